"""``fcsd perfmodel`` and ``fcsd bench``: the analytic speedups (paper Appendix B), the overlap measured or run over a
modelled link, a cluster measured for the plan (design §4)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def add_parsers(sub) -> None:
    p = sub.add_parser("perfmodel", help="analytical prefill / training model of FarSkip speedups (Appendix B)")
    p.add_argument("--model", help="hub id or local folder of a supported MoE model (reads config.json only)")
    p.add_argument("--preset", help="embedded config: deepseek-v3")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel ranks for attention / shared experts")
    p.add_argument("--ep", type=int, default=8, help="expert-parallel ranks for routed experts")
    p.add_argument("--batch", type=int, default=32, help="prefill sequences")
    p.add_argument("--context", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--train-batch", type=int, default=4, help="training sequences per GPU (Sec. 4.1 estimate)")
    sparsity_help = "sparsity factors, routed experts / active routed (default: the model's own and 3 doublings)"
    p.add_argument("--sparsity", help=sparsity_help)
    p.add_argument(
        "--scenario",
        help="comma list of baseline, 2x_compute, 2x_attention, 2x_comm, 2x_compute_2x_comm (default: all)",
    )
    p.add_argument("--attn-tflops", type=float, default=500.0, help="core-attention throughput (default 500)")
    p.add_argument("--gemm-tflops", type=float, default=600.0, help="GEMM throughput (default 600)")
    p.add_argument("--allreduce-gbps", type=float, default=400.0, help="all-reduce bus bandwidth, GB/s")
    p.add_argument("--alltoall-gbps", type=float, default=300.0, help="all-to-all bus bandwidth, GB/s")
    p.add_argument("--json", action="store_true", help='print {"rows": [...], "training": {...}}')
    p.add_argument("--plot", help="write the speedup-vs-sparsity PNG here")
    p.set_defaults(func=_perfmodel)

    bench_help = (
        "benchmarks: 'overlap' times expert-parallel collectives and their overlap; 'cluster' measures what fcsd "
        "plan assumes (GEMM rate, collective bandwidths, host link) and writes a cluster file (--out; under torchrun)"
    )
    p = sub.add_parser("bench", help=bench_help)
    p.add_argument("what", choices=["overlap", "cluster"])
    model_help = "overlap: a saved MoE causal LM folder (default: --config); cluster: a preset, config.json or demo"
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--out", default=None, metavar="FILE", help="cluster: the cluster file to write (JSON)")
    p.add_argument("--tokens", type=int, default=None, help="cluster: GEMM rows per micro-batch (4096 GPU, 512 CPU)")
    p.add_argument("--quick", action="store_true", help="cluster: shorter timings (tests; noisier)")
    config_help = "built-in shapes: tiny, mid (Qwen3-MoE, 8 experts), dsv3 (DeepSeek-V3's layers, narrower)"
    p.add_argument("--config", choices=["tiny", "mid", "dsv3"], default="tiny", help=config_help)
    ranks_help = "local processes, one device each (the expert-parallel group size; must divide the expert count)"
    p.add_argument("--ranks", type=int, default=2, help=ranks_help)
    p.add_argument("--iters", type=int, default=5, help="timed iterations per measurement (median reported)")
    dispatcher_help = "all-to-all dispatcher (hierarchical: node-aware, with --node-size)"
    p.add_argument("--dispatcher", choices=["plain", "dedup", "hierarchical"], default="plain", help=dispatcher_help)
    p.add_argument("--node-size", type=int, default=None, help="ranks per stand-in node (default: all on one node)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--trace", default=None, help="write torch.profiler traces to this folder")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: a GPU per rank if any")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto", help="auto: NCCL with a GPU per rank")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="auto: bf16 on GPU")
    link_help = (
        "run over a modelled link: BANDWIDTH[,LATENCY] (e.g. 25GB/s,10us) or a preset (xgmi, nvlink, eth400: scaled "
        "to this CPU's speed); prints hidden share, structural limit and schedule efficiency per collective"
    )
    p.add_argument("--link", default=None, help=link_help)
    timeline_help = "with --link: one step per rank, regular vs overlapped, drawn to FILE.png (+ FILE.trace.json)"
    p.add_argument("--timeline", default=None, metavar="FILE.png", help=timeline_help)
    p.set_defaults(func=_bench)


def _perfmodel(args) -> int:
    from fcsd.plan import perfmodel as pm

    if (args.model is None) == (args.preset is None):
        raise ValueError("pass exactly one of --model HUB_ID_OR_PATH and --preset (e.g. --preset deepseek-v3)")
    for name in ("tp", "ep", "batch", "context", "train_batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: it must be at least 1")
    hw = pm.Hardware(args.attn_tflops, args.gemm_tflops, args.allreduce_gbps, args.alltoall_gbps)  # checks them
    if args.plot:
        from fcsd.files import ownership

        inputs = {"model": args.model}
        args.plot = ownership.check_output_file(Path(args.plot), "--plot", "perfmodel plot", pm.is_own_plot, inputs)
    config = pm.load_config(args.model, args.preset)
    pm.model_shape(config)  # a dense or unsupported model is refused here, before the sparsity sweep
    sparsities = _sparsities(args.sparsity) if args.sparsity else pm.default_sparsities(config)
    scenarios = args.scenario.split(",") if args.scenario else list(pm.SCENARIOS)
    rows = pm.sweep(config, sparsities, scenarios, args.batch, args.context, args.tp, args.ep, hw)
    training = pm.training_moe_layer(pm.model_shape(config), args.train_batch, args.context, args.ep, hw)
    if args.json:
        print(json.dumps({"rows": [r.to_dict() for r in rows], "training": training.to_dict()}, indent=2))
    else:
        print(pm.format_report(rows, training, args.batch, args.context, args.tp, args.ep, hw))
    if args.plot:
        pm.plot_sweep(rows, args.plot, f"FarSkip prefill speedup: {args.model or args.preset}")
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _sparsities(text: str) -> list[int]:
    """``--sparsity 4,8,16``: whole numbers of at least 1 (routed experts per active routed expert)."""
    values = [part.strip() for part in text.split(",")]
    if not all(v.isdigit() and int(v) >= 1 for v in values):
        raise ValueError(
            f"--sparsity {text}: give sparsity factors (routed experts / active routed experts) as whole numbers of at "
            "least 1, e.g. --sparsity 4,8,16"
        )
    return [int(v) for v in values]


def _bench(args) -> int:
    if args.what == "cluster":
        return _bench_cluster(args)
    from fcsd.bench import picture
    from fcsd.bench.overlap import format_result, run_overlap_benchmark
    from fcsd.files import ownership

    if args.iters < 1:
        raise ValueError(f"--iters {args.iters}: it must be at least 1 timed iteration")
    if args.trace:
        args.trace = str(ownership.check_output_folder(args.trace, "trace", "--trace", {"model": args.model}))
    if args.timeline:
        png, chrome = picture.output_paths(args.timeline)
        ownership.check_output_file(png, "--timeline", "timeline picture", picture.is_own_png, {"model": args.model})
        ownership.check_output_file(chrome, "--timeline", "timeline trace", picture.is_own_trace, {"model": args.model})
    options = dict(device=args.device, backend=args.backend, dtype=args.dtype)
    options.update(link=args.link, timeline=bool(args.timeline), node_size=args.node_size)
    result = run_overlap_benchmark(
        args.ranks, args.config, args.model, args.iters, args.trace, args.dispatcher, **options
    )
    if args.trace:  # every entry there now is a trace this run (or an earlier one) wrote
        ownership.mark(args.trace, "trace", [p.name for p in Path(args.trace).iterdir() if p.name != ownership.MARKER])
    if args.timeline:
        picture.write_timeline(result, png, chrome)
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    if args.timeline:  # with --json, stdout holds the JSON alone
        print(f"timeline: {png} (Chrome trace: {chrome})", file=sys.stderr if args.json else sys.stdout)
    return 0


def _bench_cluster(args) -> int:
    """``fcsd bench cluster``: every rank of this job (torchrun, or this one process) measures; rank 0 writes
    ``--out`` and prints the figures (:mod:`fcsd.plan.calibrate`)."""
    from fcsd.plan.calibrate import check_model, format_cluster, run_cluster_benchmark

    if not args.out:
        raise ValueError("fcsd bench cluster writes a cluster file: give --out FILE, e.g. --out cluster.json")
    from fcsd.files import ownership
    from fcsd.plan.cluster import is_cluster_file

    # only a cluster file fcsd wrote is replaced (a folder, a config.json or any other file is refused first)
    ownership.check_output_file(args.out, "--out", "cluster file", is_cluster_file, {"model": args.model})
    if args.tokens is not None and args.tokens < 1:
        raise ValueError(f"--tokens {args.tokens}: give the GEMM rows of a micro-batch, at least 1, e.g. 4096")
    check_model(args.model or "demo")  # a dense or unknown model is refused before any rank measures
    data = run_cluster_benchmark(args.model or "demo", args.out, args.tokens, args.quick)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(data, indent=2) if args.json else format_cluster(data))
        if not args.json:
            print(f"cluster file: {args.out} (fcsd plan MODEL --cluster {args.out})")
    return 0
