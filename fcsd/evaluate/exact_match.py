"""Exact-match accuracy of greedy chat completions: the demo's task metric (its synthetic tasks have one answer)."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm


@torch.no_grad()
def exact_match(
    model, tokenizer, rows: list[dict], batch_size: int = 50, max_new_tokens: int = 24, progress: bool = False
) -> dict[str, float]:
    """Fraction of ``rows`` whose greedy completion equals the reference, per ``row["task"]`` and ``"all"``.

    Each row holds ``messages``: the prompt turns, then the reference assistant turn. Prompts are rendered with the
    tokenizer's chat template, left-padded and decoded greedily until EOS.
    """
    model.eval()
    device = next(model.parameters()).device
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    hits: dict[str, list[bool]] = {}
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
        for row, completion in zip(chunk, output[:, encoded["input_ids"].shape[1] :], strict=True):
            answer = tokenizer.decode(completion, skip_special_tokens=True).strip()
            hits.setdefault(row.get("task", "all"), []).append(answer == row["messages"][-1]["content"].strip())
    tokenizer.padding_side = padding_side
    scores = {task: sum(h) / len(h) for task, h in sorted(hits.items())}
    scores["all"] = sum(sum(h) for h in hits.values()) / sum(len(h) for h in hits.values())
    return scores
