"""Balanced correlated expert placement (second paper, Sec. V-A and Algorithm 1).

For each MoE layer, ``W[e, e']`` counts the tokens that select both ``e`` and ``e'``. :func:`partition` starts
from contiguous groups and applies the best improving pairwise swap until none remains (or ``max_swaps``), so
every group keeps exactly ``E / G`` experts. On ``N > 1`` nodes the partition is hierarchical: experts are split
across nodes first, then across the ``P / N`` ranks of each node.

Vectorised: the gain of every swap comes from ``C = W @ onehot(groups)`` (``C[e, g]``: co-selections of ``e``
with group ``g``), updated in ``O(E)`` per swap, so one swap step costs one ``E x E`` pass.

Group-limited routing (DeepSeek-V2/V3 ``n_group``): the router picks among contiguous blocks of ``E / n_group``
expert ids, so a placement may only move whole groups between ranks (``P <= n_group``) or experts within the
ranks of their own group (``P >= n_group``); :func:`correlated_placement` takes ``groups=n_group`` and keeps to
that, and :func:`fcsd.placement.reorder.apply_placement` refuses placements that break it.
"""

from __future__ import annotations

import numpy as np

from fcsd.placement.format import Placement, PlacementError, contiguous_ranks
from fcsd.placement.traces import Routes


def coselection(ids_TK: np.ndarray, num_experts: int) -> np.ndarray:
    """``W (E, E)`` int64: ``W[e, e']`` = tokens whose top-k holds both ``e`` and ``e'`` (zero diagonal)."""
    ids_TK = np.asarray(ids_TK, dtype=np.int64)
    k = ids_TK.shape[1]
    counts = np.zeros(num_experts * num_experts, dtype=np.int64)
    for i in range(k):
        for j in range(i + 1, k):
            counts += np.bincount(ids_TK[:, i] * num_experts + ids_TK[:, j], minlength=num_experts * num_experts)
    w = counts.reshape(num_experts, num_experts)
    w = w + w.T
    np.fill_diagonal(w, 0)
    return w


def intra_weight(w: np.ndarray, groups: np.ndarray) -> float:
    """Total ``W`` of the pairs that share a group (each pair once)."""
    same = groups[:, None] == groups[None, :]
    return float(w[same].sum()) / 2


def partition(w: np.ndarray, num_groups: int, max_swaps: int | None = None) -> np.ndarray:
    """Balanced partition of the ``E`` items of ``w`` into ``num_groups`` groups of ``E / num_groups``: best-swap
    local search from contiguous groups (Algorithm 1, procedure Partition). Returns the group of each item."""
    n = w.shape[0]
    if n % num_groups:
        raise PlacementError(f"{num_groups} groups do not divide {n} experts evenly")
    groups = np.arange(n) // (n // num_groups)
    if num_groups == 1 or n // num_groups == n:
        return groups
    w = np.asarray(w, dtype=np.float64)
    scale = max(float(np.abs(w).max()), 1.0)
    w32 = (w / scale).astype(np.float32)  # float32 passes: the search is memory-bound; gains are relative
    w2 = 2 * w32
    max_swaps = 20 * n if max_swaps is None else max_swaps
    c = w32 @ np.eye(num_groups, dtype=np.float32)[groups]  # C[e, g] = sum of W[e, members of g]
    blocked = np.where(groups[:, None] == groups[None, :], -np.inf, 0).astype(np.float32)  # no swap within a group
    rows = np.arange(n)
    gain = np.empty((n, n), dtype=np.float32)
    for _ in range(max_swaps):
        # moving a to g(b) and b to g(a): a gains C[a,g(b)] - C[a,g(a)], b likewise, minus the W[a,b] both counted
        np.take(c, groups, axis=1, out=gain)
        gain -= c[rows, groups][:, None]
        gain += gain.T.copy()
        gain -= w2
        gain += blocked
        best = int(np.argmax(gain))
        a, b = divmod(best, n)
        if not gain[a, b] > 0.5 / scale:  # gains are whole co-selection counts: below half a count is rounding
            break
        ga, gb = groups[a], groups[b]
        c[:, ga] += w32[:, b] - w32[:, a]
        c[:, gb] += w32[:, a] - w32[:, b]
        groups[a], groups[b] = gb, ga
        for x in (a, b):
            blocked[x, :] = np.where(groups == groups[x], -np.inf, 0)
            blocked[:, x] = blocked[x, :]
    return groups


def _place_layer(w: np.ndarray, ep: int, nodes: int, groups: int, max_swaps: int | None) -> np.ndarray:
    num_experts = w.shape[0]
    if groups > 1 and ep <= groups:
        # whole routing groups move between ranks: partition the group graph, each rank gets groups/ep groups
        size = num_experts // groups
        member = np.arange(num_experts) // size
        wg = np.zeros((groups, groups))
        np.add.at(wg, (member[:, None], member[None, :]), w)
        np.fill_diagonal(wg, 0)
        return _place_layer(wg, ep, nodes if nodes <= ep else 1, 1, max_swaps)[member]
    if groups > 1:
        # experts stay within the ranks of their routing group (ep / groups ranks each)
        top = np.arange(num_experts) // (num_experts // groups)
        per = ep // groups
        return _refine(w, top, per, max_swaps)
    if nodes > 1:
        top = partition(w, nodes, max_swaps)
        return _refine(w, top, ep // nodes, max_swaps)
    return partition(w, ep, max_swaps)


def _refine(w: np.ndarray, top: np.ndarray, per: int, max_swaps: int | None) -> np.ndarray:
    ranks = np.empty_like(top)
    for node in range(int(top.max()) + 1):
        members = np.flatnonzero(top == node)
        ranks[members] = node * per + partition(w[np.ix_(members, members)], per, max_swaps)
    return ranks


def correlated_placement(
    routes: Routes,
    ep: int,
    nodes: int = 1,
    groups: int | None = None,
    max_swaps: int | None = None,
    max_tokens: int | None = None,
) -> Placement:
    """Algorithm 1 on every MoE layer of ``routes``: a balanced placement (every rank exactly ``E / ep`` experts).

    ``nodes > 1`` partitions across nodes first (``ep`` ranks in ``nodes`` equal nodes). ``groups`` is the
    router's group-limited routing (default: the routes header's ``routing_groups``). ``max_tokens`` caps the
    tokens counted per layer (the first ones), ``max_swaps`` the swaps per partition (default ``20 E``).
    """
    num_experts = routes.num_experts
    groups = int(routes.header.get("routing_groups", 1) if groups is None else groups)
    check_sizes(num_experts, ep, nodes, groups)
    layers = {}
    for layer in routes.layers:
        ids = routes.layer(layer)
        if max_tokens is not None:
            ids = ids[:max_tokens]
        layers[layer] = _place_layer(coselection(ids, num_experts), ep, nodes, groups, max_swaps)
    return Placement(num_experts, ep, nodes, layers, source=_source(routes.header))


def contiguous_placement(routes: Routes, ep: int, nodes: int = 1) -> Placement:
    """The default sharding: expert ``e`` on rank ``e // (E / ep)``, every layer."""
    check_sizes(routes.num_experts, ep, nodes, 1)
    ranks = contiguous_ranks(routes.num_experts, ep)
    return Placement(routes.num_experts, ep, nodes, {layer: ranks for layer in routes.layers})


def check_sizes(num_experts: int, ep: int, nodes: int, groups: int = 1) -> None:
    """Clear errors for EP degrees, nodes and routing groups that cannot give a balanced placement."""
    if ep < 1 or num_experts % ep:
        raise PlacementError(f"--ep {ep} does not divide the {num_experts} experts; pick a divisor of {num_experts}")
    if nodes < 1 or ep % nodes:
        raise PlacementError(f"--nodes {nodes} does not divide --ep {ep}; every node needs the same number of ranks")
    if groups > 1 and ep % groups and groups % ep:
        raise PlacementError(
            f"the model routes within {groups} expert groups (group-limited routing), and --ep {ep} neither divides "
            f"nor is a multiple of {groups}; a placement must keep each group's experts together"
        )


def _source(header: dict) -> dict:
    keys = ("model", "model_type", "model_fingerprint", "tokens", "data", "data_fingerprint", "routing_groups")
    return {key: header[key] for key in keys if header.get(key) is not None}
