"""Per-family MoE adapters: a MoE block split into its router, its routed experts and its shared experts.

FarSkip connectivity (paper Sec. 3) adds the shared experts to the partial stream ``n_k`` and the routed experts only
to the full stream ``o_k``; expert parallelism (Sec. 4) moves tokens between routing and the routed experts. So each
family exposes three parts that can be called separately:

- ``route(moe, x_TD) -> Routing``: router logits, top-k expert ids and weights, and the rows the experts take;
- ``experts(moe, tokens_RD, expert_ids_RK, weights_RK) -> y_RD``: the routed experts on *given* rows, expert ids
  (indices into ``moe.experts``; ids ``>= number of experts held`` are skipped) and weights, each row's selected
  experts weighted and summed;
- ``shared(moe, x) -> shared output``.

Every adapter calls the stock sub-modules (router, experts, shared experts) of the installed transformers, so hooks
on them (router-logit recording) keep working. Shape suffixes: ``T`` tokens, ``R`` rows, ``K`` experts per token,
``D`` hidden size, ``E`` experts. Single-device code: no collectives here (exports copy this file).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class Routing(NamedTuple):
    """What a router decided for ``T`` tokens."""

    router_logits: torch.Tensor  # (T, E), as the stock router returns them
    topk_ids: torch.Tensor  # (T, K) global expert ids
    topk_weights: torch.Tensor  # (T, K)
    tokens: torch.Tensor  # (T, D) the rows the routed experts take (the input; jittered for Mixtral in training)


def topk_route(moe: nn.Module, x_TD: torch.Tensor) -> Routing:
    """Routers named ``gate`` returning ``(logits, weights, ids)``: Qwen3-MoE, Qwen2-MoE, DeepSeek-V2/V3, OLMoE."""
    router_logits, topk_weights, topk_ids = moe.gate(x_TD)
    return Routing(router_logits, topk_ids, topk_weights, x_TD)


def mixtral_route(moe: nn.Module, x_TD: torch.Tensor) -> Routing:
    """Mixtral: :func:`topk_route` after the router jitter noise the stock block applies in training (the experts
    then take the jittered rows too, as in the stock block)."""
    if moe.training and moe.jitter_noise > 0:
        x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - moe.jitter_noise, 1.0 + moe.jitter_noise)
    return topk_route(moe, x_TD)


def llama4_route(moe: nn.Module, x_TD: torch.Tensor) -> Routing:
    """Llama-4: the sigmoid top-k router returns dense scores (0 where not selected); keep the selected ones."""
    scores_TE, router_logits = moe.router(x_TD)
    topk_ids = torch.topk(router_logits, moe.router.top_k, dim=1).indices  # the router's own top-k, recomputed
    return Routing(router_logits, topk_ids, scores_TE.gather(1, topk_ids), x_TD)


def weighted_experts(moe: nn.Module, tokens_RD, expert_ids_RK, weights_RK) -> torch.Tensor:
    """Experts modules taking ``(rows, ids, weights)`` and weighting their outputs (all families but Llama-4)."""
    return moe.experts(tokens_RD, expert_ids_RK, weights_RK)


def llama4_experts(moe: nn.Module, tokens_RD, expert_ids_RK, weights_RK) -> torch.Tensor:
    """Llama-4's experts take rows pre-scaled by their router score; only the selected (row, expert) pairs are
    computed (the stock block runs every expert on every row, scaled by 0 where not selected: E/K times the FLOPs;
    an expert without bias maps 0 to 0, so the sums are the same)."""
    experts = moe.experts
    num_held, num_slots = experts.gate_up_proj.shape[0], expert_ids_RK.shape[-1]
    out_RD = torch.zeros_like(tokens_RD)
    flat_ids = expert_ids_RK.reshape(-1)
    row_of_pair = torch.arange(tokens_RD.shape[0], device=tokens_RD.device).repeat_interleave(num_slots)
    flat_weights = weights_RK.reshape(-1, 1).to(tokens_RD.dtype)
    for expert in torch.unique(flat_ids).tolist():
        if expert >= num_held:  # an expert held elsewhere (expert parallelism)
            continue
        pairs = (flat_ids == expert).nonzero().squeeze(1)
        rows = row_of_pair[pairs]
        gate, up = (tokens_RD[rows] * flat_weights[pairs]).matmul(experts.gate_up_proj[expert]).chunk(2, dim=-1)
        out_RD = out_RD.index_add(0, rows, (up * experts.act_fn(gate)).matmul(experts.down_proj[expert]))
    return out_RD


def shared_module(attr: str):
    """Shared experts held by a plain sub-module ``moe.<attr>`` (DeepSeek, Llama-4)."""

    def shared(moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return getattr(moe, attr)(x)

    shared.__name__ = f"shared_module_{attr}"
    return shared


def qwen2_gated_shared(moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE: the shared expert scaled by a per-token sigmoid gate."""
    return torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
