"""Token dispatchers: one interface, several ways to bring routed tokens to their experts and back (design §4).

Interface (what a schedule uses; a new dispatcher, e.g. the deduplicating one, implements the same three calls)::

    pending = dispatcher.dispatch_async(x_TD, topk_ids_TK, topk_weights_TK)   # launch Dispatch(k)
    rows = pending.wait()            # DispatchedRows: this rank's rows, local expert ids, weights
    y_RK = routed experts on rows    # (family adapter: experts(moe, rows.tokens, rows.expert_ids, rows.weights))
    done = dispatcher.combine_async(y_RD, pending)                              # launch Combine(k)
    routed_TD = done.wait()          # each token's weighted sum of its experts' outputs, in the token order

Implementations: :class:`LocalDispatcher` (EP=1, no communication), :class:`AllToAllDispatcher` (blocking, or
split-phase asynchronous: the token counts are exchanged first, then the rows go asynchronously; no host sync between
a launch and its wait), :class:`AllReduceDispatcher` (inference layout of paper Sec. 4.2: activations replicated,
experts sharded, one asynchronous all-reduce). Each counts the rows and bytes it sends (``rows_sent``,
``bytes_sent``), for the benchmarks.

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
    #: True where routing needs no exchange before the experts (the all-reduce layout): the schedule may then wait the
    #: previous layer's Combine after the whole attention instead of between its parts.
    routes_locally = False

    def _count(self, rows: int, row_bytes: int) -> None:
        self.rows_sent += rows
        self.bytes_sent += rows * row_bytes

    def reset_counters(self) -> None:
        self.rows_sent = self.bytes_sent = self.rows_received = 0

    def dispatch_async(self, x_TD, topk_ids_TK, topk_weights_TK) -> Pending:
        raise NotImplementedError

    def combine_async(self, y_RD, pending: Pending) -> Pending:
        raise NotImplementedError


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
class AllToAllDispatcher(Dispatcher):
    """One row per (token, selected expert) to the expert's rank, results back by the reverse all-to-all.

    The routing weight travels as one extra column of each row, so each family's experts apply it as they do on one
    device (Llama-4 scales the expert *input* by it). ``blocking=True`` waits every collective at once (the
    ``regular`` and ``farskip_reference`` modes); otherwise dispatch and combine are split-phase: the per-expert
    token counts are exchanged first (the one host sync of a layer, before the launch), then the rows move
    asynchronously until ``wait()``. Gradients take the reverse paths asynchronously too (:mod:`.collectives`).
    """

    group: Any = None
    num_local_experts: int = 1
    blocking: bool = False

    def _sync(self) -> bool:
        return self.blocking or sync_debug()

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
        self._count(sum(s for r, s in enumerate(send_sizes) if r != dist.get_rank(self.group)), send_RD[:1].nbytes)
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


@dataclass
class AllReduceDispatcher(Dispatcher):
    """Inference layout (paper Sec. 4.2): every rank holds the same tokens; each runs its own experts on them (other
    ranks' experts masked) and an asynchronous all-reduce sums the partial outputs. Forward only (no autograd)."""

    group: Any = None
    num_local_experts: int = 1
    blocking: bool = False
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
