"""Where a token's experts sit: the expected number of distinct nodes and GPUs of an expert-parallel group that its
``top_k`` experts reach, which is what a node-aware dispatch sends (paper Sec. 4.1's Dispatch and Combine; design §4
"EP across nodes").

Layout (the trainer's): an EP group of ``P`` consecutive GPUs, each holding ``E / P`` consecutive experts (expert
``e`` on GPU ``e // (E / P)``), ``node_size`` consecutive GPUs a node. Routing model: every token picks ``top_k``
distinct experts uniformly at random; with DeepSeek-V3's group-limited routing (``n_group``, ``topk_group`` in its
config) it first picks ``topk_group`` of the ``n_group`` expert groups uniformly (group ``g`` holds experts
``g * E / n_group ...`` consecutively), then ``top_k`` experts uniformly among the experts of those groups. The
token's own GPU is uniform over the group and independent of its routing (balanced, as the memory simulation
assumes), which gives the counts of rows that leave a node or a GPU by symmetry (:class:`Reach`).

Exact: for every choice of groups (one when routing is not group-limited) the chance that a node (a GPU) holding
``o`` of the ``u`` experts the token may pick is missed is ``C(u - o, k) / C(u, k)``; the expectation sums over
nodes and averages over the choices. Beyond :data:`MAX_EXACT` choices of groups a fixed-seed Monte Carlo of
:data:`SAMPLES` tokens draws the same model.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

MAX_EXACT = 20_000  # group choices enumerated exactly; beyond, the Monte Carlo
SAMPLES = 1 << 15
SEED = 0


@dataclass(frozen=True)
class Reach:
    """Per token and MoE layer: ``nodes`` and ``gpus`` of the EP group its experts reach (expected), ``top_k``, and
    the group's ``num_nodes`` and ``node_size``. The rows that move follow, with the token's GPU uniform:"""

    nodes: float
    gpus: float
    top_k: int
    num_nodes: int
    node_size: int

    @property
    def remote_nodes(self) -> float:
        """Nodes other than the token's own it sends to: one hierarchical row each."""
        return self.nodes * (1 - 1 / self.num_nodes)

    @property
    def fan_out_rows(self) -> float:
        """Rows a hierarchical dispatch moves inside nodes: one per GPU reached, except the GPU a row lands on (its
        rail peer in a remote node, the token's own GPU in its node: the same position, chance 1 / node_size)."""
        return self.gpus * (1 - 1 / self.node_size)

    @property
    def remote_pairs(self) -> float:
        """(token, expert) pairs on other nodes: a plain dispatch's rows across nodes, the routing pairs beside the
        hierarchical rows."""
        return self.top_k * (1 - 1 / self.num_nodes)

    @property
    def fan_out_pairs(self) -> float:
        """(token, expert) pairs not on the GPU their row lands on: the pairs beside the fan-out rows."""
        return self.top_k * (1 - 1 / self.node_size)

    @property
    def node_local_pairs(self) -> float:
        """(token, expert) pairs on another GPU of the token's own node: a plain dispatch's rows inside it."""
        return self.top_k * (self.node_size - 1) / (self.num_nodes * self.node_size)


def _check(num_experts: int, top_k: int, ep: int, node_size: int, n_group: int, topk_group: int) -> None:
    if num_experts % ep or (ep > node_size and ep % node_size):
        raise ValueError(
            f"EP {ep} over nodes of {node_size} GPUs with {num_experts} experts: the EP size must divide the experts "
            "and be a divisor or a multiple of the GPUs per node"
        )
    if num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(
            f"n_group {n_group}, topk_group {topk_group} with {num_experts} experts: the groups must split the experts "
            "evenly and a token picks between 1 and n_group of them (the model's config.json)"
        )
    if top_k > topk_group * num_experts // n_group:
        raise ValueError(f"top_k {top_k} is more than the {topk_group} groups a token picks hold: check the config")


def _holders(num_experts: int, ep: int, node_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The GPU and the node (inside the EP group) of every expert."""
    gpu = np.arange(num_experts) // (num_experts // ep)
    return gpu, gpu // min(node_size, ep)


def reach(
    num_experts: int,
    top_k: int,
    ep: int,
    node_size: int,
    n_group: int = 1,
    topk_group: int = 1,
    max_exact: int = MAX_EXACT,
) -> Reach:
    """The :class:`Reach` of one token (see the module docstring); a layout or routing that cannot exist is a
    one-line error."""
    n_group, topk_group = max(1, n_group or 1), max(1, topk_group or 1)
    _check(num_experts, top_k, ep, node_size, n_group, topk_group)
    gpu, node = _holders(num_experts, ep, node_size)
    num_nodes = int(node.max()) + 1
    if math.comb(n_group, topk_group) > max_exact:
        nodes, gpus = _sampled(num_experts, top_k, n_group, topk_group, gpu, node)
    else:
        nodes, gpus = _exact(num_experts, top_k, n_group, topk_group, gpu, node)
    return Reach(nodes, gpus, top_k, num_nodes, min(node_size, ep))


def _exact(num_experts, top_k, n_group, topk_group, gpu, node) -> tuple[float, float]:
    group = np.arange(num_experts) // (num_experts // n_group)
    choices = np.array(list(itertools.combinations(range(n_group), topk_group)))
    chosen = np.zeros((len(choices), n_group))
    np.put_along_axis(chosen, choices, 1.0, axis=1)
    allowed = chosen[:, group]  # (choices, experts): 1 where a token making that choice may pick the expert
    u = int(allowed[0].sum())
    missed = np.array([math.comb(u - o, top_k) / math.comb(u, top_k) for o in range(u + 1)])
    found = []
    for holder in (node, gpu):
        members = np.zeros((num_experts, int(holder.max()) + 1))
        members[np.arange(num_experts), holder] = 1.0
        overlap = np.rint(allowed @ members).astype(int)  # (choices, holders): experts it may pick there
        found.append(float((1.0 - missed[overlap]).sum(axis=1).mean()))
    return found[0], found[1]


def _sampled(num_experts, top_k, n_group, topk_group, gpu, node, samples=SAMPLES) -> tuple[float, float]:
    rng = np.random.default_rng(SEED)
    group = np.arange(num_experts) // (num_experts // n_group)
    picked_groups = np.argsort(rng.random((samples, n_group)), axis=1)[:, :topk_group]
    chosen = np.zeros((samples, n_group), dtype=bool)
    np.put_along_axis(chosen, picked_groups, True, axis=1)
    scores = np.where(chosen[:, group], rng.random((samples, num_experts)), -1.0)
    experts = np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k]
    return _distinct(node[experts]), _distinct(gpu[experts])


def _distinct(values: np.ndarray) -> float:
    ordered = np.sort(values, axis=1)
    return float((1 + (np.diff(ordered, axis=1) != 0).sum(axis=1)).mean())


def model_reach(shape, model_config, ep: int, node_size: int) -> Reach:
    """:func:`reach` for a model: its experts and top-k (``shape``, :func:`fcsd.plan.perfmodel.model_shape`) and its
    group-limited routing, if its config has one (``n_group`` / ``topk_group``)."""
    from fcsd.connectivity.families import text_config

    text = text_config(model_config) if model_config is not None else None
    limited = getattr(text, "topk_method", None) != "greedy"  # DeepSeek-V2's greedy top-k ignores the groups
    n_group = int(getattr(text, "n_group", None) or 1) if limited else 1
    topk_group = int(getattr(text, "topk_group", None) or 1) if limited else 1
    return reach(shape.num_experts, shape.top_k, ep, node_size, n_group, topk_group)
