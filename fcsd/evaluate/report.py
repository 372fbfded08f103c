"""The evaluation report in the layout of the paper's Table 1: one row per model, one column per task, the average,
and a delta row (converted minus original); plus lm-eval's JSON per model and a PNG bar chart."""

from __future__ import annotations

import json
from pathlib import Path

from fcsd.evaluate.harness import task_score
from fcsd.evaluate.suites import SuiteConfig
from fcsd.files import ownership
from fcsd.sources import display_name

TABLE = "eval_table.md"


def score_table(results: dict[str, dict], suite: SuiteConfig) -> dict[str, dict[str, float]]:
    """label -> {column: score in percent, ..., "Avg": mean of the columns}."""
    table = {}
    for label, result in results.items():
        row = {spec.column or spec.task: task_score(result, spec) for spec in suite.tasks}
        row["Avg"] = sum(row.values()) / len(row)
        table[label] = row
    if {"original", "converted"} <= set(table):
        table["delta"] = {k: table["converted"][k] - table["original"][k] for k in table["converted"]}
    return table


def format_table(table: dict[str, dict[str, float]], names: dict[str, str], suite: SuiteConfig) -> str:
    """Markdown: Model | task columns | Avg, scores in percent with one decimal, deltas signed."""
    columns = list(next(iter(table.values())))
    lines = [
        "| Model | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for label, row in table.items():
        name = f"{label} ({display_name(names[label])})" if label in names else label
        cells = [f"{v:+.1f}" if label == "delta" else f"{v:.1f}" for v in row.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    settings = "; ".join(_describe(spec) for spec in suite.tasks)
    return "\n".join([f"lm-eval suite `{suite.name}`, scores in % ({settings})", "", *lines])


def _describe(spec) -> str:
    shots = "default shots" if spec.num_fewshot is None else f"{spec.num_fewshot}-shot"
    chat = ", chat template" if spec.apply_chat_template else ""
    return f"{spec.column or spec.task} = {spec.task} `{spec.metric or 'first metric'}` {shots}{chat}"


def plot_table(table: dict[str, dict[str, float]], path: Path, title: str) -> None:
    """Grouped bars per task (models side by side), deltas left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = {label: row for label, row in table.items() if label != "delta"}
    columns = list(next(iter(rows.values())))
    x = np.arange(len(columns))
    width = 0.8 / len(rows)
    figure, axis = plt.subplots(figsize=(max(6, 0.9 * len(columns) + 2), 4))
    for i, (label, row) in enumerate(rows.items()):
        axis.bar(x + (i - (len(rows) - 1) / 2) * width, [row[c] for c in columns], width, label=label)
    axis.set_xticks(x, columns, rotation=30, ha="right")
    axis.set_ylabel("score (%)")
    axis.set_title(title)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_report(out: Path, results: dict[str, dict], names: dict[str, str], suite: SuiteConfig) -> dict:
    """``results_<label>.json`` (lm-eval layout), ``eval_table.md``, ``eval_table.png`` and ``eval_summary.json``
    in ``out``; returns the score table."""
    from lm_eval.utils import handle_non_serializable

    from fcsd.files.staging import atomic_file

    ownership.mark(out, "eval")
    ownership.record(out)  # in the run folder that holds it
    marker, fresh = ownership.read_marker(out), {f"results_{label}.json" for label in results}
    for stale in out.glob("results_*.json"):  # an earlier report's model this one does not score (--compare)
        if stale.name not in fresh and marker.owns(stale.name):
            stale.unlink()
    table = score_table(results, suite)
    summary = {"suite": suite.name, "models": {k: display_name(v) for k, v in names.items()}, "scores": table}
    texts = {
        f"results_{label}.json": json.dumps(result, indent=2, default=handle_non_serializable)
        for label, result in results.items()
    }
    texts[TABLE] = format_table(table, names, suite) + "\n"
    texts["eval_summary.json"] = json.dumps(summary, indent=2)
    for name, text in texts.items():  # each file whole or not at all: a stop leaves the previous one
        with atomic_file(out / name) as staging:
            staging.write_text(text)
    plot_table(table, out / "eval_table.png", f"lm-eval suite {suite.name}")
    for name in [*fresh, TABLE, "eval_table.png", "eval_summary.json"]:
        ownership.record(out / name)
    return table


def default_output(model: str) -> Path:
    """``RUN/eval`` for a run folder (so the export's model card can show the table), else ``outputs/eval/<name>``."""
    from fcsd.files.run_folder import RunFolder

    run = RunFolder(model)
    return run.eval_dir if run.checkpoint() else Path("outputs") / "eval" / (run.root.name or "model")


def warn_if_not_converted(model: str) -> None:
    """Say so (on stderr) when the model scored as "converted" has no FarSkip layers: a stock checkpoint, or a run
    folder's teacher, is scored with its regular connectivity."""
    import sys

    from fcsd.connectivity.patch import CONFIG_KEY
    from fcsd.loading import load_config
    from fcsd.sources import resolve_checkpoint

    try:
        config = load_config(resolve_checkpoint(model))
    except Exception:  # unreadable or only on an unreachable hub: loading the model reports it
        return
    if not (getattr(config, CONFIG_KEY, None) or {}).get("layers"):
        print(
            f"fcsd eval: warning: {display_name(model)} has no FarSkip layers (a stock checkpoint, not a converted "
            "one): it is scored with its regular connectivity, labelled 'converted' only as the row being compared",
            file=sys.stderr,
        )


def evaluate_and_report(
    model: str, suite: SuiteConfig, compare: str | None = None, output: str | Path | None = None, **options
) -> tuple[Path, dict]:
    """``fcsd eval``: score ``model`` (and ``compare``, the original, under the same settings), write the report to
    ``output``; for a run folder also ``RUN/eval_table.md`` and a refreshed model card in ``RUN/export``. Returns
    the report folder and the score table. Under a multi-process launch only the main process evaluates and
    reports (once); the others return ``(folder, None)`` at once."""
    import shutil

    from fcsd.evaluate.harness import evaluate_checkpoints
    from fcsd.parallel.processes import is_main_process

    refs = {"original": compare, "converted": model} if compare else {"converted": model}
    from fcsd.evaluate.harness import check_chat_template, check_code_execution

    check_code_execution(suite, options.get("allow_code_execution", False))  # the refusal comes before any warning
    check_chat_template(refs, suite)  # tokenizers only: seconds, where lm-eval would find out after the model loads
    warn_if_not_converted(model)
    out = Path(output).expanduser() if output else default_output(model)
    if not is_main_process():
        return out, None
    inputs = {name: ref for name, ref in (("model", model), ("compared model", compare)) if ref}
    if out.resolve() != default_output(model).resolve():  # a run's own eval/ lies inside the run on purpose
        ownership.check_not_an_input(out, "--output", inputs, "eval")
    ownership.check_not_in_use(out.parent, "the folder that holds the report,")  # a run still training there
    ownership.check_replaceable(out, "eval", "--output", "choose another --output")
    from fcsd.export.model_card import refresh_card, run_config
    from fcsd.files.run_folder import RunFolder

    run = RunFolder(model)
    refreshes_card = out.parent.resolve() == run.root.resolve() and (run.export / "config.json").exists()
    if refreshes_card:
        run_config(run.final)  # a run that used a setting fcsd removed is refused before the evaluation
    results = evaluate_checkpoints(refs, suite, **options)
    table = write_report(out, results, refs, suite)
    if refreshes_card:
        shutil.copyfile(out / TABLE, run.eval_table)
        ownership.record(run.eval_table)
        refresh_card(run)
    return out, table
