"""Starting gloo process groups from tests: ``torchrun`` on a free port, with this test environment."""

import os
import socket
import subprocess
import sys


def torchrun(nproc: int, *argv: str, check: bool = True, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m torch.distributed.run --nproc_per_node nproc *argv`` (``-m module ...`` or a script);
    ``timeout`` (seconds) turns a hang into a ``subprocess.TimeoutExpired``."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}"]
    return subprocess.run([*command, *argv], env=env, check=check, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """The ids of every process below ``pid`` (Linux ``/proc``): torchrun starts each worker in a session of its
    own, so killing the launcher's process group leaves them running."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int, sig=None) -> None:
    """SIGKILL ``pid`` and all its descendants, by id (the workers first, so none outlives its launcher)."""
    import signal

    for target in [*reversed(descendants(pid)), pid]:
        try:
            os.kill(target, sig or signal.SIGKILL)
        except ProcessLookupError:
            pass
