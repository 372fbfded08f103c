"""Worker for test_expert_parallel: every family and mode under expert parallelism in ONE gloo launch.

Each rank runs its own (uneven) share of a global batch on the expert-parallel model and compares, against the
single-process model run on every share: logits, the gradient of its input embeddings and every parameter gradient
(after ``reduce_gradients(op="sum")`` of the summed loss). FarSkip modes are also compared with the hand-written
reference of tests/reference.py. Writes ``<out>.<rank>.json``.
"""

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from ep_common import RANK, WORLD, batch, expert_grad_errors, loss_of, prepare, rel, run, shuffled_placement
from reference import farskip_reference
from tiny_models import CONFIGS, TEXT_FAMILIES, build

import fcsd
from fcsd.parallel import expert_parallel, full_state_dict, reduce_gradients
from fcsd.parallel.dispatchers import AllToAllDispatcher, DedupAllToAllDispatcher
from fcsd.parallel.hierarchical import HierarchicalDispatcher, node_and_rail_groups
from fcsd.parallel.schedule import SPLIT_COUNTS
from fcsd.placement import apply_placement
from fcsd.placement.stats import dispatch_counts

NODE = max(1, WORLD // 2)  # the hierarchical cases: two "nodes" of WORLD / 2 ranks


def case(family, mode, route_to_first=False, dispatcher="plain", placement=False):
    single = prepare(family, mode, route_to_first)
    plan = shuffled_placement(single) if placement else None
    if plan is not None:  # the single-process reference with the same (output-preserving) permutation of experts
        apply_placement(single, plan)
    shares = batch(single)
    total, outputs = 0, []
    for share in shares:
        logits, embeds = run(single, share)
        total = total + loss_of(logits)
        outputs.append((logits, embeds))
    total.backward()
    expected_logits, expected_embeds = outputs[RANK]
    where = plan.to_dict() if plan is not None else None  # the dict form, as read from PLACEMENT.json
    options = {"mode": mode, "dispatcher": dispatcher, "placement": where, "node_size": NODE}
    model = expert_parallel(prepare(family, mode, route_to_first), **options)
    logits, embeds = run(model, shares[RANK])
    loss_of(logits).backward()
    reduce_gradients(model, op="sum")
    result = {
        "logits": rel(logits.detach(), expected_logits.detach()),
        "input_grad": rel(embeds.grad, expected_embeds.grad),
    }
    result["param_grad"] = expert_grad_errors(model, single)
    if mode != "regular":
        converted = set(fcsd.farskip_layers(single))
        ref_logits, _, _ = farskip_reference(prepare(family, "regular", route_to_first), shares[RANK], converted)
        result["reference_logits"] = rel(logits.detach(), ref_logits)
    used = model.fcsd_expert_parallel.dispatcher
    result.update(rows_sent=used.rows_sent, rows_received=used.rows_received, inter_rows_sent=used.inter_rows_sent)
    if plan is not None:
        unplaced = prepare(family, mode, route_to_first)  # outputs unchanged by the placement itself
        result["unplaced_logits"] = rel(logits.detach(), run(unplaced, shares[RANK])[0].detach())
    return result


def direct_dispatch(blocking, tokens=7 + 3 * RANK, hidden=5, top_k=3, local=2):
    """Plain vs deduplicating vs node-aware dispatcher on the same random routes with per-expert linear maps: outputs,
    gradients (tokens and routing weights), the dedup counters against the offline dispatch_counts, and the rows
    crossing nodes (two "nodes" of WORLD / 2 ranks) against a hand count."""
    num_experts = local * WORLD
    gen = torch.Generator().manual_seed(10 + RANK)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids[0] = torch.arange(top_k) % num_experts  # at least one token with two experts on rank 0
    weights = torch.rand(tokens, top_k, generator=gen)
    maps = torch.randn(num_experts, hidden, hidden, generator=torch.Generator().manual_seed(99))[
        RANK * local : (RANK + 1) * local
    ]
    probe = torch.randn(tokens, hidden, generator=gen)
    node_group, rail_group = node_and_rail_groups(None, NODE)
    out = {}
    for name, cls in (("plain", AllToAllDispatcher), ("dedup", DedupAllToAllDispatcher), ("hier", None)):
        common = {"num_local_experts": local, "blocking": blocking, "node_size": NODE}
        if cls is None:
            dispatcher = HierarchicalDispatcher(**common, node_group=node_group, rail_group=rail_group)
        else:
            dispatcher = cls(**common)
        xg, wg = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        pending = dispatcher.dispatch_async(xg, ids, wg)
        rows = pending.wait()
        y = torch.einsum("rd,rde->re", rows.tokens, maps[rows.expert_ids[:, 0]]) * rows.weights
        result = dispatcher.combine_async(y, pending).wait()
        (result * probe).sum().backward()
        out[name] = (result.detach(), xg.grad, wg.grad, dispatcher)
    plain, dedup, hier = out["plain"], out["dedup"], out["hier"]
    counts = dispatch_counts(
        ids.numpy(), np.arange(num_experts) // local, np.full(tokens, RANK), hidden, elem_bytes=4, weight_bytes=4
    )
    node_of = ids.numpy() // local // NODE  # (T, K) the node of each selected expert
    mine = RANK // NODE
    pairs_away = int((node_of != mine).sum())
    rows_away = sum(len(set(row) - {mine}) for row in node_of.tolist())
    d, h = dedup[3], hier[3]
    return {
        "output": rel(dedup[0], plain[0]),
        "x_grad": rel(dedup[1], plain[1]),
        "weight_grad": rel(dedup[2], plain[2]),
        "hier": [rel(hier[0], plain[0]), rel(hier[1], plain[1]), rel(hier[2], plain[2])],
        "rows": [d.dispatch_rows_sent, counts.remote_dedup],
        "bytes": [d.dispatch_bytes_sent, counts.remote_bytes_dedup],
        "plain_rows": [plain[3].dispatch_rows_sent, counts.remote_plain],
        "combine_rows": d.rows_sent - d.dispatch_rows_sent,
        # across nodes: plain sends a row per (token, expert) on the other node, node-aware one per (token, node)
        "inter_plain": [plain[3].dispatch_inter_rows_sent, pairs_away],
        "inter_hier": [h.dispatch_inter_rows_sent, rows_away],
        "inter_hier_bytes": [h.dispatch_inter_bytes_sent, rows_away * hidden * 4 + pairs_away * 8],
        "inter_combine": [h.inter_rows_sent - h.dispatch_inter_rows_sent, h.dispatch_inter_rows_sent],
        "hier_received": h.rows_received,
        "dedup_received": d.rows_received,
    }


def placement_state_dict(family):
    """EP with a placement: the gathered state dict is the permuted stock layout, recorded in config.farskip, and a
    fresh stock model loading it computes what the original model computes."""
    original = build(family)
    plan = shuffled_placement(original)
    placed = apply_placement(build(family), plan)
    model = expert_parallel(build(family), mode="regular", placement=plan)
    gathered = full_state_dict(model)
    expected = placed.state_dict()
    fresh = build(family, seed=1)
    fresh.load_state_dict(gathered)
    ids = batch(original)[RANK]
    recorded = (model.config.farskip or {}).get("placement", {})
    orders = {str(layer): plan.order(layer).tolist() for layer in plan.layers}
    return {
        "equal": expected.keys() == gathered.keys() and all(torch.equal(expected[k], gathered[k]) for k in expected),
        "permuted": any(not torch.equal(original.state_dict()[k], gathered[k]) for k in gathered),
        "fresh_logits": rel(run(fresh, ids)[0].detach(), run(original, ids)[0].detach()),
        "recorded": recorded.get("expert_order") == orders and recorded.get("ep") == WORLD,
    }


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
    out["bad_dispatcher"] = error_of(lambda: expert_parallel(build("qwen3_moe"), mode="regular", dispatcher="x"))
    wrong_ep = shuffled_placement(build("qwen3_moe")).to_dict()
    contiguous = (np.arange(wrong_ep["num_experts"]) // (wrong_ep["num_experts"] // (2 * WORLD))).tolist()
    wrong_ep.update(ep=2 * WORLD, layers={k: contiguous for k in wrong_ep["layers"]})
    out["placement_ep"] = error_of(lambda: expert_parallel(build("qwen3_moe"), mode="regular", placement=wrong_ep))
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
DEDUP_CASES = {
    True: [("qwen3_moe", "farskip_overlap"), ("deepseek_v3", "farskip_reference"), ("llama4_text", "farskip_overlap")]
    + [("mixtral", "regular"), ("qwen2_moe", "farskip_overlap")],
    False: [("deepseek_v3", "farskip_overlap"), ("olmoe", "regular")],
}[FULL]
results["dedup"] = {f"{f}/{m}": case(f, m, dispatcher="dedup") for f, m in DEDUP_CASES}
results["dedup"]["route_to_first"] = case("deepseek_v3", "farskip_overlap", True, dispatcher="dedup")
os.environ["FCSD_EP_SYNC"] = "1"
results["dedup"]["sync_debug"] = case("deepseek_v3", "farskip_overlap", dispatcher="dedup")
os.environ["FCSD_EP_SYNC"] = "0"
HIERARCHICAL_CASES = {
    True: [("qwen3_moe", "farskip_overlap"), ("deepseek_v3", "farskip_reference"), ("llama4_text", "farskip_overlap")],
    False: [("deepseek_v3", "farskip_overlap"), ("llama4_text", "farskip_overlap"), ("olmoe", "regular")],
}[FULL]
results["hierarchical"] = {f"{f}/{m}": case(f, m, dispatcher="hierarchical") for f, m in HIERARCHICAL_CASES}
results["direct_dispatch"] = {str(blocking): direct_dispatch(blocking) for blocking in (True, False)}
PLACED = [("qwen3_moe", "farskip_overlap", "dedup"), ("olmoe", "regular", "plain")] if FULL else []
results["placement"] = {f"{f}/{m}/{d}": case(f, m, dispatcher=d, placement=True) for f, m, d in PLACED}
results["placement_state_dict"] = placement_state_dict("qwen3_moe") if FULL else {}
with open(f"{sys.argv[1]}.{RANK}.json", "w") as handle:
    json.dump(results, handle, indent=1)
dist.destroy_process_group()
