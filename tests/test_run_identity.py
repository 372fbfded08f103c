"""A checkpoint belongs to its run: ``--resume`` refuses another run's step checkpoint (copied in) and one whose
recorded schedule was edited, before anything is written; ``train.init_from`` is the recorded way to train on from
another run's weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from tiny_models import save_chat_model

from fcsd.cli import main
from fcsd.distill import trainer
from fcsd.files import ownership

FAST = ["data.seq_len=32", "data.eval_sequences=2", "train.batch_tokens=64", "train.micro_batch_size=2"]
FAST += ["train.warmup_steps=0", "progress=false", "early_stop.enabled=false", "export=false"]
FAST += ["recovery=plain", "train.max_steps=10", "train.save_every=2", "train.keep_checkpoints=0", "train.eval_every=2"]
STOP_AT = 4


class Stopped(Exception):
    """What stops a run right after its step-4 checkpoint (as a kill would)."""


def convert(world: Path, out: Path, *overrides: str, model: str = "model") -> list[str]:
    data = [f"data.path={world / 'train.jsonl'}", f"data.cache_dir={world / 'packed'}"]
    return ["convert", str(world / model), *data, *FAST, f"output_dir={out}", *overrides]


def stopped_run(world: Path, out: Path, *overrides: str, monkeypatch, model: str = "model") -> Path:
    """A run of ``overrides`` stopped after its step-4 checkpoint."""
    save = trainer.TrainingSession.save_checkpoint

    def save_then_stop(session, done):
        save(session, done)
        if done == STOP_AT:
            raise Stopped

    with monkeypatch.context() as patch:
        patch.setattr(trainer.TrainingSession, "save_checkpoint", save_then_stop)
        with pytest.raises(Stopped):
            main(convert(world, out, *overrides, model=model))
    assert (out / "checkpoints" / f"step-{STOP_AT}").is_dir() and not (out / "final").exists()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny model and its chat data, and two runs of them stopped at step 4: ``slow`` (train.lr=2e-5) and
    ``fast`` (train.lr=1e-3)."""
    root = tmp_path_factory.mktemp("identity")
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"add {i} and {i + 1}"},
                {"role": "assistant", "content": str(2 * i + 1)},
            ]
        }
        for i in range(60)
    ]
    save_chat_model(root / "model", rows, vocab_size=120)
    shutil.copytree(root / "model", root / "other_model")  # another fine-tune of the same shapes
    weights = root / "other_model" / "model.safetensors"
    save_file({k: v * 1.01 for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.MonkeyPatch.context() as patch:
        stopped_run(root, root / "runs" / "slow", "train.lr=2e-5", monkeypatch=patch)
        stopped_run(root, root / "runs" / "fast", "train.lr=1e-3", monkeypatch=patch)
    return root


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not ownership.is_lock_file(p.name)
    }


def run_id(run: Path) -> str:
    return json.loads((run / ownership.MARKER).read_text())["run_id"]


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_resume_refuses_a_step_checkpoint_copied_from_another_run(world, tmp_path, capsys):
    """The probe: the 1e-3 run's step-4 copied into the 2e-5 run; --resume trained steps 5-10 at the other run's LR
    from its weights while the run's config said 2e-5. Now it is refused in one line naming both runs, and nothing
    in the run folder changes."""
    run = tmp_path / "slow"
    shutil.copytree(world / "runs" / "slow", run)
    shutil.rmtree(run / "checkpoints" / "step-4")
    shutil.copytree(world / "runs" / "fast" / "checkpoints" / "step-4", run / "checkpoints" / "step-4")
    before = snapshot(run)
    capsys.readouterr()
    assert main([*convert(world, run, "train.lr=2e-5"), "--resume"]) == 2
    message = one_line(capsys)
    assert "checkpoints/step-4 belongs to another run" in message, message
    assert run_id(world / "runs" / "fast") in message and run_id(run) in message, message
    assert "train.init_from=" in message and "move it out of" in message, message
    assert snapshot(run) == before


def test_resume_refuses_a_checkpoint_whose_recorded_schedule_was_edited(world, tmp_path, capsys):
    run = tmp_path / "slow"
    shutil.copytree(world / "runs" / "slow", run)
    state_file = run / "checkpoints" / "step-4" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["run"]["settings"]["train.lr"] = 1e-3
    state_file.write_text(json.dumps(state))
    before = snapshot(run)
    capsys.readouterr()
    assert main([*convert(world, run, "train.lr=2e-5"), "--resume"]) == 2
    message = one_line(capsys)
    assert "records another LR schedule or optimizer than the run's (train.lr: 0.001 vs the run's 2e-05)" in message
    assert snapshot(run) == before


def test_resume_refuses_another_runs_checkpoint_without_its_record_once_its_state_loads(world, tmp_path, capsys):
    """A foreign checkpoint whose run record was deleted (as one written before checkpoints recorded their run):
    the optimizer and scheduler state it brings carry the other run's peak LR, refused before any step trains."""
    run = tmp_path / "slow"
    shutil.copytree(world / "runs" / "slow", run)
    shutil.rmtree(run / "checkpoints" / "step-4")
    shutil.copytree(world / "runs" / "fast" / "checkpoints" / "step-4", run / "checkpoints" / "step-4")
    state_file = run / "checkpoints" / "step-4" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["run"]
    state_file.write_text(json.dumps(state))
    metrics = (run / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main([*convert(world, run, "train.lr=2e-5"), "--resume"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # after the models loaded
    assert len(errors) == 1, errors
    message = errors[0]
    assert "checkpoints/step-4 holds another LR schedule or optimizer than the run's" in message, message
    assert "initial_lr: 0.001 vs the run's 2e-05" in message, message
    assert (run / "metrics.jsonl").read_bytes() == metrics and not (run / "checkpoints" / "step-6").exists()


def test_the_runs_own_checkpoint_resumes_and_every_checkpoint_records_the_run(world, tmp_path):
    run = tmp_path / "slow"
    shutil.copytree(world / "runs" / "slow", run)
    assert main([*convert(world, run, "train.lr=2e-5"), "--resume"]) == 0
    identity = run_id(run)
    assert identity == run_id(world / "runs" / "slow")
    for step in (2, 4, 6, 8):
        record = json.loads((run / "checkpoints" / f"step-{step}" / "trainer_state.json").read_text())["run"]
        assert record["id"] == identity and record["settings"]["train.lr"] == 2e-5
    assert json.loads((run / "final" / "fcsd_checkpoint.json").read_text())["run_id"] == identity
    lrs = [r["train/lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "train/lr" in r]
    assert len(lrs) == 10 and max(lrs) <= 2e-5


def test_init_from_trains_from_the_other_runs_weights_and_records_it(world, tmp_path):
    source = world / "runs" / "fast" / "checkpoints" / "step-4"
    run = tmp_path / "from_fast"
    assert main(convert(world, run, "train.lr=2e-5", "train.max_steps=2", f"train.init_from={source}")) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    theirs = [json.loads(line) for line in (world / "runs" / "fast" / "metrics.jsonl").read_text().splitlines()]
    nll = next(r["eval/nll"] for r in records if r["step"] == 0 and "eval/nll" in r)
    their_nll = next(r["eval/nll"] for r in theirs if r["step"] == STOP_AT and "eval/nll" in r)
    fresh_nll = next(r["eval/nll"] for r in theirs if r["step"] == 0 and "eval/nll" in r)
    assert nll == pytest.approx(their_nll, rel=1e-6) and abs(nll - fresh_nll) > 1e-3  # 4 steps at 1e-3 apart
    assert f"init_from: {source}" in (run / "fcsd_config.yaml").read_text()
    final = json.loads((run / "final" / "fcsd_checkpoint.json").read_text())
    assert final["init_from"] == {"path": str(source), "step": STOP_AT, "run_id": run_id(world / "runs" / "fast")}
    assert final["run_id"] == run_id(run) != run_id(world / "runs" / "fast")
    assert max(r["train/lr"] for r in records if "train/lr" in r) <= 2e-5  # its own schedule, not the source's


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("runs/slow/checkpoints/step-9", "runs/slow/checkpoints/step-9 does not exist; give a step checkpoint"),
        ("runs/slow/checkpoints", "runs/slow/checkpoints is no step checkpoint (RUN/checkpoints/step-N"),
        ("other_run/checkpoints/step-2", "is a checkpoint of another model ("),
    ],
)
def test_init_from_is_checked_before_anything_loads(world, tmp_path, capsys, source, expected):
    if source.startswith("other_run") and not (world / "other_run").exists():
        with pytest.MonkeyPatch.context() as patch:
            stopped_run(world, world / "other_run", monkeypatch=patch, model="other_model")
    out = tmp_path / "new"
    capsys.readouterr()
    assert main(convert(world, out, f"train.init_from={world / source}")) == 2
    message = one_line(capsys)
    assert expected in message and message.startswith("fcsd convert: error: train.init_from="), message
    assert not out.exists()


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda state: {**state, "step": "two"}, "step, tokens or checkpoint_format were edited"),
        (lambda state: {**state, "tokens": -5}, "step, tokens or checkpoint_format were edited"),
        (lambda state: {**state, "checkpoint_format": 99}, "checkpoint format 99, newer than this fcsd's"),
        (lambda state: "{oops", "is no JSON table (damaged or edited)"),
        (lambda state: [state], "is no JSON table (damaged or edited)"),
    ],
)
def test_a_trainer_state_edited_into_nonsense_is_a_damaged_checkpoint(world, tmp_path, capsys, edit, said):
    """The probe: a step of "two" was a TypeError traceback after "resuming from"; a state that is no JSON table
    read as a missing file. Each is a damaged checkpoint now, refused in one line with the sound one to resume from."""
    run = tmp_path / "slow"
    shutil.copytree(world / "runs" / "slow", run)
    state_file = run / "checkpoints" / f"step-{STOP_AT}" / "trainer_state.json"
    edited = edit(json.loads(state_file.read_text()))
    state_file.write_text(edited if isinstance(edited, str) else json.dumps(edited))
    before = snapshot(run)
    capsys.readouterr()
    assert main([*convert(world, run, "train.lr=2e-5"), "--resume"]) == 2
    message = one_line(capsys)
    assert said in message and "train.resume_step=" in message, message
    assert snapshot(run) == before
