"""The whole parallel layout of a model, decided in one place (design §4 "EP at scale"; torchtitan's
``parallelize_*``): expert parallelism (EP) composed with FSDP2 on one set of device meshes.

Two views of the same ``W`` processes (Megatron's "MoE parallel folding", torchtitan's dense and sparse meshes):

- the **dense** mesh ``(fsdp,)``: every process. Everything outside the routed experts (embeddings, attention,
  norms, routers, shared experts, dense MLPs, the LM head) is ``fully_shard``-ed over it.
- the **sparse** mesh ``(efsdp, ep)``, ``efsdp = W / ep``, ``ep`` innermost (consecutive ranks: inside a node, or
  whole nodes when ``ep`` exceeds a node, e.g. EP 64 over 8 nodes of 8 with ``efsdp`` 2, or EP = W with ``efsdp`` 1:
  no FSDP over the experts; ``parallel.dispatcher=hierarchical`` then crosses each node boundary once). The
  routed experts are split over ``ep`` (rank ``p`` keeps experts ``[p E/ep, (p+1) E/ep)``, the all-to-all runs inside
  the ep group, :func:`fcsd.parallel.expert_parallel`), and each rank's expert shard is ``fully_shard``-ed over its
  ``efsdp`` replicas: dim 0 when ``E/ep`` divides by ``efsdp`` (whole experts), else dim 1 (always with a placement,
  so that permuting experts stays within a process, :mod:`fcsd.placement`).
- the **experts** mesh ``(ep, efsdp)``: the same groups, ordered as an expert's place in the stock ``(E, ...)``
  tensor (the ep block first, then its efsdp slice). It names where each rank's expert slice sits in the unsharded
  tensor, for step checkpoints (:mod:`fcsd.parallel.step_state`), shard-on-read loading (:mod:`fcsd.parallel.load`)
  and streamed saving (:mod:`fcsd.parallel.stream_save`).

The experts stay plain ``E/ep`` tensors to the expert-parallel runtime (dispatchers, schedules, placements,
generation): FSDP2 hands them to it gathered, as it hands every module its parameters.

FSDP units. Under the overlapped FarSkip schedule a layer's MLP side (post-attention norm, router, routed and
shared experts) runs on ``o_{k-1}``, which is completed *inside* layer ``k`` (the previous Combine is waited between
the attention's parts), so its gradient leaves the layer without passing the layer's inputs: it cannot share the
attention's unit, whose gradients are reduce-scattered as soon as the gradient of the layer's inputs is complete.
So the MLP side has units of its own, two per layer: the routed experts (sparse mesh), and one group of its small
modules (post-attention norm, router, shared experts, Qwen2's shared-expert gate, or a dense MLP): one gather per pass
and one reduce-scatter for all of them. The group is correct because the norm runs first and everything else of it
consumes the norm's output: its reduce-scatter, hung on the gradient of the norm's input, comes after all of their
gradients; every module's output gathers it when its gradient arrives (FSDP2 hangs a group's gather on its last
module only). Then the layer itself (attention and input norm), the embeddings, ``[final norm, LM head]`` and the
root: 9 collectives per MoE layer and step, against 12 to 18 with a unit per small module
(``benchmarks/fsdp_collectives.py``). Every unit reshards after forward but the student's ``[final norm, LM
head]``, which the chunked loss uses right after the forward (:class:`fcsd.distill.objectives.GatheredHead`: no
full-vocabulary logits) and whose reduce-scatter reshards it; the root holds no parameters (unless the embeddings
are tied), and a frozen teacher is resharded after each forward anyway (a root's reshard is skipped by FSDP2 when no
backward follows), its head unit by the chunked loss when the forward computed no logits. Forward and backward
prefetch are explicit (a layer prefetches its MLP units and the next layer; backward the previous layer), since the
dispatcher's host synchronisation per layer stops FSDP's implicit prefetch from running ahead.

Gradient scale, right by construction: the trainer's loss on each process is ``W x (its token-loss sum) / (global
token count)`` (the DDP convention). Dense units average over the ``W`` processes (FSDP's default). An expert shard's
gradient already sums every rank of its ep group (the reverse all-to-all brings them) and its units sum its
``efsdp`` replicas: divided by ``efsdp`` (FSDP's default for their group) it would come out ``ep`` times too large,
the classic error; so their divide factor is ``W``. Every reduction is a plain sum divided afterwards (gloo has no
average; NCCL's pre-multiplied sum is slower and was wrong in bf16), except a size-1 expert group, where FSDP2 divides
itself. Reductions run in fp32 (``reduce_dtype``); with ``compute_dtype=bfloat16`` the gathered weights are bf16.

:func:`parallelize` applies all of it; it runs on real, meta or fake tensors (the loader calls it on the meta model
before reading the weights, the planner on fake tensors over a fake process group).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

ROLES = ("student", "teacher")


@dataclass(frozen=True)
class ParallelDims:
    """How ``world`` processes run a model: routed experts over groups of ``ep`` consecutive processes; with
    ``fsdp`` everything else (and each expert shard over its ``world / ep`` replicas) FSDP2-sharded, without it
    replicated (gradients all-reduced: :func:`fcsd.parallel.reduce_gradients`)."""

    world: int
    ep: int = 1
    fsdp: bool = False

    def __post_init__(self):
        if self.ep < 1 or self.world % self.ep:
            raise ValueError(
                f"parallel.ep_size={self.ep} must divide the number of processes ({self.world}): expert-parallel "
                "groups are consecutive ranks"
            )

    @property
    def efsdp(self) -> int:
        """Processes holding the same experts (one per expert-parallel group)."""
        return self.world // self.ep

    @property
    def name(self) -> str:
        if not self.fsdp:
            return f"EP {self.ep}" if self.ep > 1 else "replicated"
        return f"EP {self.ep} x FSDP {self.efsdp}" if self.ep > 1 else f"FSDP {self.world}"

    def to_dict(self) -> dict:
        return {"world": self.world, "ep": self.ep, "fsdp": self.fsdp}


@dataclass
class Meshes:
    """The device meshes of :class:`ParallelDims` (see the module docstring)."""

    dims: ParallelDims
    device_type: str
    dense: object  # DeviceMesh ("fsdp",)
    sparse: object  # DeviceMesh ("efsdp", "ep")
    experts: object  # DeviceMesh ("ep", "efsdp"): the same groups in the stock tensors' order

    @property
    def ep_group(self):
        return self.sparse.get_group("ep")

    @property
    def efsdp_mesh(self):
        return self.sparse["efsdp"]


def build_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    """The meshes of ``dims`` over the initialised job (a collective: every process calls it, in the same order).
    Under NCCL the expert-parallel groups use high-priority streams, so that the all-to-alls the schedule overlaps
    with compute are not queued behind it."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from fcsd.parallel.groups import bound_by_the_run_timeout, high_priority_options

    if dist.get_world_size() != dims.world:
        raise ValueError(f"the layout is for {dims.world} processes but the job has {dist.get_world_size()}")
    options = high_priority_options() if device_type == "cuda" else None
    override = {"ep": ("nccl", options)} if options is not None else None
    dense = init_device_mesh(device_type, (dims.world,), mesh_dim_names=("fsdp",))
    sparse = init_device_mesh(
        device_type, (dims.efsdp, dims.ep), mesh_dim_names=("efsdp", "ep"), backend_override=override
    )
    bound_by_the_run_timeout(dense.get_group("fsdp"), sparse.get_group("ep"), sparse.get_group("efsdp"))
    experts = DeviceMesh.from_group(
        [sparse.get_group("ep"), sparse.get_group("efsdp")],
        device_type,
        mesh=sparse.mesh.t().contiguous(),
        mesh_dim_names=("ep", "efsdp"),
    )
    return Meshes(dims, device_type, dense, sparse, experts)


@dataclass
class Layout:
    """What :func:`parallelize` set up, kept as ``model.fcsd_layout``."""

    meshes: Meshes
    role: str
    expert_dim: int | None = None  # the dim FSDP2 shards each expert tensor on (None: experts not FSDP-sharded)
    units: list = field(default_factory=list)  # FSDP modules, in forward order
    placement: object = None  # a placement still to apply once weights are loaded (a meta model)

    @property
    def dims(self) -> ParallelDims:
        return self.meshes.dims


def parallelize(
    model: nn.Module,
    meshes: Meshes,
    role: str = "student",
    *,
    mode: str = "farskip_overlap",
    placement=None,
    dispatcher: str = "plain",
    node_size: int | None = None,
    checkpointing: bool = False,
    offload: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Lay ``model`` out over ``meshes`` in place (the module docstring says how) and return it.

    - ``role="student"``: trained (gradient divide factors as above, ``checkpointing`` recomputes each decoder
      layer with its exchanges replayed, ``offload`` keeping their rows in host memory: :mod:`fcsd.parallel.recompute`);
      ``"teacher"``: frozen, no gradients,
      resharded after every forward, run in mode ``regular`` when it has no FarSkip layers.
    - ``mode``, ``placement``, ``dispatcher``, ``node_size``: as :func:`fcsd.parallel.expert_parallel` (expert
      parallelism over the ep groups, which may span nodes; with ``ep=1`` the local dispatcher). On a meta model
      (the sharded loader's) the placement is kept and applied by :func:`finish_loading`.
    - ``compute_dtype``: the dtype FSDP2 gathers the weights in (bf16 on GPUs; ``None``: as stored); gradients are
      reduced in fp32.

    Every process calls it with the same arguments (it is collective). Returns ``model`` with ``model.fcsd_layout``
    (:class:`Layout`) set.
    """
    from fcsd.connectivity.patch import farskip_layers
    from fcsd.parallel.apply_ep import expert_parallel

    if role not in ROLES:
        raise ValueError(f"role={role!r}: use one of {', '.join(ROLES)}")
    dims = meshes.dims
    meta = any(p.is_meta for p in model.parameters())  # the sharded loader's model, before its weights are read
    if role == "teacher" and not farskip_layers(model):
        mode = "regular"
    deferred = placement if meta else None
    replicas = meshes.sparse.get_group("efsdp") if dims.efsdp > 1 else None
    options = {"mode": mode, "placement": None if meta else placement, "dispatcher": dispatcher, "node_size": node_size}
    expert_parallel(model, meshes.ep_group, replica_group=replicas, **options)
    layout = Layout(meshes, role, placement=deferred)
    model.fcsd_layout = layout
    if checkpointing and role == "student":
        from fcsd.parallel import recompute

        recompute.enable(model, offload)
    if dims.fsdp:
        shard_fully(model, layout, compute_dtype, column_experts=placement is not None)
    return model


def expert_shard_dim(local_experts: int, efsdp: int, column: bool) -> int:
    """The dim of an expert tensor FSDP2 shards over the ``efsdp`` replicas: 0 (whole experts) when they divide
    evenly and no placement will permute them, else 1."""
    return 0 if not column and local_experts % efsdp == 0 else 1


def expert_divide_factor(dims: ParallelDims) -> float:
    """What an expert shard's summed gradient is divided by: every process's tokens reach it (the ep group's through
    the reverse all-to-all, the efsdp replicas' through the reduce-scatter), so the process count, as for a dense
    gradient; FSDP2's default for the expert group, ``efsdp``, would leave it ``ep`` times too large."""
    return float(dims.world)


def shard_fully(model: nn.Module, layout: Layout, compute_dtype=None, column_experts: bool = False) -> None:
    """The FSDP2 part of :func:`parallelize` (see the module docstring for the units, factors and prefetch)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    from torch.distributed.tensor import Shard

    from fcsd.connectivity.families import family_for_config, find_decoder_layers, text_model

    dims, meshes = layout.dims, layout.meshes
    student = layout.role == "student"
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    common = {"mp_policy": policy}
    family = family_for_config(model.config)
    units, per_layer = [], []

    def unit(module, mesh=meshes.dense, reshard_after_forward=True, **options):
        module = fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, **common, **options)
        module = module[0] if isinstance(module, list) else module  # a group of modules shares one state
        if student and dims.world > 1:
            module.set_force_sum_reduction_for_comms(True)
        units.append(module)
        return module

    routers = set()  # router rows are experts: keep them whole on every process (placements permute them)

    def rows_first(param):
        return Shard(1) if id(param) in routers and param.ndim >= 2 else Shard(0)

    embeddings, head = text_model(model).get_input_embeddings(), text_model(model).get_output_embeddings()
    tied = head is not None and head.weight is embeddings.weight
    if not tied:
        unit(embeddings)
    for layer in find_decoder_layers(model, family):
        first = len(units)
        mlp = getattr(layer, family.mlp_attr)
        mlp_side = [layer.post_attention_layernorm]  # one unit: its module run first, its input's gradient last
        if family.is_moe(mlp):
            experts = getattr(mlp, family.experts_attr)
            local = experts._fcsd_shard.local
            layout.expert_dim = expert_shard_dim(local, dims.efsdp, column_experts)
            experts.fcsd_rows = types.MethodType(_rows_forward(family, mlp), experts)
            unit(experts, meshes.efsdp_mesh, shard_placement_fn=lambda p: Shard(layout.expert_dim))
            register_fsdp_forward_method(experts, "fcsd_rows")
            if student:
                experts.set_gradient_divide_factor(expert_divide_factor(dims))
                experts.set_force_sum_reduction_for_comms(dims.efsdp > 1)  # a size-1 group divides by itself
            routers.update(id(p) for p in family.router(mlp).parameters())
            mlp_side += [c for c in mlp.children() if c is not experts and any(True for _ in c.parameters())]
        elif any(True for _ in mlp.parameters()):
            mlp_side.append(mlp)
        unit(mlp_side, shard_placement_fn=rows_first)
        _gather_before_backward(mlp_side)
        unit(layer)
        per_layer.append(units[first:])
    tail = [m for m in (_final_norm(model), None if tied else head) if m is not None]
    # the student's head stays gathered after the forward, for the chunked loss (its post-backward reshards it)
    unit(tail if len(tail) > 1 else tail[0], reshard_after_forward=not student)
    unit(model)
    if student:  # before FSDP2's own post-forward hook, which warns about the views it would register on
        model.register_forward_hook(without_views, prepend=True)
    _prefetch(per_layer)
    if not student:
        model.requires_grad_(False)
        head_owner = model if tied else units[-2]
        model.register_forward_hook(lambda module, args, output: _reshard(units, output, head_owner))
    model.fcsd_fsdp_units = units
    layout.units = units


def without_views(module, args, output):
    """The root's output with every view that requires a gradient replaced by a copy.

    ``output_hidden_states`` records the first decoder layer's input as FSDP2's own pre-forward hook handed it on: a
    view of the embeddings (its autograd function returns its input). FSDP2 then warns on every step that the root
    "returned a view tensor" whose pre-backward hook an in-place op would drop. fcsd never changes an output in place
    (and its hidden-state losses skip that entry), so the warning was noise; a copy of one ``(B, T, d)`` tensor per
    micro-batch removes it at the source and makes the outputs safe for a caller that does."""
    if isinstance(output, torch.Tensor):
        return output.clone() if output._base is not None and output.requires_grad else output
    if isinstance(output, dict):  # transformers' ModelOutput: replaced key by key, the object kept
        for key, value in list(output.items()):
            output[key] = without_views(module, args, value)
        return output
    if isinstance(output, tuple | list):
        values = [without_views(module, args, value) for value in output]
        return type(output)(values) if isinstance(output, list) or type(output) is tuple else output
    return output


def _final_norm(model):
    from fcsd.connectivity.families import final_norm

    return final_norm(model)


def _reshard(units, output, head_owner) -> None:
    """Free every gathered weight of a frozen model after its forward (FSDP2 keeps the root's gathered when no
    backward follows); a forward that computed no logits (the chunked loss's) leaves the LM head's unit gathered
    for the chunks, which reshard it when done (:class:`fcsd.distill.objectives.GatheredHead`)."""
    logits = getattr(output, "logits", None)
    keep = head_owner if isinstance(logits, torch.Tensor) and logits.numel() == 0 else None
    for module in units:
        if module is not keep:
            module.reshard()


def head_unit(model: nn.Module):
    """The FSDP2 module whose unit holds ``model``'s LM head weight (the innermost ``fully_shard``-ed module on the
    path to the head: ``[final norm, LM head]`` here, the root when tied or under accelerate's FSDP2), or None."""
    from torch.distributed.fsdp import FSDPModule

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None
    path = next((name for name, module in model.named_modules() if module is head), None)
    if path is None:
        return None
    owner, module = (model if isinstance(model, FSDPModule) else None), model
    for part in path.split(".") if path else []:
        module = getattr(module, part)
        owner = module if isinstance(module, FSDPModule) else owner
    return owner


def _prefetch(per_layer: list[list]) -> None:
    """Explicit prefetch: the layer unit (each layer's last) gathers its layer's MLP units and the next layer in
    forward; in backward the previous layer's units."""
    for index, units in enumerate(per_layer):
        layer_unit, inner = units[-1], units[:-1]
        ahead = inner + ([per_layer[index + 1][-1]] if index + 1 < len(per_layer) else [])
        if ahead:
            layer_unit.set_modules_to_forward_prefetch(ahead)
        if index > 0:
            layer_unit.set_modules_to_backward_prefetch(per_layer[index - 1])


def _gather_before_backward(group: list) -> None:
    """FSDP2 hangs a grouped unit's pre-backward gather on the output of the module that ran last; the router's
    output gradient can come first (the weighted sum of the routed rows). So every module's output gathers the unit
    when its gradient arrives (nothing when gathered already; always before the unit's post-backward, which waits for
    the gradient of the first module's input, upstream of them all)."""

    def hook(module, args, output):
        for tensor in torch.utils._pytree.tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad: module.unshard())

    for module in group[1:]:
        module.register_forward_hook(hook)


def _rows_forward(family, moe):
    """The routed experts on given rows, the experts module's own forward (an FSDP2 forward method: its weights are
    gathered around it). A rank whose experts get no rows still returns an output tied to their weights, so that
    every rank's backward reaches the same units and reduces the same gradients."""
    from fcsd.connectivity.adapters import weighted_experts

    def fcsd_rows(self, tokens_RD, expert_ids_RK, weights_RK):
        if family.experts is weighted_experts:
            out = self.forward(tokens_RD, expert_ids_RK, weights_RK)  # the hooks live in __call__, run already
        else:
            out = family.experts(moe, tokens_RD, expert_ids_RK, weights_RK)
        trainable = [p for p in self.parameters() if p.requires_grad]
        if torch.is_grad_enabled() and trainable and not out.requires_grad:
            out = out + sum(p.reshape(-1)[:0].sum() for p in trainable)
        return out

    return fcsd_rows
