"""The guided recovery recipe (``recovery=guided``, fcsd's default): the relative hidden-state loss
against a hand computation, its place in the micro-batch loss (the teacher's states, not the student's), a run
through `fcsd convert` and its resume, and the same training in one process, under DDP and under expert parallelism
(2 gloo processes)."""

from types import SimpleNamespace

import pytest
import torch
from test_recovery import _batch, _models, convert_args, killed_at, one_thread, records  # noqa: F401 (autouse)
from test_trainer import assert_same_training, pretrained_assets

from fcsd.cli import main
from fcsd.distill import losses
from fcsd.distill.objectives import micro_batch_loss

GUIDED = ["recovery=guided"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """test_recovery's briefly pretrained tiny Qwen3-MoE teacher and its data."""
    return pretrained_assets(tmp_path_factory.mktemp("assets"), rows=120, steps=40, batch_size=4)


def _convert_args(assets, *extra):
    return convert_args(assets, *GUIDED, *extra)


def _by_hand(student_states, teacher_states) -> float:
    """Sum over tokens of the mean over layers of ||o - t||^2 / ||t||^2, one token and one layer at a time."""
    total = 0.0
    for b in range(student_states[0].shape[0]):
        for t in range(student_states[0].shape[1]):
            errors = [
                float(((o[b, t] - s[b, t]) ** 2).sum() / (s[b, t] ** 2).sum())
                for o, s in zip(student_states, teacher_states, strict=True)
            ]
            total += sum(errors) / len(errors)
    return total


def test_relative_hidden_loss_matches_a_hand_computation_and_is_scale_free():
    generator = torch.Generator().manual_seed(0)
    student = [torch.randn(2, 5, 8, generator=generator) for _ in range(3)]
    teacher = [torch.randn(2, 5, 8, generator=generator) * 10**i for i in range(3)]  # layers of unlike scales
    value = losses.relative_hidden_l2(student, teacher)
    assert value.item() == pytest.approx(_by_hand(student, teacher), rel=1e-5)
    assert losses.relative_hidden_l2([3 * s for s in student], [3 * t for t in teacher]).item() == pytest.approx(
        value.item(), rel=1e-5
    )
    assert losses.relative_hidden_l2(teacher, teacher).item() == 0.0
    with pytest.raises(ValueError, match="matching layers"):
        losses.relative_hidden_l2(student, teacher[:2])


def _config(hidden_l2: float):
    train = dict(objective="kl", divergence="forward_kl", temperature=1.0, jsd_beta=0.5, l2_coef=0.0)
    train = SimpleNamespace(**train, loss_chunk_size=7, router_aux_coef=0.0)
    return SimpleNamespace(train=train, recovery=SimpleNamespace(hidden_l2=hidden_l2))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_the_guide_compares_the_students_states_with_the_teachers(family):
    """The micro-batch loss adds ``hidden_l2`` times the relative error between the student's own hidden states and
    the teacher's (both from independent forwards here), and that term reaches the weights."""
    teacher, student = _models(family)
    with torch.no_grad():
        for p in student.parameters():  # a student that differs from the teacher also before the rewiring
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    batch = _batch(teacher.config.vocab_size)
    with torch.no_grad():
        own = student(input_ids=batch.input_ids, output_hidden_states=True).hidden_states[1:]
        target = teacher(input_ids=batch.input_ids, output_hidden_states=True).hidden_states[1:]
    grads = []
    for weight in (0.0, 4.0):
        student.zero_grad()
        parts = micro_batch_loss(student, student, batch, _config(weight), teacher)
        parts.total.backward()
        grads.append([p.grad.clone() for p in student.parameters()])
        if weight:
            assert parts.terms["hidden"].item() == pytest.approx(_by_hand(own, target), rel=1e-4)
            assert parts.total.item() == pytest.approx((parts.terms["kl"] + weight * parts.terms["hidden"]).item())
        else:
            assert "hidden" not in parts.terms
    assert any(not torch.allclose(a, b) for a, b in zip(*grads, strict=True))


def test_a_guided_run_fades_its_guide_and_resumes_exactly_only_with_its_weight(assets, tmp_path, monkeypatch, capsys):
    """Through `fcsd convert`: held-out KL falls; each step's loss is its KL plus the guide at the step's weight,
    4 falling linearly to 0 at half the run (3 of 6 steps), then KL alone; a run killed at step 5 resumes exactly,
    and not with another guide weight."""
    args = _convert_args(assets, "train.max_steps=6", "train.save_every=2", "train.eval_every=2", "train.log_every=1")
    assert main([*args, f"output_dir={tmp_path / 'u'}"]) in (0, None)
    whole = records(tmp_path / "u")
    kl = [r["eval/kl"] for r in whole if "eval/kl" in r]
    assert len(kl) == 4 and kl[-1] < 0.8 * kl[0]
    steps = [r for r in whole if "train/loss" in r]
    assert [r["step"] for r in steps if "train/hidden" in r] == [1, 2, 3]  # weights 4, 8/3, 4/3; then 0
    for record, weight in zip(steps, (4.0, 8 / 3, 4 / 3), strict=False):
        expected = record["train/kl"] + weight * record["train/hidden"]
        assert record["train/loss"] == pytest.approx(expected, rel=1e-5)
    assert steps[1]["train/hidden"] < steps[0]["train/hidden"]

    killed_at(monkeypatch, [*args, f"output_dir={tmp_path / 'k'}"], 5)
    capsys.readouterr()
    assert main([*args, "recovery.hidden_l2=1", f"output_dir={tmp_path / 'k'}", "--resume"]) == 2
    assert "recovery.hidden_l2" in capsys.readouterr().err
    assert main([*args, f"output_dir={tmp_path / 'k'}", "--resume"]) in (0, None)
    resumed = records(tmp_path / "k")
    for key in ("train/loss", "train/hidden", "train/kl", "eval/kl"):
        assert [r[key] for r in resumed if key in r] == [r[key] for r in whole if key in r], key
    assert_same_training(tmp_path / "k", tmp_path / "u")


def test_the_guide_is_turned_off_where_it_cannot_apply_and_a_note_says_so(assets, tmp_path, capsys):
    """The teacher cache holds no hidden states, and the guide belongs to the KL: there the guided recipe runs without
    it (its config says recovery.hidden_l2=0, so a resume reads the same) and stderr says why; elsewhere it stays."""
    from test_recovery import config_for

    for overrides, why in (
        (["teacher.mode=cache"], "teacher.mode=cache holds no hidden states"),
        (["train.objective=sft"], "not to train.objective=sft"),
        (["train.objective=kl_l2"], "not to train.objective=kl_l2"),
    ):
        config = config_for(assets, tmp_path / "x", *GUIDED, *overrides)
        assert config.recovery.hidden_l2 == 0 and config.recovery.lr_scale == 4
        note = capsys.readouterr().err
        assert "note: recovery.hidden_l2 set to 0 (the guided recipe without its hidden-state guide)" in note
        assert why in note and note.count("\n") == 1
    assert config_for(assets, tmp_path / "x", *GUIDED).recovery.hidden_l2 == 4
    assert "hidden_l2" not in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["ddp", "parallel.ep_size=2"])
def test_two_gloo_processes_train_as_one(assets, tmp_path, layout):
    """DDP, and expert parallelism (its layers hand the next one a pending full stream, which the recorded hidden
    states must see completed): the same losses, gradient norms and weights as one process."""
    from launch import torchrun

    args = _convert_args(assets, "train.max_steps=3", "train.micro_batch_size=4", "train.save_every=0")
    assert main([*args, f"output_dir={tmp_path / 'one'}"]) in (0, None)
    extra = [] if layout == "ddp" else [layout]
    torchrun(2, "-m", "fcsd.cli", *args, *extra, f"output_dir={tmp_path / 'two'}", timeout=600)
    assert_same_training(tmp_path / "two", tmp_path / "one")
    assert any("train/hidden" in r for r in records(tmp_path / "two"))
