"""Token dispatchers: one interface, several ways to bring routed tokens to their experts and back (design §4).

Interface (what a schedule uses; a new dispatcher, e.g. the deduplicating one, implements the same three calls)::

    pending = dispatcher.dispatch_async(x_TD, topk_ids_TK, topk_weights_TK)   # launch Dispatch(k)
    rows = pending.wait()            # DispatchedRows: this rank's rows, local expert ids, weights
    y_RK = routed experts on rows    # (family adapter: experts(moe, rows.tokens, rows.expert_ids, rows.weights))
    done = dispatcher.combine_async(y_RD, pending)                              # launch Combine(k)
    routed_TD = done.wait()          # each token's weighted sum of its experts' outputs, in the token order

Implementations: :class:`LocalDispatcher` (EP=1, no communication), :class:`AllToAllDispatcher` (blocking, or
split-phase asynchronous: the token counts are exchanged first, then the rows go asynchronously; no host sync between
a launch and its wait), :class:`DedupAllToAllDispatcher` (the same, one row per (token, destination rank): second
paper, Sec. V-A), :class:`AllReduceDispatcher` (inference layout of paper Sec. 4.2: activations replicated,
experts sharded, one asynchronous all-reduce). Each counts the rows and bytes it sends to other ranks (``rows_sent``,
``bytes_sent``: dispatch and combine together; ``dispatch_rows_sent``, ``dispatch_bytes_sent``: the dispatch alone),
for the benchmarks.

Shape suffixes: ``T`` tokens of this rank, ``K`` experts per token, ``R`` rows this rank's experts receive, ``D``
hidden size, ``P`` ranks of the expert-parallel group. Expert ``e`` lives on rank ``e // (E / P)`` as local expert
``e % (E / P)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fcsd.parallel.collectives import AllReduceHandle, Exchange, launch_all_to_all, sync_debug, wait_all_to_all
from fcsd.placement.stats import ID_BYTES


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

    def wait(self):
        if self._wait_fn is not None:
            self._result, self._wait_fn = self._wait_fn(), None
        return self._result

    @classmethod
    def done(cls, result, state: Any = None) -> Pending:
        pending = cls(None, state)
        pending._result = result
        return pending


@dataclass
class Dispatcher:
    """Base class: traffic counters shared by every implementation."""

    rows_sent: int = field(default=0, init=False)
    bytes_sent: int = field(default=0, init=False)
    rows_received: int = field(default=0, init=False)
    dispatch_rows_sent: int = field(default=0, init=False)
    dispatch_bytes_sent: int = field(default=0, init=False)
    #: True where routing needs no exchange before the experts (the all-reduce layout): the schedule may then wait the
    #: previous layer's Combine after the whole attention instead of between its parts.
    routes_locally = False

    def _count(self, rows: int, row_bytes: int, dispatch: bool = False, extra_bytes: int = 0) -> None:
        self.rows_sent += rows
        self.bytes_sent += rows * row_bytes + extra_bytes
        if dispatch:
            self.dispatch_rows_sent += rows
            self.dispatch_bytes_sent += rows * row_bytes + extra_bytes

    def reset_counters(self) -> None:
        self.rows_sent = self.bytes_sent = self.rows_received = 0
        self.dispatch_rows_sent = self.dispatch_bytes_sent = 0

    def dispatch_async(self, x_TD, topk_ids_TK, topk_weights_TK) -> Pending:
        raise NotImplementedError

    def combine_async(self, y_RD, pending: Pending) -> Pending:
        raise NotImplementedError


@dataclass
class CollectiveDispatcher(Dispatcher):
    """A dispatcher over a process group (``None``: the whole job) holding ``num_local_experts`` experts per rank;
    ``blocking`` (or ``FCSD_EP_SYNC=1``) waits every collective as soon as it is launched."""

    group: Any = None
    num_local_experts: int = 1
    blocking: bool = False

    def _sync(self) -> bool:
        return self.blocking or sync_debug()


@dataclass
class LocalDispatcher(Dispatcher):
    """Every expert on this rank (EP=1): the rows are the tokens themselves, nothing moves."""

    def dispatch_async(self, x_TD, topk_ids_TK, topk_weights_TK) -> Pending:
        return Pending.done(DispatchedRows(x_TD, topk_ids_TK, topk_weights_TK))

    def combine_async(self, y_RD, pending: Pending) -> Pending:
        return Pending.done(y_RD)


class _AllToAllState(NamedTuple):
    token_of_row: torch.Tensor  # (T*K,) the token each sent row came from, in send order
    num_tokens: int
    exchange: Exchange  # split sizes of the dispatch (the combine runs it in reverse)


@dataclass
class AllToAllDispatcher(CollectiveDispatcher):
    """One row per (token, selected expert) to the expert's rank, results back by the reverse all-to-all.

    The routing weight travels as one extra column of each row, so each family's experts apply it as they do on one
    device (Llama-4 scales the expert *input* by it). ``blocking=True`` waits every collective at once (the
    ``regular`` and ``farskip_reference`` modes); otherwise dispatch and combine are split-phase: the per-expert
    token counts are exchanged first (the one host sync of a layer, before the launch), then the rows move
    asynchronously until ``wait()``. Gradients take the reverse paths asynchronously too (:mod:`.collectives`).
    """

    def dispatch_async(self, x_TD, topk_ids_TK, topk_weights_TK) -> Pending:
        num_ranks = dist.get_world_size(self.group)
        num_tokens, top_k = topk_ids_TK.shape
        flat_ids = topk_ids_TK.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # rows grouped by expert, hence by destination rank
        token_of_row = order // top_k
        send_counts = torch.bincount(flat_ids, minlength=self.num_local_experts * num_ranks)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # counts first: sizes known on the host
        send_sizes = send_counts.view(num_ranks, -1).sum(dim=1).tolist()
        recv_counts_PE = recv_counts.view(num_ranks, -1)
        recv_sizes = recv_counts_PE.sum(dim=1).tolist()
        self.rows_received += sum(recv_sizes)
        weights = topk_weights_TK.reshape(-1, 1)[order].to(x_TD.dtype)
        send_RD = torch.cat([x_TD[token_of_row], weights], dim=1)
        exchange = Exchange(send_sizes, recv_sizes, self.group, sync=self._sync())
        recv = launch_all_to_all(send_RD, exchange)
        remote = sum(s for r, s in enumerate(send_sizes) if r != dist.get_rank(self.group))
        self._count(remote, send_RD[:1].nbytes, dispatch=True)
        local_ids = torch.arange(self.num_local_experts, device=x_TD.device).repeat(num_ranks)
        local_ids = local_ids.repeat_interleave(recv_counts_PE.reshape(-1), output_size=sum(recv_sizes))

        def wait() -> DispatchedRows:
            ready = wait_all_to_all(recv, exchange)
            tokens, weights = ready[:, :-1], ready[:, -1:]
            return DispatchedRows(tokens, local_ids.unsqueeze(1), weights)

        return Pending(wait, _AllToAllState(token_of_row, num_tokens, exchange))

    def combine_async(self, y_RD, pending: Pending) -> Pending:
        state: _AllToAllState = pending.state
        dispatched = pending.wait()
        # keep the received rows in the graph even where no expert used them, so that every rank runs the reverse
        # all-to-all in backward (an empty product adds nothing)
        y_RD = y_RD + dispatched.tokens[:, :0].sum()
        forward = state.exchange
        back = Exchange(forward.recv_sizes, forward.send_sizes, self.group, sync=self._sync())
        recv = launch_all_to_all(y_RD, back)
        self._count(sum(s for r, s in enumerate(back.send_sizes) if r != dist.get_rank(self.group)), y_RD[:1].nbytes)

        def wait() -> torch.Tensor:
            rows = wait_all_to_all(recv, back)
            out_TD = rows.new_zeros((state.num_tokens, rows.shape[1]))
            return out_TD.index_add(0, state.token_of_row, rows)

        return Pending(wait)


class _DedupState(NamedTuple):
    token_of_row: torch.Tensor  # (S,) the token each sent row came from, in send order
    num_tokens: int
    exchange: Exchange  # the payload's exchange (element counts per rank)
    send_rows: list[int]  # rows sent to each rank
    recv_rows: list[int]  # rows received from each rank
    received: dict  # filled by wait(): "rows" (R, D) received rows, "row_of_pair" (A,) row of each expanded pair


@dataclass
class DedupAllToAllDispatcher(CollectiveDispatcher):
    """One row per (token, destination rank) instead of one per (token, expert) (second paper, Sec. V-A).

    A token whose ``k`` experts live on ``g`` distinct ranks sends ``g`` rows instead of ``k``; each row carries the
    ids and weights of the token's experts on that rank. On the wire, per destination rank: its rows' hidden states,
    then one routing weight per (token, expert) pair (same dtype, autograd flows through it as in the plain
    dispatcher), in one all-to-all; the pairs' local expert ids (int32, the first pair of each row marked by a
    negative id) in a second one without autograd. The receiver expands its rows locally into the expert-major
    ``(pair, 1)`` rows the plain dispatcher delivers (same expert inputs, so the same outputs); the combine first sums
    each row's pairs into one weighted partial sum per (token, rank), then sends those back (again one row per
    (token, rank)), where each token adds its partial sums.

    Counters follow :func:`fcsd.placement.stats.dispatch_counts` (remote rows/bytes): a dispatch row costs ``D`` hidden
    values and each of its pairs an int32 id plus a weight; a combine row ``D`` values. ``blocking`` as in
    :class:`AllToAllDispatcher`.
    """

    def dispatch_async(self, x_TD, topk_ids_TK, topk_weights_TK) -> Pending:
        num_ranks, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        num_tokens, top_k = topk_ids_TK.shape
        hidden = x_TD.shape[1]
        flat_ids = topk_ids_TK.reshape(-1)
        dest = flat_ids // self.num_local_experts
        token = torch.arange(num_tokens, device=x_TD.device).repeat_interleave(top_k)
        key = dest * num_tokens + token
        order = torch.argsort(key, stable=True)  # pairs grouped by destination rank, then token, then slot
        sorted_key = key[order]
        first = torch.ones_like(sorted_key, dtype=torch.bool)
        first[1:] = sorted_key[1:] != sorted_key[:-1]  # the first pair of each (token, rank) row
        row_keys = sorted_key[first]
        token_of_row = row_keys % max(num_tokens, 1)
        counts = torch.stack(
            [
                torch.bincount(row_keys // max(num_tokens, 1), minlength=num_ranks),
                torch.bincount(dest, minlength=num_ranks),
            ],
            dim=1,
        ).reshape(-1)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # (rows, pairs) per rank: sizes on the host
        send_rows, send_pairs = counts.view(num_ranks, 2).t().tolist()
        recv_rows, recv_pairs = recv_counts.view(num_ranks, 2).t().tolist()
        self.rows_received += sum(recv_rows)

        weights = topk_weights_TK.reshape(-1)[order].to(x_TD.dtype)
        pieces = []
        for rows_part, weights_part in zip(x_TD[token_of_row].split(send_rows), weights.split(send_pairs)):
            pieces += [rows_part.reshape(-1), weights_part]
        exchange = Exchange(
            [n * hidden + a for n, a in zip(send_rows, send_pairs)],
            [n * hidden + a for n, a in zip(recv_rows, recv_pairs)],
            self.group,
            sync=self._sync(),
        )
        recv = launch_all_to_all(torch.cat(pieces), exchange)
        local = (flat_ids[order] % self.num_local_experts).to(torch.int32)
        send_ids = torch.where(first, -local - 1, local)
        recv_ids = send_ids.new_empty(sum(recv_pairs))
        ids_work = dist.all_to_all_single(recv_ids, send_ids, recv_pairs, send_pairs, group=self.group, async_op=True)
        if self._sync():
            ids_work.wait()
        remote_rows = sum(n for r, n in enumerate(send_rows) if r != rank)
        remote_pairs = sum(a for r, a in enumerate(send_pairs) if r != rank)
        elem = x_TD.element_size()
        self._count(remote_rows, hidden * elem, dispatch=True, extra_bytes=remote_pairs * (ID_BYTES + elem))
        state = _DedupState(token_of_row, num_tokens, exchange, send_rows, recv_rows, {})

        def wait() -> DispatchedRows:
            ready = wait_all_to_all(recv, exchange)
            ids_work.wait()
            send_ids.numel()  # the send buffer lives until here
            parts = ready.split([size for n, a in zip(recv_rows, recv_pairs) for size in (n * hidden, a)])
            rows_RD = torch.cat([part.view(-1, hidden) for part in parts[0::2]])
            weights_A = torch.cat(parts[1::2])
            starts = recv_ids < 0
            local_A = torch.where(starts, -recv_ids - 1, recv_ids).long()
            row_of_pair = torch.cumsum(starts, 0) - 1
            expert_major = torch.argsort(local_A, stable=True)  # expand locally, grouped by expert
            row_of_pair = row_of_pair[expert_major]
            # keep every received value in the graph, so that every rank runs the reverse all-to-all in backward
            state.received.update(rows=rows_RD, row_of_pair=row_of_pair, anchor=ready[:0].sum())
            return DispatchedRows(
                rows_RD[row_of_pair], local_A[expert_major].unsqueeze(1), weights_A[expert_major].unsqueeze(1)
            )

        return Pending(wait, state)

    def combine_async(self, y_RD, pending: Pending) -> Pending:
        state: _DedupState = pending.state
        pending.wait()
        received = state.received
        partial = y_RD.new_zeros((received["rows"].shape[0], y_RD.shape[1])).index_add(0, received["row_of_pair"], y_RD)
        partial = partial + received["anchor"]
        back = Exchange(state.recv_rows, state.send_rows, self.group, sync=self._sync())
        recv = launch_all_to_all(partial, back)
        rank = dist.get_rank(self.group)
        self._count(sum(n for r, n in enumerate(back.send_sizes) if r != rank), y_RD.shape[1] * y_RD.element_size())

        def wait() -> torch.Tensor:
            rows = wait_all_to_all(recv, back)
            out_TD = rows.new_zeros((state.num_tokens, rows.shape[1]))
            return out_TD.index_add(0, state.token_of_row, rows)

        return Pending(wait)


@dataclass
class AllReduceDispatcher(CollectiveDispatcher):
    """Inference layout (paper Sec. 4.2): every rank holds the same tokens; each runs its own experts on them (other
    ranks' experts masked) and an asynchronous all-reduce sums the partial outputs. Forward only (no autograd)."""

    routes_locally = True

    def dispatch_async(self, x_TD, topk_ids_TK, topk_weights_TK) -> Pending:
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
        handle = AllReduceHandle(y_RD, self.group, sync=self.blocking or None)
        self._count(y_RD.shape[0], y_RD[:1].nbytes)
        return Pending(handle.wait)
