"""Stopping a command: Ctrl-C and SIGTERM end it at any moment, loading included, in one line (exit 130 / 143), and
every process it started ends with it.

- :func:`install` (the CLI, first thing) makes SIGINT raise ``KeyboardInterrupt`` and SIGTERM :class:`Terminated`,
  and remembers that a stop came: a library that turns the interrupt into another error while it imports or loads
  (transformers' lazy modules report ``Could not import module ...``) is still reported as the stop.
- :func:`import_torch` (the CLI, for the commands that use torch) imports torch with stops deferred to the end of
  the import (:func:`deferred`): an interrupted ``torch.distributed`` import cannot be imported again.
- :func:`run_child` starts a process (a sweep stage, ``torchrun``) in a process group of its own and passes a stop
  on to that whole group, waits for it, and kills what is left after a grace period; the child is also told to
  stop if this process dies without a chance to pass anything on (``PR_SET_PDEATHSIG`` through
  ``python -m fcsd.stopping``).
- :func:`die_with_parent` does the same for worker processes fcsd's own code starts (benchmark ranks, ``fcsd plan
  --measure`` workers) and for the ranks of a command run under ``torchrun`` (:func:`install`), and
  :func:`joined` stops ``torch.multiprocessing`` workers when their parent is stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

GRACE_SECONDS = 60  # how long a stopped child may take to end (write nothing more, release its locks) before a kill


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, ``kill``), handled as Ctrl-C is: writes end cleanly, locks are released."""


_RECEIVED: list[int] = []  # the stop signals this process received
_DEFERRED: list[list[int]] = []  # while not empty: the stops that arrived inside deferred(), raised when it ends


def _stop(signum, frame):
    _RECEIVED.append(signum)
    if _DEFERRED:
        _DEFERRED[-1].append(signum)
        return
    _raise(signum)


def _raise(signum: int):
    raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt


@contextmanager
def deferred():
    """A stop that arrives inside the block is raised when the block ends: for imports of C extensions that cannot
    be interrupted halfway and imported again (``torch.distributed`` registers its types once: importing it again
    after an interrupted import aborts the process, ``generic_type: cannot initialize type``)."""
    _DEFERRED.append([])
    try:
        yield
    finally:
        arrived = _DEFERRED.pop()
    if arrived:
        _raise(arrived[0])


def import_torch() -> None:
    """Import torch and ``torch.distributed`` with stops deferred (:func:`deferred`): the commands that train,
    cache or load call it first, so that Ctrl-C while they start stays one line."""
    with deferred():
        import torch.distributed  # noqa: F401


def raise_terminated(signum, frame):
    """A SIGTERM handler: raise :class:`Terminated` where the process is."""
    _stop(signum, frame)


def install() -> dict:
    """SIGINT -> ``KeyboardInterrupt``, SIGTERM -> :class:`Terminated`, both remembered (:func:`received`); returns
    the previous handlers for :func:`restore`. A SIGINT the shell set to be ignored (a background job) stays so. A
    rank that ``torchrun`` (or ``accelerate launch``) started is stopped when its launcher dies, even by ``kill -9``
    (:func:`die_with_parent`): it never trains on alone, holding the run's lock."""
    _RECEIVED.clear()  # a stop of an earlier command run in this process (tests call the CLI in-process)
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        previous[sig] = signal.signal(sig, _stop)
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None:  # a rank of torchrun / accelerate launch: none outlives it
        die_with_parent(orphaned_ends=False)
        _watch_launcher()
    return previous


LAUNCHER_ENV = "FCSD_LAUNCH_PID"  # the process of fcsd launch: the ranks' parent while it lives


def launcher_alive() -> bool | None:
    """Whether this rank's ``fcsd launch`` still runs (it is the ranks' parent); None: not under ``fcsd launch``."""
    pid = os.environ.get(LAUNCHER_ENV)
    if pid is None or not pid.isdigit():
        return None
    return os.getppid() == int(pid)


def orphaned_stop() -> int | None:
    """143 in a rank whose ``fcsd launch`` is gone (killed): an error it meets then (its peers' and store's links
    broke) is that stop, said as one (the resume line), not a traceback; None otherwise (also in a process started
    under a rank, whose parent never was the launcher)."""
    return 143 if _WATCHING and launcher_alive() is False else None


_WATCHING: list = []


def _watch_launcher(every: float = 1.0) -> None:
    """In a rank of ``fcsd launch``: SIGTERM to this process once its launcher is gone (``PR_SET_PDEATHSIG`` is
    bound to the thread that started it, and does not cross a launcher that re-parents its workers)."""
    if _WATCHING or not launcher_alive():  # not under fcsd launch, or a process started under a rank
        return
    import threading

    def watch():
        while launcher_alive():
            time.sleep(every)
        os.kill(os.getpid(), signal.SIGTERM)

    _WATCHING.append(threading.Thread(target=watch, name="fcsd-launcher-watch", daemon=True))
    _WATCHING[0].start()


def restore(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def ignore_further_stops() -> None:
    """Ignore SIGINT and SIGTERM from now on (until :func:`restore`): the command is already stopping and reports
    it; a second Ctrl-C, or a second SIGTERM from a launcher, must not turn that report into a traceback."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def received() -> int | None:
    """The first stop signal this process received, or None."""
    return _RECEIVED[0] if _RECEIVED else None


def was_stopped(error: BaseException) -> int | None:
    """The exit status of a command that ended with ``error``: 130 (Ctrl-C) or 143 (SIGTERM) when the error is, or
    came from, a stop (however a library wrapped it); None otherwise."""
    if isinstance(error, Terminated):
        return 143
    if isinstance(error, KeyboardInterrupt):
        return 130
    signum = received()
    if signum is not None:
        return 143 if signum == signal.SIGTERM else 130
    return None


def die_with_parent(orphaned_ends: bool = True) -> None:
    """Ask the kernel to send SIGTERM to this process when its parent dies (Linux; elsewhere nothing), and end now if
    the parent is already gone (``orphaned_ends``; not for a parent that may itself be process 1, such as a
    container's ``torchrun``). For processes fcsd starts, so that none outlives the command."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if orphaned_ends and os.getppid() == 1:
        os._exit(143)


def run_child(command: list[str], env: dict | None = None, grace: float = GRACE_SECONDS) -> None:
    """Run ``command`` (``[python, -m, module, ...]`` runs under :func:`die_with_parent`) in a process group of its
    own and wait for it. SIGINT and SIGTERM sent to this process are passed on to the whole group and waited for, so
    that no process of it is left writing after the command stops; what still runs ``grace`` seconds later is
    killed. An interrupted child raises ``KeyboardInterrupt`` (:class:`Terminated` for SIGTERM) here once it has
    ended; a failed one ``subprocess.CalledProcessError``."""
    if len(command) > 2 and command[1] == "-m":  # the child stops if this process dies
        command = [command[0], "-m", "fcsd.stopping", *command[2:]]
    child = subprocess.Popen(command, env=env, start_new_session=True)
    received_here: list[int] = []
    stopped_at: list[float] = []

    def forward(signum, frame):
        stopped_at.append(stopped_at[0] if stopped_at else time.monotonic())
        received_here.append(signum)
        _RECEIVED.append(signum)
        _signal_group(child.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                code = child.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if stopped_at and time.monotonic() - stopped_at[0] > grace:
                    _signal_group(child.pid, signal.SIGKILL)
    finally:
        restore(previous)
        if child.poll() is None:  # this process is stopping for another reason: the child goes too
            _signal_group(child.pid, signal.SIGTERM)
            try:
                child.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _signal_group(child.pid, signal.SIGKILL)
                child.wait()
        _signal_group(child.pid, signal.SIGKILL)  # stragglers of the group (the leader has ended)
    if received_here:
        raise Terminated if signal.SIGTERM in received_here else KeyboardInterrupt
    if code:
        raise subprocess.CalledProcessError(code, command[:5])


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def joined(context, grace: float = GRACE_SECONDS) -> None:
    """Wait for the ``torch.multiprocessing`` processes of ``context`` (``start_processes(..., join=False)``);
    if this process is stopped or a worker fails, the others are terminated (then killed) before the error goes on."""
    try:
        while not context.join():
            pass
    except BaseException:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
        for process in context.processes:
            process.join(grace)
            if process.is_alive():
                process.kill()
                process.join()
        raise


def _run_module() -> None:
    """``python -m fcsd.stopping MODULE ARGS...``: run ``MODULE`` as ``python -m`` would, under
    :func:`die_with_parent`."""
    import runpy

    die_with_parent()
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _run_module()
