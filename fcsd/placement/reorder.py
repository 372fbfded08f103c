"""Applying an expert placement to a model (second paper, Sec. V-A: "The resulting placement is a per-layer
permutation of global expert IDs and does not change router decisions or expert parameters").

:func:`apply_placement` permutes, per MoE layer, the router rows, any per-expert router buffer (DeepSeek-V3's
``e_score_correction_bias``) and the expert weights so that slot ``j`` holds the expert the placement puts on rank
``j // (E / P)``. Contiguous expert-parallel sharding (rank ``r`` holds slots ``r E/P .. (r+1) E/P - 1``) then
realises the placement with no other change: the router picks the same experts under new ids, so the model
computes the same function. The weights stay a valid stock checkpoint; the permutation is recorded in the config's
``farskip`` block (``placement``) so exports and later placements know the experts' original ids.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fcsd.connectivity.families import MoEFamily, family_for_config, moe_blocks
from fcsd.connectivity.patch import CONFIG_KEY
from fcsd.placement.format import Placement, PlacementError, load_placement
from fcsd.placement.traces import check_same_model

RECORD_KEY = "placement"


def check_placement(model: nn.Module, placement) -> Placement:
    """Validate ``placement`` against ``model``: expert count, MoE layers, source model, routing groups."""
    from fcsd.placement.record import routes_header

    placement = load_placement(placement)
    family = family_for_config(model.config)
    blocks = moe_blocks(model, family)
    header = routes_header(model)
    if placement.source:
        check_same_model(header, placement.source, "the placement's routes")
    if placement.num_experts != header["num_experts"]:
        raise PlacementError(
            f"the placement is for {placement.num_experts} experts per layer, the model has {header['num_experts']}"
        )
    unknown = sorted(set(placement.layers) - set(blocks))
    if unknown:
        raise PlacementError(
            f"the placement names layer(s) {unknown} that are not MoE layers of this model (its MoE layers: "
            f"{sorted(blocks)})"
        )
    groups = family.routing_groups(model.config)
    if groups > 1:
        size = placement.num_experts // groups
        for layer in placement.layers:
            slots = placement.order(layer).reshape(groups, size) // size
            if (slots != slots[:, :1]).any():
                raise PlacementError(
                    f"layer {layer}: the placement splits the expert groups of {family.name}'s group-limited routing "
                    f"({groups} groups of {size}); compute it with `fcsd routes place` from routes of this model "
                    "(it keeps groups together)"
                )
    return placement


def per_expert_tensors(block: nn.Module, family: MoEFamily) -> list[tuple[nn.Module, str]]:
    """``(module, attribute)`` of every tensor of ``block`` indexed by expert on dim 0 that a permutation must move:
    the family row's ``router_per_expert`` and ``experts_per_expert`` (an ``nn.ModuleList`` of experts is permuted
    as a list).

    Raises ``ValueError`` if the router or experts hold another tensor with a leading expert dimension that the
    family table does not list (a permutation that missed it would silently change the model).
    """
    router = family.router(block)
    experts = getattr(block, family.experts_attr)
    num_experts = router.weight.shape[0]
    found: list[tuple[nn.Module, str]] = []
    for owner, names in ((router, family.router_per_expert), (experts, family.experts_per_expert)):
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
                    f"{type(owner).__name__}.{name} has one row per expert but is not in {family.name}'s row of the "
                    "family table (router_per_expert / experts_per_expert in fcsd/connectivity/families.py); add it "
                    "there before permuting experts"
                )
    return found


@torch.no_grad()
def permute_experts(block: nn.Module, family, order: np.ndarray) -> None:
    """Reorder the experts of one MoE block in place: new slot ``j`` holds old expert ``order[j]``."""
    for owner, name in per_expert_tensors(block, family):
        if name == "":  # an nn.ModuleList of expert modules
            modules = list(owner)
            for slot, old in enumerate(order):
                owner[slot] = modules[int(old)]
            continue
        tensor = getattr(owner, name)
        index = torch.as_tensor(order, device=tensor.device)
        tensor.copy_(tensor.index_select(0, index))


def apply_placement(model: nn.Module, placement, permute=None) -> nn.Module:
    """Permute every listed MoE layer's experts so that contiguous EP sharding over ``placement.ep`` ranks realises
    ``placement`` (a :class:`Placement`, a dict or a PLACEMENT.json path). Outputs are unchanged.

    Expert ids in the placement are the model's current ones (those its routes were recorded with). The
    composition with any placement applied before is recorded in ``model.config.farskip["placement"]``:
    ``{"ep", "nodes", "num_experts", "expert_order": {layer: [original id of slot 0, ...]}}``. ``permute(block,
    family, order)`` moves the experts (default :func:`permute_experts`; expert parallelism passes one for sharded
    experts). Returns ``model``.
    """
    placement = check_placement(model, placement)
    family = family_for_config(model.config)
    blocks = moe_blocks(model, family)
    block_record = dict(getattr(model.config, CONFIG_KEY, None) or {})
    previous = (block_record.get(RECORD_KEY) or {}).get("expert_order", {})
    expert_order = {}
    for layer in sorted(blocks):
        before = np.asarray(previous.get(str(layer), np.arange(placement.num_experts)), dtype=np.int64)
        order = placement.order(layer) if layer in placement.layers else np.arange(placement.num_experts)
        if (order != np.arange(order.size)).any():
            (permute or permute_experts)(blocks[layer], family, order)
        expert_order[str(layer)] = [int(x) for x in before[order]]
    block_record[RECORD_KEY] = {
        "ep": placement.ep,
        "nodes": placement.nodes,
        "num_experts": placement.num_experts,
        "expert_order": expert_order,
    }
    setattr(model.config, CONFIG_KEY, block_record)
    return model
