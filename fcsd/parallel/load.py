"""Loading a checkpoint with only this rank's routed experts (paper Sec. 4.1; design §4): shard before loading.

A 30B MoE in fp32 is ~120 GB, more than one GPU: under expert parallelism no rank may hold every expert, not even
for a moment. transformers' own loader already reads only a rank's shard of a parameter that is a ``DTensor`` on the
meta device (``DtensorShardOperation``: safetensors slices, per-expert checkpoint keys it does not own skipped, its
weight converters stacking the rest). We reuse it: the model is built on the meta device as usual, then, at the
loader's own seam between model init and weight loading (``maybe_distribute_model``), every fused expert parameter
becomes a ``Shard(0)`` ``DTensor`` placeholder over a one-dimensional mesh of the expert-parallel group; after loading
each is turned back into a plain parameter holding the rank's experts (:mod:`fcsd.parallel.shards`), which
:func:`fcsd.parallel.expert_parallel` then adopts. Host memory per rank: the non-expert weights plus ``1/P`` of the
experts; with ``device`` CUDA the tensors load straight onto the GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fcsd.connectivity.families import family_for_config, find_decoder_layers
from fcsd.parallel.shards import ExpertShard, fused_expert_names, mark_sharded


def _experts_modules(model: nn.Module) -> list[nn.Module]:
    family = family_for_config(model.config)
    blocks = [getattr(layer, family.mlp_attr) for layer in find_decoder_layers(model, family)]
    return [getattr(block, family.experts_attr) for block in blocks if family.is_moe(block)]


def sharded_class(model_class: type, group, device_type: str) -> type:
    """A subclass of a transformers model class whose ``from_pretrained`` loads only this rank's experts (the class
    of the loaded model is set back to ``model_class``)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device_type)

    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        for experts in _experts_modules(model):
            num_experts = next(experts.parameters()).shape[0]
            for name in fused_expert_names(experts, num_experts):
                meta = experts._parameters[name]
                placeholder = distribute_tensor(meta.data, mesh, [Shard(0)], src_data_rank=None)
                experts._parameters[name] = nn.Parameter(placeholder, requires_grad=meta.requires_grad)
        return model

    return type(model_class.__name__, (model_class,), {"maybe_distribute_model": classmethod(maybe_distribute_model)})


def adopt_local_shards(model: nn.Module, base_class: type, group) -> nn.Module:
    """After a :func:`sharded_class` load: plain parameters holding the local experts, marked as shards."""
    from torch.distributed.tensor import DTensor

    model.__class__ = base_class
    if hasattr(model.config, "distributed_config"):
        del model.config.distributed_config  # a stock save_pretrained afterwards (no distributed gather)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    for experts in _experts_modules(model):
        names = tuple(name for name, p in experts.named_parameters(recurse=False) if isinstance(p.data, DTensor))
        num_experts = 0
        for name in names:
            param = experts._parameters[name]
            num_experts = param.shape[0]
            experts._parameters[name] = nn.Parameter(param.data.to_local(), requires_grad=param.requires_grad)
        mark_sharded(experts, ExpertShard(rank, size, num_experts, names))
    return model


def check_divisible(config, size: int) -> None:
    """Refuse, before loading, an expert count the group size does not divide."""
    from fcsd.connectivity.families import text_config

    cfg = text_config(config)
    for attr in ("num_experts", "n_routed_experts", "num_local_experts"):
        count = getattr(cfg, attr, None)
        if isinstance(count, int) and count % size:
            raise ValueError(
                f"{count} routed experts cannot be split evenly over {size} expert-parallel ranks: pick a group size "
                f"that divides {count}"
            )


def load_kwargs(group, device: torch.device | None) -> dict:
    """``from_pretrained`` options of a sharded load: the loader's seam (a neutral ``DistributedConfig``) and, on CUDA,
    this rank's device as the target of every tensor."""
    from transformers.distributed import DistributedConfig

    options = {"distributed_config": DistributedConfig()}
    if device is not None and device.type == "cuda":
        options["device_map"] = {"": device}
    return options


def from_pretrained_sharded(name_or_path: str, group, device=None, layers=None, text_only: bool = False, **kwargs):
    """:func:`fcsd.from_pretrained` with only this rank's routed experts loaded (rank ``r`` of ``group``, a process
    group; ``dist.group.WORLD`` for the whole job): host memory holds the non-expert weights and ``1/P`` of the
    experts; with a CUDA ``device`` every tensor loads onto it. Pass the result to
    :func:`fcsd.parallel.expert_parallel` with the same group. Raises ``ValueError`` when the group size does not
    divide the expert count."""
    from transformers.models.auto.auto_factory import _BaseAutoModelClass, _get_model_class

    from fcsd.loading import _stock_config, load_config, model_class_for

    revision = kwargs.get("revision")
    config = kwargs.get("config") or _stock_config(name_or_path, revision) or load_config(name_or_path, revision)
    check_divisible(config, dist.get_world_size(group))
    base = model_class_for(name_or_path, text_only, config, revision)
    if issubclass(base, _BaseAutoModelClass):
        base = _get_model_class(config, base._model_mapping)
    device = torch.device(device) if device is not None else None
    loader = sharded_class(base, group, device.type if device is not None else "cpu")
    from fcsd.loading import from_pretrained

    model = from_pretrained(name_or_path, layers, text_only, model_class=loader, **load_kwargs(group, device), **kwargs)
    return adopt_local_shards(model, base, group)
