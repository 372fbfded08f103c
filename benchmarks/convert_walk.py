"""How `fcsd convert` walks through fcsd's own modules before it loads the models (its pre-flight).

`fcsd convert` runs on the demo's files (built in a scratch cache, the teacher barely pretrained) with a tiny run,
under a profiler hook that follows fcsd's own frames from `fcsd.cli.main` to `fcsd.distill.student_teacher.load_models`
(where it stops the run: all before it resolves and checks the sources, the folders, the data and the resume):
calls into other packages are transparent, so the "current module" is the module of the innermost fcsd frame.
Printed:

- modules: how many distinct fcsd modules the walk enters (imports, i.e. module bodies and what they call, are not
  part of it);
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
    """Raised when the models start loading: the walk is over (a BaseException, so no `except Exception` keeps it)."""


def walk(argv: list[str]) -> list[tuple[str, str]]:
    """``(event, module)`` for each change of the current fcsd module while ``fcsd <argv>`` runs until it loads the
    models."""
    from fcsd.cli import main

    changes: list[tuple[str, str]] = []
    stack: list[str] = []
    importing = [0]  # fcsd module bodies running (an import): not part of the walk

    def profile(frame, event, _arg):
        if event not in ("call", "return"):
            return
        module = frame.f_globals.get("__name__", "")
        if not (module == "fcsd" or module.startswith("fcsd.")):
            return
        if frame.f_code.co_name == "<module>":
            importing[0] += 1 if event == "call" else -1
            return
        if importing[0]:
            return
        if event == "call":
            if frame.f_code.co_name == "load_models" and module == "fcsd.distill.student_teacher":
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
    import os

    from fcsd.embedded import assets as demo_assets

    with tempfile.TemporaryDirectory() as scratch:
        # the demo's files, its teacher barely pretrained (the walk does not depend on what the model knows)
        os.environ["FCSD_CACHE"] = str(Path(scratch) / "cache")
        demo_assets.PRETRAIN_STEPS = 1
        demo = demo_assets.prepare_demo()
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
    print(
        f"fcsd convert, fcsd.cli.main to load_models: {result['modules']} modules entered, {result['stays']} stays, "
        f"{result['climbs']} climbs back up"
    )
    for module, count in result["visits"].items():
        print(f"{count:>5}  {module}")


if __name__ == "__main__":
    main()
