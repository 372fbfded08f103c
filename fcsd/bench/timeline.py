"""Timing expert-parallel steps honestly on either device (paper Sec. 4, Appendix C; used by ``fcsd bench overlap``).

- :class:`StepTimer`: phase boundaries of one step. On CUDA they are CUDA events on the current stream, read after a
  device synchronisation, so a phase is the GPU time between its boundaries, not how fast the CPU queued kernels; on
  CPU they are ``perf_counter`` readings (gloo collectives block the calling thread).
- :class:`Timeline`: intervals of device activity, each ``compute`` or ``comm``, e.g. read from a
  ``torch.profiler`` trace (:meth:`Timeline.from_profiler`). :meth:`Timeline.exposed` is the communication time no
  compute overlaps (the union of ``comm`` intervals minus the union of ``compute`` ones): what the overlap leaves on
  the critical path. On NCCL a ``work.wait()`` returns at once (it only orders streams), so this trace-based figure
  replaces the wait-time figure there.

The modelled link of ``fcsd bench overlap --link`` (:mod:`fcsd.bench.modelled_link`, figures per transfer in
:mod:`fcsd.bench.hidden_share`, pictures in :mod:`fcsd.bench.picture`) computes its intervals instead of measuring
them, on any machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

#: substrings of a device kernel's name that mark it as communication (NCCL kernels; gloo has no device kernels)
COMM_KERNELS = ("nccl", "AllToAll", "all_to_all", "SendRecv")


class StepTimer:
    """``mark(name)`` at phase boundaries, then ``seconds()``: the time from each mark to the next, per phase."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((name, event))
        else:
            self.marks.append((name, time.perf_counter()))

    def seconds(self) -> dict[str, float]:
        """``{phase: seconds}`` for consecutive marks (the phase is named by its opening mark)."""
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for (name, start), (_, end) in zip(self.marks, self.marks[1:]):
            out[name] = start.elapsed_time(end) / 1e3 if self.cuda else end - start
        self.marks = []
        return out


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


@dataclass
class Timeline:
    """Device activity as ``(kind, start, end)`` intervals, ``kind`` in ``compute`` / ``comm`` (any time unit)."""

    intervals: list[tuple[str, float, float]] = field(default_factory=list)

    def add(self, kind: str, start: float, end: float) -> None:
        self.intervals.append((kind, start, end))

    def busy(self, kind: str) -> float:
        return _length(_union([(a, b) for k, a, b in self.intervals if k == kind]))

    def exposed(self) -> float:
        """Communication time during which no compute runs."""
        comm = _union([(a, b) for k, a, b in self.intervals if k == "comm"])
        compute = _union([(a, b) for k, a, b in self.intervals if k == "compute"])
        hidden, j = 0.0, 0
        for start, end in comm:
            while j < len(compute) and compute[j][1] <= start:
                j += 1
            k = j
            while k < len(compute) and compute[k][0] < end:
                hidden += min(end, compute[k][1]) - max(start, compute[k][0])
                k += 1
        return _length(comm) - hidden

    @classmethod
    def from_profiler(cls, prof) -> Timeline:
        """The device kernels of a finished ``torch.profiler`` run (microseconds); empty without device activity."""
        timeline = cls()
        for event in prof.events():
            if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            kind = "comm" if any(name in event.name for name in COMM_KERNELS) else "compute"
            timeline.add(kind, event.time_range.start, event.time_range.end)
        return timeline
