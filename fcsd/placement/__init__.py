"""Expert coupling (second paper: Sec. II-B, V, Table I, Algorithms 1-2; design §5): routing capture, co-selection
and cross-layer statistics, balanced correlated placement, applying a placement, the token-shuffle planner."""

from fcsd.placement.apply import apply_placement, check_placement
from fcsd.placement.format import Placement, PlacementError, load_placement
from fcsd.placement.record import record_routes
from fcsd.placement.solver import contiguous_placement, correlated_placement
from fcsd.placement.traces import Routes, RoutesError, load_routes

__all__ = [
    "Placement",
    "PlacementError",
    "Routes",
    "RoutesError",
    "apply_placement",
    "check_placement",
    "contiguous_placement",
    "correlated_placement",
    "load_placement",
    "load_routes",
    "record_routes",
]
