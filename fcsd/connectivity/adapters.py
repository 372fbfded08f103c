"""Per-family MoE adapters: a MoE block split into its router, its routed experts and its shared experts.

FarSkip connectivity (paper Sec. 3) adds the shared experts to the partial stream ``n_k`` and the routed experts only
to the full stream ``o_k``; expert parallelism (Sec. 4) moves tokens between routing and the routed experts. So each
family exposes three parts that can be called separately:

- ``route(moe, x_TD) -> Routing``: router logits, top-k expert ids and weights, and the rows the experts take;
- ``experts(moe, tokens_RD, expert_ids_RK, weights_RK) -> y_RD``: the routed experts on *given* rows, expert ids
  (indices into ``moe.experts``; ids ``>= number of experts held`` are skipped) and weights, each row's selected
  experts weighted and summed;
- ``shared(moe, x) -> shared output``.

Router access for expert-coupling work (second paper, Sec. II-B, V-A) reads the same router output:
``read_topk(router, router_output) -> (ids, weights)`` is what ``route`` uses, so a forward hook on the router
(route recording) sees exactly the experts the model runs; ``routing_groups(config) -> groups`` says which
contiguous expert groups a group-limited router needs kept together when experts are permuted.

Every adapter calls the stock sub-modules (router, experts, shared experts) of the installed transformers, so hooks
on them (router-logit recording) keep working. Shape suffixes: ``T`` tokens, ``R`` rows, ``K`` experts per token,
``D`` hidden size, ``E`` experts. Single-device code: no collectives here (exports copy this file).
"""

from __future__ import annotations

import types
from typing import NamedTuple

import torch
from torch import nn


class Routing(NamedTuple):
    """What a router decided for ``T`` tokens."""

    router_logits: torch.Tensor  # (T, E), as the stock router returns them
    topk_ids: torch.Tensor  # (T, K) global expert ids
    topk_weights: torch.Tensor  # (T, K)
    tokens: torch.Tensor  # (T, D) the rows the routed experts take (the input; jittered for Mixtral in training)


TopK = tuple[torch.Tensor, torch.Tensor]  # (ids (T, K) int64, weights (T, K))


def gate_topk(router: nn.Module, output) -> TopK:
    """Routers returning ``(logits, top-k weights, top-k ids)``: Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V2/V3."""
    _, topk_weights, topk_ids = output
    return topk_ids, topk_weights


def llama4_topk(router: nn.Module, output) -> TopK:
    """Llama-4 returns ``(scores (T, E): sigmoid of the top-k logits, 0 elsewhere; logits)``; its own top-k is on the
    logits, so repeating it gives the same ids."""
    scores_TE, router_logits = output
    topk_ids = torch.topk(router_logits, router.top_k, dim=1).indices
    return topk_ids, scores_TE.gather(1, topk_ids)


def topk_route(moe: nn.Module, x_TD: torch.Tensor) -> Routing:
    """Routers named ``gate`` returning ``(logits, weights, ids)``: Qwen3-MoE, Qwen2-MoE, DeepSeek-V2/V3, OLMoE."""
    output = moe.gate(x_TD)
    topk_ids, topk_weights = gate_topk(moe.gate, output)
    return Routing(output[0], topk_ids, topk_weights, x_TD)


def mixtral_route(moe: nn.Module, x_TD: torch.Tensor) -> Routing:
    """Mixtral: :func:`topk_route` after the router jitter noise the stock block applies in training (the experts
    then take the jittered rows too, as in the stock block)."""
    if moe.training and moe.jitter_noise > 0:
        x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - moe.jitter_noise, 1.0 + moe.jitter_noise)
    return topk_route(moe, x_TD)


def llama4_route(moe: nn.Module, x_TD: torch.Tensor) -> Routing:
    """Llama-4: the sigmoid top-k router returns dense scores (0 where not selected); keep the selected ones."""
    output = moe.router(x_TD)
    topk_ids, topk_weights = llama4_topk(moe.router, output)
    return Routing(output[1], topk_ids, topk_weights, x_TD)


def deepseek_groups(always: bool):
    """Expert groups of DeepSeek's group-limited routing: ``n_group`` contiguous blocks of ``E / n_group`` ids when
    the router selects among ``topk_group < n_group`` of them (DeepSeek-V3 always; DeepSeek-V2 only with
    ``topk_method="group_limited_greedy"``), else 1."""

    def routing_groups(config) -> int:
        n_group, topk_group = getattr(config, "n_group", None) or 1, getattr(config, "topk_group", None) or 1
        if not always and getattr(config, "topk_method", "greedy") != "group_limited_greedy":
            return 1
        return int(n_group) if topk_group < n_group else 1

    routing_groups.__name__ = f"deepseek_groups_{'always' if always else 'group_limited_greedy'}"
    return routing_groups


def autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes matmuls in on ``tensor``'s device, or ``None`` where autocast is off."""
    kind = tensor.device.type
    if kind == "meta" or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def in_compute_dtype(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s own floating-point parameters cast to the autocast dtype (empty when autocast is off or they
    are in that dtype already): transformers' grouped experts kernel is no autocast op (:mod:`fcsd.precision`)."""
    params = {name: p for name, p in module.named_parameters(recurse=False) if p.is_floating_point()}
    if any(p.element_size() == 1 for p in params.values()):  # FP8 experts (and their scales) run their own kernels
        return {}
    dtype = autocast_dtype(next(iter(params.values()))) if params else None
    if dtype is None or all(p.dtype == dtype for p in params.values()):
        return {}
    return {name: p.to(dtype) for name, p in params.items()}


def weighted_experts(moe: nn.Module, tokens_RD, expert_ids_RK, weights_RK) -> torch.Tensor:
    """Experts modules taking ``(rows, ids, weights)`` and weighting their outputs (all families but Llama-4)."""
    return moe.experts(tokens_RD, expert_ids_RK, weights_RK)


def llama4_experts(moe: nn.Module, tokens_RD, expert_ids_RK, weights_RK) -> torch.Tensor:
    """Llama-4's experts take rows pre-scaled by their router score; only the selected (row, expert) pairs are
    computed, grouped by expert with transformers' ``grouped_mm`` experts kernel in the compute dtype (the stock block
    runs every expert on every row, scaled by 0 where not selected: E/K times the FLOPs; an expert without bias maps 0
    to 0, so the sums are the same). No host synchronisation; each row's pairs are summed in fp32."""
    from transformers.integrations.moe import _default_apply_gate, grouped_mm_experts_forward

    experts = moe.experts
    weights = {"gate_up_proj": experts.gate_up_proj, "down_proj": experts.down_proj, **in_compute_dtype(experts)}
    num_rows, num_slots = expert_ids_RK.shape
    pairs = tokens_RD.repeat_interleave(num_slots, dim=0, output_size=num_rows * num_slots)
    scaled = (pairs.float() * weights_RK.reshape(-1, 1).float()).to(tokens_RD.dtype)
    kernel = types.SimpleNamespace(
        **weights,  # in the autocast dtype under autocast
        num_experts=experts.gate_up_proj.shape[0],  # held here; ids beyond are experts held elsewhere (skipped)
        _is_expert_parallel=True,
        has_gate=True,
        has_bias=False,
        is_transposed=True,  # Llama-4 stores (E, in, out)
        has_post_expert_norm=False,
        act_fn=experts.act_fn,
    )
    kernel._apply_gate = lambda out: _default_apply_gate(kernel, out)
    ones = torch.ones(num_rows * num_slots, 1, dtype=scaled.dtype, device=scaled.device)
    out = grouped_mm_experts_forward(kernel, scaled, expert_ids_RK.reshape(-1, 1), ones)
    return out.view(num_rows, num_slots, -1).float().sum(dim=1).to(tokens_RD.dtype)


def shared_module(attr: str):
    """Shared experts held by a plain sub-module ``moe.<attr>`` (DeepSeek, Llama-4)."""

    def shared(moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return getattr(moe, attr)(x)

    shared.__name__ = f"shared_module_{attr}"
    return shared


def qwen2_gated_shared(moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE: the shared expert scaled by a per-token sigmoid gate."""
    return torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
