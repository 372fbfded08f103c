"""Process groups fcsd makes, all by one rule: they wait the run's ``parallel.timeout_minutes`` (the default
group's timeout), not torch's own 10 (NCCL) or 30 (gloo) minutes, and the exchanges the overlapped schedule hides
behind compute (expert-parallel, node and rail groups) run on high-priority NCCL streams."""

from __future__ import annotations

import torch
import torch.distributed as dist


def new_group(ranks: list[int], high_priority: bool = True):
    """``dist.new_group(ranks)`` by the module's rule (a collective: every process calls it, in the same order)."""
    options = high_priority_options() if high_priority else None
    return dist.new_group(ranks, timeout=default_group_timeout(), pg_options=options)


def high_priority_options():
    """Under NCCL, the options of a group whose collectives run on a high-priority stream (the expert-parallel,
    node and rail groups: the exchanges the schedule overlaps with compute are not queued behind it); else None."""
    return dist.ProcessGroupNCCL.Options(is_high_priority_stream=True) if dist.get_backend() == "nccl" else None


def bound_by_the_run_timeout(*groups) -> None:
    """Give groups that torch's own helpers made (device meshes) the default group's timeout: they wait torch's 10
    (NCCL) or 30 (gloo) minutes otherwise, whatever ``parallel.timeout_minutes`` says."""
    timeout = default_group_timeout()
    for group in groups if timeout is not None else ():
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def default_group_timeout():
    """The default process group's timeout (``parallel.timeout_minutes`` once the run set it), for the groups made
    after it; None outside a job (torch's own default then)."""
    if not dist.is_initialized():
        return None
    group = dist.distributed_c10d._get_default_group()
    for device in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError, ValueError):
            continue
    return None
