"""``expert_parallel``: shard a loaded model's routed experts over a process group and install the EP schedules
(paper Sec. 4; design §4).

Each rank keeps ``E / P`` whole experts (expert ``e`` on rank ``e // (E / P)``, dim 0 of the fused expert weights, as
transformers' ``MoEParamShard`` lays them out) and runs its own tokens. Routers, attention, norms, embeddings and shared
experts stay replicated. A model loaded with only its own experts (:func:`fcsd.parallel.load.from_pretrained_sharded`)
is adopted as it is, so no rank ever holds every expert. ``state_dict()`` all-gathers the expert shards back into the
original unsharded layout (a collective: call it on every rank, write from one, e.g. ``save_pretrained(out,
state_dict=...)``; :func:`fcsd.parallel.full_state_dict` gathers to one rank only) and ``load_state_dict`` accepts
that layout (each rank keeps its own experts), so checkpoints are unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fcsd.connectivity.families import expert_count, family_for_config, find_decoder_layers
from fcsd.connectivity.patch import FarSkipLayerMixin, farskip_layers
from fcsd.parallel.dispatchers import (
    AllReduceDispatcher,
    AllToAllDispatcher,
    DedupAllToAllDispatcher,
    Dispatcher,
    LocalDispatcher,
)
from fcsd.parallel.generate import install as install_generate
from fcsd.parallel.groups import new_group
from fcsd.parallel.hierarchical import HierarchicalDispatcher, node_and_rail_groups
from fcsd.parallel.schedule import FarSkipEPSchedule, _refuse_checkpointing, ep_moe_forward
from fcsd.parallel.shards import GatherMode, install_state_dict_hooks, permute_sharded_experts, shard_experts

MODES = ("regular", "farskip_reference", "farskip_overlap")
LAYOUTS = ("all_to_all", "all_reduce")
#: dispatchers of the all-to-all layout: one row per (token, expert), one per (token, destination rank), or one per
#: (token, destination node) across nodes fanned out inside the node (:mod:`fcsd.parallel.hierarchical`)
DISPATCHERS = {"plain": AllToAllDispatcher, "dedup": DedupAllToAllDispatcher, "hierarchical": HierarchicalDispatcher}


@dataclass
class ExpertParallelState:
    """What :func:`expert_parallel` set up, kept as ``model.fcsd_expert_parallel``."""

    mode: str
    layout: str
    group: Any
    size: int
    rank: int
    dispatcher: Dispatcher
    expert_params: list  # the sharded parameters (each a Parameter holding E/P experts on dim 0)
    replica_group: Any = None  # ranks holding the same experts (one per EP group); None when there is one EP group
    gather: GatherMode | None = None  # how state_dict() fills in the unsharded experts


def expert_parallel(
    model: nn.Module,
    group=None,
    mode: str = "farskip_overlap",
    layout: str = "all_to_all",
    placement=None,
    dispatcher: str = "plain",
    replica_group=None,
    node_size: int | None = None,
):
    """Shard ``model``'s routed experts over ``group`` (default: the whole job) and run it expert-parallel, in place.

    Call it in an initialised ``torch.distributed`` job, on every rank, with the same loaded model on each (or the
    same checkpoint loaded as shards with :func:`fcsd.parallel.load.from_pretrained_sharded` over ``group``). Under
    NCCL the current CUDA device is set to the model's.

    - ``mode="regular"``: stock connectivity, blocking collectives (the model must not be converted);
      ``"farskip_reference"``: FarSkip connectivity, blocking collectives; ``"farskip_overlap"``: FarSkip with the
      overlapped schedule of Sec. 4.1 (both need :func:`fcsd.apply_farskip` first).
    - ``layout="all_to_all"``: each rank runs its own tokens, sent to the experts' ranks and back (training and
      inference); ``"all_reduce"``: every rank holds the *same* tokens, experts sharded, one all-reduce per layer
      (inference only, Sec. 4.2). ``model.generate`` works in both, correct by construction (:mod:`.generate`): ranks
      step together until all are done, and in ``all_reduce`` every rank takes rank 0's prompt and token choices.
    - ``placement``: an expert placement (a PLACEMENT.json path, its dict, or a :class:`fcsd.placement.Placement`
      computed by ``fcsd routes place --ep P`` for ``P`` = the group size), applied with
      :func:`fcsd.placement.apply_placement` before sharding: experts (weights, router rows, per-expert router
      buffers) are permuted so that contiguous sharding puts each on its placed rank; outputs are unchanged, the
      gathered state dict holds the permuted (still stock) layout and ``config.farskip["placement"]`` records it.
      A callable ``placement(model)`` is also accepted and run as is.
    - ``dispatcher`` (layout ``all_to_all``): ``"plain"``, one row per (token, expert); ``"dedup"``, one row per
      (token, destination rank) carrying that rank's expert ids and weights (second paper, Sec. V-A), the same
      outputs with fewer rows when a token's experts share ranks (most with a correlated ``placement``);
      ``"hierarchical"``, node-aware: one row per (token, destination node) across nodes, fanned out inside the node
      (:mod:`fcsd.parallel.hierarchical`), the same outputs with fewer rows crossing nodes.
    - ``node_size``: ranks per node (``parallel.node_size``; default the launcher's ``LOCAL_WORLD_SIZE``), for the
      hierarchical dispatcher and every dispatcher's count of rows crossing nodes (``inter_rows_sent``). A group
      larger than a node must hold whole nodes (consecutive ranks).

    - ``replica_group``: the ranks holding the same experts as this one, when the caller has it (a device mesh's
      group, :mod:`fcsd.parallel.layout`); else it is found with an object collective.

    Returns ``model``. Raises ``ValueError`` for an unknown mode, layout or dispatcher, a number of experts not
    divisible by the group size, a placement for another EP size, or a FarSkip mode on an unconverted model (and
    ``regular`` on a converted one).
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: use one of {', '.join(MODES)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {', '.join(LAYOUTS)}")
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher={dispatcher!r}: use one of {', '.join(DISPATCHERS)}")
    if not dist.is_initialized():
        raise RuntimeError("fcsd.parallel.expert_parallel needs an initialised torch.distributed process group")
    if getattr(model, "fcsd_expert_parallel", None) is not None:
        raise ValueError("this model is already expert-parallel")
    converted = farskip_layers(model)
    if mode == "regular" and converted:
        raise ValueError(
            f"mode='regular' runs the stock connectivity but layers {converted} are converted to FarSkip: use "
            "mode='farskip_reference' or 'farskip_overlap', or fcsd.remove_farskip(model) first"
        )
    if mode != "regular" and not converted:
        raise ValueError(
            f"mode={mode!r} needs a FarSkip model: convert it with fcsd.apply_farskip(model, layers) first "
            "(or load a converted checkpoint with fcsd.from_pretrained), or use mode='regular'"
        )
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    _bind_device(model, group)
    family = family_for_config(model.config)
    layers = find_decoder_layers(model, family)
    moe_blocks = [getattr(layer, family.mlp_attr) for layer in layers if family.is_moe(getattr(layer, family.mlp_attr))]
    loaded_as_shards = any(hasattr(getattr(moe, family.experts_attr), "_fcsd_shard") for moe in moe_blocks)
    if callable(placement):
        placement(model)
    elif placement is not None:
        _apply_placement(model, placement, size, group, loaded_as_shards)
    num_experts = {_global_count(getattr(moe, family.experts_attr)) for moe in moe_blocks}
    for count in num_experts:
        if count % size:
            raise ValueError(
                f"{count} routed experts cannot be split evenly over {size} expert-parallel ranks: pick a group size "
                f"that divides {count}"
            )
    local = (num_experts.pop() if num_experts else size) // size
    per_node = resolve_node_size(size, node_size)
    options = {"group": group, "num_local_experts": local, "blocking": mode != "farskip_overlap", "node_size": per_node}
    if size == 1:
        dispatcher = LocalDispatcher()
    elif layout == "all_reduce":
        dispatcher = AllReduceDispatcher(**options)
    elif dispatcher == "hierarchical":
        node_group, rail_group = node_and_rail_groups(group, per_node)
        dispatcher = HierarchicalDispatcher(**options, node_group=node_group, rail_group=rail_group)
    else:
        dispatcher = DISPATCHERS[dispatcher](**options)

    expert_params, gather = [], GatherMode()
    for moe in moe_blocks:
        experts = getattr(moe, family.experts_attr)
        shard = shard_experts(experts, rank, size)
        install_state_dict_hooks(experts, shard, group, gather)
        expert_params += [getattr(experts, name) for name in shard.names]
        moe.forward = ep_moe_forward(family, moe, dispatcher)
    schedule = FarSkipEPSchedule(dispatcher, overlap=mode == "farskip_overlap")
    for layer in layers:
        if isinstance(layer, FarSkipLayerMixin):
            layer._farskip_schedule = schedule
        layer.register_forward_pre_hook(lambda module, args: _refuse_checkpointing(module))
    model.fcsd_expert_parallel = ExpertParallelState(
        mode, layout, group, size, rank, dispatcher, expert_params, replica_group or _replica_group(group, size), gather
    )
    install_generate(model)
    return model


def resolve_node_size(size: int, node_size: int | None = None) -> int:
    """Ranks per node inside an expert-parallel group of ``size`` consecutive ranks: ``node_size``, else the
    launcher's ``LOCAL_WORLD_SIZE``, at most the group (a group inside one node). A group spanning nodes must hold
    whole ones."""
    node = node_size or int(os.environ.get("LOCAL_WORLD_SIZE") or size)
    if node < 1:
        raise ValueError(f"parallel.node_size={node}: it must be at least 1 (processes per node)")
    world = dist.get_world_size() if dist.is_initialized() else None
    if node_size and world is not None and world % node_size:
        raise ValueError(
            f"parallel.node_size={node_size} does not divide the job's {world} processes into whole nodes: set the "
            "processes each node runs (the launcher's --nproc_per_node), or leave it unset"
        )
    node = min(node, size)
    if size % node:
        raise ValueError(
            f"an expert-parallel group of {size} processes cannot hold whole nodes of {node}: make parallel.ep_size a "
            f"multiple of the processes per node ({node}) or at most that (parallel.node_size sets it)"
        )
    return node


def _global_count(experts: nn.Module) -> int:
    shard = getattr(experts, "_fcsd_shard", None)
    return shard.num_experts if shard is not None else expert_count(experts)


def _bind_device(model: nn.Module, group) -> None:
    """NCCL collectives and object collectives use the current CUDA device: make it the model's (a direct caller may
    not have set it; every rank would otherwise default to GPU 0)."""
    device = next(model.parameters()).device
    if device.type == "cuda" and dist.get_backend(group) == "nccl":
        torch.cuda.set_device(device)


def _apply_placement(model: nn.Module, placement, size: int, group, sharded: bool) -> None:
    """Permute the experts for ``placement``; experts loaded as shards move between the ranks of ``group``."""
    from fcsd.placement import apply_placement, load_placement

    placement = load_placement(placement)
    if placement.ep != size:
        raise ValueError(
            f"the placement was computed for EP {placement.ep} but the expert-parallel group has {size} ranks: "
            f"compute one with `fcsd routes place ROUTES --ep {size}`"
        )
    if not sharded:
        apply_placement(model, placement)
        return

    def permute(block, family, order):
        permute_sharded_experts(block, family, order, group)

    apply_placement(model, placement, permute=permute)


def _replica_group(group, size: int):
    """The group of ranks holding the same experts as this one (same position in their EP groups), or ``None`` when
    the EP group is the whole job. Every rank creates every replica group, in the same order (torch requires it)."""
    world = dist.get_world_size()
    if size == world:
        return None
    positions = [None] * world
    dist.all_gather_object(positions, dist.get_rank(group))
    mine = None
    for position in range(size):
        ranks = [r for r in range(world) if positions[r] == position]
        created = new_group(ranks, high_priority=False)  # gradients and gathers, not the overlapped exchanges
        if position == dist.get_rank(group):
            mine = created
    return mine
