"""Held-out figures of the student (paper Sec. 5.1 scores the converted model before and after training):
per-token KL(teacher || student) and next-token NLL.

With an online teacher the KL is the full-vocabulary forward KL at temperature 1 (``eval/kl``). From a teacher
cache only the top-k log-probabilities at ``train.temperature`` exist, so the figure is the KL of the two
distributions coarsened to k+1 outcomes at that temperature, scaled by T² like the loss (``eval/kl_topk``; equal to
the full KL when k is the vocabulary size and T = 1): a different number, logged under its own name.

With an online teacher three agreement figures come beside the KL, so that "recovered" can be read as "predicts what
the teacher predicts": ``eval/acc`` (the student's argmax equals the true next token, over the tokens that have one),
``eval/teacher_acc`` (the same for the teacher on the same rows) and ``eval/top1_agree`` (the student's argmax equals
the teacher's, over every token the KL scores). A teacher cache holds no teacher argmax over the full vocabulary at
temperature 1, so these are left out there.
"""

from __future__ import annotations

import torch

from fcsd.distill import losses
from fcsd.distill.data import Packed
from fcsd.distill.objectives import head_inputs, release, teacher_targets, teacher_token_loss
from fcsd.run_facts import KL_KEYS

AGREEMENT_KEYS = ("eval/acc", "eval/teacher_acc", "eval/top1_agree")


def _agreement_sums(x, head, teacher_x, teacher_head, labels, chunk: int) -> tuple[float, float, float]:
    """Summed over the tokens: the student's argmax equal to the label, the teacher's equal to the label, and the
    two argmaxes equal (-100: no label, never a hit); one head projection of each per chunk."""
    hits = teacher_hits = agree = 0.0
    with torch.no_grad():
        for start in range(0, x.shape[0], chunk):
            rows = slice(start, start + chunk)
            mine, theirs = head(x[rows]).argmax(-1), teacher_head(teacher_x[rows]).argmax(-1)
            hits += float((mine == labels[rows]).sum())
            teacher_hits += float((theirs == labels[rows]).sum())
            agree += float((mine == theirs).sum())
    return hits, teacher_hits, agree


def kl_name(metrics: dict) -> str:
    """How a message names the held-out KL of ``metrics``: the full KL, or the teacher cache's top-k figure."""
    return "held-out KL" if KL_KEYS[0] in metrics else "held-out top-k KL (from the teacher cache)"


@torch.no_grad()
def heldout_metrics(
    student, held: Packed, config, teacher=None, cache=None, cache_offset: int = 0, head_in_forward=False
) -> dict:
    """``eval/kl`` (online teacher) or ``eval/kl_topk`` (``cache``, rows from ``cache_offset``), and ``eval/nll``
    of ``student`` (unwrapped) on ``held``; with an online teacher also ``eval/acc``, ``eval/teacher_acc`` and
    ``eval/top1_agree`` (see the module's docstring)."""
    was_training = student.training
    student.eval()
    device = next(student.parameters()).device
    kl_sum, nll_sum, kl_tokens, nll_tokens = 0.0, 0.0, 0, 0
    hits, teacher_hits, agree = 0.0, 0.0, 0.0
    chunk, temperature = config.train.loss_chunk_size, config.train.temperature
    for start in range(0, len(held), config.train.micro_batch_size):
        rows = held.rows(slice(start, start + config.train.micro_batch_size))
        batch = Packed(rows.input_ids.to(device), rows.position_ids.to(device))
        x, head, _ = head_inputs(student, student, batch, head_in_forward)
        labels = batch.sft_labels().reshape(-1)
        nll_sum += float(losses.chunked_head_loss(x, head, losses.cross_entropy, (labels,), chunk))
        nll_tokens += int((labels != -100).sum())
        if cache is not None:
            logp, ids = cache.rows(list(range(cache_offset + start, cache_offset + start + len(rows))))
            targets = (logp.reshape(x.shape[0], -1).to(device), ids.reshape(x.shape[0], -1).to(device))
            token_loss = lambda s, lp, i: losses.topk_forward_kl(s, lp, i, temperature)  # noqa: E731
        else:
            teacher_x, teacher_head, _ = teacher_targets(teacher, batch, head_in_forward=head_in_forward)
            targets = (teacher_x,)
            token_loss = teacher_token_loss(losses.divergence("forward_kl"), teacher_head)
            sums = _agreement_sums(x, head, teacher_x, teacher_head, labels, chunk)
            hits, teacher_hits, agree = (total + part for total, part in zip((hits, teacher_hits, agree), sums))
        kl_sum += float(losses.chunked_head_loss(x, head, token_loss, targets, chunk))
        kl_tokens += x.shape[0]
        release(head)  # no backward follows to reshard an FSDP2 head
        if cache is None:
            release(teacher_head)
    student.train(was_training)
    result = {KL_KEYS[cache is not None]: kl_sum / kl_tokens, "eval/nll": nll_sum / nll_tokens}
    if cache is None:
        result.update(
            zip(AGREEMENT_KEYS, (hits / nll_tokens, teacher_hits / nll_tokens, agree / kl_tokens), strict=True)
        )
    return result
