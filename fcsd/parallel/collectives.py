"""Async-safe autograd collectives for expert parallelism (paper Appendix C; design §4).

An all-to-all is split into two autograd nodes, *launch* and *wait*, so that other work can run between them in the
forward **and** in the backward:

- forward: ``launch`` starts the all-to-all and returns the (not yet filled) receive buffer; ``wait`` waits for it.
- backward, in reverse: ``wait``'s backward *launches* the reverse all-to-all of the incoming gradient; ``launch``'s
  backward *waits* for it right before the gradient is consumed by the node that produced the send buffer.

Autograd node priorities: the engine runs ready nodes by decreasing sequence number. Where the installed torch lets a
node's number be re-assigned (``grad_fn._set_sequence_nr``, torch >= 2.1), the reverse launch gets the highest number
(issued as soon as its gradient is ready) and the reverse wait the lowest (run only when nothing else is ready).
Fallback where it is missing: the forward creation order, which already places every node created between launch and
wait between the reverse launch and the reverse wait (:data:`REPRIORITISES` says which one is in use).

``FCSD_EP_SYNC=1`` makes every wait immediate (forward and backward), for debugging: results must not change.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

_SEQUENCE_NR_MAX = 2**62  # above any sequence number a process creates, below uint64 overflow


def _probe_set_sequence_nr() -> bool:
    probe = torch.zeros(1, requires_grad=True) * 1
    return hasattr(probe.grad_fn, "_set_sequence_nr") and hasattr(probe.grad_fn, "_sequence_nr")


REPRIORITISES = _probe_set_sequence_nr()

#: seconds this process spent blocked in all-to-all waits, per phase (read by the overlap benchmark)
WAIT_SECONDS = {"forward": 0.0, "backward": 0.0}


def _timed_wait(work, phase: str) -> None:
    start = time.perf_counter()
    work.wait()
    WAIT_SECONDS[phase] += time.perf_counter() - start


def sync_debug() -> bool:
    """Whether ``FCSD_EP_SYNC=1`` asks every collective to be waited for as soon as it is launched."""
    return os.environ.get("FCSD_EP_SYNC", "0") not in ("", "0")


class Exchange:
    """One all-to-all between the ranks of ``group`` and its reverse: split sizes and the pending work handles.

    ``send_sizes[r]`` rows go to rank ``r``; ``recv_sizes[r]`` rows come from it (host lists, known before launch).
    """

    def __init__(self, send_sizes: list[int], recv_sizes: list[int], group, sync: bool | None = None):
        self.send_sizes, self.recv_sizes, self.group = send_sizes, recv_sizes, group
        self.sync = sync_debug() if sync is None else sync
        self.work = self.reverse_work = None
        self.keep_alive = ()  # send buffers must outlive the asynchronous collective
        self.reverse_grad = None

    def start(self, send: torch.Tensor, recv_sizes: list[int], send_sizes: list[int]):
        send = send.contiguous()
        recv = send.new_empty((sum(recv_sizes), *send.shape[1:]))
        work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.group, async_op=True)
        if self.sync:
            work.wait()
            work = None
        return recv, work, send


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send: torch.Tensor, exchange: Exchange):
        recv, exchange.work, kept = exchange.start(send, exchange.recv_sizes, exchange.send_sizes)
        exchange.keep_alive = (kept,)
        ctx.exchange = exchange
        return recv

    @staticmethod
    def backward(ctx, _grad_recv):
        exchange = ctx.exchange
        if exchange.reverse_work is not None:  # wait for the reverse all-to-all launched by _Wait.backward
            _timed_wait(exchange.reverse_work, "backward")
        grad_send, exchange.reverse_grad, exchange.reverse_work, exchange.keep_alive = (
            exchange.reverse_grad,
            None,
            None,
            (),
        )
        return grad_send, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recv: torch.Tensor, exchange: Exchange):
        if exchange.work is not None:
            _timed_wait(exchange.work, "forward")
            exchange.work = None
        exchange.keep_alive = ()
        ctx.exchange = exchange
        return recv.view_as(recv)

    @staticmethod
    def backward(ctx, grad_recv):
        exchange = ctx.exchange
        exchange.reverse_grad, exchange.reverse_work, kept = exchange.start(
            grad_recv, exchange.send_sizes, exchange.recv_sizes
        )
        exchange.keep_alive = (kept,)
        return grad_recv, None


def launch_all_to_all(send: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """Start the all-to-all of ``send`` (rows grouped by destination rank); returns the receive buffer, which must go
    through :func:`wait_all_to_all` before it is read."""
    recv = _Launch.apply(send, exchange)
    if REPRIORITISES and recv.grad_fn is not None:
        recv.grad_fn._set_sequence_nr(0)  # its backward waits: as late as possible
    return recv


def wait_all_to_all(recv: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """Wait for the all-to-all started by :func:`launch_all_to_all`; returns the filled receive buffer."""
    ready = _Wait.apply(recv, exchange)
    if REPRIORITISES and ready.grad_fn is not None:
        ready.grad_fn._set_sequence_nr(_SEQUENCE_NR_MAX)  # its backward launches: as early as possible
    return ready


class AllReduceHandle:
    """A sum over ``group`` of a tensor started asynchronously (inference layout, paper Sec. 4.2; no autograd)."""

    def __init__(self, tensor: torch.Tensor, group, sync: bool | None = None):
        self.tensor = tensor.contiguous().clone()
        self.work = dist.all_reduce(self.tensor, group=group, async_op=True)
        if sync_debug() if sync is None else sync:
            self.wait()

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.tensor
