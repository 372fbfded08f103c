"""MBPP+ early stopping (paper Sec. 3.1, 5.1): the decision rule on scripted scores, evalplus scoring of the offline
fixture, generation with a tiny model, and the trainer stopping, exporting its best checkpoint and resuming."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from launch import torchrun
from test_trainer import FAST, assets, config_for  # noqa: F401  (the module fixture is shared)

import fcsd
from fcsd.distill.convert import convert
from fcsd.distill.early_stopping import EarlyStopping
from fcsd.evaluate import mbpp_plus

FIXTURE = Path(__file__).resolve().parents[1] / "eval" / "fixtures" / "mbpp_plus_mini.jsonl"
EARLY = ["early_stop.enabled=true", f"early_stop.data={FIXTURE}", "early_stop.max_new_tokens=16"]


def run(scores, patience=3, min_delta=2.0):
    rule = EarlyStopping(patience, min_delta)
    return rule, [rule.update(step, score) for step, score in enumerate(scores)]


def test_improvements_reset_patience_and_a_plateau_stops():
    rule, decisions = run([10, 15, 15, 16, 30, 29, 29, 29])
    assert [d.significant for d in decisions] == [True, True, False, False, True, False, False, False]
    assert [d.stop for d in decisions] == [False] * 7 + [True]
    assert (rule.best_score, rule.best_step, rule.stopped_at) == (30, 4, 7)


def test_min_delta_is_absolute_and_exclusive():
    _, decisions = run([50, 52, 51, 52.01], patience=5)
    assert [d.significant for d in decisions] == [True, False, False, True]  # +2.00 is not > 2 points; +2.01 is
    assert [d.new_best for d in decisions] == [True, True, False, True]  # the best checkpoint follows any increase
    _, relative = run([50, 50.9], patience=5)
    assert not relative[1].significant  # 50.9 is 1.8% above 50 relative, 0.9 absolute: absolute decides


def test_small_gains_become_best_but_do_not_reset_patience():
    rule, decisions = run([20, 21, 21.5, 22], patience=3)
    assert [d.new_best for d in decisions] == [True, True, True, True]
    assert decisions[-1].stop and rule.best_step == 3 and rule.reference == 20


def test_patience_counts_evaluations_and_resume_continues_the_count():
    scores = [40, 35, 41, 39, 38]
    uninterrupted, expected = run(scores)
    first = EarlyStopping(3, 2.0)
    for step, score in enumerate(scores[:2]):
        first.update(step, score)
    resumed = EarlyStopping.from_state(json.loads(json.dumps(first.state())))
    after = [resumed.update(step, score) for step, score in list(enumerate(scores))[2:]]
    assert after == expected[2:] and after[-1].stop
    assert resumed.state() == uninterrupted.state()
    with pytest.raises(ValueError, match="patience=0"):
        EarlyStopping(0, 2.0)


def test_evalplus_scores_base_and_plus_tests_in_sandboxes():
    problems = mbpp_plus.load_problems(str(FIXTURE))
    assert list(problems) == ["Mbpp/3", "Mbpp/4", "Mbpp/8", "Mbpp/17", "Mbpp/62"]
    assert list(mbpp_plus.load_problems(str(FIXTURE), limit=2)) == ["Mbpp/3", "Mbpp/4"]
    solutions = {task: problem["canonical_solution"] for task, problem in problems.items()}
    assert mbpp_plus.score_solutions(problems, solutions).plus == 100.0
    solutions["Mbpp/8"] = "def square_nums(nums):\n    return [2 * x for x in nums]\n"  # wrong
    solutions["Mbpp/17"] = "def square_perimeter(a):\n    while True:\n        pass\n"  # never returns
    # right on the base inputs, wrong on the extra ones (a one-element list): MBPP passes, MBPP+ fails
    solutions["Mbpp/62"] = "def smallest_num(xs):\n    return sorted(xs)[0] if len(xs) > 1 else 0\n"
    del solutions["Mbpp/3"]  # no solution: a failure
    score = mbpp_plus.score_solutions(problems, solutions)
    assert score.status == {
        "Mbpp/3": ["fail", "fail"],
        "Mbpp/4": ["pass", "pass"],
        "Mbpp/8": ["fail", "fail"],
        "Mbpp/17": ["fail", "fail"],  # stopped by the per-test time limit
        "Mbpp/62": ["pass", "fail"],
    }
    assert (score.base, score.plus) == (40.0, 20.0)


def test_unloadable_mbpp_plus_data_is_a_clear_error(tmp_path):
    with pytest.raises(mbpp_plus.MBPPPlusUnavailable, match="does not exist"):
        mbpp_plus.load_problems(str(tmp_path / "MbppPlus.jsonl"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"task_id": "Mbpp/2", "prompt": "x"}) + "\n")
    with pytest.raises(mbpp_plus.MBPPPlusUnavailable, match="early_stop.data=PATH"):
        mbpp_plus.load_problems(str(broken))


def test_a_tiny_model_generates_and_is_scored(assets):  # noqa: F811
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets / "model")
    model = fcsd.from_pretrained(str(assets / "model"))
    problems = mbpp_plus.load_problems(str(FIXTURE))
    prompt = mbpp_plus.chat_prompt(problems["Mbpp/8"], tokenizer)
    assert mbpp_plus.INSTRUCTION_PREFIX in prompt and "square_nums" in prompt and prompt.endswith("```python\n")
    solutions = mbpp_plus.generate_solutions(model, tokenizer, problems, max_new_tokens=12, batch_size=2)
    assert set(solutions) == set(problems) and all(isinstance(code, str) for code in solutions.values())
    score = mbpp_plus.score_solutions(problems, solutions)
    assert set(score.status) == set(problems) and score.plus <= score.base


def summary_of(out) -> dict:
    return json.loads((Path(out) / "run_summary.json").read_text())


def test_early_stopping_stops_the_run_and_exports_the_best_checkpoint(assets, tmp_path):  # noqa: F811
    config = config_for(
        assets, tmp_path / "run", *EARLY, "train.max_steps=12", "early_stop.every=2", "early_stop.patience=2"
    )
    result = convert(config)
    assert result.steps == 4  # the tiny model never writes passing Python: 0% at steps 0, 2 and 4 -> stop
    early = summary_of(tmp_path / "run")["early_stop"]
    assert list(early["scores"]) == ["0", "2", "4"] and early["stopped_at"] == 4 and early["best_step"] == 0
    assert early["step_0"] == early["final"] == {"base": 0.0, "plus": 0.0}
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "early_stop/mbpp_plus" in r] == [0, 2, 4]
    assert max(r["step"] for r in records if "train/loss" in r) == 4
    # the best checkpoint is the converted model of step 0: its weights are the original ones, final/ moved on
    original, final = fcsd.from_pretrained(str(assets / "model")), fcsd.from_pretrained(str(result.final_dir))
    exported = fcsd.from_pretrained(str(tmp_path / "run" / "export"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(exported.state_dict()[name], original.state_dict()[name])
    assert not torch.equal(final.state_dict()[name], original.state_dict()[name])
    assert fcsd.farskip_layers(exported) == fcsd.farskip_layers(final)


def scripted(monkeypatch, plus_scores: list[float]):
    """Replace the evalplus verdicts by ``plus_scores`` in order (generation still runs)."""
    scores = iter(plus_scores)

    def score(problems, solutions, workers=None):
        value = next(scores)
        return mbpp_plus.MBPPPlusScore(value, value, len(problems), {})

    monkeypatch.setattr(mbpp_plus, "score_solutions", score)


def test_the_best_checkpoint_follows_the_highest_score(assets, tmp_path, monkeypatch):  # noqa: F811
    scripted(monkeypatch, [0.0, 10.0, 11.0, 5.0, 5.0])
    config = config_for(
        assets, tmp_path / "run", *EARLY, "train.max_steps=9", "early_stop.every=1", "early_stop.patience=2"
    )
    result = convert(config)
    early = summary_of(tmp_path / "run")["early_stop"]
    # 10 > 0 + 2 resets patience; 11 is a new best but within 2 points; 5 is the second evaluation without gain
    assert (result.steps, early["best_step"], early["best_score"], early["stopped_at"]) == (3, 2, 11.0, 3)
    assert json.loads((tmp_path / "run" / "best" / "fcsd_checkpoint.json").read_text())["step"] == 2
    assert json.loads((tmp_path / "run" / "final" / "fcsd_checkpoint.json").read_text())["step"] == 3


def test_resume_keeps_the_early_stopping_state(assets, tmp_path, monkeypatch):  # noqa: F811
    args = [*EARLY, "train.max_steps=9", "early_stop.every=1", "early_stop.patience=3", "train.save_every=2"]
    scripted(monkeypatch, [0.0] * 4)
    convert(config_for(assets, tmp_path / "run", *args))
    assert summary_of(tmp_path / "run")["early_stop"]["stopped_at"] == 3
    # continue from the step-2 checkpoint: evaluations 0, 1, 2 are in its state, so step 3 exhausts patience
    for later in ("final", "export", "run_summary.json"):
        target = tmp_path / "run" / later
        target.unlink() if target.is_file() else shutil.rmtree(target)
    scripted(monkeypatch, [0.0] * 4)
    result = convert(config_for(assets, tmp_path / "run", *args, "train.resume=true"))
    early = summary_of(tmp_path / "run")["early_stop"]
    assert result.steps == 3 and list(early["scores"]) == ["0", "1", "2", "3"] and early["stopped_at"] == 3


def test_two_processes_take_the_same_decision(assets, tmp_path):  # noqa: F811
    args = ["-m", "fcsd.cli", "convert", str(assets / "model"), f"data.path={assets / 'train.jsonl'}"]
    args += [f"data.cache_dir={assets / 'cache'}", *FAST, *EARLY, "train.max_steps=12", "train.micro_batch_size=4"]
    args += ["early_stop.every=2", "early_stop.patience=1", f"output_dir={tmp_path / 'two'}"]
    torchrun(2, *args)
    early = summary_of(tmp_path / "two")["early_stop"]
    assert early["stopped_at"] == 2 and early["problems"] == 5 and summary_of(tmp_path / "two")["steps"] == 2


def test_missing_mbpp_plus_fails_before_training(assets, tmp_path, capsys):  # noqa: F811
    from fcsd.cli import main

    argv = ["convert", str(assets / "model"), f"data.path={assets / 'train.jsonl'}", *FAST, f"output_dir={tmp_path}/o"]
    assert main([*argv, "early_stop.enabled=true", f"early_stop.data={tmp_path / 'MbppPlus.jsonl'}"]) == 2
    assert "MbppPlus.jsonl does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # nothing trained, nothing written
