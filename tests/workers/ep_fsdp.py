"""Worker for test_ep_fsdp: EP x FSDP2 layouts (fcsd.parallel.layout) on 4 gloo processes, in one launch.

Training cases: the same 2 AdamW steps (gradient clipping active) in one process and laid out, compared per step
(loss, global gradient norm) and after the steps (every weight, gathered in the stock layout); fused AdamW over the
two meshes' parameter groups. Planted errors: the classic factor-of-ep expert gradient and a checkpointed layer
recomputed without replaying its exchanges. Loading: each process's student and teacher bytes against its share,
the teacher resharded after its forward, generation and streamed saving of a model loaded laid out. Writes
``<out>.<rank>.json``.
"""

import contextlib
import json
import sys
import tempfile
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from ep_common import RANK, WORLD, batch, loss_of, prepare, rel
from torch.distributed.tensor import DTensor

import fcsd
from fcsd.connectivity.families import expert_count, family_for_config, moe_blocks
from fcsd.parallel import layout, recompute
from fcsd.parallel.events import record_events
from fcsd.parallel.layout import ParallelDims, build_meshes, parallelize
from fcsd.parallel.load import from_pretrained_parallel
from fcsd.parallel.step_state import expert_names, model_state
from fcsd.parallel.stream_save import gather, write_weights
from fcsd.parallel.training import parameter_groups, reduce_and_clip
from fcsd.placement import Placement, apply_placement

STEPS, LR, CLIP = 2, 1e-2, 0.5
SINGLE: dict = {}  # family -> the one-process run of single()


def placement_for(model, ep):
    """A shuffled balanced placement over ``ep`` ranks for every MoE layer (the same on every process)."""
    gen = np.random.default_rng(3)
    blocks = moe_blocks(model, family_for_config(model.config))
    num_experts = expert_count(next(iter(blocks.values())).experts)
    contiguous = np.arange(num_experts) // (num_experts // ep)
    layers = {layer: gen.permutation(contiguous).tolist() for layer in blocks}
    return Placement(num_experts=num_experts, ep=ep, nodes=1, layers=layers)


def is_expert(name: str) -> bool:
    return ".experts." in name and "shared" not in name


def step_batch(model, step):
    shares = batch(model, seed=step)
    return shares, sum(share.numel() for share in shares)


def single(family, placement=None):
    """One process on every share: per step (loss per token, gradient norm), then the weights (computed once per
    family without a placement: several cases compare with the same run)."""
    if placement is None and family in SINGLE:
        return SINGLE[family]
    model = prepare(family, "farskip_overlap").train()
    if placement is not None:
        apply_placement(model, placement)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    records = []
    for step in range(STEPS):
        shares, tokens = step_batch(model, step)
        total = sum(loss_of(model(input_ids=share, use_cache=False).logits) for share in shares) / tokens
        total.backward()
        experts = [p.grad for name, p in model.named_parameters() if is_expert(name)]
        expert_norm = float(torch.stack([g.pow(2).sum() for g in experts]).sum().sqrt())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        records.append([float(total), float(norm), expert_norm])
    if placement is not None:
        return records, model.state_dict()
    return SINGLE.setdefault(family, (records, model.state_dict()))


@contextlib.contextmanager
def counting_host_copies(counter: list):
    """Counts the rows a checkpointed layer moves to host memory (``train.checkpoint_offload``)."""
    counter.append(1)
    yield


def laid_out(family, ep, checkpointing=False, placement=None, dispatcher="plain", offload=False, node_size=None):
    """The same steps laid out EP ``ep`` x FSDP ``WORLD / ep`` (the trainer's loss scale and calls)."""
    model = prepare(family, "farskip_overlap").train()
    meshes = build_meshes(ParallelDims(WORLD, ep, True), "cpu")
    options = dict(placement=placement, dispatcher=dispatcher, checkpointing=checkpointing, offload=offload)
    options["node_size"] = node_size
    parallelize(model, meshes, "student", **options)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameter_groups(model, params), lr=LR, fused=True)
    records, events, host_copies = [], [], []
    recompute.host_allocation = partial(counting_host_copies, host_copies)
    for step in range(STEPS):
        shares, tokens = step_batch(model, step)
        loss = loss_of(model(input_ids=shares[RANK], use_cache=False).logits)
        with record_events() as log:
            (loss * WORLD / tokens).backward()  # the trainer's scale: W x (this rank's sum) / global tokens
        events += [what for what, _, _ in log]
        events += [f"{what} {serial}" for what, kind, serial in log if kind == "layer"]  # recomputation order
        squares = torch.zeros((), dtype=torch.float64)
        for name in expert_names(model):
            squares += model.get_parameter(name).grad._local_tensor.double().pow(2).sum()
        dist.all_reduce(squares)  # each element of an expert gradient lives on one process
        norm = reduce_and_clip(model, CLIP)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        records.append([float(total) / tokens, norm, float(squares.sqrt())])
    recompute.host_allocation = contextlib.nullcontext
    state = {key: gather(value) for key, value in model_state(model).items()}
    events.append(f"host copies: {len(host_copies)}")
    return records, state, events, len(optimizer.param_groups), (model, optimizer)


def compare(family, ep, **options):
    placement = options.get("placement")
    expected, weights = single(family, placement)
    got, state, events, groups, _ = laid_out(family, ep, **options)
    return {
        "loss": max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(got, expected)),
        "grad_norm": max(abs(a[1] - b[1]) / b[1] for a, b in zip(got, expected)),
        "expert_norm_ratio": [a[2] / b[2] for a, b in zip(got, expected)],
        "weights": max(rel(state[k], weights[k]) for k in weights),
        "same_keys": sorted(state) == sorted(weights),
        "backward_events": sorted(set(events)),
        "recomputation": [e for e in events if e.startswith(("recompute ", "prefetch "))],  # in order
        "param_groups": groups,
    }


def dcp_round_trip(folder):
    """A step checkpoint of EP 2 x FSDP 2 (:func:`fcsd.parallel.step_state.save`, each process its shards) read
    back into a fresh layout of the same model: every weight and AdamW state exactly as saved."""
    from fcsd.parallel import step_state

    *_, (model, optimizer) = laid_out("qwen3_moe", 2)
    step_state.save(model, optimizer, folder)
    fresh = parallelize(
        prepare("qwen3_moe", "farskip_overlap").train(), build_meshes(ParallelDims(WORLD, 2, True), "cpu")
    )
    again = torch.optim.AdamW(parameter_groups(fresh, list(fresh.parameters())), lr=LR, fused=True)
    step_state.load(fresh, again, folder)
    saved, loaded = step_state.optimizer_state(model, optimizer), step_state.optimizer_state(fresh, again)
    pairs = [(model_state(model)[k], v) for k, v in model_state(fresh).items()]
    pairs += [(saved["state"][k][n], v) for k, states in loaded["state"].items() for n, v in states.items()]
    equal = [torch.equal(gather(a), gather(b)) for a, b in pairs]  # a list: every rank runs every gather
    return {"tensors": len(pairs), "equal": all(equal)}


def error_of(fn) -> str:
    try:
        fn()
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return ""


def planted_ep_factor():
    """The classic error: expert gradients divided by their own group's size (FSDP2's default) instead of W."""
    saved = layout.expert_divide_factor
    layout.expert_divide_factor = lambda dims: float(dims.efsdp)
    try:
        return compare("qwen3_moe", 2)
    finally:
        layout.expert_divide_factor = saved


def planted_recompute():
    """A checkpointed layer recomputed without replaying its exchanges re-issues them during the backward."""
    saved = recompute.replay_log, recompute.replaying
    recompute.replay_log, recompute.replaying = (lambda: None), (lambda: False)
    try:
        return error_of(lambda: laid_out("qwen3_moe", 2, checkpointing=True))
    finally:
        recompute.replay_log, recompute.replaying = saved


def share_numel(shape, dims: ParallelDims, expert_dim=None, padded=False) -> int:
    """Elements this rank holds of a tensor of ``shape``: a dense one chunked over all processes (dim 0, as FSDP2),
    an expert one split over ep (dim 0) and then chunked over efsdp (``expert_dim``). ``padded``: FSDP2's storage,
    every chunk as long as the first."""
    meta = torch.empty(shape, device="meta")
    if expert_dim is not None:
        meta, parts, index, dim = meta.chunk(dims.ep, 0)[RANK % dims.ep], dims.efsdp, RANK // dims.ep, expert_dim
    else:
        parts, index, dim = dims.world, RANK, 0
    chunks = meta.chunk(parts, dim)
    if padded:
        return chunks[0].numel()
    return chunks[index].numel() if index < len(chunks) else 0


def local_numel(model, storage=False) -> int:
    """Elements of the parameters this process holds; ``storage``: counted by their storages (a view of a whole
    checkpoint tensor counts whole; FSDP2's padding counts)."""
    locals_ = [p._local_tensor if isinstance(p, DTensor) else p for p in model.parameters()]
    return sum(t.untyped_storage().nbytes() // t.element_size() if storage else t.numel() for t in locals_)


def loaded(folder):
    """Student and teacher loaded laid out (EP 2 x FSDP 2): each holds exactly its share; the teacher is sharded
    again after a forward; greedy generation and streamed saving give what one process gives."""
    dims = ParallelDims(WORLD, 2, True)
    meshes = build_meshes(dims, "cpu")
    student = from_pretrained_parallel(folder, meshes, "student", layers="all", dtype=torch.float32)
    teacher = from_pretrained_parallel(folder, meshes, "teacher", dtype=torch.float32)
    reference = fcsd.from_pretrained(folder, layers="all").eval()
    expert_dim = student.fcsd_layout.expert_dim
    params = list(reference.named_parameters())
    shares = [
        sum(share_numel(p.shape, dims, expert_dim if is_expert(name) else None, padded) for name, p in params)
        for padded in (False, True)
    ]
    ids = batch(reference)[RANK]
    with torch.no_grad():
        teacher_logits = teacher(input_ids=ids, use_cache=False).logits
        stock = fcsd.from_pretrained(folder).eval()(input_ids=ids, use_cache=False).logits
    prompt = torch.tensor([[5, 17, 33, 8, 41, 12][: 3 + RANK]])
    student.eval()
    generated = student.generate(prompt, max_new_tokens=6, do_sample=False)
    expected = reference.generate(prompt, max_new_tokens=6, do_sample=False)
    out = tempfile.mkdtemp() if RANK == 0 else None
    weight_map = write_weights(student, out, torch.float32, max_shard_bytes=40_000)
    saved = {}
    if RANK == 0:
        from safetensors.torch import load_file

        for name in sorted(set(weight_map.values())):
            saved.update(load_file(f"{out}/{name}"))
        reference.save_pretrained(f"{out}-reference")
        expected_files = load_file(f"{out}-reference/model.safetensors")
    return {
        "student_local": [local_numel(student), local_numel(student, storage=True)],
        "teacher_local": [local_numel(teacher), local_numel(teacher, storage=True)],
        "share": shares,
        "total": sum(p.numel() for p in reference.parameters()),
        "teacher_resharded": all(isinstance(p, DTensor) for p in teacher.parameters()),
        "teacher_logits": rel(teacher_logits, stock),
        "generate_equal": bool(torch.equal(generated, expected)),
        "shards": len(set(weight_map.values())),
        "saved_equal": RANK != 0
        or (saved.keys() == expected_files.keys() and all(torch.equal(saved[k], expected_files[k]) for k in saved)),
    }


def chat_assets(root):
    """A tiny Qwen3-MoE with its locally trained tokenizer and chat data (rank 0 writes them)."""
    from pathlib import Path

    from tiny_models import save_chat_model

    from fcsd.embedded.synthetic import make_dataset, write_jsonl

    root = Path(root)
    if RANK == 0:
        rows = make_dataset(60, seed=5)
        save_chat_model(root / "model", rows, "qwen3_moe")
        write_jsonl(rows, root / "train.jsonl")
    dist.barrier()
    return root


def mbpp_generation(root):
    """MBPP+ early stopping's generation (every process its problems, stepping together) with the student laid out
    EP 2 x FSDP 2: the same solutions as one process."""
    from pathlib import Path

    from fcsd.evaluate.mbpp_plus import generate_solutions, load_problems
    from fcsd.loading import tokenizer_from_pretrained

    fixture = Path(__file__).resolve().parents[2] / "eval" / "fixtures" / "mbpp_plus_mini.jsonl"
    # each process its own share, as many on each (every generate call is collective, as early stopping pads)
    problems = dict(list(load_problems(str(fixture)).items())[:4][RANK % 2 :: 2])
    tokenizer = tokenizer_from_pretrained(str(root / "model"))
    meshes = build_meshes(ParallelDims(WORLD, 2, True), "cpu")
    student = from_pretrained_parallel(str(root / "model"), meshes, "student", layers="all").eval()
    reference = fcsd.from_pretrained(str(root / "model"), layers="all").eval()
    options = {"max_new_tokens": 12, "batch_size": 2}
    got = generate_solutions(student, tokenizer, problems, synced_gpus=True, **options)
    return {"problems": len(problems), "equal": got == generate_solutions(reference, tokenizer, problems, **options)}


def cache_share(root):
    """``fcsd cache-teacher`` on 4 processes (teacher EP 2 x FSDP 2, 8-row shards): each process writes its shards
    and the cache equals the one a single process writes."""
    from fcsd.distill import teacher_cache
    from fcsd.distill.config import compose, to_config
    from fcsd.distill.run_data import all_rows, load_run_data
    from fcsd.distill.student_teacher import load_tokenizer

    overrides = [f"model.name={root / 'model'}", f"data.path={root / 'train.jsonl'}", f"data.cache_dir={root / 'p'}"]
    overrides += ["data.seq_len=32", "data.eval_sequences=2", "train.batch_tokens=256", "progress=false"]
    overrides += ["parallel.ep_size=2", "parallel.fsdp=true", "teacher.top_k=8", f"teacher.cache_dir={root / 'c4'}"]
    config = to_config(compose(overrides))
    saved, teacher_cache.SHARD_ROWS = teacher_cache.SHARD_ROWS, 8
    written, write_shard = [], teacher_cache.write_shard
    teacher_cache.write_shard = lambda *a, **k: written.append(a[4].name) or write_shard(*a, **k)
    try:
        teacher_cache.cache_teacher(config)
        equal = True
        if RANK == 0:  # the one-process cache of the same rows, with the plain teacher
            from safetensors.torch import load_file

            teacher_cache.write_shard = write_shard
            tokenizer = load_tokenizer(config)
            rows = all_rows(*load_run_data(config, tokenizer)[:2])
            teacher = fcsd.from_pretrained(str(root / "model")).eval()
            meta = teacher_cache.run_meta(teacher, rows, config)
            teacher_cache.build_cache(teacher, rows, root / "c1", meta, progress=False)
            names = sorted(p.name for p in (root / "c1").glob("shard-*"))
            equal = names == sorted(p.name for p in (root / "c4").glob("shard-*")) and all(
                torch.equal(a["ids"], b["ids"]) and rel(a["logp"], b["logp"]) < 1e-5
                for a, b in ((load_file(root / "c1" / n), load_file(root / "c4" / n)) for n in names)
            )
            equal = equal and json.loads((root / "c1/meta.json").read_text()) == json.loads(
                (root / "c4/meta.json").read_text()
            )
    finally:
        teacher_cache.SHARD_ROWS, teacher_cache.write_shard = saved, write_shard
    return {"written": written, "equal": equal}


results = {"cases": {}}
cases = {
    "deepseek_v3/ep2xfsdp2": ("deepseek_v3", 2, {}),
    "deepseek_v3/ep2xfsdp2/checkpointing": ("deepseek_v3", 2, {"checkpointing": True}),
    "llama4_text/ep2xfsdp2/checkpointing": ("llama4_text", 2, {"checkpointing": True}),
    "qwen3_moe/ep2xfsdp2/checkpointing+offload": ("qwen3_moe", 2, {"checkpointing": True, "offload": True}),
    "qwen3_moe/ep4xfsdp1": ("qwen3_moe", 4, {}),
    "qwen3_moe/fsdp4/checkpointing": ("qwen3_moe", 1, {"checkpointing": True}),
    "qwen3_moe/ep2xfsdp2/placement+dedup": ("qwen3_moe", 2, {"dispatcher": "dedup", "placement": "ep2"}),
    # two "nodes" of one rank per EP group: the node-aware dispatcher, its replay in host memory
    "qwen3_moe/ep2xfsdp2/checkpointing+offload+hierarchical": (
        "qwen3_moe",
        2,
        {"checkpointing": True, "offload": True, "dispatcher": "hierarchical", "node_size": 1},
    ),
}
for name, (family, ep, options) in cases.items():
    if options.get("placement") == "ep2":
        options["placement"] = placement_for(prepare(family, "regular"), 2)
    results["cases"][name] = compare(family, ep, **options)
results["planted_ep_factor"] = planted_ep_factor()
results["planted_recompute"] = planted_recompute()
results["dcp"] = dcp_round_trip(f"{sys.argv[1]}.dcp")  # the same path on every rank
folder = f"{sys.argv[1]}.model"  # the same path on every rank
if RANK == 0:
    prepare("deepseek_v3", "regular").save_pretrained(folder)
dist.barrier()
results["loaded"] = loaded(folder)
chat = chat_assets(f"{sys.argv[1]}.chat")
results["mbpp"] = mbpp_generation(chat)
results["cache"] = cache_share(chat)
with open(f"{sys.argv[1]}.{RANK}.json", "w") as handle:
    json.dump(results, handle, indent=1)
dist.destroy_process_group()
