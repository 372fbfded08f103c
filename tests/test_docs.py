"""The manual cannot rot: every example in README.md and docs/ runs here, checked or run.

- Fenced ``bash`` blocks (every line) and ``console`` blocks (the ``$`` lines), and inline ``fcsd ...`` / ``make ...``
  code in the prose: each command goes through :mod:`shell_commands` (fcsd's own parser and config checks up to where
  its job would start; launchers' parsers; ``make -n``). An inline span that is a command's name (``fcsd routes
  stats``) or a synopsis (``[``, ``|`` or an upper-case placeholder such as ``MODEL``) is not a command.
- A command these tests cannot run (a server, ``curl``) needs a marker on the line before its block,
  ``<!-- unchecked: PROGRAM ... (reason) -->``; :data:`UNCHECKED` counts them per file, so none is added silently.
- Fenced ``python`` blocks run on tiny local models, each as a script of its own (one fresh interpreter runs them
  all, one namespace each): the hub ids and paths they name are the keys of :data:`PLACEHOLDERS`, replaced by local
  folders. A block after ``<!-- run: torchrun N -->`` runs on N gloo processes.
- Any other fence must say what it holds (``text``, ``yaml``, ``json``), so that no command hides in a bare block.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from launch import torchrun
from shell_commands import ROOT, CommandError, check_line, split_commands

PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
KNOWN_FENCES = {"bash", "console", "python", "text", "yaml", "json"}

# commands that are shown but not run here, per file; the marker before each block says why
UNCHECKED = {"README.md": 3, "docs/serving.md": 4}

# the hub ids and paths the Python examples name -> the tiny local model each stands for (see `stand_ins`)
PLACEHOLDERS = {
    "Qwen/Qwen3-30B-A3B": "stock",  # a tiny random Qwen3-MoE with a locally trained tokenizer
    "path/to/checkpoint": "stock",
    "path/to/converted": "converted",  # the same with FarSkip on its last half, saved with save_pretrained
    "OUT_DIR": "export",  # `fcsd export` of the converted one
}

# what the examples' relative paths refer to, seen from the folder commands are checked in: the checkout's own
# folders, and stand-ins for the user's files that a command reads before its job starts
CHECKOUT = {"recipes": "recipes", "eval": "eval", "my_suite.yaml": "eval/suites/demo.yaml", "my_tasks": "eval/tasks"}

MARKER = re.compile(r"<!--\s*(unchecked|run):\s*(.*?)\s*-->")


@dataclass
class Example:
    page: str  # relative to the checkout
    line: int
    kind: str  # "shell", "inline" or "python"
    text: str
    marker: tuple[str, str] | None = None  # ("unchecked", "vllm curl (why)") or ("run", "torchrun 2")

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _fenced(page: Path):
    """(fence language, first line number, body lines, marker of the line before the fence) per fenced block."""
    lines = page.read_text().split("\n")
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            found = MARKER.search(previous)
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            yield lines[i][3:].strip(), i + 2, lines[i + 1 : end], (found.groups() if found else None)
            i = end
        i += 1


def _shell_lines(language: str, start: int, body: list[str]):
    """(line number, command line) of a bash or console block: continuations and open quotes joined."""
    pending, first = "", None
    for number, line in enumerate(body, start):
        if not pending:
            if language == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            first = number
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quote opened on this line closes on a later one
            pending += "\n"
            continue
        yield first, pending
        pending = ""


def _command_names() -> set[str]:
    """fcsd's (sub)command names, from its parser: ``convert``, ``routes``, ``stats``, ``bench``, ``overlap``, ..."""
    import argparse

    from fcsd.cli import build_parser

    names, parsers = {"fcsd"}, [build_parser()]
    while parsers:
        for action in parsers.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                names |= set(action.choices)
                parsers += action.choices.values()
            elif not action.option_strings and action.choices:
                names |= set(action.choices)
    return names


def _is_inline_command(span: str, names: set[str]) -> bool:
    words = span.split()
    if words[0] == "make":
        return True
    if words[0] != "fcsd" or set(words) <= names:
        return False
    placeholder = any(re.fullmatch(r"[A-Z][A-Z_0-9]*", part) for part in re.split(r"[\s=@/,]+", span) if part)
    return not ("[" in span or "|" in span or placeholder)


def collect() -> list[Example]:
    examples, names = [], _command_names()
    for page in PAGES:
        name = str(page.relative_to(ROOT))
        for language, start, body, marker in _fenced(page):
            if language in ("bash", "console"):
                examples += [Example(name, n, "shell", line, marker) for n, line in _shell_lines(language, start, body)]
            elif language == "python":
                examples.append(Example(name, start, "python", "\n".join(body), marker))
        text = page.read_text()
        prose = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
        for found in re.finditer(r"`([^`]+)`", prose):
            span = " ".join(found.group(1).split())
            if _is_inline_command(span, names):
                examples.append(Example(name, prose.count("\n", 0, found.start()) + 1, "inline", span))
    return examples


EXAMPLES = collect()
SHELL = [e for e in EXAMPLES if e.kind in ("shell", "inline")]
PYTHON = [e for e in EXAMPLES if e.kind == "python"]


def _program(words: list[str]) -> str:
    return Path(words[0]).name


def _unchecked(example: Example) -> list[str]:
    """The commands of an example that its block's marker exempts."""
    if not example.marker or example.marker[0] != "unchecked":
        return []
    exempt = example.marker[1].split("(")[0].split()
    return [shlex.join(w) for w in split_commands(example.text) if _program(w) in exempt]


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """The folder commands are checked in: CHECKOUT is there, nothing else is."""
    folder = tmp_path_factory.mktemp("checked")
    for name, target in CHECKOUT.items():
        (folder / name).symlink_to(ROOT / target)
    return folder


@pytest.mark.parametrize("example", SHELL, ids=[e.id for e in SHELL])
def test_shell_example_is_accepted(example, sandbox):
    exempt = _unchecked(example)
    for words in split_commands(example.text):
        if shlex.join(words) in exempt:
            continue
        try:
            check_line(shlex.join(words), sandbox)
        except CommandError as error:
            pytest.fail(f"{example.id}: {error}")


def test_unchecked_commands_are_marked_and_counted():
    """Every command the tests do not run is exempted by a marker with its reason, and the count per file is the
    one this test states: adding one means changing UNCHECKED here."""
    found: dict[str, list[str]] = {}
    for example in SHELL:
        for command in _unchecked(example):
            found.setdefault(example.page, []).append(f"{example.id}: {command}")
        if example.marker and example.marker[0] == "unchecked":
            assert "(" in example.marker[1], f"{example.id}: the marker says no reason: {example.marker[1]}"
    assert {page: len(commands) for page, commands in found.items()} == UNCHECKED, "\n".join(
        c for commands in found.values() for c in commands
    )


def test_every_fence_says_what_it_holds():
    unknown = [
        f"{page.relative_to(ROOT)}:{start - 1}: ```{language}"
        for page in PAGES
        for language, start, _, _ in _fenced(page)
        if language not in KNOWN_FENCES
    ]
    assert not unknown, f"fences without a known language ({', '.join(sorted(KNOWN_FENCES))}): {unknown}"


def test_the_collector_finds_the_examples():
    """The examples this suite checks are there (a parser that found none would pass everything)."""
    pages = {e.page for e in EXAMPLES}
    assert {"README.md", "docs/converting.md", "docs/scale-out.md", "docs/serving.md"} <= pages
    assert len(SHELL) > 40 and len(PYTHON) >= 3
    assert any(e.text == "make install && make demo" for e in SHELL)
    assert any(e.text.startswith("fcsd launch accelerate launch") for e in SHELL)


def test_a_broken_command_is_caught(sandbox):
    """The checks refuse what fcsd, a launcher or make would refuse (so a passing example means something)."""
    for line in (
        "fcsd convert demo train.lrr=1e-3",  # an unknown key
        "fcsd convert Qwen/Qwen3-30B-A3B --resume",  # no data.path
        "fcsd eval runs/x --limit 0",
        "fcsd eval runs/x --suite paper",  # it runs model-written code: --allow-code-execution is required
        "fcsd bench overlap --link fast",
        "accelerate launch --config_file recipes/accelerate/none.yaml -m fcsd.cli convert demo",
        "torchrun --nproc_per_node 2 -m fcsd.cli convert demo train.lr=-1",
        "make no-such-target",
    ):
        with pytest.raises(CommandError):
            check_line(line, sandbox)


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """The tiny local models the placeholders stand for (PLACEHOLDERS)."""
    from tiny_models import save_chat_model

    import fcsd
    from fcsd.export.save import export_checkpoint

    root = tmp_path_factory.mktemp("stand-ins")
    chat = [
        [{"role": "user", "content": f"add {i} {i}"}, {"role": "assistant", "content": str(2 * i)}] for i in range(9)
    ]
    tokenizer = save_chat_model(root / "stock", [{"messages": m} for m in chat], vocab_size=120)
    model = fcsd.apply_farskip(fcsd.from_pretrained(str(root / "stock")), "last:50%")
    model.save_pretrained(root / "converted")
    tokenizer.save_pretrained(root / "converted")
    export_checkpoint(root / "converted", root / "export")
    return {name: str(root / folder) for name, folder in PLACEHOLDERS.items()}


RUN_BLOCKS = """
import json, sys, traceback
blocks, results = json.load(open(sys.argv[1])), {}
for name, code in blocks.items():  # each in its own namespace, as a script of its own
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
        results[name] = None
    except BaseException:
        results[name] = traceback.format_exc()
json.dump(results, open(sys.argv[2], "w"))
"""


def _with_stand_ins(code: str, stand_ins: dict[str, str]) -> str:
    for name, folder in stand_ins.items():
        code = code.replace(f'"{name}"', repr(folder))
    return code


@pytest.fixture(scope="module")
def python_results(stand_ins, tmp_path_factory):
    """The plain Python examples, run one after another in one fresh interpreter (one start-up for all)."""
    folder = tmp_path_factory.mktemp("python-examples")
    blocks = {e.id: _with_stand_ins(e.text, stand_ins) for e in PYTHON if not e.marker}
    (folder / "blocks.json").write_text(json.dumps(blocks))
    (folder / "run.py").write_text(RUN_BLOCKS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    command = [sys.executable, "run.py", "blocks.json", "results.json"]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((folder / "results.json").read_text())


@pytest.mark.parametrize("example", PYTHON, ids=[e.id for e in PYTHON])
def test_python_example_runs(example, request, tmp_path):
    if not example.marker:
        error = request.getfixturevalue("python_results")[example.id]
        assert error is None, f"{example.id}:\n{example.text}\n{error}"
        return
    kind, how = example.marker
    launcher, processes = how.split()
    assert (kind, launcher) == ("run", "torchrun"), f"{example.id}: unknown marker {example.marker}"
    script = tmp_path / "example.py"
    script.write_text(_with_stand_ins(example.text, request.getfixturevalue("stand_ins")))
    done = torchrun(int(processes), str(script), check=False, timeout=600)
    assert done.returncode == 0, f"{example.id}:\n{example.text}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
