"""The schedule-free recovery recipe (``recovery=schedule_free``): the optimizer and its warm-up, the
average it scores and saves (checked against the relation between its iterates, y = (1 - b1) z + b1 x), an exact
resume, and the same training in one process, under DDP and under expert parallelism (2 gloo processes)."""

import pytest
import torch
from test_recovery import _batch, config_for, convert_args, killed_at, one_thread, records  # noqa: F401 (autouse)
from test_trainer import assert_same_training, pretrained_assets
from tiny_models import build

from fcsd.cli import main
from fcsd.connectivity import apply_farskip
from fcsd.distill import trainer
from fcsd.distill.objectives import micro_batch_loss
from fcsd.distill.optim import build_optimizer, evaluation_weights, plan_steps

SF = ["recovery=schedule_free"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """test_recovery's briefly pretrained tiny Qwen3-MoE teacher and its data."""
    return pretrained_assets(tmp_path_factory.mktemp("assets"), rows=120, steps=40, batch_size=4)


def _convert_args(assets, *extra):
    return convert_args(assets, *SF, *extra)


def test_optimizer_warms_up_then_holds_the_lr_and_scores_the_average(assets, tmp_path):
    config = config_for(assets, tmp_path / "r", "train.max_steps=400", *SF)  # warm-up: 0.5% of 400 = 2 steps
    student = apply_farskip(build("qwen3_moe"), "all")
    teacher = build("qwen3_moe")
    optimizer, scheduler = build_optimizer(student, config, plan_steps(config, 1))
    assert type(optimizer).__name__ == "AdamWScheduleFree"
    lrs = []
    for step in range(4):
        lrs.append(optimizer.param_groups[0]["lr"])
        micro_batch_loss(student, student, _batch(97, seed=step), config, teacher).total.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    peak = config.recovery.lr_scale * config.train.lr  # the preset: 2x
    assert lrs == pytest.approx([peak / 3, 2 * peak / 3, peak, peak])
    beta1 = config.train.adam_betas[0]
    params = [p for p in student.parameters() if p in optimizer.state]
    trained = [p.detach().clone() for p in params]  # the training iterate y
    z = [optimizer.state[p]["z"] for p in params]
    with evaluation_weights(optimizer):
        with evaluation_weights(optimizer):  # nested (finish() scores, then saves): still the average inside
            pass
        for p, y, zz in zip(params, trained, z, strict=True):
            torch.testing.assert_close(p, (y - (1 - beta1) * zz) / beta1, rtol=1e-4, atol=1e-6)
        assert any(not torch.equal(p, y) for p, y in zip(params, trained, strict=True))
    for p, y in zip(params, trained, strict=True):
        torch.testing.assert_close(p, y)  # back to the training iterate


def test_a_run_scores_and_saves_the_average_and_resumes_exactly(assets, tmp_path, monkeypatch):
    """Through `fcsd convert`: held-out KL falls; final/ holds the average, not the training iterate; a run killed
    after its step-4 checkpoint (held-out evaluations switched the weights before it) resumes exactly."""
    import fcsd

    args = _convert_args(assets, "train.max_steps=8", "train.save_every=2", "train.eval_every=2")
    seen = {}
    original_finish = trainer.TrainingSession.finish

    def finish(self, done):  # the training iterate and the optimizer's z at the end of the run
        params = dict(self.unwrapped.named_parameters())
        seen["y"] = {n: p.detach().clone() for n, p in params.items()}
        seen["z"] = {n: self.optimizer.optimizer.state[p]["z"].clone() for n, p in params.items()}
        return original_finish(self, done)

    monkeypatch.setattr(trainer.TrainingSession, "finish", finish)
    assert main([*args, f"output_dir={tmp_path / 'u'}"]) in (0, None)
    monkeypatch.setattr(trainer.TrainingSession, "finish", original_finish)
    kl = [r["eval/kl"] for r in records(tmp_path / "u") if "eval/kl" in r]
    assert len(kl) == 5 and kl[-1] < 0.8 * kl[0]
    saved = dict(fcsd.from_pretrained(str(tmp_path / "u" / "final")).named_parameters())
    for name, y in seen["y"].items():
        torch.testing.assert_close(saved[name], (y - 0.1 * seen["z"][name]) / 0.9, rtol=1e-4, atol=1e-6)
    assert any(not torch.equal(saved[n], y) for n, y in seen["y"].items())

    killed_at(monkeypatch, [*args, f"output_dir={tmp_path / 'k'}"], 5)
    assert main([*args, f"output_dir={tmp_path / 'k'}", "--resume"]) in (0, None)
    whole, resumed = records(tmp_path / "u"), records(tmp_path / "k")
    for key in ("train/loss", "train/grad_norm", "train/lr", "eval/kl"):
        assert [r[key] for r in resumed if key in r] == [r[key] for r in whole if key in r], key
    assert_same_training(tmp_path / "k", tmp_path / "u")
    # the run's optimizer is part of what it is: resuming it as plain AdamW is refused in one line
    assert main([*args, "recovery=plain", f"output_dir={tmp_path / 'k'}", "--resume"]) == 2


@pytest.mark.parametrize("layout", ["ddp", "parallel.ep_size=2"])
def test_two_gloo_processes_train_as_one(assets, tmp_path, layout):
    """DDP, and expert parallelism (its own gradient reduction; the optimizer's per-mesh groups hold DTensors):
    the same losses, gradient norms and saved average as one process."""
    from launch import torchrun

    args = _convert_args(assets, "train.max_steps=3", "train.micro_batch_size=4", "train.save_every=0")
    args += ["train.grad_clip=0.05"]  # clipping takes part
    assert main([*args, f"output_dir={tmp_path / 'one'}"]) in (0, None)
    extra = [] if layout == "ddp" else [layout]
    torchrun(2, "-m", "fcsd.cli", *args, *extra, f"output_dir={tmp_path / 'two'}", timeout=600)
    assert_same_training(tmp_path / "two", tmp_path / "one")


def test_the_model_card_names_the_optimizer_the_scaled_lr_the_ramp_and_the_guide():
    from fcsd.export.model_card import learning_rate, objective

    train = {"lr": 2e-5, "warmup_steps": 1000}
    recovery = {"optimizer": "schedule_free", "lr_scale": 2.0, "warmup_share": 0.005}
    assert learning_rate(train, recovery) == (
        "4e-05 (schedule-free AdamW, constant after a warm-up of 0.5% of the steps; the average is saved)"
    )
    assert learning_rate(train, {}) == "2e-05 (AdamW, cosine, warm-up 1000 steps)"  # a run written before recipes
    ramp = {**recovery, "batch_ramp": [4, 2], "batch_ramp_shares": [0.033, 0.05]}
    assert learning_rate(train, ramp).endswith(
        "; batch ramp: the first 3.3% of the steps in 4, the next 5.0% of the steps in 2 updates each, at the LR / "
        "sqrt(updates)"
    )
    train = {"objective": "kl", "divergence": "forward_kl"}
    assert objective(train, {"hidden_l2": 4.0, "hidden_l2_share": 0.5}) == (
        "`kl` (forward_kl) + 4 x relative hidden-state error (the teacher's states), fading to 0 over 50% of the steps"
    )
    assert objective(train, {}) == "`kl` (forward_kl)"


def test_a_run_written_before_the_optimizer_keys_resumes_as_plain(assets, tmp_path, monkeypatch):
    """A run config without recovery.optimizer / lr_scale / warmup_share / hidden_l2 (an older fcsd wrote it) reads
    them as the schema's defaults, the paper's AdamW without a guide: it resumes with recovery=plain and is refused
    with the default recipe, in one line."""
    from omegaconf import OmegaConf

    args = _convert_args(assets, "train.max_steps=4", "train.save_every=2", "recovery=plain")

    run = tmp_path / "old"
    killed_at(monkeypatch, [*args, f"output_dir={run}"], 3)
    saved = OmegaConf.load(run / "fcsd_config.yaml")
    for key in ("optimizer", "lr_scale", "warmup_share", "hidden_l2"):
        del saved.recovery[key]
    OmegaConf.save(saved, run / "fcsd_config.yaml")
    assert main([*args[:-1], f"output_dir={run}", "--resume"]) == 2  # now the default: guided
    assert main([*args, f"output_dir={run}", "--resume"]) in (0, None)
    assert [r["step"] for r in records(run) if "train/loss" in r] == [1, 2, 3, 4]


def test_the_warm_up_check_applies_to_the_warm_up_the_run_has(assets, tmp_path):
    """train.warmup_steps longer than the run is refused for the recipe that uses it, not for the default recipe,
    which warms up for recovery.warmup_share of the steps."""
    config = config_for(assets, tmp_path / "r", "train.max_steps=300", "train.warmup_steps=1000", *SF)
    assert config.recovery.warmup_share == 0.005
    with pytest.raises(ValueError, match="train.warmup_steps=1000 is longer than the run"):
        config_for(assets, tmp_path / "r", "train.max_steps=300", "train.warmup_steps=1000", "recovery=plain")
