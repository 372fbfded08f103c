"""One voice under a launcher: ``fcsd launch torchrun --nproc_per_node 2 -m fcsd.cli convert ...``, the
line fcsd prints and documents, on 2 gloo processes. A refusal is said once with fcsd's status and no launcher
traceback; Ctrl-C and SIGTERM to the launcher end in one line, 130 / 143, every process gone, and the run resumes
from the line printed; "resuming from" is said once."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from launch import free_port
from processes import TAG, started, tagged, wait_for
from test_trainer import FAST, losses_of, pretrained_assets

LAUNCHER_NOISE = ("Traceback", "ChildFailedError", "SignalException", "elastic")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return pretrained_assets(tmp_path_factory.mktemp("assets"), rows=64, steps=1, batch_size=8)


def launch_line(assets, out: Path, *overrides: str) -> list[str]:
    """``fcsd launch torchrun`` of a short 2-process conversion (``fcsd`` as this interpreter's ``-m fcsd.cli``)."""
    launcher = ["torchrun", "--nproc_per_node", "2", f"--master_port={free_port()}", "-m", "fcsd.cli"]
    convert = ["convert", str(assets / "model"), f"data.path={assets / 'train.jsonl'}"]
    convert += [f"data.cache_dir={assets / 'cache'}", *FAST, *overrides, f"output_dir={out}"]
    return [sys.executable, "-m", "fcsd.cli", "launch", *launcher, *convert]


def environ() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}


def run(argv: list[str]) -> subprocess.CompletedProcess:
    with started(argv, env=environ(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        out, err = process.communicate(timeout=600)
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def fcsd_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("fcsd ")]


def test_a_refusal_after_the_process_group_started_is_said_once_with_status_2(assets, tmp_path):
    done = run(launch_line(assets, tmp_path / "r", "parallel.ep_size=3"))
    refusal = "fcsd convert: error: parallel.ep_size=3 must divide the number of processes (2)"
    assert done.returncode == 2, done.stderr[-3000:]
    assert fcsd_lines(done.stderr) == [line for line in done.stderr.splitlines() if line.startswith(refusal)]
    assert done.stderr.count(refusal) == 1, done.stderr
    assert not any(noise in done.stderr for noise in LAUNCHER_NOISE), done.stderr


def test_ctrl_c_to_the_launcher_ends_in_one_line_130_and_the_printed_line_resumes(assets, tmp_path):
    out = tmp_path / "run"
    argv = launch_line(assets, out, "train.max_steps=6", "train.save_every=1", "export=false")
    options = dict(env=environ(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with started(argv, **options) as launch:
        wait_for(lambda: list((out / "checkpoints").glob("step-*")), 300, "the first step checkpoint", launch)
        launch.send_signal(signal.SIGINT)
        _, err = launch.communicate(timeout=300)
        assert launch.returncode == 130, err[-3000:]
        wait_for(lambda: not tagged(os.environ[TAG]), 60, "every process of the launch ended")
    assert len(fcsd_lines(err)) == 1 and "fcsd convert: interrupted; the last checkpoint is step-" in err, err
    assert not any(noise in err for noise in LAUNCHER_NOISE), err
    assert not (out / ".fcsd-lock").exists()
    resume = shlex.split(err.split("continue with `")[1].split("`")[0])
    assert resume[:3] == ["fcsd", "launch", "torchrun"] and resume[-1] == "--resume", resume
    port = next(w for w in resume if w.startswith("--master_port="))
    resume[resume.index(port)] = f"--master_port={free_port()}"  # the stopped launch's port may still be held
    done = run([sys.executable, "-m", "fcsd.cli", *resume[1:]])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("resuming from") == 1, done.stdout
    assert len(losses_of(out)) == 6 and (out / "final").is_dir()


def test_sigterm_to_the_launcher_ends_in_one_line_143_and_no_process_left(assets, tmp_path):
    out = tmp_path / "run"
    argv = launch_line(assets, out, "train.max_steps=50", "export=false")
    options = dict(env=environ(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with started(argv, **options) as launch:
        wait_for(lambda: (out / "metrics.jsonl").exists(), 300, "training started", launch)
        launch.send_signal(signal.SIGTERM)
        _, err = launch.communicate(timeout=300)
        assert launch.returncode == 143, err[-3000:]
        wait_for(lambda: not tagged(os.environ[TAG]), 60, "every process of the launch ended")
    assert fcsd_lines(err) == [line for line in err.splitlines() if "fcsd convert: terminated (SIGTERM)" in line]
    assert len(fcsd_lines(err)) == 1, err
    assert not any(noise in err for noise in LAUNCHER_NOISE), err


RUN = ("train.max_steps=5", "train.save_every=1", "train.keep_checkpoints=3", "export=false")


@pytest.fixture(scope="module")
def stopped_run(assets, tmp_path_factory):
    """A 2-process run stopped after step 4 of 5 (train.stop_after; its last step is final/'s, not a checkpoint's)
    with final/ and the summary removed: a run whose last checkpoint is step-3."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    done = run(launch_line(assets, out, *RUN, "train.stop_after=4"))
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.rmtree(out / "final")
    (out / "run_summary.json").unlink()
    return out


def damaged_copy(stopped_run: Path, folder: Path) -> Path:
    """A copy of the stopped run whose step-3 and step-2 had 4 KiB of model.safetensors overwritten (size kept)."""
    out = shutil.copytree(stopped_run, folder / "run")
    for step in (3, 2):
        path = out / "checkpoints" / f"step-{step}" / "model.safetensors"
        with open(path, "r+b") as handle:
            handle.seek(path.stat().st_size // 2)
            handle.write(b"\xff" * 4096)
    return out


def test_a_damaged_checkpoint_is_hashed_by_every_process_its_share_and_refused_once(assets, stopped_run, tmp_path):
    """--resume of a damaged checkpoint on 2 processes: its checksums were read by the main process alone (and then
    each older checkpoint's), while the other waited in a collective (NCCL times out after 10 minutes: a multi-TB
    checkpoint). Each process now hashes its share, as when the checkpoint was written; the older checkpoints are
    hashed only up to the first sound one; the refusal is said once, status 2, naming step-1."""
    from launch import worker_results

    from fcsd.files import checksums

    out = damaged_copy(stopped_run, tmp_path)
    worker = Path(__file__).parent / "workers" / "resume_hashing.py"
    results = worker_results(2, worker, tmp_path / "out", timeout=600)
    refusal = results[0]["refusal"]
    assert "checkpoints/step-3 is damaged (model.safetensors changed since it was written" in refusal, refusal
    assert "continue from step-1: `" in refusal and refusal.endswith("train.resume_step=1`"), refusal
    assert results[1]["refusal"] == refusal  # every process raises the main one's verdict: none waits in a barrier
    for rank, result in enumerate(results):
        expected = []
        for step in (3, 2, 1):  # step-1 is sound: nothing older is read
            checkpoint = out / "checkpoints" / f"step-{step}"
            recorded = json.loads((checkpoint / "trainer_state.json").read_text())["sha256"]
            files = [checkpoint / name for name in recorded]
            expected += [str(p.relative_to(out)) for p in checksums.share(files, rank, 2)]
        assert sorted(result["hashed"]) == sorted(expected), (rank, result["hashed"], expected)
    assert all(result["hashed"] for result in results)

    done = run(launch_line(assets, out, *RUN, "--resume"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(fcsd_lines(done.stderr)) == 1 and "step-3 is damaged (model.safetensors" in done.stderr, done.stderr
    assert not any(noise in done.stderr for noise in LAUNCHER_NOISE), done.stderr


# -- one voice under plain torchrun, and a killed fcsd launch ---------------------------------------------------------

LAST_WORDS = """
import os, signal, sys
import torch.distributed as dist
from fcsd.cli.launch import say

signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as fcsd's main once a command has ended: torchrun's stop is no news
dist.init_process_group("gloo")
dist.barrier()  # every rank reaches its last word (else torchrun ends a slow one when rank 0 exits)
rank, mode = int(os.environ["RANK"]), sys.argv[1]
line = "fcsd demo: error: the same refusal" if mode == "same" or rank == 0 else f"fcsd demo: error: only rank {rank}"
say(line, 2)
sys.exit(2)
"""


@pytest.mark.parametrize("mode", ["same", "differ"])
def test_under_plain_torchrun_a_refusal_every_rank_says_is_printed_by_rank_0_alone(tmp_path, mode):
    """The rule of fcsd.cli.launch.say over torchrun's store: a line every rank says once, a rank's own line named."""
    from launch import torchrun

    script = tmp_path / "last_words.py"
    script.write_text(LAST_WORDS)
    done = torchrun(3, str(script), mode, check=False, timeout=120)
    said = fcsd_lines(done.stderr)
    if mode == "same":
        assert said == ["fcsd demo: error: the same refusal"], done.stderr[-3000:]
    else:
        expected = ["fcsd demo (rank 1): error: only rank 1", "fcsd demo (rank 2): error: only rank 2"]
        assert sorted(said) == sorted(["fcsd demo: error: the same refusal", *expected]), done.stderr[-3000:]


def test_a_refusal_under_plain_torchrun_is_said_once_by_rank_0(assets, tmp_path):
    from launch import torchrun

    command = launch_line(assets, tmp_path / "r", "parallel.ep_size=3")
    done = torchrun(2, *command[command.index("-m", 4) :], check=False, timeout=600)
    refusal = "fcsd convert: error: parallel.ep_size=3 must divide the number of processes (2)"
    assert done.returncode != 0
    assert fcsd_lines(done.stderr) == [line for line in done.stderr.splitlines() if line.startswith(refusal)]
    assert done.stderr.count(refusal) == 1 and "(rank 1)" not in done.stderr, done.stderr[-3000:]


def test_sigkill_of_the_launcher_ranks_say_the_resume_line_and_remove_the_launch_folder(assets, tmp_path):
    """fcsd launch killed (-9): its ranks notice, rank 0 prints how to resume (one line, no Terminated traceback),
    the launch's message folder is removed and no process is left."""
    out, temporary = tmp_path / "run", tmp_path / "tmp"
    temporary.mkdir()
    argv = launch_line(assets, out, "train.max_steps=50", "train.save_every=1", "export=false")
    options = dict(env={**environ(), "TMPDIR": str(temporary)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with started(argv, text=True, **options) as launch:
        wait_for(lambda: list((out / "checkpoints").glob("step-*")), 300, "the first step checkpoint", launch)
        assert [p.name for p in temporary.iterdir() if p.name.startswith("fcsd-launch-")]
        launch.kill()
        _, err = launch.communicate(timeout=300)  # the ranks hold stderr until they end
        wait_for(lambda: not tagged(os.environ[TAG]), 60, "every process of the launch ended")
    assert len(fcsd_lines(err)) == 1, err[-3000:]
    assert "fcsd convert: terminated (SIGTERM); the last checkpoint is step-" in err, err[-3000:]
    assert "continue with `fcsd launch torchrun" in err and "Traceback" not in err, err[-3000:]
    assert not [p.name for p in temporary.iterdir() if p.name.startswith("fcsd-launch-")]
