"""Routing traces: every token's top-k expert ids (and weights) at every MoE layer, on disk and in memory.

The offline statistics of the second paper (Sec. II-B: "We record every token's expert choices at every MoE layer
... fit each placement and predictor on some of these steps, and apply them to the recorded routes of the other
steps") all read this one format.

On disk a routes file is one safetensors file:

* ``ids``: ``(L, T, k)`` integer expert ids (int16 when ``E <= 32767``, else int32), ``L`` MoE layers in decoder
  order, ``T`` tokens in the order they were read (sequence after sequence), ``k`` experts per token;
* ``weights``: ``(L, T, k)`` float16 routing weights as the router returned them (optional);
* a JSON header in the safetensors metadata under ``fcsd_routes``: ``format``, ``version``, ``model``,
  ``model_type``, ``model_fingerprint`` (a hash of the routing-relevant architecture), ``layers`` (decoder-layer
  indices of the ``L`` rows), ``num_experts``, ``top_k``, ``tokens``, ``seq_len``, ``routing_groups``, ``data``,
  ``split``, ``data_fingerprint``, ``placement`` (the placement already applied to the model, if any).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FORMAT = "fcsd-routes"
VERSION = 1
METADATA_KEY = "fcsd_routes"


class RoutesError(ValueError):
    """A routes file that cannot be read, or that does not belong with what it is used with."""


def model_fingerprint(model_type: str, layers: list[int], num_experts: int, top_k: int, hidden_size: int) -> str:
    """A short hash of what routes depend on structurally: two models with the same one share expert ids."""
    key = json.dumps([model_type, list(layers), num_experts, top_k, hidden_size])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass
class Routes:
    """Top-k routes of ``T`` tokens at ``L`` MoE layers: ``ids[l, t]`` are token ``t``'s experts at ``layers[l]``."""

    ids: np.ndarray  # (L, T, k) integer (kept in its stored width; :meth:`layer` returns int64)
    header: dict
    weights: np.ndarray | None = None  # (L, T, k) float16
    _index: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.ids.ndim != 3:
            raise RoutesError(f"routes ids must be (layers, tokens, k), got shape {self.ids.shape}")
        self.header.setdefault("layers", list(range(self.ids.shape[0])))
        self.header.setdefault("num_experts", int(self.ids.max()) + 1 if self.ids.size else 0)
        self.header.setdefault("top_k", self.ids.shape[2])
        self.header.setdefault("routing_groups", 1)
        self.header["tokens"] = int(self.ids.shape[1])
        if len(self.header["layers"]) != self.ids.shape[0]:
            raise RoutesError(f"header names {len(self.header['layers'])} layers, the ids hold {self.ids.shape[0]}")
        self._index = {int(layer): row for row, layer in enumerate(self.header["layers"])}

    @property
    def layers(self) -> list[int]:
        return [int(x) for x in self.header["layers"]]

    @property
    def num_experts(self) -> int:
        return int(self.header["num_experts"])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[2])

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[1])

    def layer(self, decoder_index: int) -> np.ndarray:
        """``(T, k)`` ids at decoder layer ``decoder_index``; a clear error for a layer the routes do not hold."""
        if int(decoder_index) not in self._index:
            raise RoutesError(
                f"the routes hold no MoE layer {decoder_index}; their layers are {self.layers} "
                f"(decoder-layer indices of the model's MoE layers)"
            )
        return self.ids[self._index[int(decoder_index)]].astype(np.int64)

    def split(self, holdout: float) -> tuple[Routes, Routes]:
        """``(fit, held_out)``: the last ``holdout`` share of the sequences is held out (whole sequences)."""
        if not 0.0 < holdout < 1.0:
            raise RoutesError(f"--holdout must be between 0 and 1 (exclusive), got {holdout}")
        seq = int(self.header.get("seq_len") or 1)
        sequences = max(self.num_tokens // seq, 1)
        held = min(max(round(sequences * holdout), 1), sequences - 1) if sequences > 1 else 0
        cut = (sequences - held) * seq if held else round(self.num_tokens * (1 - holdout))
        return self.select(slice(0, cut)), self.select(slice(cut, self.num_tokens))

    def select(self, tokens: slice) -> Routes:
        weights = self.weights[:, tokens] if self.weights is not None else None
        return Routes(self.ids[:, tokens], dict(self.header), weights)

    def save(self, path: str | Path) -> Path:
        from safetensors.numpy import save_file

        from fcsd.files.staging import atomic_file

        path = Path(path)
        dtype = np.int16 if self.num_experts <= np.iinfo(np.int16).max else np.int32
        tensors = {"ids": np.ascontiguousarray(self.ids, dtype=dtype)}
        if self.weights is not None:
            tensors["weights"] = np.ascontiguousarray(self.weights, dtype=np.float16)
        header = {"format": FORMAT, "version": VERSION, **self.header}
        with atomic_file(path) as staging:
            save_file(tensors, str(staging), metadata={METADATA_KEY: json.dumps(header)})
        return path


# a file fcsd cannot read as its own is never overwritten (fcsd.files.ownership.check_output_file): record into another
_RECORD_AGAIN = "record the routes again into a new file: `fcsd routes record MODEL --out NEW.routes`"


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:160] if lines else type(error).__name__


def load_routes(path: str | Path) -> Routes:
    """Read a routes file written by :meth:`Routes.save` (``fcsd routes record``)."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():  # a checkpoint folder, say: the routes are recorded from it into a file of their own
        raise RoutesError(
            f"{path} is a folder, not a routes file; record one with `fcsd routes record {path} --out "
            "routes.safetensors`"
        )
    if not path.is_file():
        raise RoutesError(f"no routes file at {path}; record one with `fcsd routes record MODEL --out {path}`")
    try:
        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
            names = set(f.keys())
            ids = f.get_tensor("ids") if "ids" in names else None
            weights = f.get_tensor("weights") if "weights" in names else None
    except Exception as error:  # safetensors raises its own error types for foreign files
        raise RoutesError(f"{path} is not a routes file ({_first_line(error)}); {_RECORD_AGAIN}") from None
    if ids is None or METADATA_KEY not in metadata:
        raise RoutesError(f"{path} is not a routes file (no fcsd_routes header); {_RECORD_AGAIN}")
    header = json.loads(metadata[METADATA_KEY])
    if header.get("format") != FORMAT or int(header.get("version", 0)) > VERSION:
        raise RoutesError(f"{path}: unsupported routes format {header.get('format')} v{header.get('version')}")
    return Routes(ids, header, weights)


def check_same_model(header: dict, other: dict, what: str) -> None:
    """Refuse to combine routes (or a placement fitted on them) with another model's: compares fingerprints."""
    mine, theirs = header.get("model_fingerprint"), other.get("model_fingerprint")
    if mine and theirs and mine != theirs:
        raise RoutesError(
            f"{what} come from another model ({other.get('model')}, {other.get('model_type')}, "
            f"{other.get('num_experts')} experts) than {header.get('model')} ({header.get('model_type')}, "
            f"{header.get('num_experts')} experts); record routes of this model with `fcsd routes record`"
        )
