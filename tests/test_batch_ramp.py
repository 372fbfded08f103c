"""The batch-size ramp of the guided recipe (``recovery.batch_ramp``): which steps are split, how a split
step's rows are shared by its updates and the processes, that a split step trains exactly as the smaller steps it
stands for (and not as one step), one process against DDP, and a run killed inside the ramp resuming exactly."""

import pytest
import torch
from test_recovery import config_for, convert_args, killed_at, one_thread, records  # noqa: F401 (autouse)
from test_trainer import assert_same_training, pretrained_assets

import fcsd
from fcsd.cli import main
from fcsd.distill.config import update_split
from fcsd.distill.optim import StepPlan
from fcsd.run_facts import ramp_stages

# 8 sequences of 32 tokens a step (test_trainer's FAST), guide off and no warm-up: the LR is constant from step 0
PLAIN_SF = ["recovery=guided", "recovery.hidden_l2=0", "recovery.warmup_share=0"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return pretrained_assets(tmp_path_factory.mktemp("assets"), rows=120, steps=40, batch_size=4)


def test_the_ramp_splits_its_share_of_the_steps_and_refuses_a_malformed_one(assets, tmp_path):
    config = config_for(assets, tmp_path / "a", "recovery.batch_ramp=[4,2]", "recovery.batch_ramp_shares=[0.1,0.2]")
    config.train.max_steps = 20
    assert [update_split(config, step) for step in range(20)] == [4, 4] + [2] * 4 + [1] * 14
    assert ramp_stages(config) == [(0, 2, 4), (2, 6, 2)]
    guided = config_for(assets, tmp_path / "b", "recovery=guided")
    assert guided.recovery.batch_ramp == [4, 2]  # the default's
    guided.train.max_steps = 1800
    assert ramp_stages(guided) == [(0, 59, 4), (59, 149, 2)]
    guided.train.max_steps = 6  # 3.3% and 5% of 6 steps round to none: no step is split
    assert ramp_stages(guided) == [] and update_split(guided, 0) == 1
    with pytest.raises(ValueError, match="to turn the ramp off set both"):
        config_for(assets, tmp_path / "e", "recovery=guided", "recovery.batch_ramp=[]")
    for overrides in (
        ["recovery.batch_ramp=[4,2]", "recovery.batch_ramp_shares=[0.1]"],
        ["recovery.batch_ramp=[1]", "recovery.batch_ramp_shares=[0.1]"],
        ["recovery.batch_ramp=[2]", "recovery.batch_ramp_shares=[1.0]"],
    ):
        with pytest.raises(ValueError, match="recovery.batch_ramp="):
            config_for(assets, tmp_path / "c", *overrides)


def test_a_split_steps_rows_are_shared_by_its_updates_as_a_whole_step_by_the_processes():
    plan = StepPlan(sequences=8, micro_batch_size=2, accumulation=2, world_size=2, total_steps=10, schedule_steps=10)
    rows = list(range(10, 18))
    assert [plan.update_rows(rows, 1, rank) for rank in (0, 1)] == [
        [[[10, 11], [14, 15]]],  # a whole step: micro-batch i of rank r holds rows (i * 2 + r) * 2 ...
        [[[12, 13], [16, 17]]],
    ]
    assert [plan.update_rows(rows, 2, rank) for rank in (0, 1)] == [
        [[[10, 11]], [[14, 15]]],  # two updates: the first half of the step, then the second
        [[[12, 13]], [[16, 17]]],
    ]
    assert [plan.update_rows(rows, 4, rank) for rank in (0, 1)] == [
        [[[10]], [[12]], [[14]], [[16]]],
        [[[11]], [[13]], [[15]], [[17]]],
    ]
    assert [plan.fit_split(k) for k in (1, 2, 3, 4, 8)] == [1, 2, 2, 4, 4]  # 4 rows per process


def assert_trains_as(run, same, other) -> None:
    """The final weights of the run in folder ``run`` equal those of ``same`` and differ from those of ``other``."""
    mine, same_w, other_w = (fcsd.from_pretrained(str(out / "final")).state_dict() for out in (run, same, other))
    for name, value in mine.items():
        torch.testing.assert_close(value, same_w[name], msg=name)
    assert any(not torch.allclose(value, other_w[name]) for name, value in mine.items())


def test_a_split_step_trains_as_the_smaller_steps_it_stands_for(assets, tmp_path):
    """Step 0 of a run whose ramp splits it in two equals steps 0 and 1 of a run with half the batch at the LR over
    sqrt(2) (the same rows, in the same order); the same step unsplit does not."""
    ramp = ["recovery.batch_ramp=[2]", "recovery.batch_ramp_shares=[0.5]"]
    split = convert_args(assets, *PLAIN_SF, *ramp, "train.max_steps=2", "train.stop_after=1", "train.lr=1e-3")
    assert main([*split, f"output_dir={tmp_path / 'split'}"]) in (0, None)
    small = ["train.batch_tokens=128", "train.micro_batch_size=2", "train.max_steps=4", "train.stop_after=2"]
    halves = convert_args(assets, *PLAIN_SF, *small, f"train.lr={1e-3 / 2**0.5}")
    assert main([*halves, f"output_dir={tmp_path / 'halves'}"]) in (0, None)
    whole = convert_args(assets, *PLAIN_SF, "train.max_steps=2", "train.stop_after=1", "train.lr=1e-3")
    assert main([*whole, f"output_dir={tmp_path / 'whole'}"]) in (0, None)
    assert_trains_as(tmp_path / "split", tmp_path / "halves", tmp_path / "whole")


RAMP = ["recovery.batch_ramp=[4,2]", "recovery.batch_ramp_shares=[0.25,0.25]"]


@pytest.mark.parametrize("layout", ["ddp", "parallel.ep_size=2"])
def test_two_gloo_processes_ramp_as_one(assets, tmp_path, layout):
    """Each update of a split step syncs (DDP) or reduces (expert parallelism) its own gradients: the same losses,
    gradient norms and weights as one process."""
    from launch import torchrun

    args = convert_args(assets, "recovery=guided", *RAMP, "train.micro_batch_size=1", "train.max_steps=4")
    assert main([*args, "train.save_every=0", f"output_dir={tmp_path / 'one'}"]) in (0, None)
    extra = [] if layout == "ddp" else [layout]
    torchrun(2, "-m", "fcsd.cli", *args, *extra, "train.save_every=0", f"output_dir={tmp_path / 'two'}", timeout=600)
    # two processes sum the routers' gradients in another order (DDP's bucketed all-reduce, expert parallelism's
    # exchanges), and 8 Adam updates of 1-row batches carry that float noise to ~2e-5 on weights of ~1.5 (measured:
    # 1.4e-5 under DDP with accelerate 1.16); an update missing a reduction would differ by the LR, 4e-3
    assert_same_training(tmp_path / "two", tmp_path / "one", rtol=1e-4, atol=1e-4)


def test_the_run_says_which_steps_the_ramp_splits_and_lowers_a_split_a_step_cannot_share(assets, tmp_path, capsys):
    args = convert_args(assets, "recovery=guided", *RAMP, "train.max_steps=4", "train.save_every=0")
    assert main([*args, f"output_dir={tmp_path / 'eight'}"]) in (0, None)
    assert "batch ramp: steps 1-1 in 4 updates, steps 2-2 in 2 updates, each at" in capsys.readouterr().out
    assert main([*args, "train.batch_tokens=64", f"output_dir={tmp_path / 'two'}"]) in (0, None)  # 2 sequences
    out = capsys.readouterr().out
    assert "steps 1-1 in 2 updates (not 4: this process holds 2 sequences of a step), steps 2-2 in 2 updates" in out


def test_a_run_killed_inside_the_ramp_resumes_exactly(assets, tmp_path, monkeypatch, capsys):
    args = convert_args(
        assets, "recovery=guided", *RAMP, "train.max_steps=8", "train.save_every=1", "train.log_every=1"
    )
    assert main([*args, f"output_dir={tmp_path / 'u'}"]) in (0, None)
    killed_at(monkeypatch, [*args, f"output_dir={tmp_path / 'k'}"], 3)
    capsys.readouterr()
    assert main([*args, "recovery.batch_ramp_shares=[0.25,0.5]", f"output_dir={tmp_path / 'k'}", "--resume"]) == 2
    assert "recovery.batch_ramp_shares" in capsys.readouterr().err
    assert main([*args, f"output_dir={tmp_path / 'k'}", "--resume"]) in (0, None)
    for key in ("train/loss", "train/grad_norm", "eval/kl"):
        assert [r[key] for r in records(tmp_path / "k") if key in r] == [
            r[key] for r in records(tmp_path / "u") if key in r
        ]
    assert_same_training(tmp_path / "k", tmp_path / "u")


def test_an_update_the_guard_refuses_is_skipped_alone_and_its_step_logged_as_skipped(
    assets, tmp_path, monkeypatch, capsys
):
    """The spike guard judges each update of a split step: refused ones are named in one line a step (it was one
    line per update, twice: printed and logged), and the step is logged as skipped."""
    from fcsd.distill import trainer

    calls, original = [], trainer.apply_update

    def refuse_second(optimizer, scaler, guard, loss, grad_norm):
        calls.append(loss)
        if len(calls) <= 2:
            return False, "planted refusal"
        return original(optimizer, scaler, guard, loss, grad_norm)

    monkeypatch.setattr(trainer, "apply_update", refuse_second)
    ramp = ["recovery.batch_ramp=[2]", "recovery.batch_ramp_shares=[0.5]", "train.log_every=1"]
    args = convert_args(assets, *PLAIN_SF, *ramp, "train.max_steps=2", f"output_dir={tmp_path / 'r'}")
    assert main(args) in (0, None)
    said = capsys.readouterr()
    assert [line for line in said.out.splitlines() if "not applied" in line] == [
        "step 1 (updates 1, 2 of 2) not applied: planted refusal"
    ]
    assert "not applied" not in said.err
    assert len(calls) == 3  # step 1 split in two, step 2 whole
    assert [r["train/skipped"] for r in records(tmp_path / "r") if "train/loss" in r] == [True, False]
