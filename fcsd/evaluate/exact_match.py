"""Exact-match accuracy of greedy chat completions: the demo's task metric (its synthetic tasks have one answer)."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

MAX_NEW_TOKENS = 24  # the demo suite's lm-eval task (eval/tasks/fcsd_demo) generates as many (max_gen_toks)


@torch.no_grad()
def greedy_answers(
    model, tokenizer, rows: list[dict], batch_size: int = 50, max_new_tokens: int = MAX_NEW_TOKENS, progress=False
) -> list[str]:
    """The greedy completion of each row's prompt turns (``row["messages"]`` without its last turn), rendered with the
    tokenizer's chat template, zero-shot, left-padded, decoded until EOS; special tokens dropped, spaces stripped."""
    model.eval()
    device = next(model.parameters()).device
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    answers = []
    try:
        for start in tqdm(range(0, len(rows), batch_size), desc="exact match", disable=not progress):
            chunk = rows[start : start + batch_size]
            prompts = [
                tokenizer.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True)
                for row in chunk
            ]
            encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            output = model.generate(
                **encoded,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            for completion in output[:, encoded["input_ids"].shape[1] :]:
                answers.append(tokenizer.decode(completion, skip_special_tokens=True).strip())
    finally:
        tokenizer.padding_side = padding_side
    return answers


def exact_match(model, tokenizer, rows: list[dict], **options) -> dict[str, float]:
    """Fraction of ``rows`` whose greedy completion (:func:`greedy_answers`, same ``options``) equals the reference
    (the row's last turn), per ``row["task"]`` and ``"all"``."""
    return exact_match_of(greedy_answers(model, tokenizer, rows, **options), rows)


def exact_match_of(answers: list[str], rows: list[dict]) -> dict[str, float]:
    """Fraction of ``answers`` equal to their row's reference answer, per ``row["task"]`` and ``"all"``."""
    hits: dict[str, list[bool]] = {}
    for row, answer in zip(rows, answers, strict=True):
        hits.setdefault(row.get("task", "all"), []).append(answer.strip() == row["messages"][-1]["content"].strip())
    scores = {task: sum(h) / len(h) for task, h in sorted(hits.items())}
    scores["all"] = sum(sum(h) for h in hits.values()) / sum(len(h) for h in hits.values())
    return scores
