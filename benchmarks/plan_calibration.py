"""The planner's time model, calibrated and checked: `fcsd bench cluster` on 4 gloo processes, then `fcsd plan MODEL
--cluster FILE --measure --json`, which runs every layout the plan timed reduced (hidden 256, 8 experts, at most 4
layers, 128-token sequences) on 4 gloo processes and sets each measured step beside its calibrated prediction.

    python benchmarks/plan_calibration.py [--model demo] [--rounds 1] [--json] [overrides ...]

Each round calibrates and then measures at once (the figures of a shared CPU drift with the other work on it):
printed per layout are the measured step (the fastest of 3 unprofiled steps, slowest process), the prediction
(the planner's time model at the measured GEMM rate and bandwidths, plus the per-op dispatch, elementwise bytes and
collective latencies it leaves out, from the microbenchmarks) and their ratio, predicted over measured. Every
process runs one thread (OMP_NUM_THREADS=1). Results are recorded in BENCHMARKS.md.
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

PROCESSES = 4


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def calibrate(model: str, out: Path, env: dict) -> dict:
    """`fcsd bench cluster` under torchrun on :data:`PROCESSES` local gloo processes; the cluster file it wrote."""
    from fcsd.plan.cluster import read_cluster_file

    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={PROCESSES}"]
    command += [f"--master_port={free_port()}", "-m", "fcsd.cli", "bench", "cluster", "--model", model]
    command += ["--out", str(out)]
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return read_cluster_file(out)


def measure(model: str, cluster: Path, overrides: list[str], env: dict) -> dict:
    """`fcsd plan MODEL --cluster FILE --measure --json`: the plan's report."""
    command = [sys.executable, "-m", "fcsd.cli", "plan", model, *overrides, "--cluster", str(cluster)]
    done = subprocess.run([*command, "--measure", "--json"], env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def rows_of(report: dict, round_: int) -> list[dict]:
    rows = []
    for entry in report["measure"]["layouts"]:
        m = entry["measured"]
        prediction = m["prediction"]
        parts = {**prediction["time_model"], **prediction.get("beyond_time_model", {})}
        rows.append(
            {
                "round": round_,
                "layout": entry["short"],
                "measured_s": m["step_seconds"],
                "predicted_s": m["estimated_step_seconds"],
                "ratio": m["ratio"],
                "parts_s": {k: v for k, v in parts.items() if k.endswith("_s")},
                "notes": m.get("notes", []),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="a preset, config folder or demo (default demo)")
    parser.add_argument("--rounds", type=int, default=1, help="calibrate-then-measure rounds (default 1)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("overrides", nargs="*", help="fcsd convert overrides for the plan")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    rows, files = [], []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(1, args.rounds + 1):
            path = Path(folder) / f"cluster{round_}.json"
            files.append(calibrate(args.model, path, env))
            rows += rows_of(measure(args.model, path, args.overrides, env), round_)
    if args.json:
        print(json.dumps({"clusters": files, "layouts": rows}, indent=2))
        return
    for round_, data in enumerate(files, 1):
        latency = {k: v.get(str(PROCESSES)) for k, v in data["latency_us"].items()}
        print(
            f"round {round_}: GEMM {data['tflops'] * 1e3:.1f} GFLOP/s (reduced shapes {data['reduced_tflops']}), "
            f"all-gather/reduce-scatter {data['intra_gbps']:.3f} GB/s, all-to-all {data['alltoall_intra_gbps']:.3f} "
            f"GB/s, overlap {data.get('overlap', 1.0):.2f}, {data['op_us']:.1f} us per op, elementwise "
            f"{data['memory_gbps']:.1f} GB/s, latency over "
            f"{PROCESSES} (us) {json.dumps({k: round(v) for k, v in latency.items() if v})}"
        )
    print("| round | reduced layout, 4 gloo processes | measured ms | predicted ms | predicted / measured | parts ms |")
    print("|---|---|---:|---:|---:|---|")
    for r in rows:
        parts = ", ".join(f"{k[:-2]} {v * 1e3:.0f}" for k, v in r["parts_s"].items())
        print(
            f"| {r['round']} | {r['layout']} | {r['measured_s'] * 1e3:.0f} | {r['predicted_s'] * 1e3:.0f} | "
            f"{r['ratio']:.2f} | {parts} |"
        )
    inside = [r for r in rows if 0.75 <= r["ratio"] <= 1.25]
    print(f"within 25%: {len(inside)} of {len(rows)} (predicted / measured in [0.75, 1.25])")
    for note in dict.fromkeys(n for r in rows for n in r["notes"]):
        print(f"note: {note}")
    print(f"(calibrated and measured in {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
