"""Rows and bytes sent by the real plain vs deduplicating dispatchers (fcsd.parallel) on gloo ranks, replaying
recorded routes under contiguous and correlated placement (second paper, Sec. V-A, Table I layout), checked against
the offline definition (fcsd.placement.stats.dispatch_counts).

    python benchmarks/dedup_dispatch.py outputs/routes/demo.safetensors --ep 4,8,16 [--step-tokens 4096]

For each EP degree P it launches P CPU gloo processes (torchrun). The correlated placement is fitted on the first
80% of the sequences; one step of ``--step-tokens`` held-out tokens is split over the ranks in contiguous slices
(plain sequence parallelism), and every MoE layer's routes go through both dispatchers (dispatch + combine, identity
experts). Reported: remote rows and bytes of the dispatch summed over ranks and layers, the offline figures for the
same tokens, and the seconds per layer on CPU gloo (indicative only: processes share the CPU, no network).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    from fcsd.parallel.dispatchers import AllToAllDispatcher, DedupAllToAllDispatcher
    from fcsd.placement.shuffle import home_ranks
    from fcsd.placement.solver import contiguous_placement, correlated_placement
    from fcsd.placement.stats import dispatch_counts
    from fcsd.placement.traces import load_routes

    dist.init_process_group("gloo")
    rank, ep = dist.get_rank(), dist.get_world_size()
    routes = load_routes(args.routes)
    fit, held = routes.split(args.holdout)
    hidden = args.hidden or int(routes.header.get("hidden_size") or 64)
    step = min(args.step_tokens, held.num_tokens)
    source = home_ranks(step, ep)
    mine = np.flatnonzero(source == rank)
    local = routes.num_experts // ep
    placements = [None]
    if rank == 0:  # one solver run, broadcast (every rank must use the same placement)
        placements = [{"contiguous": contiguous_placement(routes, ep), "correlated": correlated_placement(fit, ep)}]
    dist.broadcast_object_list(placements, src=0)
    dtype = getattr(torch, args.dtype)
    x = torch.randn(mine.size, hidden).to(dtype)
    out = {}
    for name, placement in placements[0].items():
        row = {}
        for kind, cls in (("plain", AllToAllDispatcher), ("dedup", DedupAllToAllDispatcher)):
            dispatcher = cls(num_local_experts=local, blocking=False)
            seconds = 0.0
            for layer in held.layers:
                slot_of = np.argsort(placement.order(layer))  # expert id -> slot realising the placement
                ids = torch.as_tensor(slot_of[held.layer(layer)[:step][mine]], dtype=torch.int64)
                weights = torch.rand(ids.shape)
                dist.barrier()
                start = time.perf_counter()
                pending = dispatcher.dispatch_async(x, ids, weights)
                rows = pending.wait()
                dispatcher.combine_async(rows.tokens * rows.weights, pending).wait()
                seconds += time.perf_counter() - start
            totals = torch.tensor([dispatcher.dispatch_rows_sent, dispatcher.dispatch_bytes_sent], dtype=torch.float64)
            dist.all_reduce(totals)
            row[kind] = {"rows": int(totals[0]), "bytes": int(totals[1]), "s_per_layer": seconds / len(held.layers)}
        offline = {"rows_plain": 0, "rows_dedup": 0, "bytes_dedup": 0, "assignments": 0}
        elem = torch.empty((), dtype=dtype).element_size()
        for layer in held.layers:
            counts = dispatch_counts(held.layer(layer)[:step], placement.ranks(layer), source, hidden, elem_bytes=elem)
            offline["rows_plain"] += counts.remote_plain
            offline["rows_dedup"] += counts.remote_dedup
            offline["bytes_dedup"] += counts.remote_bytes_dedup
            offline["assignments"] += counts.assignments
        row["offline"] = offline
        out[name] = row
    if rank == 0:
        Path(args.json_out).write_text(json.dumps(out))
    dist.destroy_process_group()


def _launch(args, ep: int) -> dict:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ep}", f"--master_port={port}"]
        command += [__file__, args.routes, "--worker", "--json-out", str(out), "--step-tokens", str(args.step_tokens)]
        command += ["--holdout", str(args.holdout), "--hidden", str(args.hidden), "--dtype", args.dtype]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, env=env)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("routes")
    parser.add_argument("--ep", default="4,8,16")
    parser.add_argument("--step-tokens", type=int, default=4096)
    parser.add_argument("--holdout", type=float, default=0.2)
    parser.add_argument("--hidden", type=int, default=0, help="hidden size on the wire (default: the model's)")
    parser.add_argument("--dtype", default="float32", help="hidden dtype on the wire (gloo: float32 or bfloat16)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    results = {ep: _launch(args, int(ep)) for ep in args.ep.split(",")}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    print(
        "| EP | placement | remote rows plain | remote rows dedup | removed | MB plain | MB dedup | offline rows "
        "plain / dedup | offline MB dedup | s/layer plain | s/layer dedup |"
    )
    print("|---" * 11 + "|")
    for ep, rows in results.items():
        for name, r in rows.items():
            p, d, o = r["plain"], r["dedup"], r["offline"]
            print(
                f"| {ep} | {name} | {p['rows']:,} | {d['rows']:,} | {100 * (1 - d['rows'] / max(p['rows'], 1)):.1f}% "
                f"| {p['bytes'] / 1e6:.3f} | {d['bytes'] / 1e6:.3f} | {o['rows_plain']:,} / {o['rows_dedup']:,} | "
                f"{o['bytes_dedup'] / 1e6:.3f} | {p['s_per_layer']:.4f} | {d['s_per_layer']:.4f} |"
            )


if __name__ == "__main__":
    main()
