"""Table I of the second paper (Sec. II-B) for recorded routes: placements and the shuffle planner fitted on one
part of the traces, every figure measured on the held-out part.

Per EP degree and placement (``contiguous``; ``correlated`` from Algorithm 1; ``given`` for a PLACEMENT.json):
``same_gpu``, ``gpus_per_token``, ``dedup_removed`` (means over MoE layers), ``local_stay`` and ``local_moved``
(next-layer experts local when the token stays on its home rank vs when it moves to the rank predicted from its
current experts, first-order table, ``T / P`` tokens per rank), ``planner_local`` and ``planner_ms`` (Algorithm 2
with second-order tables and back-off), and the rows and bytes of a plain vs a deduplicating dispatch summed over
layers (:func:`fcsd.placement.stats.dispatch_counts`).
"""

from __future__ import annotations

import time

import numpy as np

from fcsd.placement.format import Placement, PlacementError
from fcsd.placement.shuffle import evaluate_shuffle, home_ranks
from fcsd.placement.solver import check_sizes, contiguous_placement, correlated_placement
from fcsd.placement.stats import coselection_summary, dispatch_counts, transition_summary, within_layer
from fcsd.placement.traces import Routes

DEFAULT_EPS = (8, 16, 32)


def default_eps(num_experts: int) -> list[int]:
    """EP degrees reported when none are asked for: 8, 16, 32 where they divide ``E`` and leave 2+ experts a rank."""
    eps = [ep for ep in DEFAULT_EPS if num_experts % ep == 0 and num_experts // ep >= 2]
    return eps or [ep for ep in (2, 4) if num_experts % ep == 0][-1:]


def placement_rows(fit: Routes, held: Routes, placement: Placement, step_tokens: int, hidden_size: int) -> dict:
    """One Table I row: within-layer and across-layer figures of ``placement`` on ``held`` (tables fit on ``fit``)."""
    within = [within_layer(held.layer(layer), placement.ranks(layer)) for layer in held.layers]
    row = {key: float(np.mean([w[key] for w in within])) for key in within[0]}
    first = evaluate_shuffle(fit, held, placement, step_tokens, order=1)
    second = evaluate_shuffle(fit, held, placement, step_tokens, order=2)
    row.update(local_stay=first["local_stay"], local_moved=first["local_moved"])
    row.update(planner_local=second["local_moved"], planner_ms=second["planner_ms"], step_tokens=second["step_tokens"])
    totals = dict.fromkeys(
        ("rows_plain", "rows_dedup", "remote_plain", "remote_dedup", "bytes_plain", "bytes_dedup"), 0
    )
    for layer in held.layers:
        ids = held.layer(layer)
        step = min(step_tokens, ids.shape[0])
        source = home_ranks(step, placement.ep)[np.arange(ids.shape[0]) % step]
        counts = dispatch_counts(ids, placement.ranks(layer), source, hidden_size).to_dict()
        for key in totals:
            totals[key] += counts[key]
    row.update(totals)
    return row


def coupling_report(
    routes: Routes,
    eps: list[int] | None = None,
    nodes: int = 1,
    holdout: float = 0.2,
    placement: Placement | None = None,
    step_tokens: int = 4096,
    hidden_size: int | None = None,
) -> dict:
    """Co-selection and cross-layer summaries plus Table I rows per EP degree (see the module docstring)."""
    fit, held = routes.split(holdout)
    e = routes.num_experts
    eps = list(eps or default_eps(e))
    hidden = int(hidden_size or routes.header.get("hidden_size") or 0)
    for ep in eps:
        check_sizes(e, ep, nodes, 1)
    if placement is not None:
        if placement.num_experts != e:
            raise PlacementError(f"the placement is for {placement.num_experts} experts, the routes have {e}")
        missing = sorted(set(placement.layers) - set(routes.layers))
        if missing:
            raise PlacementError(f"the placement names layer(s) {missing} the routes do not hold ({routes.layers})")
        if placement.ep not in eps:
            eps.append(placement.ep)
    layers = routes.layers
    co = [coselection_summary(held.layer(layer), e) for layer in layers]
    cross = [transition_summary(held.layer(a), held.layer(b), e) for a, b in zip(layers, layers[1:])]
    report = {
        "routes": {key: routes.header.get(key) for key in ("model", "model_type", "num_experts", "top_k")},
        "tokens": {"fit": fit.num_tokens, "held_out": held.num_tokens, "layers": len(layers)},
        "coselection": {key: float(np.mean([c[key] for c in co])) for key in co[0]},
        "cross_layer": {key: float(np.mean([c[key] for c in cross])) for key in cross[0]} if cross else {},
        "ep": {},
    }
    for ep in eps:
        ep_nodes = nodes if ep > nodes else 1
        begin = time.perf_counter()
        correlated = correlated_placement(fit, ep, ep_nodes)
        solve = time.perf_counter() - begin
        rows = {
            "contiguous": placement_rows(fit, held, contiguous_placement(fit, ep), step_tokens, hidden),
            "correlated": {
                **placement_rows(fit, held, correlated, step_tokens, hidden),
                "solver_s": solve,
                "nodes": ep_nodes,
            },
        }
        if placement is not None and placement.ep == ep:
            rows["given"] = placement_rows(fit, held, placement, step_tokens, hidden)
        report["ep"][str(ep)] = rows
    return report


COLUMNS = (
    ("same_gpu", "same GPU", "%"),
    ("gpus_per_token", "GPUs", "f"),
    ("dedup_removed", "dedup", "%"),
    ("local_moved", "moved", "%"),
    ("local_stay", "stay", "%"),
    ("planner_local", "planner", "%"),
    ("planner_ms", "plan ms", "f"),
)


def format_report(report: dict) -> str:
    """Table I as text (values in %, GPUs a mean), with the co-selection and cross-layer summaries."""
    r, t, co = report["routes"], report["tokens"], report["coselection"]
    lines = [
        f"routes: {r['model']} ({r['model_type']}), {r['num_experts']} experts, top-{r['top_k']}, {t['layers']} MoE "
        f"layers; fit on {t['fit']} tokens, held out {t['held_out']}",
        f"within layer: the top 1% of expert pairs ({co['top_pairs']:.0f}) carry {100 * co['top_pairs_share']:.1f}% of "
        f"co-selections (independent routing with the same loads: {100 * co['independent_share']:.1f}%); "
        f"{co['experts_with_partner_30']:.1f} experts (mean over layers) have a partner in >= 30% of their tokens",
    ]
    if report["cross_layer"]:
        cl = report["cross_layer"]
        lines.append(
            f"across layers: median top successor P(e' at l+1 | e at l) = {100 * cl['median_top_successor']:.1f}%; "
            f"{cl['experts_with_successor_30']:.1f} experts send >= 30% of their tokens to one next-layer expert"
        )
    header = f"{'EP':>4} {'placement':<11}" + "".join(f"{title:>10}" for _, title, _ in COLUMNS)
    header += f"{'rows plain':>12}{'rows dedup':>12}"
    lines += ["", header]
    for ep, rows in report["ep"].items():
        for name, row in rows.items():
            cells = "".join(
                f"{100 * row[key]:>10.1f}" if kind == "%" else f"{row[key]:>10.2f}" for key, _, kind in COLUMNS
            )
            lines.append(f"{ep:>4} {name:<11}{cells}{row['rows_plain']:>12,}{row['rows_dedup']:>12,}")
    return "\n".join(lines)
