"""``fcsd convert demo``: the embedded default job (FCSD and the SFT baseline on the demo teacher, an exact-match
table, then lm-eval). A leaf: only the command line imports it."""

from __future__ import annotations


def run_demo(config) -> dict:
    """``fcsd convert demo``: FCSD and, with the same budget, the SFT baseline (paper Tab. 2), then a table of
    exact-match accuracy and held-out KL for the teacher, the converted model before training, and both runs; last,
    lm-eval's score of the teacher vs the FCSD model on the demo suite (``eval/suites/demo.yaml``).

    Under ``torchrun`` / ``accelerate launch`` every process trains (the runs are multi-process), and the main
    process alone builds the demo assets first, prints, scores and reports; the others return ``{}`` when training
    is done (the launcher waits for the main process)."""
    import dataclasses
    import json
    from pathlib import Path

    from fcsd.connectivity.patch import apply_farskip
    from fcsd.demo_assets import prepare_demo
    from fcsd.distill.convert import convert
    from fcsd.evaluate.exact_match import exact_match
    from fcsd.loading import from_pretrained, tokenizer_from_pretrained
    from fcsd.parallel.processes import main_process_first, quiet_unless_main

    with main_process_first() as is_main:
        root = prepare_demo()
    say = quiet_unless_main(is_main)
    out = Path(config.output_dir)
    runs = {}
    for objective in ("kl", "sft"):
        train = dataclasses.replace(config.train, objective=objective)
        run_config = dataclasses.replace(config, train=train, output_dir=str(out / f"fcsd-{objective}"))
        say(f"demo: training the converted model with train.objective={objective}")
        runs[objective] = convert(run_config)
    if not is_main:
        return {}

    def read(name: str) -> list[dict]:
        return [json.loads(line) for line in (root / "data" / name).read_text().splitlines()]

    scored, general = read("heldout.jsonl"), read("heldout-general.jsonl")

    def scores(model) -> dict:
        return {
            **exact_match(model, tokenizer, scored),
            CONVERSION_TASKS: exact_match(model, tokenizer, general)["all"],
        }

    tokenizer = tokenizer_from_pretrained(str(root / "model"))
    teacher = from_pretrained(str(root / "model"))
    report = {"teacher": {"kl": 0.0, **scores(teacher)}}
    converted = apply_farskip(teacher, config.farskip.layers)
    report["converted, before training"] = {"kl": runs["kl"].eval_before["eval/kl"], **scores(converted)}
    for objective, label in (("kl", "after FCSD (KL)"), ("sft", "after SFT, same budget")):
        model = from_pretrained(str(runs[objective].final_dir))
        report[label] = {"kl": runs[objective].eval_after["eval/kl"], **scores(model)}
    text = format_report(report, config)
    print(text)
    (out / "demo_report.md").write_text(text + "\n")
    print(f"wrote {out / 'demo_report.md'}")
    import datasets

    from fcsd.evaluate.report import TABLE, evaluate_and_report
    from fcsd.evaluate.suites import load_suite
    from fcsd.run_folder import RunFolder

    datasets.disable_progress_bars()  # "Generating test split" of the demo's local task files says nothing here
    print("demo: lm-eval, teacher (original) vs FCSD (converted), suite `demo`")
    fcsd_run, suite = runs["kl"].output_dir, load_suite("demo")
    report_dir = RunFolder(fcsd_run).eval_dir
    folder, table = evaluate_and_report(str(fcsd_run), suite, str(root / "model"), report_dir, batch_size=64)
    print((folder / TABLE).read_text())
    report["lm-eval"] = table
    (out / "demo_report.json").write_text(json.dumps(report, indent=2))
    return report


CONVERSION_TASKS = "conversion tasks"  # the report's column for held-out rows of the conversion data's tasks


def format_report(report: dict, config) -> str:
    """The demo's markdown table: one row per model, held-out KL then exact match per scored task, over the scored
    tasks, and over held-out rows of the conversion data's own tasks."""
    tasks = [key for key in next(iter(report.values())) if key not in ("kl", "all", CONVERSION_TASKS)]
    header = ["model", "held-out KL", *tasks, "all scored", CONVERSION_TASKS]
    from fcsd.distill.synthetic import GENERAL_TASKS

    lines = [
        f"FarSkip layers `{config.farskip.layers}`, {config.train.max_steps} steps of {config.train.batch_tokens} "
        "tokens; exact match on the held-out synthetic tasks",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
    ]
    for name, scores in report.items():
        cells = [f"{scores['kl']:.4f}"] + [f"{100 * scores[t]:.1f}%" for t in [*tasks, "all", CONVERSION_TASKS]]
        lines.append("| " + " | ".join([name, *cells]) + " |")
    lines += [
        "",
        "FCSD and SFT trained on the same conversion data, other tasks the teacher knows "
        f"({', '.join(GENERAL_TASKS)}): FCSD on the teacher's distributions, SFT on the gold answers. None of the "
        f"scored tasks is in it; the held-out KL is measured on them, `{CONVERSION_TASKS}` on held-out rows of the "
        "conversion data's own tasks.",
    ]
    return "\n".join(lines)
