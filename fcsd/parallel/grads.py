"""Gradient reduction and full state dicts for training under expert parallelism (design §4, "Training with EP").

Non-expert weights are data-parallel over every rank of the job; a routed expert's gradient already holds the
contributions of every rank of its expert-parallel group (the reverse all-to-all brings them), so it is reduced only
over the ranks that hold a copy of that expert (one per expert-parallel group), never across different experts.

How a trainer calls it, after ``loss.backward()`` and before clipping / ``optimizer.step()``::

    reduce_gradients(model, op="mean")   # each rank's loss is the mean over its own tokens (DDP convention)
    reduce_gradients(model, op="sum")    # each rank's loss is already divided by the *global* token count

Do not wrap the expert-parallel student in DDP/FSDP as well (they would average expert shards across experts).
For checkpoints: :func:`full_state_dict` on *every* rank gives the unsharded layout, on every rank or (``dst=``)
only where it is written.

Gradients are reduced in buckets of at most :data:`BUCKET_BYTES` (flattened, all-reduced, copied back in place), so
the reduction holds one bucket beyond the gradients themselves.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

BUCKET_BYTES = 64 * 2**20


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
    for p in params:
        if p.grad is None:  # every rank issues the same collectives: a missing gradient takes part as zeros
            p.grad = torch.zeros_like(p)
    bucket, size = [], 0
    for p in params:
        bucket.append(p.grad)
        size += p.grad.numel() * p.grad.element_size()
        if size >= BUCKET_BYTES or p is params[-1]:
            _reduce_bucket(bucket, group, world, op)
            bucket, size = [], 0


def _reduce_bucket(grads: list[torch.Tensor], group, world: int, op: str) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1)
    dist.all_reduce(flat, group=group)
    if op == "mean":
        flat.div_(world)
    if len(grads) == 1 and flat.data_ptr() == grads[0].data_ptr():
        return  # reduced in place
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of every element of ``tensors`` as a 0-d fp32 tensor on ``device``: one foreach norm
    kernel per device (fp32 accumulation), not a loop of fp64 copies."""
    tensors = [t.detach() for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), device=device, dtype=torch.float32)
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    return torch.stack([n.to(device) for n in norms]).square().sum()


@contextmanager
def gathered(model: nn.Module, mode):
    """While active, ``model.state_dict()`` fills in the experts as ``mode`` says (see
    :class:`fcsd.parallel.shards.GatherMode`)."""
    gather = model.fcsd_expert_parallel.gather
    saved, gather.mode = gather.mode, mode
    try:
        yield
    finally:
        gather.mode = saved


def full_state_dict(model: nn.Module, dst: int | None = None) -> dict[str, torch.Tensor]:
    """The unsharded state dict (expert shards gathered), on CPU; a collective: call it on every rank.

    ``dst=None``: every rank gets it; ``dst=r`` (a global rank): only rank ``r`` does, the others get ``{}`` (no
    rank but the writer ever holds the whole model)."""
    with gathered(model, "all" if dst is None else dst):
        state = model.state_dict()
    if dst is not None and dist.get_rank() != dst:
        return {}
    return {key: value.detach().cpu() for key, value in state.items()}
