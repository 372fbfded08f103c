"""Activation checkpointing under expert parallelism that never re-issues a collective (design §4 "EP at scale").

A checkpointed decoder layer is run twice: in the forward, and again in the backward to rebuild what it saved. Its
expert-parallel exchanges (the per-expert counts, the Dispatch and Combine all-to-alls) must not run again: a second
exchange would have to be issued by every rank at the same point of its backward, and the rows it would carry are
already known. So, as torchtitan's selective policy saves the all-to-all outputs, each checkpointed forward
*records* the result of every exchange it issues (the received counts and the receive buffers) in a
:class:`ReplayLog`, and the recomputation *replays* them: the dispatchers take the recorded tensors instead of
communicating, in the same order, and check that the recomputed routing sends what was sent (else the saved rows
would belong to other tokens). The backward's reverse exchanges are issued by the nodes of the original forward, as
without checkpointing, so the overlapped backward and its order chain are unchanged.

Memory: a layer keeps its inputs plus the rows its exchanges received (what torchtitan keeps), instead of every
activation. The log is per layer call and freed with the checkpoint. With ``offload`` (``train.checkpoint_offload``)
the received rows wait for the backward in host memory instead: each is copied to pinned host memory once its
exchange has been waited (on a side stream, so the forward goes on while it copies; the GPU buffer is released when
the copy is done), and copied back *prefetched*: when the backward starts recomputing layer ``k``, the rows of layer
``k - 1`` (the next it recomputes) start their copy back on the side stream, so the copy runs beside layer ``k``'s
recomputation instead of stalling layer ``k - 1``'s (the layer recomputed first, the last, copies its own when it
starts; a prefetched layer holds its rows on the device one layer early). On a CPU the prefetch is decided at the
same point but the copy stays at the layer's own recomputation: without a copy engine it could not run beside it.
That is what lets the replay of 48-61 MoE layers at
``tokens x top_k x hidden`` rows each stop growing the GPU's share with the tokens (``fcsd plan`` prices the copies
over the host link). On a CPU the host copy is a buffer outside torch's allocator (what the tests and ``fcsd plan
--measure`` run; the planner's simulation charges it to host memory).

Guard: a forward exchange issued while a backward runs (a recomputation that does not replay) raises at once
(:func:`check_not_in_backward`), so a re-issued collective can never go unnoticed or hang a job.

:func:`enable` installs it on every decoder layer of a model (``train.gradient_checkpointing`` under
``parallel.ep_size`` > 1 or ``parallel.fsdp``).
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager, nullcontext
from functools import partial

import torch


class HostCopy:
    """A tensor waiting in host memory for the recomputation: ``host`` (pinned on a GPU run), the ``device`` it
    returns to and, on CUDA, the ``event`` that marks the end of its copy out."""

    def __init__(self, tensor: torch.Tensor):
        self.device, self.requires_grad = tensor.device, tensor.requires_grad
        self.event = None
        with host_allocation():
            if tensor.device.type == "cuda":
                stream = _copy_stream(tensor.device, "out")
                stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the exchange's result is complete
                with torch.cuda.stream(stream):
                    self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                    self.host.copy_(tensor, non_blocking=True)
                    self.event = torch.cuda.Event()
                    self.event.record(stream)
                tensor.record_stream(stream)  # its GPU memory is reused only once the copy has read it
            elif _is_fake(tensor):  # the planner's simulation: a copy it charges to host memory
                self.host = tensor.detach().clone()
            else:  # a CPU run: bytes outside torch's allocator, as a GPU's host memory is outside the GPU's
                self.host = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().copy()
                self.shape, self.dtype = tensor.shape, tensor.dtype

    def back(self) -> torch.Tensor:
        """The tensor on its device again (a GPU run: queued on the current stream after the copy out), requiring
        gradients as the recorded one did, so that the recomputation saves what the forward saved."""
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
            back = self.host.to(self.device, non_blocking=True)
        elif isinstance(self.host, torch.Tensor):
            back = self.host.clone()
        elif self.host.size == 0:  # an exchange that received no rows (numpy's empty view has no stride to reuse)
            back = torch.empty(self.shape, dtype=self.dtype)
        else:
            back = torch.from_numpy(self.host).view(self.dtype).view(self.shape).clone()
        return back.requires_grad_(self.requires_grad)

    def prefetch(self) -> Prefetched:
        """Start the copy back now (a GPU run: on the side stream, after the copy out), for the recomputation that
        reads it later (:meth:`ReplayLog.prefetch`). A CPU run has no copy engine to run it beside the compute: its
        copy stays where the recomputation reads it (an early copy would only hold the rows longer). The planner's
        fake tensors stand for a GPU run's: they come back at once, charged to the device a layer early."""
        if self.event is None:
            return Prefetched(self.back()) if _is_fake(self.host) else self
        stream = _copy_stream(self.device, "back")
        with torch.cuda.stream(stream):
            stream.wait_event(self.event)
            tensor = self.host.to(self.device, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(stream)
        return Prefetched(tensor.requires_grad_(self.requires_grad), arrived)


class Shape:
    """What the replay keeps of an exchange whose rows' values the recomputation never reads (they only build sends):
    their shape, dtype and device, given back as a placeholder of one value broadcast to that shape (no memory), so
    that the recomputation runs and saves exactly what the forward did."""

    def __init__(self, tensor: torch.Tensor, requires_grad: bool):
        self.shape, self.dtype, self.device, self.requires_grad = (
            tensor.shape,
            tensor.dtype,
            tensor.device,
            requires_grad,
        )

    def back(self) -> torch.Tensor:
        value = torch.zeros((), dtype=self.dtype, device=self.device, requires_grad=self.requires_grad)
        return value.expand(self.shape)


class Prefetched:
    """A :class:`HostCopy` on its way back (or back) to its device; ``back()`` hands it to the current stream."""

    def __init__(self, tensor: torch.Tensor, event=None):
        self.tensor, self.event = tensor, event

    def back(self) -> torch.Tensor:
        if self.event is not None:
            current = torch.cuda.current_stream(self.tensor.device)
            current.wait_event(self.event)
            self.tensor.record_stream(current)  # allocated on the copy stream, read on this one
        return self.tensor


def _is_fake(tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


_COPY_STREAMS: dict = {}


def _copy_stream(device, direction: str):
    """One copy stream per device and direction ("out" to host memory, "back" to the device): PCIe copies both ways
    at once, so a layer's rows going out need not queue behind another's prefetch."""
    if (device, direction) not in _COPY_STREAMS:
        _COPY_STREAMS[device, direction] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device, direction]


#: the context host copies are allocated in; the planner's memory tracker charges them to host memory
host_allocation = nullcontext


class ReplayLog:
    """The exchanges of one checkpointed layer call, in issue order: ``(kind, tensors)``. With ``offload``, the
    received rows move to host memory once their exchange is waited (:meth:`offload`)."""

    def __init__(self, offload: bool = False, previous: ReplayLog | None = None):
        self.entries: list[tuple[str, tuple]] = []
        self.exchanges: list = []
        self.position = 0
        self.offloads = offload
        # the log of the layer recorded just before this one in the same forward (recomputed right after this one):
        # a weak reference, so that a log never keeps an earlier layer's rows alive
        self.previous = weakref.ref(previous) if previous is not None else None
        self.index = previous.index + 1 if previous is not None else 0  # the layer's place in its forward

    def prefetch(self) -> None:
        """Start copying this log's rows in host memory back to the device (with ``offload``): called when the
        layer recomputed just before this one starts its recomputation, so that the copies run beside it (paper Sec.
        4.1's overlap applied to the replay; a side stream on GPUs, in the same order on a CPU)."""
        pending = [i for i, (_, tensors) in enumerate(self.entries) if tensors and isinstance(tensors[0], HostCopy)]
        if not pending or self.position:
            return
        from fcsd.parallel.events import record

        record("prefetch", "layer", self.index)
        for index in pending:
            kind, (copy,) = self.entries[index]
            self.entries[index] = (kind, (copy.prefetch(),))

    def earlier(self) -> ReplayLog | None:
        """The log recorded just before this one, while it lives."""
        return self.previous() if self.previous is not None else None

    def put(self, kind: str, *tensors, exchange=None) -> None:
        """Record an exchange's result; ``exchange`` (its :class:`~fcsd.parallel.collectives.Exchange`) forgets its
        copy when the recomputation takes this one, as autograd keeps the exchange until its reverse has run."""
        self.entries.append((kind, tensors))
        self.exchanges.append(exchange)

    def offload(self, tensor: torch.Tensor) -> HostCopy | None:
        """Move the recorded ``tensor`` (an exchange's receive buffer, now filled) to host memory, if this log
        offloads; returns its :class:`HostCopy` (None: kept on the device)."""
        if not self.offloads:
            return None
        for index, (kind, tensors) in enumerate(self.entries):
            if len(tensors) == 1 and tensors[0] is tensor:
                copy = HostCopy(tensor)
                self.entries[index] = (kind, (copy,))
                return copy
        return None

    def take(self, kind: str) -> tuple:
        if self.position >= len(self.entries):
            raise RuntimeError(
                f"the recomputation of a checkpointed expert-parallel layer issued more exchanges than its forward "
                f"({len(self.entries)}, next: {kind}): the layer must run the same code when it is recomputed"
            )
        recorded, tensors = self.entries[self.position]
        if recorded != kind:
            raise RuntimeError(
                f"the recomputation of a checkpointed expert-parallel layer issued a {kind} exchange where its "
                f"forward issued a {recorded} one (exchange {self.position + 1})"
            )
        self.entries[self.position] = (recorded, ())  # released: the recomputation holds it now
        if (exchange := self.exchanges[self.position]) is not None:
            exchange.received = None
            self.exchanges[self.position] = None
        self.position += 1
        return tuple(t.back() if isinstance(t, HostCopy | Prefetched | Shape) else t for t in tensors)


class _Active(threading.local):
    log: ReplayLog | None = None
    replaying: bool = False


_ACTIVE = _Active()


@contextmanager
def _mode(log: ReplayLog, replaying: bool):
    saved = (_ACTIVE.log, _ACTIVE.replaying)
    _ACTIVE.log, _ACTIVE.replaying = log, replaying
    try:
        yield
    finally:
        _ACTIVE.log, _ACTIVE.replaying = saved


@contextmanager
def _recomputing(log: ReplayLog, layer):
    """The recomputation of ``layer``: its exchanges replayed from ``log`` and, when the layer is an FSDP2 unit, its
    parameters gathered first. The checkpoint wraps the layer's ``forward``, inside FSDP2's hooks, so nothing else
    gathers them: FSDP2's pre-backward hook sits on the layer's outputs, but under the overlapped schedule the
    backward can reach the layer's MLP side first (through ``o_k``, completed in the next layer), and unpacking any
    tensor the layer saved recomputes all of it, its norms and attention included. The unshard is a collective every
    rank issues at the same point of its backward (the same graph); the layer's own post-backward reshards."""
    from torch.distributed.fsdp import FSDPModule

    from fcsd.parallel.events import record

    if isinstance(layer, FSDPModule):
        layer.unshard()
    record("recompute", "layer", log.index)
    if (earlier := log.earlier()) is not None:
        earlier.prefetch()  # the next layer the backward recomputes: its rows come back while this one runs
    with _mode(log, True):
        yield


def recording_log() -> ReplayLog | None:
    """The log of the checkpointed forward in progress (its exchanges are recorded there), or None."""
    return _ACTIVE.log if not _ACTIVE.replaying else None


def replay_log() -> ReplayLog | None:
    """The log being replayed by the recomputation in progress, or None."""
    return _ACTIVE.log if _ACTIVE.replaying else None


def replaying() -> bool:
    return _ACTIVE.replaying


def check_not_in_backward(kind: str) -> None:
    """Refuse a forward exchange issued during a backward pass without replay: a checkpointed layer whose
    recomputation would re-issue its collectives (each rank at its own moment of the backward)."""
    if torch._C._current_graph_task_id() != -1:
        raise RuntimeError(
            f"an expert-parallel {kind} exchange was issued during the backward pass: a layer was recomputed "
            "(activation checkpointing) without replaying its collectives. Enable checkpointing with "
            "fcsd.parallel.recompute.enable(model) (train.gradient_checkpointing=true does it), not "
            "model.gradient_checkpointing_enable()"
        )


class ReplayingCheckpoint:
    """The checkpoint function installed in decoder layers (transformers' ``_gradient_checkpointing_func`` seam):
    torch's non-reentrant checkpoint, with each call's exchanges recorded in the forward and replayed in the
    recomputation."""

    fcsd_replays = True

    def __init__(self, offload: bool = False):
        self.offload = offload
        self._last = None  # weak reference to the log recorded last

    def __call__(self, function, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint

        last = self._last() if self._last is not None else None
        if last is not None and last.position:  # already replayed: a backward ran since, this is a new forward
            last = None
        log = ReplayLog(self.offload, previous=last)
        self._last = weakref.ref(log)
        layer = function.args[0] if isinstance(function, partial) and function.args else None
        pending = getattr(function, "keywords", {}).get("farskip_pending")
        if pending is not None and args and args[0] is pending.full:
            # o_{k-1} arrives empty and is completed in place inside the layer (the overlapped schedule): the
            # recomputation reads it completed, so it is held by the closure, not saved at version 0 as an input
            held, layer_forward = pending.full, function
            function, args = (lambda *rest, **options: layer_forward(held, *rest, **options)), args[1:]
        return checkpoint(
            function,
            *args,
            use_reentrant=False,
            context_fn=lambda: (_mode(log, False), _recomputing(log, layer)),
            **kwargs,
        )


def replays(layer) -> bool:
    """Whether ``layer`` is checkpointed by :class:`ReplayingCheckpoint` (or not checkpointed at all)."""
    if not getattr(layer, "gradient_checkpointing", False):
        return True
    return getattr(getattr(layer, "_gradient_checkpointing_func", None), "fcsd_replays", False)


def enable(model, offload: bool = False) -> None:
    """Checkpoint every decoder layer of ``model`` with :class:`ReplayingCheckpoint` (the layer's inputs and its
    exchanges' results are kept, the rest is recomputed in the backward); ``offload``: the exchanges' results are
    kept in host memory (see the module docstring)."""
    from fcsd.connectivity.families import family_for_config, find_decoder_layers

    function = ReplayingCheckpoint(offload)
    for layer in find_decoder_layers(model, family_for_config(model.config)):
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = function
