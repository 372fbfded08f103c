"""Chat-format synthetic tasks for the offline demo: addition, sorting and reversing short digit lists, and
key-value recall. Each row is ``{"messages": [user, assistant], "task": name}`` with one exact answer.

They are sized so that a 6-layer, 96-wide MoE learns them in a few minutes on a laptop CPU."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

TASKS = ("add", "sort", "reverse", "recall")


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
