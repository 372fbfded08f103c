"""Chat-format synthetic tasks for the offline demo: multi-digit addition, sorting short lists, reversing strings
and key-value recall. Each row is ``{"messages": [user, assistant], "task": name}`` with an exact answer."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

TASKS = ("add", "sort", "reverse", "recall")


def make_example(task: str, rng: random.Random) -> dict:
    if task == "add":
        a, b = rng.randint(10, 9999), rng.randint(10, 9999)
        question, answer = f"add {a} + {b}", str(a + b)
    elif task == "sort":
        values = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
        question, answer = f"sort {' '.join(map(str, values))}", " ".join(map(str, sorted(values)))
    elif task == "reverse":
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))
        question, answer = f"reverse {word}", word[::-1]
    elif task == "recall":
        keys = rng.sample(string.ascii_lowercase, 4)
        pairs = {k: rng.randint(0, 99) for k in keys}
        key = rng.choice(keys)
        question = "recall " + " ".join(f"{k}={v}" for k, v in pairs.items()) + f" ; {key}?"
        answer = str(pairs[key])
    else:
        raise ValueError(f"unknown synthetic task {task!r}; choose from {TASKS}")
    return {"task": task, "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def make_dataset(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [make_example(TASKS[i % len(TASKS)], rng) for i in range(n)]


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return path
