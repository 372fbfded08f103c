"""Distillation losses as standalone functions (paper Sec. 2.2, Eqs. 3-5; design §3).

Two layers:

* per-token divergences on logits ``(N, vocab)`` -> ``(N,)``: :func:`kl_divergence` (forward KL(teacher || student),
  the paper's Eq. 4, or reverse), :func:`jensen_shannon`, :func:`topk_forward_kl` (against a cached top-k teacher);
* :func:`chunked_head_loss`, which applies the LM head and a per-token loss to ``chunk_size`` hidden states at a time
  and computes each chunk's gradients right away, so full-vocabulary logits never exist for more than one chunk
  (the pattern of Liger-Kernel's fused linear + loss and torchtune's chunked output).

Reducers return the *sum* over tokens with the token count, so that callers normalise by a global token count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fcsd.distill.config import DIVERGENCES


def check_vocabularies(student_vocab: int, teacher_vocab: int) -> None:
    if student_vocab != teacher_vocab:
        raise ValueError(
            f"vocabulary mismatch: the student has {student_vocab} output entries, the teacher {teacher_vocab}; "
            "FCSD distils a model into itself, so load teacher and student from the same checkpoint and tokenizer"
        )


def kl_divergence(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0, reverse: bool = False
) -> torch.Tensor:
    """Per-token KL(teacher || student) (paper Eq. 4), or KL(student || teacher) with ``reverse``; fp32, scaled by
    ``temperature**2`` so gradients keep their size across temperatures."""
    check_vocabularies(student_logits.shape[-1], teacher_logits.shape[-1])
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    p, q = (s, t) if reverse else (t, s)
    return (p.exp() * (p - q)).sum(-1) * temperature**2


def forward_kl_and_grad(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token forward KL (as :func:`kl_divergence`) and its gradient w.r.t. the student logits,
    ``T * (softmax(s / T) - softmax(t / T))``, in closed form: no autograd graph over the vocabulary."""
    check_vocabularies(student_logits.shape[-1], teacher_logits.shape[-1])
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    p = t.exp()
    loss = t.sub_(s).mul_(p).sum(-1) * temperature**2  # in place: three vocabulary-wide buffers at most
    del t
    grad = s.exp_().sub_(p).mul_(temperature)
    return loss, grad


def jensen_shannon(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = 0.5, temperature: float = 1.0
) -> torch.Tensor:
    """Per-token generalised JSD: ``beta * KL(t || m) + (1 - beta) * KL(s || m)`` with ``m = beta t + (1-beta) s``."""
    check_vocabularies(student_logits.shape[-1], teacher_logits.shape[-1])
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    m = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log(1 - beta)]), dim=0)
    kl_tm = (t.exp() * (t - m)).sum(-1)
    kl_sm = (s.exp() * (s - m)).sum(-1)
    return (beta * kl_tm + (1 - beta) * kl_sm) * temperature**2


@dataclass(frozen=True)
class TokenLoss:
    """A per-token loss ``loss(student_logits, *targets) -> (N,)`` for :func:`chunked_head_loss`, optionally with
    ``loss_and_grad(student_logits, *targets) -> (loss (N,), d loss / d student_logits)`` in closed form; with it
    the chunked head loss skips autograd over the vocabulary."""

    loss: Callable[..., torch.Tensor]
    loss_and_grad: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def __call__(self, *args) -> torch.Tensor:
        return self.loss(*args)


def divergence(name: str, temperature: float = 1.0, jsd_beta: float = 0.5) -> TokenLoss:
    """The per-token divergence ``f(student_logits, teacher_logits) -> (N,)`` called ``name`` (see DIVERGENCES);
    forward KL comes with its closed-form gradient."""
    if name == "forward_kl":
        return TokenLoss(
            lambda s, t: kl_divergence(s, t, temperature), lambda s, t: forward_kl_and_grad(s, t, temperature)
        )
    if name == "reverse_kl":
        return TokenLoss(lambda s, t: kl_divergence(s, t, temperature, reverse=True))
    if name == "jsd":
        return TokenLoss(lambda s, t: jensen_shannon(s, t, jsd_beta, temperature))
    raise ValueError(f"unknown divergence {name!r}; choose one of {', '.join(DIVERGENCES)}")


def topk_teacher(teacher_logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's ``k`` most likely tokens: (log-probabilities ``(N, k)`` fp32, token ids ``(N, k)``).

    The residual mass ``1 - sum(exp(logp))`` is implied; :func:`topk_forward_kl` uses it as one extra bucket.
    """
    logp = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    values, ids = logp.topk(k, dim=-1)
    return values, ids


def chunked_topk_teacher(
    hidden: torch.Tensor, head: torch.nn.Module, k: int, temperature: float = 1.0, max_elements: int = 1 << 25
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_teacher` of ``head(hidden)`` (``hidden`` ``(N, d)``, ``head`` the LM head or ``nn.Identity``
    over logits), a chunk of rows at a time: at most ``max_elements`` (rows x vocabulary) fp32 logits exist at once
    (128 MiB by default), so a teacher cache's memory does not grow with rows x vocabulary."""
    vocab = head.out_features if isinstance(head, torch.nn.Linear) else hidden.shape[-1]
    rows = max(1, max_elements // max(vocab, 1))
    logps, ids = [], []
    with torch.no_grad():
        for start in range(0, hidden.shape[0], rows):
            logits = head(hidden[start : start + rows]).to(torch.float32, copy=True)  # never the caller's
            logits.div_(temperature)
            logits.sub_(logits.logsumexp(-1, keepdim=True))  # log-softmax in place: one vocabulary-wide buffer
            values, top = logits.topk(k, dim=-1)
            del logits
            logps.append(values)
            ids.append(top)
    if not logps:  # no rows
        return hidden.new_zeros((0, k), dtype=torch.float32), hidden.new_zeros((0, k), dtype=torch.long)
    return torch.cat(logps), torch.cat(ids)


def topk_forward_kl(
    student_logits: torch.Tensor, teacher_logp: torch.Tensor, teacher_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Per-token KL(teacher || student) over the teacher's top-k tokens plus one bucket holding the rest of the mass.

    This is the exact KL between both distributions coarsened to k+1 outcomes (a lower bound of the full KL that
    equals it when the residual is 0); it lets training run from a cached teacher (design §3, DistillKit's recipe).
    """
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    s_top = s.gather(-1, teacher_ids.long())
    t_top = teacher_logp.float()
    kl = (t_top.exp() * (t_top - s_top)).sum(-1)
    t_rest = (1 - t_top.exp().sum(-1)).clamp_min(0)
    s_rest = (1 - s_top.exp().sum(-1)).clamp_min(1e-12)
    kl = kl + torch.where(t_rest > 0, t_rest * (t_rest.clamp_min(1e-12).log() - s_rest.log()), 0.0)
    return kl * temperature**2


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-token next-token negative log-likelihood (paper Eq. 3); 0 where ``labels == ignore_index``."""
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="none")


def chunked_head_loss(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    token_loss: Callable[..., torch.Tensor],
    targets: tuple[torch.Tensor, ...],
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Sum over the ``N`` rows of ``hidden`` ``(N, d)`` of ``token_loss(head(hidden_chunk), *target_chunks)``.

    ``head`` is a bias-free ``nn.Linear`` (the LM head) or ``nn.Identity`` (``hidden`` are logits already). Every
    tensor in ``targets`` is sliced along dim 0 with the hidden states. A :class:`TokenLoss` with ``loss_and_grad``
    supplies its gradient in closed form. When gradients are needed, each chunk's
    gradients with respect to the hidden states and the head weight are computed right after its loss (Liger-Kernel's
    fused linear + loss pattern), so only one chunk of logits exists at a time and nothing is recomputed.
    """
    weight = None if isinstance(head, torch.nn.Identity) else head.weight
    if getattr(head, "bias", None) is not None:
        raise ValueError("chunked_head_loss expects a bias-free LM head")
    if torch.is_grad_enabled() and (hidden.requires_grad or (weight is not None and weight.requires_grad)):
        return _FusedHeadLoss.apply(hidden, weight, token_loss, chunk_size, *targets)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_size):
        logits = _project(hidden[start : start + chunk_size], weight)
        total = total + token_loss(logits, *(t[start : start + chunk_size] for t in targets)).sum()
    return total


def _project(hidden: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    return hidden if weight is None else F.linear(hidden, weight)


class _FusedHeadLoss(torch.autograd.Function):
    """Forward computes the loss and, chunk by chunk, its gradients; backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, token_loss, chunk_size, *targets):
        grad_hidden = torch.zeros_like(hidden) if hidden.requires_grad else None
        wants_weight = weight is not None and weight.requires_grad
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wants_weight else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            chunk = hidden[start : start + chunk_size]
            logits = _project(chunk, weight)
            pieces = tuple(t[start : start + chunk_size] for t in targets)
            if isinstance(token_loss, TokenLoss) and token_loss.loss_and_grad is not None:
                loss, grad_logits = token_loss.loss_and_grad(logits, *pieces)
                loss, grad_logits = loss.sum(), grad_logits.to(logits.dtype)
            else:
                with torch.enable_grad():
                    leaf = logits.detach().requires_grad_()
                    loss = token_loss(leaf, *pieces).sum()
                    (grad_logits,) = torch.autograd.grad(loss, leaf)
            total += loss.detach()
            if grad_hidden is not None:
                grad_hidden[start : start + chunk_size] = grad_logits if weight is None else grad_logits @ weight
            if grad_weight is not None:
                if grad_logits.dtype == grad_weight.dtype:
                    grad_weight.addmm_(grad_logits.t(), chunk.to(grad_logits.dtype))
                else:
                    grad_weight += grad_logits.t() @ chunk.to(grad_logits.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.num_targets = len(targets)
        ctx.weight_dtype = None if weight is None else weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden.mul_(grad_output.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_output).to(ctx.weight_dtype)
        return (grad_hidden, grad_weight, None, None, *([None] * ctx.num_targets))


def hidden_l2(
    student_hidden: list[torch.Tensor], teacher_hidden: list[torch.Tensor], mask: torch.Tensor
) -> torch.Tensor:
    """Sum over selected tokens of ``sum_i ||o_i - t_i||_2^2`` over the matched layers (paper Eq. 5)."""
    if len(student_hidden) != len(teacher_hidden):
        raise ValueError(f"hidden-state L2 needs matching layers: {len(student_hidden)} vs {len(teacher_hidden)}")
    total = student_hidden[0].new_zeros((), dtype=torch.float32)
    for o, t in zip(student_hidden, teacher_hidden, strict=True):
        # masked by multiplication, not by indexing: no data-dependent shapes (fcsd plan runs this on fake tensors)
        total = total + (((o.float() - t.float()) ** 2).sum(-1) * mask).sum()
    return total


def relative_hidden_l2(student_hidden: list[torch.Tensor], teacher_hidden: list[torch.Tensor]) -> torch.Tensor:
    """Sum over tokens of the mean over matched layers of ``||o_i - t_i||^2 / ||t_i||^2``: paper Eq. 5 made
    scale-free, each token's error relative to the teacher's own state (the ``guided`` recovery recipe).

    Per token, so a micro-batch's value does not depend on the others in its step (data and expert parallelism sum
    the same terms as one process), and a layer with large activations does not drown the others.
    """
    if len(student_hidden) != len(teacher_hidden) or not student_hidden:
        raise ValueError(f"hidden-state loss needs matching layers: {len(student_hidden)} vs {len(teacher_hidden)}")
    total = student_hidden[0].new_zeros((), dtype=torch.float32)
    for o, t in zip(student_hidden, teacher_hidden, strict=True):
        t = t.float()
        energy = (t**2).sum(-1).clamp_min(torch.finfo(torch.float32).tiny)
        total = total + (((o.float() - t) ** 2).sum(-1) / energy).sum()
    return total / len(student_hidden)


def forward_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, int]:
    """Sum over tokens of KL(teacher || student) (paper Eq. 4) on ready logits ``(..., vocab)``, and the count."""
    check_vocabularies(student_logits.shape[-1], teacher_logits.shape[-1])
    student, teacher = _flatten(student_logits, mask), _flatten(teacher_logits, mask)
    token_loss = lambda s, t: kl_divergence(s, t, temperature)  # noqa: E731
    return chunked_head_loss(student, torch.nn.Identity(), token_loss, (teacher,), chunk_size), student.shape[0]


def next_token_nll(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, chunk_size: int = 1024
) -> tuple[torch.Tensor, int]:
    """Sum of next-token negative log-likelihoods (paper Eq. 3) and the number of scored tokens.

    ``labels`` are aligned with ``logits`` (position t predicts ``labels[t]``); ``ignore_index`` entries do not count.
    """
    flat_labels = labels.reshape(-1)
    token_loss = lambda x, y: cross_entropy(x, y, ignore_index)  # noqa: E731
    total = chunked_head_loss(_flatten(logits), torch.nn.Identity(), token_loss, (flat_labels,), chunk_size)
    return total, int((flat_labels != ignore_index).sum())


def _flatten(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    flat = logits.reshape(-1, logits.shape[-1])
    return flat if mask is None else flat[mask.reshape(-1)]
