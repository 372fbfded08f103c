"""What a GPU run needs of the parallel runtime, checked on CPU gloo processes: the process groups' timeout, saves that
gather each tensor only on the writing process, compute-dtype tensors saved for the combine's backward, gradient
all-reduces overlapped with the backward (tests/workers/saves_and_grads.py)."""

import json
from pathlib import Path

import pytest
from launch import torchrun

from fcsd.distill.config import compose, to_config

WORKER = Path(__file__).parent / "workers" / "saves_and_grads.py"


def _launch(tmp_path, nproc: int, which: str, timeout: float = 300) -> list[dict]:
    out = tmp_path / which
    result = torchrun(nproc, str(WORKER), str(out), which, check=False, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(nproc)]


def test_process_group_waits_the_configured_minutes(tmp_path):
    for rank in _launch(tmp_path, 2, "timeout"):
        assert rank["processes"] == 2 and rank["sum"] == 2
        assert rank["at_start"] == 7  # the group the trainer starts
        assert rank["running"] == 11  # a group started before (by `fcsd convert`, or the caller)


def test_timeout_below_a_minute_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"parallel.timeout_minutes=0: .*at least 1 minute") as refused:
        to_config(compose(["model.name=m", "data.path=d", "parallel.timeout_minutes=0"]))
    assert "\n" not in str(refused.value)
    assert to_config(compose(["model.name=m", "data.path=d"])).parallel.timeout_minutes == 60
