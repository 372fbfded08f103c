"""``fcsd plan``: before spending GPU hours, what fits, how long it takes and which layers to convert (paper Sec.
3.1, 4.1, 5.1, Appendix B).

The run is the one ``fcsd convert MODEL [overrides]`` would make (the same Hydra recipe and presets): the layer
table chooses the layers, the candidate search (:mod:`fcsd.plan.candidates`, EP groups up to all the GPUs, its
simulations in worker processes: :mod:`fcsd.plan.workers`) the way to run them on the cluster, the timing model
(:mod:`fcsd.plan.timing`, Sec. 4.1 / Eq. 9, the node-aware dispatch across nodes) the hours and where a step's time
goes, and :mod:`fcsd.plan.printed_commands` the commands. When nothing fits, the same search runs on
twice as many nodes, then four times, ... and the plan says which size fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fcsd.plan.candidates import Candidate, Search, choose, parameter_counts, search
from fcsd.plan.cluster import GIB, Cluster
from fcsd.plan.layers import DEFAULT_SPECS, LayerOption, layer_options, probe, recommend
from fcsd.plan.model_configs import ModelSource, load_model_config
from fcsd.plan.serving_fit import plan_serving, serving_on
from fcsd.plan.workers import simulation_workers
from fcsd.run_facts import schedule_steps
from fcsd.units import duration, time_unit

MAX_NODES = 128
PARALLEL_FROM = 1e9  # parameters from which simulations run in worker processes (their start takes seconds)
DEFAULT_DATA = "data=tulu3_sft_mixture"  # the printed command's data, unless the overrides name some


@dataclass
class Plan:
    source: ModelSource
    cluster: Cluster
    tokens: float
    config: object  # the resolved FCSDConfig the plan trains with
    summary: object  # fcsd.model_summary.ModelSummary
    options: list[LayerOption]
    choice: LayerOption
    reason: str
    search: Search
    fallback: Search | None = None  # when this cluster does not fit: the larger one that does, or the last tried
    flops: dict = field(default_factory=dict)  # per token, by part, of the chosen candidate
    cache_pass_hours: float = 0.0  # wall hours of fcsd cache-teacher's pass, on cache_gpus GPUs
    cache_gpus: int = 1
    layout_reason: str = ""  # why the chosen layout: EP against the fastest FSDP2-only one
    commands: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    counts: object = None  # candidates.Counts of the model
    serving: object = None  # serving.ServingCheck on the cluster the commands target (None: vLLM lacks the family)

    @property
    def chosen(self) -> Candidate | None:
        found = self.search if self.search.chosen is not None else self.fallback
        return found.chosen if found is not None else None

    @property
    def fits(self) -> bool:
        return self.search.chosen is not None

    @property
    def steps(self) -> int:
        return int(self.tokens // self.config.train.batch_tokens)

    @property
    def hours(self) -> float | None:
        chosen = self.chosen
        return None if chosen is None else self.steps * chosen.time.seconds / 3600

    @property
    def gpu_hours(self) -> float | None:
        chosen, hours = self.chosen, self.hours
        return None if chosen is None else hours * chosen.layout.processes + self.cache_pass_hours * self.cache_gpus


def make_plan(
    model: str,
    cluster: Cluster,
    tokens: float | None = None,
    specs: list[str] | None = None,
    probe_data: str | None = None,
    overrides: list[str] | None = None,
    max_kl: float | None = None,
    workers: int | None = None,
    serve_context: int | None = None,
    serve_sequences: int = 1,
) -> Plan:
    """Plan FCSD for ``model`` on ``cluster`` (see the module docstring). ``overrides`` are ``fcsd convert``'s
    Hydra overrides (batch size, sequence length, ...); ``tokens`` the training budget (default: the recipe's
    ``train.max_tokens``); ``workers``: processes simulating candidates (default: the CPU cores, up to 4, for a
    model of :data:`PARALLEL_FROM` parameters or more, else this process; :mod:`fcsd.plan.workers`);
    ``serve_context`` / ``serve_sequences``: what the serving check holds a KV cache for
    (:func:`fcsd.plan.serving_fit.check_serving`)."""
    from fcsd.model_summary import summarize
    from fcsd.plan import perfmodel as pm

    source = load_model_config(model)
    summary = summarize(source.name, config=source.config)
    shape = pm.model_shape(source.config)  # a dense or unsupported model is refused here, in one line
    config, defaults, notes = run_config(source, overrides or [], tokens, cluster)
    serving = plan_serving(source.config, cluster, serve_context, serve_sequences, config)  # bad input: at once
    if config.teacher.dtype == "fp8":  # refused where no candidate could run it; else what it saves, and where
        from fcsd.plan.teacher_dtype import check_fp8_teacher, fp8_note

        check_fp8_teacher(config, source.config, cluster)
        notes.append(fp8_note(source.config))
    steps = schedule_steps(config.train)  # the run fcsd convert makes: train.max_steps ends it first when it is shorter
    tokens = float(steps * config.train.batch_tokens)
    if steps < config.train.max_tokens // config.train.batch_tokens:
        notes.append(
            f"train.max_steps={config.train.max_steps} ends the run at {steps:,} steps ({tokens:.3g} tokens), before "
            f"train.max_tokens={config.train.max_tokens:.3g}: the plan prices those steps; raise train.max_steps for "
            "a longer run"
        )
    given = [o.split("=", 1)[1] for o in overrides or [] if o.startswith("farskip.layers=")]
    specs = specs or given[-1:] or DEFAULT_SPECS  # the user's farskip.layers is the one spec planned
    options = layer_options(shape, specs, cluster, config.train.batch_tokens, config.data.seq_len)
    if probe_data is not None:
        probe(source.name, probe_data, options)
    choice, reason = recommend(options, tokens, max_kl)
    config.farskip.layers = choice.spec
    cache_ok = _cache_ok(config)
    counts = parameter_counts(source.config)
    converted = set(choice.layers)
    fallback = None
    with simulation_workers(workers if workers is not None or counts.total >= PARALLEL_FROM else 1):
        result = search(source.config, config, cluster, counts, cache_ok, shape, converted)
        if choose(result, source.config, config, shape, converted) is None:
            fallback = _larger_cluster(source, config, cluster, shape, counts, converted, cache_ok, notes)
    plan = Plan(
        source, cluster, tokens, config, summary, options, choice, reason, result, fallback, notes=notes, counts=counts
    )
    chosen = plan.chosen
    if chosen is not None:
        plan.flops = _flops_per_token(chosen)
        plan.layout_reason = layout_reason(fallback if fallback is not None else result)
        if chosen.layout.teacher == "cache":
            from fcsd.plan.run import LAID_OUT

            plan.cache_gpus = chosen.layout.processes if chosen.layout.strategy in LAID_OUT else 1
            rate = _rate(cluster) * plan.cache_gpus
            plan.cache_pass_hours = tokens * _teacher_flops(shape, config.data.seq_len) / rate / 3600
        from fcsd.plan.printed_commands import plan_commands

        user = list(overrides or [])
        has_data = any(_names_data(o) for o in user) or defaults.data.path != "plan"
        extra = user if has_data else [DEFAULT_DATA, *user]
        from fcsd.connectivity.families import text_config

        target = fallback.cluster if fallback is not None else cluster
        if serving is not None and target is not cluster:  # the serve line is checked where the commands run
            serving = serving_on(serving, target)
        plan.serving, model_type = serving, text_config(source.config).model_type
        plan.commands, replaced = plan_commands(
            source.name, chosen.layout, choice.spec, config, defaults, target, extra, (model_type, serving)
        )
        plan.notes += replaced
        if chosen.layout.teacher == "cache" and config.recovery.hidden_l2 > 0:
            plan.notes.append(
                "the chosen layout caches the teacher, which holds no hidden states: the guided recipe runs there "
                "without its hidden-state guide (more tokens to the same KL, docs/recovery.md); an online-teacher "
                "layout keeps it"
            )
    return plan


def run_config(source: ModelSource, overrides: list[str], tokens: float | None, cluster: Cluster):
    """``(config, recipe defaults, notes)``: the resolved ``fcsd convert`` config for the plan (``train.max_tokens``
    = ``tokens``; a step's sequences raised to a multiple of the GPUs when they do not split over them)."""
    import copy

    from fcsd.connectivity.families import text_config
    from fcsd.distill.config import compose, hydra_override, preset_for, to_config
    from fcsd.distill.preflight import check_seq_len

    names = [hydra_override("model.name", source.name)]
    preset = preset_for(source.name)
    if preset is not None:
        names.insert(0, f"model={preset}")
    user = [o for o in overrides if not _names_data(o)]
    composed = compose([*names, "early_stop.enabled=false", *user])
    if composed.data.path is None:  # the plan reads no data; the printed command names some
        composed.data.path = "plan"
    config = to_config(composed, resolve=False)  # the guide as the recipe sets it: each layout resolves it
    defaults = copy.deepcopy(config)
    if tokens is not None:
        if tokens < config.train.batch_tokens:
            raise ValueError(f"--tokens {tokens:.3g} is less than one step ({config.train.batch_tokens} tokens)")
        config.train.max_tokens = int(tokens)
    config, notes = run_config_for(config, cluster)
    try:
        check_seq_len(config, text_config(source.config))
    except ValueError as error:  # the plan still prices it; the printed command would be refused as it stands
        notes.append(f"fcsd convert refuses this run as it stands: {error}")
    return config, defaults, notes


def _names_data(override: str) -> bool:
    """Whether an override chooses the training data (the plan needs none; the printed command keeps it)."""
    return override.split("=")[0].lstrip("+") in ("data", "data.path", "data.split", "data.eval_path")


def _cache_ok(config) -> bool | str:
    """Whether the teacher cache can serve this run's objective: it holds the top-k of the forward KL (another
    objective or divergence: the reason, as ``fcsd convert`` would refuse it). Whether the teacher fits where
    ``fcsd cache-teacher`` runs is decided per candidate (:func:`fcsd.plan.candidates.cache_teacher_bytes`)."""
    from fcsd.distill.config import cache_refusal

    return cache_refusal(config.train) or True


def layout_reason(result: Search) -> str:
    """Why the chosen layout: the fastest expert-parallel candidate's step beside the fastest FSDP2-only one's
    (compute and exposed communication), or why one kind is missing."""
    ep, fsdp2, chosen = result.best(True), result.best(False), result.chosen
    if ep is None or fsdp2 is None:
        kind = (lambda c: c.layout.ep_size > 1) if ep is None else (lambda c: c.layout.ep_size == 1)
        slower = [c for c in result.candidates if kind(c) and c.status == "slower"]
        missing = "no expert-parallel layout" if ep is None else "no layout without expert parallelism"
        if slower:
            return f"{missing} can be faster on {result.cluster.gpus} GPUs: {slower[0].note}"
        return f"{missing} fits on {result.cluster.gpus} GPUs"
    other = fsdp2 if chosen is ep else ep
    a, b = chosen.time, other.time
    parts = []
    if a.compute_s < 0.99 * b.compute_s:
        parts.append(f"less compute ({_versus(a.compute_s, b.compute_s)}: " + _compute_why(chosen, other) + ")")
    if a.exposed_comm_s < b.exposed_comm_s - 0.01 * b.seconds:
        parts.append(f"less exposed communication ({_versus(a.exposed_comm_s, b.exposed_comm_s)})")
    if a.compute_s > 1.01 * b.compute_s:
        lighter = _compute_why(other, chosen)
        parts.append(f"despite more compute ({_versus(a.compute_s, b.compute_s)}: {lighter} there)")
    why = " and ".join(parts) or "about the same step time (within 1%)"
    return (
        f"{chosen.layout.shape} ({duration(a.seconds)} per step) is {b.seconds / a.seconds:.2f}x as fast as "
        f"{other.layout.short} ({duration(b.seconds)}): {why}"
    )


def _versus(a: float, b: float) -> str:
    """``a vs b`` in one unit that shows both (ms for a small model's steps)."""
    name, size = time_unit(a, b)
    return f"{a / size:.2f} {name} vs {b / size:.2f} {name}"


def _compute_why(fast, slow) -> str:
    """What makes ``fast``'s step compute less than ``slow``'s: recomputation, micro-batch, the online teacher."""
    reasons = []
    if slow.layout.gradient_checkpointing and not fast.layout.gradient_checkpointing:
        reasons.append("no recomputation")
    if fast.layout.micro_batch > slow.layout.micro_batch:
        reasons.append(f"micro-batch {fast.layout.micro_batch} vs {slow.layout.micro_batch}")
    if fast.layout.teacher == "cache" and slow.layout.teacher == "online":
        reasons.append("the cached teacher runs no forward")
    return ", ".join(reasons) or "the same work"


def _larger_cluster(source, config, cluster: Cluster, shape, counts, converted, cache_ok, notes) -> Search | None:
    """The search on twice as many nodes (same GPUs per node), again and again, until a candidate fits: so the first
    size that fits is the smallest power-of-two multiple of the nodes asked for. It stops at :data:`MAX_NODES`, when
    no number of nodes can help (:func:`_more_nodes_cannot_help`), or when the closest peak stops shrinking (FSDP2
    pads the fused expert weights once the GPUs outnumber the experts); the last search is returned either way."""
    nodes, previous, result = cluster.nodes * 2, None, None
    while nodes <= MAX_NODES:
        bigger = cluster.with_nodes(nodes)
        sized, extra = run_config_for(config, bigger)
        result = search(source.config, sized, bigger, counts, cache_ok, shape, converted)
        if choose(result, source.config, sized, shape, converted) is not None:
            notes += extra
            config.train.batch_tokens, config.train.warmup_steps = sized.train.batch_tokens, sized.train.warmup_steps
            return result
        peaks = [c.estimate.peak for c in result.candidates if c.estimate is not None]
        if _more_nodes_cannot_help(result) or (previous is not None and peaks and min(peaks) >= previous):
            return result
        previous = min(peaks) if peaks else previous
        nodes *= 2
    return result


def _more_nodes_cannot_help(result: Search) -> bool:
    """Whether every simulated candidate needs more than a GPU holds even without its static bytes (the unsharded
    layers in flight, the activations), which more GPUs do not shrink (each such candidate's note says so)."""
    budget = result.cluster.budget
    simulated = [c for c in result.candidates if c.estimate is not None]
    for candidate in simulated:
        e = candidate.estimate
        rest = e.peak - (e.weights + e.gradients + e.optimizer + e.teacher)
        if rest >= budget:
            candidate.note = f"{rest / GIB:.1f} GiB of its peak are not static: more GPUs cannot make it fit"
    return bool(simulated) and all("more GPUs cannot" in c.note for c in simulated)


def run_config_for(config, cluster: Cluster):
    """``config`` made runnable on ``cluster``, with a note for each change: a step's sequences raised to a multiple
    of its GPUs, and the LR warm-up shortened to a tenth of a run shorter than it (``fcsd convert`` refuses a
    warm-up longer than the run)."""
    import copy

    sized, notes = copy.deepcopy(config), []
    sequences = sized.train.batch_tokens // sized.data.seq_len
    if sequences % cluster.gpus:
        raised = sized.data.seq_len * cluster.gpus * -(-sequences // cluster.gpus)
        notes.append(
            f"train.batch_tokens raised from {config.train.batch_tokens} to {raised}: {sequences} sequences of "
            f"{sized.data.seq_len} tokens do not split over {cluster.gpus} GPUs"
        )
        sized.train.batch_tokens = raised
    steps = schedule_steps(sized.train)
    if sized.train.warmup_steps > steps:
        warmup = max(1, steps // 10)
        notes.append(
            f"train.warmup_steps lowered from {sized.train.warmup_steps} to {warmup}: the run has {steps} steps"
        )
        sized.train.warmup_steps = warmup
    return sized, notes


def _rate(cluster: Cluster) -> float:
    return cluster.gpu.tflops * cluster.mfu * 1e12


def _teacher_flops(shape, seq_len: int) -> float:
    """Forward FLOPs per token of the teacher (Appendix B's per-layer counts, causal attention, the LM head)."""
    total = 2.0 * shape.hidden * shape.vocab
    for layer in shape.layers:
        core = 2 * seq_len / 2 * layer.heads * (layer.d_qk + layer.d_v)
        total += layer.attn_proj_flops + layer.gate_flops + layer.routed_flops + layer.shared_flops + core
    return total


def _flops_per_token(candidate: Candidate) -> dict:
    estimate = candidate.estimate
    return {phase: value / estimate.tokens for phase, value in estimate.flops.items() if value}


def budget_line(cluster: Cluster) -> str:
    return f"{cluster.budget / GIB:.1f} GiB"
