"""``fcsd plan``'s arguments and output (the CLI stays thin: the plan is :func:`fcsd.plan.planner.make_plan`)."""

from __future__ import annotations

import json
from pathlib import Path

from fcsd.plan.cluster import GPUS, positive_number

MAX_TOKENS = 1e14  # a conversion budget beyond any corpus: a typo (1e30), answered before planning


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="what fits on a cluster, how long it takes and which layers to convert (config only)",
        description="Plan FCSD for MODEL (hub id, folder, preset or demo; its config only, weights with --probe): "
        "per-GPU memory of each way to run it (one training step simulated on fake tensors), hours and GPU-hours, "
        "a layer table with predicted speedups, and the commands to run.",
    )
    p.add_argument("model", help="hub id, local folder, preset (qwen3_30b_a3b, deepseek-v3, ...) or 'demo'")
    p.add_argument(
        "overrides", nargs="*", help="fcsd convert overrides, e.g. train.batch_tokens=131072 data.seq_len=2048"
    )
    p.add_argument("--gpu", help=f"GPU preset: {', '.join(GPUS)} (default h100)")
    p.add_argument(
        "--cluster",
        metavar="FILE",
        help="a cluster file of `fcsd bench cluster` (measured memory, GEMM rate, bandwidths) instead of a preset; "
        "the options below, when given, override its figures",
    )
    p.add_argument(
        "--gpu-memory",
        help="memory per GPU as the driver reports it, e.g. 79.6GiB or 141GiB (GB = 10^9 bytes: an H100's "
        "'80 GB' is 79.6 GiB; default: the preset's)",
    )
    p.add_argument("--gpu-tflops", type=float, help="peak dense bf16 TFLOP/s per GPU (default: the preset's)")
    p.add_argument("--intra-gbps", type=float, help="bus bandwidth inside a node, GB/s (default: the preset's)")
    p.add_argument("--inter-gbps", type=float, help="bus bandwidth between nodes per GPU, GB/s")
    p.add_argument(
        "--host-gbps", type=float, help="GPU-host copy bandwidth per GPU and direction, GB/s (checkpoint offload; 25)"
    )
    p.add_argument("--host-memory", help="host memory of a node, e.g. 2TiB (default); a plan pins at most half")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (8; with --cluster: the file's)")
    p.add_argument("--nodes", type=int, help="nodes (1; with --cluster: the file's)")
    p.add_argument("--mfu", type=float, help="share of peak FLOP/s a training step reaches (0.3)")
    p.add_argument("--margin", type=float, default=0.1, help="share of GPU memory kept free (0.1)")
    p.add_argument("--tokens", type=float, help="training tokens (default: the recipe's train.max_tokens, 10B)")
    p.add_argument("--layers", nargs="+", help="layer specs to compare (default: last:25%% last:50%% last:75%% all)")
    p.add_argument("--probe", metavar="DATA", help="held-out data: measure each spec's KL without training")
    p.add_argument("--max-kl", type=float, help="with --probe: the largest acceptable KL (default: a quarter of all's)")
    p.add_argument(
        "--measure",
        action="store_true",
        help="run real steps of the plan at reduced size here (with --cluster: every timed layout, each beside its "
        "calibrated step time)",
    )
    p.add_argument(
        "--serve-context",
        type=int,
        metavar="TOKENS",
        help="tokens per sequence the serving check holds a KV cache for, passed to vLLM as --max-model-len "
        "(default 32768, or the model's maximum when smaller)",
    )
    p.add_argument(
        "--serve-sequences", type=int, default=1, metavar="N", help="sequences of that context served at once (1)"
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run_plan)


def _looks_like_a_file(data: str) -> bool:
    """A local path rather than a ``datasets`` hub name (which ``--probe`` also takes)."""
    from fcsd.sources import looks_local

    return Path(data).suffix in (".jsonl", ".json", ".parquet", ".txt", ".csv") or looks_local(data)


def plan_cluster(args):
    """The plan's :class:`~fcsd.plan.cluster.Cluster`: a preset with the options' changes, or the measured one of
    ``--cluster FILE`` with the options given beside it overriding the file (a preset, a peak rate or an MFU are
    refused there: the file's measured GEMM rate replaces peak x mfu)."""
    from fcsd.plan.cluster import load_cluster_file, make_cluster

    if args.cluster is None:
        return make_cluster(
            args.gpu or "h100",
            8 if args.gpus_per_node is None else args.gpus_per_node,
            1 if args.nodes is None else args.nodes,
            args.gpu_memory,
            args.gpu_tflops,
            args.intra_gbps,
            args.inter_gbps,
            0.3 if args.mfu is None else args.mfu,
            args.margin,
            args.host_gbps,
            args.host_memory,
        )
    for option, value in (("--gpu", args.gpu), ("--gpu-tflops", args.gpu_tflops), ("--mfu", args.mfu)):
        if value is not None:
            raise ValueError(
                f"{option} {value} with --cluster {args.cluster}: the file's measured GEMM rate replaces the preset's "
                f"peak x mfu; leave {option} out (or plan without --cluster)"
            )
    return load_cluster_file(
        args.cluster,
        args.margin,
        gpus_per_node=args.gpus_per_node,
        nodes=args.nodes,
        gpu_memory=args.gpu_memory,
        intra_gbps=args.intra_gbps,
        inter_gbps=args.inter_gbps,
        host_gbps=args.host_gbps,
        host_memory=args.host_memory,
    )


def run_plan(args) -> int:
    from fcsd.plan.planner import make_plan
    from fcsd.plan.printed_report import format_plan, plan_dict

    if args.max_kl is not None and not positive_number(args.max_kl):
        raise ValueError(f"--max-kl {args.max_kl}: a held-out KL bound is a finite number > 0, e.g. --max-kl 0.05")
    if args.max_kl is not None and args.probe is None:
        raise ValueError("--max-kl bounds the KL that --probe DATA measures: add --probe DATA, or leave --max-kl out")
    for override in args.overrides:
        if "=" not in override:
            raise ValueError(f"override {override!r} is not KEY=VALUE, e.g. data.seq_len=2048 (fcsd convert's keys)")
    if args.probe is not None and _looks_like_a_file(args.probe) and not Path(args.probe).expanduser().exists():
        raise ValueError(f"--probe {args.probe}: no such file; give held-out chat data (.jsonl, .json, .parquet)")
    if args.tokens is not None and not 0 < args.tokens <= MAX_TOKENS:
        raise ValueError(
            f"--tokens {args.tokens:g}: give a training budget between 1 and {MAX_TOKENS:g} tokens (the paper converts "
            "with up to 1e10; no corpus holds more than about 1e14), e.g. 2e9"
        )
    cluster = plan_cluster(args)
    plan = make_plan(
        args.model,
        cluster,
        args.tokens,
        args.layers,
        args.probe,
        args.overrides,
        args.max_kl,
        serve_context=args.serve_context,
        serve_sequences=args.serve_sequences,
    )
    report = plan_dict(plan)
    if args.measure:
        from fcsd.plan.predict import format_measured, measure_layouts
        from fcsd.plan.self_check import check_plan, format_check

        checked = check_plan(plan)
        checked.update(measure_layouts(plan, checked))
        report["measure"] = checked
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_plan(plan))
        if args.measure:
            print(format_check(checked))
            print(format_measured(checked))
    if plan.chosen is None:
        largest = plan.fallback.cluster if plan.fallback is not None else cluster
        raise ValueError(
            f"nothing fits on {cluster.gpus} GPUs of {cluster.gpu.memory_gib:g} GiB, nor on {largest.nodes} nodes of "
            "them: the memory table above says what each way needs; plan for GPUs with more memory (--gpu)"
        )
    return 0
