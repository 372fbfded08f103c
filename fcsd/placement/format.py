"""The placement file (second paper, Sec. V-A: "a per-layer permutation of global expert IDs").

Stable format, one JSON object::

    {"num_experts": E, "ep": P, "nodes": N,
     "layers": {"<decoder layer index>": [rank of expert 0, rank of expert 1, ...], ...},
     "source": {...}}            # optional: the routes it was fitted on (model, model_fingerprint, tokens, data)

Every listed layer gives each of its ``E`` experts a rank in ``[0, P)``, every rank exactly ``E / P`` experts.
Expert ids are those of the model the routes were recorded on. Layers not listed keep contiguous placement.
Rank ``r`` sits on node ``r // (P / N)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


class PlacementError(ValueError):
    """A placement that is malformed, unbalanced, or does not fit the model or routes it is used with."""


def contiguous_ranks(num_experts: int, ep: int) -> np.ndarray:
    return np.arange(num_experts) // (num_experts // ep)


@dataclass
class Placement:
    """Balanced expert-to-rank maps, one per MoE layer (decoder-layer index -> ``(E,)`` ranks)."""

    num_experts: int
    ep: int
    nodes: int
    layers: dict[int, np.ndarray]
    source: dict = field(default_factory=dict)

    def __post_init__(self):
        self.layers = {int(k): np.asarray(v, dtype=np.int64) for k, v in self.layers.items()}
        self.validate()

    def validate(self, where: str = "placement") -> None:
        e, p, n = self.num_experts, self.ep, self.nodes
        if p < 1 or e % p:
            raise PlacementError(f"{where}: ep {p} does not divide num_experts {e}")
        if n < 1 or p % n:
            raise PlacementError(f"{where}: nodes {n} does not divide ep {p}")
        for layer, ranks in self.layers.items():
            if ranks.shape != (e,):
                raise PlacementError(f"{where}: layer {layer} lists {ranks.size} ranks for {e} experts")
            if ranks.min() < 0 or ranks.max() >= p:
                raise PlacementError(f"{where}: layer {layer} has ranks outside [0, {p})")
            counts = np.bincount(ranks, minlength=p)
            if (counts != e // p).any():
                raise PlacementError(
                    f"{where}: layer {layer} is unbalanced (ranks hold {counts.min()}..{counts.max()} experts, "
                    f"every rank must hold exactly {e // p})"
                )

    def ranks(self, layer: int) -> np.ndarray:
        """``(E,)`` rank of each expert at decoder layer ``layer`` (contiguous for a layer not listed)."""
        ranks = self.layers.get(int(layer))
        return ranks if ranks is not None else contiguous_ranks(self.num_experts, self.ep)

    def order(self, layer: int) -> np.ndarray:
        """The expert permutation that realises the placement under contiguous sharding: new slot ``j`` holds
        old expert ``order[j]`` (experts sorted by rank, by id within a rank)."""
        return np.argsort(self.ranks(layer), kind="stable")

    def to_dict(self) -> dict:
        out = {
            "num_experts": int(self.num_experts),
            "ep": int(self.ep),
            "nodes": int(self.nodes),
            "layers": {str(k): [int(r) for r in v] for k, v in sorted(self.layers.items())},
        }
        if self.source:
            out["source"] = self.source
        return out

    def save(self, path: str | Path) -> Path:
        from fcsd.files.staging import atomic_file

        path = Path(path)
        with atomic_file(path) as staging:
            staging.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def from_dict(cls, data, where: str = "placement") -> Placement:
        if not isinstance(data, dict):
            raise PlacementError(f"{where}: expected a JSON object with num_experts, ep, nodes, layers")
        missing = [key for key in ("num_experts", "ep", "layers") if key not in data]
        if missing:
            raise PlacementError(f"{where}: missing {', '.join(missing)}; write it with `fcsd routes place`")
        layers = data["layers"]
        if not isinstance(layers, dict):
            raise PlacementError(f'{where}: "layers" must map decoder-layer indices to lists of ranks')
        try:
            parsed = {int(k): np.asarray(v, dtype=np.int64) for k, v in layers.items()}
            return cls(
                int(data["num_experts"]),
                int(data["ep"]),
                int(data.get("nodes", 1)),
                parsed,
                dict(data.get("source") or {}),
            )
        except (TypeError, ValueError) as error:
            if isinstance(error, PlacementError):
                raise
            raise PlacementError(f"{where}: malformed ({error}); write it with `fcsd routes place`") from None


def load_placement(path_or_dict) -> Placement:
    """A :class:`Placement` from a PLACEMENT.json path, a dict, or a Placement (returned as is)."""
    if isinstance(path_or_dict, Placement):
        return path_or_dict
    if isinstance(path_or_dict, dict):
        return Placement.from_dict(path_or_dict)
    path = Path(path_or_dict)
    if not path.is_file():
        raise PlacementError(
            f"no placement file at {path}; write one with `fcsd routes place ROUTES --ep P --out {path}`"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise PlacementError(f"{path} is not valid JSON ({error}); write it with `fcsd routes place`") from None
    return Placement.from_dict(data, where=str(path))
