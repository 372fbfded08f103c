"""Async-safe autograd collectives for expert parallelism (paper Appendix C; design §4).

An all-to-all is split into two autograd nodes, *launch* and *wait*, so that other work can run between them in the
forward **and** in the backward:

- forward: ``launch`` starts the all-to-all and returns the (not yet filled) receive buffer; ``wait`` waits for it.
- backward, in reverse: ``wait``'s backward *launches* the reverse all-to-all of the incoming gradient; ``launch``'s
  backward *waits* for it right before the gradient is consumed by the node that produced the send buffer.

**Collective order in backward is structural.** NCCL needs every rank to issue its collectives in the same order.
Data dependencies alone do not guarantee it (two forwards summed into one loss give autograd two independent chains
it may interleave differently per rank; a rank whose rows need no gradient would skip a reverse exchange the others
issue). So when a forward needs a backward (:func:`needs_backward`), every launch and wait node also takes and returns
a scalar *order token* (:class:`OrderChain`): each node depends on the one created before it, and autograd must run
their backwards, hence issue the reverse all-to-alls, in exactly the reverse of the forward order, on every rank,
whatever the data needs. Launch and wait nodes are recorded even where no input requires a gradient.

Autograd node priorities: the engine runs ready nodes by decreasing sequence number. Where the installed torch lets a
node's number be re-assigned (``grad_fn._set_sequence_nr``, torch >= 2.1), the reverse launch gets the highest number
(issued as soon as its gradient is ready) and the reverse wait the lowest (run only when nothing else is ready),
except a Combine's, placed right below the nodes created after its Dispatch's launch (see :func:`launch_all_to_all`).
Fallback where it is missing: the forward creation order (:data:`REPRIORITISES` says which one is in use).

Debugging switches (environment): ``FCSD_EP_SYNC=1`` makes every wait immediate (forward and backward; results must
not change); ``FCSD_EP_CHECK_ORDER=1`` makes every rank compare, before each collective, what it is about to issue
with the other ranks of the group (phase, exchange number, kind) and raise a ``RuntimeError`` naming both sides on a
mismatch, instead of hanging or exchanging the wrong buffers.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from fcsd.parallel import recompute
from fcsd.parallel.events import record

_SEQUENCE_NR_MAX = 2**62  # above any sequence number a process creates, below uint64 overflow


def _probe_set_sequence_nr() -> bool:
    probe = torch.zeros(1, requires_grad=True) * 1
    return hasattr(probe.grad_fn, "_set_sequence_nr") and hasattr(probe.grad_fn, "_sequence_nr")


REPRIORITISES = _probe_set_sequence_nr()

#: seconds this process spent blocked in all-to-all waits, per phase (read by the overlap benchmark on gloo; on NCCL
#: a wait only orders the GPU streams and returns at once, so the benchmark reads exposure from a profiler trace)
WAIT_SECONDS = {"forward": 0.0, "backward": 0.0}
PHASES = ("forward", "backward")
KINDS = ("counts", "dispatch", "combine", "all_reduce", "ids")
#: a :class:`fcsd.bench.modelled_link.ModelledLink` every collective of this module goes through (``fcsd bench overlap
#: --link``); None: the real transport alone
LINK = None


def _remote_rows(sizes: list[int], group) -> int:
    rank = dist.get_rank(group)
    return sum(size for r, size in enumerate(sizes) if r != rank)


def _timed_wait(work, phase: str) -> None:
    start = time.perf_counter()
    work.wait()
    WAIT_SECONDS[phase] += time.perf_counter() - start


def sync_debug() -> bool:
    """Whether ``FCSD_EP_SYNC=1`` asks every collective to be waited for as soon as it is launched."""
    return os.environ.get("FCSD_EP_SYNC", "0") not in ("", "0")


def order_debug() -> bool:
    """Whether ``FCSD_EP_CHECK_ORDER=1`` asks every rank to check the collective order against the others."""
    return os.environ.get("FCSD_EP_CHECK_ORDER", "0") not in ("", "0")


def check_order(group, phase: str, kind: str, serial: int, device) -> None:
    """Under ``FCSD_EP_CHECK_ORDER=1``: all ranks of ``group`` compare the collective they are about to issue."""
    if not order_debug():
        return
    mine = torch.tensor([PHASES.index(phase), KINDS.index(kind), serial], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    if any(not torch.equal(other, mine) for other in every):

        def name(t):
            p, k, s = t.tolist()
            return f"{PHASES[p]} {KINDS[k]} #{s}"

        ranks = ", ".join(f"rank {r}: {name(t)}" for r, t in enumerate(every))
        raise RuntimeError(
            f"expert-parallel collectives out of order across ranks ({ranks}): every rank must run the same "
            "forwards and backwards in the same order (backpropagate every training forward, all ranks alike)"
        )


def needs_backward(module: torch.nn.Module) -> bool:
    """Whether a forward through ``module`` must prepare the backward's collectives: grad mode is on and the module
    trains or has trainable parameters. Both are the same on every rank (unlike whether some rank's rows require a
    gradient), so every rank records the same launch/wait nodes."""
    if not torch.is_grad_enabled():
        return False
    return module.training or any(p.requires_grad for p in module.parameters())


class OrderChain:
    """The order token threaded through every exchange of one dispatcher (see the module docstring).

    A chain lasts until a backward runs through it; the next exchange then starts a new one. Forwards made before
    that backward join the same chain and must be backpropagated together (sum their losses), as under DDP. A
    forward that is never backpropagated (an evaluation outside ``torch.no_grad()`` on a trainable model) keeps its
    graph alive through the chain: past :data:`LONG_CHAIN` exchanges without a backward this warns once."""

    LONG_CHAIN = 4096

    def __init__(self):
        self.token = None
        self.consumed = True
        self.links = 0

    def take(self, device) -> torch.Tensor:
        if self.consumed or self.token is None:
            self.token, self.consumed, self.links = torch.zeros((), device=device, requires_grad=True), False, 0
        self.links += 1
        if self.links == self.LONG_CHAIN:
            import warnings

            warnings.warn(
                f"{self.LONG_CHAIN} expert-parallel exchanges joined one backward chain with no backward through it: "
                "their graphs stay in memory until one runs; run forwards you do not backpropagate (evaluation) "
                "under torch.no_grad()",
                stacklevel=3,
            )
        return self.token

    def put(self, token: torch.Tensor) -> None:
        self.token = token


class Exchange:
    """One all-to-all between the ranks of ``group`` and its reverse: split sizes and the pending work handles.

    ``send_sizes[r]`` rows go to rank ``r``; ``recv_sizes[r]`` rows come from it (host lists, known before launch).
    ``kind`` and ``serial`` name it in the order check and the event log.
    """

    def __init__(
        self,
        send_sizes: list[int],
        recv_sizes: list[int],
        group,
        sync: bool | None = None,
        kind: str = "dispatch",
        serial: int = 0,
    ):
        self.send_sizes, self.recv_sizes, self.group = send_sizes, recv_sizes, group
        self.sync = sync_debug() if sync is None else sync
        self.kind, self.serial = kind, serial
        self.work = self.reverse_work = None
        self.keep_alive = ()  # send buffers must outlive the asynchronous collective
        self.reverse_grad = None
        self.replay_log = None  # the checkpointed layer's log that recorded the receive buffer
        self.received = None  # the receive buffer (or its host copy under train.checkpoint_offload): see received()
        self.sequence_nr = None  # of its launch node, before re-numbering (see launch_all_to_all)
        # whether a checkpointed layer's recomputation reads its rows' values (False: they only build sends, which a
        # recomputation does not send: the replay log keeps their shape alone and the recomputation gets a
        # placeholder; the node-aware dispatcher's forwarding hops)
        self.replayed = True
        self.chain = None  # the order chain of the forward that launched it (launch_all_to_all)

    def start(self, send: torch.Tensor, recv_sizes: list[int], send_sizes: list[int], phase: str):
        if phase == "forward":
            recompute.check_not_in_backward(self.kind)
        check_order(self.group, phase, self.kind, self.serial, send.device)
        send = send.contiguous()
        recv = send.new_empty((sum(recv_sizes), *send.shape[1:]))
        if phase == "forward" and (log := recompute.recording_log()) is not None:
            if self.replayed:
                log.put(self.kind, recv, exchange=self)  # filled by the collective before anything reads it
                self.replay_log = log  # offloaded once waited (wait_all_to_all)
            else:
                needs_grad = send.requires_grad or self.chain is not None
                log.put(self.kind, recompute.Shape(recv, needs_grad), exchange=self)
        work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.group, async_op=True)
        if LINK is not None:  # full duplex: the larger of what leaves and what arrives from other ranks
            row_bytes = send[:1].nbytes if send.shape[0] else recv[:1].nbytes
            remote = max(_remote_rows(send_sizes, self.group), _remote_rows(recv_sizes, self.group)) * row_bytes
            work = LINK.launch(work, self.kind, phase, self.serial, remote, send.device)
        record("launch" if phase == "forward" else "reverse", self.kind, self.serial)
        if self.sync:
            work.wait()
            work = None
            record("done" if phase == "forward" else "reverse_done", self.kind, self.serial)
        return recv, work, send


def _next_token(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), device=like.device)


def _token_grad(ctx):
    return torch.zeros((), device=ctx.device) if ctx.chained else None


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send: torch.Tensor, exchange: Exchange, token):
        recv, exchange.work, kept = exchange.start(send, exchange.recv_sizes, exchange.send_sizes, "forward")
        exchange.keep_alive = (kept,)
        ctx.exchange, ctx.chained, ctx.device = exchange, token is not None, send.device
        return recv, _next_token(send)

    @staticmethod
    def backward(ctx, _grad_recv, _grad_token):
        exchange = ctx.exchange
        if exchange.reverse_work is not None:  # wait for the reverse all-to-all launched by _Wait.backward
            _timed_wait(exchange.reverse_work, "backward")
            record("reverse_done", exchange.kind, exchange.serial)
        grad_send, exchange.reverse_grad, exchange.reverse_work, exchange.keep_alive = (
            exchange.reverse_grad,
            None,
            None,
            (),
        )
        return grad_send, None, _token_grad(ctx)


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recv: torch.Tensor, exchange: Exchange, token):
        if exchange.work is not None:
            _timed_wait(exchange.work, "forward")
            exchange.work = None
            record("done", exchange.kind, exchange.serial)
        exchange.keep_alive = ()
        ctx.exchange, ctx.chained, ctx.device = exchange, token is not None, recv.device
        return recv.view_as(recv), _next_token(recv)

    @staticmethod
    def backward(ctx, grad_recv, _grad_token):
        exchange = ctx.exchange
        chain = exchange.chain
        if chain is not None:
            chain.consumed = True  # a backward runs through this chain: later exchanges start a new one
        exchange.reverse_grad, exchange.reverse_work, kept = exchange.start(
            grad_recv, exchange.send_sizes, exchange.recv_sizes, "backward"
        )
        exchange.keep_alive = (kept,)
        return grad_recv, None, _token_grad(ctx)


def launch_all_to_all(
    send: torch.Tensor, exchange: Exchange, chain: OrderChain | None = None, wait_after: Exchange | None = None
) -> torch.Tensor:
    """Start the all-to-all of ``send`` (rows grouped by destination rank); returns the receive buffer, which must go
    through :func:`wait_all_to_all` before it is read. With ``chain`` (a forward that needs a backward) the node
    joins the order chain.

    In backward the reverse all-to-all is waited as late as possible (when no other node is ready), or, with
    ``wait_after`` (an exchange launched earlier in this forward), once the nodes created after ``wait_after``'s
    launch have run and before those created before it: a Combine passes its Dispatch, so that its reverse overlaps
    attention part b and the shared experts, and attention part a is left for the reverse Dispatch (paper Appendix
    C, Fig. 14), instead of the reverse Combine taking all of the layer's attention backward and the reverse
    Dispatch none."""
    replay = recompute.replay_log()
    if replay is not None:  # a checkpointed layer's recomputation: the rows it received the first time
        exchange.chain = None
        (recv,) = replay.take(exchange.kind)
        record("replay", exchange.kind, exchange.serial)
        exchange.received = recv
        return recv
    exchange.chain = chain
    token = chain.take(send.device) if chain is not None else None
    recv, token = _Launch.apply(send, exchange, token)
    exchange.received = recv
    if chain is not None:
        chain.put(token)
    if REPRIORITISES and recv.grad_fn is not None:
        exchange.sequence_nr = recv.grad_fn._sequence_nr()
        late = getattr(wait_after, "sequence_nr", None)
        recv.grad_fn._set_sequence_nr(0 if late is None else late)  # when its backward waits
    return recv


def received(exchange: Exchange) -> torch.Tensor:
    """The receive buffer of ``exchange`` (launched by :func:`launch_all_to_all`), back on its device if it waits in
    host memory. A wait closure reads it here rather than holding the buffer itself, so that a checkpointed layer's
    rows can leave the GPU once waited (``train.checkpoint_offload``) while the closure stays for the
    recomputation."""
    rows = exchange.received
    if rows is None:
        raise RuntimeError(
            f"the rows of {exchange.kind} exchange {exchange.serial} were released (waited, or taken by its layer's "
            "recomputation) before a recomputation read them again: the backward reached the layers in an order the "
            "checkpointed schedule does not expect; disable train.gradient_checkpointing"
        )
    return rows if isinstance(rows, torch.Tensor) else rows.back()


def wait_all_to_all(recv: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """Wait for the all-to-all started by :func:`launch_all_to_all`; returns the filled receive buffer."""
    if recompute.replaying():  # its result is known; the recomputation's graph is never backpropagated
        return recv.view_as(recv)
    chain = exchange.chain
    token = chain.take(recv.device) if chain is not None else None
    ready, token = _Wait.apply(recv, exchange, token)
    if chain is not None:
        chain.put(token)
    if exchange.replay_log is not None:  # filled now: the log may keep it in host memory
        exchange.received = exchange.replay_log.offload(recv) or recv
    else:  # waited once: only a checkpointed layer's recomputation reads it again (autograd holds the exchange)
        exchange.received = None
    if REPRIORITISES and ready.grad_fn is not None:
        ready.grad_fn._set_sequence_nr(_SEQUENCE_NR_MAX)  # its backward launches: as early as possible
    return ready


def exchange_counts(send_counts: torch.Tensor, group, serial: int) -> torch.Tensor:
    """The per-destination counts of an exchange, swapped between ranks (no autograd; no host sync by itself).
    In a checkpointed layer's recomputation the recorded counts come back instead, after checking that this rank
    sends what it sent (:mod:`fcsd.parallel.recompute`)."""
    replay = recompute.replay_log()
    if replay is not None:
        from torch._subclasses.fake_tensor import FakeTensor

        sent, recv_counts = replay.take("counts")
        if not isinstance(sent, FakeTensor) and not torch.equal(sent, send_counts):  # fake: the planner's, no data
            raise RuntimeError(
                "a checkpointed expert-parallel layer routed its tokens differently when it was recomputed: its "
                "saved rows belong to the first routing (a non-deterministic router?); disable "
                "train.gradient_checkpointing"
            )
        record("replay", "counts", serial)
        return recv_counts
    recompute.check_not_in_backward("counts")
    check_order(group, "forward", "counts", serial, send_counts.device)
    recv_counts = torch.empty_like(send_counts)
    launched = LINK.now(send_counts.device) if LINK is not None else 0.0
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    if LINK is not None:
        share = 1 - 1 / dist.get_world_size(group)
        LINK.blocking("counts", "forward", serial, send_counts.nbytes * share, launched, send_counts.device)
    if (log := recompute.recording_log()) is not None:
        log.put("counts", send_counts, recv_counts)
    return recv_counts


class AllReduceHandle:
    """A sum over ``group`` of a tensor started asynchronously (inference layout, paper Sec. 4.2; no autograd). The
    tensor is summed in place: pass one nothing else reads (a layer's fresh expert output)."""

    def __init__(self, tensor: torch.Tensor, group, sync: bool | None = None, serial: int = 0):
        check_order(group, "forward", "all_reduce", serial, tensor.device)
        self.tensor, self.serial = tensor.contiguous(), serial
        self.work = dist.all_reduce(self.tensor, group=group, async_op=True)
        if LINK is not None:  # a ring all-reduce carries 2 (P - 1) / P of the tensor per rank
            ring = 2 * (1 - 1 / dist.get_world_size(group)) * self.tensor.nbytes
            self.work = LINK.launch(self.work, "all_reduce", "forward", serial, ring, tensor.device)
        record("launch", "all_reduce", serial)
        if sync_debug() if sync is None else sync:
            self.wait()

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
            record("done", "all_reduce", self.serial)
        return self.tensor
