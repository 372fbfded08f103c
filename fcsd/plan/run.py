"""One process of an FCSD training run as ``fcsd convert`` sets it up, and its training step (paper Sec. 3.1, 4.1).

The student and the teacher are built the way :func:`fcsd.distill.student_teacher.load_models` builds them (FarSkip
layers, fp32 master weights, a bf16 teacher on GPUs, the configured attention and expert kernels, gradient
checkpointing), laid out as the trainer lays them out for a candidate (:class:`Layout`: one process; DDP; or, for expert
parallelism (``ep``: the rest replicated), EP x FSDP2 (``ep_fsdp``) and FSDP2 alone (``fsdp2``), the trainer's own
:func:`fcsd.parallel.layout.parallelize` over :func:`fcsd.parallel.layout.build_meshes`, student and online teacher
alike (the teacher laid out as the student: experts EP-sharded, the rest FSDP2-sharded, resharded after every
forward), checkpointing through the layout's own recomputation; or a teacher cache), and :meth:`Run.step` makes the
trainer's calls: per micro-batch :func:`fcsd.distill.objectives.micro_batch_loss` under autocast (the fused chunked
KL loss) and its backward, gradient synchronisation as accelerate runs it, then the gradient reduction and clipping
(:func:`fcsd.parallel.training.reduce_and_clip` under a layout) and AdamW from
:func:`fcsd.distill.optim.build_optimizer`.

The same :class:`Run` is simulated on fake tensors (:mod:`fcsd.plan.simulate`) and measured on real ones
(:mod:`fcsd.plan.measure`). ``target="cuda"`` applies a GPU run's choices (bf16 autocast and teacher, fused AdamW)
wherever the tensors are; ``target="cpu"`` those of a CPU run (fp32, no autocast).
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass

import torch

STRATEGIES = ("single", "ddp", "ep", "ep_fsdp", "fsdp2")
LAID_OUT = ("ep", "ep_fsdp", "fsdp2")  # the strategies fcsd.parallel.layout lays out (parallel.ep_size / parallel.fsdp)


@dataclass(frozen=True)
class Layout:
    """A candidate: how ``processes`` GPUs run the step. ``strategy``: ``single`` (one process), ``ddp``
    (replicated student), ``ep`` (routed experts over groups of ``ep_size``, the rest replicated: ``parallel.ep_size``),
    ``ep_fsdp`` (the same experts, each shard FSDP2-sharded over its ``processes / ep_size`` replicas, the rest
    FSDP2-sharded over all processes: ``parallel.ep_size`` and ``parallel.fsdp=true``), ``fsdp2`` (everything
    FSDP2-sharded over all processes: ``parallel.fsdp=true``); the online teacher is laid out as the student;
    ``teacher``: ``online`` or ``cache`` (the top-k cache of ``fcsd cache-teacher``)."""

    strategy: str
    processes: int
    ep_size: int = 1
    teacher: str = "online"
    micro_batch: int = 1
    gradient_checkpointing: bool = False
    offload: bool = False  # checkpointing's replayed rows in host memory (train.checkpoint_offload)

    @property
    def fsdp(self) -> bool:
        """Whether the layout FSDP2-shards (``parallel.fsdp=true``)."""
        return self.strategy in ("ep_fsdp", "fsdp2")

    @property
    def teacher_layout(self) -> str:
        if self.teacher == "cache":
            return "top-k cache"
        return {"ep": "EP-sharded", "ep_fsdp": "EP x FSDP2-sharded", "fsdp2": "FSDP2-sharded"}.get(
            self.strategy, "replicated"
        )

    @property
    def shape(self) -> str:
        """The strategy in a few characters: ``EP=8``, ``EP=8xFSDP=2``, ``FSDP2``, ``DDP``, ``1 GPU``."""
        if self.strategy == "ep_fsdp":
            return f"EP={self.ep_size}xFSDP={self.processes // self.ep_size}"
        return {"single": "1 GPU", "ddp": "DDP", "fsdp2": "FSDP2"}.get(self.strategy, f"EP={self.ep_size}")

    @property
    def short(self) -> str:
        teacher = "cache" if self.teacher == "cache" else "online"
        checkpointing = (" ckpt+host" if self.offload else " ckpt") if self.gradient_checkpointing else ""
        return f"{self.shape} {teacher} mb{self.micro_batch}{checkpointing}"

    @property
    def name(self) -> str:
        shape = "1 process" if self.strategy == "single" else self.shape.replace("x", " x ").replace("=", " ")
        checkpointing = ", grad ckpt" if self.gradient_checkpointing else ""
        checkpointing += " (replay in host memory)" if self.offload else ""
        return f"{shape}, teacher {self.teacher_layout}, micro-batch {self.micro_batch}{checkpointing}"


def step_config(fcsd_config, layout: Layout, processes: int):
    """The run's config for ``layout``: micro-batch, checkpointing, teacher mode and EP size set as the candidate
    says (what the printed ``fcsd convert`` command sets), the guide resolved as ``fcsd convert`` resolves it."""
    from fcsd.distill.config import resolve_guide

    config = copy.deepcopy(fcsd_config)
    config.train.micro_batch_size = layout.micro_batch
    config.train.gradient_checkpointing = layout.gradient_checkpointing
    config.train.checkpoint_offload = layout.offload
    config.teacher.mode = layout.teacher
    resolve_guide(config)  # a cached teacher: no hidden-state guide, as fcsd convert resolves it
    config.parallel.ep_size = layout.ep_size if layout.strategy in ("ep", "ep_fsdp") else 1
    config.parallel.fsdp = layout.fsdp
    return config


def accumulation_steps(fcsd_config, layout: Layout) -> int:
    """Micro-batches per process and step, as :func:`fcsd.distill.optim.plan_steps` splits a step."""
    from fcsd.distill.optim import plan_steps

    return plan_steps(step_config(fcsd_config, layout, layout.processes), layout.processes).accumulation


def _text_model(model_config, dtype: torch.dtype, run_config, layers=None, subset=None):
    """A causal LM of ``model_config``'s text tower as ``load_models`` loads one (``text_only``), with FarSkip on
    ``layers`` (a spec; None: none). With ``subset`` (full-model layer indices, :mod:`fcsd.plan.depth`) it is built
    on the meta device, cut to those layers, converted where the full model is, and given fake CPU tensors (the
    active ``FakeTensorMode`` makes them)."""
    import transformers

    from fcsd.connectivity.families import text_config
    from fcsd.connectivity.layer_spec import parse_layer_spec
    from fcsd.connectivity.patch import apply_farskip

    options = {"dtype": dtype}
    if run_config.model.attn_implementation:
        options["attn_implementation"] = run_config.model.attn_implementation
    if run_config.model.experts_implementation:
        options["experts_implementation"] = run_config.model.experts_implementation
    from fcsd.precision import experts_in_compute_dtype

    config = copy.deepcopy(text_config(model_config))
    if subset is None:
        model = apply_farskip(transformers.AutoModelForCausalLM.from_config(config, **options), layers or [])
        experts_in_compute_dtype(model)  # as load_models does: the plan prices the expert matmuls that run
        return model
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from fcsd.plan.depth import keep_layers

    with unset_fake_temporarily(), torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, **options)
    converted = set(parse_layer_spec(layers, config.num_hidden_layers)) if layers is not None else set()
    keep_layers(model, subset)
    apply_farskip(model, [position for position, index in enumerate(subset) if index in converted])
    experts_in_compute_dtype(model)
    return _materialize(model)


def _materialize(model: torch.nn.Module) -> torch.nn.Module:
    """Give every meta parameter and buffer an (uninitialised) CPU tensor, keeping tied weights tied."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, wrap in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                if id(tensor) not in made:
                    empty = torch.empty_like(tensor, device="cpu")
                    made[id(tensor)] = torch.nn.Parameter(empty, tensor.requires_grad) if wrap else empty
                table[name] = made[id(tensor)]
    return model


@dataclass
class Run:
    """Everything one process holds for the step: the two models (as called and unwrapped), the optimizer, and how
    a step is driven. Micro-batch ``i`` of a step is made when the step reaches it, as the trainer reads its rows."""

    layout: Layout
    config: object
    model: torch.nn.Module
    unwrapped: torch.nn.Module
    teacher: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    micro_batches: int  # per step on this process (a simulated step runs only the last)
    vocab: int
    autocast: bool
    device: torch.device
    head_in_forward: bool
    seed: int = 0

    def batch(self, index: int):
        """Micro-batch ``index``: ``micro_batch`` packed rows of ``data.seq_len`` random tokens (two documents per
        row: position ids restart, so the attention takes the block-diagonal mask of packed training) and, with a
        cached teacher, its rows (fp32 log-probabilities and int32 ids of the top k)."""
        from fcsd.distill.data import Packed

        rows, seq = self.layout.micro_batch, self.config.data.seq_len
        generator = torch.Generator().manual_seed(self.seed + index)
        ids = torch.randint(0, self.vocab, (rows, seq), generator=generator)
        positions = (torch.arange(seq) % max(1, (seq + 1) // 2)).repeat(rows, 1)
        if self.layout.teacher != "cache":
            return Packed(ids, positions), None
        k = self.config.teacher.top_k
        logp = torch.randn(rows, seq, k, generator=generator).log_softmax(-1)
        top = torch.randint(0, self.vocab, (rows, seq, k), generator=generator, dtype=torch.int32)
        return Packed(ids, positions), (logp, top)

    def step(self, phase=None) -> None:
        """One optimizer step of :func:`fcsd.distill.trainer.train` on this process (its micro-batches, the gradient
        reduction and clipping, AdamW). ``phase(name)`` (a tracker's) names what each part allocates."""
        from fcsd.distill.objectives import micro_batch_loss

        phase = phase or _no_phase
        for index in range(self.micro_batches):
            with phase("teacher" if self.layout.teacher == "cache" else "activations"):
                batch, cached = self.batch(index)
            sync = _gradient_sync(self.model, self.layout, last=index == self.micro_batches - 1)
            autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast)
            with sync, autocast:
                parts = micro_batch_loss(
                    self.model, self.unwrapped, batch, self.config, self.teacher, cached, self.head_in_forward
                )
                with phase("activations"):
                    loss = parts.total * (1.0 / max(parts.tokens, 1))
                with phase("backward"):
                    loss.backward()
            del parts, loss, batch, cached
        with phase("backward"):
            self.clip()
        with phase("optimizer"):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def clip(self) -> None:
        """``TrainingSession.clip_gradients``: a laid-out model reduces and clips itself, the others through torch's
        clipping."""
        max_norm = self.config.train.grad_clip or math.inf
        if self.layout.strategy in LAID_OUT:
            from fcsd.parallel.training import reduce_and_clip

            reduce_and_clip(self.unwrapped, max_norm)
            return
        params = [p for p in self.model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=self.device.type == "cuda" or None)


@contextlib.contextmanager
def _no_phase(name):
    yield


def _gradient_sync(model, layout: Layout, last: bool):
    """Accelerate's ``accumulate`` as the trainer configures it: DDP skips its all-reduce before the last
    micro-batch of a step; FSDP2 reduce-scatters every micro-batch (``sync_each_batch``, so that no GPU holds
    unsharded gradients between micro-batches)."""
    if last or layout.strategy != "ddp":
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def run_meshes(layout: Layout, device_type: str = "cpu"):
    """The device meshes the trainer builds for ``layout`` (:func:`fcsd.parallel.training.run_meshes`), over the
    initialised job (a real one, or the planner's fake process group of ``layout.processes`` ranks); None for the
    strategies fcsd does not lay out."""
    if layout.strategy not in LAID_OUT:
        return None
    from fcsd.parallel.layout import ParallelDims, build_meshes

    ep = layout.ep_size if layout.strategy in ("ep", "ep_fsdp") else 1
    return build_meshes(ParallelDims(layout.processes, ep, layout.fsdp), device_type)


def build_run(model_config, fcsd_config, layout: Layout, target: str, meshes=None, subset=None, seed: int = 0) -> Run:
    """Build this process's models, optimizer and micro-batches for ``layout`` (real tensors, or fake ones with
    ``subset``: see :func:`_text_model`). ``meshes``: the run's device meshes (:func:`run_meshes`) for the
    strategies fcsd lays out (``ep``, ``ep_fsdp``, ``fsdp2``), as :func:`fcsd.parallel.training.laid_out_loader`
    lays out the student and the teacher."""
    from fcsd.connectivity.families import text_config
    from fcsd.distill.optim import build_optimizer, plan_steps

    config = step_config(fcsd_config, layout, layout.processes)
    plan = plan_steps(config, layout.processes)
    cuda = target == "cuda"
    mixed = config.train.mixed_precision
    mixed = ("bf16" if cuda else "no") if mixed == "auto" else mixed
    teacher = None
    if layout.teacher == "online":
        # an FP8 teacher is built in bf16 (fake tensors cannot run FP8 kernels); fcsd.plan.teacher_dtype prices it
        name = "bfloat16" if config.teacher.dtype == "fp8" else config.teacher.dtype
        dtype = _dtype(name, cuda, torch.float32, torch.bfloat16)
        teacher = _text_model(model_config, dtype, config, subset=subset).eval().requires_grad_(False)
    dtype = _dtype(config.model.dtype, cuda, torch.float32, torch.float32)
    student = _text_model(model_config, dtype, config, config.farskip.layers, subset)
    model, head_in_forward = student, False
    if layout.strategy in LAID_OUT:
        from fcsd.parallel.layout import parallelize

        if meshes is None:
            raise ValueError(f"layout {layout.name} needs the run's device meshes (fcsd.plan.run.run_meshes)")
        parallel = config.parallel
        options = {"mode": parallel.mode, "dispatcher": parallel.dispatcher}
        compute = torch.bfloat16 if mixed == "bf16" else None
        train = config.train
        checkpointing = {"checkpointing": train.gradient_checkpointing, "offload": train.checkpoint_offload}
        parallelize(student, meshes, "student", **options, **checkpointing, compute_dtype=compute)
        if teacher is not None:
            parallelize(teacher, meshes, "teacher", **options)
        _adopt_laid_out_experts(student)
        _adopt_laid_out_experts(teacher)
        head_in_forward = layout.fsdp
    elif config.train.gradient_checkpointing:
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if layout.strategy == "ddp" and subset is None:  # fake tensors cannot run DDP's reducer: see track_step
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(student)
    optimizer, _ = build_optimizer(student, config, plan)
    if cuda:  # what fuse_on_gpu makes of it on GPUs (the fake tensors are CPU tensors)
        for group_options in optimizer.param_groups:
            group_options["fused"], group_options["foreach"] = True, False
    # a real step runs all its micro-batches; a simulated one only the last (the simulation leaves the gradients the
    # earlier ones would have left)
    count = plan.accumulation if subset is None else 1
    device = torch.device("cpu") if subset is not None else _device_of(student)
    vocab = text_config(model_config).vocab_size
    return Run(
        layout, config, model, student, teacher, optimizer, count, vocab, mixed == "bf16", device, head_in_forward
    )


def _adopt_laid_out_experts(model) -> None:
    """What the trainer's loader does once a laid-out model is filled (:func:`fcsd.parallel.load.finish_loading`):
    the expert-parallel runtime's list of expert parameters names the laid-out ones (FSDP2's shards), so that the
    tensors the experts held before ``fully_shard`` (the trainer's are meta tensors) are not kept alive."""
    if model is None:
        return
    from fcsd.parallel.step_state import expert_names

    model.fcsd_expert_parallel.expert_params = [model.get_parameter(name) for name in expert_names(model)]


def _device_of(model) -> torch.device:
    from torch.distributed.tensor import DTensor

    param = next(model.parameters())
    return (param._local_tensor if isinstance(param, DTensor) else param).device


def _dtype(name: str, cuda: bool, cpu_default, gpu_default) -> torch.dtype:
    return (gpu_default if cuda else cpu_default) if name == "auto" else getattr(torch, name)
