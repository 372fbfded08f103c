"""Overlap over a modelled link, regular against FarSkip overlapped, next to the paper's figures (paper Sec. 4.1,
4.2, Table 4, Sec. 5.2): drives ``fcsd bench overlap --link`` for several configs and link speeds.

    python benchmarks/overlap_link.py [--configs tiny,mid,dsv3] [--links 1GB/s,100MB/s] [--ranks 2] [--iters 3]
        [--json FILE]

Per config, link and phase (training forward / backward over all-to-all, inference prefill over all-reduce): the
share of the link time hidden by the overlapped schedule and by the regular one (both measured the same way: link
time that ran while the rank computed), the structural limit (what the schedule's windows allow), the schedule
efficiency and the exposed remainder by cause (per rank and step); the paper's overlap for the same phase beside it.
Step times under the link are in the JSON (``--json``) but not in the table: on a shared CPU they are dominated by
the real gloo collectives' waits, not by the modelled link. Definitions: fcsd/bench/hidden_share.py. Results are
recorded in BENCHMARKS.md.
"""

import argparse
import json

from fcsd.bench.overlap import run_overlap_benchmark

#: paper Table 4 (all-to-all % overlap, Megatron-LM training, EP8, MI325X) and Sec. 5.2 (all-reduce overlap, vLLM
#: prefill, 8x MI300X)
PAPER = {
    "forward": "87.6 (DS-V2 Lite), 92.9 (DS-V3 L=6)",
    "backward": "89.0 (DS-V2 Lite), 84.1 (DS-V3 L=6)",
    "prefill": "95.3 (Llama-4 Scout) - 97.6 (DS-V2)",
}
LAYOUT_OF = {"forward": "all_to_all", "backward": "all_to_all", "prefill": "all_reduce"}


def rows(result: dict, config: str, link: str) -> list[str]:
    out = []
    for phase, layout in LAYOUT_OF.items():
        data = result["layouts"][layout]
        overlap, regular = data["modes"]["farskip_overlap"], data["modes"]["regular"]
        total = overlap["phases"][phase]["total"]
        causes = total["exposed_ms"]
        exposed = ", ".join(f"{cause} {ms:.2f}" for cause, ms in causes.items() if ms >= 0.005) or "-"
        out.append(
            f"| {config} | {link} | {phase} | {100 * regular['phases'][phase]['total']['hidden_share']:.1f} | "
            f"**{100 * total['hidden_share']:.1f}** | {100 * total['structural_limit']:.1f} | "
            f"{total['efficiency']:.2f} | {total['link_ms']:.2f} | {exposed} | {PAPER[phase]} |"
        )
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="tiny,mid,dsv3")
    parser.add_argument("--links", default="1GB/s,100MB/s")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write every result to this file")
    args = parser.parse_args()
    header = (
        "| config | link | phase | regular: hidden % | FarSkip: hidden % | structural limit % | efficiency | "
        "link ms/step | exposed ms by cause | paper, FarSkip hidden % |"
    )
    lines, results = [header, "|---" * 10 + "|"], {}
    for config in args.configs.split(","):
        for link in args.links.split(","):
            result = run_overlap_benchmark(args.ranks, config, iters=args.iters, link=link)
            results[f"{config} @ {link}"] = result
            lines += rows(result, config, link)
            print("\n".join(lines[-3:]), flush=True)
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
