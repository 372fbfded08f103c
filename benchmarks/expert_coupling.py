"""Table I on recorded routes: contiguous vs correlated placement at EP 4/8/16, plain vs deduplicating dispatch
(rows and bytes), next-layer locality when tokens stay vs move, and the token-shuffle planner's local share and
runtime. Placements and planner tables are fitted on 80% of the sequences and measured on the held-out 20%.

    fcsd routes record demo --tokens 131072 --out outputs/routes/demo.safetensors
    python benchmarks/expert_coupling.py outputs/routes/demo.safetensors --ep 4,8,16
"""

from __future__ import annotations

import argparse

from fcsd.placement.coupling_table import coupling_report, format_report
from fcsd.placement.traces import load_routes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("routes", help="a routes file of `fcsd routes record`")
    parser.add_argument("--ep", default="4,8,16")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--holdout", type=float, default=0.2)
    parser.add_argument("--step-tokens", type=int, default=4096, help="tokens per step (sequence-parallel group)")
    parser.add_argument("--elem-bytes", type=int, default=2, help="bytes per hidden value on the wire (bf16: 2)")
    args = parser.parse_args()

    routes = load_routes(args.routes)
    eps = [int(x) for x in args.ep.split(",")]
    report = coupling_report(routes, eps, args.nodes, args.holdout, step_tokens=args.step_tokens)
    print(format_report(report))
    print()
    print(
        "| EP | placement | same GPU | GPUs/token | dedup removed | rows plain | rows dedup | MB plain | MB dedup "
        "| remote rows plain | remote rows dedup | local stay | local moved | planner local | 1/P | planner ms/step |"
    )
    print("|---" * 16 + "|")
    for ep, rows in report["ep"].items():
        for name, r in rows.items():
            print(
                f"| {ep} | {name} | {100 * r['same_gpu']:.1f}% | {r['gpus_per_token']:.2f} | "
                f"{100 * r['dedup_removed']:.1f}% | {r['rows_plain']:,} | {r['rows_dedup']:,} | "
                f"{r['bytes_plain'] / 1e6:.2f} | {r['bytes_dedup'] / 1e6:.2f} | {r['remote_plain']:,} | "
                f"{r['remote_dedup']:,} | {100 * r['local_stay']:.1f}% | {100 * r['local_moved']:.1f}% | "
                f"{100 * r['planner_local']:.1f}% | {100 / int(ep):.1f}% | {r['planner_ms']:.2f} |"
            )


if __name__ == "__main__":
    main()
