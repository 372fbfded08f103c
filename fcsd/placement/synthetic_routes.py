"""Synthetic routes with planted structure, for tests and benchmarks (where the optimum is known).

At every layer the experts are split into hidden clusters (a random permutation, so contiguous placement does not
see them). A token picks a cluster; with probability ``pair_rate`` all its ``k`` experts come from that cluster,
otherwise ``k`` experts spread over the whole layer. With probability ``chain_rate`` the token's cluster at the
next layer is a fixed function of its cluster here (a planted cross-layer chain), else a random cluster.
Placing each cluster on one rank is then optimal (Sec. II-B's "stable pairs"), and the next layer's cluster is
predictable from this one (Fig. 2b).
"""

from __future__ import annotations

import numpy as np

from fcsd.placement.format import Placement
from fcsd.placement.traces import Routes


def _distinct(rng, rows: int, pool: int, k: int) -> np.ndarray:
    """``(rows, k)`` distinct offsets in ``[0, pool)``: ``base + j * stride`` with ``(k - 1) * stride < pool``."""
    base = rng.integers(0, pool, rows)
    stride = rng.integers(1, max((pool - 1) // max(k - 1, 1), 1) + 1, rows)
    return (base[:, None] + np.arange(k)[None, :] * stride[:, None]) % pool


def planted_routes(
    num_experts: int = 32,
    top_k: int = 2,
    num_layers: int = 4,
    tokens: int = 8192,
    cluster_size: int = 4,
    pair_rate: float = 0.8,
    chain_rate: float = 0.8,
    seq_len: int = 512,
    seed: int = 0,
) -> tuple[Routes, list[np.ndarray]]:
    """Routes with planted clusters and chains, and the clusters (``(E,)`` cluster of each expert) per layer."""
    if num_experts % cluster_size or top_k > cluster_size:
        raise ValueError("cluster_size must divide num_experts and be at least top_k")
    rng = np.random.default_rng(seed)
    clusters = num_experts // cluster_size
    ids = np.empty((num_layers, tokens, top_k), dtype=np.int16)
    truth = []
    cluster = rng.integers(0, clusters, tokens)
    for layer in range(num_layers):
        members = rng.permutation(num_experts).reshape(clusters, cluster_size)  # members[c] = experts of cluster c
        of_expert = np.empty(num_experts, dtype=np.int64)
        of_expert[members.ravel()] = np.repeat(np.arange(clusters), cluster_size)
        truth.append(of_expert)
        if layer:
            successor = rng.permutation(clusters)
            chained = rng.random(tokens) < chain_rate
            cluster = np.where(chained, successor[cluster], rng.integers(0, clusters, tokens))
        inside = members[cluster[:, None], _distinct(rng, tokens, cluster_size, top_k)]
        spread = _distinct(rng, tokens, num_experts, top_k)
        planted = rng.random(tokens) < pair_rate
        ids[layer] = np.where(planted[:, None], inside, spread)
    header = {
        "model": "synthetic",
        "model_type": "synthetic",
        "layers": list(range(num_layers)),
        "num_experts": num_experts,
        "top_k": top_k,
        "seq_len": seq_len,
        "routing_groups": 1,
    }
    return Routes(ids, header), truth


def cluster_placement(truth: list[np.ndarray], ep: int) -> Placement:
    """The planted optimum when clusters are rank-sized: cluster ``c`` on rank ``c`` (needs ``E / ep`` experts per
    cluster)."""
    num_experts = truth[0].size
    return Placement(num_experts, ep, 1, {layer: clusters for layer, clusters in enumerate(truth)})
