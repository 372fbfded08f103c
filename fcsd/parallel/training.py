"""What the FCSD trainer needs under ``parallel.ep_size`` > 1 or ``parallel.fsdp`` (paper Sec. 4.1; design §4 "EP
at scale"): the run's device meshes, the laid-out loading of student and teacher, the gradient reduction, the global
gradient norm over both meshes and the optimizer's parameter groups.

The FCSD trainer (:mod:`fcsd.distill.trainer`) calls these; the student is then not wrapped in DDP or accelerate's
FSDP (:mod:`fcsd.parallel.layout` lays it out). Step checkpoints: :mod:`fcsd.parallel.step_state`; ``final/`` and
``best/``: :mod:`fcsd.parallel.stream_save`. :func:`expert_parallel_group` and :func:`make_expert_parallel` lay out
expert parallelism alone on a process group (what ``fcsd plan`` models).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from fcsd.parallel.apply_ep import expert_parallel
from fcsd.parallel.groups import new_group

OPTIMIZER_SHARD = "optimizer_ep_rank{rank}.pt"  # each process's optimizer state (its experts' moments differ)
DENSE_FILE = "model_replicated.pt"  # the non-expert weights, written by the main process
EXPERT_SHARD = "model_experts_ep{rank}.pt"  # expert shards of expert-parallel rank r (written by the first EP group)


def expert_parallel_group(ep_size: int):
    """The group of ``ep_size`` consecutive ranks this process belongs to. Every process creates every group, in the
    same order, as torch requires. Under NCCL the groups use high-priority CUDA streams, so that the all-to-alls
    the schedule overlaps with compute are not queued behind it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if ep_size < 1 or world % ep_size:
        raise ValueError(
            f"parallel.ep_size={ep_size} must divide the number of processes ({world}): expert-parallel groups are "
            "consecutive ranks"
        )
    mine = None
    for first in range(0, world, ep_size):
        group = new_group(list(range(first, first + ep_size)))
        if first <= rank < first + ep_size:
            mine = group
    return mine


def run_meshes(config, accelerator):
    """The device meshes of a run's ``parallel.*`` settings (:mod:`fcsd.parallel.layout`), or None when it has no
    parallel layout (one process, DDP, accelerate's FSDP / ZeRO-3 configs)."""
    from accelerate.utils import DistributedType

    from fcsd.parallel.layout import ParallelDims, build_meshes

    parallel = config.parallel
    if parallel.ep_size == 1 and not parallel.fsdp:
        return None
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ValueError(
            "parallel.ep_size > 1 and parallel.fsdp=true run under plain torchrun / accelerate launch (fcsd lays the "
            "model out itself), not under accelerate's FSDP / ZeRO-3 configs"
        )
    dims = ParallelDims(accelerator.num_processes, parallel.ep_size, parallel.fsdp)
    return build_meshes(dims, accelerator.device.type)


def teacher_meshes(accelerator):
    """Under accelerate's FSDP2 (which shards the student), the meshes the frozen teacher is loaded sharded over:
    FSDP2 over every process (design §4: no process loads the whole teacher)."""
    from accelerate.utils import DistributedType

    from fcsd.parallel.layout import ParallelDims, build_meshes

    if accelerator.distributed_type != DistributedType.FSDP:
        return None
    return build_meshes(ParallelDims(accelerator.num_processes, 1, True), accelerator.device.type)


def laid_out_loader(config, meshes, role: str, device):
    """``load(path, layers=None, text_only=False, **from_pretrained options)`` loading ``role`` laid out over
    ``meshes`` as the run's config says (:func:`fcsd.parallel.load.from_pretrained_parallel`)."""
    from fcsd.parallel.load import from_pretrained_parallel

    parallel, train = config.parallel, config.train
    options = {"mode": parallel.mode, "dispatcher": parallel.dispatcher, "placement": parallel.placement or None}
    options["node_size"] = getattr(parallel, "node_size", None)  # absent from run configs written before it
    if role == "student":
        bf16 = train.mixed_precision == "bf16" or (train.mixed_precision == "auto" and device.type == "cuda")
        options.update(
            checkpointing=train.gradient_checkpointing,
            offload=train.checkpoint_offload,
            compute_dtype=torch.bfloat16 if bf16 else None,
        )

    def load(path, layers=None, text_only=False, **kwargs):
        return from_pretrained_parallel(path, meshes, role, layers, text_only, device, options, **kwargs)

    return load


def make_expert_parallel(model: nn.Module, group, mode: str, placement: str | None = None) -> nn.Module:
    """Shard the routed experts of a model over ``group`` (see :func:`fcsd.parallel.expert_parallel`; a model loaded
    as shards is adopted); ``placement`` is a PLACEMENT.json applied first. A model without FarSkip layers (the
    teacher) runs in mode ``regular``."""
    from fcsd.connectivity.patch import farskip_layers

    mode = mode if farskip_layers(model) else "regular"
    return expert_parallel(model, group, mode=mode, placement=placement or None)


def take_traffic(model: nn.Module) -> dict:
    """The rows every process's expert-parallel dispatcher sent to other processes since the last call, summed over
    the job (training and held-out forwards; a checkpointed layer's recomputation sends none), and of them the rows
    that crossed to another node (:attr:`~fcsd.parallel.dispatchers.Dispatcher.inter_rows_sent`); the counters
    restart. A collective: every process calls it. Empty without expert parallelism."""
    state = getattr(model, "fcsd_expert_parallel", None)
    if state is None or state.size == 1:
        return {}
    dispatcher = state.dispatcher
    device = next(model.parameters()).device
    sent = torch.tensor([dispatcher.rows_sent, dispatcher.inter_rows_sent], dtype=torch.int64, device=device)
    dist.all_reduce(sent)
    dispatcher.reset_counters()
    rows, crossing = sent.tolist()
    return {"ep/rows_sent": rows, "ep/rows_crossing_nodes": crossing}


def clip_grad_norm_(model: nn.Module, max_norm: float) -> float:
    """Clip the gradients of an expert-parallel or FSDP2-sharded model to a global 2-norm of ``max_norm`` (``inf``:
    measure only); returns the norm before clipping, equal to the single-process model's.

    Without FSDP, replicated gradients count once and each expert shard once per expert-parallel group. Under FSDP2
    (:mod:`fcsd.parallel.layout`) each element of every gradient lives on exactly one process (dense shards over
    the dense mesh, expert slices over ``ep`` x ``efsdp``): one sum of local squares over all processes, whatever
    mesh each gradient is on (a norm of DTensors of two meshes at once is what torch's clipping refuses)."""
    from torch.distributed.tensor import DTensor

    from fcsd.parallel.grads import sum_of_squares

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    device = next(model.parameters()).device  # a rank without gradients still takes part, on the group's device
    if getattr(getattr(model, "fcsd_layout", None), "dims", None) is not None and model.fcsd_layout.dims.fsdp:
        locals_ = [grad._local_tensor if isinstance(grad, DTensor) else grad for grad in grads]
        squares = sum_of_squares(locals_, device).reshape(1)
        dist.all_reduce(squares)
        norm = float(torch.sqrt(squares[0]))
    else:
        state = model.fcsd_expert_parallel
        kinds = [getattr(p, "fcsd_expert_shard", False) for p in model.parameters() if p.grad is not None]
        dense = sum_of_squares([g for g, is_expert in zip(grads, kinds) if not is_expert], device)
        expert_sq = sum_of_squares([g for g, is_expert in zip(grads, kinds) if is_expert], device).reshape(1)
        dist.all_reduce(expert_sq, group=state.group)  # the shards of one expert-parallel group make the experts
        norm = float(torch.sqrt(dense + expert_sq[0]))
    if math.isfinite(max_norm) and norm > max_norm:
        for grad in grads:
            grad.mul_(max_norm / (norm + 1e-6))
    return norm


def reduce_and_clip(model: nn.Module, max_norm: float) -> float:
    """What the trainer does after a step's backward under a parallel layout: without FSDP the gradients are
    all-reduced (DP over every process, experts over their copies; FSDP2 reduce-scatters them during the
    backward), then :func:`clip_grad_norm_`."""
    from fcsd.parallel.grads import reduce_gradients

    if not model.fcsd_layout.dims.fsdp:
        reduce_gradients(model, op="mean")  # the DDP convention the trainer's loss scale assumes
    return clip_grad_norm_(model, max_norm)


def parameter_groups(model: nn.Module, params: list) -> list[dict]:
    """``params`` in two optimizer groups, the routed experts' and the others': under FSDP2 each group's tensors are
    on one device mesh (torch's fused and foreach AdamW run one kernel over a group, which DTensors of two meshes
    cannot share), and the groups are the same in every layout, so that a resume in another layout finds the
    scheduler's and optimizer's groups it saved."""
    from fcsd.parallel.step_state import expert_names

    experts = {id(p) for p in (model.get_parameter(name) for name in expert_names(model))}
    groups = [[p for p in params if id(p) not in experts], [p for p in params if id(p) in experts]]
    return [{"params": group} for group in groups if group]
