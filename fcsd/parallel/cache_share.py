"""``fcsd cache-teacher`` on several processes (design §3, §4): a teacher larger than one GPU, laid out over all of
them, each process caching its share of the data.

The teacher is laid out as a training run would lay out its teacher (:mod:`fcsd.parallel.layout`): ``parallel.*``
of the config, or FSDP2 over every process when it asks for no layout. Cache shard ``s`` (256 packed rows) is
written by process ``s mod W`` into the staging folder the main process created; every forward of a laid-out
model is a collective, so a process with fewer rows to run repeats a forward on row 0 (discarded) until every
process has run the same number. The main process writes ``meta.json`` once all shards are written and publishes
the folder in one rename (:func:`fcsd.staging.atomic_dir`): the cache is the one a single process would write,
shard for shard.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch.distributed as dist


def cache_meshes(config):
    """The teacher's meshes under a multi-process launch (``WORLD_SIZE`` > 1), else None (one process)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch
    from accelerate import PartialState

    from fcsd.parallel.layout import ParallelDims, build_meshes

    state = PartialState(cpu=not torch.cuda.is_available())  # initialises the process group, as the trainer does
    parallel = config.parallel
    fsdp = parallel.fsdp or parallel.ep_size == 1
    return build_meshes(ParallelDims(state.num_processes, parallel.ep_size, fsdp), state.device.type)


def share_cache(teacher, packed, folder, meta: dict, batch_size: int, progress: bool, overwrite: bool) -> Path:
    """:func:`fcsd.distill.teacher_cache.build_cache` with the shards spread over the processes (see the module
    docstring); every process calls it and gets the folder."""
    from tqdm.auto import tqdm

    from fcsd.distill.teacher_cache import reusable, shard_batches, shard_name, teacher_topk, write_shard
    from fcsd.parallel.layout import head_unit
    from fcsd.staging import atomic_dir

    folder = Path(folder)
    world, rank = dist.get_world_size(), dist.get_rank()
    if reusable(folder, meta, overwrite):  # every process reads the same folder, before anything is written
        return folder
    head_in_forward = teacher.fcsd_layout.dims.fsdp  # the LM head is sharded: applied in chunks, gathered once
    shards = shard_batches(len(packed), batch_size)
    forwards = max(sum(len(batches) for batches in shards[r::world]) for r in range(world))
    with contextlib.ExitStack() as stack:
        staging = (
            [
                str(
                    stack.enter_context(
                        atomic_dir(folder, kind="teacher-cache", replace=overwrite, what="teacher.cache_dir")
                    )
                )
            ]
            if rank == 0
            else [None]
        )
        dist.broadcast_object_list(staging, src=0)
        staging = Path(staging[0])
        bar = tqdm(total=len(packed), desc="caching teacher logits", unit="seq", disable=not progress or rank)
        done = 0
        for shard in range(rank, len(shards), world):
            batches = shards[shard]
            write_shard(teacher, packed, batches, meta, staging / shard_name(shard), bar.update, head_in_forward)
            done += len(batches)
        for _ in range(forwards - done):  # the other processes' forwards need this one's collectives
            teacher_topk(teacher, packed, 0, min(batch_size, len(packed)), meta, head_in_forward)
        unit = head_unit(teacher)  # the LM head stays gathered over the forwards (no logits are computed in them)
        if unit is not None:
            unit.reshard()
        bar.close()
        dist.barrier()  # every shard is in the staging folder
        if rank == 0:
            (staging / "meta.json").write_text(json.dumps(meta, indent=2))
    dist.barrier()  # published
    return folder
