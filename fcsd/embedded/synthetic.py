"""Chat-format synthetic tasks for the offline demo. Each row is ``{"messages": [user, assistant], "task": name}``
with one exact answer.

Two families, as in the paper's setting (the original model's abilities are scored on benchmarks; the conversion
data is general instruction data that covers those skills among many others):

- :data:`TASKS`, the scored "benchmark" tasks: addition, sorting and reversing short digit lists, key-value recall;
- :data:`GENERAL_TASKS`, the other tasks of the "general instruction data": copying a digit list, sorting it in
  descending order, its maximum and minimum, subtraction, and the key that holds a value (recall backwards).

The demo teacher learns both with the gold answers. The conversion data mixes both families, on other prompts than
the scored ones, with the answers of another "writer" (:func:`writer_answer`: its own phrasing and its own
mistakes), as instruction data written by other models is. The tasks are sized so that a 6-layer, 96-wide MoE
learns them in a few minutes on a laptop CPU."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

TASKS = ("add", "sort", "reverse", "recall")
GENERAL_TASKS = ("copy", "desc", "max", "min", "sub", "lookup")


def make_example(task: str, rng: random.Random) -> dict:
    digits = [rng.randint(0, 9) for _ in range(rng.randint(3, 4))]
    if task == "add":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        question, answer = f"add {a} + {b}", str(a + b)
    elif task == "sort":
        question, answer = f"sort {' '.join(map(str, digits))}", " ".join(map(str, sorted(digits)))
    elif task == "reverse":
        question, answer = f"reverse {' '.join(map(str, digits))}", " ".join(map(str, digits[::-1]))
    elif task == "recall":
        keys = rng.sample(string.ascii_lowercase, 3)
        pairs = {k: rng.randint(0, 9) for k in keys}
        key = rng.choice(keys)
        question = "recall " + " ".join(f"{k}={v}" for k, v in pairs.items()) + f" ; {key}?"
        answer = str(pairs[key])
    elif task == "desc":
        question, answer = f"desc {' '.join(map(str, digits))}", " ".join(map(str, sorted(digits, reverse=True)))
    elif task == "sub":
        a, b = sorted((rng.randint(0, 18), rng.randint(0, 9)), reverse=True)
        question, answer = f"sub {a} - {b}", str(a - b)
    elif task == "copy":
        question, answer = f"copy {' '.join(map(str, digits))}", " ".join(map(str, digits))
    elif task in ("max", "min"):
        question, answer = f"{task} {' '.join(map(str, digits))}", str(max(digits) if task == "max" else min(digits))
    elif task == "lookup":
        keys, values = rng.sample(string.ascii_lowercase, 3), rng.sample(range(10), 3)
        value = rng.choice(values)
        question = "lookup " + " ".join(f"{k}={v}" for k, v in zip(keys, values, strict=True)) + f" ; ={value}?"
        answer = keys[values.index(value)]
    else:
        raise ValueError(f"unknown synthetic task {task!r}; choose from {TASKS + GENERAL_TASKS}")
    return {"task": task, "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def make_dataset(n: int, seed: int = 0, tasks: tuple[str, ...] = TASKS) -> list[dict]:
    """``n`` rows cycling through ``tasks`` (the scored tasks by default), reproducible from ``seed``."""
    rng = random.Random(seed)
    return [make_example(tasks[i % len(tasks)], rng) for i in range(n)]


WRITER_PHRASING = 1 / 3  # the share of the writer's answers in its own phrasing
WRITER_PHRASE = "the answer is "
WRITER_ERRORS = 1 / 4  # the share of the writer's answers with a mistake (independent of the phrasing)


def writer_answer(answer: str, rng: random.Random) -> str:
    """The conversion data's "writer" answering a prompt whose gold answer is ``answer``: another model than the
    teacher, with a habit of its own (:data:`WRITER_PHRASING` of its answers open with :data:`WRITER_PHRASE`) and
    its own mistakes (:data:`WRITER_ERRORS` of them: two neighbours of a list swapped, or a value one off), so about
    half of its answers are the teacher's exact answer (paper Sec. 5: responses in SFT data are written by other
    models, which is why SFT on them moves a model away from its own outputs)."""
    if rng.random() < WRITER_ERRORS:
        answer = mistake(answer, rng)
    return WRITER_PHRASE + answer if rng.random() < WRITER_PHRASING else answer


def mistake(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer: two different neighbours of a list swapped, else one item one off (a digit by one,
    a letter by one place)."""
    items = answer.split()
    swappable = [i for i in range(len(items) - 1) if items[i] != items[i + 1]]
    if swappable:
        i = rng.choice(swappable)
        items[i], items[i + 1] = items[i + 1], items[i]
        return " ".join(items)
    i = rng.randrange(len(items))
    item = items[i]
    if item.isdigit():
        items[i] = str(int(item) + 1 if item == "0" or rng.random() < 0.5 else int(item) - 1)
    else:
        items[i] = "b" if item == "a" else chr(ord(item) - 1)
    return " ".join(items)


def conversion_data(n: int, seed: int, held_out: list[dict]) -> list[dict]:
    """The demo's conversion data: ``n`` rows of all ten tasks (the scored ones among the others), none with a
    prompt of ``held_out``, answered by :func:`writer_answer`."""
    rng = random.Random(seed)
    taken = {row["messages"][0]["content"] for row in held_out}
    tasks, rows = TASKS + GENERAL_TASKS, []
    while len(rows) < n:
        row = make_example(tasks[len(rows) % len(tasks)], rng)
        if row["messages"][0]["content"] not in taken:
            rows.append(with_answer(row, writer_answer(row["messages"][-1]["content"], rng)))
    return rows


def with_answer(row: dict, answer: str) -> dict:
    """``row`` with another assistant answer."""
    return {**row, "messages": [*row["messages"][:-1], {"role": "assistant", "content": answer}]}


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return path
