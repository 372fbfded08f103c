"""What data echoing (``recovery.echo``, docs/recovery.md) adds to a step's memory in ``fcsd plan``: the teacher's
outputs for every micro-batch of the step on a process, kept until its last pass. The simulated step already holds
one micro-batch's (the one it trains on); the others' are added to the peak."""

from __future__ import annotations

import dataclasses


def echo_output_bytes(model_config, config, layout, accumulation: int, tokens: int, target: str = "cuda") -> int:
    """Bytes of the teacher's outputs kept beyond the simulated micro-batch's: ``accumulation - 1`` micro-batches of
    ``tokens`` tokens, each its final hidden states (the logits where the LM head runs inside the forward, FSDP2)
    and, with the guide on (``config`` as :func:`fcsd.plan.run.step_config` resolves it) or ``train.objective=kl_l2``,
    the hidden states of the embeddings and of every layer, in the teacher's dtype (``teacher.dtype=auto``: bf16 on
    GPU, fp32 on CPU). None with the teacher cache, whose rows are read again."""
    from fcsd.connectivity.families import text_config
    from fcsd.distill.config import echo_steps

    if echo_steps(config) == 0 or accumulation < 2 or layout.teacher == "cache":  # cached rows are read again
        return 0
    text = text_config(model_config)
    per_token = text.vocab_size if layout.fsdp else text.hidden_size
    if config.recovery.hidden_l2 > 0 or config.train.objective == "kl_l2":
        per_token += (text.num_hidden_layers + 1) * text.hidden_size
    dtype = config.teacher.dtype
    width = 4 if dtype == "float32" or (dtype == "auto" and target != "cuda") else 2
    return (accumulation - 1) * tokens * per_token * width


def with_echo_outputs(estimate, model_config, config, target: str = "cuda"):
    """``estimate`` (a :class:`fcsd.plan.simulate.StepEstimate`) with :func:`echo_output_bytes` added to its peak,
    alive at the peak as ``echo``, and recorded in ``extra``."""
    layout, accumulation, tokens = estimate.layout, estimate.accumulation, estimate.tokens
    extra = echo_output_bytes(model_config, config, layout, accumulation, tokens, target)
    if not extra:
        return estimate
    at_peak = {**estimate.at_peak, "echo": extra}
    return dataclasses.replace(
        estimate, peak=estimate.peak + extra, at_peak=at_peak, extra={**estimate.extra, "echo_outputs": extra}
    )
