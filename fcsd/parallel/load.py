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

    return _loader_class(model_class, maybe_distribute_model)


def _loader_class(model_class: type, maybe_distribute_model) -> type:
    """``model_class`` with its loader seam replaced. The subclass keeps the stock class's ``__module__``:
    transformers reads that module's source to decide whether the model may use its grouped experts kernel, and
    without it picked the ``eager`` loop over experts (a host synchronisation per expert) for every sharded load."""
    attributes = {"maybe_distribute_model": classmethod(maybe_distribute_model), "__module__": model_class.__module__}
    return type(model_class.__name__, (model_class,), attributes)


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


def layout_class(model_class: type, meshes, role: str, layers, options: dict) -> type:
    """A subclass of a transformers model class whose ``from_pretrained`` builds the model on the meta device,
    converts ``layers`` to FarSkip, lays it out with :func:`fcsd.parallel.layout.parallelize` and then reads only
    this rank's slice of every tensor: FSDP2 shards are DTensors already, and each rank's routed-expert slice is
    exposed to the loader as its place in the stock ``(E, ...)`` tensor (:func:`expose_experts`) until
    :func:`finish_loading` gives the runtime back its own tensors."""

    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        from fcsd.connectivity.patch import apply_farskip
        from fcsd.parallel.layout import parallelize

        if layers:
            apply_farskip(model, layers)
        parallelize(model, meshes, role, **options)
        model.fcsd_expert_parallel.gather.mode = "local"  # the loader reads the state dict of a meta model
        expose_experts(model)
        return model

    return _loader_class(model_class, maybe_distribute_model)


def expose_experts(model: nn.Module) -> None:
    """Replace each sharded expert tensor by its stock-layout view (:func:`fcsd.parallel.step_state.expert_view`),
    which the loader fills with this rank's slice; the runtime's tensors are kept for :func:`finish_loading`."""
    from fcsd.parallel.step_state import expert_names, expert_view

    kept = {}
    for key, experts in expert_names(model).items():
        name = key.rsplit(".", 1)[1]
        param = experts._parameters[name]
        kept[key] = param
        experts._parameters[name] = nn.Parameter(expert_view(param.data, model), requires_grad=param.requires_grad)
    model.fcsd_layout.loading = kept


def finish_loading(model: nn.Module, base_class: type) -> nn.Module:
    """After a :func:`layout_class` load: each expert tensor back in the runtime's layout (the rank's ``E/ep``
    experts, FSDP2-sharded or plain) holding what was read, the class and state-dict mode restored, a deferred
    placement applied (by exchanging experts between the ranks)."""
    from torch.distributed.tensor import DTensor

    from fcsd.parallel.step_state import expert_names

    layout, state = model.fcsd_layout, model.fcsd_expert_parallel
    experts = expert_names(model)
    for key, kept in layout.loading.items():
        module, name = experts[key], key.rsplit(".", 1)[1]
        local = module._parameters[name].data._local_tensor
        if isinstance(kept, DTensor):
            data = DTensor.from_local(
                local, kept.device_mesh, kept.placements, run_check=False, shape=kept.shape, stride=kept.stride()
            )
        else:
            data = local
        module._parameters[name] = param = nn.Parameter(data, requires_grad=kept.requires_grad)
        param.fcsd_expert_shard = True
    layout.loading = None
    _compact(model)
    state.expert_params = [module._parameters[key.rsplit(".", 1)[1]] for key, module in experts.items()]
    state.gather.mode = "all"
    if not layout.dims.fsdp:
        model.__class__ = base_class
    if hasattr(model.config, "distributed_config"):
        del model.config.distributed_config  # a stock save_pretrained afterwards (no distributed gather)
    if layout.placement is not None:
        from fcsd.parallel.apply_ep import _apply_placement

        _apply_placement(model, layout.placement, layout.dims.ep, layout.meshes.ep_group, True)
        layout.placement = None
    return model


def concrete_class(name_or_path: str, text_only: bool, config, revision=None) -> type:
    """The model class :func:`fcsd.loading.from_pretrained` loads ``name_or_path`` with, an auto class resolved."""
    from transformers.models.auto.auto_factory import _BaseAutoModelClass, _get_model_class

    from fcsd.loading import model_class_for

    base = model_class_for(name_or_path, text_only, config, revision)
    return _get_model_class(config, base._model_mapping) if issubclass(base, _BaseAutoModelClass) else base


def _compact(model: nn.Module) -> None:
    """Give every DTensor parameter a storage of its own slice: the loader may hand over a view of the whole
    checkpoint tensor (a memory-mapped file's), which would keep it alive."""
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if not isinstance(param, DTensor):
                continue
            local = param._local_tensor
            if local.untyped_storage().nbytes() > local.numel() * local.element_size():
                data = DTensor.from_local(
                    local.clone(),
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
                module._parameters[name] = nn.Parameter(data, requires_grad=param.requires_grad)


def from_pretrained_parallel(
    name_or_path: str,
    meshes,
    role: str = "student",
    layers=None,
    text_only: bool = False,
    device=None,
    layout: dict | None = None,
    **kwargs,
):
    """Load a checkpoint laid out by :func:`fcsd.parallel.layout.parallelize` over ``meshes`` (``layout``: its
    keyword options), reading only this rank's slices (design §4: no rank ever holds a whole model, on device or
    host). ``layers``: the FarSkip selection (default: the checkpoint's recorded one). A collective: every process
    calls it. Raises ``ValueError`` when the expert-parallel size does not divide the expert count."""
    from fcsd.block_fp8 import dequantizing_class, fp8_settings, without_quantization
    from fcsd.connectivity.patch import CONFIG_KEY
    from fcsd.loading import _stock_config, check_weight_files, load_config

    revision = kwargs.get("revision")
    config = kwargs.pop("config", None) or _stock_config(name_or_path, revision) or load_config(name_or_path, revision)
    check_divisible(config, meshes.dims.ep)
    check_weight_files(name_or_path)
    base = concrete_class(name_or_path, text_only, config, revision)
    if layers is None:
        layers = (getattr(config, CONFIG_KEY, None) or {}).get("layers", [])
    device = torch.device(device) if device is not None else None
    read = base
    settings = fp8_settings(config)
    if settings is not None:  # block FP8: each rank dequantizes the whole blocks around its slices (fcsd.block_fp8)
        config, read = without_quantization(config), dequantizing_class(base, settings)
    loader = layout_class(read, meshes, role, layers, layout or {})
    model = loader.from_pretrained(name_or_path, config=config, **load_kwargs(None, device), **kwargs)
    return finish_loading(model, base)
