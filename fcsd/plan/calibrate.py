"""``fcsd bench cluster``: measure the figures the planner's time model rests on, on the machines at hand, and write
them to a cluster file that ``fcsd plan --cluster FILE`` uses instead of its presets (design §4: times the plan
prints are a model; this measures what it assumes). :mod:`fcsd.plan.predict` prices a step with them, the
prediction ``fcsd plan --cluster FILE --measure`` sets beside each measured one.

Run it under ``torchrun`` (one node or several; a node is ``LOCAL_WORLD_SIZE`` ranks), NCCL on GPUs (one each) and
gloo on CPUs, or as one process. Every rank measures at the same time (as a training step loads every GPU, or every
core), and rank 0 writes the file:

- GEMM throughput at the model's shapes (every linear layer of each kind of decoder layer, the LM head; bf16 on
  GPUs, fp32 on a CPU, as training computes), the FLOP-weighted rate over one layer stack: the effective FLOP/s that
  replaces ``peak x mfu``; the same at the reduced shapes ``--measure`` runs
  (:func:`fcsd.plan.self_check.reduced_config`, 128 and 256 tokens). On a CPU a GEMM's rows are capped so that one takes
  at most :data:`CPU_GEMM_FLOPS` (a large model's LM head would take seconds per call).
- The routed experts' grouped GEMMs (:func:`expert_rate`: the grouped-matmul kernel transformers' ``grouped_mm``
  experts run) at the rows an expert-parallel rank receives (``tokens x top_k / ep`` from each of the ``ep`` ranks'
  micro-batches) over its ``experts / ep`` local experts, for each EP size :func:`ep_sizes`: what the planner prices
  the experts' FLOPs at (per-expert ``nn.Linear`` experts stay among the GEMMs above).
- Collective bus bandwidths (NCCL's convention, as the presets are stated: ``nccl-tests``' busbw) and latencies of
  all-to-all, all-gather, reduce-scatter and all-reduce, through ``torch.distributed``: inside a node over groups
  of 2, 4, ... consecutive ranks up to the node (all groups at once), and between nodes over the ranks of one
  local rank (one per node; every local rank's group at once). Bandwidth from a large message, latency from a
  small one. The plan's ``intra_gbps`` / ``inter_gbps`` are the all-gather and reduce-scatter bus bandwidth
  (what FSDP2's collectives and the gradient all-reduce move, at the node's size), the all-to-all's own beside it.
- The host link: pinned host-device copies, each way, every local rank copying (on a CPU there is no link: a
  memcpy, said so in the file).
- How much of a collective hides behind compute beside it (:func:`measure_overlap`), the share of each window the
  time model hides.
- Costs the time model leaves out and that dominate small steps on a CPU: the time one tensor op takes to dispatch
  (Python, dispatcher, autograd: a tiny network's forward, backward and AdamW, divided by the ops it dispatches)
  and elementwise memory bandwidth.

Timings on a shared CPU are noisy (other processes take the cores); the file says how many threads each process
ran with, and a plan measured with another count is not comparable.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist

from fcsd.plan.cluster import GIB, GPUS, write_cluster_file

CPU_GEMM_FLOPS = 4e8  # the most FLOPs one measured GEMM takes on a CPU (its rows are cut to fit)
REDUCED_TOKENS = (128, 256)  # the reduced run's micro-batch tokens (fcsd plan --measure: 128-token sequences)
COLLECTIVE_KINDS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")
LINK_PRESET = "h100"  # the links a measurement without collectives keeps (fcsd plan's default --gpu)
SMALL_BYTES = 4096  # the latency message (bytes of the collective's whole buffer)
WORK_STEPS = 4  # tiny training steps before each latency message (a step's collectives follow compute)
LARGE_BYTES = {"cpu": 16 * 2**20, "cuda": 512 * 2**20}  # the bandwidth message
REPEATS = {"cpu": (30, 5), "cuda": (50, 20)}  # timed repeats of the small and the large message
C10D_KINDS = {  # torch's c10d ops (what a step dispatches) -> the collective whose latency they pay
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
}


# -- where this rank runs -----------------------------------------------------------------------------------------


def _setup() -> tuple[torch.device, bool]:
    """This rank's device and whether this command started the process group (under torchrun with several ranks)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank % torch.cuda.device_count()}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    started = False
    if world > 1 and not dist.is_initialized():
        gpus = torch.cuda.device_count() if cuda else 0
        backend = "nccl" if cuda and gpus >= int(os.environ.get("LOCAL_WORLD_SIZE", "1")) else "gloo"
        from fcsd.distill.config import process_group_timeout

        cuda_device = device if backend == "nccl" else None
        dist.init_process_group(backend, device_id=cuda_device, timeout=process_group_timeout())
        started = True
    return device, started


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device) -> None:
    if dist.is_initialized():
        _sync(device)
        dist.barrier()


def _timed(call, device: torch.device, min_seconds: float, batches: int = 5) -> float:
    """Seconds per call of ``call`` (after one warm-up): the fastest of ``batches`` batches, each repeating it for at
    least ``min_seconds / batches`` (at least twice). The fastest batch is the one other work on the machine
    disturbed least (local work only: the number of repeats differs between ranks)."""
    call()
    _sync(device)
    best = math.inf
    for _ in range(batches):
        repeats, start = 0, time.perf_counter()
        while repeats < 2 or time.perf_counter() - start < min_seconds / batches:
            call()
            repeats += 1
        _sync(device)
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


# -- GEMMs ----------------------------------------------------------------------------------------------------------


def _layers_and_experts(model_config) -> tuple[object, int, list]:
    """``(model, top_k, [(decoder layer, its routed experts module or None), ...])`` of ``model_config``'s text
    model, built on the meta device."""
    from fcsd.connectivity.families import family_for_config, find_decoder_layers, meta_model, text_config

    family = family_for_config(model_config)
    top_k = int(getattr(text_config(model_config), family.top_k_attr))
    model, layers = meta_model(model_config), []
    for layer in find_decoder_layers(model, family):
        mlp = getattr(layer, family.mlp_attr)
        layers.append((layer, getattr(mlp, family.experts_attr, None) if family.is_moe(mlp) else None))
    return model, top_k, layers


def gemm_shapes(model_config, tokens: int, fused_experts: bool = True) -> Counter:
    """``(M, K, N) -> count`` of the GEMMs one forward of ``tokens`` tokens makes through ``model_config``'s text
    model: every ``nn.Linear`` of each decoder layer at ``tokens`` rows, the routed experts' GEMMs at ``tokens x top_k
    / experts`` rows each (balanced routing, the planner's assumption; fused 3-D expert weights only with
    ``fused_experts``: :func:`expert_rate` times them as grouped GEMMs), the LM head."""
    from fcsd.connectivity.families import expert_count

    shapes: Counter = Counter()
    model, top_k, layers = _layers_and_experts(model_config)
    for layer, experts in layers:
        expert_params = set()
        if experts is not None:
            count = expert_count(experts)
            rows = max(1, tokens * top_k // count)
            for param in experts.parameters():
                expert_params.add(id(param))
                if param.dim() == 3 and fused_experts:  # fused experts: (E, out, in) or (E, in, out)
                    shapes[(rows, param.shape[2], param.shape[1])] += param.shape[0]
            for module in experts.modules():
                if isinstance(module, torch.nn.Linear):  # one module per expert
                    shapes[(rows, module.in_features, module.out_features)] += 1
                    expert_params.add(id(module.weight))
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear) and id(module.weight) not in expert_params:
                shapes[(tokens, module.in_features, module.out_features)] += 1
    head = model.get_output_embeddings()
    shapes[(tokens, head.in_features, head.out_features)] += 1
    return shapes


def gemm_rate(shapes: Counter, device: torch.device, dtype: torch.dtype, min_seconds: float) -> dict:
    """Each shape's measured FLOP/s and the FLOP-weighted rate of the whole (total FLOPs over total time). A shape is
    timed as training runs it: the forward ``x @ W.T`` (weights stored ``(N, K)``), the input gradient ``g @ W`` and
    the weight gradient ``g.T @ x``, one after another."""
    rows, flops, seconds = [], 0.0, 0.0
    for (m, k, n), count in sorted(shapes.items()):
        if device.type == "cpu":  # cap one GEMM's work on a CPU (the rate at fewer rows)
            m = max(1, min(m, int(CPU_GEMM_FLOPS // (2 * k * n))))
        x = torch.randn(m, k, device=device, dtype=dtype)
        weight = torch.randn(n, k, device=device, dtype=dtype)
        grad = torch.randn(m, n, device=device, dtype=dtype)

        def three(x=x, weight=weight, grad=grad):
            x @ weight.T
            grad @ weight
            grad.T @ x

        per_call = _timed(three, device, min_seconds) / 3
        work = 2.0 * m * k * n
        rows.append({"m": m, "k": k, "n": n, "count": count, "tflops": work / per_call / 1e12})
        flops += count * work
        seconds += count * per_call
    return {"tflops": flops / seconds / 1e12 if seconds else 0.0, "shapes": rows}


# -- grouped expert GEMMs --------------------------------------------------------------------------------------------

EP_SIZES_MAX = 64  # the largest EP size measured (plans with more price at the nearest measured)
EXPERT_WEIGHT_BYTES = {"cpu": 2**28, "cuda": 2**33}  # at most this many bytes of local expert weights (and as many
# gradients) are allocated; beyond, fewer local experts are timed at the same rows per expert


def expert_kinds(model_config) -> Counter:
    """``(experts, top_k, ((K, N, transposed), ...)) -> MoE layers`` of ``model_config``'s fused experts (3-D
    weights, which transformers' ``grouped_mm`` experts run as grouped GEMMs): each weight's GEMM, input width ``K``
    to output width ``N``, and whether it is stored ``(E, K, N)``; empty for per-expert ``nn.Linear`` experts."""
    from fcsd.connectivity.families import expert_count

    kinds: Counter = Counter()
    _, top_k, layers = _layers_and_experts(model_config)
    for _, experts in layers:
        if experts is None:
            continue
        transposed = bool(getattr(experts, "is_transposed", False))
        gemms = tuple(
            (p.shape[1], p.shape[2], True) if transposed else (p.shape[2], p.shape[1], False)
            for p in experts.parameters()
            if p.dim() == 3
        )
        if gemms:
            kinds[(expert_count(experts), top_k, gemms)] += 1
    return kinds


def ep_sizes(experts: int) -> list[int]:
    """The EP sizes measured for ``experts`` routed experts: the powers of two that divide them, up to
    :data:`EP_SIZES_MAX`."""
    sizes, ep = [], 1
    while ep <= min(experts, EP_SIZES_MAX) and experts % ep == 0:
        sizes.append(ep)
        ep *= 2
    return sizes


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The grouped matmul transformers' ``grouped_mm`` experts call: ``(rows, K) x (groups, K, N) -> (rows, N)``."""
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return grouped(x, weight, offs=offsets)


def expert_rate(kind: tuple, tokens: int, ep: int, device: torch.device, dtype, min_seconds: float) -> dict:
    """FLOP/s of one MoE layer's grouped expert GEMMs on a rank of EP ``ep`` whose ranks each route ``tokens`` tokens
    (``kind``: an :func:`expert_kinds` key): the rows it receives, ``tokens x top_k / ep`` from each rank (balanced
    routing: ``tokens x top_k x ep / experts`` per local expert), through each fused weight of its ``experts / ep``
    local experts in ``dtype``, forward, input gradient and weight gradient.
    Fewer local experts are timed where their weights would exceed :data:`EXPERT_WEIGHT_BYTES` (on a CPU also where a
    call would exceed :data:`CPU_GEMM_FLOPS`; then fewer rows too), at the same rows per expert."""
    experts, top_k, gemms = kind
    local = max(1, experts // ep)
    per_expert = max(1, tokens * top_k // local)
    weights = sum(k * n for k, n, _ in gemms)
    size = torch.empty((), dtype=dtype).element_size()
    groups = max(1, min(local, EXPERT_WEIGHT_BYTES[device.type] // (2 * weights * size)))
    if device.type == "cpu":
        groups = max(1, min(groups, int(CPU_GEMM_FLOPS // (2 * per_expert * weights))))
        per_expert = max(1, min(per_expert, int(CPU_GEMM_FLOPS // (2 * groups * weights))))
    rows = per_expert * groups
    offsets = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * per_expert
    leaves, calls = [], []
    for k, n, transposed in gemms:
        x = torch.randn(rows, k, device=device, dtype=dtype, requires_grad=True)
        stored = (groups, k, n) if transposed else (groups, n, k)
        weight = (torch.randn(*stored, device=device, dtype=dtype) / math.sqrt(k)).requires_grad_()
        grad = torch.randn(rows, n, device=device, dtype=dtype)
        leaves += [x, weight]
        calls.append((x, weight, transposed, grad))

    def step():
        outs = [_grouped_mm(x, w if t else w.transpose(-2, -1), offsets) for x, w, t, _ in calls]
        torch.autograd.backward(outs, [g for *_, g in calls])
        for leaf in leaves:
            leaf.grad = None

    seconds = _timed(step, device, min_seconds)
    work = 3 * 2.0 * rows * weights
    return {
        "ep": ep,
        "experts": experts,
        "local_experts": local,
        "groups": groups,
        "rows": rows,
        "rank_rows": tokens * top_k,
        "gemms": [[k, n] for k, n, _ in gemms],
        "dtype": str(dtype).removeprefix("torch."),
        "tflops": work / seconds / 1e12,
    }


def expert_rates(kinds: Counter, tokens: int, device: torch.device, dtype, min_seconds: float) -> dict:
    """``{ep: row}`` for each EP size of :func:`ep_sizes`: the FLOP-weighted rate of the model's MoE layers'
    grouped expert GEMMs on one EP rank (:func:`expert_rate`; ``row["tflops"]``) and each kind's measurement."""
    out = {}
    for ep in ep_sizes(min(kind[0] for kind in kinds)):
        flops, seconds, measured = 0.0, 0.0, []
        for kind, layers in sorted(kinds.items()):
            row = expert_rate(kind, tokens, ep, device, dtype, min_seconds)
            work = 6.0 * kind[1] * tokens * sum(k * n for k, n, _ in kind[2])
            flops += layers * work
            seconds += layers * work / (row["tflops"] * 1e12)
            measured.append(row)
        out[str(ep)] = {"tflops": flops / seconds / 1e12, "kinds": measured}
    return out


# -- per-op dispatch and elementwise bandwidth ------------------------------------------------------------------------


class OpCounter:
    """A ``TorchDispatchMode`` counting the tensor ops dispatched under it (``prim`` queries of fake tensors left
    out), their bytes (tensor inputs and outputs of ops that are not views) and their collectives."""

    def __new__(cls, *args, **kwargs):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Counting(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.ops = 0
                self.bytes = 0
                self.gemms = 0
                self.collectives: Counter = Counter()

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                namespace = func.namespace
                if namespace == "prim":
                    return out
                self.ops += 1
                name = func._opname
                if namespace == "c10d":
                    self.collectives[(C10D_KINDS.get(name, "all_reduce"), _group_size(args))] += 1
                elif name in ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm") or "attention" in name:
                    self.gemms += 1
                elif not func.is_view:
                    self.bytes += _tensor_bytes((args, kwargs, out))
                return out

        return Counting()


def _group_size(args) -> int:
    from torch.distributed import ProcessGroup

    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            with contextlib.suppress(Exception):
                return ProcessGroup.unbox(arg).size()
    return dist.get_world_size() if dist.is_initialized() else 1


def _tensor_bytes(tree) -> int:
    from torch.utils._pytree import tree_leaves

    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


class _Tiny(torch.nn.Module):
    """A few decoder-like blocks on tiny tensors (RMS norm, gated MLP, residual): its step's time is dispatch, not
    arithmetic."""

    def __init__(self, width: int = 16, blocks: int = 4):
        super().__init__()
        self.up = torch.nn.ModuleList(torch.nn.Linear(width, 2 * width, bias=False) for _ in range(blocks))
        self.down = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(blocks))
        self.norm = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(width)) for _ in range(blocks))

    def forward(self, x):
        for up, down, weight in zip(self.up, self.down, self.norm, strict=True):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
            gate, value = up(h).chunk(2, dim=-1)
            x = x + down(torch.nn.functional.silu(gate) * value)
        return x


def _tiny_steps(device: torch.device, count: int):
    """A call making ``count`` training steps of :class:`_Tiny` (local work of a few milliseconds on a CPU)."""
    torch.manual_seed(0)
    model = _Tiny().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda" or None)
    x = torch.randn(4, 16, device=device)

    def steps():
        for _ in range(count):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return steps


def op_seconds(device: torch.device, min_seconds: float) -> dict:
    """Seconds one dispatched tensor op takes: a tiny network's training step (forward, backward, AdamW as the
    trainer builds it: fused on a GPU) over the ops it dispatches."""
    step = _tiny_steps(device, 1)
    step()
    counter = OpCounter()
    with counter:
        step()
    per_step = _timed(step, device, min_seconds)
    return {"op_us": per_step / counter.ops * 1e6, "ops_per_step": counter.ops}


def _elementwise_suite(rows: int, width: int, fan_out: int, device: torch.device):
    """The elementwise and data-movement work of a MoE decoder layer's training step on ``(rows, width)`` fp32 rows
    (the rows an expert-parallel exchange moves: tokens x top-k), no GEMM, as one call making its forward and its
    backward: the gather of each token's ``fan_out`` rows, RMS norm, a gated activation, per-row routing weights,
    the scatter-add back to the tokens, a softmax and a sum."""
    tokens = torch.randn(max(1, rows // fan_out), width, device=device, requires_grad=True)
    up = torch.randn(rows, width, device=device, requires_grad=True)
    norm = torch.randn(width, device=device, requires_grad=True)
    routing = torch.randn(rows, 1, device=device, requires_grad=True)
    index = torch.randperm(rows, device=device) % tokens.shape[0]

    def suite():
        x = tokens[index]
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
        y = torch.nn.functional.silu(h) * up * routing
        back = torch.zeros_like(tokens).index_add(0, index, y)
        loss = (back.softmax(-1) * back).sum()
        loss.backward()
        for tensor in (tokens, up, norm, routing):
            tensor.grad = None

    return suite


def memory_bandwidth(device: torch.device, rows: int, width: int, fan_out: int, min_seconds: float) -> float:
    """GB/s of a decoder step's elementwise work (:func:`_elementwise_suite`, forward and backward) on ``(rows,
    width)`` rows: its bytes (inputs and outputs of the ops that are not views, as :func:`step_counts` counts them)
    over its time, less that of the same ops on tiny tensors (their dispatch, which the per-op time prices)."""
    large, tiny = _elementwise_suite(rows, width, fan_out, device), _elementwise_suite(4, 4, 1, device)
    counter = OpCounter()
    with counter:
        large()
    moved = counter.bytes
    with OpCounter() as small:
        tiny()
    seconds = _timed(large, device, min_seconds) - _timed(tiny, device, min_seconds)
    return max(moved - small.bytes, 1) / max(seconds, 1e-9) / 1e9


# -- collectives ----------------------------------------------------------------------------------------------------


def _collective(kind: str, total: int, group, ranks: int, device: torch.device, dtype: torch.dtype):
    """A call running one ``kind`` collective over ``group`` whose whole buffer is ``total`` bytes (the gathered
    output, the scattered input, each rank's all-to-all buffer, the all-reduced tensor), and its bus bytes
    (``nccl-tests``' convention)."""
    size = torch.tensor([], dtype=dtype).element_size()
    elements = max(ranks, total // size // ranks * ranks)
    whole = torch.zeros(elements, device=device, dtype=dtype)
    part = torch.zeros(elements // ranks, device=device, dtype=dtype)
    share = (ranks - 1) / ranks
    if kind == "all_gather":
        return (lambda: _all_gather()(whole, part, group=group)), elements * size * share
    if kind == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return (lambda: scatter(part, whole, group=group)), elements * size * share
    if kind == "all_to_all":
        out = torch.zeros_like(whole)
        return (lambda: dist.all_to_all_single(out, whole, group=group)), elements * size * share
    return (lambda: dist.all_reduce(whole, group=group)), 2 * elements * size * share


def _all_gather():
    """torch's all-gather into one tensor (``all_gather_single`` where this torch has it)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _median_seconds(call, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_collective(call, repeats: int, device: torch.device, work=None) -> float:
    """Median seconds of ``repeats`` calls, after one warm-up; with ``work`` (the same local work on every rank)
    each call follows it, and the median of the work alone is taken out: the collective's cost where a step makes
    it, after compute, every rank arriving when its share of the machine lets it."""
    call()
    _barrier(device)
    if work is None:
        return _median_seconds(call, repeats, device)
    alone = _median_seconds(work, repeats, device)
    _barrier(device)
    both = _median_seconds(lambda: (work(), call()), repeats, device)
    return max(both - alone, 1e-7)


def collective_groups(world: int, local: int) -> list[tuple[str, int, list[list[int]]]]:
    """``(scope, ranks, groups)`` to measure: inside a node, groups of 2, 4, ... consecutive ranks up to the node's
    ``local`` (sizes that divide it; the node's own size always), and between nodes the ranks of each local rank."""
    nodes = world // local
    sizes = sorted({s for s in (2**i for i in range(1, local.bit_length())) if local % s == 0} | {local} - {1})
    found = []
    for size in sizes:
        groups = [[base + i for i in range(size)] for base in range(0, world, size)]
        found.append(("intra", size, groups))
    if nodes > 1:
        found.append(("inter", nodes, [[node * local + r for node in range(nodes)] for r in range(local)]))
    return found


def measure_collectives(device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Latency and bus bandwidth of every collective kind over every group of :func:`collective_groups` (this rank's
    view: the slowest rank is taken when the ranks' figures are combined)."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return []
    world, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    small_repeats, large_repeats = REPEATS[device.type]
    work = _tiny_steps(device, WORK_STEPS)
    rows = []
    for scope, ranks, groups in collective_groups(world, local):
        mine = None
        for members in groups:  # every rank creates every group, in the same order
            group = dist.new_group(members)
            if rank in members:
                mine = group
        for kind in COLLECTIVE_KINDS:
            small, _ = _collective(kind, SMALL_BYTES, mine, ranks, device, dtype)
            large, bus = _collective(kind, LARGE_BYTES[device.type], mine, ranks, device, dtype)
            latency = _time_collective(small, small_repeats, device, work)
            seconds = _time_collective(large, large_repeats, device)
            rows.append(
                {"scope": scope, "kind": kind, "ranks": ranks, "latency_us": latency * 1e6, "gbps": bus / seconds / 1e9}
            )
    return rows


def measure_overlap(device: torch.device, dtype: torch.dtype) -> dict:
    """How much of a collective hides behind compute running beside it, every rank at once (what the time model's
    windows assume: :attr:`fcsd.plan.cluster.Cluster.overlap`): an all-gather of the bandwidth message over all
    ranks, alone (``t_comm``); GEMMs of about as long, alone (``t_work``); the all-gather launched asynchronously, the
    GEMMs run, then its wait (``t_both``), medians of a few repeats. The share (:func:`pooled_overlap`) is
    ``(t_work + t_comm - t_both) / min(t_work, t_comm)`` in [0, 1]: 1 when the pair takes as long as the longer of
    the two, 0 when it takes their sum (a CPU whose every core computes: the collective's copies take cores from the
    GEMMs)."""
    repeats = REPEATS[device.type][1]
    world = dist.get_world_size()
    size = torch.tensor([], dtype=dtype).element_size()
    elements = LARGE_BYTES[device.type] // size // world * world
    whole = torch.zeros(elements, device=device, dtype=dtype)
    part = torch.zeros(elements // world, device=device, dtype=dtype)

    def comm(async_op: bool = False):
        return _all_gather()(whole, part, async_op=async_op)

    n = 4096 if device.type == "cuda" else 256
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    comm()
    _barrier(device)
    t_comm = _median_seconds(comm, repeats, device)
    one = _median_seconds(lambda: a @ b, repeats, device)

    def gemms(count: int):
        return lambda: [a @ b for _ in range(count)]

    count = max(1, round(t_comm / max(one, 1e-9)))
    t_work = _median_seconds(gemms(count), repeats, device)
    work = gemms(max(1, round(count * t_comm / max(t_work, 1e-9))))  # a lone GEMM runs faster than many in a row
    _barrier(device)
    t_work = _median_seconds(work, repeats, device)
    _barrier(device)

    def both():
        pending = comm(async_op=True)
        work()
        pending.wait()

    t_both = _median_seconds(both, repeats, device)
    return {"comm_s": t_comm, "work_s": t_work, "both_s": t_both}


def pooled_overlap(ranks: list[dict]) -> float:
    """The overlap share of :func:`measure_overlap` from every rank's three times pooled (sums over the ranks: one
    rank's share alone swings with what else its core ran)."""
    work, comm, both = (sum(r[key] for r in ranks) for key in ("work_s", "comm_s", "both_s"))
    shorter = sum(min(r["work_s"], r["comm_s"]) for r in ranks)
    return min(1.0, max(0.0, (work + comm - both) / max(shorter, 1e-9)))


# -- the host link ----------------------------------------------------------------------------------------------------


def host_link(device: torch.device, min_seconds: float) -> dict:
    """GB/s of host-device copies, each way, from pinned host memory (every local rank copying at once); on a CPU, of
    a memcpy (there is no link)."""
    nbytes = 256 * 2**20 if device.type == "cuda" else 64 * 2**20
    if device.type != "cuda":
        source, target = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        seconds = _timed(lambda: target.copy_(source), device, min_seconds)
        return {"gbps": nbytes / seconds / 1e9, "what": "memcpy (CPU: no host link)"}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    up = _timed(lambda: gpu.copy_(host, non_blocking=True), device, min_seconds)
    down = _timed(lambda: host.copy_(gpu, non_blocking=True), device, min_seconds)
    return {"gbps": nbytes / max(up, down) / 1e9, "to_gpu_gbps": nbytes / up / 1e9, "to_host_gbps": nbytes / down / 1e9}


# -- the benchmark ----------------------------------------------------------------------------------------------------


def measure_rank(model: str, tokens: int | None, device: torch.device, quick: bool = False) -> dict:
    """Everything this rank measures (see the module docstring), every rank at the same time."""
    import psutil

    from fcsd.plan.self_check import reduced_config

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    seconds = 0.02 if quick else (0.1 if cuda else 0.3)
    source = check_model(model)
    tokens = tokens or (4096 if cuda else 512)
    _barrier(device)
    result = {"model": source.name, "tokens": tokens}
    kinds = expert_kinds(source.config)
    result["gemm"] = gemm_rate(gemm_shapes(source.config, tokens, not kinds), device, dtype, seconds)
    if kinds:
        result["experts"] = expert_rates(kinds, tokens, device, dtype, seconds)
    reduced = reduced_config(source.config)
    reduced_kinds = expert_kinds(reduced)
    result["reduced_gemm"] = {
        str(t): gemm_rate(gemm_shapes(reduced, t, not reduced_kinds), device, dtype, seconds)["tflops"]
        for t in REDUCED_TOKENS
    }
    if reduced_kinds:
        result["reduced_experts"] = {
            str(t): {ep: row["tflops"] for ep, row in expert_rates(reduced_kinds, t, device, dtype, seconds).items()}
            for t in REDUCED_TOKENS
        }
    _barrier(device)
    result.update(op_seconds(device, seconds))
    _barrier(device)
    top_k = reduced.num_experts_per_tok
    rows = max(REDUCED_TOKENS) * top_k
    result["memory_gbps"] = memory_bandwidth(device, rows, reduced.hidden_size, top_k, seconds)
    _barrier(device)
    result["host"] = host_link(device, seconds)
    _barrier(device)
    result["collectives"] = measure_collectives(device, dtype)
    if dist.is_initialized() and dist.get_world_size() > 1:
        _barrier(device)
        result["overlap"] = measure_overlap(device, dtype)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if cuda:
        result["memory_gib"] = torch.cuda.get_device_properties(device).total_memory / GIB
        result["device_name"] = torch.cuda.get_device_name(device)
        result["compute_capability"] = None if torch.version.hip else list(torch.cuda.get_device_capability(device))
    else:
        result["memory_gib"] = psutil.virtual_memory().total / GIB / local
        result["device_name"] = "CPU"
    result["host_memory_gib"] = psutil.virtual_memory().total / GIB
    result["threads"] = torch.get_num_threads()
    return result


def check_model(model: str):
    """The config of ``model`` (a preset, a folder, a ``config.json``, a hub id or ``demo``), refused in one line when
    it is not a supported MoE model (its shapes are what the GEMMs are measured at)."""
    from fcsd.plan.model_configs import load_model_config
    from fcsd.plan.perfmodel import model_shape

    source = load_model_config(_model_name(model))
    model_shape(source.config)
    return source


def _model_name(model: str) -> str:
    """A config.json path names its folder (what :func:`fcsd.plan.model_configs.load_model_config` reads)."""
    from pathlib import Path

    path = Path(model).expanduser()
    return str(path.parent) if path.name == "config.json" and path.is_file() else model


def combine(results: list[dict], world: int, local: int, backend: str) -> dict:
    """The cluster file from every rank's :func:`measure_rank`: GEMM and dispatch figures averaged over the ranks,
    collectives at their slowest rank (a collective ends when its last rank does), copies at their slowest."""
    first = results[0]
    nodes = max(1, world // local)
    tflops = statistics.mean(r["gemm"]["tflops"] for r in results)
    reduced = {t: statistics.mean(r["reduced_gemm"][t] for r in results) for t in first["reduced_gemm"]}
    experts = {}
    if "experts" in first:  # grouped expert GEMMs: the ranks' mean at each EP size
        experts["expert_tflops"] = {
            ep: statistics.mean(r["experts"][ep]["tflops"] for r in results) for ep in first["experts"]
        }
    if "reduced_experts" in first:
        experts["reduced_expert_tflops"] = {
            t: {ep: statistics.mean(r["reduced_experts"][t][ep] for r in results) for ep in sizes}
            for t, sizes in first["reduced_experts"].items()
        }
    collectives: dict[tuple, dict] = {}
    for r in results:
        for row in r["collectives"]:
            key = (row["scope"], row["kind"], row["ranks"])
            seen = collectives.setdefault(key, dict(row))
            seen["latency_us"] = max(seen["latency_us"], row["latency_us"])
            seen["gbps"] = min(seen["gbps"], row["gbps"])
    latency: dict[str, dict] = {}
    for (scope, kind, ranks), row in sorted(collectives.items()):
        if scope == "intra":
            latency.setdefault(kind, {})[str(ranks)] = row["latency_us"]
    if nodes > 1:  # a group spanning nodes: the inter-node latency, at the job's size
        for (scope, kind, _), row in collectives.items():
            if scope == "inter":
                latency.setdefault(kind, {})[str(world)] = row["latency_us"]

    def bus(scope: str, kinds: tuple[str, ...]) -> float | None:
        sizes = [key[2] for key in collectives if key[0] == scope]
        if not sizes:
            return None
        found = [collectives[(scope, k, max(sizes))]["gbps"] for k in kinds]
        return len(found) / sum(1 / g for g in found)  # harmonic mean: equal bytes through each

    assumed = []
    preset = GPUS[LINK_PRESET]
    intra = bus("intra", ("all_gather", "reduce_scatter"))
    inter = bus("inter", ("all_gather", "reduce_scatter"))
    if intra is None:  # one process: no collective measured, both links stay the preset's (a memcpy is no link)
        assumed.append("intra_gbps")
        intra = preset.intra_gbps
    if inter is None:  # one node: GPUs keep the preset's NICs, a CPU its own (intra-node) figure
        assumed.append("inter_gbps")
        inter = preset.inter_gbps if first["device_name"] != "CPU" or "intra_gbps" in assumed else intra
    name = first["device_name"]
    threads = first["threads"]
    if name == "CPU":
        name = f"CPU ({backend}, {threads} thread{'s' if threads != 1 else ''} per process)"
    return {
        "format": "fcsd-cluster",
        "version": 1,
        "name": name,
        "device": "cuda" if first["device_name"] != "CPU" else "cpu",
        "backend": backend,
        "threads": threads,
        "model": first["model"],
        "nodes": nodes,
        "gpus_per_node": local if world > 1 else 1,
        "gpu_memory_gib": min(r["memory_gib"] for r in results),
        "host_memory_gib": min(r["host_memory_gib"] for r in results),
        "tflops": tflops,
        "intra_gbps": intra,
        "inter_gbps": inter,
        "host_gbps": min(r["host"]["gbps"] for r in results),
        "alltoall_intra_gbps": bus("intra", ("all_to_all",)),
        "alltoall_inter_gbps": bus("inter", ("all_to_all",)),
        "op_us": statistics.mean(r["op_us"] for r in results),
        "memory_gbps": statistics.mean(r["memory_gbps"] for r in results),
        "latency_us": latency,
        "reduced_tflops": reduced,
        **experts,
        "assumed": assumed,
        "compute_capability": first.get("compute_capability"),  # CUDA's (major, minor); None on a CPU or ROCm
        **({"overlap": pooled_overlap([r["overlap"] for r in results])} if "overlap" in first else {}),
        "measurements": {
            "gemm_tokens": first["tokens"],
            "gemm": first["gemm"]["shapes"],
            "experts": [row for m in first.get("experts", {}).values() for row in m["kinds"]],
            "collectives": sorted(collectives.values(), key=lambda r: (r["scope"], r["ranks"], r["kind"])),
            "host_link": first["host"],
            "overlap": [r["overlap"] for r in results if "overlap" in r],
            "ops_per_tiny_step": first["ops_per_step"],
            "processes": world,
            "torch": torch.__version__,
        },
    }


def run_cluster_benchmark(model: str = "demo", out=None, tokens: int | None = None, quick: bool = False) -> dict:
    """``fcsd bench cluster``: measure on every rank of this job (started here under torchrun, or one process), write
    the cluster file to ``out`` from rank 0 (atomically), and return it (on every rank)."""
    device, started = _setup()
    try:
        result = measure_rank(model, tokens, device, quick)
        world = dist.get_world_size() if dist.is_initialized() else 1
        results = [result]
        backend = dist.get_backend() if dist.is_initialized() else "none"
        if world > 1:
            results = [None] * world
            dist.all_gather_object(results, result)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        data = combine(results, world, local, backend)
        if out is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            write_cluster_file(out, data)
        if world > 1:
            dist.barrier()
        return data
    finally:
        if started:
            dist.destroy_process_group()


def assumed_note(data: dict) -> str:
    """What the file's ``assumed`` figures are: the preset's links where one process measured no collective."""
    fields = ", ".join(data["assumed"])
    if "intra_gbps" in data["assumed"]:
        preset = GPUS[LINK_PRESET]
        return (
            f"{fields} kept from the {preset.name} preset ({preset.intra_gbps:g} / {preset.inter_gbps:g} GB/s): one "
            "process measures no collective; run it under torchrun, or give --intra-gbps / --inter-gbps"
        )
    return f"{fields} (not measured here: give --intra-gbps / --inter-gbps)"


def format_cluster(data: dict) -> str:
    """The cluster file's figures in a few lines."""

    def figure(value, unit):
        return "-" if value is None else f"{value:.3g} {unit}"

    lines = [
        f"cluster    {data['nodes']} x {data['gpus_per_node']} {data['name']}, {data['gpu_memory_gib']:.1f} GiB each",
        f"GEMM       {data['tflops']:.3g} TFLOP/s at {data['model']}'s shapes ({data['measurements']['gemm_tokens']} "
        "tokens; replaces peak x mfu)",
        *(
            [
                "experts    grouped GEMMs "
                + ", ".join(f"{v:.3g} TFLOP/s at EP {ep}" for ep, v in data["expert_tflops"].items())
                + " (the rows an EP rank receives)"
            ]
            if data.get("expert_tflops")
            else []
        ),
        f"in a node  all-gather/reduce-scatter {figure(data['intra_gbps'], 'GB/s')}, all-to-all "
        f"{figure(data['alltoall_intra_gbps'], 'GB/s')} (bus bandwidth)",
        f"between    {figure(data['inter_gbps'], 'GB/s')}, all-to-all {figure(data['alltoall_inter_gbps'], 'GB/s')}",
        f"host link  {figure(data['host_gbps'], 'GB/s')} ({data['measurements']['host_link'].get('what', 'pinned')})",
        f"per op     {data['op_us']:.3g} us dispatch, {figure(data['memory_gbps'], 'GB/s')} elementwise",
    ]
    if "overlap" in data:
        lines.append(f"overlap    {data['overlap']:.0%} of a collective hides behind compute beside it")
    for kind, sizes in data["latency_us"].items():
        lines.append(f"latency    {kind}: " + ", ".join(f"{us:.0f} us over {n}" for n, us in sizes.items()))
    if data["assumed"]:
        lines.append(f"assumed    {assumed_note(data)}")
    return "\n".join(lines)
