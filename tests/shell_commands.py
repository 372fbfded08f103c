"""Shell command lines checked without running their job (tests/test_docs.py: every example in docs/ and README.md;
tests/test_plan.py: the commands a plan prints).

- ``fcsd ...``, also behind ``accelerate launch ...``, ``torchrun ...`` (with ``fcsd launch`` in front or not) or
  ``python -m fcsd.cli ...``: fcsd's own
  :func:`fcsd.cli.main` runs, parser and checks included, up to the point where the command's job would start
  (:data:`JOBS`: the trainer, the demo, lm-eval, the export, the first model or routes file it loads, ...), which
  raises :class:`Reached` instead. The launcher's own parser (accelerate's, torchrun's) reads its part, and an
  ``accelerate --config_file`` must exist.
- ``make TARGET [VAR=VALUE ...]``: ``make -n`` (print, run nothing) must accept it.

A word ``...`` (an elided rest of the command) is dropped; ``$VAR`` words take the values of :data:`ENVIRONMENT`.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent

# where each command's job starts: everything before it runs for real (parser, config and argument checks)
JOBS = (
    "fcsd.distill.convert.convert",  # fcsd convert MODEL
    "fcsd.cli.demo.run_demo",  # fcsd convert demo
    "fcsd.distill.teacher_cache.cache_teacher",  # fcsd cache-teacher
    "fcsd.distill.sweep.run_sweep",  # fcsd sweep
    "fcsd.evaluate.harness.evaluate_checkpoints",  # fcsd eval: lm-eval (after the suite, option and code-execution
    # opt-in checks; resolving the model, below, comes first)
    "fcsd.export.save.export_checkpoint",  # fcsd export
    "fcsd.export.push.push",  # fcsd push
    "fcsd.distill.probe.probe_checkpoint",  # fcsd probe
    "fcsd.plan.perfmodel.load_config",  # fcsd perfmodel (after its option checks)
    "fcsd.plan.planner.make_plan",  # fcsd plan (after its option and cluster checks)
    "fcsd.sources.resolve_model",  # inspect, eval, routes record, bench --model: resolving the model (`demo` builds it)
    "fcsd.cli.routes.load_routes",  # fcsd routes stats / place: reading the routes file
)
LAUNCH = "torch.distributed.run"  # a command that starts processes of this (fcsd bench overlap's ranks, after its
# --ranks and --link checks) has reached its job too

# values of the shell variables examples use (a node's rank and address in a multi-node launch)
ENVIRONMENT = {"NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"}


class Reached(BaseException):
    """The job a checked command would start (a BaseException: no ``except Exception`` in fcsd swallows it)."""

    def __init__(self, job: str, args: tuple, kwargs: dict):
        super().__init__(job)
        self.job, self.args_, self.kwargs = job, args, kwargs


class CommandError(AssertionError):
    """A documented command that fcsd, a launcher or make refuses."""


@dataclass
class Checked:
    """What checking one command found: the fcsd arguments and the job it would start with its inputs (``job`` is
    None when the command completed by itself, e.g. ``--cfg job``, or is not fcsd's)."""

    words: list[str]
    fcsd_argv: list[str] | None = None
    job: str | None = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    @property
    def config(self):
        """The :class:`fcsd.distill.config.FCSDConfig` handed to the job (convert, cache-teacher, sweep)."""
        from fcsd.distill.config import FCSDConfig

        found = [a for a in (*self.args, *self.kwargs.values()) if isinstance(a, FCSDConfig)]
        if not found:
            raise CommandError(f"{shlex.join(self.words)}: no config reached a job (job: {self.job})")
        return found[0]


def split_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line (``a && b | c ; d``), as words; comments dropped, ``$VAR`` expanded."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, words = [], []
    for token in lexer:
        if token in ("&&", "||", "|", ";", "&"):
            commands.append(words)
            words = []
        else:
            words.append(ENVIRONMENT.get(token[1:], token) if token.startswith("$") else token)
    return [c for c in [*commands, words] if c]


def check_line(line: str, cwd: Path | None = None) -> list[Checked]:
    """Check every command of a shell line (see the module docstring); raises :class:`CommandError`."""
    return [check_words(words, cwd) for words in split_commands(line)]


def check_command(line: str, cwd: Path | None = None) -> Checked:
    """The one command of ``line`` (e.g. a command a plan prints), checked."""
    (checked,) = check_line(line, cwd)
    return checked


def check_words(words: list[str], cwd: Path | None = None) -> Checked:
    words = [w for w in words if w != "..."]
    program = words[0]
    if program == "make":
        return _check_make(words, cwd)
    if program == "fcsd" and words[1:2] == ["launch"]:  # fcsd launch LAUNCH-LINE: the launch line is checked
        return check_words(words[2:], cwd)
    if program == "fcsd":
        return check_fcsd(words, words[1:], cwd)
    if program == "accelerate" and words[1:2] == ["launch"]:
        from accelerate.commands.launch import launch_command_parser

        launch = _parse(launch_command_parser(), words[2:], words)
        if launch.config_file and not (Path(cwd or ROOT) / launch.config_file).is_file():
            raise CommandError(f"{shlex.join(words)}: no accelerate config {launch.config_file}")
        return _check_module(launch, words, cwd)
    if program == "torchrun":
        from torch.distributed.run import get_args_parser

        return _check_module(_parse(get_args_parser(), words[1:], words), words, cwd)
    if program.startswith("python") and words[1:3] == ["-m", "fcsd.cli"]:
        return check_fcsd(words, words[3:], cwd)
    raise CommandError(f"{shlex.join(words)}: not a command these tests can check (fcsd, make, a launcher of fcsd)")


def check_fcsd(words: list[str], argv: list[str], cwd: Path | None = None) -> Checked:
    """Run ``fcsd argv`` through :func:`fcsd.cli.main` until its job would start."""
    from fcsd.cli import main

    def stub(job):
        def reached(*args, **kwargs):
            raise Reached(job, args, kwargs)

        return reached

    def run(command, *args, **kwargs):  # other processes (a library's probe of the system) still run
        if LAUNCH in command:
            raise Reached(LAUNCH, (command, *args), kwargs)
        return real_run(command, *args, **kwargs)

    real_run, stderr = subprocess.run, io.StringIO()
    with contextlib.ExitStack() as stack:
        for job in JOBS:
            module, name = job.rsplit(".", 1)
            stack.enter_context(mock.patch.object(importlib.import_module(module), name, stub(job)))
        stack.enter_context(mock.patch.object(subprocess, "run", run))
        stack.enter_context(_working_directory(cwd or ROOT))
        stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        stack.enter_context(contextlib.redirect_stderr(stderr))
        try:
            code = main(list(argv))
        except Reached as reached:
            return Checked(words, list(argv), reached.job, reached.args_, reached.kwargs)
        except SystemExit as exit_:  # argparse
            code = exit_.code
    if code != 0:
        raise CommandError(f"{shlex.join(words)}: exit {code}: {stderr.getvalue().strip()}")
    return Checked(words, list(argv))


@contextlib.contextmanager
def _working_directory(path: Path):
    previous = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def _parse(parser, argv: list[str], words: list[str]):
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parser.parse_args(argv)
    except SystemExit:
        raise CommandError(f"{shlex.join(words)}: {stderr.getvalue().strip()}") from None


def _check_module(launch, words: list[str], cwd: Path | None) -> Checked:
    if not (launch.module and launch.training_script == "fcsd.cli"):
        raise CommandError(f"{shlex.join(words)}: launches {launch.training_script}, not -m fcsd.cli")
    return check_fcsd(words, list(launch.training_script_args), cwd)


def _check_make(words: list[str], cwd: Path | None) -> Checked:
    """``make -n``: the targets exist (and their recipes expand) without running anything."""
    done = subprocess.run(
        ["make", "-n", "-f", str(ROOT / "Makefile"), *words[1:]], cwd=cwd or ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise CommandError(f"{shlex.join(words)}: {done.stderr.strip()}")
    return Checked(words)
