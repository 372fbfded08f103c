"""Worker for test_expert_parallel: every family and mode under expert parallelism in ONE gloo launch.

Each rank runs its own (uneven) share of a global batch on the expert-parallel model and compares, against the
single-process model run on every share: logits, the gradient of its input embeddings and every parameter gradient
(after ``reduce_gradients(op="sum")`` of the summed loss). FarSkip modes are also compared with the hand-written
reference of tests/reference.py. Writes ``<out>.<rank>.json``.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from reference import causal_lm, farskip_reference
from tiny_models import CONFIGS, TEXT_FAMILIES, build

import fcsd
from fcsd.parallel import expert_parallel, full_state_dict, reduce_gradients
from fcsd.parallel.schedule import SPLIT_COUNTS

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


def case(family, mode, route_to_first=False):
    single = prepare(family, mode, route_to_first)
    shares = batch(single)
    total, outputs = 0, []
    for share in shares:
        logits, embeds = run(single, share)
        total = total + loss_of(logits)
        outputs.append((logits, embeds))
    total.backward()
    expected_logits, expected_embeds = outputs[RANK]
    model = expert_parallel(prepare(family, mode, route_to_first), mode=mode)
    logits, embeds = run(model, shares[RANK])
    loss_of(logits).backward()
    reduce_gradients(model, op="sum")
    result = {
        "logits": rel(logits.detach(), expected_logits.detach()),
        "input_grad": rel(embeds.grad, expected_embeds.grad),
    }
    single_params = dict(single.named_parameters())
    worst = 0.0
    for name, param in model.named_parameters():
        expected = single_params[name].grad
        if expected is None:
            continue
        if getattr(param, "fcsd_expert_shard", False):
            local = param.shape[0]
            expected = expected[RANK * local : (RANK + 1) * local]
            if expected.abs().max() == 0:  # an expert no token reached: its gradient must be zero too
                worst = max(worst, float(param.grad.abs().max()) if param.grad is not None else 0.0)
                continue
        worst = max(worst, rel(param.grad, expected))
    result["param_grad"] = worst
    if mode != "regular":
        converted = set(fcsd.farskip_layers(single))
        ref_logits, _, _ = farskip_reference(prepare(family, "regular", route_to_first), shares[RANK], converted)
        result["reference_logits"] = rel(logits.detach(), ref_logits)
    result["rows_sent"] = model.fcsd_expert_parallel.dispatcher.rows_sent
    result["rows_received"] = model.fcsd_expert_parallel.dispatcher.rows_received
    return result


def error_of(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as error:
        return str(error)
    return ""


def errors():
    out = {}
    out["not_converted"] = error_of(lambda: expert_parallel(build("qwen3_moe"), mode="farskip_overlap"))
    out["regular_on_converted"] = error_of(
        lambda: expert_parallel(fcsd.apply_farskip(build("qwen3_moe"), "all"), mode="regular")
    )
    out["bad_mode"] = error_of(lambda: expert_parallel(build("qwen3_moe"), mode="fast"))
    model_cls, config = CONFIGS["qwen3_moe"]()
    config.num_experts = WORLD + 1
    config._attn_implementation = "eager"
    out["indivisible"] = error_of(lambda: expert_parallel(model_cls(config), mode="regular"))
    model = expert_parallel(fcsd.apply_farskip(build("qwen3_moe"), "all"), mode="farskip_overlap")
    model.gradient_checkpointing_enable()
    model.train()
    out["checkpointing"] = error_of(lambda: run(model, batch(model)[RANK]))
    return out


def generation(family, mode):
    prompt = torch.tensor([[5, 17, 33, 8, 41, 12]])
    single = prepare(family, mode)
    expected = single.generate(prompt, max_new_tokens=8, do_sample=False)
    model = expert_parallel(prepare(family, mode), mode=mode, layout="all_reduce")
    got = model.generate(prompt, max_new_tokens=8, do_sample=False)
    return {"equal": bool(torch.equal(got, expected)), "tokens": got.tolist()}


def state_dicts(family):
    original = build(family).state_dict()
    gathered = full_state_dict(expert_parallel(fcsd.apply_farskip(build(family), "all"), mode="farskip_overlap"))
    return original.keys() == gathered.keys() and all(torch.equal(original[k], gathered[k]) for k in original)


FULL = sys.argv[2] == "full"  # the 2-process launch runs every case; the 4-process one a subset
results = {"cases": {}, "sync_debug": {}}
for family in TEXT_FAMILIES if FULL else ("deepseek_v3", "llama4_text", "olmoe"):
    for mode in ("regular", "farskip_reference", "farskip_overlap") if FULL else ("regular", "farskip_overlap"):
        results["cases"][f"{family}/{mode}"] = case(family, mode)
results["split_counts"] = dict(SPLIT_COUNTS)
os.environ["FCSD_EP_SYNC"] = "1"
for family in ("deepseek_v3", "llama4_text", "qwen2_moe") if FULL else ("deepseek_v3",):
    results["sync_debug"][family] = case(family, "farskip_overlap")
os.environ["FCSD_EP_SYNC"] = "0"
results["route_to_first"] = {mode: case("deepseek_v3", mode, True) for mode in ("regular", "farskip_overlap")}
results["errors"] = errors()
results["generate"] = {
    f"{family}/{mode}": generation(family, mode)
    for family in (("qwen3_moe", "deepseek_v3", "llama4_text") if FULL else ("deepseek_v3",))
    for mode in ("regular", "farskip_overlap")
}
results["state_dict_equal"] = {family: state_dicts(family) for family in ("qwen3_moe", "llama4_text")}
with open(f"{sys.argv[1]}.{RANK}.json", "w") as handle:
    json.dump(results, handle, indent=1)
dist.destroy_process_group()
