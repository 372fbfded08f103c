"""Which ways of running FCSD on a cluster fit in memory, and which of them trains fastest.

A candidate is a :class:`~fcsd.plan.simulate.Layout`: one process, DDP, expert parallelism over groups of ``P``
GPUs (``P`` divides the GPUs and the experts), or FSDP2 over all of them; an online teacher (laid out as the
strategy lays it out) or the top-k cache; a micro-batch (a divisor of each GPU's share of a step); gradient
checkpointing on or off (not under expert parallelism, which refuses it). Each is decided by simulation, cheapest
first, and a candidate that needs at least as much memory as one that already failed is not simulated again
(``dominated``): the static bytes (weights, gradients, AdamW, teacher) rule a strategy out before any step; a
step with the cached teacher and checkpointing is the frugal one, whose failure rules out the online teacher and
the run without checkpointing at the same micro-batch; a larger micro-batch needs more (FSDP2 included: the
trainer reduce-scatters every micro-batch, so no GPU holds unsharded gradients between them). ``fcsd cache-teacher``
holds the whole bf16 teacher on one GPU: a teacher that does not fit there rules the cache out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fcsd.plan.cluster import GIB, Cluster
from fcsd.plan.simulate import Layout, StepEstimate, estimate_step

MAX_MICRO_BATCH = 8


@dataclass
class Candidate:
    layout: Layout
    status: str  # fits | exceeds | static (its static bytes alone exceed) | dominated | invalid
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


def strategies(processes: int, num_experts: int) -> list[tuple[str, int]]:
    """``(strategy, EP size)`` pairs for ``processes`` GPUs."""
    if processes == 1:
        return [("single", 1)]
    found = [("ep", p) for p in range(processes, 1, -1) if processes % p == 0 and num_experts % p == 0]
    return found + [("fsdp2", 1), ("ddp", 1)]


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


def static_floor(layout: Layout, counts: Counts) -> int:
    """A lower bound of a candidate's static bytes per GPU, from parameter counts alone: its share of the student's
    fp32 weights (4 bytes per parameter), gradients and AdamW moments (12 more, embeddings left out in case they
    are frozen), DDP's buckets, and its share of a bf16 online teacher. Only used to skip candidates that cannot
    fit; every other one is simulated."""
    held = {
        "ep": counts.total - counts.experts + counts.experts // layout.ep_size,
        "fsdp2": counts.total // layout.processes,
    }.get(layout.strategy, counts.total)
    trained = max(0, held - counts.embeddings * held // counts.total)
    floor = 4 * held + 12 * trained + (4 * trained if layout.strategy == "ddp" else 0)
    return floor + (2 * held if layout.teacher == "online" else 0)


def loading_floor(layout: Layout, counts: Counts) -> int:
    """A lower bound of a GPU's bytes while ``fcsd convert`` loads an FSDP2 run with the online teacher: the trainer
    puts the whole bf16 teacher on every GPU and shards it only after accelerate has sharded the student (whose fp32
    share is there by then). 0 for every other layout (expert parallelism loads each rank's experts only)."""
    if layout.strategy != "fsdp2" or layout.teacher != "online":
        return 0
    return 2 * counts.total + 4 * counts.total // layout.processes


def search(model_config, fcsd_config, cluster: Cluster, counts: Counts, cache_ok: bool | str) -> Search:
    """Decide every candidate on ``cluster`` (see the module docstring). ``cache_ok``: whether the teacher cache may
    be used (True), or why not (False: the teacher does not fit one GPU; a string: the reason)."""
    from fcsd.perfmodel import model_shape

    result = Search(cluster)
    processes = cluster.gpus
    share = fcsd_config.train.batch_tokens // fcsd_config.data.seq_len // processes
    for strategy, ep in strategies(processes, model_shape(model_config).num_experts):
        layouts = [  # fastest first: the online teacher, no recomputation, fewer micro-batches
            Layout(strategy, processes, ep, teacher, mb, gc)
            for teacher in ("online", "cache")
            for gc in ([False, True] if strategy != "ep" else [False])
            for mb in reversed(micro_batches(share))
        ]
        result.candidates += _decide(model_config, fcsd_config, layouts, cluster.budget, counts, cache_ok)
    return result


def lighter(a: Layout, b: Layout) -> bool:
    """Whether ``a`` needs at most the memory of ``b`` (same strategy): a cached teacher needs less than an online
    one, checkpointing less than none, a smaller micro-batch less than a larger one."""
    return (
        (a.strategy, a.ep_size) == (b.strategy, b.ep_size)
        and (a.teacher == "cache" or b.teacher == "online")
        and (a.gradient_checkpointing or not b.gradient_checkpointing)
        and a.micro_batch <= b.micro_batch
    )


def _decide(model_config, fcsd_config, layouts: list[Layout], budget: int, counts: Counts, cache_ok: bool | str):
    """Decide ``layouts`` (one strategy, fastest first): the heaviest and the lightest are simulated first, then
    every candidate not implied by a simulated one (a lighter one fits when a heavier one does, a heavier one does
    not when a lighter one does not)."""
    decided: dict[Layout, Candidate] = {}
    for layout in layouts:
        floor = static_floor(layout, counts)
        if layout.teacher == "cache" and cache_ok is not True:
            note = cache_ok or "fcsd cache-teacher holds the whole bf16 teacher on one GPU, which it does not fit"
            decided[layout] = Candidate(layout, "invalid", note=note)
        elif floor > budget:
            note = f"its fp32 weights, gradients and AdamW (and teacher) take at least {floor / GIB:.1f} GiB"
            decided[layout] = Candidate(layout, "static", note=note)
        elif loading_floor(layout, counts) > budget:
            note = (
                f"loading: the trainer holds the whole bf16 teacher ({2 * counts.total / GIB:.1f} GiB) on every GPU "
                "until it shards it, after the student"
            )
            decided[layout] = Candidate(layout, "static", note=note)
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
            estimate = estimate_step(model_config, fcsd_config, layout)
            decided[layout] = Candidate(layout, "fits" if estimate.peak <= budget else "exceeds", estimate)
    return [decided[layout] for layout in layouts]


def choose(result: Search, model_config, fcsd_config, shape, converted: set[int]) -> Candidate | None:
    """The fastest candidate that fits: each strategy's first fitting candidate in its order (fastest first; it is
    simulated now if its fit was implied), timed, the quickest kept."""
    from fcsd.plan.timing import step_time

    best: dict[tuple, Candidate] = {}
    for candidate in result.candidates:
        group = (candidate.layout.strategy, candidate.layout.ep_size)
        if not candidate.fits or group in best:
            continue
        if candidate.estimate is None:
            candidate.estimate = estimate_step(model_config, fcsd_config, candidate.layout)
            if candidate.estimate.peak > result.cluster.budget:  # not implied after all: keep looking
                candidate.status = "exceeds"
                continue
        candidate.time = step_time(
            candidate.estimate,
            shape,
            converted,
            result.cluster,
            fcsd_config.train.batch_tokens,
            fcsd_config.data.seq_len,
        )
        best[group] = candidate
    result.chosen = min(best.values(), key=lambda c: c.time.seconds) if best else None
    return result.chosen


def why_none_fits(result: Search, counts: Counts) -> list[str]:
    """Why no candidate of ``result`` fits, strategy by strategy, from its simulations and parameter counts, and
    what would (design §4: expert parallelism shards only the routed experts)."""
    lines = []
    ep = [c.layout.ep_size for c in result.candidates if c.layout.strategy == "ep"]
    if ep:
        replicated = counts.total - counts.experts
        lines.append(
            f"expert parallelism (EP up to {max(ep)}): every GPU holds the {replicated / 1e9:.1f}B parameters outside "
            f"the routed experts whole, about {16 * replicated / GIB:.0f} GiB of fp32 weights, gradients and AdamW "
            "at any EP size"
        )
    every_fsdp2 = [c for c in result.candidates if c.layout.strategy == "fsdp2"]
    fsdp2 = [c for c in every_fsdp2 if c.estimate is not None]
    if not fsdp2:  # none simulated: the reasons they were ruled out before any step
        lines += [f"FSDP2: {note}" for note in dict.fromkeys(c.note for c in every_fsdp2)]
    else:
        lightest = min(fsdp2, key=lambda c: c.estimate.peak)
        e = lightest.estimate
        unsharded = e.peak - (e.weights + e.gradients + e.optimizer + e.teacher)
        lines.append(
            f"FSDP2: {unsharded / GIB:.1f} GiB of its lightest step ({lightest.layout.short}) are not sharded: the "
            "layers it gathers whole (every routed expert of a MoE layer at once), their gradients and the activations"
        )
    lines.append(
        "what would fit: expert parallelism with the other parameters sharded too (FSDP2 over the expert-parallel "
        "ranks), which fcsd does not build yet, or GPUs with more memory (--gpu, --gpu-memory)"
    )
    return lines
