"""Distillation losses as standalone functions (paper Sec. 2.2, Eqs. 3-5; design §3).

All functions take logits shaped ``(..., vocab)`` and return the *sum* over tokens together with the token count,
so callers can normalise by a global token count. They work through the tokens in chunks so that fp32
full-vocabulary log-probabilities exist for at most ``chunk_size`` tokens of both models at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def forward_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, int]:
    """Sum over tokens of KL(teacher || student) (paper Eq. 4) and the number of tokens summed.

    ``mask`` (bool, shape ``logits.shape[:-1]``) selects the tokens that count. Vocabularies must match.
    """
    if student_logits.shape[-1] != teacher_logits.shape[-1]:
        raise ValueError(
            f"vocabulary mismatch: student logits have {student_logits.shape[-1]} entries, teacher logits "
            f"{teacher_logits.shape[-1]}; FCSD distils a model into itself, so load both from the same checkpoint"
        )
    vocab = student_logits.shape[-1]
    student = student_logits.reshape(-1, vocab)
    teacher = teacher_logits.reshape(-1, vocab)
    if mask is not None:
        keep = mask.reshape(-1).nonzero().squeeze(-1)
        student, teacher = student[keep], teacher[keep]
    total = student.new_zeros((), dtype=torch.float32)
    for start in range(0, student.shape[0], chunk_size):
        s = F.log_softmax(student[start : start + chunk_size].float() / temperature, dim=-1)
        t = F.log_softmax(teacher[start : start + chunk_size].float() / temperature, dim=-1)
        total = total + F.kl_div(s, t, log_target=True, reduction="sum")
    return total * temperature**2, student.shape[0]


def next_token_nll(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, chunk_size: int = 1024
) -> tuple[torch.Tensor, int]:
    """Sum of next-token negative log-likelihoods (paper Eq. 3) and the number of scored tokens.

    ``labels`` are aligned with ``logits`` (position t predicts ``labels[t]``); entries equal to ``ignore_index``
    do not count.
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    total = flat_logits.new_zeros((), dtype=torch.float32)
    for start in range(0, flat_labels.shape[0], chunk_size):
        total = total + F.cross_entropy(
            flat_logits[start : start + chunk_size].float(),
            flat_labels[start : start + chunk_size],
            ignore_index=ignore_index,
            reduction="sum",
        )
    return total, int((flat_labels != ignore_index).sum())
