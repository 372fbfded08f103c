"""How `fcsd convert` walks through fcsd's own modules before its first training step (issue: validate once).

`fcsd convert` runs on the demo teacher (built once in the user cache) with a tiny run, under a profiler hook that
follows fcsd's own frames from `fcsd.cli.main` to the first `TrainingSession.forward_backward` (where it stops the
run): calls into other packages are transparent, so the "current module" is the module of the innermost fcsd frame.
Printed:

- modules: how many distinct fcsd modules the walk enters;
- stays: how many times the current module changes (each maximal stretch in one module is a stay);
- climbs: how many of those changes are returns (back up into a caller's module), the back-and-forth of a
  pre-flight that alternates between helpers;
- visits per module, most visited first.

    python benchmarks/convert_walk.py [--json]

Run it on two commits to compare a refactor (the numbers are deterministic for a given tree). Results are recorded
in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path


class _Reached(BaseException):
    """Raised at the first training step: the walk is over (a BaseException, so no `except Exception` keeps it)."""


def walk(argv: list[str]) -> list[tuple[str, str]]:
    """``(event, module)`` for each change of the current fcsd module while ``fcsd <argv>`` runs to its first step."""
    from fcsd.cli import main

    changes: list[tuple[str, str]] = []
    stack: list[str] = []

    def profile(frame, event, _arg):
        if event not in ("call", "return"):
            return
        module = frame.f_globals.get("__name__", "")
        if not (module == "fcsd" or module.startswith("fcsd.")):
            return
        if event == "call":
            if frame.f_code.co_name == "forward_backward" and module == "fcsd.distill.trainer":
                raise _Reached
            if not stack or stack[-1] != module:
                changes.append(("enter", module))
            stack.append(module)
        elif stack:
            stack.pop()
            if stack and stack[-1] != module:
                changes.append(("climb", stack[-1]))

    sys.setprofile(profile)
    try:
        main(argv)
    except _Reached:
        pass
    finally:
        sys.setprofile(None)
    return changes


def summary(changes: list[tuple[str, str]]) -> dict:
    visits = Counter(module for _, module in changes)
    return {
        "modules": len(visits),
        "stays": len(changes),
        "climbs": sum(event == "climb" for event, _ in changes),
        "visits": dict(visits.most_common()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from fcsd.demo_assets import prepare_demo

    demo = prepare_demo()
    with tempfile.TemporaryDirectory() as scratch:
        argv = [
            "convert",
            str(demo / "model"),
            f"data.path={demo / 'data' / 'train.jsonl'}",
            "data.seq_len=128",
            "train.batch_tokens=256",
            "train.max_steps=2",
            "train.warmup_steps=1",
            "data.eval_sequences=2",
            "early_stop.enabled=false",
            f"output_dir={Path(scratch) / 'run'}",
            "progress=false",
        ]
        result = summary(walk(argv))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"fcsd convert, fcsd.cli.main to the first training step: {result['modules']} modules entered, ")
    print(f"{result['stays']} stays, {result['climbs']} climbs back up")
    for module, count in result["visits"].items():
        print(f"{count:>5}  {module}")


if __name__ == "__main__":
    main()
