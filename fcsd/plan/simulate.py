"""One FCSD training step as ``fcsd convert`` runs it, on fake tensors or real ones (paper Sec. 3.1, 4.1).

The student and the teacher are built the way :func:`fcsd.distill.student_teacher.load_models` builds them (FarSkip
layers, fp32 master weights, a bf16 teacher on GPUs, the configured attention and expert kernels, gradient
checkpointing), laid out as the trainer lays them out for the candidate (one process; DDP; expert parallelism, EP x
FSDP2 or FSDP2 alone through the trainer's own :func:`fcsd.parallel.layout.parallelize`, the online teacher laid out as
the student (:mod:`fcsd.plan.run`); or a teacher cache), and a step runs the trainer's calls: per micro-batch
:func:`fcsd.distill.objectives.micro_batch_loss` under autocast (the fused chunked KL loss) and its backward (DDP
synchronises the last micro-batch only, FSDP2 reduce-scatters every one), then the gradient reduction and
the clipping and AdamW from :func:`fcsd.distill.optim.build_optimizer`.

With ``fake=True`` everything runs under ``FakeTensorMode`` (shapes and dtypes only) on a fake process group of the
candidate's size, as rank 0: that is how the planner sizes a 671B model on a CPU. Two things the fake run decides
where a real run reads data: the expert-parallel token counts are perfectly balanced (each rank sends and receives
``tokens x top_k / P`` rows per MoE layer: the planner's routing assumption, as in Appendix B; an EP group spanning
nodes runs the plain dispatcher here, whose split sizes the fake step can be given: the node-aware one's replayed
rows are priced from its routing by :mod:`fcsd.plan.timing`), and the optimizer
states exist before the tracked step (the steady state of every step after the first). ``target="cuda"`` applies a
GPU run's choices on the CPU (bf16 autocast and teacher, fused AdamW, 512-byte allocator blocks, the CUDA
flash-attention backward's scratch);
``target="cpu"`` those of a CPU run (fp32, no autocast), which is what the CPU measurements compare against.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fcsd.plan.run import LAID_OUT, Layout, Run, accumulation_steps, build_run, run_meshes, step_config
from fcsd.plan.tracker import HOST, MemoryTracker

CATEGORIES = ("weights", "gradients", "optimizer", "teacher", "activations", "loss")


@dataclass
class StepEstimate:
    """Bytes per GPU of one training step: the static parts exactly (``weights``, ``gradients``, ``optimizer``,
    ``teacher``: parameters, their gradients, AdamW states and the frozen teacher held by this process), the
    largest amount of ``activations`` (forward and backward) and ``loss`` (the chunked head loss, or the logits of
    a sharded head) alive at any moment, the ``peak`` of everything together and what was alive then (``at_peak``);
    ``flops`` by phase for ``tokens`` tokens of one micro-batch, ``expert_flops`` of them in the routed experts'
    grouped GEMMs (priced at their own rate: :meth:`fcsd.plan.cluster.Cluster.expert_rate`)."""

    layout: Layout
    peak: int
    at_peak: dict[str, int]
    weights: int
    gradients: int
    optimizer: int
    teacher: int
    activations: int
    loss: int
    flops: dict[str, float]
    tokens: int
    accumulation: int
    peak_phase: str = ""
    host: int = 0  # bytes kept in host memory at most (train.checkpoint_offload's rows for the replay)
    extra: dict = field(default_factory=dict)
    expert_flops: float = 0.0

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("peak", "peak_phase", "at_peak", *CATEGORIES, "host", "flops", "tokens")}
        return {"layout": self.layout.__dict__ | {"name": self.layout.name}, "accumulation": self.accumulation, **out}


# -- process groups and modes -------------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_process_group(world: int):
    """A fake process group of ``world`` ranks (no communication; this process is rank 0), torch's own
    ``FakeProcessGroup``; refused when a real group is initialised."""
    if dist.is_initialized():
        raise RuntimeError("the planner's fake process group cannot start inside an initialised torch.distributed job")
    import torch.testing._internal.distributed.fake_pg as fake_pg  # registers the "fake" backend

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def balanced_routing(tokens: int, top_k: int):
    """Expert-parallel counts without data: every rank sends (and receives) ``tokens * top_k / P`` rows to (from)
    each rank, at the dispatchers' one host synchronisation per layer."""
    from fcsd.parallel import dispatchers

    original = dispatchers._split_sizes

    def split_sizes(send_counts, recv_counts, num_ranks):
        rows = tokens * top_k
        sizes = [rows // num_ranks + (1 if r < rows % num_ranks else 0) for r in range(num_ranks)]
        return sizes, list(sizes)

    dispatchers._split_sizes = split_sizes
    try:
        yield
    finally:
        dispatchers._split_sizes = original


@contextlib.contextmanager
def meshes_outside_fake_mode():
    """FSDP2's default device mesh (the teacher's ``fully_shard`` without a mesh) is built on real tensors: a mesh
    reads its ranks back to the host, which fake tensors cannot."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    original = _fsdp_init.init_device_mesh

    def init_device_mesh(*args, **kwargs):
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    _fsdp_init.init_device_mesh = init_device_mesh
    try:
        yield
    finally:
        _fsdp_init.init_device_mesh = original


class _Chunks:
    """``torch.chunk(tensor, count, dim)`` padded to ``count`` pieces as FSDP2's ``_chunk_with_empty`` pads it, each
    piece made when it is read (the same view): FSDP2 reads two pieces of a parameter (the first and its rank's),
    and making all of them on fake tensors, for a mesh of 128 ranks, took a third of a simulation."""

    def __init__(self, tensor, count: int, dim: int):
        self.tensor, self.count, self.dim = tensor, count, dim
        size = tensor.size(dim)
        self.step = -(-size // count) if size else 0
        self.made = -(-size // self.step) if size else count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        index = index + self.count if index < 0 else index
        if not 0 <= index < self.count:
            raise IndexError(index)
        if index >= self.made:
            return self[0].new_empty(0)
        size = self.tensor.size(self.dim)
        start = index * self.step
        return self.tensor.narrow(self.dim, start, min(self.step, size - start))


@contextlib.contextmanager
def lazy_fsdp_chunks():
    """FSDP2's parameter sharding through :class:`_Chunks` (the same shards, made on demand)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    original = _fsdp_param._chunk_with_empty
    _fsdp_param._chunk_with_empty = _Chunks
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original


# -- the estimate ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _phases(run: Run, tracker: MemoryTracker):
    """Charge the teacher's forward to ``teacher``, the loss (chunked head loss; the head inside a sharded forward)
    to ``loss``, gradients stored into ``.grad`` to ``gradients``."""
    from fcsd.distill import losses

    handles, original = [], losses.chunked_head_loss
    saved = []

    def enter(name):
        return lambda module, args: saved.append(tracker.phase) or setattr(tracker, "phase", name)

    def leave(module, args, output):
        tracker.phase = saved.pop()

    if run.teacher is not None:
        handles += [run.teacher.register_forward_pre_hook(enter("teacher")), run.teacher.register_forward_hook(leave)]
    if run.head_in_forward:
        head = run.unwrapped.get_output_embeddings()
        handles += [head.register_forward_pre_hook(enter("loss")), head.register_forward_hook(leave)]

    def chunked_head_loss(*args, **kwargs):
        with tracker.phase_as("loss"):
            return original(*args, **kwargs)

    losses.chunked_head_loss = chunked_head_loss
    for param in run.unwrapped.parameters():
        if param.requires_grad:
            handles.append(param.register_post_accumulate_grad_hook(lambda p: tracker.retag(p.grad, "gradients")))
    try:
        yield
    finally:
        losses.chunked_head_loss = original
        for handle in handles:
            handle.remove()


def _local(tensor):
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _optimizer_tensors(optimizer) -> list:
    return [_local(v) for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def prime_optimizer(run: Run, keep_gradients: bool = False) -> None:
    """Create the AdamW states as a first step would (zero gradients, one update), so that the tracked step is the
    steady state that every later step repeats; ``keep_gradients``: leave the gradients, as the earlier
    micro-batches of a step leave them for its last one."""
    for param in run.unwrapped.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    run.optimizer.step()
    if not keep_gradients:
        run.optimizer.zero_grad(set_to_none=True)


def track_step(run: Run, target: str = "cpu") -> dict:
    """Run one steady-state step of ``run`` under a :class:`~fcsd.plan.tracker.MemoryTracker`; returns what it
    measured: the static bytes, each phase's peak and what was alive then, the largest amounts of activations and
    loss, the FLOPs by phase."""
    tracker = MemoryTracker(target)
    params = [_local(p) for p in run.unwrapped.parameters()]
    buffers = [_local(b) for b in run.unwrapped.buffers()]
    for tensor in params + buffers:
        tracker.track(tensor, "weights")
    teacher_tensors = []
    if run.teacher is not None:
        teacher_tensors = [_local(t) for t in (*run.teacher.parameters(), *run.teacher.buffers())]
    for tensor in teacher_tensors:
        tracker.track(tensor, "teacher")
    for tensor in _optimizer_tensors(run.optimizer):
        tracker.track(tensor, "optimizer")
    for param in run.unwrapped.parameters():
        if param.grad is not None:
            tracker.track(_local(param.grad), "gradients")
    with _phases(run, tracker), tracker, _host_copies(tracker):
        run.step(tracker.phase_as)
    static = static_bytes(run, tracker)
    # DDP's reducer (which fake tensors cannot run) holds its buckets, a flat copy of the gradients, for the step
    buckets = static["gradients"] if run.layout.strategy == "ddp" and run.model is run.unwrapped else 0
    return {
        "buckets": {"gradients": buckets},
        "static": static,
        "phases": {
            phase: {"peak": peak, **{f"at:{k}": v for k, v in alive.items()}}
            for phase, (peak, alive) in tracker.phase_peaks.items()
        },
        "largest": {
            "activations": tracker.largest.get("activations", 0) + tracker.largest.get("backward", 0),
            "loss": tracker.largest.get("loss", 0),
            "host": tracker.largest.get(HOST, 0),
        },
        "flops": dict(tracker.flops),
        "expert_flops": tracker.expert_flops,
    }


@contextlib.contextmanager
def _host_copies(tracker: MemoryTracker):
    """The rows ``train.checkpoint_offload`` keeps for the replay charged to host memory, not to the GPU."""
    from fcsd.parallel import recompute

    saved, recompute.host_allocation = recompute.host_allocation, lambda: tracker.phase_as(HOST)
    try:
        yield
    finally:
        recompute.host_allocation = saved


def static_bytes(run: Run, tracker: MemoryTracker) -> dict[str, int]:
    """Bytes this process holds for the whole run: its student weights (and buffers), their gradients, the AdamW
    states, the teacher (its weights, or a micro-batch of cached rows)."""
    params = [_local(t) for t in (*run.unwrapped.parameters(), *run.unwrapped.buffers())]
    trained = [_local(p) for p in run.unwrapped.parameters() if p.requires_grad]
    teacher = [] if run.teacher is None else [_local(t) for t in (*run.teacher.parameters(), *run.teacher.buffers())]
    return {
        "weights": tracker.bytes_of(params),
        "gradients": sum(tracker._bytes(p.numel() * p.element_size()) for p in trained),
        "optimizer": tracker.bytes_of(_optimizer_tensors(run.optimizer)),
        "teacher": tracker.bytes_of(teacher) + _cache_rows(run, tracker),
    }


def _cache_rows(run: Run, tracker: MemoryTracker) -> int:
    """Bytes of one micro-batch of cached teacher rows (fp32 log-probabilities and int32 ids of the top k)."""
    if run.layout.teacher != "cache":
        return 0
    rows = run.layout.micro_batch * run.config.data.seq_len * run.config.teacher.top_k
    return 2 * tracker._bytes(4 * rows)


def _estimate(measured: dict, layout: Layout, tokens: int, accumulation: int) -> StepEstimate:
    phases = measured["phases"]
    buckets = measured["buckets"]["gradients"]
    for values in phases.values():
        values["peak"] += buckets
        values["at:gradients"] = values.get("at:gradients", 0) + buckets
    measured["static"]["gradients"] += buckets
    phase = max(phases, key=lambda name: phases[name]["peak"])
    at_peak = {k[3:]: int(v) for k, v in phases[phase].items() if k.startswith("at:") and v > 0}
    return StepEstimate(
        layout=layout,
        peak=int(phases[phase]["peak"]),
        at_peak=at_peak,
        **{k: int(v) for k, v in measured["static"].items()},
        activations=int(measured["largest"]["activations"]),
        loss=int(measured["largest"]["loss"]),
        host=int(measured["largest"].get("host", 0)),
        flops=dict(measured["flops"]),
        expert_flops=float(measured.get("expert_flops", 0.0)),
        tokens=tokens,
        accumulation=accumulation,
        peak_phase=phase,
    )


def estimate_step(model_config, fcsd_config, layout: Layout, target: str = "cuda") -> StepEstimate:
    """The memory and FLOPs of one FCSD training step of ``layout``, per GPU, from the config alone: the models are
    built and the step run on fake tensors with a fake process group (see the module docstring), through a few
    layers of the stack (:mod:`fcsd.plan.depth`), in worker processes inside
    :func:`fcsd.plan.workers.simulation_workers`."""
    config = step_config(fcsd_config, layout, layout.processes)
    from fcsd.plan.teacher_dtype import fp8_teacher, with_fp8_teacher
    from fcsd.plan.workers import results

    plan = reduction_for(model_config, fcsd_config, layout)
    measured = results(simulate, model_config, fcsd_config, layout, target, plan.subsets)
    keys = ("static", "largest", "flops", "buckets", "expert_flops")
    combined = {key: plan.combine([m.get(key, 0.0) for m in measured]) for key in keys}
    phases = {name for m in measured for name in m["phases"]}
    combined["phases"] = {name: plan.combine([m["phases"].get(name, {}) for m in measured]) for name in phases}
    estimate = _estimate(combined, layout, layout.micro_batch * config.data.seq_len, accumulation_steps(config, layout))
    if fp8_teacher(config, layout):  # simulated with a bf16 teacher: the bytes FP8 saves (fcsd.plan.teacher_dtype)
        estimate = with_fp8_teacher(estimate, model_config)
    return estimate


def prefetch(model_config, fcsd_config, layout: Layout, target: str = "cuda") -> None:
    """Start simulating ``layout`` in the workers of :func:`fcsd.plan.workers.simulation_workers` (nothing without
    them); :func:`estimate_step` collects it."""
    from fcsd.plan.workers import pooled, submit_ahead

    if not pooled():  # nothing runs ahead in this process
        return
    submit_ahead(
        simulate, model_config, fcsd_config, layout, target, reduction_for(model_config, fcsd_config, layout).subsets
    )


_REDUCTIONS: dict[tuple, tuple] = {}  # (id of the model config, layer spec) -> (the config, its Reduction)


def reduction_for(model_config, fcsd_config, layout: Layout):
    """The :class:`fcsd.plan.depth.Reduction` of the model's stack under the run's layer spec (kept per model config
    and spec: it builds the model on the meta device)."""
    from fcsd.connectivity.families import meta_model, text_config
    from fcsd.connectivity.layer_spec import parse_layer_spec
    from fcsd.plan.depth import layer_kinds, reduction

    spec = step_config(fcsd_config, layout, layout.processes).farskip.layers
    key = (id(model_config), str(spec))
    found = _REDUCTIONS.get(key)
    if found is None or found[0] is not model_config:
        layers = text_config(model_config).num_hidden_layers
        kinds = layer_kinds(meta_model(text_config(model_config)), parse_layer_spec(spec, layers))
        found = _REDUCTIONS[key] = (model_config, reduction(kinds))
    return found[1]


def simulate(model_config, fcsd_config, layout: Layout, target: str, subset: tuple[int, ...]) -> dict:
    """One steady-state step of ``layout`` on fake tensors through the layers ``subset``, as :func:`track_step`
    reports it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fcsd.connectivity.families import family_for_config, text_config

    config = step_config(fcsd_config, layout, layout.processes)
    tokens = layout.micro_batch * config.data.seq_len
    top_k = int(getattr(text_config(model_config), family_for_config(model_config).top_k_attr))
    with contextlib.ExitStack() as stack:
        meshes = None
        if layout.processes > 1 and layout.strategy in LAID_OUT:
            stack.enter_context(fake_process_group(layout.processes))
            meshes = run_meshes(layout)
        stack.enter_context(balanced_routing(tokens, top_k))
        stack.enter_context(meshes_outside_fake_mode())
        stack.enter_context(lazy_fsdp_chunks())
        stack.enter_context(_quiet_fake_warnings())
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        run = build_run(model_config, fcsd_config, layout, target, meshes, subset)
        prime_optimizer(run, keep_gradients=accumulation_steps(config, layout) > 1)
        return track_step(run, target)


@contextlib.contextmanager
def _quiet_fake_warnings():
    """Fake tensors warn when code compares data pointers (the gradient buckets do), transformers when checkpointing
    is enabled by its old name (as the trainer does): harmless here, and once per simulation would be noise."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        warnings.filterwarnings("ignore", message="`gradient_checkpointing_enable` is deprecated")
        yield
