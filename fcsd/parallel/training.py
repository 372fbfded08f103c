"""What a trainer needs to train an expert-parallel student (paper Sec. 4.1; design §4 "Training with EP"):
expert-parallel groups, the global gradient norm, and checkpoints whose model part keeps the unsharded layout
while each process keeps its own experts' optimizer state.

The FCSD trainer (:mod:`fcsd.distill.trainer`) calls these when ``parallel.ep_size`` > 1; with them the student is
*not* wrapped in DDP/FSDP (:func:`fcsd.parallel.reduce_gradients` does the data-parallel part, per parameter kind).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fcsd.parallel.apply import expert_parallel
from fcsd.parallel.grads import full_state_dict

OPTIMIZER_SHARD = "optimizer_ep_rank{rank}.pt"  # each process's optimizer state (its experts' moments differ)
MODEL_FILE = "model_unsharded.pt"  # the gathered state dict, written by the main process


def expert_parallel_group(ep_size: int):
    """The group of ``ep_size`` consecutive ranks this process belongs to (``None``: the whole job). Every process
    creates every group, in the same order, as torch requires."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if ep_size < 1 or world % ep_size:
        raise ValueError(
            f"parallel.ep_size={ep_size} must divide the number of processes ({world}): expert-parallel groups are "
            "consecutive ranks"
        )
    if ep_size == world:
        return None
    mine = None
    for first in range(0, world, ep_size):
        group = dist.new_group(list(range(first, first + ep_size)))
        if first <= rank < first + ep_size:
            mine = group
    return mine


def make_expert_parallel(model: nn.Module, ep_size: int, mode: str, placement: str | None = None) -> nn.Module:
    """Shard the routed experts of a converted student over groups of ``ep_size`` processes (see
    :func:`fcsd.parallel.expert_parallel`); ``placement`` is a PLACEMENT.json applied before sharding."""
    return expert_parallel(model, expert_parallel_group(ep_size), mode=mode, placement=placement or None)


def clip_grad_norm_(model: nn.Module, max_norm: float) -> float:
    """Clip the gradients of an expert-parallel model to a global 2-norm of ``max_norm`` (``inf``: measure only);
    returns the norm before clipping. Replicated gradients count once, each expert shard once per expert-parallel
    group: the norm equals the single-process model's."""
    state = model.fcsd_expert_parallel
    grads = [(p.grad, getattr(p, "fcsd_expert_shard", False)) for p in model.parameters() if p.grad is not None]
    device = grads[0][0].device if grads else torch.device("cpu")
    squares = torch.zeros(2, device=device, dtype=torch.float64)
    for grad, is_expert in grads:
        squares[int(is_expert)] += grad.detach().double().pow(2).sum()
    expert_sq = squares[1:].clone()
    dist.all_reduce(expert_sq, group=state.group)  # the shards of one expert-parallel group make the whole experts
    norm = float(torch.sqrt(squares[0] + expert_sq[0]))
    if math.isfinite(max_norm) and norm > max_norm:
        for grad, _ in grads:
            grad.mul_(max_norm / (norm + 1e-6))
    return norm


def save_training_state(model: nn.Module, optimizer, folder: Path, is_main: bool) -> None:
    """The model's unsharded state dict (main process) and every process's optimizer state; collective."""
    full = full_state_dict(model)  # every process takes part in the gathers; the main process writes
    if is_main:
        torch.save(full, folder / MODEL_FILE)
    del full
    torch.save(optimizer.state_dict(), folder / OPTIMIZER_SHARD.format(rank=dist.get_rank()))


def load_training_state(model: nn.Module, optimizer, folder: Path) -> None:
    """Inverse of :func:`save_training_state`: the unsharded weights (each process keeps its own experts) and this
    process's optimizer state."""
    model.load_state_dict(torch.load(folder / MODEL_FILE, map_location="cpu"))
    state = torch.load(folder / OPTIMIZER_SHARD.format(rank=dist.get_rank()), map_location="cpu", weights_only=False)
    optimizer.load_state_dict(state)
