"""`fcsd plan --measure` for the paper models' chosen layouts: the estimate against 4 real gloo processes.

For each model and the layout its plan chooses (or, where none fits, the closest expert-parallel one), the run is
cut down as ``--measure`` cuts it (:func:`fcsd.plan.self_check.reduced`: hidden 256, 8 experts, at most 4 layers of the
same kinds, 128-token sequences, 4 processes laid out as the candidate: EP x FSDP2 as EP 2 x FSDP 2, FSDP2 alone
over 4), estimated from the config alone (fake tensors over a fake process group, ``target="cpu"``) and measured
for real on 4 gloo processes (:func:`fcsd.plan.measure.measure_jobs`: the tensors alive before the second step plus
the CPU allocator's events during it, balanced routing). Prints the estimated peak, every process's measured peak
and their ratios, and whether the weights and AdamW bytes are exact.

    python benchmarks/plan_measure.py [--json]

Results are recorded in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import time

from fcsd.plan.run import Layout

LAYOUTS = [  # (model, GPU, nodes, layout): what the plans of docs/planning.md choose (Qwen3: its fastest EP one)
    ("deepseek_v2_lite", "h100", 1, Layout("ep_fsdp", 8, 8, "online", 2, True)),
    ("deepseek_v2_lite", "h100", 1, Layout("fsdp2", 8, 1, "online", 2, True)),
    ("llama4_scout", "h200", 2, Layout("ep_fsdp", 16, 8, "online", 1, True)),
    ("qwen3_30b_a3b", "h100", 1, Layout("ep_fsdp", 8, 8, "online", 2, True, offload=True)),
    ("deepseek-v3", "h200", 16, Layout("ep_fsdp", 128, 8, "online", 1, True, offload=True)),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from fcsd.plan.cluster import make_cluster
    from fcsd.plan.measure import measure_jobs
    from fcsd.plan.model_configs import load_model_config
    from fcsd.plan.planner import run_config
    from fcsd.plan.self_check import reduced
    from fcsd.plan.simulate import estimate_step

    jobs, names = [], []
    for model, gpu, nodes, layout in LAYOUTS:
        source = load_model_config(model)
        config, _, _ = run_config(source, [], 2e9, make_cluster(gpu, 8, nodes))
        jobs.append(reduced(source.config, config, layout))
        names.append(f"{model}: {layout.short} on {nodes} x 8 {gpu}")
    estimates = [estimate_step(*job, "cpu") for job in jobs]
    start = time.perf_counter()
    measured = measure_jobs(jobs)
    rows = []
    for name, job, estimate, ranks in zip(names, jobs, estimates, measured, strict=True):
        rows.append(
            {
                "plan": name,
                "reduced": job[2].short,
                "estimated_mib": estimate.peak / 2**20,
                "measured_mib": [m.peak / 2**20 for m in ranks],
                "ratios": [estimate.peak / m.peak for m in ranks],
                "weights_adamw_exact": estimate.weights == ranks[0].weights
                and estimate.optimizer == ranks[0].optimizer,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| plan's layout | reduced, 4 gloo processes | estimated MiB | measured MiB (ranks 0-3) | ratio | exact |")
    print("|---|---|---:|---|---|---|")
    for r in rows:
        measured_text = " / ".join(f"{m:.1f}" for m in r["measured_mib"])
        ratios = f"{min(r['ratios']):.3f} - {max(r['ratios']):.3f}"
        exact = "exact" if r["weights_adamw_exact"] else "DIFFERENT"
        print(f"| {r['plan']} | {r['reduced']} | {r['estimated_mib']:.1f} | {measured_text} | {ratios} | {exact} |")
    print(f"(measured in {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
