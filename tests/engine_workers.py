"""The serving engines' own environments (``make serve-env`` -> .venv-vllm, ``make sglang-env`` -> .venv-sglang), and
a worker script run there on a list of jobs: what the serving tests drive the engines with."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from processes import started

ROOT = Path(__file__).resolve().parents[1]


def engine_python(venv: str, make_target: str) -> Path:
    """The interpreter of the checkout's ``venv``; the test fails naming ``make_target`` when it is missing."""
    python = ROOT / venv / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{ROOT / venv} is missing: run `make {make_target}` (the engine and fcsd's plugin in their own "
                    "environment)")  # fmt: skip
    return python


def engine_env(**extra) -> dict:
    """This environment for an engine's interpreter: none of fcsd's paths, offline."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def run_worker(python: Path, worker: Path, jobs: list[dict], out: Path, env: dict) -> tuple[dict, str]:
    """``python worker JOBS.json OUT.json`` beside ``out``; returns the results and the worker's log."""
    (out.parent / f"{out.stem}.jobs.json").write_text(json.dumps(jobs))
    log = out.parent / f"{out.stem}.log"
    command = [str(python), str(worker), str(out.parent / f"{out.stem}.jobs.json"), str(out)]
    with log.open("w") as stream, started(command, env=env, stdout=stream, stderr=subprocess.STDOUT,
                                          cwd=out.parent) as process:  # fmt: skip
        process.wait(timeout=1500)  # its engine processes go with it, whatever happens
    text = log.read_text()
    assert out.exists(), f"the {worker.name} worker failed:\n{text[-3000:]}"
    return json.loads(out.read_text()), text
