"""The timeline of ``fcsd bench overlap --link ... --timeline FILE.png``: one step per rank, regular against
overlapped, like the paper's layer execution traces (Appendix D, Figs. 12-14).

Per layout (training: forward then backward; inference prefill), mode and rank, two lanes: the compute segments
(:mod:`fcsd.parallel.segments`) with the time blocked in waits drawn over them, and the modelled link with each
transfer from the moment the link took it to its delivery (hatched before that while it queued behind another). The
same intervals go to a Chrome-trace JSON (``chrome://tracing``, https://ui.perfetto.dev) beside the PNG.
"""

from __future__ import annotations

import json
from pathlib import Path

WRITER = "fcsd bench overlap"
COLOURS = {
    "attention": "#2a3f6b",
    "attention part a": "#4c72b0",
    "attention part b": "#8fb3e0",
    "routing": "#dd8452",
    "routed experts": "#c44e52",
    "shared experts": "#8172b3",
    "LM head": "#55a868",
    "other": "#d9d9d9",
    "collective": "#d9d9d9",
}
LINK_COLOURS = {"dispatch": "#17becf", "combine": "#bcbd22", "counts": "#000000", "ids": "#8c564b"}
LINK_COLOURS["all_reduce"] = "#e377c2"
LEGEND = {"attention": "attention (not split)"}
TITLES = {"all_to_all": "training step, all-to-all layout", "all_reduce": "inference prefill, all-reduce layout"}
MODE_NAMES = {"regular": "regular", "farskip_overlap": "FarSkip overlapped"}


def output_paths(png: str | Path) -> tuple[Path, Path]:
    """``FILE.png`` -> (the PNG, its Chrome trace ``FILE.trace.json``); other names are refused in one line."""
    png = Path(png).expanduser()
    if png.suffix.lower() != ".png":
        raise ValueError(
            f"--timeline {png}: give a .png file name, e.g. overlap.png (a Chrome trace is written beside)"
        )
    return png, png.with_suffix(".trace.json")


def is_own_png(path: Path) -> bool:
    """A PNG this command wrote (its ``Software`` text chunk names it)."""
    from fcsd.files.ownership import is_png_by

    return is_png_by(path, WRITER)


def is_own_trace(path: Path) -> bool:
    try:
        return json.loads(Path(path).read_text()).get("otherData", {}).get("writer") == WRITER
    except (ValueError, OSError, AttributeError):
        return False


def _lanes(result: dict):
    """``(layout, mode, rank, timeline)`` for every recorded step."""
    for layout, data in result["layouts"].items():
        for mode, ranks in data.get("timeline", {}).items():
            for rank, timeline in enumerate(ranks):
                yield layout, mode, rank, timeline


def _blocked(timeline: dict) -> tuple[list, list]:
    """Time blocked in waits: ``(on the modelled link, on the real collective after the modelled delivery)``, the
    second being another rank arriving late or the host transport (CPU contention), not the schedule."""
    on_link, late = [], []
    for t in timeline["transfers"]:
        if t["waited"] is None or t["done"] is None:
            continue
        delivered = max(t["waited"], min(t["delivered"], t["done"]))
        on_link.append((t["waited"], delivered))
        late.append((delivered, t["done"]))
    return [s for s in on_link if s[1] > s[0]], [s for s in late if s[1] > s[0]]


def chrome_trace(result: dict) -> dict:
    """The recorded steps as Chrome-trace events (microseconds): one process per layout and mode, two threads (compute,
    link) per rank."""
    events, pids = [], {}
    for layout, mode, rank, timeline in _lanes(result):
        pid = pids.setdefault((layout, mode), len(pids) + 1)
        if rank == 0:
            name = f"{TITLES[layout]}: {MODE_NAMES[mode]}"
            events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        compute, link = 2 * rank, 2 * rank + 1
        for tid, lane in ((compute, f"rank {rank} compute"), (link, f"rank {rank} link")):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}})
        for start, end, label in timeline["segments"]:
            events.append(_event(label, "compute", pid, compute, start, end))
        on_link, late = _blocked(timeline)
        for start, end in on_link:
            events.append(_event("waiting for the link", "wait", pid, compute, start, end))
        for start, end in late:
            events.append(_event("waiting for another rank", "wait", pid, compute, start, end))
        for t in timeline["transfers"]:
            args = {"queued_ms": t["start"] - t["launched"], "waited_at_ms": t["waited"], "done_ms": t["done"]}
            events.append(_event(f"{t['kind']} #{t['serial']} ({t['phase']})", "link", pid, link, t["start"],
                                 t["delivered"], args))  # fmt: skip
    link = result["link"]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"writer": WRITER, **link}}


def _event(name, category, pid, tid, start_ms, end_ms, args=None) -> dict:
    event = {"name": name, "cat": category, "ph": "X", "pid": pid, "tid": tid, "ts": 1e3 * start_ms}
    event.update(dur=max(0.0, 1e3 * (end_ms - start_ms)), args=args or {})
    return event


def draw(result: dict, path: Path) -> None:
    """The PNG (see the module docstring) at ``path``, written as is (callers stage it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    layouts = [layout for layout, data in result["layouts"].items() if data.get("timeline")]
    ranks = result["ranks"]
    rows = {layout: 2 * ranks * len(result["layouts"][layout]["timeline"]) for layout in layouts}
    figure, axes = plt.subplots(
        len(layouts), 1, figsize=(13, 1.0 + 0.32 * sum(rows.values()) + 0.9 * len(layouts)), squeeze=False,
        gridspec_kw={"height_ratios": [rows[layout] for layout in layouts]},
    )  # fmt: skip
    used = set()
    for axis, layout in zip(axes[:, 0], layouts):
        labels, y = [], 0
        for mode, per_rank in result["layouts"][layout]["timeline"].items():
            for rank, timeline in enumerate(per_rank):
                _draw_compute(axis, y, timeline, used)
                _draw_link(axis, y + 1, timeline, used)
                labels += [f"{MODE_NAMES[mode]}, rank {rank}: compute", f"{MODE_NAMES[mode]}, rank {rank}: link"]
                if layout == "all_to_all" and timeline["forward_end_ms"] is not None:
                    axis.plot([timeline["forward_end_ms"]] * 2, [y - 0.45, y + 1.45], color="black", lw=0.8, ls=":")
                y += 2
        axis.set_yticks(range(len(labels)), labels, fontsize=8)
        axis.set_ylim(len(labels) - 0.5, -0.5)
        axis.set_xlim(left=0)
        axis.set_xlabel("ms from the start of the step (dotted: forward ends, backward begins)", fontsize=8)
        axis.set_title(f"{TITLES[layout]}: {result['config']}, {ranks} ranks, link {result['link']['description']}",
                       fontsize=9, loc="left")  # fmt: skip
        axis.grid(axis="x", alpha=0.3)
    legend = [Patch(color=COLOURS[k], label=LEGEND.get(k, k)) for k in COLOURS if k in used and k != "collective"]
    legend.append(Patch(facecolor="white", edgecolor="black", hatch="////", label="waiting for the link"))
    legend.append(Patch(facecolor="white", edgecolor="#b0b0b0", hatch="////", label="waiting for another rank"))
    legend += [Patch(color=LINK_COLOURS[k], label=f"link: {k}") for k in LINK_COLOURS if f"link {k}" in used]
    figure.legend(handles=legend, loc="lower center", ncol=6, fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    figure.savefig(path, format="png", dpi=80, metadata={"Software": WRITER})
    plt.close(figure)


def _draw_compute(axis, y: float, timeline: dict, used: set) -> None:
    by_label: dict[str, list] = {}
    for start, end, label in timeline["segments"]:
        by_label.setdefault(label, []).append((start, end - start))
    for label, spans in by_label.items():
        used.add(label)
        axis.broken_barh(spans, (y - 0.4, 0.8), facecolors=COLOURS.get(label, "#d9d9d9"), linewidth=0)
    on_link, late = _blocked(timeline)
    for spans, colour in ((on_link, "black"), (late, "#b0b0b0")):
        spans = [(a, b - a) for a, b in spans]
        axis.broken_barh(spans, (y - 0.4, 0.8), facecolors="white", edgecolors=colour, hatch="////", linewidth=0.3)


def _draw_link(axis, y: float, timeline: dict, used: set) -> None:
    for t in timeline["transfers"]:
        used.add(f"link {t['kind']}")
        colour = LINK_COLOURS.get(t["kind"], "#7f7f7f")
        axis.broken_barh([(t["start"], max(t["delivered"] - t["start"], 1e-3))], (y - 0.3, 0.6), facecolors=colour)
        if t["start"] > t["launched"]:
            axis.broken_barh([(t["launched"], t["start"] - t["launched"])], (y - 0.3, 0.6), facecolors="none",
                             edgecolors=colour, hatch="....", linewidth=0.3)  # fmt: skip


def write_timeline(result: dict, png: Path, trace: Path) -> None:
    """Draw ``result``'s recorded steps to ``png`` and ``trace``, each staged and renamed into place."""
    from fcsd.files.staging import atomic_file

    with atomic_file(png) as staging:
        draw(result, staging)
    with atomic_file(trace) as staging:
        staging.write_text(json.dumps(chrome_trace(result)))
