"""``fcsd bench overlap --link``: the expert-parallel schedules run over a modelled link (paper Sec. 4.1, 4.2,
Table 4, Appendix D).

For every layout: all-to-all (training; forward and backward reported separately) and all-reduce (inference
prefill, every rank holding the same tokens), each in mode ``regular`` (stock connectivity, blocking) and
``farskip_overlap``, the real schedule runs ``iters`` steps with every collective going through a
:class:`fcsd.bench.modelled_link.ModelledLink`. Reported per phase and collective kind (:mod:`fcsd.bench.hidden_share`):
link time, time hidden, window, hidden share, structural limit, schedule efficiency and the exposed remainder by
cause; the step wall times under the link (slowest rank's median; they include the real collectives' waits, so on
a shared CPU they are noisy) and their ratio, regular over overlapped; the worst rank's hidden share; how much of
each rank's non-waiting wall time it spent on its own CPU (below 1: other processes took the core, which lengthens
the windows). ``timeline=True`` adds one recorded step per mode and rank
(:mod:`fcsd.parallel.segments`) for :mod:`fcsd.bench.picture`.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from fcsd.bench.hidden_share import Figures, summarise
from fcsd.bench.modelled_link import ModelledLink, gemm_flops, parse_link, scale_to_device
from fcsd.parallel import collectives
from fcsd.parallel.segments import SegmentRecorder

MODES = ("regular", "farskip_overlap")
LAYOUTS = {"all_to_all": ("forward", "backward"), "all_reduce": ("prefill",)}


LINK_TIME_LIMIT = 600.0  # seconds of modelled transfers one --link run may take (the rest is compute)
TRANSFERS_PER_LAYER = {"all_to_all": 6, "all_reduce": 1}  # per MoE layer and step: dispatch, combine (+ counts,
# ids) forward and backward; one routed all-reduce per layer in a prefill


def link_time(spec, ranks: int, moe_layers: int, tokens: int, hidden: int, top_k: int, steps: int, bytes_per=4.0):
    """The modelled link time of a whole ``--link`` run, estimated before any process starts: per rank and step, an
    all-to-all moves ``tokens * top_k`` rows of ``hidden`` values four times per MoE layer (dispatch and combine,
    forward and backward; the ``(P - 1) / P`` that leave the rank), a prefill all-reduces ``tokens * hidden`` values
    once per layer (ring: ``2 (P - 1) / P``); ``steps`` steps per mode and layout, two modes."""
    share = (ranks - 1) / ranks
    a2a = 4 * tokens * top_k * hidden * bytes_per * share
    reduce = 2 * tokens * hidden * bytes_per * share
    per_step = moe_layers * ((a2a + reduce) / spec.bandwidth + sum(TRANSFERS_PER_LAYER.values()) * spec.latency)
    return 2 * steps * per_step


def check_link_time(text: str, seconds: float, limit: float = LINK_TIME_LIMIT) -> None:
    """Refuse a ``--link`` whose modelled transfers alone would take longer than ``limit`` (the run would sit
    waiting on a link it cannot model in reasonable time), naming the estimate and a link that fits."""
    if seconds <= limit:
        return
    spec = parse_link(text)
    faster = spec.bandwidth * seconds / limit
    raise ValueError(
        f"--link {text}: the modelled transfers alone would take about {_human_duration(seconds)} (limit "
        f"{_human_duration(limit)}); give a faster link, e.g. --link {_rate_text(faster)}"
        + (f",{text.split(',', 1)[1]}" if "," in text else "")
        + ", or fewer --iters"
    )


def _human_duration(seconds: float) -> str:
    for unit, size in (("years", 365 * 86400.0), ("days", 86400.0), ("hours", 3600.0), ("minutes", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def _rate_text(bandwidth: float) -> str:
    """A bandwidth at least ``bandwidth`` bytes/s, rounded up, in ``--link`` syntax."""
    import math

    for prefix, size in (("G", 1e9), ("M", 1e6), ("k", 1e3), ("", 1.0)):
        if bandwidth >= size:
            return f"{math.ceil(bandwidth / size)}{prefix}B/s"
    return "1B/s"


def agreed_link(text: str, device: torch.device):
    """The link every rank uses: presets scaled to rank 0's measured GEMM rate (see :mod:`fcsd.bench.modelled_link`)."""
    spec = parse_link(text)
    if spec.preset is not None and device.type != "cuda":
        flops = torch.tensor([gemm_flops() if dist.get_rank() == 0 else 0.0], dtype=torch.float64)
        dist.broadcast(flops, 0)
        spec = scale_to_device(spec, device, float(flops))
    return spec


class LinkStep:
    """Steps of ``model`` on ``input_ids`` under ``link``: training (forward + backward) or, with ``train=False``, an
    inference prefill. After :meth:`run`: :attr:`times` (seconds per phase), :attr:`transfers` (this step's, phase
    ``forward``/``backward`` or ``prefill``), :attr:`cpu_share` and, when recorded, :attr:`timeline`."""

    def __init__(self, model, input_ids: torch.Tensor, link: ModelledLink, train: bool = True):
        self.model, self.input_ids, self.link, self.train = model, input_ids, link, train
        self.device = input_ids.device
        self.times, self.transfers, self.timeline, self.cpu_share = {}, [], None, float("nan")

    def run(self, record: bool = False) -> LinkStep:
        recorder = SegmentRecorder(self.model) if record else None
        dist.barrier()
        self.link.take()
        self.link.free_at = 0.0
        cpu, start = time.thread_time(), self.link.now(self.device)
        with recorder if recorder is not None else nullcontext():
            if self.train:
                loss = self.model(input_ids=self.input_ids, use_cache=False).logits.float().square().mean()
            else:
                with torch.no_grad():
                    self.model(input_ids=self.input_ids, use_cache=False)
                loss = None
            middle = self.link.now(self.device)
            if recorder is not None:
                recorder.end_forward(loss)
            if loss is not None:
                loss.backward()
                self.model.zero_grad(set_to_none=True)
        end = self.link.now(self.device)
        self.transfers = self.link.take()
        for t in self.transfers:  # a prefill's collectives are forward ones; name them by their phase
            t.phase = t.phase if self.train else "prefill"
        self.times = {"forward": middle - start, "backward": end - middle} if self.train else {"prefill": end - start}
        blocked = sum((t.done or t.delivered) - (t.waited or t.launched) for t in self.transfers)
        self.cpu_share = (time.thread_time() - cpu) / max(end - start - blocked, 1e-9)
        if recorder is not None:
            self.timeline = _relative(start, middle, recorder.intervals(), self.transfers)
        return self


def _relative(origin: float, middle: float, segments, transfers) -> dict:
    def ms(t):
        return None if t is None else round(1e3 * (t - origin), 4)

    return {
        "forward_end_ms": ms(middle),
        "segments": [(ms(a), ms(b), label) for a, b, label in segments],
        "transfers": [
            dict(
                kind=t.kind,
                phase=t.phase,
                serial=t.serial,
                launched=ms(t.launched),
                start=ms(t.start),
                delivered=ms(t.delivered),
                waited=ms(t.waited),
                done=ms(t.done),
            )
            for t in transfers
        ],
    }


def bench_inputs(model, batch: int, seq: int, same_on_every_rank: bool, device) -> torch.Tensor:
    """The token ids a rank runs: its own (training layout) or the same on every rank (all-reduce layout)."""
    seed = 100 if same_on_every_rank else 100 + dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (batch, seq), generator=gen).to(device)


def _slowest_median(values: list[float], device) -> float:
    value = torch.tensor([statistics.median(values)], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _all_values(value) -> list:
    """``value`` of every rank, in rank order."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def _combine(per_rank: list[dict[str, dict[str, Figures]]], steps: int, phases) -> tuple[dict, dict]:
    """Per phase and kind, figures per rank and step (summed over ranks, divided by steps x ranks), and the worst
    rank's hidden share per phase."""
    table, worst = {}, {}
    for phase in phases:
        kinds: dict[str, Figures] = {}
        for figures in per_rank:
            for kind, fig in figures.get(phase, {}).items():
                kinds.setdefault(kind, Figures()).add(fig)
        table[phase] = {kind: fig.as_dict(steps * len(per_rank)) for kind, fig in kinds.items()}
        shares = [f[phase]["total"].hidden / f[phase]["total"].link for f in per_rank if phase in f]
        worst[phase] = min(shares) if shares else float("nan")
    return table, worst


def measure_link(args, env, model_for) -> dict:
    """All figures of the module docstring (the same dict on every rank). ``model_for(mode, layout)`` builds the
    expert-parallel model and returns ``(model, batch, seq)``."""
    spec = agreed_link(args.link, env.device)
    link = ModelledLink(spec)
    saved, collectives.LINK = collectives.LINK, link
    layouts = {}
    try:
        for layout, phases in LAYOUTS.items():
            train = layout == "all_to_all"
            modes, timeline = {}, {}
            for mode in MODES:
                model, batch, seq = model_for(mode, layout)
                step = LinkStep(model, bench_inputs(model, batch, seq, not train, env.device), link, train)
                step.run()  # warm-up
                times, steps, cpu = {p: [] for p in phases}, [], []
                for _ in range(args.iters):
                    step.run()
                    for phase, seconds in step.times.items():
                        times[phase].append(seconds)
                    steps.append(step.transfers)
                    cpu.append(step.cpu_share)
                table, worst = _combine(_all_values(summarise(steps)), args.iters, phases)
                modes[mode] = {
                    "step_ms": {p: 1e3 * _slowest_median(v, env.device) for p, v in times.items()},
                    "phases": table,
                    "worst_rank_hidden_share": worst,
                    "cpu_share": min(_all_values(statistics.median(cpu))),
                }
                if args.timeline:
                    timeline[mode] = _all_values(step.run(record=True).timeline)
                del model
            overlapped, regular = modes["farskip_overlap"]["step_ms"], modes["regular"]["step_ms"]
            layouts[layout] = {"modes": modes, "speedup": sum(regular.values()) / sum(overlapped.values())}
            if args.timeline:
                layouts[layout]["timeline"] = timeline
    finally:
        collectives.LINK = saved
    return {
        "link": {
            "text": args.link,
            "bandwidth": spec.bandwidth,
            "latency": spec.latency,
            "scale": spec.scale,
            "description": spec.describe(),
        },
        "layouts": layouts,
    }


CAUSE_NAMES = {"last_combine": "last combine", "counts": "counts", "no_window": "no window", "queued": "queued"}


def format_link_table(result: dict) -> str:
    """The ``--link`` figures as text tables (per rank and step; shares in percent)."""
    link = result["link"]
    lines = [f"modelled link: {link['description']} (one serial link per rank; bus bandwidth)"]
    titles = {"all_to_all": "all-to-all layout (training)", "all_reduce": "all-reduce layout (inference prefill)"}
    head = (
        f"{'phase':9}{'collective':21}{'n':>4}{'link ms':>10}{'hidden ms':>11}{'hidden':>8}{'window ms':>11}"
        f"{'struct.':>9}{'effic.':>8}  exposed ms by cause: " + ", ".join(CAUSE_NAMES.values())
    )
    for layout, data in result["layouts"].items():
        overlap, regular = data["modes"]["farskip_overlap"], data["modes"]["regular"]
        lines += ["", f"{titles[layout]}, farskip_overlap, per rank and step:", head]
        for phase, kinds in overlap["phases"].items():
            for kind in sorted(kinds, key=lambda k: (k == "total", k)):
                f = kinds[kind]
                causes = ", ".join(f"{f['exposed_ms'][c]:.2f}" for c in CAUSE_NAMES)
                lines.append(
                    f"{phase:9}{kind:21}{f['count']:>4.0f}{f['link_ms']:>10.2f}{f['hidden_ms']:>11.2f}"
                    f"{_pct(f['hidden_share']):>8}{f['window_ms']:>11.2f}{_pct(f['structural_limit']):>9}"
                    f"{_ratio(f['efficiency']):>8}  {causes}"
                )
        phases = list(overlap["step_ms"])
        for p in phases:
            share = overlap["phases"][p]["total"]["hidden_share"]
            lines.append(
                f"{p}: {_pct(share)} of the link time hidden (worst rank {_pct(overlap['worst_rank_hidden_share'][p])})"
                f"; regular schedule: {_pct(regular['phases'][p]['total']['hidden_share'])}"
            )
        times = "; ".join(
            f"{mode} " + " + ".join(f"{p} {data['modes'][mode]['step_ms'][p]:.1f}" for p in phases) for mode in MODES
        )
        lines.append(
            f"step wall time under the link (slowest rank, median ms; includes the real collectives' waits): {times}; "
            f"ratio {data['speedup']:.3f}"
        )
        lines.append(
            f"CPU share of non-waiting time (lowest rank): regular {regular['cpu_share']:.2f}, overlapped "
            f"{overlap['cpu_share']:.2f} (below 1: other processes took the core; windows are wall time)"
        )
    return "\n".join(lines)


def _pct(value: float) -> str:
    return "n/a" if value != value else f"{100 * value:.1f}%"


def _ratio(value: float) -> str:
    return "n/a" if value != value else f"{value:.2f}"
