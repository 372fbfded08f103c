"""Gradient reduction and full state dicts for training under expert parallelism (design §4, "Training with EP").

Non-expert weights are data-parallel over every rank of the job; a routed expert's gradient already holds the
contributions of every rank of its expert-parallel group (the reverse all-to-all brings them), so it is reduced only
over the ranks that hold a copy of that expert (one per expert-parallel group), never across different experts.

How a trainer calls it, after ``loss.backward()`` and before clipping / ``optimizer.step()``::

    reduce_gradients(model, op="mean")   # each rank's loss is the mean over its own tokens (DDP convention)
    reduce_gradients(model, op="sum")    # each rank's loss is already divided by the *global* token count

Do not wrap the expert-parallel student in DDP/FSDP as well (they would average expert shards across experts).
For checkpoints: :func:`full_state_dict` (or ``model.state_dict()``) on *every* rank gives the
unsharded layout; write it from rank 0 only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def reduce_gradients(model: nn.Module, op: str = "mean") -> None:
    """All-reduce the gradients of an :func:`~fcsd.parallel.expert_parallel` model in place (see module docstring).

    ``op="mean"`` gives the gradient of the mean of the ranks' losses, ``op="sum"`` of their sum. Parameters without a
    gradient on some rank take part with zeros, so every rank issues the same collectives.
    """
    if op not in ("mean", "sum"):
        raise ValueError(f"op={op!r}: use 'mean' or 'sum'")
    state = model.fcsd_expert_parallel
    world = dist.get_world_size()
    params = [p for p in model.parameters() if p.requires_grad]
    dense = [p for p in params if not getattr(p, "fcsd_expert_shard", False)]
    experts = [p for p in params if getattr(p, "fcsd_expert_shard", False)]
    _all_reduce_grads(dense, None, world, op)
    if state.replica_group is not None:
        _all_reduce_grads(experts, state.replica_group, world, op)
    elif op == "mean":
        for p in experts:
            if p.grad is not None:
                p.grad.div_(world)


def _all_reduce_grads(params, group, world: int, op: str) -> None:
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    if op == "mean":
        flat.div_(world)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.dtype).clone()
        offset += n


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict (expert shards all-gathered), on CPU; a collective: call it on every rank."""
    return {key: value.detach().cpu() for key, value in model.state_dict().items()}
