"""``fcsd launch``: ``torchrun`` and ``accelerate launch`` with one voice.

``fcsd launch torchrun --nproc_per_node 2 -m fcsd.cli convert ...`` (or ``fcsd launch accelerate launch ...``: any
launch line of fcsd with ``fcsd launch`` in front) runs the launcher in this process, through its own API
(``torch.distributed.run.run``, accelerate's ``launch_command``), and owns the output and the exit status:

- each process leaves its last word (a refusal, an error, "interrupted; continue with ...") in a folder of this
  launch (:func:`say`) instead of on stderr; this process prints one of them once: the first error a process met,
  or, for a stop, rank 0's line; and ends with that status (2 for bad input, 130 / 143 for Ctrl-C / SIGTERM);
- torchrun's own report of a failed process (``ChildFailedError``, its logged warnings) is not printed: a process
  that crashed has printed its traceback itself, and this process names it in one line;
- Ctrl-C and SIGTERM reach every process (the launcher passes them on and waits), which saves what it must and
  says how to resume; the launch ends in that one line with status 130 / 143.

With several nodes, each node's ``fcsd launch`` speaks for the processes it started.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from fcsd.command_line import LINE_ENV
from fcsd.stopping import LAUNCHER_ENV, launcher_alive

MESSAGES_ENV = "FCSD_LAUNCH_MESSAGES"  # the folder each process of a launch leaves its last word in
STOPS = {130: signal.SIGINT, 143: signal.SIGTERM}
WAIT_FOR_MAIN = 10.0  # seconds another rank waits for rank 0's last word before it says its own
USAGE = (
    "put fcsd launch in front of a launch line of fcsd: `fcsd launch torchrun --nproc_per_node N -m fcsd.cli "
    "convert ...` or `fcsd launch accelerate launch --config_file FILE -m fcsd.cli convert ...`"
)


def say(line: str, code: int) -> None:
    """Say the last word ``line`` of a command ending with status ``code`` (one line on stderr) with one voice: the
    one rule of every launch. Outside a launcher it is printed. In a rank of ``torchrun`` / ``accelerate launch``,
    rank 0 says its line; another rank says nothing of a stop (rank 0 says it) nor of the line rank 0 said (every
    rank reached the same refusal), and says a different line, or one rank 0 did not say within
    :data:`WAIT_FOR_MAIN` seconds, with its rank's name. Under ``fcsd launch`` the words are left in the launch's
    folder for it to print once; a rank whose ``fcsd launch`` is gone (killed) prints them itself, and rank 0 removes
    the folder."""
    if os.environ.get("TORCHELASTIC_RUN_ID") is None:
        print(line, file=sys.stderr)
        return
    rank, folder = int(os.environ.get("RANK", "0")), os.environ.get(MESSAGES_ENV)
    folder = Path(folder) if folder and launcher_alive() is not None else None
    alive = folder is not None and launcher_alive()
    if rank == 0:
        if not alive:
            print(line, file=sys.stderr)
        if alive or code not in STOPS:  # the other ranks compare their errors with it
            _post(folder, rank, line, code)
        if not alive and folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        return
    if code in STOPS and not alive:
        return  # rank 0 says how the stopped run resumes
    if code not in STOPS:
        main = _main_word(folder)
        if main == line:
            return
        line = named(line, rank)
    if alive:
        _post(folder, rank, line, code)
    else:
        print(line, file=sys.stderr)


def named(line: str, rank: int) -> str:
    """``line`` with the rank that said it: ``fcsd convert (rank 1): error: ...``."""
    head, colon, rest = line.partition(":")
    if colon and head.startswith("fcsd ") and " " not in head[5:]:
        return f"{head} (rank {rank}):{rest}"
    return f"rank {rank}: {line}"


def _post(folder: Path | None, rank: int, line: str, code: int) -> None:
    """Leave ``line`` where the launch and the other ranks read it: the launch's folder, else the launcher's store."""
    record = json.dumps({"rank": rank, "line": line, "code": code, "time": time.time()})
    if folder is not None:
        try:
            with open(folder / f"{rank}.json", "x") as file:
                file.write(record)
        except FileExistsError:  # said already: the first word is kept
            pass
        except OSError:  # the launch's folder is gone: nobody will read it, so say it here
            print(line, file=sys.stderr, flush=True)
        return
    if rank == 0:
        store = _store()
        if store is not None:
            try:
                store.set(_said_key(), line)
            except Exception:  # noqa: BLE001 - the store is gone: the other ranks name themselves
                pass


def _main_word(folder: Path | None) -> str | None:
    """Rank 0's last word, waited for up to :data:`WAIT_FOR_MAIN` seconds (stops ignored meanwhile: this process is
    ending with its own status); None when it said none."""
    from fcsd.stopping import ignore_further_stops

    ignore_further_stops()
    if folder is None:
        store = _store()
        if store is None:
            return None
        try:
            from datetime import timedelta

            store.wait([_said_key()], timedelta(seconds=WAIT_FOR_MAIN))
            return store.get(_said_key()).decode()
        except Exception:  # noqa: BLE001 - not said in time, or the store is gone
            return None
    deadline = time.monotonic() + WAIT_FOR_MAIN
    while time.monotonic() < deadline:
        try:
            return json.loads((folder / "0.json").read_text())["line"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.1)
    return None


def _store():
    """A client of the launcher's store (``MASTER_ADDR:MASTER_PORT``), or None."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not address or not port.isdigit():
        return None
    try:
        from datetime import timedelta

        import torch.distributed as dist

        timeout = timedelta(seconds=WAIT_FOR_MAIN)
        return dist.TCPStore(address, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
    except Exception:  # noqa: BLE001 - no store to reach: said without comparing
        return None


def _said_key() -> str:
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"fcsd-last-word/{os.environ.get('TORCHELASTIC_RUN_ID')}/{restart}"


def launch(words: list[str], check_command) -> int:
    """Run the launch line ``words`` (``torchrun ... -m fcsd.cli COMMAND ...`` or ``accelerate launch ...``) and
    return its exit status, having printed at most one line of its own (see the module docstring)."""
    parser, run = _launcher(words)
    options = words[2:] if words[:2] == ["accelerate", "launch"] else words[1:]
    args = parser.parse_args(options)
    if not (args.module and args.training_script == "fcsd.cli"):
        raise ValueError(f"`{shlex.join(words)}` does not run fcsd: {USAGE}")
    command = list(args.training_script_args)
    check_command(command)  # a usage error is said once, here, before any process starts
    prefix = ["fcsd", "launch", *words[: len(words) - len(command)]]
    name = next((word for word in command if not word.startswith("-")), "launch")
    with tempfile.TemporaryDirectory(prefix="fcsd-launch-") as folder:
        saved = {key: os.environ.get(key) for key in (MESSAGES_ENV, LINE_ENV, LAUNCHER_ENV)}
        os.environ.update({MESSAGES_ENV: folder, LINE_ENV: shlex.join(prefix), LAUNCHER_ENV: str(os.getpid())})
        try:
            return _run_quietly(run, args, Path(folder), name)
        finally:
            for key, value in saved.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def _launcher(words: list[str]):
    if words[:1] == ["torchrun"]:
        import torch.distributed.run as torchrun

        return torchrun.get_args_parser(), torchrun.run
    if words[:2] == ["accelerate", "launch"]:
        from accelerate.commands.launch import launch_command, launch_command_parser

        return launch_command_parser(), launch_command
    if not words:
        raise ValueError(f"give fcsd launch a launch line to run: {USAGE}")
    raise ValueError(f"{shlex.join(words[:2])} is not a launcher fcsd launch knows: {USAGE}")


def _run_quietly(run, args, folder: Path, name: str) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    _quiet_launcher_logs()
    try:
        with _quiet_rendezvous_shutdown():
            run(args)
        return 0
    except RendezvousConnectionError:
        return _report_lost_store(folder, name, args)
    except SignalException as stop:
        return _report_stop(folder, name, int(stop.sigval))
    except KeyboardInterrupt as stop:  # before the processes started, or accelerate's one-process launch
        from fcsd.stopping import Terminated

        return _report_stop(folder, name, signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)
    except SystemExit as exit:  # accelerate launch ends a stopped launch so (128 + the signal)
        code = exit.code if isinstance(exit.code, int) else 1
        if code - 128 in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            return _report_stop(folder, name, code - 128)
        return _report_failure(folder, name, None, code)
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        return _report_failure(folder, name, rank, failure.exitcode)
    except subprocess.CalledProcessError as failed:  # accelerate's one-process launch
        return _report_failure(folder, name, 0, failed.returncode)


STORE_NOISE = ("[c10d]", "TCPStore", "Exception raised from", "frame #", "<omitting python frames>")


_FD2 = threading.Lock()  # one block at a time swaps file descriptor 2, never while ranks are started (they inherit it)


@contextmanager
def _quiet_rendezvous_shutdown():
    """An agent closing the rendezvous after the node that hosted its store has ended (every multi-node run's last
    moment, a successful one's too), or talking to it once that node is lost, gets torch's C++ ``recvVector failed``
    warning with its stack frames on stderr: that noise is dropped (anything else said meanwhile is kept)."""
    try:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    except ImportError:
        yield
        return

    def quiet(original):  # the agent's main thread: closing, polling the rendezvous
        def call(self, *args, **kwargs):
            with _FD2, _stderr_filtered(STORE_NOISE):
                return original(self, *args, **kwargs)

        return call

    def quiet_heartbeat(original):  # its heartbeat thread: beats unfiltered rather than wait long for the main one
        def call(self):
            if not _FD2.acquire(timeout=1.0):
                return original(self)
            try:
                with _stderr_filtered(STORE_NOISE):
                    return original(self)
            finally:
                _FD2.release()

        return call

    def starting(original):  # the ranks start with this process's own stderr
        def call(self, *args, **kwargs):
            with _FD2:
                return original(self, *args, **kwargs)

        return call

    patches = [(DynamicRendezvousHandler, name, quiet) for name in ("shutdown", "num_nodes_waiting")]
    patches += [
        (DynamicRendezvousHandler, "_keep_alive", quiet_heartbeat),
        (LocalElasticAgent, "_start_workers", starting),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for (owner, name, wrap), (_, _, original) in zip(patches, originals, strict=True):
        setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


@contextmanager
def _stderr_filtered(noise: tuple):
    """This process's file descriptor 2 (C++ writes to it too) into a file for the block; then its lines that hold
    none of ``noise`` are written back."""
    sys.stderr.flush()
    try:
        caught, saved = tempfile.TemporaryFile(), os.dup(2)
    except OSError:  # no room for the file, or no descriptor left: unfiltered rather than failing the launch
        yield
        return
    with caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = caught.read().decode(errors="replace").splitlines()
            kept = [line for line in lines if line.strip() and not any(word in line for word in noise)]
            if kept:
                print("\n".join(kept), file=sys.stderr)


def _quiet_launcher_logs() -> None:
    """torchrun's warnings of a failure or a stop ("failed (exitcode: 2)", "Sending process ... closing signal"):
    this launch reports those in one line. Each of its loggers has its level set, so each is set here."""
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous  # noqa: F401 - its logger, made before run

    names = [name for name in logging.root.manager.loggerDict if name.startswith(("torch.distributed.elastic",
             "torch.distributed.launcher", "torch.distributed.run"))]  # fmt: skip
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR + 10)


def _messages(folder: Path) -> list[dict]:
    found = []
    for path in folder.glob("*.json"):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # a process killed while writing: it said nothing
            continue
    return sorted(found, key=lambda m: (m["time"], m["rank"]))


def _report_stop(folder: Path, name: str, signum: int) -> int:
    """The launch was stopped (``signum``): rank 0's line (it names the checkpoint to resume from), else another's."""
    code = 128 + signum
    messages = _messages(folder)
    stops = [m for m in messages if m["code"] in STOPS] or messages
    line = next((m["line"] for m in stops if m["rank"] == 0), stops[0]["line"] if stops else None)
    how = "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted"
    print(line or f"fcsd {name}: {how}", file=sys.stderr)
    return code


def _report_lost_store(folder: Path, name: str, args) -> int:
    """The node hosting the rendezvous store is gone: this node's processes are stopped (they leave their words
    here: how to resume) and the launch ends in one line naming the store, status 1."""
    _stop_children()
    endpoint = getattr(args, "rdzv_endpoint", "") or ":".join(
        str(part) for part in (getattr(args, "master_addr", None), getattr(args, "master_port", None)) if part
    )
    stops = [m["line"] for m in _messages(folder) if m["code"] in STOPS]
    hint = next((line.split("; ", 1)[1] for line in stops if "; " in line), None)
    how = hint or "once every node is up, run the same launch line again on each"
    print(
        f"fcsd {name}: lost the rendezvous store at {endpoint or 'the first node'} (the node hosting it is gone or "
        f"unreachable); this node's processes were stopped; {how}",
        file=sys.stderr,
    )
    return 1


def _stop_children(grace: float = 60) -> None:
    """SIGTERM to the processes this one started (the node's ranks), waited for ``grace`` seconds, then killed."""
    import psutil

    children = psutil.Process().children()
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=grace)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def _report_failure(folder: Path, name: str, rank: int | None, exitcode: int) -> int:
    """A process failed: the first error a process said (processes stopped by the launcher after it say they were
    stopped: not the cause), else a stop the processes were sent from elsewhere, else the failed process named."""
    messages = _messages(folder)
    errors = [m for m in messages if m["code"] not in STOPS]
    if errors:
        print(errors[0]["line"], file=sys.stderr)
        return errors[0]["code"]
    if messages:
        first = next((m for m in messages if m["rank"] == 0), messages[0])
        print(first["line"], file=sys.stderr)
        return first["code"]
    code = 128 - exitcode if exitcode < 0 else exitcode or 1
    who = "a process" if rank is None else f"process {rank}"
    print(f"fcsd {name}: {who} failed with exit status {code} (its own output is above)", file=sys.stderr)
    return code
