"""Correlated placement (Algorithm 1) on a DeepSeek-V3-sized problem: 256 experts, 58 MoE layers, EP 64 on 8 nodes,
routes of 1M tokens, top-8. Times routes -> PLACEMENT (co-selection counts + hierarchical best-swap search) against
the contiguous placement it starts from, and prints what it buys on the same routes.

    python benchmarks/placement_solver.py                       # the full problem (about 1 GB of routes in memory)
    python benchmarks/placement_solver.py --tokens 100000 --layers 8   # a quick look
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from fcsd.placement.solver import contiguous_placement, correlated_placement
from fcsd.placement.stats import within_layer
from fcsd.placement.synthetic_routes import planted_routes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--layers", type=int, default=58)
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--ep", type=int, default=64)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--cluster-size", type=int, default=16, help="planted co-selection clusters (experts)")
    parser.add_argument("--pair-rate", type=float, default=0.6, help="share of tokens routed inside one cluster")
    args = parser.parse_args()

    begin = time.perf_counter()
    routes, _ = planted_routes(
        args.experts, args.top_k, args.layers, args.tokens, args.cluster_size, args.pair_rate, 0.7, seq_len=4096
    )
    print(
        f"routes: {args.layers} layers x {args.tokens:,} tokens x top-{args.top_k}, {args.experts} experts "
        f"({routes.ids.nbytes / 2**20:.0f} MiB, generated in {time.perf_counter() - begin:.1f} s)"
    )

    begin = time.perf_counter()
    contiguous = contiguous_placement(routes, args.ep, args.nodes)
    t_contiguous = time.perf_counter() - begin
    begin = time.perf_counter()
    correlated = correlated_placement(routes, args.ep, args.nodes)
    t_correlated = time.perf_counter() - begin
    print(f"contiguous placement: {t_contiguous:.3f} s")
    print(
        f"correlated placement: {t_correlated:.1f} s  (EP {args.ep} on {args.nodes} nodes, "
        f"{t_correlated / args.layers:.2f} s per layer)"
    )

    sample = routes.layers[:: max(1, args.layers // 8)]
    for name, placement in (("contiguous", contiguous), ("correlated", correlated)):
        rows = [within_layer(routes.layer(layer), placement.ranks(layer)) for layer in sample]
        nodes = [
            within_layer(routes.layer(layer), placement.ranks(layer) // (args.ep // args.nodes)) for layer in sample
        ]
        print(
            f"{name:>11}: GPUs per token {np.mean([r['gpus_per_token'] for r in rows]):.2f}, rows removed by "
            f"deduplication {100 * np.mean([r['dedup_removed'] for r in rows]):.1f}%, nodes per token "
            f"{np.mean([r['gpus_per_token'] for r in nodes]):.2f} (layers {sample[0]}..{sample[-1]})"
        )
    ratio = np.mean([within_layer(routes.layer(layer), contiguous.ranks(layer))["gpus_per_token"] for layer in sample])
    ratio /= np.mean([within_layer(routes.layer(layer), correlated.ranks(layer))["gpus_per_token"] for layer in sample])
    print(f"ratio contiguous / correlated rows sent by a deduplicating dispatcher: {ratio:.2f}x")


if __name__ == "__main__":
    main()
