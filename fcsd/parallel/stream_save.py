"""``final/``, ``best/`` and exports of a parallel layout, streamed (design §4: "exports streamed tensor by tensor").

No process ever holds the whole model: the tensors are gathered one at a time (every process takes part in each
gather; a replicated tensor needs none) and the main process adds each to the output shard being filled, converted
to the model's dtype and back to the checkpoint's stock key layout (transformers' own reverse weight conversion:
fused experts are written as the per-expert tensors the model was loaded from), and writes a shard as soon as it is
full. Shards are planned before anything is gathered (from the tensors' global shapes), so the files are named as
``save_pretrained`` names them (``model-00001-of-00003.safetensors`` and ``model.safetensors.index.json``, or one
``model.safetensors``). Host memory of the main process: one output shard plus one tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fcsd.weight_files import WEIGHTS, write_index

DEFAULT_SHARD_BYTES = 5 * 2**30


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


def write_weights(
    model: nn.Module, folder: Path | None, dtype: torch.dtype, max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> dict:
    """Stream ``model``'s weights into ``folder`` (the main process's staging folder; ``None`` on the others, which
    only take part in the gathers). Returns the weight map (output key -> file) on the main process."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    from fcsd.parallel.step_state import model_state

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
            full = gather(state[key])
            if folder is None:
                continue
            full = full.detach().to("cpu", dtype=dtype if full.is_floating_point() else full.dtype)
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
