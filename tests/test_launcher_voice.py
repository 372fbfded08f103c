"""One voice under a launcher (issue 38): ``fcsd launch torchrun --nproc_per_node 2 -m fcsd.cli convert ...``, the
line fcsd prints and documents, on 2 gloo processes. A refusal is said once with fcsd's status and no launcher
traceback; Ctrl-C and SIGTERM to the launcher end in one line, 130 / 143, every process gone, and the run resumes
from the line printed; "resuming from" is said once."""

import os
import shlex
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
