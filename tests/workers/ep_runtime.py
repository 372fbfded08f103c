"""Worker for test_ep_runtime: what a GPU run of expert parallelism relies on, checked on CPU gloo processes.

Host synchronisations per MoE layer (every torch call that makes the host wait for the device is counted through a
``TorchFunctionMode``), bf16 precision and bitwise determinism, the structural collective order in backward and its
debug check, the order the overlapped schedule promises, ``generate`` with prompts of several lengths, loading only
this rank's experts, gathering to one rank, and the trainer's ``reduce_gradients(op="mean")``. Writes
``<out>.<rank>.json``.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from ep_common import RANK, WORLD, batch, expert_grad_errors, loss_of, prepare, rel, run, shuffled_placement
from torch.overrides import TorchFunctionMode

import fcsd
from fcsd.connectivity.families import family_for_config, moe_blocks
from fcsd.parallel import expert_parallel, full_state_dict, grads, reduce_gradients
from fcsd.parallel.events import record_events
from fcsd.parallel.load import from_pretrained_sharded
from fcsd.placement import apply_placement

SYNCING = {"tolist", "item", "nonzero", "argwhere", "unique", "unique_consecutive", "bincount", "masked_select"}
SYNCING |= {"__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "equal", "allclose"}


def _bool_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class SyncCounter(TorchFunctionMode):
    """Counts the torch calls that need a device-to-host copy on CUDA (and names them)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        syncing = name in SYNCING
        syncing |= name in ("__getitem__", "__setitem__", "index_put", "index_put_") and _bool_index(args)
        syncing |= name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else None, torch.Tensor)
        syncing &= not (name == "repeat_interleave" and kwargs.get("output_size") is not None)
        syncing |= name == "where" and len(args) == 1 and not kwargs
        if syncing:
            self.calls.append(name)
        return func(*args, **kwargs)


def host_syncs(family, dispatcher, mode):
    """Host syncs of one training forward and backward, expert-parallel and single-process (the stock model's own,
    e.g. transformers' mask preparation, happen in both)."""
    single = prepare(family, mode)
    ids = batch(single)[RANK]
    with SyncCounter() as stock:
        run(single, ids)
    model = expert_parallel(prepare(family, mode), mode=mode, dispatcher=dispatcher, node_size=1)  # 2 "nodes"
    model.train()
    with SyncCounter() as forward:
        logits, _ = run(model, ids)
    with SyncCounter() as backward:
        loss_of(logits).backward()
    layers = len(moe_blocks(model, family_for_config(model.config)))
    return {"stock": stock.calls, "forward": forward.calls, "backward": backward.calls, "moe_layers": layers}


def precision(family, dispatcher):
    """EP under bf16 autocast against the single-process fp32 model (and single-process bf16 autocast for scale),
    twice: outputs and gradients must be bitwise identical; the rows travel in bf16."""
    single = prepare(family, "farskip_overlap")
    shares = batch(single)
    expected = run(single, shares[RANK])[0].detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        single_bf16 = run(single, shares[RANK])[0].detach().float()
    runs = []
    for _ in range(2):
        model = expert_parallel(prepare(family, "farskip_overlap"), dispatcher=dispatcher, node_size=1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, embeds = run(model, shares[RANK])
            loss_of(logits.float()).backward()
        router_grads = [p.grad.clone() for n, p in model.named_parameters() if p.grad is not None]
        runs.append((logits.detach().float(), embeds.grad.clone(), router_grads, model.fcsd_expert_parallel.dispatcher))
    (first, first_grad, first_params, sent), (second, second_grad, second_params, _) = runs
    hidden = model.config.hidden_size
    return {
        "ep_bf16_vs_fp32": rel(first, expected),
        "single_bf16_vs_fp32": rel(single_bf16, expected),
        "bitwise": bool(torch.equal(first, second) and torch.equal(first_grad, second_grad))
        and all(torch.equal(a, b) for a, b in zip(first_params, second_params)),
        # plain rows carry the hidden state alone: its bytes per value on the wire (2: bf16)
        "wire_bytes": sent.dispatch_bytes_sent / max(sent.dispatch_rows_sent * hidden, 1),
    }


def combine_precision(name, tokens=40, hidden=16, top_k=8, local=4):
    """Identity experts under bf16 autocast: the combine must return sum_k w_k * bf16(x) computed in fp32 (weights
    never rounded to bf16, no bf16 accumulation), whatever the dispatcher."""
    from fcsd.parallel.dispatchers import AllToAllDispatcher, DedupAllToAllDispatcher
    from fcsd.parallel.hierarchical import HierarchicalDispatcher, node_and_rail_groups

    gen = torch.Generator().manual_seed(20 + RANK)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(local * WORLD, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    if name == "hierarchical":  # two "nodes" of one rank
        node_group, rail_group = node_and_rail_groups(None, 1)
        dispatcher = HierarchicalDispatcher(num_local_experts=local, node_group=node_group, rail_group=rail_group)
    else:
        dispatcher = {"plain": AllToAllDispatcher, "dedup": DedupAllToAllDispatcher}[name](num_local_experts=local)
    with torch.autocast("cpu", dtype=torch.bfloat16), AtomicFloatSums() as atomic:
        pending = dispatcher.dispatch_async(x, ids, weights)
        rows = pending.wait()
        out = dispatcher.combine_async(rows.tokens * rows.weights, pending).wait()
    expected = (x.to(torch.bfloat16).double().unsqueeze(1) * weights.double().unsqueeze(-1)).sum(1)
    return {"dtype": str(out.dtype), "error": rel(out.double(), expected), "atomic_float_sums": atomic.found}


class AtomicFloatSums(torch.overrides.TorchFunctionMode):
    """Records the scatter-style sums of floating-point values (``index_add``, ``scatter_add``, ``index_put`` with
    ``accumulate``): on GPUs they add with atomics in no fixed order, so a combine using them is not bitwise
    reproducible there, whatever CPU runs show."""

    NAMES = {"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_"}

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        accumulate = name in ("index_put", "index_put_") and (kwargs.get("accumulate") or args[3:4] == (True,))
        floating = bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_floating_point()
        if floating and (name in self.NAMES or accumulate):
            self.found.append(name)
        return func(*args, **kwargs)


def reverse_order_of(events):
    return [(kind, serial) for what, kind, serial in events if what == "reverse"]


def two_forwards_summed(family):
    """Two forwards (different token counts), one loss; rank 1 sums them in the other order. The reverse
    collectives must come in exactly the reverse of the forward order, on every rank; gradients must match."""
    single = prepare(family, "farskip_overlap")
    first, second = batch(single, seed=0), batch(single, seed=5)
    total = 0
    for share in (*first, *second):
        total = total + loss_of(run(single, share)[0])
    total.backward()
    model = expert_parallel(prepare(family, "farskip_overlap"))
    model.train()
    with record_events() as events:
        loss_a = loss_of(run(model, first[RANK])[0])
        loss_b = loss_of(run(model, second[RANK])[0])
        (loss_a + loss_b if RANK == 0 else loss_b + loss_a).backward()
    reduce_gradients(model, op="sum")
    launches = [(kind, serial) for what, kind, serial in events if what == "launch" and kind != "counts"]
    return {
        "forward": launches,
        "reverse": reverse_order_of(events),
        "param_grad": expert_grad_errors(model, single),
    }


def no_rows_with_eager_experts():
    """Rank 1 receives no rows and transformers' eager experts then return a tensor with no autograd history: the
    reverse combine must still run there (the order token), or the other rank would wait forever."""
    single = prepare("deepseek_v3", "farskip_overlap", route_to_first=True)
    single.config._experts_implementation = "eager"
    shares = batch(single)
    total = 0
    for share in shares:
        total = total + loss_of(run(single, share)[0])
    total.backward()
    model = prepare("deepseek_v3", "farskip_overlap", route_to_first=True)
    model.config._experts_implementation = "eager"
    model = expert_parallel(model)
    with record_events() as events:
        loss_of(run(model, shares[RANK])[0]).backward()
    reduce_gradients(model, op="sum")
    return {
        "rows_received": model.fcsd_expert_parallel.dispatcher.rows_received,
        "reverse": reverse_order_of(events),
        "param_grad": expert_grad_errors(model, single),
    }


def order_check():
    """FCSD_EP_CHECK_ORDER=1: a correct run gives the same results; ranks issuing different collectives (rank 0
    backpropagates while rank 1 runs another forward) get a clear error instead of a hang."""
    os.environ["FCSD_EP_CHECK_ORDER"] = "1"
    try:
        single = prepare("qwen3_moe", "farskip_overlap")
        shares = batch(single)
        expected = run(single, shares[RANK])[0].detach()
        model = expert_parallel(prepare("qwen3_moe", "farskip_overlap"))
        logits = run(model, shares[RANK])[0]
        loss_of(logits).backward()
        same = rel(logits.detach(), expected)
        model = expert_parallel(prepare("qwen3_moe", "farskip_overlap"))
        logits = run(model, shares[RANK])[0]
        try:
            if RANK == 0:
                loss_of(logits).backward()
            else:
                run(model, shares[RANK])
            error = ""
        except RuntimeError as caught:
            error = str(caught)
    finally:
        os.environ["FCSD_EP_CHECK_ORDER"] = "0"
    return {"logits": same, "error": error}


def schedule_events(family):
    """The events of one overlapped forward: collective launches/completions and the schedule's markers."""
    model = expert_parallel(prepare(family, "farskip_overlap"))
    with record_events() as events:
        run(model, batch(model)[RANK])
    return events


def bucketed_mean():
    """The trainer's path: each rank's loss is the mean over its own tokens, reduce_gradients(op="mean") (in small
    buckets) gives the gradient of the mean of the ranks' losses."""
    single = prepare("qwen3_moe", "farskip_overlap")
    shares = batch(single)
    total = 0
    for share in shares:
        logits = run(single, share)[0]
        total = total + loss_of(logits) / logits.shape[:2].numel()
    (total / WORLD).backward()
    model = expert_parallel(prepare("qwen3_moe", "farskip_overlap"))
    logits = run(model, shares[RANK])[0]
    (loss_of(logits) / logits.shape[:2].numel()).backward()
    saved, grads.BUCKET_BYTES = grads.BUCKET_BYTES, 4096  # several buckets
    try:
        reduce_gradients(model, op="mean")
    finally:
        grads.BUCKET_BYTES = saved
    return expert_grad_errors(model, single)


def generation(family, layout):
    """Greedy generation with prompts of several lengths against the single-process model. all_to_all: each rank
    its own prompts (a left-padded batch of two lengths) and its own max_new_tokens, so the ranks finish at
    different steps. all_reduce: rank 1 is handed other prompts and its logits are perturbed (a kernel flipping a
    token on one rank): every rank must still return rank 0's tokens."""
    single = prepare(family, "farskip_overlap")
    pad = single.config.pad_token_id
    prompts = {0: [[5, 17, 33], [8, 41, 12, 9, 30, 22, 7]], 1: [[44, 6, 19, 27, 3, 11]]}
    new_tokens = {0: 9, 1: 4}

    def padded(rows):
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        return ids, (ids != pad).long() if len(rows) > 1 else torch.ones_like(ids)

    model = expert_parallel(prepare(family, "farskip_overlap"), layout=layout)
    if layout == "all_to_all":
        ids, mask = padded(prompts[RANK])
        options = dict(attention_mask=mask, max_new_tokens=new_tokens[RANK], do_sample=False, pad_token_id=pad)
        expected = single.generate(ids, **options)
        got = model.generate(ids, **options)
        return {"equal": bool(torch.equal(got, expected)), "steps": got.shape[1] - ids.shape[1]}
    ids, mask = padded(prompts[0])
    options = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=pad)
    expected = single.generate(ids, **options)
    if RANK == 1:
        ids, mask = padded(prompts[1] * 2)
        noise = torch.Generator().manual_seed(7)  # its own generator: the sampling RNG stays untouched
        model.get_output_embeddings().register_forward_hook(
            lambda m, a, out: out + 5 * torch.randn(out.shape, generator=noise)
        )
    got = model.generate(ids, attention_mask=mask, **{k: v for k, v in options.items() if k != "attention_mask"})
    sampled = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True, pad_token_id=pad)
    every = [None] * WORLD
    dist.all_gather_object(every, sampled.tolist())
    return {"equal": bool(torch.equal(got, expected)), "sampled_same": all(s == every[0] for s in every)}


def sharded_loading(folder):
    """from_pretrained_sharded: only this rank's experts in memory, the same model once expert-parallel, a
    placement applied by moving experts between ranks, and final/-style gathering to one rank only."""
    full = fcsd.from_pretrained(folder, layers="all")
    loaded = from_pretrained_sharded(folder, dist.group.WORLD, layers="all")
    local = {n: tuple(p.shape) for n, p in loaded.named_parameters() if "experts" in n}
    expected_local = {n: tuple(p.shape) for n, p in full.named_parameters() if "experts" in n}
    plan = shuffled_placement(full)
    model = expert_parallel(loaded, mode="farskip_overlap", placement=plan)
    ids = batch(full)[RANK]
    placed = apply_placement(fcsd.from_pretrained(folder, layers="all"), plan)
    gathered = full_state_dict(model, dst=0)
    reference = placed.state_dict()
    return {
        "halved": all(local[n][0] * WORLD == expected_local[n][0] for n in local if "shared" not in n),
        "logits": rel(run(model, ids)[0].detach(), run(full, ids)[0].detach()),
        "gathered_keys": len(gathered),
        "gathered_equal": RANK != 0
        or (gathered.keys() == reference.keys() and all(torch.equal(gathered[k], reference[k]) for k in reference)),
    }


results = {"syncs": {}, "precision": {}, "generate": {}}
for family in ("qwen3_moe", "deepseek_v3", "llama4_text", "mixtral", "qwen2_moe", "olmoe", "deepseek_v2"):
    results["syncs"][f"{family}/plain/farskip_overlap"] = host_syncs(family, "plain", "farskip_overlap")
for family in ("deepseek_v3", "llama4_text"):
    results["syncs"][f"{family}/dedup/farskip_overlap"] = host_syncs(family, "dedup", "farskip_overlap")
    results["syncs"][f"{family}/hierarchical/farskip_overlap"] = host_syncs(family, "hierarchical", "farskip_overlap")
    results["syncs"][f"{family}/plain/regular"] = host_syncs(family, "plain", "regular")
for family, dispatcher in (("qwen3_moe", "plain"), ("deepseek_v3", "dedup"), ("llama4_text", "plain")) + (
    ("qwen3_moe", "hierarchical"),
):
    results["precision"][f"{family}/{dispatcher}"] = precision(family, dispatcher)
results["combine"] = {name: combine_precision(name) for name in ("plain", "dedup", "hierarchical")}
results["two_forwards"] = {family: two_forwards_summed(family) for family in ("qwen3_moe", "deepseek_v3")}
results["no_rows_eager"] = no_rows_with_eager_experts()
results["order_check"] = order_check()
results["schedule"] = {family: schedule_events(family) for family in ("qwen3_moe", "deepseek_v3")}
results["mean"] = bucketed_mean()
for family in ("qwen3_moe", "deepseek_v3"):
    for layout in ("all_to_all", "all_reduce"):
        results["generate"][f"{family}/{layout}"] = generation(family, layout)
folder = f"{sys.argv[1]}.model"  # the same path on every rank
if RANK == 0:
    prepare("qwen3_moe", "regular").save_pretrained(folder)
dist.barrier()
results["sharded"] = sharded_loading(folder)
with open(f"{sys.argv[1]}.{RANK}.json", "w") as handle:
    json.dump(results, handle, indent=1)
dist.destroy_process_group()
