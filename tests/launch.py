"""Starting gloo process groups from tests: ``torchrun`` on a free port, with this test environment; whatever
happens (a timeout included), torchrun and every worker it started are stopped before this returns."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from processes import started


def torchrun(nproc: int, *argv: str, check: bool = True, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m torch.distributed.run --nproc_per_node nproc *argv`` (``-m module ...`` or a script);
    ``timeout`` (seconds) turns a hang into a ``subprocess.TimeoutExpired``."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}"]
    options = dict(env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with started([*command, *argv], **options) as process:
        out, err = process.communicate(timeout=timeout)
    done = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def worker_results(nproc: int, worker, out, timeout: float) -> list[dict]:
    """Run the gloo test ``worker`` script on ``nproc`` processes and read back the JSON each rank wrote to
    ``{out}.{rank}.json``; ``timeout`` turns a collective-order bug (a hang) into a failure."""
    result = torchrun(nproc, str(worker), str(out), check=False, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(nproc)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
