"""Routed experts held as shards (design §4: "checkpoints and exports keep the unsharded layout").

Each rank of an expert-parallel group of ``P`` ranks keeps experts ``[r E/P, (r+1) E/P)`` of every fused expert
weight (dim 0, as transformers' ``MoEParamShard`` lays them out). This module slices a loaded model's experts
(:func:`shard_experts`) or adopts experts loaded as shards (:mod:`fcsd.parallel.load`), turns shards back into the
stock layout in state dicts (:class:`GatherMode`: all ranks, one rank, or none), and permutes sharded experts for an
expert placement by exchanging whole experts between ranks (:func:`permute_sharded_experts`), so that no rank ever
holds all the experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn


@dataclass
class ExpertShard:
    """What an experts module holds: ``size`` shards of ``num_experts`` experts, this one number ``rank``; ``names``
    are its fused parameters with the expert dimension first."""

    rank: int
    size: int
    num_experts: int
    names: tuple[str, ...]

    @property
    def local(self) -> int:
        return self.num_experts // self.size


class GatherMode:
    """How the state-dict hooks of sharded experts fill in the stock layout: ``"all"`` (all-gather: every rank gets
    the full experts), a global rank (gathered there only; the other ranks' state dicts leave the expert keys out),
    or ``"local"`` (each rank's own shard, e.g. for per-rank checkpoint files)."""

    def __init__(self):
        self.mode: str | int = "all"


def fused_expert_names(experts: nn.Module, num_experts: int) -> tuple[str, ...]:
    """Parameters of a fused experts module with one slice per expert on dim 0."""
    return tuple(name for name, param in experts.named_parameters(recurse=False) if param.shape[0] == num_experts)


def mark_sharded(experts: nn.Module, shard: ExpertShard) -> list[nn.Parameter]:
    """Record ``shard`` on an experts module whose parameters already hold only this rank's experts."""
    experts._fcsd_shard = shard
    if hasattr(experts, "num_experts"):
        experts.num_experts = shard.local
    experts._is_expert_parallel = True  # transformers' experts forwards skip ids >= num_experts only when set
    params = [getattr(experts, name) for name in shard.names]
    for param in params:
        param.fcsd_expert_shard = True
    return params


def shard_experts(experts: nn.Module, rank: int, size: int) -> ExpertShard:
    """Keep only this rank's experts of a loaded (unsharded) fused experts module; a module loaded as shards is
    adopted as it is. Returns its :class:`ExpertShard`."""
    if isinstance(experts, nn.ModuleList):
        raise NotImplementedError("expert parallelism needs fused 3-D expert weights (transformers >= 5)")
    shard = getattr(experts, "_fcsd_shard", None)
    if shard is not None:
        if (shard.rank, shard.size) != (rank, size):
            raise ValueError(
                f"the experts were loaded as shard {shard.rank} of {shard.size} but this is rank {rank} of an "
                f"expert-parallel group of {size}: load the model with the same group"
            )
        return shard
    num_experts = next(experts.parameters()).shape[0]
    shard = ExpertShard(rank, size, num_experts, fused_expert_names(experts, num_experts))
    local = shard.local
    for name in shard.names:
        param = getattr(experts, name)
        kept = param.data[rank * local : (rank + 1) * local].clone()
        setattr(experts, name, nn.Parameter(kept, requires_grad=param.requires_grad))
    mark_sharded(experts, shard)
    return shard


def install_state_dict_hooks(experts: nn.Module, shard: ExpertShard, group, gather: GatherMode) -> None:
    """``state_dict()`` holds the stock (unsharded) layout as ``gather`` says; ``load_state_dict`` accepts the
    stock layout (each rank keeps its own experts) or this rank's shard."""

    def gather_hook(module, state_dict, prefix, local_metadata):
        mode = gather.mode
        if mode == "local":
            return
        from torch.distributed.tensor import DTensor

        for name in shard.names:
            key = prefix + name
            part = state_dict[key].detach()
            part = (part.full_tensor() if isinstance(part, DTensor) else part).contiguous()  # FSDP2: its efsdp slices
            if mode == "all":
                parts = [torch.empty_like(part) for _ in range(shard.size)]
                dist.all_gather(parts, part, group=group)
                state_dict[key] = torch.cat(parts, dim=0).cpu()  # host memory, one layer's experts at a time
                continue
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(shard.size))
            if mode not in ranks:  # another expert-parallel group gathers for the destination
                del state_dict[key]
                continue
            is_dst = dist.get_rank() == mode
            parts = [torch.empty_like(part) for _ in range(shard.size)] if is_dst else None
            dist.gather(part, parts, dst=mode, group=group)
            if is_dst:
                state_dict[key] = torch.cat(parts, dim=0).cpu()
            else:
                del state_dict[key]

    def scatter_hook(module, state_dict, prefix, *args):
        for name in shard.names:
            key = prefix + name
            if key in state_dict and state_dict[key].shape[0] == shard.num_experts:
                state_dict[key] = state_dict[key][shard.rank * shard.local : (shard.rank + 1) * shard.local]

    experts.register_state_dict_post_hook(gather_hook)
    experts.register_load_state_dict_pre_hook(scatter_hook)


@torch.no_grad()
def permute_sharded_experts(block: nn.Module, family, order: np.ndarray, group) -> None:
    """:func:`fcsd.placement.reorder.permute_experts` for sharded experts: the (replicated) router rows are permuted
    in place, and whole experts move between ranks by one all-to-all per expert tensor: new slot ``j`` holds old
    expert ``order[j]``, and rank ``r`` keeps slots ``[r L, (r+1) L)``."""
    from fcsd.placement.reorder import per_expert_tensors

    experts = getattr(block, family.experts_attr)
    shard: ExpertShard = experts._fcsd_shard
    local, rank = shard.local, shard.rank
    order = np.asarray(order, dtype=np.int64)
    owner = order // local  # the rank holding each new slot's expert before the move
    mine = np.arange(rank * local, (rank + 1) * local)
    # what each rank sends to each other one: its experts the receiver's slots need, in the receiver's slot order
    send_index = [
        [int(order[j]) - rank * local for j in range(r * local, (r + 1) * local) if owner[j] == rank]
        for r in range(shard.size)
    ]
    recv_slots = [[int(j) - rank * local for j in mine if owner[j] == r] for r in range(shard.size)]
    from torch.distributed.tensor import DTensor

    for module, name in per_expert_tensors(block, family):
        tensor = getattr(module, name)
        if isinstance(tensor, DTensor):  # FSDP2-sharded on another dim (fcsd.parallel.layout): every row is here
            tensor = tensor._local_tensor
        if module is not experts:  # the router: replicated, permuted in place
            tensor.copy_(tensor.index_select(0, torch.as_tensor(order, device=tensor.device)))
            continue
        index = torch.as_tensor([i for part in send_index for i in part], dtype=torch.int64, device=tensor.device)
        send = tensor.index_select(0, index).contiguous()
        recv = torch.empty_like(tensor)
        dist.all_to_all_single(recv, send, [len(p) for p in recv_slots], [len(p) for p in send_index], group=group)
        slots = torch.as_tensor([j for part in recv_slots for j in part], dtype=torch.int64, device=tensor.device)
        tensor.index_copy_(0, slots, recv)
