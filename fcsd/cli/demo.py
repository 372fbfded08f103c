"""``fcsd convert demo``: the embedded default job (FCSD and the SFT baseline on the demo teacher, an exact-match
table, then lm-eval). A leaf: only the command line imports it."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path


def demo_runs(output_dir) -> dict:
    """The demo's two run folders under ``output_dir``, by objective: FCSD's KL run, then the SFT baseline's."""
    from fcsd.files.run_folder import RunFolder

    return {objective: RunFolder(Path(output_dir) / f"fcsd-{objective}") for objective in ("kl", "sft")}


def run_demo(config) -> dict:
    """``fcsd convert demo``: FCSD and, with the same budget, the SFT baseline (paper Tab. 2), then a table of
    exact-match accuracy and held-out KL for the teacher, the conversion data's writer, the converted model before
    training, and both runs; last, lm-eval's score of the teacher vs the FCSD model on the demo suite
    (``eval/suites/demo.yaml``: the table's prompts, so the teacher scores the same in both, printed side by side).

    Under ``torchrun`` / ``accelerate launch`` every process trains (the runs are multi-process), and the main
    process alone builds the demo assets first, prints, scores and reports; the others return ``{}`` when training
    is done (the launcher waits for the main process)."""
    from fcsd.embedded.assets import prepare_demo
    from fcsd.parallel.processes import is_main_process, main_process_first

    with demo_folder(config, is_main_process()):  # one demo per folder, for the whole demo
        with main_process_first() as is_main:
            root = prepare_demo()
        return _run_demo(config, root, is_main)


REPORTS = ("demo_report.md", "demo_report.json")


@contextmanager
def demo_folder(config, is_main: bool):
    """Hold the demo's ``output_dir`` (:mod:`fcsd.files.ownership`): not an input, the current or the home folder, not
    in use by another demo, not a folder of another kind, and no report file of the demo's name that fcsd did not write
    (a user's ``demo_report.md``); the demo replaces its own runs and reports, and a user's other files stay
    beside them. Refused in one line before anything is built or trains. Only the main process checks and locks."""
    from fcsd.distill.preflight import run_inputs
    from fcsd.files import ownership

    out = Path(config.output_dir).expanduser()
    if not is_main:
        yield
        return
    ownership.check_not_an_input(out, "output_dir", run_inputs(config), "demo")
    ownership.check_not_in_use(out, "output_dir")
    marker = ownership.read_marker(out)
    if marker is not None and not marker.is_kind("demo"):
        raise ownership.FolderError(f"output_dir {out} is {marker.description()}, not a demo folder; choose another")
    earlier = marker is None and _holds_demo_runs(out)  # written before demo folders were marked
    foreign = [n for n in REPORTS if (out / n).exists() and not earlier and not (marker and marker.owns(n))]
    if foreign:
        raise ownership.FolderError(
            f"output_dir {out} holds {', '.join(foreign)}, which fcsd did not write and the demo would replace; move "
            "it out first, or choose another output_dir"
        )
    with ownership.folder_lock(out, "output_dir"):
        ownership.mark(out, "demo")
        for name in (*(run.root.name for run in demo_runs(out).values()), *REPORTS):
            ownership.record(out / name)  # written below: the manifest names them from the start
        yield


def _holds_demo_runs(out: Path) -> bool:
    """Whether ``out`` holds a run folder of the demo's (an fcsd run under its name)."""
    from fcsd.files import ownership

    for run in demo_runs(out).values():
        marker = ownership.read_marker(run.root) if run.root.is_dir() else None
        if marker is not None and marker.is_kind("run"):
            return True
    return False


def _run_demo(config, root: Path, is_main: bool) -> dict:
    import dataclasses
    import json

    from fcsd.connectivity.patch import apply_farskip
    from fcsd.distill.config import resolve_guide
    from fcsd.distill.convert import convert
    from fcsd.evaluate.exact_match import exact_match_of, greedy_answers
    from fcsd.loading import from_pretrained, tokenizer_from_pretrained
    from fcsd.parallel.processes import quiet_unless_main

    say = quiet_unless_main(is_main)
    out = Path(config.output_dir)
    runs = {}
    for objective, folder in demo_runs(config.output_dir).items():
        # --resume continues the run a stop cut short; the demo's other runs (not started, or finished: the report
        # needs their results) are trained as a plain `fcsd convert demo` trains them
        resume = config.train.resume and bool(folder.checkpoints()) and not folder.final.exists()
        if config.train.resume and not resume:
            say(f"demo: {folder.root} holds no stopped run to continue: training it")
        train = dataclasses.replace(config.train, objective=objective, resume=resume)
        recovery = dataclasses.replace(config.recovery)
        run_config = dataclasses.replace(config, train=train, recovery=recovery, output_dir=str(folder.root))
        resolve_guide(run_config)  # SFT: the guided recipe without its guide, which belongs to the KL
        say(f"demo: training the converted model with train.objective={objective}")
        runs[objective] = convert(run_config)
    if not is_main:
        return {}

    def read(name: str) -> list[dict]:
        return [json.loads(line) for line in (root / "data" / name).read_text().splitlines()]

    scored, general = read("heldout.jsonl"), read("heldout-general.jsonl")

    def table_row(kl: float | None, scored_answers: list[str], general_answers: list[str]) -> dict:
        return {
            "kl": kl,
            **exact_match_of(scored_answers, scored),
            OTHER_TASKS: exact_match_of(general_answers, general)["all"],
        }

    def scores(model, kl: float) -> dict:
        return table_row(kl, greedy_answers(model, tokenizer, scored), greedy_answers(model, tokenizer, general))

    tokenizer = tokenizer_from_pretrained(str(root / "model"))
    teacher = from_pretrained(str(root / "model"))
    report = {"teacher": scores(teacher, 0.0), WRITER: table_row(None, *writer_answers(scored, general))}
    converted = apply_farskip(teacher, config.farskip.layers)
    from fcsd.distill.heldout import kl_name
    from fcsd.run_facts import kl_of

    report["converted, before training"] = scores(converted, kl_of(runs["kl"].eval_before))
    for objective, label in (("kl", "after FCSD (KL)"), ("sft", "after SFT, same budget")):
        report[label] = scores(from_pretrained(str(runs[objective].final_dir)), kl_of(runs[objective].eval_after))
    text = format_report(report, config, len(scored), len(general), kl_name(runs["kl"].eval_before))
    print(text)
    (out / "demo_report.md").write_text(text + "\n")
    print(f"wrote {out / 'demo_report.md'}")
    import datasets

    from fcsd.evaluate.report import TABLE, evaluate_and_report
    from fcsd.evaluate.suites import load_suite
    from fcsd.files.run_folder import RunFolder

    datasets.disable_progress_bars()  # "Generating test split" of the demo's local task files says nothing here
    print("demo: lm-eval, teacher (original) vs FCSD (converted), suite `demo`")
    fcsd_run, suite = runs["kl"].output_dir, load_suite("demo")
    report_dir = RunFolder(fcsd_run).eval_dir
    folder, table = evaluate_and_report(str(fcsd_run), suite, str(root / "model"), report_dir, batch_size=64)
    print((folder / TABLE).read_text())
    report["lm-eval"] = table
    table_says, lm_eval_says = 100 * report["teacher"]["all"], table["original"]["demo-gen"]
    print(
        f"the teacher, exact match on the same {len(scored)} prompts: {table_says:.1f}% in the table above, "
        f"{lm_eval_says:.1f} on lm-eval's demo-gen (same chat template, zero-shot, greedy until EOS)"
    )
    (out / "demo_report.json").write_text(json.dumps(report, indent=2))
    return report


OTHER_TASKS = "other tasks"  # the report's column for held-out prompts of the unscored tasks
WRITER = "the conversion data's writer"  # the report's row for the writer's answers to the held-out prompts


def writer_answers(scored: list[dict], general: list[dict]) -> tuple[list[str], list[str]]:
    """What the conversion data's writer (:func:`fcsd.embedded.synthetic.writer_answer`) answers to the held-out
    prompts: the score the SFT baseline would reach by imitating it perfectly."""
    import random

    from fcsd.embedded.synthetic import writer_answer

    rng = random.Random(0)
    return tuple([writer_answer(row["messages"][-1]["content"], rng) for row in rows] for rows in (scored, general))


def format_report(report: dict, config, n_scored: int, n_general: int, kl_label: str = "held-out KL") -> str:
    """The demo's markdown table: one row per model, held-out KL (``kl_label``: with the teacher cache, its top-k
    figure) then exact match per scored task, over the scored tasks, and over held-out prompts of the other tasks;
    what the data models, below it."""
    from fcsd.embedded.synthetic import GENERAL_TASKS, TASKS, WRITER_ERRORS, WRITER_PHRASE, WRITER_PHRASING
    from fcsd.run_facts import end_step

    tasks = [key for key in next(iter(report.values())) if key not in ("kl", "all", OTHER_TASKS)]
    header = ["model", kl_label, *tasks, "all scored", OTHER_TASKS]
    lines = [
        f"FarSkip layers `{config.farskip.layers}`, {end_step(config.train)} steps of {config.train.batch_tokens} "
        f"tokens. Exact match (greedy, zero-shot, chat template) on {n_scored} held-out prompts of the scored tasks "
        f"and on {n_general} of the other tasks; {kl_label} to the teacher on the scored rows",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
    ]
    for name, scores in report.items():
        kl = "-" if scores["kl"] is None else f"{scores['kl']:.3f}"
        cells = [kl] + [f"{100 * scores[t]:.1f}%" for t in [*tasks, "all", OTHER_TASKS]]
        lines.append("| " + " | ".join([name, *cells]) + " |")
    lines += [
        "",
        f"The teacher learned all ten tasks with the gold answers. FCSD and SFT trained on the same conversion data: "
        f"the scored tasks ({', '.join(TASKS)}) mixed with the others ({', '.join(GENERAL_TASKS)}) on other prompts "
        f"than the held-out ones, answered by another writer ({WRITER_PHRASING:.0%} of its answers open with "
        f"{WRITER_PHRASE.strip()!r}, {WRITER_ERRORS:.0%} hold a mistake; its row scores its answers to the held-out "
        "prompts). FCSD learns the teacher's distributions on that data, SFT the writer's answers.",
    ]
    return "\n".join(lines)
