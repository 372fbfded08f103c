"""Which ways of running FCSD on a cluster fit in memory, and which of them trains fastest.

A candidate is a :class:`~fcsd.plan.simulate.Layout`: one process, DDP, expert parallelism over groups of ``P``
GPUs with the rest replicated, EP ``P`` x FSDP2 (the expert shards FSDP2-sharded over their ``W / P`` replicas,
the rest over all ``W`` GPUs; ``W / P`` may be 1), or FSDP2 alone over all of them; ``P`` divides the GPUs and the
experts, and an EP group lies inside a node or spans whole nodes (``P`` a divisor or a multiple of the GPUs per
node: ep innermost, consecutive ranks; a group beyond a node runs the node-aware ``hierarchical`` dispatcher,
:mod:`fcsd.plan.timing`); an online teacher (laid out as the student) or the top-k cache; a micro-batch (a divisor
of each GPU's share of a step); gradient checkpointing on or off (under expert parallelism the layout's own, which
replays the exchanges, with its rows on the GPU or in host memory).

Each is decided by simulation. Without a time model (``shape`` not given to :func:`search`) every candidate is
decided, cheapest first, and a candidate that needs at least as much memory as one that already failed is not
simulated again (``dominated``): the static bytes (weights, gradients, AdamW, teacher) rule a strategy out before
any step; a lighter candidate fits when a heavier one does; a larger micro-batch needs more (FSDP2 included: the
trainer reduce-scatters every micro-batch, so no GPU holds unsharded gradients between them). With it (what
``fcsd plan`` runs) the search looks for the fastest layout and simulates only what can decide it: strategies in
the order of a lower bound of their step time that needs no simulation (:func:`fcsd.plan.pricing.step_bound`:
FSDP2's collectives and the all-to-alls nothing hides); a strategy whose bound is not below the fastest step found
is not simulated (``slower``); inside a strategy its candidates are tried fastest first (the online teacher, no
recomputation, fewer micro-batches) until one fits (after a first miss, the lightest one: if it does not fit,
none does); the rest are ``skipped``. ``fcsd cache-teacher`` lays the teacher out as the run does (on the run's
GPUs under a parallel layout, else on one GPU): a teacher whose share does not fit there rules the cache out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fcsd.plan.cluster import GIB, Cluster
from fcsd.plan.run import LAID_OUT
from fcsd.plan.simulate import Layout, StepEstimate, estimate_step, prefetch
from fcsd.units import duration

MAX_MICRO_BATCH = 8


@dataclass
class Candidate:
    layout: Layout
    status: str  # fits | exceeds | static (its static bytes alone exceed) | dominated | invalid | slower | skipped
    estimate: StepEstimate | None = None
    static: dict | None = None
    note: str = ""
    time: object = None  # timing.StepTime of a candidate that fits

    @property
    def fits(self) -> bool:
        return self.status == "fits"

    def to_dict(self) -> dict:
        out = {"layout": {**self.layout.__dict__, "name": self.layout.name}, "status": self.status, "note": self.note}
        if self.estimate is not None:
            out["memory"] = self.estimate.to_dict()
        if self.static is not None:
            out["static"] = self.static
        if self.time is not None:
            out["time"] = self.time.to_dict()
        return out


@dataclass
class Search:
    """The candidates of one cluster size, with the best that fits (``chosen``; None when none does)."""

    cluster: Cluster
    candidates: list[Candidate] = field(default_factory=list)
    chosen: Candidate | None = None
    timed: list[Candidate] = field(default_factory=list)  # each strategy's fastest fitting candidate, timed
    counts: Counts | None = None

    def best(self, expert_parallel: bool) -> Candidate | None:
        """The fastest timed candidate with (True) or without (False) expert parallelism."""
        found = [c for c in self.timed if (c.layout.ep_size > 1) == expert_parallel]
        return min(found, key=lambda c: c.time.seconds) if found else None


def strategies(processes: int, num_experts: int, gpus_per_node: int | None = None) -> list[tuple[str, int]]:
    """``(strategy, EP size)`` pairs for ``processes`` GPUs: EP x FSDP2 and expert parallelism with the rest
    replicated for every EP size dividing the GPUs and the experts whose groups lie inside a node or span whole
    nodes of ``gpus_per_node``, then FSDP2 and DDP."""
    if processes == 1:
        return [("single", 1)]
    node = gpus_per_node or processes
    sizes = [
        p
        for p in range(processes, 1, -1)
        if processes % p == 0 and num_experts % p == 0 and (node % p == 0 or p % node == 0)
    ]
    return [("ep_fsdp", p) for p in sizes] + [("ep", p) for p in sizes] + [("fsdp2", 1), ("ddp", 1)]


def micro_batches(share: int) -> list[int]:
    """Micro-batch sizes worth trying for ``share`` sequences per GPU and step: the divisors up to
    :data:`MAX_MICRO_BATCH`, and the whole share (one micro-batch per step)."""
    return sorted({m for m in range(1, min(share, MAX_MICRO_BATCH) + 1) if share % m == 0} | {share})


@dataclass(frozen=True)
class Counts:
    """Parameter counts of the model: all, routed experts, input and output embeddings."""

    total: int
    experts: int
    embeddings: int


def parameter_counts(model_config) -> Counts:
    """:class:`Counts` of a meta-device build of ``model_config``'s text model."""
    from fcsd.connectivity.families import family_for_config, meta_model, moe_blocks, text_config

    model = meta_model(text_config(model_config))
    family = family_for_config(model.config)
    blocks = moe_blocks(model, family).values()
    experts = sum(p.numel() for block in blocks for p in getattr(block, family.experts_attr).parameters())
    embeddings = {id(m.weight): m.weight.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings())}
    return Counts(sum(p.numel() for p in model.parameters()), experts, sum(embeddings.values()))


def held_parameters(layout: Layout, counts: Counts) -> int:
    """Parameters of the model one GPU holds under ``layout``'s strategy (FSDP2's padding left out)."""
    return {
        "ep": counts.total - counts.experts + counts.experts // layout.ep_size,
        "ep_fsdp": counts.total // layout.processes,
        "fsdp2": counts.total // layout.processes,
    }.get(layout.strategy, counts.total)


def static_floor(layout: Layout, counts: Counts, fp8_teacher: bool = False) -> int:
    """A lower bound of a candidate's static bytes per GPU, from parameter counts alone: its share of the student's
    fp32 weights (4 bytes per parameter), gradients and AdamW moments (12 more, embeddings left out in case they
    are frozen), DDP's buckets, and its share of a bf16 online teacher (``fp8_teacher``: one byte a parameter).
    Only used to skip candidates that cannot fit; every other one is simulated."""
    held = held_parameters(layout, counts)
    trained = max(0, held - counts.embeddings * held // counts.total)
    floor = 4 * held + 12 * trained + (4 * trained if layout.strategy == "ddp" else 0)
    return floor + ((1 if fp8_teacher else 2) * held if layout.teacher == "online" else 0)


def cache_teacher_bytes(layout: Layout, counts: Counts) -> int:
    """What ``fcsd cache-teacher`` holds per GPU for ``layout``'s cache: under a parallel layout it runs on the same
    GPUs laid out the same way (its bf16 share, :func:`static_floor`'s), else the whole bf16 teacher on one GPU; a
    tenth more for its activations."""
    held = held_parameters(layout, counts) if layout.strategy in LAID_OUT else counts.total
    return int(1.1 * 2 * held)


def _layouts(strategy: str, processes: int, ep: int, share: int) -> list[Layout]:
    """A strategy's candidates, fastest first: the online teacher, no recomputation (then no offload), fewer
    micro-batches."""
    # under expert parallelism checkpointing may keep its replayed rows in host memory (train.checkpoint_offload)
    recomputing = [(True, False), (True, True)] if strategy in ("ep", "ep_fsdp") else [(True, False)]
    return [
        Layout(strategy, processes, ep, teacher, mb, gc, offload)
        for teacher in ("online", "cache")
        for gc, offload in [(False, False), *recomputing]
        for mb in reversed(micro_batches(share))
    ]


def search(
    model_config, fcsd_config, cluster: Cluster, counts: Counts, cache_ok: bool | str, shape=None, converted=None
) -> Search:
    """Decide the candidates on ``cluster`` (see the module docstring). ``cache_ok``: whether the teacher cache may
    serve the run's objective (True), or why not (a string: the reason). With ``shape`` (the model's
    :class:`fcsd.plan.perfmodel.ModelShape`) and ``converted`` (its FarSkip layers) the search times what it finds and
    fills ``timed`` and ``chosen``."""
    from fcsd.plan.perfmodel import model_shape

    result = Search(cluster, counts=counts)
    processes = cluster.gpus
    share = fcsd_config.train.batch_tokens // fcsd_config.data.seq_len // processes
    experts = model_shape(model_config).num_experts if shape is None else shape.num_experts
    groups = [
        _layouts(strategy, processes, ep, share)
        for strategy, ep in strategies(processes, experts, cluster.gpus_per_node)
    ]
    if shape is None:
        for layouts in groups:
            result.candidates += _decide(model_config, fcsd_config, layouts, cluster, counts, cache_ok)
        return result
    from fcsd.plan.pricing import Pricing

    pricing = Pricing(model_config, fcsd_config, cluster, counts, shape, set(converted or ()))
    decided: dict[Layout, Candidate] = {}
    screened = [_screen(layouts, cluster, counts, cache_ok, fcsd_config) for layouts in groups]
    bounds = [min((pricing.bound(c.layout) for c in found if c.status == "open"), default=None) for found in screened]
    best: Candidate | None = None
    order = sorted(range(len(groups)), key=lambda i: (bounds[i] is None, bounds[i] or 0.0))
    for position, index in enumerate(order):
        found, bound = screened[index], bounds[index]
        if bound is not None and best is not None and bound >= best.time.seconds:
            note = (
                f"its step takes at least {duration(bound)} (FSDP2's collectives and the all-to-alls nothing "
                f"hides), not less than {best.layout.short}'s {duration(best.time.seconds)}"
            )
            found = [c if c.status != "open" else Candidate(c.layout, "slower", note=note) for c in found]
        else:
            after = next((c.layout for i in order[position + 1 :] for c in screened[i] if c.status == "open"), None)
            found = _walk(model_config, fcsd_config, found, cluster, after, pricing.host_scale)
            first = next((c for c in found if c.fits), None)
            if first is not None:
                first.time = pricing.time(first.estimate)
                result.timed.append(first)
                if best is None or first.time.seconds < best.time.seconds:
                    best = first
        decided.update((c.layout, c) for c in found)
    result.candidates = [decided[layout] for layouts in groups for layout in layouts]
    result.chosen = best
    return result


def lighter(a: Layout, b: Layout) -> bool:
    """Whether ``a`` needs at most the memory of ``b`` (same strategy): a cached teacher needs less than an online
    one, checkpointing less than none (and with its replay in host memory less than without), a smaller
    micro-batch less than a larger one."""
    return (
        (a.strategy, a.ep_size) == (b.strategy, b.ep_size)
        and (a.teacher == "cache" or b.teacher == "online")
        and (a.gradient_checkpointing or not b.gradient_checkpointing)
        and (a.offload or not b.offload)
        and a.micro_batch <= b.micro_batch
    )


def _screen(layouts: list[Layout], cluster: Cluster, counts: Counts, cache_ok: bool | str, config) -> list[Candidate]:
    """``layouts`` decided where no simulation is needed (``invalid``, ``static``); the others ``open``."""
    from fcsd.plan.teacher_dtype import fp8_teacher

    budget = cluster.budget
    found = []
    for layout in layouts:
        floor = static_floor(layout, counts, fp8_teacher(config, layout))
        if layout.teacher == "cache" and cache_ok is not True:
            found.append(Candidate(layout, "invalid", note=cache_ok))
        elif layout.teacher == "cache" and cache_teacher_bytes(layout, counts) > budget:
            where = "each of the run's GPUs" if layout.strategy in LAID_OUT else "one GPU"
            note = f"fcsd cache-teacher holds its bf16 teacher's share on {where}, which it does not fit"
            found.append(Candidate(layout, "invalid", note=note))
        elif floor > budget:
            note = f"its fp32 weights, gradients and AdamW (and teacher) take at least {floor / GIB:.1f} GiB"
            found.append(Candidate(layout, "static", note=note))
        else:
            found.append(Candidate(layout, "open"))
    return found


def _walk(model_config, fcsd_config, found: list[Candidate], cluster: Cluster, after=None, host_scale=None):
    """One strategy's screened candidates (fastest first) simulated in order until one fits; after the first miss
    the lightest is simulated (when it does not fit, no candidate does); a candidate needing at least what a
    failed one needs is ``dominated``; the ones after the first that fits are ``skipped``. While one simulates, the
    workers (:mod:`fcsd.plan.workers`) start the one needed if it misses (or ``after``, the next strategy's).
    ``host_scale(layout)``: :func:`_simulated`'s."""
    out = {c.layout: c for c in found}
    opened = [c.layout for c in found if c.status == "open"]
    first = None
    for index, layout in enumerate(opened):
        if out[layout].status != "open":
            first = first or (out[layout] if out[layout].fits else None)  # the lightest, simulated after a miss
            continue
        if first is not None:
            out[layout] = Candidate(layout, "skipped", note=f"{first.layout.short} comes first and fits")
            continue
        failing = next(
            (c for c in out.values() if c.estimate is not None and not c.fits and lighter(c.layout, layout)), None
        )
        if failing is not None:
            out[layout] = Candidate(layout, "dominated", note=f"needs at least what {failing.layout.short} needs")
            continue
        missed = any(c.estimate is not None or c.status == "invalid" for c in out.values() if c.layout in opened)
        later = [other for other in opened[index + 1 :] if out[other].status == "open"]
        upcoming = (later[-1] if not missed and later else later[0]) if later else after
        prefetch(model_config, fcsd_config, layout)
        if upcoming is not None:
            prefetch(model_config, fcsd_config, upcoming)
        scale = host_scale or (lambda layout: 1.0)
        out[layout] = _simulated(model_config, fcsd_config, layout, cluster, scale(layout))
        if out[layout].fits:
            first = out[layout]
        elif out[opened[-1]].status == "open":
            out[opened[-1]] = _simulated(model_config, fcsd_config, opened[-1], cluster, scale(opened[-1]))
    return [out[c.layout] for c in found]


def _decide(model_config, fcsd_config, layouts: list[Layout], cluster: Cluster, counts: Counts, cache_ok: bool | str):
    """Decide ``layouts`` (one strategy, fastest first): the heaviest and the lightest are simulated first, then
    every candidate not implied by a simulated one (a lighter one fits when a heavier one does, a heavier one does
    not when a lighter one does not)."""
    decided = {c.layout: c for c in _screen(layouts, cluster, counts, cache_ok, fcsd_config) if c.status != "open"}
    pending = [layout for layout in layouts if layout not in decided]
    for layout in pending[:1] + pending[-1:] + pending[1:-1]:  # heaviest, lightest, then the fastest first
        if layout in decided:
            continue
        simulated = [c for c in decided.values() if c.estimate is not None]
        fitting = next((c for c in simulated if c.fits and lighter(layout, c.layout)), None)
        failing = next((c for c in simulated if not c.fits and lighter(c.layout, layout)), None)
        if fitting is not None:
            decided[layout] = Candidate(layout, "fits", note=f"needs at most what {fitting.layout.short} needs")
        elif failing is not None:
            decided[layout] = Candidate(layout, "dominated", note=f"needs at least what {failing.layout.short} needs")
        else:
            decided[layout] = _simulated(model_config, fcsd_config, layout, cluster)
    return [decided[layout] for layout in layouts]


def _simulated(model_config, fcsd_config, layout: Layout, cluster: Cluster, host_scale: float = 1.0) -> Candidate:
    """``layout`` simulated; a step the trainer's own code cannot run (it raises on fake tensors as it would on real
    ones) is an ``invalid`` candidate naming the error, not a crashed plan. ``host_scale``: the layout's replayed
    rows over the simulated dispatcher's (:func:`fcsd.plan.timing.replay_scale`), for the host memory they take."""
    try:
        estimate = estimate_step(model_config, fcsd_config, layout)
    except RuntimeError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return Candidate(layout, "invalid", note=f"the trainer's step fails in this layout: {first[:160]}")
    if estimate.peak > cluster.budget:
        return Candidate(layout, "exceeds", estimate)
    host = estimate.host * host_scale * cluster.gpus_per_node
    if host > cluster.host_budget:
        note = (
            f"its GPUs' rows for the replay take {host / GIB:.0f} GiB of a node's host memory, more than the "
            f"{cluster.host_budget / GIB:.0f} GiB allowed (--host-memory)"
        )
        return Candidate(layout, "exceeds", estimate, note=note)
    note = ""
    if host_scale != 1.0 and estimate.host:
        note = f"the node-aware dispatcher's replay holds {host_scale:.2f}x as much: {host / GIB:.0f} GiB per node"
    return Candidate(layout, "fits", estimate, note=note)


def choose(result: Search, model_config, fcsd_config, shape, converted: set[int]) -> Candidate | None:
    """The fastest candidate that fits: each strategy's first fitting candidate in its order (fastest first; it is
    simulated now if its fit was implied), timed (all of them kept in ``result.timed``), the quickest chosen. A
    search that timed its candidates itself (:func:`search` with ``shape``) has chosen already."""
    if result.timed:
        return result.chosen
    from fcsd.plan.pricing import Pricing

    pricing = Pricing(model_config, fcsd_config, result.cluster, result.counts, shape, set(converted))
    best: dict[tuple, Candidate] = {}
    for candidate in result.candidates:
        group = (candidate.layout.strategy, candidate.layout.ep_size)
        if not candidate.fits or group in best:
            continue
        if candidate.estimate is None:
            simulated = _simulated(model_config, fcsd_config, candidate.layout, result.cluster)
            candidate.estimate, candidate.status, candidate.note = simulated.estimate, simulated.status, simulated.note
            if not candidate.fits:  # not implied after all (or the step fails): keep looking
                continue
        candidate.time = pricing.time(candidate.estimate)
        best[group] = candidate
    result.timed = list(best.values())
    result.chosen = min(best.values(), key=lambda c: c.time.seconds) if best else None
    return result.chosen


def why_none_fits(result: Search, counts: Counts) -> list[str]:
    """Why no candidate of ``result`` fits, strategy by strategy, from its simulations and parameter counts, and
    what would (design §4)."""
    lines = []
    ep = [c.layout.ep_size for c in result.candidates if c.layout.strategy == "ep"]
    if ep:
        replicated = counts.total - counts.experts
        lines.append(
            f"expert parallelism alone (EP up to {max(ep)}): every GPU holds the {replicated / 1e9:.1f}B parameters "
            f"outside the routed experts whole, about {16 * replicated / GIB:.0f} GiB of fp32 weights, gradients and "
            "AdamW at any EP size"
        )
    for strategy, name, unsharded_what in (
        (
            "ep_fsdp",
            "EP x FSDP2",
            "the layers it gathers whole (one layer's expert shard, its attention), the rows "
            "each exchange received, the activations and the loss",
        ),
        (
            "fsdp2",
            "FSDP2",
            "the layers it gathers whole (every routed expert of a MoE layer at once), their "
            "gradients and the activations",
        ),
    ):
        every = [c for c in result.candidates if c.layout.strategy == strategy]
        simulated = [c for c in every if c.estimate is not None]
        if not simulated:  # none simulated: the reasons they were ruled out before any step
            lines += [f"{name}: {note}" for note in dict.fromkeys(c.note for c in every)]
            continue
        lightest = min(simulated, key=lambda c: c.estimate.peak)
        e = lightest.estimate
        unsharded = e.peak - (e.weights + e.gradients + e.optimizer + e.teacher)
        lines.append(
            f"{name}: {unsharded / GIB:.1f} GiB of its lightest step ({lightest.layout.short}, peak "
            f"{e.peak / GIB:.1f} GiB) are not sharded: {unsharded_what}"
        )
    lines.append(
        "what would fit: more GPUs shrink only the sharded static bytes; GPUs with more memory (--gpu, --gpu-memory), "
        "or a shorter data.seq_len"
    )
    return lines
