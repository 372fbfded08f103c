"""How fcsd writes durations: in s, ms or us, whichever shows the figure. A small model's step in ``fcsd plan`` is
milliseconds or microseconds, which a fixed ``0.00 s`` would hide (and a ratio of two such figures would then read
"1.26x as fast (0.00 s vs 0.00 s)"); a modelled link's latency (:mod:`fcsd.bench.modelled_link`) is microseconds. A
neutral module: the plan and the parallel package both use it (``fcsd.parallel`` does not import ``fcsd.plan``)."""

from __future__ import annotations

UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6))


def time_unit(*seconds: float) -> tuple[str, float]:
    """``(name, seconds per unit)``: the largest unit in which the largest of ``seconds`` is at least 1 (seconds for
    nothing but zeros); one unit for figures set side by side, such as a table's column."""
    largest = max((abs(s) for s in seconds), default=0.0)
    return next(((name, size) for name, size in UNITS if largest >= size), UNITS[-1] if largest else UNITS[0])


def duration(seconds: float) -> str:
    """``seconds`` in its own unit with two decimals: ``8.03 s``, ``12.40 ms``, ``310.52 us``, ``0 s``."""
    if seconds == 0:
        return "0 s"
    name, size = time_unit(seconds)
    return f"{seconds / size:.2f} {name}"
