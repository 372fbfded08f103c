"""The ``fcsd`` command line. Thin: it parses arguments and calls library functions."""

from __future__ import annotations

import argparse
import sys

from fcsd.cli.errors import input_errors, is_symlink_loop, one_line, quiet_hub_retries
from fcsd.cli.stops import command_name, exit_stopped, say_stopped, stops_said_at_exit

DESCRIPTION = (
    "FarSkip-Collective conversion of Hugging Face MoE models with FCSD self-distillation: inspect, probe and convert "
    "a checkpoint, export, evaluate and push the result; measure expert-parallel overlap (bench) and place experts "
    "from recorded routes (routes)."
)


def build_parser() -> argparse.ArgumentParser:
    from fcsd.cli import checkpoints, performance, planning, routes, runs

    parser = argparse.ArgumentParser(prog="fcsd", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    runs.add_parsers(sub)  # convert, sweep, cache-teacher
    checkpoints.add_parsers(sub)  # inspect, probe, export, eval, push
    planning.add_parser(sub)  # plan
    performance.add_parsers(sub)  # perfmodel, bench
    routes.add_parser(sub)  # routes record | stats | place
    p = sub.add_parser(
        "launch",
        help="run a torchrun / accelerate launch line of fcsd with one voice: an error or a stop is said once, "
        "with its own exit status (2, 130, 143), and no launcher traceback",
        description="Put `fcsd launch` in front of a launch line: fcsd launch torchrun --nproc_per_node 2 -m "
        "fcsd.cli convert demo",
    )
    p.add_argument("line", nargs=argparse.REMAINDER, help="the launch line: torchrun ... or accelerate launch ...")
    p.set_defaults(func=_launch)
    return parser


def _launch(args) -> int:
    from fcsd.cli.launch import launch

    return launch(args.line, check_command=parse_command)


# the commands that import torch anyway: imported first, a stop deferred until it is complete (stopping.import_torch)
TORCH_COMMANDS = {"convert", "cache-teacher", "sweep", "export", "eval", "probe", "plan", "bench", "routes", "launch"}


def _check_device(args) -> None:
    """A ``--device`` torch knows and this machine has, and ``--backend nccl`` only with a GPU: one line before any
    work (they were tracebacks from inside torch, or a silent run on the CPU)."""
    import torch

    name = getattr(args, "device", None)
    if name is not None and not (name == "auto" and args.command == "bench"):  # only bench takes auto
        try:
            device = torch.device(name)
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ValueError(f"--device {name}: give cpu, cuda or cuda:N")
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.type == "cuda" and (device.index or 0) >= visible:
            seen = f"{visible} CUDA device{'s' * (visible != 1)} visible" if visible else "no CUDA device is visible"
            raise ValueError(f"--device {name}: {seen} on this machine; use --device cpu")
    if getattr(args, "backend", None) == "nccl" and not torch.cuda.is_available():
        raise ValueError("--backend nccl needs a CUDA device, and none is visible; use --backend gloo")


def parse_command(argv: list[str]) -> argparse.Namespace:
    """The parsed ``fcsd argv`` (a usage error: argparse's message and ``SystemExit(2)``)."""
    if argv[:1] == ["launch"] and argv[1:2] not in ([], ["-h"], ["--help"]):  # the launch line, word for word
        return argparse.Namespace(command="launch", line=argv[1:], func=_launch, argv=argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(_joined_option_values(parser, argv))
    if extra and hasattr(args, "overrides") and not any(e.startswith("-") for e in extra):
        args.overrides += extra  # key=value after a flag (`fcsd convert M --resume train.lr=1e-5`)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    """The ``fcsd`` command (``argv``: its arguments; None: this process's own, and then a stop ends the process
    with its status at once, see :func:`exit_stopped`). Bad input: one line, status 2; Ctrl-C: 130; SIGTERM: 143."""
    from fcsd import stopping
    from fcsd.cli.launch import say

    previous = stopping.install()  # first of all: a stop while fcsd imports or loads is one line too
    whole_process = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    args, said = None, None
    try:
        from fcsd import quiet
        from fcsd.command_line import set_command

        quiet.install()
        quiet_hub_retries()
        args = parse_command(argv)
        set_command(argv)
        if args.command in TORCH_COMMANDS:
            stopping.import_torch()
            _check_device(args)
        return args.func(args)
    except SystemExit:
        raise
    except BaseException as error:
        stopping.ignore_further_stops()  # the command has ended: a stop now must not chain onto this report
        name = command_name(args, argv)
        code = stopping.was_stopped(error) or stopping.orphaned_stop()
        if code is not None:
            say_stopped(args, argv, code)
            if whole_process:
                exit_stopped(code)
            return code
        if isinstance(error, input_errors()) or is_symlink_loop(error):
            say(f"fcsd {name}: error: {one_line(error)}", 2)
            said = 2
            return 2
        raise
    finally:
        stopping.restore(previous)
        if whole_process:
            stops_said_at_exit(args, argv, previous, said)


def _joined_option_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--link -1MB/s`` as ``--link=-1MB/s``: argparse takes a value that starts with a dash for an option and
    answers "expected one argument"; an option that takes a value gets the next word whatever it starts with, so
    that the value itself is checked (and refused in fcsd's words if wrong)."""
    commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    actions = [a for group in commands for sub in group.choices.values() for a in sub._actions]
    takes_value = {option for a in actions if a.nargs is None for option in a.option_strings}
    joined, i = [], 0
    while i < len(argv):
        word = argv[i]
        if word in takes_value and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1] not in takes_value:
            joined.append(f"{word}={argv[i + 1]}")
            i += 2
            continue
        joined.append(word)
        i += 1
    return joined
