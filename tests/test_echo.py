"""Data echoing (issue 37 item 3; ``recovery.echo``): which steps are echoed, that an echoed step trains as the same
rows taken again by the next steps, with the teacher run once on them, one process against DDP and EP x FSDP2, and a
run killed inside the echoed steps resuming exactly."""

import pytest
from test_batch_ramp import PLAIN_SF, RAMP, assert_trains_as
from test_recovery import config_for, convert_args, killed_at, one_thread, records  # noqa: F401 (autouse)
from test_trainer import assert_same_training, pretrained_assets

from fcsd.cli import main
from fcsd.distill import objectives, trainer
from fcsd.distill.config import check_recovery, echo_passes, echo_steps
from fcsd.distill.optim import StepPlan

ECHO = ["recovery.echo=2", "recovery.echo_share=0.5"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return pretrained_assets(tmp_path_factory.mktemp("assets"), rows=120, steps=40, batch_size=4)


def test_the_echo_covers_its_share_of_the_steps_and_refuses_a_malformed_one(assets, tmp_path):
    config = config_for(assets, tmp_path / "a", "recovery.echo=3", "recovery.echo_share=0.25")
    config.train.max_steps = 20
    assert echo_steps(config) == 5 and [echo_passes(config, step) for step in range(20)] == [3] * 5 + [1] * 15
    assert echo_steps(config_for(assets, tmp_path / "b", "recovery=guided")) == 0  # off in the default
    for overrides, said in (
        (["recovery.echo=0"], "recovery.echo=0 recovery.echo_share=0.0: echo is a whole number"),
        (["recovery.echo=2", "recovery.echo_share=1.5"], "echo_share a share of the run's steps in [0, 1]"),
        (["recovery.echo=2"], "recovery.echo=2 with recovery.echo_share=0.0 echoes nothing: set both"),
        (["recovery.echo_share=0.5"], "recovery.echo=1 with recovery.echo_share=0.5 echoes nothing: set both"),
        (["recovery.echo=2", "recovery.echo_share=0.01", "train.max_steps=20"], "rounds to no echoed step: raise it"),
        (["recovery=warm_start", *ECHO], "recovery.echo cannot be combined with the layer-local warm start"),
    ):
        with pytest.raises(ValueError, match=said.replace(".", r"\.").replace("[", r"\[")):
            config_for(assets, tmp_path / "c", *overrides)
    config.recovery.echo = True  # the Python API: a bool is not a number of passes
    with pytest.raises(ValueError, match="echo is a whole number"):
        check_recovery(config)


def _counting_teacher(monkeypatch) -> list:
    calls, original = [], objectives.teacher_targets

    def counted(*args, **keywords):
        calls.append(1)
        return original(*args, **keywords)

    monkeypatch.setattr(objectives, "teacher_targets", counted)
    return calls


def test_an_echoed_step_trains_as_its_rows_taken_again_with_the_teacher_run_once(assets, tmp_path, monkeypatch):
    """Step 0 echoed twice equals steps 0 and 1 of a run whose step 1 gets step 0's rows again, and it runs the
    teacher as often as one unechoed step; the same step unechoed does not train so."""
    steps = ["train.max_steps=2", "train.stop_after=1", "train.lr=1e-3", "train.log_every=1"]
    echoed = convert_args(assets, *PLAIN_SF, *ECHO, *steps)
    calls = _counting_teacher(monkeypatch)
    assert main([*echoed, "train.eval_every=0", f"output_dir={tmp_path / 'echo'}"]) in (0, None)
    echo_calls = len(calls)
    once = convert_args(assets, *PLAIN_SF, *steps)
    calls.clear()
    assert main([*once, "train.eval_every=0", f"output_dir={tmp_path / 'once'}"]) in (0, None)
    assert echo_calls == len(calls) > 0  # one teacher forward per micro-batch of the step, not two
    rows = StepPlan.rows
    monkeypatch.setattr(StepPlan, "rows", lambda self, step, count, seed: rows(self, 0, count, seed))
    again = convert_args(assets, *PLAIN_SF, "train.max_steps=2", "train.lr=1e-3", "train.log_every=1")
    assert main([*again, f"output_dir={tmp_path / 'again'}"]) in (0, None)
    assert_trains_as(tmp_path / "echo", tmp_path / "again", tmp_path / "once")
    # the step logs the mean of its two updates' losses
    (logged,) = [r["train/loss"] for r in records(tmp_path / "echo") if "train/loss" in r]
    first, second = [r["train/loss"] for r in records(tmp_path / "again") if "train/loss" in r]
    assert logged == pytest.approx((first + second) / 2, rel=1e-5) and first != second


def test_the_kept_teacher_outputs_train_as_the_teacher_run_again_with_the_guide_and_the_ramp(
    assets, tmp_path, monkeypatch
):
    """With the guide (every layer's teacher states kept) and the batch ramp (each update's micro-batches kept),
    the echoed run equals the same run computing the teacher again on each pass."""
    args = convert_args(assets, "recovery=guided", *RAMP, "recovery.echo=3", "recovery.echo_share=0.5")
    args += ["train.max_steps=4", "train.save_every=0"]
    calls = _counting_teacher(monkeypatch)
    assert main([*args, "train.eval_every=0", f"output_dir={tmp_path / 'kept'}"]) in (0, None)
    kept_calls = len(calls)
    original = trainer.micro_batch_loss
    monkeypatch.setattr(trainer, "micro_batch_loss", lambda *args, teacher_memo=None: original(*args))  # no memo
    calls.clear()
    assert main([*args, "train.eval_every=0", f"output_dir={tmp_path / 'again'}"]) in (0, None)
    # step 1 is 4 updates of one micro-batch, step 2 two: running the teacher on every pass adds 2 x (4 + 2) calls
    assert len(calls) - kept_calls == (3 - 1) * (4 + 2)
    assert_same_training(tmp_path / "kept", tmp_path / "again")


def test_the_teacher_runs_once_per_micro_batch_of_each_step_even_on_rows_the_step_or_the_last_one_held(
    assets, tmp_path, monkeypatch
):
    """The kept outputs belong to a micro-batch's place in its step, not to its rows: a step holding one row eight
    times (as a step crossing an epoch of a small data set may hold a row twice) and steps all holding the same
    rows run the teacher as often as without echoing, so every process runs the same teacher forwards (under FSDP2
    each is a collective) and no step reads another's outputs."""
    rows = StepPlan.rows
    monkeypatch.setattr(StepPlan, "rows", lambda self, step, count, seed: rows(self, 0, count, seed)[:1] * 8)
    calls = _counting_teacher(monkeypatch)
    steps = [*PLAIN_SF, "train.max_steps=3", "train.eval_every=0", "train.save_every=0"]
    assert main([*convert_args(assets, *steps), f"output_dir={tmp_path / 'once'}"]) in (0, None)
    once = len(calls)
    calls.clear()
    echoed = convert_args(assets, *steps, "recovery.echo=3", "recovery.echo_share=1.0")
    assert main([*echoed, f"output_dir={tmp_path / 'echo'}"]) in (0, None)
    assert len(calls) == once


def test_an_echoed_step_runs_its_updates_in_order_then_again_and_drops_the_passes_of_a_refused_one(
    assets, tmp_path, monkeypatch, capsys
):
    """A ramp's two updates echoed twice run as u1, u2, u1, u2; an update the guard refuses is not run again on its
    later passes (same rows, and every process refuses alike), so one refusal is not counted once per pass."""
    seen, calls = [], []
    original_fb, original_apply = trainer.TrainingSession.forward_backward, trainer.apply_update

    def recording(self, step, micro_batches, memos=None):
        seen.append((step, micro_batches))
        return original_fb(self, step, micro_batches, memos)

    def refuse_first(optimizer, scaler, guard, loss, grad_norm):
        calls.append(loss)
        if len(calls) == 1:
            return False, "planted refusal"
        return original_apply(optimizer, scaler, guard, loss, grad_norm)

    monkeypatch.setattr(trainer.TrainingSession, "forward_backward", recording)
    monkeypatch.setattr(trainer, "apply_update", refuse_first)
    ramp = ["recovery.batch_ramp=[2]", "recovery.batch_ramp_shares=[0.5]", "train.micro_batch_size=4"]
    args = convert_args(assets, *PLAIN_SF, *ramp, "recovery.echo=3", "recovery.echo_share=0.5", "train.max_steps=2")
    assert main([*args, "train.save_every=0", f"output_dir={tmp_path / 'o'}"]) in (0, None)
    first = [micro for step, micro in seen if step == 0]
    assert len(first) == 1 + 3 and first[0] != first[1]  # u1 refused, then u2 three times: u1 never again
    assert first[1] == first[2] == first[3]
    assert "step 1 (update 1 of 6) not applied: planted refusal" in capsys.readouterr().out
    seen.clear()
    monkeypatch.setattr(trainer, "apply_update", original_apply)
    assert main([*args, "train.save_every=0", f"output_dir={tmp_path / 'p'}"]) in (0, None)
    first = [micro for step, micro in seen if step == 0]
    assert first[0] != first[1] and first == first[:2] * 3  # u1, u2, u1, u2, u1, u2


def test_the_echo_line_says_what_runs_on_the_echoed_rows(assets, tmp_path, capsys):
    """The teacher once (online), nothing (SFT trains on the rows' tokens alone): the line does not promise a
    teacher forward a run does not make."""
    args = convert_args(assets, *PLAIN_SF, "train.max_steps=2", "recovery.echo=2", "recovery.echo_share=0.5")
    assert main([*args, "train.save_every=0", f"output_dir={tmp_path / 'kl'}"]) in (0, None)
    assert "data echoing: step 1 trains 2 times on its rows (the teacher run once on them)\n" in capsys.readouterr().out
    assert main([*args, "train.objective=sft", "train.save_every=0", f"output_dir={tmp_path / 'sft'}"]) in (0, None)
    assert "data echoing: step 1 trains 2 times on its rows\n" in capsys.readouterr().out


def test_the_spike_guard_forgets_the_echoed_passes_losses_when_the_echo_ends(assets, tmp_path, monkeypatch):
    """Losses on rows already trained on are lower than fresh rows': the first unechoed step is not judged by them."""
    seen, original = [], trainer.TrainingSession.optimizer_steps

    def recording(self, step):
        seen.append(len(self.guard.history))
        return original(self, step)

    monkeypatch.setattr(trainer.TrainingSession, "optimizer_steps", recording)
    args = convert_args(assets, *PLAIN_SF, *ECHO, "train.max_steps=4", "train.save_every=0")
    assert main([*args, f"output_dir={tmp_path / 'g'}"]) in (0, None)
    assert seen == [0, 2, 0, 1]  # steps 1-2 make two updates each; step 3 starts afresh


@pytest.mark.parametrize("layout", ["ddp", "ep_fsdp"])
def test_two_gloo_processes_echo_as_one(assets, tmp_path, layout):
    """Every pass of an echoed step syncs (DDP) or reduces (EP x FSDP2) its own gradients: the same losses,
    gradient norms and weights as one process."""
    from launch import torchrun

    args = convert_args(assets, "recovery=guided", *RAMP, *ECHO, "train.micro_batch_size=1", "train.max_steps=4")
    assert main([*args, "train.save_every=0", f"output_dir={tmp_path / 'one'}"]) in (0, None)
    extra = [] if layout == "ddp" else ["parallel.ep_size=2", "parallel.fsdp=true"]
    torchrun(2, "-m", "fcsd.cli", *args, *extra, "train.save_every=0", f"output_dir={tmp_path / 'two'}", timeout=600)
    # as the batch ramp's test: float noise of another reduction order over 12 Adam updates, against the LR 4e-3
    # a pass missing a reduction would leave
    assert_same_training(tmp_path / "two", tmp_path / "one", rtol=1e-4, atol=1e-4)


def test_the_run_says_which_steps_it_echoes_and_a_run_killed_inside_them_resumes_exactly(
    assets, tmp_path, monkeypatch, capsys
):
    args = convert_args(assets, "recovery=guided", *RAMP, *ECHO, "train.max_steps=8", "train.save_every=1")
    args.append("train.log_every=1")
    assert main([*args, f"output_dir={tmp_path / 'u'}"]) in (0, None)
    assert "data echoing: steps 1-4 train 2 times on their rows (the teacher run once on them)" in (
        capsys.readouterr().out
    )
    killed_at(monkeypatch, [*args, f"output_dir={tmp_path / 'k'}"], 3)
    capsys.readouterr()
    for changed in ("recovery.echo=3", "recovery.echo_share=0.75"):
        assert main([*args, changed, f"output_dir={tmp_path / 'k'}", "--resume"]) == 2
        assert changed.split("=")[0] in capsys.readouterr().err
    assert main([*args, f"output_dir={tmp_path / 'k'}", "--resume"]) in (0, None)
    for key in ("train/loss", "train/grad_norm", "eval/kl"):
        assert [r[key] for r in records(tmp_path / "k") if key in r] == [
            r[key] for r in records(tmp_path / "u") if key in r
        ]
    assert_same_training(tmp_path / "k", tmp_path / "u")
