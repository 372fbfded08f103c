"""The fcsd command being run, as a line a message tells the user to run again: under ``fcsd``, ``torchrun``,
``accelerate launch`` or ``fcsd launch`` (a resume of a parallel run must run with as many processes)."""

from __future__ import annotations

import os
import shlex
import sys

LINE_ENV = "FCSD_LAUNCH_LINE"  # under `fcsd launch`: its line's first words, what a message says to run again

_COMMAND: list[str] | None = None  # the fcsd command line being run (set by the CLI), for messages and the lock


def set_command(argv: list[str]) -> None:
    global _COMMAND
    _COMMAND = list(argv)


def command_line(*extra: str, replace: dict[str, str] | None = None) -> str:
    """The fcsd command being run, as a shell line (``extra`` arguments appended, each argument that is a key of
    ``replace`` replaced by its value): what a message tells the user to run again."""
    argv = [(replace or {}).get(arg, arg) for arg in command_argv()]
    return shlex.join([*launcher(), *argv, *extra])


def command_argv() -> list[str]:
    """The arguments of the fcsd command being run (after ``fcsd``)."""
    return list(_COMMAND if _COMMAND is not None else sys.argv[1:])


def torchrun_line(nproc: int, settings: dict[str, str] | None = None) -> str:
    """The command being run as a ``torchrun`` launch of ``nproc`` processes on this node (behind ``fcsd launch``),
    ``settings`` (``{"parallel.ep_size": "2"}``) replacing the command's own values of those keys."""
    settings = settings or {}
    argv = [arg for arg in command_argv() if arg.split("=", 1)[0] not in settings]
    extra = [f"{key}={value}" for key, value in settings.items()]
    return shlex.join([*torchrun_words(nproc), *argv, *extra])


def torchrun_words(nproc: int | str, nodes: list[str] | None = None) -> list[str]:
    """The first words of the ``fcsd launch torchrun`` line of ``nproc`` processes per node (``nodes``: the
    ``--nnodes`` options), up to the fcsd command."""
    return ["fcsd", "launch", "torchrun", *(nodes or []), "--nproc_per_node", str(nproc), "-m", "fcsd.cli"]


def launch_prefix() -> list[str] | None:
    """In a process of ``fcsd launch``: the first words of the launch line that runs the same command again (through
    ``-m fcsd.cli``); None elsewhere."""
    line = os.environ.get(LINE_ENV)
    if line is None or os.environ.get("TORCHELASTIC_RUN_ID") is None:
        return None
    return shlex.split(line)


def launcher() -> list[str]:
    """How this command was started, as the first words of a command line that runs it again: ``fcsd``, or for a
    rank of ``torchrun`` / ``accelerate launch`` with several processes the launcher with the same process counts
    (a resume of a parallel run must run with as many processes), behind ``fcsd launch`` when it ran under it."""
    launched = launch_prefix()
    if launched is not None:  # the launch line as the user wrote it (fcsd launch torchrun ... -m fcsd.cli)
        return launched
    environ = os.environ
    world, local = environ.get("WORLD_SIZE", "1"), environ.get("LOCAL_WORLD_SIZE", "1")
    if environ.get("TORCHELASTIC_RUN_ID") is None or not world.isdigit() or int(world) <= 1 or not local.isdigit():
        return ["fcsd"]
    nodes = [] if world == local else ["--nnodes", str(int(world) // max(int(local), 1))]
    if any(name.startswith("ACCELERATE_") for name in environ):
        machines = ["--num_machines", nodes[1]] if nodes else []
        return ["fcsd", "launch", "accelerate", "launch", *machines, "--num_processes", world, "-m", "fcsd.cli"]
    return torchrun_words(local, nodes)
