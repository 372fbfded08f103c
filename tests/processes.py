"""Processes that tests start: each in a session of its own, stopped with everything it started (its process group
and any descendant in a session of its own, such as torchrun's workers) whatever the test does; and states waited
for with a generous deadline, never fixed seconds, failing in one line when they do not come."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import contextmanager

import psutil
import pytest

TAG = "FCSD_TEST_PROCESS_TAG"  # set by conftest.py for each test: every process it starts inherits it


@contextmanager
def started(argv: list[str], grace: float = 30, **options):
    """``subprocess.Popen(argv, **options)`` in a session of its own; on leaving the block the whole tree is stopped
    (:func:`stop_tree`)."""
    process = subprocess.Popen(argv, start_new_session=True, **options)
    try:
        yield process
    finally:
        stop_tree(process, grace)


def stop_tree(process: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM to ``process``'s group, up to ``grace`` seconds to end, then SIGKILL to the group and to every
    descendant seen before (those in sessions of their own too)."""
    try:
        tree = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            process.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue
    for child in tree:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=grace)
    for stream in (process.stdout, process.stderr, process.stdin):
        if stream is not None:
            stream.close()


def wait_for(condition, timeout: float, what: str, process: subprocess.Popen | None = None, poll: float = 0.2) -> None:
    """Poll ``condition()`` every ``poll`` seconds until it holds; fail the test in one line when ``timeout`` seconds
    pass or ``process`` ends first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            pytest.fail(f"{what}: the process ended first (status {process.returncode})", pytrace=False)
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not reached within {timeout:.0f} s", pytrace=False)
        time.sleep(poll)


def tagged(tag: str) -> list[psutil.Process]:
    """Live processes (not this one) whose environment carries ``tag``."""
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            if process.environ().get(TAG) == tag and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found
