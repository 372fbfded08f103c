"""How much of the modelled link the schedule hides, and why the rest is exposed (paper Sec. 4.1, 4.2, Table 4).

From the :class:`fcsd.bench.modelled_link.Transfer` records of one rank's step (forward and backward, or a prefill):

- **link time** ``L``: what the modelled link takes for a transfer (latency + bytes / bandwidth);
- **hidden**: the part of ``L`` during which this rank computed instead of waiting: ``L`` minus the time the transfer
  was in flight while the rank was blocked in a wait (its own or another's);
- **window** ``W``: the compute the schedule placed between the transfer's launch and its wait (the time between
  them minus any time blocked in other waits), measured per transfer: the **structural limit** is ``min(L, W)``,
  the most a schedule placing that much compute there can hide;
- **schedule efficiency** = hidden / structural limit: ~1 when the schedule hides all its windows allow; a low hidden
  share with a high efficiency means this model has too little compute for this link, not a wrong schedule.

The exposed remainder ``L - hidden`` is split by cause: ``last_combine`` (the last MoE layer's Combine, forward, or
the last all-reduce of a prefill: no next layer to hide behind), ``counts`` (the per-expert counts exchange, which
blocks by design: the split sizes must be known before the rows move), ``no_window`` (the window was shorter than
the transfer: ``max(0, L - W)``), ``queued`` (the rest: the transfer waited for the serial link or ran while the rank
was blocked elsewhere). Hidden shares here are comparable to the paper's "all-to-all % overlap" (Table 4: 87.6%
forward, 89.0% backward) and all-reduce overlap (Sec. 5.2: 95.3-97.6% prefill), measured the same way: the share of
communication time that ran alongside compute.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from fcsd.bench.modelled_link import Transfer
from fcsd.bench.timeline import _union

CAUSES = ("last_combine", "counts", "no_window", "queued")
LAST_KINDS = ("combine", "all_reduce")  # what the last MoE layer of a forward waits itself


def _inside(intervals, start: float, end: float) -> float:
    """Length of ``[start, end]`` covered by the (merged) ``intervals``."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in intervals if b > start and a < end)


def blocked_intervals(transfers: list[Transfer]) -> list[tuple[float, float]]:
    """When this rank was blocked in a wait (merged intervals): from each wait's call to its return."""
    spans = []
    for t in transfers:
        waited = t.launched if t.waited is None else t.waited
        spans.append((waited, t.done if t.done is not None else t.delivered))
    return _union(spans)


def kind_name(kind: str, phase: str) -> str:
    """The reported name of a transfer: ``dispatch``, ``combine (backward)`` (the reverse in backward), ..."""
    return f"{kind} (backward)" if phase == "backward" else kind


@dataclass
class Figures:
    """Sums over transfers, in seconds."""

    count: int = 0
    link: float = 0.0
    hidden: float = 0.0
    window: float = 0.0
    structural: float = 0.0
    real_wait: float = 0.0  # time blocked on the real collective after the modelled delivery (a late rank)
    exposed: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))

    def add(self, other: Figures) -> None:
        self.count += other.count
        self.link += other.link
        self.hidden += other.hidden
        self.window += other.window
        self.structural += other.structural
        self.real_wait += other.real_wait
        for cause, seconds in other.exposed.items():
            self.exposed[cause] += seconds

    def as_dict(self, divide: float = 1.0) -> dict:
        """Per-unit (``divide``: e.g. steps x ranks) milliseconds and the shares."""
        ms = 1e3 / divide
        return {
            "count": self.count / divide,
            "link_ms": self.link * ms,
            "hidden_ms": self.hidden * ms,
            "window_ms": self.window * ms,
            "structural_ms": self.structural * ms,
            "hidden_share": self.hidden / self.link if self.link > 0 else float("nan"),
            "structural_limit": self.structural / self.link if self.link > 0 else float("nan"),
            "efficiency": self.hidden / self.structural if self.structural > 0 else float("nan"),
            "real_wait_ms": self.real_wait * ms,
            "exposed_ms": {cause: seconds * ms for cause, seconds in self.exposed.items()},
        }


def transfer_figures(transfers: list[Transfer]) -> list[tuple[Transfer, Figures]]:
    """Each transfer of one rank's step (in launch order) with its :class:`Figures` (see the module docstring)."""
    blocked = blocked_intervals(transfers)
    last = {}
    for index, t in enumerate(transfers):
        if t.phase != "backward" and t.kind in LAST_KINDS:
            last[t.phase] = index
    out = []
    for index, t in enumerate(transfers):
        link = t.link_seconds
        hidden = link - _inside(blocked, t.start, t.delivered)
        waited = t.launched if t.waited is None else t.waited
        window = max(0.0, waited - t.launched - _inside(blocked, t.launched, waited))
        done = t.done if t.done is not None else t.delivered
        figures = Figures(1, link, hidden, window, min(link, window), max(0.0, done - max(waited, t.delivered)))
        exposed = max(0.0, link - hidden)
        if t.kind == "counts":
            figures.exposed["counts"] = exposed
        elif last.get(t.phase) == index:
            figures.exposed["last_combine"] = exposed
        else:
            figures.exposed["no_window"] = min(exposed, max(0.0, link - window))
            figures.exposed["queued"] = exposed - figures.exposed["no_window"]
        out.append((t, figures))
    return out


def summarise(steps: list[list[Transfer]]) -> dict[str, dict[str, Figures]]:
    """``{phase: {kind name or "total": Figures}}`` summed over ``steps`` (each one rank's transfers of one step)."""
    table: dict[str, dict[str, Figures]] = defaultdict(lambda: defaultdict(Figures))
    for transfers in steps:
        for t, figures in transfer_figures(transfers):
            table[t.phase][kind_name(t.kind, t.phase)].add(figures)
            table[t.phase]["total"].add(figures)
    return {phase: dict(kinds) for phase, kinds in table.items()}
