"""The embedded demo: assets built offline once, reused, and `demo` resolves in every command; the conversion data's
writer; one truth per model (the demo table and lm-eval score the teacher on the same prompts); the demo job."""

import json
import random
from pathlib import Path

import pytest

from fcsd.cli import main, parse_command
from fcsd.cli.stops import resume_hint
from fcsd.embedded import assets as demo_assets
from fcsd.embedded.synthetic import GENERAL_TASKS, TASKS, WRITER_PHRASE

TEACHER_STEPS = 100  # enough for answers of the tasks' lengths, each ended by EOS (the one-truth test needs them)


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory):
    """The demo assets, built once for this module in a cache folder of its own (FCSD_CACHE set while it runs)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("FCSD_CACHE", str(tmp_path_factory.mktemp("cache")))
    patch.setattr(demo_assets, "PRETRAIN_STEPS", TEACHER_STEPS)
    try:
        yield demo_assets.prepare_demo()
    finally:
        patch.undo()


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_demo_is_built_once_and_resolves(demo_root, capsys):
    config = json.loads((demo_root / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    generation = json.loads((demo_root / "model" / "generation_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == 2  # <|end|>: every harness stops there
    # the paper's setting: the conversion data mixes the scored tasks with the others, on other prompts than the
    # held-out ones, answered by another writer
    train = read_rows(demo_root / "data" / "train.jsonl")
    scored = read_rows(demo_root / "data" / "heldout.jsonl")
    general = read_rows(demo_root / "data" / "heldout-general.jsonl")
    assert {row["task"] for row in train} == set(TASKS) | set(GENERAL_TASKS)
    assert {row["task"] for row in scored} == {"add", "sort", "reverse", "recall"} == set(TASKS)
    assert {row["task"] for row in general} == set(GENERAL_TASKS)
    prompts = {row["messages"][0]["content"] for row in train}
    assert not prompts & {row["messages"][0]["content"] for row in scored + general}
    phrased = sum(row["messages"][-1]["content"].startswith(WRITER_PHRASE) for row in train) / len(train)
    assert 0.28 < phrased < 0.38
    stamp = (demo_root / "model" / "config.json").stat().st_mtime_ns
    assert demo_assets.prepare_demo() == demo_root
    assert (demo_root / "model" / "config.json").stat().st_mtime_ns == stamp
    assert main(["inspect", "demo", "--layers", "last:50%", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["converted_layers"] == [3, 4, 5]


def test_a_changed_builder_gets_another_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("FCSD_CACHE", str(tmp_path / "cache"))
    first = demo_assets.demo_dir()
    # a value patched at run time is not the builder: a sweep's jobs and torchrun's ranks find their parent's demo
    monkeypatch.setattr(demo_assets, "PRETRAIN_STEPS", demo_assets.PRETRAIN_STEPS + 1)
    assert demo_assets.demo_dir() == first
    edited = tmp_path / "demo_assets.py"  # the builder's code edited: another folder
    source = Path(demo_assets.__file__).read_text()
    edited.write_text(source.replace("PRETRAIN_STEPS = ", "PRETRAIN_STEPS = 1 + "))
    sources = demo_assets.builder_sources()
    monkeypatch.setattr(demo_assets, "builder_sources", lambda: (str(edited), *sources[1:]))
    assert demo_assets.demo_dir() != first and demo_assets.demo_dir().parent == first.parent == tmp_path / "cache"


def test_teacher_pretraining_learns():
    from transformers import Qwen3MoeForCausalLM

    from fcsd.embedded.synthetic import make_dataset
    from fcsd.embedded.tokenizer import train_tokenizer

    rows = make_dataset(300)
    tokenizer = train_tokenizer((m["content"] for r in rows for m in r["messages"]), vocab_size=300)
    model = Qwen3MoeForCausalLM(demo_assets.demo_config(len(tokenizer)))
    losses = demo_assets.pretrain_teacher(model, tokenizer, rows, steps=40, batch_size=4, seq_len=64)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


def test_the_writer_answers_in_its_own_way():
    """About half of the writer's answers are the gold answer: a third open with its phrase, a quarter hold a
    mistake (the same items in another order, or one item one off)."""
    from fcsd.embedded.synthetic import writer_answer

    rng = random.Random(0)
    for gold in ("1 3 6 7", "12", "c"):
        answers = [writer_answer(gold, rng) for _ in range(3000)]
        assert 0.45 < sum(answer == gold for answer in answers) / len(answers) < 0.55
        phrased = [answer.removeprefix(WRITER_PHRASE) for answer in answers if answer.startswith(WRITER_PHRASE)]
        assert 0.30 < len(phrased) / len(answers) < 0.37
        wrong = [a for a in (answer.removeprefix(WRITER_PHRASE) for answer in answers) if a != gold]
        assert 0.22 < len(wrong) / len(answers) < 0.28
        if " " in gold:
            assert all(sorted(a.split()) == sorted(gold.split()) for a in wrong)
        else:
            assert {a for a in wrong} <= ({"11", "13"} if gold == "12" else {"b"})


def test_the_demo_teacher_scores_the_same_in_the_table_and_in_lm_eval(demo_root):
    """One truth per model: lm-eval's `demo-gen` holds the demo's held-out rows and renders them as the demo's
    table does (chat template, zero-shot, greedy until EOS), so the teacher's completions are the same, row by row."""
    from fcsd.evaluate.exact_match import exact_match_of, greedy_answers
    from fcsd.evaluate.harness import load_for_eval, run_suite, task_score
    from fcsd.evaluate.suites import eval_dir, load_suite

    rows = read_rows(demo_root / "data" / "heldout.jsonl")
    task_rows = read_rows(eval_dir() / "tasks" / "fcsd_demo" / "heldout.jsonl")
    assert [(r["question"], r["answer"]) for r in task_rows] == [
        (r["messages"][0]["content"], r["messages"][1]["content"]) for r in rows
    ]
    model, tokenizer = load_for_eval(str(demo_root / "model"), device="cpu")
    ours = greedy_answers(model, tokenizer, rows)
    # a teacher that answers: some answers end early in their batch (where a missing EOS showed), lengths vary
    assert len({len(answer) for answer in ours}) > 2 and sum(answer == "" for answer in ours) < len(ours) / 2
    suite = load_suite("demo")
    suite.tasks = [spec for spec in suite.tasks if spec.task == "fcsd_demo_gen"]
    results = run_suite(model, tokenizer, suite, batch_size=64, log_samples=True)
    samples = sorted(results["samples"]["fcsd_demo_gen"], key=lambda sample: sample["doc_id"])
    assert [sample["filtered_resps"][0].strip() for sample in samples] == ours
    assert abs(task_score(results, suite.tasks[0]) - 100 * exact_match_of(ours, rows)["all"]) <= 2.0


def test_the_report_counts_the_steps_the_runs_made():
    """A demo with train.stop_after stops its runs early: the report's steps are theirs, not the schedule's."""
    from fcsd.cli.demo import format_report
    from fcsd.distill.config import FCSDConfig

    config = FCSDConfig()
    config.train.max_steps, config.train.stop_after, config.train.batch_tokens = 8, 3, 2048
    row = {"kl": 0.1, "add": 1.0, "all": 1.0, "other tasks": 1.0}
    assert "3 steps of 2048 tokens" in format_report({"teacher": row}, config, 10, 10)


def test_a_demo_stopped_in_its_fcsd_run_resumes_it_and_then_trains_the_sft_run(demo_root, tmp_path, monkeypatch):
    """``--resume`` continues the stopped FCSD run and trains the SFT run the stop never reached (it stopped with
    "output_dir ... does not exist" before)."""
    from test_recovery import killed_at

    out = tmp_path / "demo"
    argv = ["convert", "demo", "train.max_steps=4", "train.save_every=2", f"output_dir={out}", "progress=false"]
    killed_at(monkeypatch, argv, 3)
    assert (out / "fcsd-kl" / "checkpoints").exists() and not (out / "fcsd-sft").exists()
    # the line a stop prints names the stopped run's checkpoint and --resume (it said "no checkpoint was saved yet:
    # run the same command again", and the same command deletes the demo's runs)
    hint = resume_hint(parse_command(argv))
    assert f"the last checkpoint is step-2 in {out / 'fcsd-kl'}" in hint and "--resume`" in hint, hint
    assert main([*argv, "--resume"]) == 0
    assert "the demo's runs in" in resume_hint(parse_command(argv))  # a stop in its report: both runs had finished
    for run in ("fcsd-kl", "fcsd-sft"):
        assert json.loads((out / run / "final" / "fcsd_checkpoint.json").read_text())["step"] == 4
    report = json.loads((out / "demo_report.json").read_text())
    assert report["after SFT, same budget"]["kl"] > 0


def test_the_demo_folder_is_claimed_before_anything_trains(tmp_path, monkeypatch, capsys):
    """The demo's output_dir is checked and locked before the demo is built or trains: a user's demo_report.md (it
    was overwritten), the current folder, a folder of another kind and a folder another demo holds are refused in one
    line; an unmarked folder an earlier demo wrote (its runs beside its reports) is the demo's."""
    from fcsd.cli import demo
    from fcsd.files import ownership

    monkeypatch.setattr(demo_assets, "prepare_demo", lambda: pytest.fail("built before the folder was checked"))
    mine, export = tmp_path / "mine", tmp_path / "export"
    mine.mkdir()
    (mine / "demo_report.md").write_text("my notes")
    ownership.mark(export, "export")
    cases = [
        (f"output_dir={mine}", "holds demo_report.md, which fcsd did not write and the demo would replace; move it"),
        ("output_dir=.", "is the current folder"),
        (f"output_dir={export}", "is an fcsd export, not a demo folder"),
    ]
    monkeypatch.chdir(tmp_path)
    for override, message in cases:
        assert main(["convert", "demo", override]) == 2
        assert message in capsys.readouterr().err
    assert (mine / "demo_report.md").read_text() == "my notes"
    busy = tmp_path / "busy"
    with ownership.folder_lock(busy, "output_dir"):
        assert main(["convert", "demo", f"output_dir={busy}"]) == 2
        assert "in use" in capsys.readouterr().err
    assert not demo._holds_demo_runs(mine)
    ownership.mark(mine / "fcsd-kl", "run")  # the report beside an earlier demo's run is that demo's
    assert demo._holds_demo_runs(mine)


def test_convert_demo_with_the_teacher_cache_reports_its_top_k_kl(demo_root, tmp_path, capsys):
    """With ``teacher.mode=cache`` the runs score the cache's top-k KL (no full KL): the report says so (it stopped
    with a KeyError before)."""
    out = tmp_path / "demo"
    cache = ["teacher.mode=cache", f"teacher.cache_dir={tmp_path / 'cache'}", "teacher.top_k=16"]
    argv = [
        "convert",
        "demo",
        "train.max_steps=2",
        "train.warmup_steps=1",
        *cache,
        f"output_dir={out}",
        "progress=false",
    ]
    assert main(["cache-teacher", *argv[1:]]) == 0
    assert main(argv) == 0
    assert "| model | held-out top-k KL (from the teacher cache) |" in capsys.readouterr().out
    report = json.loads((out / "demo_report.json").read_text())
    rows = ("converted, before training", "after FCSD (KL)", "after SFT, same budget")
    assert all(report[row]["kl"] > 0 for row in rows)  # two steps: the KL need not have fallen yet


def test_convert_demo_prints_the_comparison_table(demo_root, tmp_path, capsys):
    """`fcsd convert demo` end to end on a tiny budget: FCSD and SFT runs, then the five-row report."""
    out = tmp_path / "demo"
    argv = ["convert", "demo", "train.max_steps=2", "train.warmup_steps=1", f"output_dir={out}", "progress=false"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    rows = ("teacher", "the conversion data's writer", "converted, before training", "after FCSD (KL)")
    for row in (*rows, "after SFT, same budget"):
        assert f"| {row} |" in printed
    assert "answered by another writer (33% of its answers open with 'the answer is', 25% hold a mistake" in printed
    report = json.loads((out / "demo_report.json").read_text())
    assert report["teacher"]["kl"] == 0.0 and report["converted, before training"]["kl"] > 0
    assert report["the conversion data's writer"]["kl"] is None
    assert 0.3 < report["the conversion data's writer"]["all"] < 0.7
    assert set(report["teacher"]) == {"kl", "add", "sort", "reverse", "recall", "all", "other tasks"}
    for run in ("fcsd-kl", "fcsd-sft"):
        assert (out / run / "final" / "config.json").exists()
    # it ends with lm-eval on the demo suite: teacher vs the FCSD model, the table also in the export's card
    assert set(report["lm-eval"]) == {"original", "converted", "delta"}
    assert set(report["lm-eval"]["converted"]) == {"demo-gen", "demo-choice", "Avg"}
    assert "| converted (" in (out / "fcsd-kl" / "export" / "README.md").read_text()
    teacher = 100 * report["teacher"]["all"]
    assert abs(report["lm-eval"]["original"]["demo-gen"] - teacher) <= 2.0
    assert f"{teacher:.1f}% in the table above" in printed
    # `make demo` again: the demo replaces its own runs (evaluation and export included), nothing else
    (out / "notes.txt").write_text("mine")
    assert main([*argv[:2], "train.max_steps=1", *argv[3:]]) == 0
    assert json.loads((out / "fcsd-kl" / "final" / "fcsd_checkpoint.json").read_text())["step"] == 1
    assert (out / "notes.txt").read_text() == "mine"
