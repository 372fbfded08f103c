"""Writes heldout.jsonl: the demo's held-out synthetic rows (seed 1, as `fcsd convert demo` holds out) with three
distractors each for the multiple-choice variant. Run from anywhere: python eval/tasks/fcsd_demo/make_data.py"""

import json
import random
from pathlib import Path

from fcsd.embedded.synthetic import make_dataset


def distractors(row: dict, rng: random.Random) -> list[str]:
    answer = row["messages"][-1]["content"]
    if row["task"] in ("add", "recall"):
        pool = [str(n) for n in range(19 if row["task"] == "add" else 10) if str(n) != answer]
        return rng.sample(pool, 3)
    digits, wrong = answer.split(), set()
    for _ in range(50):  # other orders of the same digits first: the hard distractors
        candidate = " ".join(rng.sample(digits, len(digits)))
        if candidate != answer:
            wrong.add(candidate)
    wrong = sorted(wrong)[:3]
    while len(wrong) < 3:  # too few distinct orders: change one digit
        position, digit = rng.randrange(len(digits)), str(rng.randint(0, 9))
        candidate = " ".join(digits[:position] + [digit] + digits[position + 1 :])
        if candidate != answer and candidate not in wrong:
            wrong.append(candidate)
    return wrong


def main() -> None:
    rng = random.Random(0)
    out = Path(__file__).with_name("heldout.jsonl")
    with open(out, "w") as handle:
        for row in make_dataset(200, seed=1):
            answer = row["messages"][-1]["content"]
            choices = [answer, *distractors(row, rng)]
            rng.shuffle(choices)
            record = {"task": row["task"], "question": row["messages"][0]["content"], "answer": answer}
            handle.write(json.dumps({**record, "choices": choices, "label": choices.index(answer)}) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
