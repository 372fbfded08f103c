"""The ``fcsd`` command line. Thin: it parses arguments and calls library functions."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from pathlib import Path

DESCRIPTION = (
    "FarSkip-Collective conversion of Hugging Face MoE models with FCSD self-distillation: inspect, probe and convert "
    "a checkpoint, export, evaluate and push the result; measure expert-parallel overlap (bench) and place experts "
    "from recorded routes (routes)."
)


def _inspect(args) -> int:
    from fcsd.model_summary import summarize
    from fcsd.sources import resolve_checkpoint

    source = resolve_checkpoint(args.model)  # a run folder is read at its export/, best/ or final/, as fcsd eval does
    if "@" in source and not Path(source).exists():  # REPO@REV: the config.json of that hub revision
        from fcsd.loading import hub_config_file

        source = str(hub_config_file(*source.rsplit("@", 1)).parent)
    summary = summarize(source, layers=args.layers)
    summary.name = args.model
    print(json.dumps(summary.to_dict(), indent=2) if args.json else summary.to_text())
    return 0


def _probe(args) -> int:
    from fcsd.distill.probe import probe_checkpoint

    options = {k: getattr(args, k) for k in ("data", "split", "grid", "seq_len", "num_sequences", "batch_size")}
    device = args.device or ("cuda" if _cuda() else "cpu")
    probe_checkpoint(args.model, dtype=args.dtype, device=device, output_dir=args.output_dir, **options)
    return 0


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


def _run_overrides(args) -> list[str]:
    """The Hydra overrides of ``fcsd convert`` / ``cache-teacher`` / ``sweep``: MODEL (and the preset that names it,
    e.g. ``demo`` or ``Qwen/Qwen3-30B-A3B``), then the user's overrides."""
    from fcsd.distill.config import PATH_KEYS, hydra_override, preset_for

    overrides, model = list(args.overrides), args.model  # args stay as parsed: this may be called twice
    paths = {f"{section}.{key}" if section else key for section, key in PATH_KEYS}
    for index, override in enumerate(overrides):  # `output_dir=~/x` as the shell passes it when quoted: a path
        key, _, value = override.partition("=")
        if key in paths and value.startswith("~"):
            overrides[index] = hydra_override(key, value)
    if model is not None and "=" in model and not Path(model).exists():  # no MODEL: the first token is an override
        overrides.insert(0, model)
        model = None
    if model is None and not any(o.startswith(("model.name=", "model=")) for o in overrides):
        raise ValueError(
            f"MODEL is missing: `fcsd {args.command} MODEL [key=value ...]` takes a hub id, a local folder or 'demo' "
            f"(e.g. `fcsd {args.command} demo`)"
        )
    named = [o.split("=", 1)[1] for o in overrides if o.startswith("model.name=")]
    if model is not None and named:
        raise ValueError(
            f"MODEL {model} and model.name={named[-1]} name two models; give the model once (as MODEL, or as "
            "model.name without MODEL)"
        )
    if model is not None and "@" in model and not Path(model).exists():  # MODEL@REV: a hub revision
        model, revision = model.rsplit("@", 1)
        overrides.insert(0, hydra_override("model.revision", revision))
    if model is not None:
        overrides.insert(0, hydra_override("model.name", model))
        preset = preset_for(model)
        if preset and not any(o.startswith("model=") for o in overrides):
            overrides.insert(0, f"model={preset}")
    if getattr(args, "resume", False):
        overrides.append("train.resume=true")
    return overrides


def _run_config(args):
    """The composed config of ``recipes/fcsd.yaml`` with :func:`_run_overrides`."""
    from fcsd.distill.config import compose

    return compose(_run_overrides(args))


def _convert(args) -> int:
    from omegaconf import OmegaConf

    cfg = _run_config(args)
    if args.cfg:
        print(OmegaConf.to_yaml(cfg, resolve=True), end="")
        return 0
    from fcsd.distill.config import to_config

    config = to_config(cfg)
    from fcsd.parallel.processes import is_main_process, quiet_unless_main

    quiet_unless_main(is_main_process())  # under torchrun / accelerate launch, one process shows progress bars
    if config.model.name == "demo":
        from fcsd.cli.demo import run_demo

        run_demo(config)
        return 0
    from fcsd.distill.convert import convert

    result = convert(config)
    if os.environ.get("RANK", "0") == "0":
        print(f"wrote {result.final_dir} (load it with fcsd.from_pretrained); metrics in {result.output_dir}")
    return 0


def _export(args) -> int:
    import json

    from fcsd.export.save import check_one_process, export_checkpoint
    from fcsd.files import ownership
    from fcsd.serving.families import serve_command

    check_one_process()  # before any folder check: the launch's own processes would find each other's lock
    ownership.check_not_in_use(Path(args.out_dir).expanduser().parent, "the folder that holds OUT_DIR,")  # a run's
    out = export_checkpoint(
        args.source, args.out_dir, overwrite=args.overwrite, export_format=args.format, text_only=args.text_only
    )
    print(f"exported {out} (reload parity checked); load it with fcsd.from_pretrained or trust_remote_code=True")
    command = serve_command(str(out), json.loads((out / "config.json").read_text())["model_type"])
    if command:
        print(f"serve it with vLLM (fcsd's plugin: `make serve-env`, docs/serving.md): {command}")
    return 0


def _eval(args) -> int:
    from fcsd.evaluate.report import TABLE, evaluate_and_report
    from fcsd.evaluate.suites import load_suite, suite_from_tasks

    for folder in args.include_path:
        if not Path(folder).expanduser().is_dir():
            raise ValueError(f"--include-path {folder}: no such folder; give a folder of lm-eval task YAML files")
    if args.tasks is not None:  # --tasks "" is refused, not read as no --tasks
        suite = suite_from_tasks(args.tasks)
    else:
        suite = load_suite(args.suite or ("demo" if args.model == "demo" else "paper"))
    for spec in suite.tasks:
        if args.chat_template:
            spec.apply_chat_template = True
        if args.num_fewshot is not None:
            spec.num_fewshot = args.num_fewshot
    options = {
        "include_paths": args.include_path,
        "limit": _eval_limit(args.limit),
        "batch_size": _eval_batch_size(args.batch_size),
        "allow_code_execution": args.allow_code_execution,
        "log_samples": args.log_samples,
    }
    out, table = evaluate_and_report(
        args.model, suite, args.compare, args.output, device=args.device, dtype=args.dtype, **options
    )
    if table is None:  # another process of a multi-process launch: the main one evaluates and prints
        return 0
    print((out / TABLE).read_text(), end="")
    print(f"wrote {out}: results_*.json (lm-eval layout), {TABLE}, eval_table.png, eval_summary.json")
    return 0


def _eval_limit(text: str | None) -> int | float | None:
    """``--limit``: a positive whole number of examples per task, or a fraction in (0, 1]."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value):
        value = float("nan")
    if 0 < value <= 1 and "." in text:
        return None if value == 1 else value  # lm-eval reads a limit of 1.0 as one example
    if value >= 1 and value == int(value):
        return int(value)
    raise ValueError(f"--limit {text}: give a whole number of examples per task (e.g. 100) or a fraction in (0, 1]")


def _eval_batch_size(text: str) -> int | str:
    """``--batch-size``: a positive whole number, ``auto`` or ``auto:N`` (lm-eval re-detects N times)."""
    if text.isdigit() and int(text) > 0:
        return int(text)
    if text == "auto" or (text.startswith("auto:") and text[5:].isdigit() and int(text[5:]) > 0):
        return text
    raise ValueError(f"--batch-size {text}: give a positive whole number, 'auto' or 'auto:N'")


def _push(args) -> int:
    from fcsd.export.push import push

    result = push(args.folder, args.repo_id, private=args.private, revision=args.revision, dry_run=args.dry_run)
    if args.dry_run:
        print(f"would upload {len(result)} files from {args.folder} to {args.repo_id}:")
        for path in result:
            print(f"  {path} ({(Path(args.folder) / path).stat().st_size:,} bytes)")
    else:
        print(f"pushed {args.folder} to {args.repo_id}: {result}")
    return 0


def _sweep(args) -> int:
    from fcsd.distill.config import compose, to_config
    from fcsd.distill.sweep import run_sweep, sweep_dir

    overrides = _run_overrides(args)
    if "model=demo" in overrides and not any(o.startswith("sweep=") for o in overrides):
        overrides.append("sweep=demo")  # the demo's minutes-long variant of the paper's sweep
    config = to_config(compose(overrides))
    selection = run_sweep(config, overrides)
    print((sweep_dir(config) / "sweep_table.md").read_text(), end="")
    print(f"wrote {sweep_dir(config)}: sweep_table.md, sweep.csv, sweep_losses.png, selection.json")
    print(f"full conversion: {selection['command']}")
    return 0


def _cache_teacher(args) -> int:
    from fcsd.distill.config import to_config
    from fcsd.distill.teacher_cache import cache_dir, cache_teacher
    from fcsd.files import ownership

    config = to_config(_run_config(args))
    ownership.check_not_in_use(cache_dir(config).parent, "the folder that holds teacher.cache_dir,")  # a run's
    folder = cache_teacher(config)
    from fcsd.parallel.processes import is_main_process

    if is_main_process():  # under torchrun every process cached its share
        print(f"teacher cache ready at {folder}; train from it with teacher.mode=cache teacher.cache_dir={folder}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fcsd", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="family, layers, experts and parameter counts of a checkpoint (config only)")
    p.add_argument("model", help="hub id, local folder, or 'demo'")
    p.add_argument("--layers", help="a layer spec to resolve, e.g. all, last:50%%, first:4, 0,3,5-7")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("probe", help="loss and KL of first-N / last-N FarSkip conversion without training (Fig. 3)")
    p.add_argument("model", help="hub id, local folder, or 'demo'")
    p.add_argument("--data", help="held-out data: a local .jsonl/.json/.txt/.parquet file or a datasets name")
    p.add_argument("--split", default="validation", help="split of a hub dataset (default: validation)")
    p.add_argument("--grid", help="numbers of converted layers, e.g. 0,4,8,all or 25%%,50%% (default: 9 steps)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: 256)")
    p.add_argument("--num-sequences", type=int, default=32, help="held-out sequences to score (default: 32)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", help="cuda, cpu, ... (default: cuda when available)")
    p.add_argument("--output-dir", default="outputs/probe", help="where probe.csv and probe.png go")
    p.set_defaults(func=_probe)

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

    from fcsd.plan.cli import add_parser as add_plan_parser  # `fcsd plan`

    add_plan_parser(sub)

    overrides_help = "Hydra overrides of recipes/fcsd.yaml, e.g. data.path=chat.jsonl train.lr=4e-5 farskip.layers=all"
    p = sub.add_parser(
        "convert",
        help="rewire a checkpoint with FarSkip connectivity and recover it with FCSD self-distillation",
        description="MODEL is a hub id, a local folder, or 'demo' (the embedded offline example: builds a tiny "
        "teacher, runs FCSD and an SFT baseline, prints exact-match accuracy and held-out KL).",
    )
    p.add_argument("model", nargs="?", help="hub id, local folder, or 'demo' (or model=PRESET, model.name=...)")
    p.add_argument("overrides", nargs="*", help=overrides_help)
    p.add_argument("--resume", action="store_true", help="continue the run in output_dir (same as train.resume=true)")
    p.add_argument("--cfg", choices=["job"], help="print the resolved config as YAML and exit")
    p.set_defaults(func=_convert)

    p = sub.add_parser(
        "export",
        help="write a converted checkpoint that loads with and without fcsd (remote code), checked by reloading",
    )
    p.add_argument(
        "source", help="a run folder of fcsd convert (its best/ after early stopping, else final/) or a checkpoint"
    )
    p.add_argument("out_dir", help="where the export goes (refused if not empty unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    p.add_argument(
        "--format",
        choices=("source", "bf16"),
        default="source",
        help="source (default): a model trained from a block-FP8 checkpoint is written in that FP8 format, any "
        "other in its dtype; bf16: the weights as they are, without quantization",
    )
    p.add_argument(
        "--text-only",
        action="store_true",
        help="a run trained from a multimodal checkpoint (Llama-4 Scout) is exported whole by default, its vision "
        "tower and projector copied from the run's source; this writes the trained text model alone",
    )
    p.set_defaults(func=_export)

    p = sub.add_parser(
        "eval",
        help="score a converted checkpoint (and the original, --compare) with lm-eval: JSON, Table-1 markdown, PNG",
        description="MODEL is an exported or converted folder, a run folder of fcsd convert, a hub id, or 'demo'. "
        "FarSkip connectivity is applied from the checkpoint's config before lm-eval sees the model.",
    )
    p.add_argument("model", help="exported/converted folder, run folder, hub id, or 'demo'")
    which = p.add_mutually_exclusive_group()
    suite_help = "suite under eval/suites (paper, quick, demo) or a suite YAML (default: paper; demo for 'demo')"
    which.add_argument("--suite", help=suite_help)
    which.add_argument("--tasks", help="comma-separated lm-eval task names instead of a suite")
    p.add_argument("--include-path", action="append", default=[], help="folder of extra lm-eval task YAML")
    p.add_argument("--compare", metavar="BASE", help="also score the original checkpoint BASE (rows + delta)")
    p.add_argument("--limit", help="examples per task: a whole number, or a fraction in (0, 1]; for smoke runs")
    p.add_argument("--output", help="report folder (default: RUN/eval for a run folder, else outputs/eval/NAME)")
    p.add_argument("--batch-size", default="8", help="lm-eval batch size: a positive number, 'auto' or 'auto:N'")
    p.add_argument("--num-fewshot", type=int, help="override every task's few-shot count")
    p.add_argument("--chat-template", action="store_true", help="render every prompt with the chat template")
    code_help = "let code tasks (humaneval_plus, mbpp_plus) run model-written code in sandboxed subprocesses"
    p.add_argument("--allow-code-execution", action="store_true", help=code_help)
    p.add_argument("--log-samples", action="store_true", help="keep every prompt and response in the JSON")
    p.add_argument("--device", help="cuda, cpu, ... (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.set_defaults(func=_eval)

    p = sub.add_parser("push", help="upload an exported folder to the Hugging Face hub in one commit")
    p.add_argument("folder", help="a folder written by fcsd export (its reload-parity record is required)")
    p.add_argument("repo_id", help="hub repository, e.g. my-org/Qwen3-30B-A3B-FarSkip")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--revision", help="branch to push to (created if needed; default: main)")
    p.add_argument("--dry-run", action="store_true", help="list what would be uploaded and exit")
    p.set_defaults(func=_push)

    p = sub.add_parser(
        "sweep",
        help="the paper's two-stage batch-size / learning-rate sweep (Hydra multirun), then the chosen settings",
        description="Stage 1 runs sweep.batch_tokens at sweep.stage1_lr, stage 2 sweep.lrs at the chosen batch size, "
        "sweep.steps steps each, selected by the mean training loss of the last sweep.select_last steps. Finished "
        "or crashed runs are not run again on a restart. 'demo' runs a CPU-sized variant (recipes/sweep/demo.yaml).",
    )
    p.add_argument("model", nargs="?", help="hub id, local folder, or 'demo' (or model=PRESET)")
    p.add_argument("overrides", nargs="*", help=overrides_help + " sweep=slurm sweep.steps=500")
    p.set_defaults(func=_sweep)

    p = sub.add_parser(
        "cache-teacher",
        help="store the teacher's top-k log-probabilities for training with teacher.mode=cache",
    )
    p.add_argument("model", nargs="?", help="hub id, local folder, or 'demo'")
    p.add_argument("overrides", nargs="*", help=overrides_help + " teacher.top_k=64 teacher.cache_dir=...")
    p.set_defaults(func=_cache_teacher)

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

    from fcsd.cli.routes import add_parser as add_routes_parser  # `fcsd routes record|stats|place`

    add_routes_parser(sub)
    p = sub.add_parser(
        "launch",
        help="run a torchrun / accelerate launch line of fcsd with one voice: an error or a stop is said once, "
        "with its own exit status (2, 130, 143), and no launcher traceback",
        description="Put `fcsd launch` in front of a launch line: fcsd launch torchrun --nproc_per_node 2 -m "
        "fcsd.cli convert demo",
    )
    p.add_argument("line", nargs=argparse.REMAINDER, help="the launch line: torchrun ... or accelerate launch ...")
    p.set_defaults(func=_launch)
    return parser


def _launch(args) -> int:
    from fcsd.cli.launch import launch

    return launch(args.line, check_command=parse_command)


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


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _input_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input: reported as one line, no traceback."""
    errors: list[type[BaseException]] = [ValueError, FileNotFoundError, OSError]  # OSError: unreadable or not found
    if "hydra" in sys.modules:
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        errors += [HydraException, OmegaConfBaseException]
    if "safetensors" in sys.modules:
        from safetensors import SafetensorError

        errors.append(SafetensorError)
    for module, name in (("httpx", "HTTPError"), ("httpx2", "HTTPError"), ("requests", "RequestException")):
        if module in sys.modules:
            errors.append(getattr(sys.modules[module], name))
    return tuple(errors)


def _one_line(error: BaseException) -> str:
    """The error as one line: a hub or loading problem in words (:func:`fcsd.sources.explain_error`), else its
    message with the cause Hydra wraps (which names the key and the expected type)."""
    from fcsd.sources import explain_error

    message = explain_error(error) or _hydra_message(error) or _path_message(error)
    if message is None:
        message = str(error).strip() or type(error).__name__
        cause = error.__cause__
        if cause is not None and "hydra" in sys.modules:
            from hydra.errors import HydraException

            if isinstance(error, HydraException) and str(cause).strip():
                message += f": {str(cause).strip().splitlines()[0]}"
    return " ".join(message.split("\n")).replace("  ", " ")


def _path_message(error: BaseException) -> str | None:
    """A path that cannot be a folder, in words: a symbolic link that leads back to itself, a file where a folder
    (or a folder on the way to one) is needed."""
    import errno
    import re

    loop = re.fullmatch(r"Symlink loop from '(.+)'", str(error))
    if isinstance(error, RuntimeError) and loop:
        return f"{loop.group(1)}: a symbolic link on this path leads back to itself; remove it or choose another path"
    name = getattr(error, "filename", None)
    if not isinstance(error, OSError) or not name:
        return None
    if error.errno == errno.ENOTDIR:
        return f"{name}: a part of this path is a file, not a folder; choose another path"
    if error.errno == errno.EEXIST and Path(name).exists() and not Path(name).is_dir():
        return f"{name} is a file where a folder is needed; choose another path"
    if error.errno == errno.EEXIST and Path(name).is_symlink() and not Path(name).exists():
        return f"{name} is a symbolic link to nothing; remove it or choose another path"
    if error.errno == errno.EROFS:
        return f"{name} is on a read-only file system; choose a folder you can write to"
    if error.errno in (errno.EACCES, errno.EPERM):
        why = "permission denied" if error.errno == errno.EACCES else f"permission denied ({error.strerror})"
        return f"{name}: {why}; fix its permissions or choose another path"
    return None


def _is_symlink_loop(error: BaseException) -> bool:
    """``Path.resolve`` on a link that leads back to itself (Python raises a RuntimeError, not an OSError)."""
    return isinstance(error, RuntimeError) and str(error).startswith("Symlink loop from ")


def _hydra_message(error: BaseException) -> str | None:
    """Hydra's parse errors in fcsd's words: its advice (``+key``, ``--multirun``, a link) does not apply to fcsd,
    which refuses new keys and runs sweeps with ``fcsd sweep``."""
    import re

    text = " ".join(str(error).split())
    found = re.match(r"Ambiguous value for argument '([^=']+)=([^']*)'", text)
    if found:
        key, value = found.groups()
        return (
            f"{key}={value}: a comma makes the value ambiguous; write a list as {key}=[{value}] or quote a string "
            f"as '{key}=\"{value}\"' (fcsd convert runs one setting; `fcsd sweep` sweeps batch size and LR)"
        )
    found = re.match(r"Could not override '([^']+)'", text)
    if found:
        return (
            f"unknown config key {found.group(1)}: check the spelling; `fcsd convert MODEL --cfg job` prints every key"
        )
    found = re.match(r"(?:LexerNoViableAltException|mismatched input.*?): (\S+=?.*?) \^", text)
    if found or "override_grammar" in text:
        override = found.group(1).strip() if found else "an override"
        key, _, value = override.partition("=")
        return f"{override}: this value cannot be read as it is written; quote it, e.g. '{key}=\"{value}\"'"
    found = re.match(
        r"In '[^']+': Could not find '([^/']+)/([^']+)' Available options in '[^']+': (.*?) Config search", text
    )
    if found:
        group, name, options = found.groups()
        return f"{group}={name}: no such preset; choose one of {', '.join(options.split())} (recipes/{group}/)"
    return None


def _quiet_hub_retries() -> None:
    """huggingface_hub retries an unreachable hub with backoff and logs each try over two lines; fcsd reports the
    outcome in one line (:func:`fcsd.sources.explain_error`) instead."""
    import logging

    class DropRetries(logging.Filter):
        def filter(self, record):
            message = record.getMessage()
            return not (message.startswith("Retrying in") or "thrown while requesting" in message)

    logger = logging.getLogger("huggingface_hub.utils._http")
    if not any(isinstance(f, DropRetries) for f in logger.filters):
        logger.addFilter(DropRetries())


# the commands that import torch anyway: imported first, a stop deferred until it is complete (stopping.import_torch)
TORCH_COMMANDS = {"convert", "cache-teacher", "sweep", "export", "eval", "probe", "plan", "bench", "routes", "launch"}


def _check_device(args) -> None:
    """A ``--device`` torch knows and this machine has, and ``--backend nccl`` only with a GPU: one line before any
    work (they were tracebacks from inside torch, or a silent run on the CPU)."""
    import torch

    name = getattr(args, "device", None)
    if name is not None and not (name == "auto" and args.command == "bench"):  # only bench takes auto
        try:
            device = torch.device(name)
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ValueError(f"--device {name}: give cpu, cuda or cuda:N")
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.type == "cuda" and (device.index or 0) >= visible:
            seen = f"{visible} CUDA device{'s' * (visible != 1)} visible" if visible else "no CUDA device is visible"
            raise ValueError(f"--device {name}: {seen} on this machine; use --device cpu")
    if getattr(args, "backend", None) == "nccl" and not torch.cuda.is_available():
        raise ValueError("--backend nccl needs a CUDA device, and none is visible; use --backend gloo")


def parse_command(argv: list[str]) -> argparse.Namespace:
    """The parsed ``fcsd argv`` (a usage error: argparse's message and ``SystemExit(2)``)."""
    if argv[:1] == ["launch"] and argv[1:2] not in ([], ["-h"], ["--help"]):  # the launch line, word for word
        return argparse.Namespace(command="launch", line=argv[1:], func=_launch, argv=argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(_joined_option_values(parser, argv))
    if extra and hasattr(args, "overrides") and not any(e.startswith("-") for e in extra):
        args.overrides += extra  # key=value after a flag (`fcsd convert M --resume train.lr=1e-5`)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    """The ``fcsd`` command (``argv``: its arguments; None: this process's own, and then a stop ends the process
    with its status at once, see :func:`_exit_stopped`). Bad input: one line, status 2; Ctrl-C: 130; SIGTERM: 143."""
    from fcsd import stopping
    from fcsd.cli.launch import say

    previous = stopping.install()  # first of all: a stop while fcsd imports or loads is one line too
    whole_process = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    args, said = None, None
    try:
        from fcsd import quiet
        from fcsd.files import ownership

        quiet.install()
        _quiet_hub_retries()
        args = parse_command(argv)
        ownership.set_command(argv)
        if args.command in TORCH_COMMANDS:
            stopping.import_torch()
            _check_device(args)
        return args.func(args)
    except SystemExit:
        raise
    except BaseException as error:
        stopping.ignore_further_stops()  # the command has ended: a stop now must not chain onto this report
        name = _command_name(args, argv)
        code = stopping.was_stopped(error) or stopping.orphaned_stop()
        if code is not None:
            _say_stopped(args, argv, code)
            if whole_process:
                _exit_stopped(code)
            return code
        if isinstance(error, _input_errors()) or _is_symlink_loop(error):
            say(f"fcsd {name}: error: {_one_line(error)}", 2)
            said = 2
            return 2
        raise
    finally:
        stopping.restore(previous)
        if whole_process:
            _stops_said_at_exit(args, argv, previous, said)


def _command_name(args, argv: list[str]) -> str:
    return getattr(args, "command", None) or next((a for a in argv if not a.startswith("-")), "")


def _say_stopped(args, argv: list[str], code: int) -> None:
    """The one line of a stopped command (status ``code``: 130 or 143), with the way on (:func:`_resume_hint`)."""
    from fcsd.cli.launch import say

    how = "terminated (SIGTERM)" if code == 143 else "interrupted"
    say(f"fcsd {_command_name(args, argv)}: {how}{_resume_hint(args)}", code)


def _stops_said_at_exit(args, argv: list[str], handled: dict, said: int | None = None) -> None:
    """A stop that comes after the command returned, while the interpreter ends (threads joined, exit handlers), is
    said in one line too, as any stop (a Ctrl-C just after a run's "exported" line ended it with status 130 and
    nothing said), and ends the process at once with its status; after an error already said (status ``said``: a
    launcher stopping the other ranks of a refusal) the process ends silently with that status. ``handled``: the
    signals fcsd handles (a SIGINT the shell ignores stays ignored)."""
    from fcsd import stopping

    def stop(signum, frame):
        stopping.ignore_further_stops()
        if said:
            _exit_stopped(said)
        code = 143 if signum == signal.SIGTERM else 130
        _say_stopped(args, argv, code)
        _exit_stopped(code)

    for sig in handled:
        signal.signal(sig, stop)


def _exit_stopped(code: int) -> None:
    """End the process with ``code`` now. An interrupt that landed inside a string ``exec`` (dataclasses build their
    ``__init__`` that way while a library imports) marks the interpreter as interrupted, and Python would then end
    itself by SIGINT at exit whatever the command returned; the command's own cleanup has run by now."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _joined_option_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--link -1MB/s`` as ``--link=-1MB/s``: argparse takes a value that starts with a dash for an option and
    answers "expected one argument"; an option that takes a value gets the next word whatever it starts with, so
    that the value itself is checked (and refused in fcsd's words if wrong)."""
    commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    actions = [a for group in commands for sub in group.choices.values() for a in sub._actions]
    takes_value = {option for a in actions if a.nargs is None for option in a.option_strings}
    joined, i = [], 0
    while i < len(argv):
        word = argv[i]
        if word in takes_value and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1] not in takes_value:
            joined.append(f"{word}={argv[i + 1]}")
            i += 2
            continue
        joined.append(word)
        i += 1
    return joined


def _resume_hint(args) -> str:
    """For an interrupted ``convert``: the step of its newest checkpoint and the command that continues it; for a
    sweep, that the same command continues it."""
    if args is not None and args.command == "sweep":
        return "; run the same command again to continue: finished runs are kept, the stopped one resumes"
    if args is None or args.command != "convert" or getattr(args, "cfg", None):
        return ""
    try:
        from fcsd.distill.config import to_config
        from fcsd.files.run_folder import RunFolder

        config = to_config(_run_config(args), resolve=False)  # no second note about the guide
    except BaseException:  # the interrupt came before the config was valid (or came again): nothing to resume
        return ""
    run = RunFolder(config.output_dir)
    if config.model.name == "demo":  # its runs live in two folders below output_dir: the stopped one resumes
        from fcsd.cli.demo import demo_runs

        stopped = [folder for folder in demo_runs(config.output_dir).values() if not folder.final.exists()]
        if not stopped:
            return f"; the demo's runs in {config.output_dir} had finished: run the same command again (it trains both)"
        run = stopped[0]  # the demo trains its runs in order: the first unfinished one is the one stopped
    elif run.final.exists():  # written by one rename: the run finished, and a resume is refused
        return _finished_hint(run, config)
    checkpoints = run.checkpoints()
    if not checkpoints:
        return f"; no checkpoint was saved yet in {run.root}: run the same command again to restart"
    import shlex

    from fcsd.files.ownership import launcher

    words = [*launcher(), *(a for a in args.argv if a not in ("--resume", "train.resume=true")), "--resume"]
    command = shlex.join(words)
    return f"; the last checkpoint is {checkpoints[-1].name} in {run.root}: continue with `{command}`"


def _finished_hint(run, config) -> str:
    """For a convert stopped after its ``final/`` was written (while it exported, pushed or exited): that the run
    finished, and the ``fcsd export`` that writes an export the stop cut short (``--resume`` refuses a finished run)."""
    import shlex

    export_dir = Path(config.export_dir or run.export)
    if config.export and not (export_dir / "config.json").exists():
        command = shlex.join(["fcsd", "export", str(run.root), str(export_dir)])
        return f"; the run in {run.root} finished (final/ is written) but not its export: write it with `{command}`"
    written = f"final/ and {export_dir}" if config.export else "final/"
    return f"; the run in {run.root} had finished ({written} written)"
