"""``final/``, ``best/`` and exports of a parallel layout, streamed (design §4: "exports streamed tensor by tensor").

No process ever holds the whole model, and only the writing (main) process ever holds a whole tensor: the tensors
are collected one at a time, each process sending its shards to the writer in pieces of at most :data:`PIECE_BYTES`,
cast to the saved dtype first (a replicated tensor needs no transfer); the writer adds each tensor to the output
shard being filled, in the checkpoint's stock key layout (transformers' own reverse weight conversion: fused experts
are written as the per-expert tensors the model was loaded from), and writes a shard as soon as it is full. Shards
are planned before anything is sent (from the tensors' global shapes), so the files are named as
``save_pretrained`` names them (``model-00001-of-00003.safetensors`` and ``model.safetensors.index.json``, or one
``model.safetensors``). Host memory of the writer: one output shard plus one tensor; device memory of every process:
one piece.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fcsd.weight_files import WEIGHTS, write_index

DEFAULT_SHARD_BYTES = 5 * 2**30
PIECE_BYTES = 256 * 2**20  # the most bytes of one transfer to the writer (and of a process's cast copy)


def stock_keys(model: nn.Module, state: dict) -> list[str]:
    """The keys ``save_pretrained`` writes (tied copies left out), in the state dict's order."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    dropped = {target for target, source in tied.items() if target in state and source in state}
    return [key for key in state if key not in dropped]


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Consecutive keys grouped into shards of at most ``max_bytes`` (a larger tensor gets a shard of its own)."""
    shards, current, filled = [], [], 0
    for key, size in sizes:
        if current and filled + size > max_bytes:
            shards.append(current)
            current, filled = [], 0
        current.append(key)
        filled += size
    if current:
        shards.append(current)
    return shards


def gather(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every process (a collective for a DTensor; a replicated tensor as it is)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def gather_to(tensor: torch.Tensor, dst: int, dtype: torch.dtype, piece_bytes: int = PIECE_BYTES):
    """The whole ``tensor`` on CPU on global rank ``dst`` (``None`` on the others), floating values in ``dtype``; a
    collective of the processes holding it: each sends its shard (one copy of a replicated one) to ``dst`` in pieces
    of at most ``piece_bytes``, cast before sending. A plain (replicated) tensor is taken from ``dst``'s copy."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    cast = dtype if tensor.is_floating_point() else tensor.dtype
    rank = dist.get_rank() if dist.is_initialized() else dst
    if not isinstance(tensor, DTensor):
        return tensor.detach().to("cpu", cast) if rank == dst else None
    if any(type(p) not in (Shard, Replicate) for p in tensor.placements):  # not a layout of fcsd's: gathered whole
        full = tensor.full_tensor()
        return full.detach().to("cpu", cast) if rank == dst else None
    ranks = tensor.device_mesh.mesh
    owners = {}  # (global offset, shape) of each distinct block -> the rank that sends it (dst when it holds it)
    for coordinate in itertools.product(*(range(n) for n in ranks.shape)):
        shape, offset = _compute_local_shape_and_global_offset(
            tensor.shape, ranks.shape, list(coordinate), tensor.placements
        )
        block = (tuple(offset), tuple(shape))
        if math.prod(shape) and (block not in owners or int(ranks[coordinate]) == dst):
            owners[block] = int(ranks[coordinate])
    local = tensor.to_local().detach()
    full = torch.empty(tensor.shape, dtype=cast) if rank == dst else None
    itemsize = torch.empty((), dtype=cast).element_size()
    for (offset, shape), owner in owners.items():
        if rank not in (owner, dst):
            continue
        for start, size in _pieces(shape, itemsize, piece_bytes):
            if rank == owner:
                piece = local[_region(start, size)].to(cast).contiguous()
            else:
                piece = torch.empty(size, dtype=cast, device=local.device)
                dist.recv(piece, src=owner)
            if rank == dst:
                full[_region([o + s for o, s in zip(offset, start)], size)].copy_(piece)
            else:
                dist.send(piece, dst=dst)
            del piece
    return full


def _pieces(shape: tuple, itemsize: int, limit: int) -> list[tuple[tuple, tuple]]:
    """``(start, shape)`` of sub-blocks of a block of ``shape``, each of at most ``limit`` bytes (one element at
    least), row-major: runs of whole rows, or pieces of one row when a row is larger."""
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:]) * itemsize
    if inner <= limit or len(shape) == 1:
        rows = max(1, limit // max(inner, 1))
        rest = (0,) * (len(shape) - 1)
        return [((s, *rest), (min(rows, shape[0] - s), *shape[1:])) for s in range(0, shape[0], rows)]
    return [((i, *start), (1, *size)) for i in range(shape[0]) for start, size in _pieces(shape[1:], itemsize, limit)]


def _region(start, size) -> tuple:
    return tuple(slice(o, o + n) for o, n in zip(start, size))


def write_weights(
    model: nn.Module,
    folder: Path | None,
    dtype: torch.dtype,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    writer: int = 0,
    piece_bytes: int = PIECE_BYTES,
) -> dict:
    """Stream ``model``'s weights into ``folder`` (the staging folder of the writing process, global rank ``writer``;
    ``None`` on the others, which only send their shards). Returns the weight map (output key -> file) on the
    writer."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    from fcsd.parallel.step_state import model_state

    rank = dist.get_rank() if dist.is_initialized() else writer
    if (folder is not None) != (rank == writer):
        raise ValueError(
            f"process {rank} has folder={folder} but the writer is process {writer}: give the folder to "
            "the writer alone"
        )
    state = model_state(model)
    keys = stock_keys(model, state)
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [
        (k, state[k].numel() * (itemsize if state[k].is_floating_point() else state[k].element_size())) for k in keys
    ]
    shards = plan_shards(sizes, max_shard_bytes)
    names = (
        [WEIGHTS]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map, total = {}, 0
    for name, shard in zip(names, shards):
        tensors = {}
        for key in shard:
            full = gather_to(state[key], writer, dtype, piece_bytes)
            if full is None:
                continue
            for out_key, out in revert_weight_conversion(model, {key: full}).items():
                tensors[out_key] = out.contiguous()
            del full
        if folder is None:
            continue
        save_file(tensors, str(Path(folder) / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    if folder is not None and len(names) > 1:
        write_index(Path(folder), weight_map, total)
    return weight_map


def save_config(model: nn.Module, folder: Path) -> None:
    """The files ``save_pretrained`` writes besides the weights: ``config.json`` (the class as architecture) and
    ``generation_config.json``."""
    config = model.config
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(folder)
    if model.can_generate():
        model.generation_config.save_pretrained(folder)
