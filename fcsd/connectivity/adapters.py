"""Per-family MoE adapters: how to compute a block's routed-expert and shared-expert outputs *separately*.

FarSkip connectivity (paper Sec. 3) adds the shared experts to the partial stream ``n_k`` and the routed experts only
to the full stream ``o_k``, so each family must expose the two parts of its MoE block. Every adapter calls the
stock sub-modules (router, experts, shared experts) of the installed transformers; none re-implements their math.
Shapes: ``x`` is ``(batch, seq, hidden)``; each adapter returns a tensor of the same shape.
"""

from __future__ import annotations

import torch
from torch import nn


def topk_router_then_experts(moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Routed output of blocks whose ``gate`` returns ``(logits, weights, indices)`` and whose ``experts`` take
    ``(tokens, indices, weights)``: Qwen3-MoE, Qwen2-MoE, DeepSeek-V2/V3, OLMoE."""
    tokens = x.reshape(-1, x.shape[-1])
    _, weights, indices = moe.gate(tokens)
    return moe.experts(tokens, indices, weights).view(x.shape)


def mixtral_routed(moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Mixtral: :func:`topk_router_then_experts` plus the router jitter noise the stock block applies in training."""
    if moe.training and moe.jitter_noise > 0:
        x = x * torch.empty_like(x).uniform_(1.0 - moe.jitter_noise, 1.0 + moe.jitter_noise)
    return topk_router_then_experts(moe, x)


def llama4_routed(moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Llama-4: a sigmoid top-k router whose experts take tokens pre-scaled by their router score (every expert sees
    every token, scaled by 0 where not selected), summed over experts."""
    tokens = x.reshape(-1, x.shape[-1])
    scores, _ = moe.router(tokens)
    num_experts = scores.shape[1]
    routed_in = tokens.repeat(num_experts, 1) * scores.transpose(0, 1).reshape(-1, 1)
    routed_out = moe.experts(routed_in)
    return routed_out.reshape(num_experts, -1, routed_out.shape[-1]).sum(dim=0).view(x.shape)


def shared_module(attr: str):
    """Shared experts held by a plain sub-module ``moe.<attr>`` (DeepSeek, Llama-4)."""

    def shared(moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return getattr(moe, attr)(x)

    shared.__name__ = f"shared_module_{attr}"
    return shared


def qwen2_gated_shared(moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE: the shared expert scaled by a per-token sigmoid gate."""
    return torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
