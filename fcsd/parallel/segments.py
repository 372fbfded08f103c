"""Which compute ran when, in one expert-parallel step, forward and backward: the compute lanes of the timeline
picture (paper Appendix D, Figs. 12-14: layer execution traces).

The schedule names its own segments (:func:`segment`: ``routing``, ``routed experts``, ``shared experts``; the
attention split marks where ``attention part b`` begins, :func:`attention_core`); a :class:`SegmentRecorder` adds
``attention`` (each decoder layer's ``self_attn``, split into parts a and b where the schedule splits it) and
``LM head`` through module hooks; everything else is ``other``. Nothing is recorded (and the markers cost one
attribute read) unless a recorder is active.

Backward: each autograd node belongs to the segment whose forward created it. At every forward segment boundary the
recorder reads the autograd sequence number the next node will get; after the forward it hooks every node of the
graph (``Node.register_prehook`` / ``register_hook``) and labels its execution interval by that number. The launch and
wait nodes of the collectives (re-numbered by :mod:`.collectives`) are labelled ``collective``, gradient
accumulation into parameters ``other``. On CUDA every mark and node boundary synchronises the device, so the
recorded step is slower than an unrecorded one but its segments are device time (not verified on a GPU).
"""

from __future__ import annotations

import bisect
import time
from contextlib import contextmanager

import torch

from fcsd.connectivity.families import family_for_config, find_decoder_layers

COLLECTIVE_NODES = ("_LaunchBackward", "_WaitBackward")


class _Active:
    recorder: SegmentRecorder | None = None


ACTIVE = _Active()


@contextmanager
def segment(label: str):
    """The compute inside the block is ``label`` (nested blocks win; no cost without an active recorder)."""
    recorder = ACTIVE.recorder
    if recorder is None:
        yield
        return
    recorder.push(label)
    try:
        yield
    finally:
        recorder.pop()


def attention_core() -> None:
    """The attention's core kernel starts: what ran of it so far was part a, what follows is part b."""
    if ACTIVE.recorder is not None:
        ACTIVE.recorder.split_attention()


def _next_sequence_nr() -> int | None:
    """The autograd sequence number of the next node this thread creates (None without grad mode)."""
    if not torch.is_grad_enabled():
        return None
    probe = torch.zeros((), requires_grad=True) * 1.0
    return probe.grad_fn._sequence_nr() + 1


class SegmentRecorder:
    """Record the compute segments of one step of ``model`` (a context manager; see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        device = next(model.parameters()).device
        self.device = device if device.type == "cuda" else None  # host clocks must read the device's progress
        self.marks: list[list] = []  # [time, label, next sequence number]
        self.stack: list[tuple[str, int]] = []  # (label, index of its mark)
        self.forward_end: float | None = None
        self.nodes: list[tuple[float, float, str]] = []
        self._handles = []
        self._starts: dict[int, float] = {}

    def __enter__(self) -> SegmentRecorder:
        family = family_for_config(self.model.config)
        for layer in find_decoder_layers(self.model, family):
            self._hook(layer.self_attn, "attention")
        head = self.model.get_output_embeddings()
        if head is not None:
            self._hook(head, "LM head")
        ACTIVE.recorder = self
        self.push("other")
        return self

    def __exit__(self, *exc) -> None:
        ACTIVE.recorder = None
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, module: torch.nn.Module, label: str) -> None:
        self._handles.append(module.register_forward_pre_hook(lambda m, a: self.push(label)))
        self._handles.append(module.register_forward_hook(lambda m, a, o: self.pop()))

    def _now(self) -> float:
        if self.device is not None:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _mark(self, label: str) -> None:
        self.marks.append([self._now(), label, _next_sequence_nr()])

    def push(self, label: str) -> None:
        self._mark(label)
        self.stack.append((label, len(self.marks) - 1))

    def pop(self) -> None:
        self.stack.pop()
        self._mark(self.stack[-1][0] if self.stack else "other")

    def split_attention(self) -> None:
        if not self.stack or self.stack[-1][0] != "attention":
            return
        _, first = self.stack.pop()
        for mark in self.marks[first:]:
            if mark[1] == "attention":
                mark[1] = "attention part a"
        self.push("attention part b")

    def end_forward(self, output: torch.Tensor | None = None) -> None:
        """The forward is over; with ``output`` (the loss), hook its graph to label the backward's nodes."""
        self.forward_end = self._now()
        self._mark("other")
        if output is None or output.grad_fn is None:
            return
        numbered = [(m[2], m[1]) for m in self.marks if m[2] is not None]
        keys = [n for n, _ in numbered]

        def label_of(node) -> str:
            name = type(node).__name__
            if name in COLLECTIVE_NODES:
                return "collective"
            if name == "AccumulateGrad":
                return "other"
            index = bisect.bisect_right(keys, node._sequence_nr()) - 1
            return numbered[index][1] if index >= 0 else "other"

        seen, todo = set(), [output.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            self._watch(node, label_of(node))
            todo.extend(next_node for next_node, _ in node.next_functions)

    def _watch(self, node, label: str) -> None:
        key = id(node)

        def before(grad_outputs):
            self._starts[key] = self._now()

        def after(grad_inputs, grad_outputs):
            end = self._now()
            self.nodes.append((self._starts.pop(key, end), end, label))

        node.register_prehook(before)
        node.register_hook(after)

    def intervals(self) -> list[tuple[float, float, str]]:
        """``(start, end, label)`` of the forward (from its marks) and the backward (hooked nodes), in time order;
        consecutive pieces of one label merged."""
        pieces = []
        end = self.forward_end if self.forward_end is not None else time.perf_counter()
        marks = [m for m in self.marks if m[0] <= end]
        for (start, label, _), nxt in zip(marks, [*marks[1:], [end, None, None]]):
            pieces.append((start, nxt[0], label))
        pieces += sorted(self.nodes)
        merged: list[list] = []
        for start, stop, label in pieces:
            if stop <= start:
                continue
            if merged and merged[-1][2] == label and start - merged[-1][1] < 20e-6:
                merged[-1][1] = max(merged[-1][1], stop)
            else:
                merged.append([start, stop, label])
        return [tuple(m) for m in merged]
