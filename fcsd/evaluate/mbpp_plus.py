"""MBPP+ pass@1 with evalplus: the early-stopping signal of FCSD (paper Sec. 3.1, 5.1).

Generation follows evalplus's own Hugging Face decoder (``evalplus.provider.hf``): the evalplus instruction and
response prefixes inside the model's chat template (plain task prompt when there is none), greedy decoding, the same
stop strings, then ``evalplus.sanitize``. We batch prompts (left padding) instead of decoding one by one.

Scoring uses evalplus's ground truth and ``check_correctness``. Nothing model-written, and no dataset code, runs in
the calling (training) process: the ground truth and every check run in a separate scoring process, and each check
runs the code in evalplus's own sandboxed subprocess (memory limit, destructive calls disabled, per-test time
limits).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch

# evalplus/codegen.py, the instruction-model prompts of the official MBPP+ leaderboard
INSTRUCTION_PREFIX = (
    "Please provide a self-contained Python script that solves the following problem in a markdown code block:"
)
RESPONSE_PREFIX = (
    "Below is a Python script with a self-contained function that solves the problem and passes corresponding tests:"
)


class MBPPPlusUnavailable(ValueError):
    """The MBPP+ problems could not be loaded."""


def load_problems(path: str | None = None, limit: int | None = None) -> dict[str, dict]:
    """The MBPP+ problems (evalplus format), the first ``limit`` by task number when given.

    ``path`` is an MbppPlus ``.jsonl`` file; None uses ``$MBPP_OVERRIDE_PATH`` or evalplus's download (network).
    """
    import evalplus.data.mbpp as mbpp

    path = path or os.environ.get("MBPP_OVERRIDE_PATH")
    if path and not Path(path).is_file():
        raise MBPPPlusUnavailable(f"MBPP+ file {path} does not exist; give an MbppPlus .jsonl file")
    mbpp.MBPP_OVERRIDE_PATH = path  # evalplus reads the variable at import time: set it on the module
    try:
        problems = mbpp.get_mbpp_plus()
    except Exception as error:
        raise MBPPPlusUnavailable(
            f"MBPP+ could not be loaded ({type(error).__name__}: {error}). Download MbppPlus.jsonl from the evalplus "
            "releases and set early_stop.data=PATH (or MBPP_OVERRIDE_PATH), or set early_stop.enabled=false"
        ) from error
    ordered = sorted(problems, key=lambda task_id: int(task_id.split("/")[-1]))
    return {task_id: problems[task_id] for task_id in ordered[:limit]}


def chat_prompt(problem: dict, tokenizer) -> str:
    """The prompt evalplus gives instruction-tuned models: the task inside the chat template, the assistant turn
    opened with a python code block."""
    from evalplus.provider.utility import make_raw_chat_prompt

    return make_raw_chat_prompt(problem["prompt"].strip() + "\n", INSTRUCTION_PREFIX, RESPONSE_PREFIX, tokenizer)


def stop_strings(tokenizer) -> list[str]:
    from evalplus.provider.utility import EOS, extra_eos_for_direct_completion

    extra = extra_eos_for_direct_completion("mbpp") if tokenizer.chat_template is None else ["\n```\n"]
    return [*EOS, *extra]


@torch.no_grad()
def generate_solutions(
    model, tokenizer, problems: dict[str, dict], max_new_tokens: int = 512, batch_size: int = 16, synced_gpus=False
) -> dict[str, str]:
    """Greedy, batched solutions of ``model`` for ``problems``, sanitized as evalplus does (task id -> code).

    ``synced_gpus`` keeps every process decoding until all are done (needed when parameters are sharded)."""
    from evalplus.sanitize import sanitize

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    stops = stop_strings(tokenizer)
    direct = tokenizer.chat_template is None
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    solutions = {}
    items = list(problems.items())
    try:
        for start in range(0, len(items), batch_size):
            chunk = items[start : start + batch_size]
            prompts = [p["prompt"].strip() + "\n" if direct else chat_prompt(p, tokenizer) for _, p in chunk]
            encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            output = model.generate(
                **encoded,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
                eos_token_id=tokenizer.eos_token_id,
                stop_strings=stops,
                tokenizer=tokenizer,
                synced_gpus=synced_gpus,
            )
            texts = tokenizer.batch_decode(output[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
            for (task_id, problem), text in zip(chunk, texts, strict=True):
                cut = min([text.index(s) for s in stops if s in text], default=len(text))
                code = text[:cut].replace("\t", "    ")
                solutions[task_id] = sanitize(problem["prompt"] + code if direct else code, problem["entry_point"])
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return solutions


@dataclass
class MBPPPlusScore:
    """pass@1 in percent on the base tests (MBPP) and on base + extra tests (MBPP+), and per-task statuses."""

    base: float
    plus: float
    problems: int
    status: dict[str, list[str]]  # task id -> [base status, plus status]

    def metric(self, name: str) -> float:
        return {"base": self.base, "plus": self.plus}[name]


def score_solutions(problems: dict[str, dict], solutions: dict[str, str], workers: int | None = None) -> MBPPPlusScore:
    """Run evalplus's base and plus tests on ``solutions`` (task id -> code; a missing one fails).

    The work happens in a fresh ``python -m fcsd.evaluate.mbpp_plus`` process: forking sandboxes out of a training
    process (or out of a multiprocessing pool worker, whose exit handlers wait for queues the fork does not have)
    is what we avoid."""
    import subprocess
    import sys
    import tempfile

    from evalplus.eval import PASS

    workers = workers or max(1, min(8, (os.cpu_count() or 2) // 2, len(problems)))
    with tempfile.TemporaryDirectory(prefix="fcsd-mbpp-") as folder:
        request, answer = Path(folder) / "request.pkl", Path(folder) / "status.json"
        with open(request, "wb") as handle:
            pickle.dump({"problems": problems, "solutions": solutions, "workers": workers}, handle)
        command = [sys.executable, "-m", "fcsd.evaluate.mbpp_plus", str(request), str(answer)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the evalplus scoring process failed:\n{done.stderr[-3000:]}")
        status = json.loads(answer.read_text())
    base = sum(s[0] == PASS for s in status.values())
    plus = sum(s[0] == PASS and s[1] == PASS for s in status.values())
    n = len(problems)
    return MBPPPlusScore(100.0 * base / n, 100.0 * plus / n, n, status)


def _score_in_this_process(problems: dict[str, dict], solutions: dict[str, str], workers: int) -> dict:
    """Ground truth (cached by evalplus, keyed by the problems' content) then one ``check_correctness`` per task;
    each check forks evalplus's sandbox."""
    from concurrent.futures import ThreadPoolExecutor

    from evalplus.eval._special_oracle import MBPP_OUTPUT_NOT_NONE_TASKS
    from evalplus.evaluate import check_correctness, get_groundtruth

    digest = hashlib.md5()
    for task_id in sorted(problems):
        digest.update(pickle.dumps((task_id, problems[task_id])))
    expected = get_groundtruth(problems, f"fcsd-mbpp-{digest.hexdigest()}", MBPP_OUTPUT_NOT_NONE_TASKS)

    def check(task_id: str) -> list[str]:
        solution = solutions.get(task_id, "")
        result = check_correctness("mbpp", 0, problems[task_id], solution, expected[task_id], False, True)
        return [result["base"][0], result["plus"][0]]

    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(problems, pool.map(check, problems), strict=True))


if __name__ == "__main__":  # the scoring process of score_solutions
    import contextlib
    import sys

    request_path, answer_path = sys.argv[1:3]
    with open(request_path, "rb") as handle:
        request = pickle.load(handle)
    with contextlib.redirect_stdout(sys.stderr):
        status = _score_in_this_process(request["problems"], request["solutions"], request["workers"])
    Path(answer_path).write_text(json.dumps(status))
