"""Expert coupling (second paper: Sec. II-B, V, Table I, Algorithms 1-2; design §5): routing capture, co-selection
and cross-layer statistics, balanced correlated placement, applying a placement, the token-shuffle planner.

The names load lazily (PEP 562), so that the command line's parser (``fcsd routes ...``) imports no torch."""

_PUBLIC = {
    "Placement": "fcsd.placement.format",
    "PlacementError": "fcsd.placement.format",
    "load_placement": "fcsd.placement.format",
    "Routes": "fcsd.placement.traces",
    "RoutesError": "fcsd.placement.traces",
    "load_routes": "fcsd.placement.traces",
    "apply_placement": "fcsd.placement.reorder",
    "check_placement": "fcsd.placement.reorder",
    "record_routes": "fcsd.placement.record",
    "contiguous_placement": "fcsd.placement.solver",
    "correlated_placement": "fcsd.placement.solver",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'fcsd.placement' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
