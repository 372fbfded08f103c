"""One micro-batch of an FCSD objective: model forwards, then the chunked losses of :mod:`fcsd.distill.losses`
(paper Eqs. 3-5, Tab. 2 ablations).

The LM head is applied chunk by chunk to the final hidden states (captured from the decoder's final norm while the
model is called with an empty ``logits_to_keep``), so neither model materialises full-vocabulary logits for the
whole micro-batch; the wrapped (DDP / DeepSpeed) model is still what gets called, so gradient hooks keep working.
An FSDP2-sharded model's head is applied the same way through :class:`GatheredHead` (its unit's weight gathered
once for all chunks, its gradient reduce-scattered by the unit); only DeepSpeed ZeRO-3 still computes the logits in
the forward.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from fcsd.connectivity.families import final_norm
from fcsd.distill import losses
from fcsd.distill.data import Packed

NO_LOGITS = torch.empty(0, dtype=torch.long)


@dataclass
class LossParts:
    """Sums over the micro-batch's tokens (not yet normalised) and the number of tokens they cover."""

    total: torch.Tensor  # what is back-propagated
    tokens: int
    terms: dict[str, torch.Tensor] = field(default_factory=dict)  # detached components of ``total``, for the log


@contextmanager
def capture_final_hidden(model):
    """Collect the output of ``model``'s final norm (the LM head's input) during the ``with`` block."""
    captured: list[torch.Tensor] = []
    norm = final_norm(model)
    handle = norm.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        yield captured
    finally:
        handle.remove()


def final_hidden(model, unwrapped, batch: Packed, **kwargs):
    """``(hidden (B*T, d), model output)``: one forward of ``model`` without computing its logits."""
    with capture_final_hidden(unwrapped) as captured:
        output = model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            logits_to_keep=NO_LOGITS.to(batch.input_ids.device),
            use_cache=False,
            **kwargs,
        )
    hidden = captured[-1]
    return hidden.reshape(-1, hidden.shape[-1]), output


class GatheredHead(torch.nn.Linear):
    """The LM head of an FSDP2-sharded model, applied outside the model's forward (chunk by chunk): reading
    ``weight`` gathers the head's FSDP unit (``unshard``: nothing when the forward left it gathered, as the student's
    layout and FSDP2's root do) and returns the gathered weight, whose gradient the unit reduce-scatters once after
    the backward; :meth:`release` reshards it (a frozen teacher's, once its chunks are done)."""

    def __init__(self, head: torch.nn.Linear, unit):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = head.in_features, head.out_features
        self.bias = None
        object.__setattr__(self, "head", head)  # neither is a submodule of this view
        object.__setattr__(self, "unit", unit)

    @property
    def weight(self) -> torch.Tensor:
        self.unit.unshard()
        return self.head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight)

    def release(self) -> None:
        self.unit.reshard()


def release(head) -> None:
    """Reshard ``head`` if it is a :class:`GatheredHead` (a frozen model's, done with its chunks)."""
    if isinstance(head, GatheredHead):
        head.release()


def head_inputs(model, unwrapped, batch: Packed, head_in_forward: bool = False, **kwargs):
    """``(x, head, output)`` with ``head(x)`` the logits of every token of ``batch``, for :func:`chunked_head_loss`.

    ``x`` are the final hidden states and ``head`` the LM head, applied chunk by chunk later. ``head_in_forward``
    (a sharded model): under FSDP2 ``head`` is a :class:`GatheredHead`; otherwise (ZeRO-3, whose weights exist
    inside the forward only) ``x`` are the logits (compute dtype) and ``head`` the identity.
    """
    from fcsd.parallel.layout import head_unit

    unit = head_unit(unwrapped) if head_in_forward else None
    if head_in_forward and unit is None:
        output = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **kwargs)
        return output.logits.reshape(-1, output.logits.shape[-1]), torch.nn.Identity(), output
    hidden, output = final_hidden(model, unwrapped, batch, **kwargs)
    head = unwrapped.get_output_embeddings()
    return hidden, head if unit is None else GatheredHead(head, unit), output


def teacher_targets(teacher, batch: Packed, want_hidden_states: bool = False, head_in_forward: bool = False):
    """The online teacher's ``(x, head, hidden states or None)`` (see :func:`head_inputs`), without gradients."""
    with torch.no_grad():
        x, head, output = head_inputs(teacher, teacher, batch, head_in_forward, output_hidden_states=want_hidden_states)
    return x, head, (output.hidden_states if want_hidden_states else None)


def teacher_token_loss(divergence: losses.TokenLoss, teacher_head) -> losses.TokenLoss:
    """``token_loss(student_logits, teacher_x)`` for :func:`chunked_head_loss`: the teacher's logits come from its
    head applied to the same chunk, without gradients; keeps the divergence's closed-form gradient if it has one."""

    def teacher_logits(teacher_chunk):
        with torch.no_grad():
            return teacher_head(teacher_chunk)

    closed_form = divergence.loss_and_grad
    return losses.TokenLoss(
        lambda s, t: divergence(s, teacher_logits(t)),
        None if closed_form is None else lambda s, t: closed_form(s, teacher_logits(t)),
    )


def micro_batch_loss(
    student,
    unwrapped_student,
    batch: Packed,
    config,
    teacher=None,
    cached: tuple[torch.Tensor, torch.Tensor] | None = None,
    head_in_forward: bool = False,
    hidden_weight: float | None = None,
) -> LossParts:
    """The loss sum of ``config.train.objective`` on one micro-batch.

    ``teacher`` is the online teacher model; ``cached`` the teacher's cached ``(top-k log-probs, ids)`` rows for
    ``teacher.mode=cache``. Every position is scored for the divergences (Eq. 4 sums over all t); SFT scores the
    next token inside each packed document. ``hidden_weight`` (default ``config.recovery.hidden_l2``; the trainer
    passes :func:`fcsd.distill.config.guide_weight` of the step) > 0 adds that multiple of
    :func:`fcsd.distill.losses.relative_hidden_l2` (the guided recipe). ``head_in_forward``: see :func:`head_inputs`.
    """
    train = config.train
    want_l2 = train.objective == "kl_l2"
    guide = config.recovery.hidden_l2 if hidden_weight is None else hidden_weight
    want_states = want_l2 or guide > 0
    options = {"output_hidden_states": want_states, "output_router_logits": train.router_aux_coef > 0}
    hidden, head, output = head_inputs(student, unwrapped_student, batch, head_in_forward, **options)
    tokens = hidden.shape[0]
    if train.objective == "sft":
        labels = batch.sft_labels().reshape(-1)
        total = losses.chunked_head_loss(hidden, head, losses.cross_entropy, (labels,), train.loss_chunk_size)
        tokens = int((labels != -100).sum())
        parts = LossParts(total, tokens, {"nll": total.detach()})
    elif cached is not None:
        logp, ids = (t.reshape(tokens, -1) for t in cached)
        token_loss = lambda s, lp, i: losses.topk_forward_kl(s, lp, i, train.temperature)  # noqa: E731
        total = losses.chunked_head_loss(hidden, head, token_loss, (logp, ids), train.loss_chunk_size)
        parts = LossParts(total, tokens, {"kl": total.detach()})
    else:
        teacher_x, teacher_head, teacher_states = teacher_targets(teacher, batch, want_states, head_in_forward)
        divergence = losses.divergence(train.divergence, train.temperature, train.jsd_beta)
        token_loss = teacher_token_loss(divergence, teacher_head)
        total = losses.chunked_head_loss(hidden, head, token_loss, (teacher_x,), train.loss_chunk_size)
        release(teacher_head)
        parts = LossParts(total, tokens, {"kl": total.detach()})
        if want_l2:
            everywhere = torch.ones_like(batch.input_ids, dtype=torch.bool)
            l2 = losses.hidden_l2(list(output.hidden_states[1:]), list(teacher_states[1:]), everywhere)
            parts.total = parts.total + train.l2_coef * l2
            parts.terms["l2"] = l2.detach()
        if guide > 0:
            relative = losses.relative_hidden_l2(list(output.hidden_states[1:]), list(teacher_states[1:]))
            parts.total = parts.total + guide * relative
            parts.terms["hidden"] = relative.detach()
    if train.router_aux_coef > 0 and getattr(output, "aux_loss", None) is not None:
        aux = train.router_aux_coef * output.aux_loss * tokens  # a per-token mean, weighted like the token sums
        parts.total = parts.total + aux
        parts.terms["router_aux"] = aux.detach()
    return parts
