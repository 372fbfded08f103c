"""Expert-parallel overlap benchmark (paper Sec. 4, Appendix C): drives ``fcsd bench overlap``.

    python benchmarks/ep_overlap.py --config mid --ranks 2 [--iters 5] [--dispatcher plain|dedup] [--json]
        [--device auto|cuda|cpu] [--backend auto|nccl|gloo] [--dtype auto|float32|bfloat16]

Figures and their definitions: fcsd/bench/overlap.py. Results are recorded in BENCHMARKS.md.
"""

import argparse
import json

from fcsd.bench.overlap import format_table, run_overlap_benchmark

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", choices=["tiny", "mid", "dsv3"], default="mid")
    parser.add_argument("--model", default=None)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--trace", default=None)
    parser.add_argument("--dispatcher", choices=["plain", "dedup"], default="plain")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    args = parser.parse_args()
    options = dict(device=args.device, backend=args.backend, dtype=args.dtype)
    result = run_overlap_benchmark(
        args.ranks, args.config, args.model, args.iters, args.trace, args.dispatcher, **options
    )
    print(json.dumps(result, indent=2) if args.json else format_table(result))
