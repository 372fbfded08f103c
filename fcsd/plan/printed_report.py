"""``fcsd plan``'s output: the text report (layer table, memory table, time with its breakdown, commands) and
``--json``.

The chosen layout's step is broken down into compute and the communication it exposes (:class:`fcsd.plan.timing.
StepTime`: all-to-all inside and across nodes, FSDP2's collectives, the DP all-reduce, the host copies), with its
tokens/s per GPU and model FLOPs utilisation, beside the published figures of the same model (:data:`PUBLISHED`,
each named with its source; pretraining figures, so the comparable distillation figure divides them by
:data:`DISTILL_COST`)."""

from __future__ import annotations

from fcsd.distill.config import peak_lr
from fcsd.plan.candidates import why_none_fits
from fcsd.plan.cluster import GIB
from fcsd.plan.simulate import CATEGORIES
from fcsd.plan.teacher_dtype import priced_teacher
from fcsd.units import duration, time_unit

STATUS = {
    "fits": "fits",
    "exceeds": "no",
    "static": "no (static)",
    "dominated": "no (implied)",
    "invalid": "no",
    "slower": "not simulated (slower)",
    "skipped": "not simulated",
}


def _unit(search) -> tuple[str, int]:
    """GiB, or MiB when every simulated peak is below 1 GiB (small models)."""
    peaks = [c.estimate.peak for c in search.candidates if c.estimate is not None]
    return ("MiB", 2**20) if peaks and max(peaks) < GIB else ("GiB", GIB)


def _memory_row(candidate, budget: int, unit: tuple[str, int]) -> str:
    estimate = candidate.estimate
    name, size = candidate.layout.short, unit[1]
    if estimate is None:
        cells = ["-"] * (len(CATEGORIES) + 1)
        verdict = STATUS[candidate.status] if candidate.status != "fits" else "fits (implied)"
        return f"{name:<32}" + "".join(f"{c:>8}" for c in cells) + f"  {verdict}: {candidate.note}"
    cells = [f"{getattr(estimate, k) / size:.1f}" for k in CATEGORIES] + [f"{estimate.peak / size:.1f}"]
    verdict = STATUS[candidate.status]
    if candidate.fits:
        verdict += f" ({(budget - estimate.peak) / GIB:.1f} GiB to spare)"
    elif estimate.peak > budget:
        verdict += f" (+{(estimate.peak - budget) / GIB:.1f} GiB)"
    if candidate.layout.offload:
        verdict += f", {estimate.host / GIB:.1f} GiB in host memory" + (f": {candidate.note}" if candidate.note else "")
    return f"{name:<32}" + "".join(f"{c:>8}" for c in cells) + f"  {verdict}"


def memory_table(search) -> list[str]:
    cluster, unit = search.cluster, _unit(search)
    head = f"{'per GPU, ' + unit[0]:<32}" + "".join(f"{h:>8}" for h in (*_SHORT, "peak")) + "  fits"
    lines = [f"memory on {cluster.describe()}", head]
    lines += [_memory_row(c, cluster.budget, unit) for c in search.candidates]
    lines.append(
        "(EP=PxFSDP=R: experts over P GPUs, each shard FSDP2-sharded over its R replicas, the rest FSDP2 over all; "
        "EP=P: the rest replicated; mbN: micro-batch of N sequences; ckpt: gradient checkpointing (under EP: the "
        "exchanges replayed; ckpt+host: their rows kept in host memory, train.checkpoint_offload); online: the "
        "teacher laid out as the student; cache: the top-k cache; grads of FSDP2 are its sharded ones)"
    )
    return lines


# published training throughputs (tokens/s per GPU) to set a plan beside, by the hub id the plan names
PUBLISHED = {
    "deepseek-ai/DeepSeek-V3": [
        ("NeMo AutoModel's performance summary: DeepSeek-V3 pretraining, 256 H100, BF16, EP 64 x PP 4", 1002),
        ("DeepSeek-V3 technical report: 180K H800 GPU-hours per trillion pretraining tokens, FP8", 1543),
    ],
    "Qwen/Qwen3-30B-A3B": [
        ("NeMo AutoModel's performance summary: Qwen3-MoE 30B pretraining, 8 H100, BF16, EP 8", 12040)
    ],
}
# a distillation step's FLOPs over a pretraining step's: 6N, plus 2N of teacher forward and 2N of recomputation
DISTILL_COST = 10 / 6


def published(plan) -> list[tuple[str, int]]:
    """The published figures of the plan's model (its hub id, or the paper model its config matches)."""
    from fcsd.plan.model_configs import embedded_name

    return PUBLISHED.get(embedded_name(plan.source) or plan.source.name, [])


def breakdown_lines(plan) -> list[str]:
    """The chosen step's breakdown, its tokens/s per GPU and MFU, and the published figures it compares with."""
    chosen = plan.chosen
    t = chosen.time
    dispatch = f", {t.dispatcher} dispatch" if t.dispatcher else ""
    parts = ", ".join(f"{name} {duration(seconds)}" for name, seconds in t.breakdown().items())
    teacher = " and 2 x for the online teacher's forward" if chosen.layout.teacher == "online" else ""
    lines = [
        f"breakdown  per step of {chosen.layout.shape}{dispatch}: {parts} = {duration(t.seconds)} "
        f"({t.seconds / t.compute_s:.2f}x its compute)"
        if t.compute_s
        else f"breakdown  {parts}",
        f"           {t.tokens_per_gpu_s:,.0f} tokens/s per GPU, model FLOPs utilisation {t.mfu:.1%} (model FLOPs: "
        f"6 x active parameters per token for the student{teacher}; the step's compute runs at "
        f"{plan.cluster.mfu:.0%} of peak)",
    ]
    for source, rate in published(plan):
        lines.append(
            f"published  {source}: {rate:,} tokens/s per GPU; as distillation (x{DISTILL_COST:.2f} the FLOPs of a "
            f"pretraining step) about {rate / DISTILL_COST:,.0f}"
        )
    return lines


_SHORT = ("weights", "grads", "AdamW", "teacher", "activ.", "loss")
PHASES = {"activations": "student forward", "backward": "backward", "teacher": "teacher forward", "loss": "loss"}


def _flops(value: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f}"


def _searched(plan):
    """The search the chosen candidate comes from (the larger cluster's when the one asked for does not fit)."""
    return plan.fallback if plan.fallback is not None and not plan.fits else plan.search


def timing_table(search) -> list[str]:
    """Each strategy's fastest fitting candidate with its step time, expert-parallel ones beside the others."""
    timed = sorted(search.timed, key=lambda c: c.time.seconds)
    if not timed:
        return []
    unit, size = time_unit(*(c.time.seconds for c in timed))  # one unit for the columns: ms for a small model
    lines = [
        "step time of each layout's fastest fitting candidate (expert parallel and not)",
        f"{'layout':<32}{'peak GiB':>9}{'step ' + unit:>9}{'compute':>9}{'comm':>8}{'a2a':>8}{'FSDP2':>8}{'other':>8}",
    ]
    for c in timed:
        mark = "  <- chosen" if c is search.chosen else ""
        t = c.time
        cells = (t.seconds, t.compute_s, t.exposed_comm_s, t.a2a_intra_s + t.a2a_inter_s, t.fsdp_s)
        cells += (t.dp_allreduce_s + t.host_s,)
        widths = (9, 9, 8, 8, 8, 8)
        lines.append(
            f"{c.layout.short:<32}{c.estimate.peak / GIB:>9.1f}"
            + "".join(f"{value / size:>{width}.2f}" for value, width in zip(cells, widths, strict=True))
            + mark
        )
    lines.append(
        f"(times in {unit}; comm: exposed communication = a2a (all-to-alls) + FSDP2 + other (DP all-reduce, host "
        "copies))"
    )
    return lines


def _hours(hours: float) -> str:
    """Hours, or a smaller unit below a tenth of an hour (a small model's run)."""
    return f"{hours:.1f} h" if hours >= 0.1 else duration(hours * 3600)


def format_plan(plan) -> str:
    """The text report of a :class:`fcsd.plan.planner.Plan`."""
    s, config = plan.summary, plan.config
    lines = [
        f"model      {plan.source.name} ({plan.source.origin}): {s.family}, {s.num_layers} layers "
        f"({len(s.moe_layers)} MoE), {s.num_experts} experts top-{s.top_k}, {s.total_params / 1e9:.2f}B parameters",
        f"run        {plan.tokens:.3g} tokens, {config.train.batch_tokens:,} tokens per step "
        f"({config.train.batch_tokens // config.data.seq_len} x {config.data.seq_len}), {plan.steps:,} steps",
        f"LR         {config.recovery.name} recipe: peak {peak_lr(config):g} = train.lr {config.train.lr:g} x "
        f"recovery.lr_scale {config.recovery.lr_scale:g} (the LR rule: docs/recovery.md)",
        "",
        "which layers (speedup: student training step under EP over one node, Eq. 9; prefill TP=EP=GPUs per node, "
        "32 x 2048, Appendix B)",
        f"{'spec':<12}{'layers':>8}{'train':>9}{'prefill':>9}{'KL':>9}{'loss':>9}",
    ]
    for o in plan.options:
        kl = "-" if o.kl is None else f"{o.kl:.4f}"
        loss = "-" if o.loss is None else f"{o.loss:.4f}"
        mark = "  <-" if o is plan.choice else ""
        lines.append(
            f"{o.spec:<12}{len(o.layers):>8}{o.training_speedup:>8.3f}x{o.prefill_speedup:>8.3f}x{kl:>9}{loss:>9}{mark}"
        )
    lines += [f"-> {plan.choice.spec}: {plan.reason}", ""]
    lines.append(f"-> chosen: {plan.chosen.layout.name}" if plan.chosen is not None else "-> nothing fits")
    lines += memory_table(plan.search)
    chosen = plan.chosen
    if not plan.fits:
        fallback = plan.fallback
        if fallback is None or fallback.chosen is None:
            tried = fallback.cluster.nodes if fallback is not None else plan.cluster.nodes
            lines.append(f"-> nothing fits on {plan.cluster.gpus} GPUs, nor on more nodes (tried up to {tried})")
            if fallback is not None:
                lines += ["", f"the largest cluster tried, {fallback.cluster.nodes} nodes:"]
                lines += memory_table(fallback)
            lines += [f"   {line}" for line in why_none_fits(fallback or plan.search, plan.counts)]
        else:
            lines += ["", f"-> nothing fits on {plan.cluster.gpus} GPUs; {fallback.cluster.nodes} nodes do:"]
            lines += memory_table(fallback)
    lines += [f"note: {n}" for n in plan.notes]
    if chosen is None:
        return "\n".join(lines)
    t = chosen.time
    lines += ["", *timing_table(_searched(plan)), f"-> {plan.layout_reason}"]
    lines += [
        "",
        f"-> {chosen.layout.name}: peak {chosen.estimate.peak / GIB:.1f} GiB per GPU "
        f"(at the {chosen.estimate.peak_phase} phase)",
        f"           teacher priced as {priced_teacher(plan.config, chosen.layout)}",
        "time       FLOPs per token: "
        + ", ".join(f"{PHASES.get(phase, phase)} {_flops(value)}" for phase, value in plan.flops.items())
        + f"; at {plan.cluster.mfu:.0%} of {plan.cluster.gpu.tflops:g} TFLOP/s",
        f"           step {duration(t.seconds)} (compute {duration(t.compute_s)}, exposed communication "
        f"{duration(t.exposed_comm_s)}), {t.tokens_per_s:,.0f} tokens/s",
        *breakdown_lines(plan),
        f"           {_hours(plan.hours)} on {chosen.layout.processes} GPUs, {plan.gpu_hours:,.0f} GPU-hours"
        + (
            f" (with the teacher cache's pass, {plan.cache_pass_hours:.1f} h on {plan.cache_gpus} "
            f"GPU{'s' if plan.cache_gpus > 1 else ''})"
            if plan.cache_pass_hours
            else ""
        ),
    ]
    if plan.cache_pass_hours:
        disk = plan.tokens * plan.config.teacher.top_k * 8 / 1e12  # fp32 log-probabilities and int32 ids
        lines.append(
            f"           the teacher cache takes about {disk:.2f} TB of disk for these tokens (top "
            f"{plan.config.teacher.top_k} per token; it covers the whole dataset, which may hold more)"
        )
    if plan.serving is not None:
        from fcsd.plan.serving_fit import serving_line

        lines += ["", serving_line(plan.serving)]
    lines += [
        "",
        "commands",
    ]
    lines += [
        f"  {plan.commands[k]}" for k in ("cache_teacher", "train", "serve", "serve_sglang") if k in plan.commands
    ]
    return "\n".join(lines)


def plan_dict(plan) -> dict:
    """``--json``: everything the text report shows."""
    chosen = plan.chosen
    return {
        "model": {"name": plan.source.name, "origin": plan.source.origin, **plan.summary.to_dict()},
        "cluster": plan.cluster.to_dict(),
        "tokens": plan.tokens,
        "batch_tokens": plan.config.train.batch_tokens,
        "seq_len": plan.config.data.seq_len,
        "steps": plan.steps,
        "lr": {
            "recipe": plan.config.recovery.name,
            "train_lr": plan.config.train.lr,
            "lr_scale": plan.config.recovery.lr_scale,
            "peak": peak_lr(plan.config),
        },
        "layers": [o.to_dict() for o in plan.options],
        "recommended_layers": {"spec": plan.choice.spec, "reason": plan.reason},
        "candidates": [c.to_dict() for c in plan.search.candidates],
        "fits": plan.fits,
        "fallback": None
        if plan.fallback is None
        else {
            "nodes": plan.fallback.cluster.nodes,
            "fits": plan.fallback.chosen is not None,
            "candidates": [c.to_dict() for c in plan.fallback.candidates],
        },
        "chosen": None if chosen is None else chosen.to_dict(),
        "teacher_priced": None if chosen is None else priced_teacher(plan.config, chosen.layout),
        "layouts_timed": [c.to_dict() for c in _searched(plan).timed],
        "layout_reason": plan.layout_reason,
        "why_nothing_fits": [] if chosen is not None else why_none_fits(plan.fallback or plan.search, plan.counts),
        "flops_per_token": plan.flops,
        "breakdown": None if chosen is None else chosen.time.to_dict(),
        "published": [
            {"source": source, "tokens_per_gpu_s": rate, "as_distillation": rate / DISTILL_COST}
            for source, rate in published(plan)
        ],
        "hours": plan.hours,
        "gpu_hours": plan.gpu_hours,
        "cache_pass_hours": plan.cache_pass_hours,
        "cache_gpus": plan.cache_gpus,
        "serving": None if plan.serving is None else plan.serving.to_dict(),
        "commands": plan.commands,
        "notes": plan.notes,
    }
