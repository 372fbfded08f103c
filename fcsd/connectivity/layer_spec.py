"""Layer selection specs: which decoder layers get FarSkip connectivity (paper Tab. 2, "Far 50/75/90/100%").

Grammar (whitespace is ignored)::

    all | none               every layer / no layer
    last:N | first:N         the last / first N layers
    last:P% | first:P%       the last / first P percent, rounded to the nearest layer (half rounds up)
    0,3,5-7                  explicit indices and inclusive ranges
    [0, 3, 5]                (Python) a list of ints

The paper converts the *last* layers when it converts a fraction, so ``last:50%`` is "Far 50%". A percentage that
rounds to no layer of the model (``last:1%`` of 4 layers) is an error naming the smallest spec that converts one, and
every command that converts (``fcsd convert``, ``fcsd plan``, ``fcsd export``) refuses a selection of no layer
(:func:`converted_layers`) before loading anything.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

GRAMMAR = (
    "layer spec grammar: 'all' | 'none' | 'last:N' | 'first:N' | 'last:P%' | 'first:P%' | "
    "'0,3,5-7' (indices and inclusive ranges) | a list of ints"
)


class EmptySelectionError(ValueError):
    """A layer spec that selects no layer where something must be converted."""


_EDGE = re.compile(r"^(first|last):(\d+(?:\.\d+)?)(%?)$")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_layer_spec(spec: str | int | Iterable[int] | None, num_layers: int) -> list[int]:
    """Resolve ``spec`` to the sorted list of layer indices it selects in a model of ``num_layers`` layers.

    Raises ``ValueError`` showing the grammar for a malformed spec, or the layer count for an index out of range.
    """
    if num_layers <= 0:
        raise ValueError(f"the model has no decoder layers (num_layers={num_layers})")
    if spec is None:
        return []
    if isinstance(spec, bool):
        raise ValueError(f"bad layer spec {spec!r}; {GRAMMAR}")
    if isinstance(spec, int):
        return _checked([spec], num_layers, spec)
    if not isinstance(spec, str):
        items = list(spec)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
            raise ValueError(f"bad layer spec {spec!r}: a list must hold ints; {GRAMMAR}")
        return _checked(items, num_layers, spec)

    text = re.sub(r"\s+", "", spec).lower()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if text == "all":
        return list(range(num_layers))
    if text in ("none", ""):
        return []
    edge = _EDGE.match(text)
    if edge:
        side, amount, percent = edge.groups()
        value = float(amount)
        if percent:
            if value > 100:
                raise ValueError(f"bad layer spec {spec!r}: a percentage must be at most 100%; {GRAMMAR}")
            count = percent_count(value, num_layers, f"layer spec {spec!r}", side)
        else:
            if not value.is_integer():
                raise ValueError(f"bad layer spec {spec!r}: a layer count must be a whole number; {GRAMMAR}")
            count = int(value)
            if count > num_layers:
                raise ValueError(f"layer spec {spec!r} asks for {count} layers but the model has {num_layers}")
        return list(range(count)) if side == "first" else list(range(num_layers - count, num_layers))

    indices: list[int] = []
    for part in text.split(","):
        match = _RANGE.match(part)
        if not match:
            raise ValueError(f"bad layer spec {spec!r} (at {part!r}); {GRAMMAR}")
        start = int(match.group(1))
        stop = int(match.group(2)) if match.group(2) is not None else start
        if stop < start:
            raise ValueError(f"bad layer spec {spec!r}: range {part!r} runs backwards; {GRAMMAR}")
        indices.extend(range(start, stop + 1))
    return _checked(indices, num_layers, spec)


def percent_count(percent: float, num_layers: int, spec, side: str = "last") -> int:
    """``percent`` % of ``num_layers``, rounded to the nearest layer (half rounds up). A positive percentage that
    rounds to no layer raises :class:`EmptySelectionError` naming the smallest ``side:P%`` (``side`` empty: ``P%``)
    that converts one; ``spec`` is what the user wrote, for the message."""
    count = math.floor(percent * num_layers / 100 + 0.5)
    if count == 0 and percent > 0:
        smallest = math.ceil(50 / num_layers)
        while math.floor(smallest * num_layers / 100 + 0.5) < 1:
            smallest += 1
        prefix = f"{side}:" if side else ""
        raise EmptySelectionError(
            f"{spec} rounds to no layer: {percent:g}% of the model's {num_layers} layers is "
            f"{percent * num_layers / 100:.2g}; the smallest that converts one layer is {prefix}{smallest}% "
            f"(or {prefix}1)"
        )
    return count


def converted_layers(spec, num_layers: int, what: str = "layer spec") -> list[int]:
    """The layers ``spec`` converts in a model of ``num_layers`` layers, refusing a selection of none
    (:class:`EmptySelectionError`): a conversion that converts nothing trains, plans or exports the stock model."""
    selected = parse_layer_spec(spec, num_layers)
    if not selected:
        raise EmptySelectionError(
            f"{what} {spec!r} selects no layer of the model's {num_layers} layers, so there is nothing to convert; "
            "choose e.g. all, last:50% or last:1"
        )
    return selected


def _checked(indices: list[int], num_layers: int, spec) -> list[int]:
    bad = [i for i in indices if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"layer spec {spec!r} names layer(s) {bad} but the model has {num_layers} layers "
            f"(valid: 0-{num_layers - 1})"
        )
    return sorted(set(indices))


def format_layers(indices: Iterable[int]) -> str:
    """Compact form of a sorted index list, e.g. ``[0, 1, 2, 5]`` -> ``'0-2,5'`` (parses back with the grammar)."""
    indices = sorted(set(indices))
    if not indices:
        return "none"
    parts, start, prev = [], indices[0], indices[0]
    for i in indices[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts)
