"""Helpers shared by the expert-parallel test workers (one gloo launch each; every rank runs them)."""

import numpy as np
import torch
import torch.distributed as dist
from reference import causal_lm
from tiny_models import build

import fcsd
from fcsd.connectivity.families import expert_count, family_for_config, moe_blocks
from fcsd.placement import Placement

if not dist.is_initialized():
    dist.init_process_group("gloo")
RANK, WORLD = dist.get_rank(), dist.get_world_size()
SHARES = {2: [2, 1], 4: [2, 1, 1, 1]}[WORLD]  # sequences per rank: uneven token counts
LENGTH = 9
SPECS = {"deepseek_v2": "last:50%"}  # partially converted: stock MoE layers beside converted ones


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def batch(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, causal_lm(model).config.vocab_size, (sum(SHARES), LENGTH), generator=gen)
    return list(torch.split(ids, SHARES))


def loss_of(logits):
    gen = torch.Generator().manual_seed(1)
    return (logits * torch.randn(logits.shape[-1], generator=gen)).sum()


def run(model, ids):
    lm = causal_lm(model)
    embeds = lm.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = lm(inputs_embeds=embeds, use_cache=False).logits
    return logits, embeds


def prepare(family, mode, route_to_first=False):
    model = build(family)
    if route_to_first:  # every token to experts 0 and 1: other ranks' experts receive nothing
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias[2:] = -100.0
    if mode != "regular":
        fcsd.apply_farskip(model, SPECS.get(family, "all"))
    return model


def expert_grad_errors(model, single) -> float:
    """Worst norm-relative error of ``model``'s parameter gradients against the single-process ``single``'s (each
    expert shard against its slice; an expert no token reached must have a zero gradient)."""
    single_params = dict(single.named_parameters())
    worst = 0.0
    for name, param in model.named_parameters():
        expected = single_params[name].grad
        if expected is None:
            continue
        if getattr(param, "fcsd_expert_shard", False):
            local = param.shape[0]
            expected = expected[RANK * local : (RANK + 1) * local]
            if expected.abs().max() == 0:
                worst = max(worst, float(param.grad.abs().max()) if param.grad is not None else 0.0)
                continue
        worst = max(worst, rel(param.grad, expected))
    return worst


def shuffled_placement(model, seed=3):
    """A non-trivial balanced placement over WORLD ranks for every MoE layer (same on every rank)."""
    gen = np.random.default_rng(seed)
    blocks = moe_blocks(model, family_for_config(model.config))
    num_experts = expert_count(next(iter(blocks.values())).experts)
    contiguous = np.arange(num_experts) // (num_experts // WORLD)
    layers = {layer: gen.permutation(contiguous).tolist() for layer in blocks}
    return Placement(num_experts=num_experts, ep=WORLD, nodes=1, layers=layers)
