"""A stopped command's one line (Ctrl-C: 130, SIGTERM: 143) with the way on: the ``--resume`` line of an interrupted
run, the ``fcsd export`` of a finished one whose export the stop cut short."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def say_stopped(args, argv: list[str], code: int) -> None:
    """The one line of a stopped command (status ``code``: 130 or 143), with the way on (:func:`resume_hint`)."""
    from fcsd.cli.launch import say

    how = "terminated (SIGTERM)" if code == 143 else "interrupted"
    say(f"fcsd {command_name(args, argv)}: {how}{resume_hint(args)}", code)


def stops_said_at_exit(args, argv: list[str], handled: dict, said: int | None = None) -> None:
    """A stop that comes after the command returned, while the interpreter ends (threads joined, exit handlers), is
    said in one line too, as any stop (a Ctrl-C just after a run's "exported" line ended it with status 130 and
    nothing said), and ends the process at once with its status; after an error already said (status ``said``: a
    launcher stopping the other ranks of a refusal) the process ends silently with that status. ``handled``: the
    signals fcsd handles (a SIGINT the shell ignores stays ignored)."""
    from fcsd import stopping

    def stop(signum, frame):
        stopping.ignore_further_stops()
        if said:
            exit_stopped(said)
        code = 143 if signum == signal.SIGTERM else 130
        say_stopped(args, argv, code)
        exit_stopped(code)

    for sig in handled:
        signal.signal(sig, stop)


def exit_stopped(code: int) -> None:
    """End the process with ``code`` now. An interrupt that landed inside a string ``exec`` (dataclasses build their
    ``__init__`` that way while a library imports) marks the interpreter as interrupted, and Python would then end
    itself by SIGINT at exit whatever the command returned; the command's own cleanup has run by now."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def resume_hint(args) -> str:
    """For an interrupted ``convert``: the step of its newest checkpoint and the command that continues it; for a
    sweep, that the same command continues it."""
    if args is not None and args.command == "sweep":
        return "; run the same command again to continue: finished runs are kept, the stopped one resumes"
    if args is None or args.command != "convert" or getattr(args, "cfg", None):
        return ""
    try:
        from fcsd.cli.runs import run_config
        from fcsd.distill.config import to_config
        from fcsd.files.run_folder import RunFolder

        config = to_config(run_config(args), resolve=False)  # no second note about the guide
    except BaseException:  # the interrupt came before the config was valid (or came again): nothing to resume
        return ""
    run = RunFolder(config.output_dir)
    if config.model.name == "demo":  # its runs live in two folders below output_dir: the stopped one resumes
        from fcsd.cli.demo import demo_runs

        stopped = [folder for folder in demo_runs(config.output_dir).values() if not folder.final.exists()]
        if not stopped:
            return f"; the demo's runs in {config.output_dir} had finished: run the same command again (it trains both)"
        run = stopped[0]  # the demo trains its runs in order: the first unfinished one is the one stopped
    elif run.final.exists():  # written by one rename: the run finished, and a resume is refused
        return _finished_hint(run, config)
    checkpoints = run.checkpoints()
    if not checkpoints:
        return f"; no checkpoint was saved yet in {run.root}: run the same command again to restart"
    import shlex

    from fcsd.command_line import launcher

    words = [*launcher(), *(a for a in args.argv if a not in ("--resume", "train.resume=true")), "--resume"]
    command = shlex.join(words)
    return f"; the last checkpoint is {checkpoints[-1].name} in {run.root}: continue with `{command}`"


def _finished_hint(run, config) -> str:
    """For a convert stopped after its ``final/`` was written (while it exported, pushed or exited): that the run
    finished, and the ``fcsd export`` that writes an export the stop cut short (``--resume`` refuses a finished run)."""
    import shlex

    export_dir = Path(config.export_dir or run.export)
    if config.export and not (export_dir / "config.json").exists():
        command = shlex.join(["fcsd", "export", str(run.root), str(export_dir)])
        return f"; the run in {run.root} finished (final/ is written) but not its export: write it with `{command}`"
    written = f"final/ and {export_dir}" if config.export else "final/"
    return f"; the run in {run.root} had finished ({written} written)"


def command_name(args, argv: list[str]) -> str:
    return getattr(args, "command", None) or next((a for a in argv if not a.startswith("-")), "")
