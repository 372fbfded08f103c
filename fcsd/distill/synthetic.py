"""Chat-format synthetic tasks for the offline demo. Each row is ``{"messages": [user, assistant], "task": name}``
with one exact answer.

Two families, as in the paper's setting (conversion data is general instruction data; what must survive are the
original model's abilities, scored on tasks the conversion data does not cover):

- :data:`TASKS`, the scored "benchmark" tasks: addition, sorting and reversing short digit lists, key-value recall;
- :data:`GENERAL_TASKS`, the "general instruction data" the demo converts with: related skills, none of them a
  scored task: copying a digit list, sorting it in descending order, its maximum and minimum, subtraction, and the
  key that holds a value (recall backwards).

The demo teacher learns both; FCSD and SFT then train on the general tasks only. They are sized so that a 6-layer,
96-wide MoE learns them in a few minutes on a laptop CPU."""

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


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return path
