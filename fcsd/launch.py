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
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MESSAGES_ENV = "FCSD_LAUNCH_MESSAGES"  # the folder each process of a launch leaves its last word in
LINE_ENV = "FCSD_LAUNCH_LINE"  # the launch line's first words: what a message tells the user to run again
STOPS = {130: signal.SIGINT, 143: signal.SIGTERM}
USAGE = (
    "put fcsd launch in front of a launch line of fcsd: `fcsd launch torchrun --nproc_per_node N -m fcsd.cli "
    "convert ...` or `fcsd launch accelerate launch --config_file FILE -m fcsd.cli convert ...`"
)


def say(line: str, code: int) -> None:
    """Print ``line`` (an error or a stop, one line; the command ends with status ``code``) on stderr; in a process
    of ``fcsd launch``, leave it to the launch to print once instead (the first word a process says is kept)."""
    folder = os.environ.get(MESSAGES_ENV)
    if folder is None or os.environ.get("TORCHELASTIC_RUN_ID") is None:
        print(line, file=sys.stderr)
        return
    record = json.dumps({"rank": int(os.environ.get("RANK", "0")), "line": line, "code": code, "time": time.time()})
    path = Path(folder) / f"{os.environ.get('RANK', '0')}.json"
    try:
        with open(path, "x") as file:
            file.write(record)
    except FileExistsError:
        pass
    except OSError:  # the launch's folder is gone: say it here
        print(line, file=sys.stderr)


def launch_prefix() -> list[str] | None:
    """In a process of ``fcsd launch``: the first words of the launch line that runs the same command again (through
    ``-m fcsd.cli``); None elsewhere."""
    line = os.environ.get(LINE_ENV)
    if line is None or os.environ.get("TORCHELASTIC_RUN_ID") is None:
        return None
    return shlex.split(line)


def launch(words: list[str]) -> int:
    """Run the launch line ``words`` (``torchrun ... -m fcsd.cli COMMAND ...`` or ``accelerate launch ...``) and
    return its exit status, having printed at most one line of its own (see the module docstring)."""
    parser, run = _launcher(words)
    options = words[2:] if words[:2] == ["accelerate", "launch"] else words[1:]
    args = parser.parse_args(options)
    if not (args.module and args.training_script == "fcsd.cli"):
        raise ValueError(f"`{shlex.join(words)}` does not run fcsd: {USAGE}")
    command = list(args.training_script_args)
    from fcsd.cli import parse_command

    parse_command(command)  # a usage error is said once, here, before any process starts
    prefix = ["fcsd", "launch", *words[: len(words) - len(command)]]
    name = next((word for word in command if not word.startswith("-")), "launch")
    with tempfile.TemporaryDirectory(prefix="fcsd-launch-") as folder:
        saved = {key: os.environ.get(key) for key in (MESSAGES_ENV, LINE_ENV)}
        os.environ.update({MESSAGES_ENV: folder, LINE_ENV: shlex.join(prefix)})
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

    _quiet_launcher_logs()
    try:
        run(args)
        return 0
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


def _quiet_launcher_logs() -> None:
    """torchrun's warnings of a failure or a stop ("failed (exitcode: 2)", "Sending process ... closing signal"):
    this launch reports those in one line. Each of its loggers has its level set, so each is set here."""
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
