"""Token dispatchers: one interface, several ways to bring routed tokens to their experts and back (design §4).

Interface (what a schedule uses; a new dispatcher implements the same three calls)::

    pending = dispatcher.dispatch_async(x_TD, topk_ids_TK, topk_weights_TK)   # launch Dispatch(k)
    rows = pending.wait()            # DispatchedRows: this rank's rows, local expert ids, weights
    y_RD = routed experts on rows    # (family adapter: experts(moe, rows.tokens, rows.expert_ids, rows.weights))
    done = dispatcher.combine_async(y_RD, pending)                              # launch Combine(k)
    routed_TD = done.wait()          # each token's weighted sum of its experts' outputs, in the token order

``dispatch_async`` also takes ``scale_inputs`` (the family weights the expert *input*, Llama-4) and
``needs_backward`` (default: grad mode; schedules pass :func:`fcsd.parallel.collectives.needs_backward`).

What every collective dispatcher guarantees (paper Sec. 4; issue-level requirements of a GPU run):

- **One host synchronisation per layer**: the per-expert counts are exchanged on the device and read back once
  (send and receive sizes in one ``tolist``); everything else (grouping by expert, local ids, un-permuting) uses
  sizes known on the host or static bounds, no ``bincount``/``nonzero``/``unique``/masked indexing.
- **Routing weights stay in fp32 on the token's own rank**: the experts run with unit weights, and the combine sums
  each token's expert outputs weighted in fp32, in fixed slots (no atomic ``index_add``), so results are
  deterministic. A family that weights the expert *input* (Llama-4) has its rows scaled in fp32 before they leave.
  The deduplicating dispatcher, whose receiver sums a row's experts before sending back, ships the weights as fp32;
  its per-(token, rank) partial sums (fp32) are rounded once to the compute dtype for the way back.
- **Rows on the wire in the compute dtype**: under autocast the hidden rows travel in the autocast dtype (bf16), not
  in the fp32 of the master weights; the expert outputs likewise.

Implementations: :class:`LocalDispatcher` (EP=1, no communication), :class:`AllToAllDispatcher` (blocking, or
split-phase asynchronous: the token counts are exchanged first, then the rows go asynchronously; no host sync between
a launch and its wait), :class:`DedupAllToAllDispatcher` (the same, one row per (token, destination rank): second
paper, Sec. V-A), :class:`AllReduceDispatcher` (inference layout of paper Sec. 4.2: activations replicated,
experts sharded, one asynchronous all-reduce). Each counts the rows and bytes it sends to other ranks (``rows_sent``,
``bytes_sent``: dispatch and combine together; ``dispatch_rows_sent``, ``dispatch_bytes_sent``: the dispatch alone),
for the benchmarks.

Shape suffixes: ``T`` tokens of this rank, ``K`` experts per token, ``R`` rows this rank's experts receive, ``A``
(token, expert) pairs, ``D`` hidden size, ``P`` ranks of the expert-parallel group. Expert ``e`` lives on rank
``e // (E / P)`` as local expert ``e % (E / P)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fcsd.parallel import recompute
from fcsd.parallel.collectives import (
    AllReduceHandle,
    Exchange,
    OrderChain,
    exchange_counts,
    launch_all_to_all,
    received,
    sync_debug,
    wait_all_to_all,
)
from fcsd.placement.stats import ID_BYTES, WEIGHT_BYTES


class DispatchedRows(NamedTuple):
    """The rows this rank's experts compute (``rows_received`` counts them): ``tokens`` (R, D), ``expert_ids``
    (R, k) local ids, ``weights`` (R, k). Ids ``>= experts held`` are skipped by the experts."""

    tokens: torch.Tensor
    expert_ids: torch.Tensor
    weights: torch.Tensor


class Pending:
    """A launched collective (or a finished local step): ``wait()`` returns its result (idempotent)."""

    def __init__(self, wait_fn, state: Any = None):
        self._wait_fn, self._result, self.state = wait_fn, None, state
        self._function = wait_fn

    def wait(self):
        if self._wait_fn is not None:
            self._result, self._wait_fn = self._wait_fn(), None
        return self._result

    def rerun(self):
        """Run the wait again, for the recomputation of a checkpointed layer (:mod:`fcsd.parallel.recompute`): the
        collective is not waited twice, its post-processing is rebuilt."""
        return self._function() if self._function is not None else self._result

    @classmethod
    def done(cls, result, state: Any = None) -> Pending:
        pending = cls(None, state)
        pending._result = result
        return pending


def wire_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype rows travel in: the autocast dtype where autocast is on for ``x``'s device, else ``x``'s own."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind) and x.is_floating_point():
        return torch.get_autocast_dtype(kind)
    return x.dtype


class _Weighted(torch.autograd.Function):
    """``rows_ND * weights_N`` in fp32, keeping for backward the rows in their own (compute) dtype, not an fp32 copy
    of them (the same values: the upcast is exact)."""

    @staticmethod
    def forward(ctx, rows_ND, weights_N):
        ctx.save_for_backward(rows_ND, weights_N)
        return rows_ND.float() * weights_N.float().unsqueeze(1)

    @staticmethod
    def backward(ctx, grad_ND):
        rows_ND, weights_N = ctx.saved_tensors
        grad_rows = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_rows = (grad_ND * weights_N.float().unsqueeze(1)).to(rows_ND.dtype)
        if ctx.needs_input_grad[1]:
            grad_weights = (grad_ND * rows_ND.float()).sum(dim=1).to(weights_N.dtype)
        return grad_rows, grad_weights


def weighted(rows_ND: torch.Tensor, weights_N: torch.Tensor) -> torch.Tensor:
    """Each row times its routing weight, in fp32; backward keeps the rows in the dtype they came in (bf16 under
    autocast: half what an fp32 copy of the ``(T, K, D)`` rows would hold until the backward)."""
    return _Weighted.apply(rows_ND, weights_N)


def slot_sum(values_ND: torch.Tensor, segment_N: torch.Tensor, num_segments: int, width: int, ordered=False):
    """Deterministic fp32 sum of ``values_ND`` rows per segment id (at most ``width`` rows per segment): each row is
    put in its own slot of a dense ``(num_segments, width, D)`` fp32 buffer (unique slots: no atomics), then the slots
    are summed. ``ordered``: the segment ids are already non-decreasing. No host synchronisation."""
    count, hidden = values_ND.shape
    if not ordered:
        order = torch.argsort(segment_N, stable=True)
        segment_N, values_ND = segment_N[order], values_ND[order]
    position = torch.arange(count, device=values_ND.device)
    starts = torch.ones_like(segment_N, dtype=torch.bool)
    starts[1:] = segment_N[1:] != segment_N[:-1]
    slot = position - torch.cummax(torch.where(starts, position, 0), dim=0).values
    dense = values_ND.new_zeros((num_segments, width, hidden), dtype=torch.float32)
    dense = dense.index_put((segment_N, slot), values_ND.float())
    return dense.sum(dim=1)


def rows_by_destination(dest_A: torch.Tensor, item_A: torch.Tensor, num_items: int):
    """(item, destination) pairs sorted by destination, then item (stable: then slot), and a mark on the first pair
    of each (item, destination) row. Returns ``(order, dest_sorted, item_sorted, first)``. No host sync."""
    order = torch.argsort(dest_A * num_items + item_A, stable=True)
    dest_sorted, item_sorted = dest_A[order], item_A[order]
    first = torch.ones_like(order, dtype=torch.bool)
    first[1:] = (dest_sorted[1:] != dest_sorted[:-1]) | (item_sorted[1:] != item_sorted[:-1])
    return order, dest_sorted, item_sorted, first


def item_of_row(first: torch.Tensor, item_sorted: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The item each of the ``num_rows`` rows marked by ``first`` stands for (``num_rows`` known on the host: no
    masked indexing); later pairs of a row write a spare slot."""
    row_slot = torch.where(first, torch.cumsum(first, 0) - 1, num_rows)
    return item_sorted.new_empty(num_rows + 1).index_put((row_slot,), item_sorted)[:num_rows]


def marked_pairs(weights_A: torch.Tensor, local_ids_A: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """The ``(A, 2)`` fp32 pairs that travel beside deduplicated rows: routing weight (autograd flows through it) and
    the receiver's expert id, negative (``-id - 1``) on the first pair of each row."""
    ids = local_ids_A.float()
    return torch.stack([weights_A.float(), torch.where(first, -ids - 1, ids)], 1)


def expand_rows(rows_RD: torch.Tensor, pairs_A2: torch.Tensor, scale_inputs: bool) -> tuple[DispatchedRows, dict]:
    """A receiver's deduplicated rows expanded into the expert-major rows the plain dispatcher delivers (same expert
    inputs, so the same outputs), Llama-4's input scaling applied here; returns them and what :func:`row_partials`
    needs to sum each row's experts on the way back."""
    ids = pairs_A2[:, 1].detach()
    starts = ids < 0
    local_A = torch.where(starts, -ids - 1, ids).long()
    row_of = torch.cumsum(starts, 0) - 1
    expert_major = torch.argsort(local_A, stable=True)  # grouped by expert
    weights_A = pairs_A2[:, 0]
    inputs = rows_RD[row_of[expert_major]]
    if scale_inputs:
        inputs = (inputs.float() * weights_A[expert_major].unsqueeze(1)).to(rows_RD.dtype)
    got = {"rows": rows_RD.shape[0], "row_of": row_of, "order": expert_major, "weights": None}
    if not scale_inputs:
        got["weights"] = weights_A
    ids_R1 = local_A[expert_major].unsqueeze(1)
    return DispatchedRows(inputs, ids_R1, torch.ones_like(ids_R1, dtype=inputs.dtype)), got


def row_partials(y_RD: torch.Tensor, got: dict, width: int) -> torch.Tensor:
    """Each received row's weighted sum of its experts' outputs (fp32 sums in fixed slots, ``width`` experts at most
    per row), rounded once to the wire dtype: what goes back, one row per received row."""
    pairs_AD = y_RD.new_empty(y_RD.shape).index_put((got["order"],), y_RD)  # back to receive order
    pairs_AD = pairs_AD.float() if got["weights"] is None else weighted(pairs_AD, got["weights"])
    return slot_sum(pairs_AD, got["row_of"], got["rows"], width, ordered=True).to(wire_dtype(y_RD))


@dataclass
class Dispatcher:
    """Base class: traffic counters shared by every implementation."""

    rows_sent: int = field(default=0, init=False)
    bytes_sent: int = field(default=0, init=False)
    rows_received: int = field(default=0, init=False)
    dispatch_rows_sent: int = field(default=0, init=False)
    dispatch_bytes_sent: int = field(default=0, init=False)
    #: of the above, what crossed to another node (``rows_sent - inter_rows_sent`` stayed inside the node)
    inter_rows_sent: int = field(default=0, init=False)
    inter_bytes_sent: int = field(default=0, init=False)
    dispatch_inter_rows_sent: int = field(default=0, init=False)
    dispatch_inter_bytes_sent: int = field(default=0, init=False)
    #: True where routing needs no exchange before the experts (the all-reduce layout): the schedule may then wait the
    #: previous layer's Combine after the whole attention instead of between its parts.
    routes_locally = False

    def _count(
        self, rows: int, row_bytes: int, dispatch: bool = False, extra_bytes: int = 0, inter: tuple = (0, 0)
    ) -> None:
        """Count ``rows`` of ``row_bytes`` (plus ``extra_bytes``) sent to other ranks, ``inter`` = (rows, bytes) of
        them to other nodes."""
        if recompute.replaying():  # a checkpointed layer's recomputation sends nothing
            return
        sent = rows * row_bytes + extra_bytes
        self.rows_sent += rows
        self.bytes_sent += sent
        self.inter_rows_sent += inter[0]
        self.inter_bytes_sent += inter[1]
        if dispatch:
            self.dispatch_rows_sent += rows
            self.dispatch_bytes_sent += sent
            self.dispatch_inter_rows_sent += inter[0]
            self.dispatch_inter_bytes_sent += inter[1]

    def _received(self, rows: int) -> None:
        if not recompute.replaying():
            self.rows_received += rows

    def reset_counters(self) -> None:
        self.rows_sent = self.bytes_sent = self.rows_received = 0
        self.dispatch_rows_sent = self.dispatch_bytes_sent = 0
        self.inter_rows_sent = self.inter_bytes_sent = self.dispatch_inter_rows_sent = (
            self.dispatch_inter_bytes_sent
        ) = 0

    def dispatch_async(self, x_TD, topk_ids_TK, topk_weights_TK, scale_inputs=False, needs_backward=None) -> Pending:
        raise NotImplementedError

    def combine_async(self, y_RD, pending: Pending) -> Pending:
        raise NotImplementedError


@dataclass
class CollectiveDispatcher(Dispatcher):
    """A dispatcher over a process group (``None``: the whole job) holding ``num_local_experts`` experts per rank;
    ``blocking`` (or ``FCSD_EP_SYNC=1``) waits every collective as soon as it is launched. ``node_size``: ranks of
    the group per node (consecutive ranks; 0: the whole group is one node), for the counters of rows crossing nodes."""

    group: Any = None
    num_local_experts: int = 1
    blocking: bool = False
    node_size: int = 0
    serial: int = field(default=0, init=False)  # exchanges issued so far: the same on every rank
    chain: OrderChain = field(default_factory=OrderChain, init=False)

    def _sync(self) -> bool:
        return self.blocking or sync_debug()

    def _next(self) -> int:
        self.serial += 1
        return self.serial

    def _exchange(self, send_sizes, recv_sizes, kind: str) -> Exchange:
        return Exchange(send_sizes, recv_sizes, self.group, sync=self._sync(), kind=kind, serial=self._next())

    def _count_sizes(
        self, sizes, row_bytes, dispatch=False, pair_sizes=None, pair_bytes=0, group=None, node_of=None
    ) -> None:
        """Count one exchange over ``group`` (default: the dispatcher's): ``sizes[r]`` rows of ``row_bytes`` (and
        ``pair_sizes[r]`` routing pairs of ``pair_bytes``) to rank ``r``; ``node_of(r)`` the node of rank ``r``
        (default: consecutive ``node_size`` ranks a node)."""
        group = self.group if group is None else group
        rank = dist.get_rank(group)
        if node_of is None:
            per_node = self.node_size or dist.get_world_size(group)
            node_of = lambda r: r // per_node  # noqa: E731
        pair_sizes = pair_sizes or [0] * len(sizes)
        rows = inter_rows = sent = inter_bytes = 0
        for r, (count, pairs) in enumerate(zip(sizes, pair_sizes)):
            if r == rank:
                continue
            size = count * row_bytes + pairs * pair_bytes
            rows, sent = rows + count, sent + size
            if node_of(r) != node_of(rank):
                inter_rows, inter_bytes = inter_rows + count, inter_bytes + size
        self._count(rows, row_bytes, dispatch, sent - rows * row_bytes, (inter_rows, inter_bytes))

    def _chain(self, needs_backward) -> OrderChain | None:
        return self.chain if (torch.is_grad_enabled() if needs_backward is None else needs_backward) else None


@dataclass
class LocalDispatcher(Dispatcher):
    """Every expert on this rank (EP=1): the rows are the tokens themselves, nothing moves."""

    def dispatch_async(self, x_TD, topk_ids_TK, topk_weights_TK, scale_inputs=False, needs_backward=None) -> Pending:
        return Pending.done(DispatchedRows(x_TD, topk_ids_TK, topk_weights_TK))

    def combine_async(self, y_RD, pending: Pending) -> Pending:
        return Pending.done(y_RD)


def _split_sizes(send_counts: torch.Tensor, recv_counts: torch.Tensor, num_ranks: int) -> tuple[list, list]:
    """Per-rank send and receive sizes from per-(rank, j) device counts: the layer's one device-to-host copy."""
    sizes = torch.stack([send_counts.view(num_ranks, -1).sum(dim=1), recv_counts.view(num_ranks, -1).sum(dim=1)])
    send_sizes, recv_sizes = sizes.tolist()
    return send_sizes, recv_sizes


class _AllToAllState(NamedTuple):
    order: torch.Tensor  # (T*K,) the (token, slot) pair each sent row came from, in send order
    shape: tuple[int, int]  # (T, K)
    weights_TK: torch.Tensor | None  # fp32 routing weights applied at the combine (None: applied to the inputs)
    out_dtype: torch.dtype
    exchange: Exchange  # split sizes of the dispatch (the combine runs it in reverse)


@dataclass
class AllToAllDispatcher(CollectiveDispatcher):
    """One row per (token, selected expert) to the expert's rank, results back by the reverse all-to-all.

    ``blocking=True`` waits every collective at once (the ``regular`` and ``farskip_reference`` modes); otherwise
    dispatch and combine are split-phase: the per-expert token counts are exchanged first (the one host sync of a
    layer, before the launch), then the rows move asynchronously until ``wait()``. Gradients take the reverse paths
    asynchronously too (:mod:`.collectives`).
    """

    def dispatch_async(self, x_TD, topk_ids_TK, topk_weights_TK, scale_inputs=False, needs_backward=None) -> Pending:
        num_ranks = dist.get_world_size(self.group)
        top_k = topk_ids_TK.shape[1]
        flat_ids = topk_ids_TK.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # rows grouped by expert, hence by destination rank
        token_of_row = order // top_k
        send_counts = torch.zeros(self.num_local_experts * num_ranks, dtype=torch.int64, device=flat_ids.device)
        send_counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        recv_counts = exchange_counts(send_counts, self.group, self._next())
        send_sizes, recv_sizes = _split_sizes(send_counts, recv_counts, num_ranks)
        self._received(sum(recv_sizes))
        wire = wire_dtype(x_TD)
        weights_TK = topk_weights_TK.float()
        if scale_inputs:  # Llama-4: the expert input is the token scaled by its routing weight, in fp32
            send_RD = (x_TD[token_of_row].float() * weights_TK.reshape(-1, 1)[order]).to(wire)
        else:
            send_RD = x_TD.to(wire)[token_of_row]
        exchange = self._exchange(send_sizes, recv_sizes, "dispatch")
        launch_all_to_all(send_RD, exchange, self._chain(needs_backward))  # the wait reads it back: received()
        self._count_sizes(send_sizes, send_RD[:1].nbytes, dispatch=True)
        local_ids = torch.arange(self.num_local_experts, device=x_TD.device).repeat(num_ranks)
        local_ids = local_ids.repeat_interleave(recv_counts, output_size=sum(recv_sizes)).unsqueeze(1)

        def wait() -> DispatchedRows:
            ready = wait_all_to_all(received(exchange), exchange)
            return DispatchedRows(ready, local_ids, torch.ones_like(local_ids, dtype=ready.dtype))

        state = _AllToAllState(
            order, tuple(topk_ids_TK.shape), None if scale_inputs else weights_TK, x_TD.dtype, exchange
        )
        return Pending(wait, state)

    def combine_async(self, y_RD, pending: Pending) -> Pending:
        state: _AllToAllState = pending.state
        pending.wait()
        forward = state.exchange
        back = self._exchange(forward.recv_sizes, forward.send_sizes, "combine")
        y_RD = y_RD.to(wire_dtype(y_RD))
        launch_all_to_all(y_RD, back, forward.chain, wait_after=forward)
        self._count_sizes(back.send_sizes, y_RD[:1].nbytes)

        def wait() -> torch.Tensor:
            rows = wait_all_to_all(received(back), back)
            pairs = rows.new_empty(rows.shape).index_put((state.order,), rows)  # back to (token, slot) order
            if state.weights_TK is None:
                pairs_TKD = pairs.view(*state.shape, rows.shape[1]).float()
            else:  # fp32 products and sum; backward keeps the rows in the wire dtype
                pairs_TKD = weighted(pairs, state.weights_TK.reshape(-1)).view(*state.shape, rows.shape[1])
            return pairs_TKD.sum(dim=1).to(state.out_dtype)

        return Pending(wait)


class _DedupState(NamedTuple):
    token_of_row: torch.Tensor  # (S,) the token each sent row came from, in send order
    num_tokens: int
    top_k: int
    out_dtype: torch.dtype
    exchanges: tuple  # (rows exchange, pairs exchange)
    received: dict  # filled by wait(): the receiver's rows, pairs and how to sum them


@dataclass
class DedupAllToAllDispatcher(CollectiveDispatcher):
    """One row per (token, destination rank) instead of one per (token, expert) (second paper, Sec. V-A).

    A token whose ``k`` experts live on ``g`` distinct ranks sends ``g`` rows instead of ``k``. Per destination rank,
    two all-to-alls: the rows' hidden states (compute dtype), and one fp32 ``(weight, local expert id)`` pair per
    (token, expert) (the first pair of each row marked by a negative id; autograd flows through the weights). The
    receiver expands its rows locally into the expert-major rows the plain dispatcher delivers (same expert inputs,
    so the same outputs), sums each row's weighted expert outputs in fp32 into one partial sum per (token, rank) and
    sends those back (again one row per (token, rank)), where each token adds its partial sums in fp32. Llama-4's
    input scaling is applied by the receiver after expansion. Deterministic: every sum fills unique slots.

    Counters follow :func:`fcsd.placement.stats.dispatch_counts` (remote rows/bytes): a dispatch row costs ``D`` hidden
    values and each of its pairs an id plus an fp32 weight; a combine row ``D`` values. ``blocking`` as in
    :class:`AllToAllDispatcher`.
    """

    def dispatch_async(self, x_TD, topk_ids_TK, topk_weights_TK, scale_inputs=False, needs_backward=None) -> Pending:
        num_ranks = dist.get_world_size(self.group)
        num_tokens, top_k = topk_ids_TK.shape
        hidden, device, local = x_TD.shape[1], x_TD.device, self.num_local_experts
        flat_ids = topk_ids_TK.reshape(-1)
        token = torch.arange(num_tokens, device=device).repeat_interleave(top_k, output_size=num_tokens * top_k)
        order, dest_sorted, token_sorted, first = rows_by_destination(flat_ids // local, token, num_tokens)
        counts = torch.zeros(num_ranks, 2, dtype=torch.int64, device=device)
        counts[:, 0].scatter_add_(0, dest_sorted, first.long())
        counts[:, 1].scatter_add_(0, dest_sorted, torch.ones_like(dest_sorted))
        recv_counts = exchange_counts(counts.reshape(-1), self.group, self._next()).view(num_ranks, 2)
        sizes = torch.cat([counts, recv_counts], dim=1).t().tolist()  # the layer's one device-to-host copy
        send_rows, send_pairs, recv_rows, recv_pairs = sizes
        self._received(sum(recv_rows))
        token_of_row = item_of_row(first, token_sorted, sum(send_rows))
        pairs_A2 = marked_pairs(topk_weights_TK.reshape(-1)[order], flat_ids[order] % local, first)
        send_RD = x_TD.to(wire_dtype(x_TD))[token_of_row]
        chain = self._chain(needs_backward)
        rows_exchange = self._exchange(send_rows, recv_rows, "dispatch")
        pairs_exchange = self._exchange(send_pairs, recv_pairs, "ids")
        launch_all_to_all(send_RD, rows_exchange, chain)  # the wait reads the buffers back: received()
        launch_all_to_all(pairs_A2, pairs_exchange, chain)
        self._count_sizes(send_rows, hidden * send_RD.element_size(), True, send_pairs, ID_BYTES + WEIGHT_BYTES)
        state = _DedupState(token_of_row, num_tokens, top_k, x_TD.dtype, (rows_exchange, pairs_exchange), {})

        def wait() -> DispatchedRows:
            rows_RD = wait_all_to_all(received(rows_exchange), rows_exchange)
            pairs = wait_all_to_all(received(pairs_exchange), pairs_exchange)
            rows, got = expand_rows(rows_RD, pairs, scale_inputs)
            state.received.update(got)
            return rows

        return Pending(wait, state)

    def combine_async(self, y_RD, pending: Pending) -> Pending:
        state: _DedupState = pending.state
        pending.wait()
        partial = row_partials(y_RD, state.received, min(state.top_k, self.num_local_experts))
        rows_exchange = state.exchanges[0]
        back = self._exchange(rows_exchange.recv_sizes, rows_exchange.send_sizes, "combine")
        launch_all_to_all(partial, back, rows_exchange.chain, wait_after=rows_exchange)
        self._count_sizes(back.send_sizes, partial.shape[1] * partial.element_size())

        def wait() -> torch.Tensor:
            rows = wait_all_to_all(received(back), back)
            width = min(state.top_k, dist.get_world_size(self.group))  # most rows one token sends
            return slot_sum(rows, state.token_of_row, state.num_tokens, width).to(state.out_dtype)

        return Pending(wait)


@dataclass
class AllReduceDispatcher(CollectiveDispatcher):
    """Inference layout (paper Sec. 4.2): every rank holds the same tokens; each runs its own experts on them (other
    ranks' experts masked) and an asynchronous all-reduce sums the partial outputs. Forward only (no autograd)."""

    routes_locally = True

    def dispatch_async(self, x_TD, topk_ids_TK, topk_weights_TK, scale_inputs=False, needs_backward=None) -> Pending:
        if torch.is_grad_enabled() and x_TD.requires_grad:
            raise RuntimeError(
                'layout="all_reduce" is the inference layout (no backward): run it under torch.no_grad() / '
                'torch.inference_mode(), or use layout="all_to_all" for training'
            )
        rank = dist.get_rank(self.group)
        held_here = topk_ids_TK // self.num_local_experts == rank
        local_ids = torch.where(held_here, topk_ids_TK % self.num_local_experts, self.num_local_experts)
        return Pending.done(DispatchedRows(x_TD, local_ids, topk_weights_TK.masked_fill(~held_here, 0.0)))

    def combine_async(self, y_RD, pending: Pending) -> Pending:
        handle = AllReduceHandle(y_RD, self.group, sync=self.blocking or None, serial=self._next())
        self._count(y_RD.shape[0], y_RD[:1].nbytes)
        return Pending(handle.wait)
