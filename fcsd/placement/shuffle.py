"""Token-shuffle planner (second paper, Sec. V-B and Algorithm 2), offline part.

From routing traces and a placement, for every MoE position ``m`` (the ``m``-th MoE layer of the routes):

* first-order table ``F_m[e, r]``: where (which ranks) the layer-``m`` experts of tokens that used expert ``e`` at
  position ``m - 1`` live, as a distribution over ranks;
* second-order table ``S_m[(e', e), r]`` for the pair ``e'`` at ``m - 2``, ``e`` at ``m - 1``, and its support
  ``n_m[e', e]`` (observations).

:meth:`ShufflePlanner.predict` mixes them per expert pair with back-off weight ``w = min(n / (n + beta), w_max)``
(Algorithm 2 lines 4-8); :func:`assign_owners` gives every token an owner rank, most confident first
(``d(1) - d(2)``), each to its most preferred rank with capacity left, every rank exactly ``T / P`` tokens
(lines 10-13). It is the exact sequential greedy, vectorised: between two moments where a rank fills up the open
ranks do not change, so each such stretch of tokens is assigned at once (at most ``P`` rounds).

Applying the plan inside a sequence-parallel reduce-scatter is not part of this module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from fcsd.placement.format import Placement
from fcsd.placement.traces import Routes


def rank_counts(ids_TK: np.ndarray, ranks_E: np.ndarray, num_ranks: int) -> np.ndarray:
    """``(T, P)``: how many of each token's experts sit on each rank."""
    tokens = ids_TK.shape[0]
    dest = np.asarray(ranks_E)[ids_TK]
    flat = (np.arange(tokens)[:, None] * num_ranks + dest).ravel()
    return np.bincount(flat, minlength=tokens * num_ranks).reshape(tokens, num_ranks).astype(np.float32)


def _normalise(counts: np.ndarray, empty: float) -> np.ndarray:
    totals = counts.sum(axis=1, keepdims=True)
    out = np.full(counts.shape, empty, dtype=np.float32)
    np.divide(counts, totals, out=out, where=totals > 0)
    return out


@dataclass
class PositionTables:
    first: np.ndarray  # (E, P)
    second: np.ndarray | None  # (E * E, P), row e' * E + e
    support: np.ndarray | None  # (E * E,)


@dataclass
class ShufflePlanner:
    """Prediction tables per MoE position, fitted by :meth:`fit`; ``beta`` back-off, ``w_max`` cap (Algorithm 2)."""

    placement: Placement
    layers: list[int]
    beta: float = 8.0
    w_max: float = 0.9
    order: int = 2  # 1: first-order table only (Table I "token moved"); 2: Algorithm 2
    tables: dict[int, PositionTables] = field(default_factory=dict)

    @classmethod
    def fit(cls, routes: Routes, placement: Placement, beta: float = 8.0, w_max: float = 0.9, order: int = 2):
        """Count ``F_m``, ``S_m``, ``n_m`` on ``routes`` under ``placement`` for every MoE position ``m >= 1``."""
        planner = cls(placement, routes.layers, beta, w_max, order)
        e, p = routes.num_experts, placement.ep
        layers = routes.layers
        for m in range(1, len(layers)):
            here = rank_counts(routes.layer(layers[m]), placement.ranks(layers[m]), p)
            prev = routes.layer(layers[m - 1])
            first = np.zeros((e, p), dtype=np.float64)
            for j in range(prev.shape[1]):
                for r in range(p):
                    first[:, r] += np.bincount(prev[:, j], weights=here[:, r], minlength=e)
            second = support = None
            if order >= 2 and m >= 2:
                pprev = routes.layer(layers[m - 2])
                second = np.zeros((e * e, p), dtype=np.float64)
                support = np.zeros(e * e, dtype=np.float64)
                for a in range(pprev.shape[1]):
                    for j in range(prev.shape[1]):
                        key = pprev[:, a] * e + prev[:, j]
                        support += np.bincount(key, minlength=e * e)
                        for r in range(p):
                            second[:, r] += np.bincount(key, weights=here[:, r], minlength=e * e)
                second = _normalise(second, 0.0)
            planner.tables[m] = PositionTables(_normalise(first, 1.0 / p), second, support)
        return planner

    def predict(self, m: int, ids_prev_TK: np.ndarray, ids_pprev_TK: np.ndarray | None = None) -> np.ndarray:
        """``(T, P)`` predicted distribution of each token's position-``m`` experts over ranks (lines 4-8)."""
        t = self.tables[m]
        e = t.first.shape[0]
        d = np.zeros((ids_prev_TK.shape[0], t.first.shape[1]), dtype=np.float32)
        for j in range(ids_prev_TK.shape[1]):
            first = t.first[ids_prev_TK[:, j]]
            if t.second is None or ids_pprev_TK is None:
                d += first
                continue
            for a in range(ids_pprev_TK.shape[1]):
                key = ids_pprev_TK[:, a] * e + ids_prev_TK[:, j]
                n = t.support[key]
                w = np.minimum(n / (n + self.beta), self.w_max).astype(np.float32)[:, None]
                d += (1.0 - w) * first + w * t.second[key]
        return d / np.maximum(d.sum(axis=1, keepdims=True), 1e-12)

    def plan(self, routes: Routes, m: int, tokens: slice | None = None) -> np.ndarray:
        """Owner rank of each token (``tokens`` of ``routes``) for MoE position ``m`` from its earlier routes."""
        tokens = tokens or slice(None)
        prev = routes.layer(self.layers[m - 1])[tokens]
        pprev = routes.layer(self.layers[m - 2])[tokens] if m >= 2 and self.order >= 2 else None
        return assign_owners(self.predict(m, prev, pprev))


def assign_owners(d_TP: np.ndarray) -> np.ndarray:
    """Greedy capacity-constrained owners (Algorithm 2 lines 10-13): tokens in decreasing ``d(1) - d(2)``, each to
    its most preferred rank with capacity left; rank ``r`` takes ``T // P`` tokens (+1 for the first ``T % P``)."""
    tokens, ranks = d_TP.shape
    caps = np.full(ranks, tokens // ranks) + (np.arange(ranks) < tokens % ranks)
    if ranks == 1:
        return np.zeros(tokens, dtype=np.int64)
    top2 = np.partition(d_TP, ranks - 2, axis=1)[:, -2:]
    confidence = top2[:, 1] - top2[:, 0]
    remaining = np.argsort(-confidence, kind="stable")
    owner = np.full(tokens, -1, dtype=np.int64)
    scores = d_TP.astype(np.float32, copy=True)
    scores[:, caps == 0] = -np.inf
    while remaining.size:
        pref = np.argmax(scores[remaining], axis=1)
        counts = np.bincount(pref, minlength=ranks)
        full = np.flatnonzero((counts >= caps) & (caps > 0))
        if full.size == 0:
            owner[remaining] = pref
            break
        # position (in processing order) at which each rank would take its last free slot
        by_rank = np.argsort(pref, kind="stable")
        starts = np.cumsum(counts) - counts
        fill_at = by_rank[starts[full] + caps[full] - 1]
        stop = int(fill_at.min())
        closed = full[int(np.argmin(fill_at))]
        owner[remaining[: stop + 1]] = pref[: stop + 1]
        caps -= np.bincount(pref[: stop + 1], minlength=ranks)
        scores[:, closed] = -np.inf
        remaining = remaining[stop + 1 :]
    return owner


def local_share(ids_TK: np.ndarray, ranks_E: np.ndarray, owner_T: np.ndarray) -> float:
    """Mean share of each token's experts that sit on its owner rank."""
    return float((np.asarray(ranks_E)[ids_TK] == owner_T[:, None]).mean())


def home_ranks(tokens: int, num_ranks: int) -> np.ndarray:
    """Owner under plain sequence parallelism: contiguous slices of the step's tokens."""
    return np.arange(tokens) * num_ranks // tokens


def evaluate_shuffle(
    fit: Routes,
    held: Routes,
    placement: Placement,
    step_tokens: int = 4096,
    order: int = 2,
    beta: float = 8.0,
    w_max: float = 0.9,
) -> dict:
    """Local-expert share on ``held`` when tokens stay home (``local_stay``, ~1/P) vs when the planner fitted on
    ``fit`` moves them (``local_moved``), steps of ``step_tokens`` tokens, averaged over MoE positions ``m >= 1``;
    ``planner_ms`` is the planner's mean time per step and position (prediction + assignment, this CPU)."""
    planner = ShufflePlanner.fit(fit, placement, beta, w_max, order)
    layers = held.layers
    p = placement.ep
    step = max(p, min(step_tokens, held.num_tokens) // p * p)
    stay, moved, seconds, plans = [], [], 0.0, 0
    for m in range(1, len(layers)):
        ids = held.layer(layers[m])
        ranks = placement.ranks(layers[m])
        for start in range(0, held.num_tokens - step + 1, step):
            window = slice(start, start + step)
            begin = time.perf_counter()
            owner = planner.plan(held, m, window)
            seconds += time.perf_counter() - begin
            plans += 1
            moved.append(local_share(ids[window], ranks, owner))
            stay.append(local_share(ids[window], ranks, home_ranks(step, p)))
    if not plans:
        return {"local_stay": float("nan"), "local_moved": float("nan"), "planner_ms": float("nan"), "step": step}
    return {
        "local_stay": float(np.mean(stay)),
        "local_moved": float(np.mean(moved)),
        "planner_ms": 1000 * seconds / plans,
        "step_tokens": step,
    }
