"""Step checkpoints of a parallel layout with ``torch.distributed.checkpoint`` (DCP; design §4 "EP at scale").

Every process writes its own shards of the model and of the AdamW states (``__<rank>_0.distcp``; the coordinator adds
``.metadata``) into the staged checkpoint folder, which the trainer publishes once all have written
(:func:`fcsd.distill.checkpointing.save_checkpoint`). What is saved is each tensor's *global* layout: parameters
FSDP2 shards are DTensors already; replicated ones (expert parallelism without FSDP) are plain tensors, written
once; a rank's routed-expert slice is described as its place in the stock ``(E, ...)`` tensor, a DTensor over the
layout's ``(ep, efsdp)`` experts mesh (:mod:`fcsd.parallel.layout`), not as the ``E/ep`` tensor the runtime holds.
So a checkpoint names every tensor as the one-process model has it, and DCP reshards on load: a resume reads the
slices its own layout needs, at any process count, ``ep`` and ``fsdp`` (the same placement: it permutes the
experts). The layout that wrote it is recorded (:func:`layout_record`) for the one-line refusals of
:func:`check_resumable`.

:func:`stock_tensors` reads such a checkpoint back tensor by tensor without any process group (``fcsd export
RUN/checkpoints/step-N``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

FORMAT = "torch.distributed.checkpoint"
METADATA = ".metadata"


def expert_names(model: nn.Module) -> dict[str, nn.Module]:
    """``{state-dict key: experts module}`` of every sharded routed-expert tensor of ``model``."""
    found = {}
    for prefix, module in model.named_modules():
        shard = getattr(module, "_fcsd_shard", None)
        if shard is not None:
            found.update({f"{prefix}.{name}": module for name in shard.names})
    return found


def expert_view(tensor: torch.Tensor, model: nn.Module):
    """This rank's slice of a routed-expert tensor (a parameter or one of its AdamW states) as a DTensor of the
    stock ``(E, ...)`` tensor over the experts mesh, sharing the live storage."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    layout = model.fcsd_layout
    meshes = layout.meshes
    per_rank = tensor.shape  # a DTensor's global shape over efsdp: the E/ep experts of this ep rank
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    shape = torch.Size([per_rank[0] * meshes.dims.ep, *per_rank[1:]])
    inner = Shard(layout.expert_dim) if layout.expert_dim is not None else Replicate()
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, meshes.experts, [Shard(0), inner], run_check=False, shape=shape, stride=stride)


def _global(key: str, tensor, experts: dict, model: nn.Module):
    return expert_view(tensor, model) if key in experts else tensor


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors in their global layout (see the module docstring), aliasing the live ones."""
    from fcsd.parallel.grads import gathered

    experts = expert_names(model)
    with gathered(model, "local"):
        state = model.state_dict()
    return {key: _global(key, value, experts, model) for key, value in state.items()}


def optimizer_state(model: nn.Module, optimizer) -> dict:
    """The AdamW states keyed by parameter name, in the same global layout; the groups' settings as an object."""
    names = _parameter_names(model)
    experts = expert_names(model)
    state = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            key = names[id(param)]
            state[key] = {
                k: _global(key, v, experts, model) if v.dim() else v for k, v in optimizer.state[param].items()
            }
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return {"state": state, "groups": groups}


def _parameter_names(model: nn.Module) -> dict[int, str]:
    return {id(param): name for name, param in model.named_parameters()}


def init_optimizer_state(optimizer) -> None:
    """Create every AdamW state (what a resume loads into): one step with zero gradients and a zero learning rate
    (weights unchanged), its counters overwritten by the load."""
    saved = [(group["lr"], group.get("weight_decay", 0.0)) for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = 0.0, 0.0
        for param in group["params"]:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, (lr, decay) in zip(optimizer.param_groups, saved):
        group["lr"], group["weight_decay"] = lr, decay


def layout_record(model: nn.Module) -> dict:
    """What a checkpoint records of the layout that wrote it."""
    return {"format": FORMAT, **model.fcsd_layout.dims.to_dict()}


def save(model: nn.Module, optimizer, folder: Path) -> None:
    """Write this rank's shards of the model and optimizer into ``folder`` (a collective: every process)."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model_state(model), "optim": optimizer_state(model, optimizer)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder), single_file_per_rank=True))


def load(model: nn.Module, optimizer, folder: Path) -> None:
    """Read the model and optimizer back from ``folder`` into this rank's tensors, resharded for its layout."""
    import torch.distributed.checkpoint as dcp

    if not any(optimizer.state.values()):
        init_optimizer_state(optimizer)
    state = {"model": model_state(model), "optim": optimizer_state(model, optimizer)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)))
    for group, saved in zip(optimizer.param_groups, state["optim"]["groups"]):
        group.update(saved)


def check_resumable(record: dict | None, checkpoint: Path, layout: str | None) -> None:
    """Refuse in one line a checkpoint whose format the run cannot read: a DCP checkpoint resumed without a
    parallel layout, or a one-process / DDP checkpoint (accelerate's full state) resumed with one (``layout``: the
    run's layout name, None without one). DCP checkpoints reshard between layouts (other process counts, ``ep``
    and ``fsdp``)."""
    record = record or {}
    if record.get("format") == FORMAT and layout is None:
        from fcsd.command_line import torchrun_line

        settings = {"parallel.ep_size": str(record["ep"]), "parallel.fsdp": str(bool(record["fsdp"])).lower()}
        raise ValueError(
            f"--resume: {checkpoint} holds the sharded checkpoint of a {_describe(record)} run: resume it on processes "
            f"a launcher starts, with its layout or another (any process count parallel.ep_size divides): "
            f"`{torchrun_line(max(record['ep'], 2), settings)}`; or export it with `fcsd export`"
        )
    if record.get("format") != FORMAT and layout is not None:
        raise ValueError(
            f"--resume: {checkpoint} was written by a run without parallel.ep_size / parallel.fsdp (the whole state "
            f"in accelerate's files): resume it without them, not as {layout}"
        )


def config_layout(config) -> str | None:
    """The name of the layout a run's ``parallel.*`` settings ask for, or None (one process, DDP, accelerate's)."""
    parallel = config.parallel
    if parallel.ep_size == 1 and not parallel.fsdp:
        return None
    return f"parallel.ep_size={parallel.ep_size} parallel.fsdp={str(parallel.fsdp).lower()}"


def _describe(record: dict) -> str:
    from fcsd.parallel.layout import ParallelDims

    dims = ParallelDims(record["world"], record["ep"], record["fsdp"])
    return f"{dims.name} ({dims.world} processes)"


def is_sharded_checkpoint(folder: Path) -> bool:
    return (Path(folder) / METADATA).exists()


def stock_tensors(folder: Path):
    """``(key, tensor)`` of the model in a DCP step checkpoint, one tensor at a time, in the stock layout, without a
    process group (what ``fcsd export`` of a step checkpoint reads)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(folder))
    metadata = reader.read_metadata()
    for fqn, meta in metadata.state_dict_metadata.items():
        if not fqn.startswith("model.") or not isinstance(meta, TensorStorageMetadata):
            continue
        tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
        dcp.load({"model": {fqn[len("model.") :]: tensor}}, storage_reader=reader, no_dist=True)
        yield fqn[len("model.") :], tensor


def recorded_layout(folder: Path) -> dict | None:
    from fcsd.files.run_folder import TRAINER_STATE

    path = Path(folder) / TRAINER_STATE
    return json.loads(path.read_text()).get("layout") if path.exists() else None


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
