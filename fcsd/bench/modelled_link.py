"""A modelled link under the expert-parallel collectives: the overlap seen and verified without a cluster (paper
Sec. 4.1, 4.2, Appendix C).

On a CPU machine gloo's transfers compete with the compute for the same cores, so timing the real collectives mixes
the schedule with CPU contention. Under a :class:`ModelledLink` the real collectives still run (the data must
arrive), but each one *completes no earlier than the modelled link delivers it*: one serial link per rank, a transfer
starts when it is launched or when the link frees up, occupies the link for ``latency + bytes / bandwidth`` and is
delivered then; a ``wait()`` that comes earlier sleeps until delivery. So the schedule's real compute, between a
launch and its wait, is what hides the modelled transfer, as a GPU's compute hides an NCCL kernel.

Bytes per transfer, per rank: an all-to-all moves the rows to and from *other* ranks (full duplex: the larger of the
two), the per-expert counts exchange ``(P - 1) / P`` of its counts, a ring all-reduce ``2 (P - 1) / P`` of its
tensor. ``bandwidth`` is therefore a *bus bandwidth* in the sense of nccl-tests (what ``all_to_all_perf`` and
``all_reduce_perf`` report as busbw). Each rank's link is modelled from its own launch times; another rank arriving
late shows up as real waiting (:attr:`Transfer.done` after :attr:`Transfer.delivered`), not as link time.

It wraps the real schedule's collectives (the seam is :data:`fcsd.parallel.collectives.LINK`); nothing of the
schedule is re-implemented. Every transfer is recorded (:class:`Transfer`) for :mod:`fcsd.bench.hidden_share`. On CUDA
the link synchronises the device at each launch and each wait, so that host clocks read device time (not verified on
a GPU: no GPU machine was available when this was written).

``--link`` syntax (:func:`parse_link`): ``BANDWIDTH[,LATENCY]`` such as ``25GB/s,10us`` (``B`` bytes, ``b`` bits;
k/M/G/T decimal, Ki/Mi/Gi/Ti binary; latency in s/ms/us/ns), or a preset of :data:`PRESETS`. Presets describe an
accelerator's link and are *scaled to this device's speed* (:func:`scale_to_device`): on CPU both the bandwidth and
the latency are stretched by the ratio of the accelerator's GEMM rate (paper Appendix B: 600 TFLOP/s) to this CPU
core's measured one, so transfer and compute keep the accelerator's proportions; on CUDA presets are used as given.
Explicit ``BANDWIDTH[,LATENCY]`` values are never scaled.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace

import torch

from fcsd.units import duration

#: paper Appendix B's hypothetical accelerator: dense GEMMs at 600 TFLOP/s (the reference a preset is scaled from)
ACCELERATOR_GEMM_FLOPS = 600e12

#: named links of an accelerator node or cluster: (bus bandwidth in bytes/s, latency in s, description)
PRESETS = {
    "xgmi": (300e9, 5e-6, "8-GPU node fabric (xGMI / NVLink): paper Appendix B's 300 GB/s all-to-all bus bandwidth"),
    "nvlink": (300e9, 5e-6, "alias of xgmi"),
    "eth400": (50e9, 10e-6, "400 Gb/s Ethernet / RoCE between nodes (paper Sec. 5.2's multi-node setting)"),
}

_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
_PREFIX["Ti"] = 2**40
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_BANDWIDTH = re.compile(r"^([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*(Ki|Mi|Gi|Ti|k|K|M|G|T)?([Bb])(?:/s|ps)$")
_LATENCY = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*(s|ms|us|µs|ns)$")
_SYNTAX = "use BANDWIDTH[,LATENCY] such as 25GB/s,10us or 400Gb/s, or a preset: " + ", ".join(PRESETS)


@dataclass(frozen=True)
class LinkSpec:
    """A link: bus bandwidth (bytes/s), latency (s), how the user named it and whether a preset was scaled."""

    bandwidth: float
    latency: float = 0.0
    name: str = ""
    preset: str | None = None
    scale: float = 1.0  # this device's GEMM rate over the accelerator's (presets on CPU); 1.0 otherwise

    def describe(self) -> str:
        text = f"{_human_rate(self.bandwidth)}, latency {duration(self.latency)}"
        if self.preset and self.scale != 1.0:
            base = PRESETS[self.preset]
            accelerator = f"a {ACCELERATOR_GEMM_FLOPS / 1e12:.0f} TFLOP/s accelerator"
            return (
                f"{self.preset} ({_human_rate(base[0])}, {duration(base[1])} on {accelerator}) scaled to this CPU "
                f"core's {self.scale * ACCELERATOR_GEMM_FLOPS / 1e9:.1f} GFLOP/s: {text}"
            )
        return text


def parse_link(text: str) -> LinkSpec:
    """``--link`` text -> :class:`LinkSpec` (presets not yet scaled); a ``ValueError`` names what is wrong."""
    raw = text.strip()
    if raw.lower() in PRESETS:
        bandwidth, latency, _ = PRESETS[raw.lower()]
        return LinkSpec(bandwidth, latency, raw, preset=raw.lower())
    parts = [p.strip() for p in raw.split(",")]
    if len(parts) > 2 or not parts[0]:
        raise ValueError(f"--link {text!r}: {_SYNTAX}")
    match = _BANDWIDTH.match(parts[0])
    if match is None:
        raise ValueError(f"--link {text!r}: cannot read the bandwidth {parts[0]!r}; {_SYNTAX}")
    number, prefix, unit = match.groups()
    bandwidth = float(number) * _PREFIX[prefix or ""] / (8 if unit == "b" else 1)
    latency = 0.0
    if len(parts) == 2:
        found = _LATENCY.match(parts[1])
        if found is None:
            raise ValueError(f"--link {text!r}: cannot read the latency {parts[1]!r}; {_SYNTAX}")
        latency = float(found.group(1)) * _SECONDS[found.group(2)]
    if bandwidth <= 0:
        raise ValueError(f"--link {text!r}: the bandwidth must be positive")
    return LinkSpec(bandwidth, latency, raw)


def gemm_flops(seconds: float = 0.3, size: int = 256) -> float:
    """This process's dense fp32 GEMM rate (FLOP/s) on its current thread settings: the best of short runs."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(8):
            torch.mm(a, b)
        best = max(best, 8 * 2 * size**3 / (time.perf_counter() - start))
    return best


def scale_to_device(spec: LinkSpec, device: torch.device, flops: float | None = None) -> LinkSpec:
    """A preset scaled to ``device`` (see the module docstring): on CPU, bandwidth times and latency divided by
    ``flops / ACCELERATOR_GEMM_FLOPS`` (``flops``: this core's GEMM rate, measured when not given)."""
    if spec.preset is None or device.type == "cuda":
        return spec
    scale = (flops or gemm_flops()) / ACCELERATOR_GEMM_FLOPS
    return replace(spec, bandwidth=spec.bandwidth * scale, latency=spec.latency / scale, scale=scale)


@dataclass
class Transfer:
    """One collective through the link, times in ``perf_counter`` seconds: ``launched`` (issued), ``start`` (the
    link took it), ``delivered`` (the link delivered it), ``waited`` (its wait was called; equal to ``launched`` for
    a blocking collective), ``done`` (the wait returned: after delivery and after the real collective)."""

    kind: str  # dispatch, combine, ids, counts, all_reduce
    phase: str  # forward or backward
    serial: int
    nbytes: float  # bytes this rank's link carries
    launched: float
    start: float
    delivered: float
    blocking: bool = False
    waited: float | None = None
    done: float | None = None

    @property
    def link_seconds(self) -> float:
        return self.delivered - self.start


class LinkWork:
    """The handle of a collective under the link: ``wait()`` waits for the real collective, then sleeps until the
    modelled delivery."""

    def __init__(self, link: ModelledLink, work, transfer: Transfer, device: torch.device):
        self.link, self.work, self.transfer, self.device = link, work, transfer, device

    def wait(self, timeout=None) -> bool:
        transfer = self.transfer
        if transfer.done is not None:
            return True
        if transfer.waited is None:
            transfer.waited = self.link.now(self.device)
        if self.work is not None:
            self.work.wait()
        self.link.sleep_until(transfer.delivered)
        transfer.done = time.perf_counter()
        return True

    def is_completed(self) -> bool:
        return self.transfer.done is not None


@dataclass
class ModelledLink:
    """This rank's serial link (see the module docstring); :attr:`transfers` records every collective through it."""

    spec: LinkSpec
    transfers: list[Transfer] = field(default_factory=list)
    free_at: float = 0.0

    def now(self, device: torch.device) -> float:
        if device.type == "cuda":  # the host clock must read the device's progress
            torch.cuda.synchronize(device)
        return time.perf_counter()

    @staticmethod
    def sleep_until(deadline: float) -> None:
        while (left := deadline - time.perf_counter()) > 0:
            time.sleep(left)

    def _transfer(self, kind, phase, serial, nbytes, launched, blocking) -> Transfer:
        start = max(launched, self.free_at)
        delivered = start + self.spec.latency + nbytes / self.spec.bandwidth
        self.free_at = delivered
        transfer = Transfer(kind, phase, serial, float(nbytes), launched, start, delivered, blocking)
        self.transfers.append(transfer)
        return transfer

    def launch(self, work, kind: str, phase: str, serial: int, nbytes: float, device) -> LinkWork:
        """Put the asynchronous collective ``work``, just issued, on the link; returns its handle. The transfer is
        launched when the real launch call has returned: time spent inside that call (gloo hands the work to its
        threads there, and may lose the core doing so) is neither compute nor a window."""
        launched = self.now(device)
        return LinkWork(self, work, self._transfer(kind, phase, serial, nbytes, launched, False), device)

    def blocking(self, kind: str, phase: str, serial: int, nbytes: float, launched: float, device) -> None:
        """A blocking collective issued at ``launched`` has returned: hold the caller until the link delivers it."""
        transfer = self._transfer(kind, phase, serial, nbytes, launched, True)
        transfer.waited = launched
        self.sleep_until(transfer.delivered)
        transfer.done = time.perf_counter()

    def take(self) -> list[Transfer]:
        """The transfers recorded since the last call (and forget them)."""
        taken, self.transfers = self.transfers, []
        return taken


def _human_rate(rate: float) -> str:
    for unit, size in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if rate >= size:
            return f"{rate / size:.3g} {unit}"
    return f"{rate:.3g} B/s"
