"""Expert-coupling statistics (second paper, Sec. II-B, Table I, Fig. 2).

* :func:`dispatch_counts`: rows a plain all-to-all dispatch sends (one per (token, expert)) against a deduplicating
  one (one per (token, destination rank), Sec. V-A), and their bytes. The deduplicating dispatcher of
  :mod:`fcsd.parallel` must report the same numbers; this is the one definition both use.
* :func:`within_layer`: Table I's within-layer columns under a placement: ``same_gpu`` (tokens whose top-k experts
  share one rank), ``gpus_per_token`` (distinct destination ranks), ``dedup_removed`` (share of rows removed).
* :func:`coselection_summary`: share of co-selections carried by the top 1% of expert pairs, against independent
  routing with the same expert loads (Sec. II-B: "64 of the 8,128 possible pairs carry 42% ... independent routing
  with the same loads would give 1.6%").
* :func:`transition_summary`: cross-layer predictability ``P(e' at l+1 | e at l)`` (Fig. 2b).

Shapes: ``ids_TK`` are ``(tokens, k)`` expert ids, ``ranks_E`` the ``(E,)`` rank of each expert.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from fcsd.placement.solver import coselection

ID_BYTES, WEIGHT_BYTES = 4, 4  # routing metadata per (token, expert): int32 expert id + fp32 weight


@dataclass
class DispatchCounts:
    """Rows and bytes of one MoE layer's dispatch (the combine sends the same rows back)."""

    tokens: int
    assignments: int  # (token, expert) pairs = rows of the plain dispatcher
    rows_plain: int
    rows_dedup: int  # distinct (token, destination rank) pairs
    remote_plain: int  # rows leaving the token's own rank (when its source rank is known)
    remote_dedup: int
    bytes_plain: int  # hidden-state payload (plain rows carry no metadata)
    bytes_dedup: int
    remote_bytes_plain: int  # the same for the rows leaving the token's rank (all rows without a source rank)
    remote_bytes_dedup: int

    @property
    def dedup_removed(self) -> float:
        return 1.0 - self.rows_dedup / max(self.rows_plain, 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "dedup_removed": self.dedup_removed}


def destination_ranks(ids_TK: np.ndarray, ranks_E: np.ndarray) -> np.ndarray:
    """``(T, k)`` rank holding each selected expert."""
    return np.asarray(ranks_E)[np.asarray(ids_TK)]


def distinct_per_row(values_TK: np.ndarray) -> np.ndarray:
    """``(T,)`` number of distinct values in each row."""
    ordered = np.sort(values_TK, axis=1)
    return 1 + (np.diff(ordered, axis=1) != 0).sum(axis=1)


def dispatch_counts(
    ids_TK: np.ndarray,
    ranks_E: np.ndarray,
    source_T: np.ndarray | None = None,
    hidden_size: int = 0,
    elem_bytes: int = 2,
    weight_bytes: int = WEIGHT_BYTES,
) -> DispatchCounts:
    """Rows (and bytes) a plain and a deduplicating dispatcher send for these routes under ``ranks_E``.

    fcsd's wire formats (:mod:`fcsd.parallel.dispatchers`). Plain: one row per (token, expert), the hidden state
    alone (the expert id is implied by the row's position, the routing weight stays on the token's rank).
    Deduplicated: one row per (token, destination rank), the hidden state, plus an id and a weight per (token,
    expert) pair (the receiver sums a row's experts, so it needs them): ``ID_BYTES + weight_bytes`` per pair, fp32
    weights by default. ``source_T`` (the rank holding each token) counts the rows (and bytes) that leave their rank;
    without it every row counts as remote. ``elem_bytes``: bytes of one hidden value on the wire (the compute dtype).
    """
    tokens, k = ids_TK.shape
    dest = destination_ranks(ids_TK, ranks_E)
    distinct = distinct_per_row(dest)
    rows_plain, rows_dedup = tokens * k, int(distinct.sum())
    if source_T is None:
        remote_plain, remote_dedup = rows_plain, rows_dedup
    else:
        local = dest == np.asarray(source_T)[:, None]
        remote_plain = int((~local).sum())
        remote_dedup = rows_dedup - int(local.any(axis=1).sum())
    pair_meta = ID_BYTES + weight_bytes
    meta = pair_meta * tokens * k
    payload = hidden_size * elem_bytes
    return DispatchCounts(
        tokens=tokens,
        assignments=tokens * k,
        rows_plain=rows_plain,
        rows_dedup=rows_dedup,
        remote_plain=remote_plain,
        remote_dedup=remote_dedup,
        bytes_plain=rows_plain * payload,
        bytes_dedup=rows_dedup * payload + meta,
        remote_bytes_plain=remote_plain * payload,
        remote_bytes_dedup=remote_dedup * payload + remote_plain * pair_meta,  # remote pairs = remote plain rows
    )


def within_layer(ids_TK: np.ndarray, ranks_E: np.ndarray) -> dict:
    """Table I, within layer: ``same_gpu``, ``gpus_per_token``, ``dedup_removed`` (fractions; GPUs a mean)."""
    distinct = distinct_per_row(destination_ranks(ids_TK, ranks_E))
    k = ids_TK.shape[1]
    return {
        "same_gpu": float((distinct == 1).mean()),
        "gpus_per_token": float(distinct.mean()),
        "dedup_removed": float(1.0 - distinct.mean() / k),
    }


def coselection_summary(ids_TK: np.ndarray, num_experts: int, top_share: float = 0.01) -> dict:
    """Share of pair co-selections carried by the top ``top_share`` of expert pairs, observed vs independent
    routing with the same per-expert loads; and how many experts have one partner in >= 30% of their tokens."""
    w = coselection(ids_TK, num_experts).astype(np.float64)
    upper = np.triu_indices(num_experts, 1)
    observed = w[upper]
    loads = np.bincount(ids_TK.ravel(), minlength=num_experts).astype(np.float64)
    independent = np.outer(loads, loads)[upper]
    top = max(1, round(top_share * observed.size))

    def share(values):
        total = values.sum()
        return float(np.sort(values)[::-1][:top].sum() / total) if total > 0 else 0.0

    partner = np.divide(w.max(axis=1), loads, out=np.zeros(num_experts), where=loads > 0)
    return {
        "top_pairs": int(top),
        "top_pairs_share": share(observed),
        "independent_share": share(independent),
        "experts_with_partner_30": int((partner >= 0.3).sum()),
    }


def transition_matrix(ids_prev_TK: np.ndarray, ids_next_TK: np.ndarray, num_experts: int) -> np.ndarray:
    """``(E, E)`` ``P(e' in top-k at the next layer | e in top-k at this layer)`` (rows sum to k)."""
    e = num_experts
    counts = np.zeros(e * e, dtype=np.int64)
    for i in range(ids_prev_TK.shape[1]):
        for j in range(ids_next_TK.shape[1]):
            counts += np.bincount(ids_prev_TK[:, i] * e + ids_next_TK[:, j], minlength=e * e)
    counts = counts.reshape(e, e).astype(np.float64)
    loads = np.bincount(ids_prev_TK.ravel(), minlength=e).astype(np.float64)
    return np.divide(counts, loads[:, None], out=np.zeros_like(counts), where=loads[:, None] > 0)


def transition_summary(ids_prev_TK: np.ndarray, ids_next_TK: np.ndarray, num_experts: int) -> dict:
    """Fig. 2b in numbers: per expert the largest ``P(e' | e)``; its median and how many experts send >= 30%."""
    best = transition_matrix(ids_prev_TK, ids_next_TK, num_experts).max(axis=1)
    return {"median_top_successor": float(np.median(best)), "experts_with_successor_30": int((best >= 0.3).sum())}
