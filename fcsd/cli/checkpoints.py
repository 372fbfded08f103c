"""``fcsd inspect``, ``probe``, ``export``, ``eval`` and ``push``: a checkpoint read, scored, exported or uploaded by
the library (design §2, §3, §8)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def add_parsers(sub) -> None:
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
    device = args.device or ("cuda" if cuda_available() else "cpu")
    probe_checkpoint(args.model, dtype=args.dtype, device=device, output_dir=args.output_dir, **options)
    return 0


def _export(args) -> int:
    import json

    from fcsd.export.save import check_one_process, export_checkpoint
    from fcsd.files import ownership
    from fcsd.serving.served_families import serve_command

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


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
