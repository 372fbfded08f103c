"""Per-family router access for expert-coupling work (second paper, Sec. II-B and V-A; design §5).

For each supported family this says where a MoE block's router is, how to read each token's top-k expert ids and
weights from the router's forward output, and which per-expert tensors a permutation of the experts must move
(router rows, per-expert router buffers such as DeepSeek-V3's ``e_score_correction_bias``, the fused 3-D expert
weights). It also says which expert groups the router's group-limited routing needs kept together.

Keyed by ``MoEFamily.model_type``; meant to become columns of the family table in
:mod:`fcsd.connectivity.families`. Only this module knows family specifics; :mod:`fcsd.placement` goes through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fcsd.connectivity.families import MoEFamily, find_decoder_layers, text_config

TopK = tuple[torch.Tensor, torch.Tensor]  # (ids (tokens, k) int64, weights (tokens, k) float)


def _gate_triple(router: nn.Module, output) -> TopK:
    # routers returning (logits, top-k weights, top-k ids): Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V2/V3
    _, weights, ids = output
    return ids, weights


def _llama4_scores(router: nn.Module, output) -> TopK:
    # Llama-4 returns (scores (tokens, E): sigmoid of the top-k logits, 0 elsewhere; logits); its own top-k is on
    # the logits, so repeating it gives the same ids
    scores, logits = output
    ids = torch.topk(logits, router.top_k, dim=1).indices
    return ids, scores.gather(1, ids)


@dataclass(frozen=True)
class RouterSpec:
    """How to reach and read the router of one family's MoE block."""

    router_attr: str  # MoE-block attribute holding the router module
    read_topk: Callable[[nn.Module, object], TopK]  # (router, router forward output) -> (ids, weights)
    router_per_expert: tuple[str, ...] = ("weight",)  # router parameters/buffers with one row per expert (dim 0)
    experts_per_expert: tuple[str, ...] = ("gate_up_proj", "down_proj")  # fused expert tensors, dim 0 = expert


ROUTERS: dict[str, RouterSpec] = {
    "deepseek_v2": RouterSpec("gate", _gate_triple),
    "deepseek_v3": RouterSpec("gate", _gate_triple, router_per_expert=("weight", "e_score_correction_bias")),
    "qwen3_moe": RouterSpec("gate", _gate_triple),
    "qwen2_moe": RouterSpec("gate", _gate_triple),
    "llama4_text": RouterSpec("router", _llama4_scores, router_per_expert=("weight", "bias")),
    "mixtral": RouterSpec("gate", _gate_triple),
    "olmoe": RouterSpec("gate", _gate_triple),
}


def router_spec(family: MoEFamily) -> RouterSpec:
    return ROUTERS[family.model_type]


def moe_blocks(model: nn.Module, family: MoEFamily) -> dict[int, nn.Module]:
    """``{decoder layer index: MoE block}`` for every MoE layer of ``model`` (dense layers skipped)."""
    blocks = {}
    for index, layer in enumerate(find_decoder_layers(model, family)):
        mlp = getattr(layer, family.mlp_attr, None)
        if mlp is not None and family.is_moe(mlp):
            blocks[index] = mlp
    return blocks


def router_of(block: nn.Module, family: MoEFamily) -> nn.Module:
    return getattr(block, router_spec(family).router_attr)


def routing_groups(config, family: MoEFamily) -> int:
    """Number of contiguous expert groups that the router's group-limited routing selects among (1 if none).

    DeepSeek-V3 always routes within ``topk_group`` of ``n_group`` groups; DeepSeek-V2 only with
    ``topk_method="group_limited_greedy"``. Groups are contiguous blocks of ``E / n_group`` expert ids, so a
    permutation of the experts keeps routing exact only if it maps every group onto a group.
    """
    cfg = text_config(config)
    n_group, topk_group = getattr(cfg, "n_group", None) or 1, getattr(cfg, "topk_group", None) or 1
    if family.model_type == "deepseek_v2" and getattr(cfg, "topk_method", "greedy") != "group_limited_greedy":
        return 1
    if family.model_type not in ("deepseek_v2", "deepseek_v3") or topk_group >= n_group:
        return 1
    return int(n_group)


def per_expert_tensors(block: nn.Module, family: MoEFamily) -> list[tuple[nn.Module, str]]:
    """``(module, attribute)`` of every tensor of ``block`` indexed by expert on dim 0 that a permutation must move.

    Raises ``ValueError`` if the router or experts hold another tensor with a leading expert dimension that the
    table does not know (a permutation that missed it would silently change the model).
    """
    spec = router_spec(family)
    router = getattr(block, spec.router_attr)
    experts = getattr(block, family.experts_attr)
    num_experts = router.weight.shape[0]
    found: list[tuple[nn.Module, str]] = []
    for owner, names in ((router, spec.router_per_expert), (experts, spec.experts_per_expert)):
        if isinstance(owner, nn.ModuleList):  # unfused experts: the list itself is permuted
            found.append((owner, ""))
            continue
        for name in names:
            if getattr(owner, name, None) is not None:
                found.append((owner, name))
        known = {name for module, name in found if module is owner}
        for name, tensor in [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]:
            if name not in known and tensor.dim() >= 1 and tensor.shape[0] == num_experts:
                raise ValueError(
                    f"{type(owner).__name__}.{name} has one row per expert but is not in fcsd's routing table "
                    f"(fcsd/connectivity/routing.py); add it there before permuting experts of {family.name}"
                )
    return found
