"""Worker of tests/test_saves_and_grads.py: one gloo launch per case, every rank writes ``{out}.{rank}.json``."""

import json
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def timeout_case() -> dict:
    """The trainer's process group waits ``parallel.timeout_minutes``: set when it starts, and on one running."""
    from fcsd.distill.config import FCSDConfig
    from fcsd.distill.trainer import process_state

    def default_group_minutes() -> float:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds() / 60

    config = FCSDConfig()
    config.parallel.timeout_minutes = 7
    started = process_state(config).num_processes
    at_start = default_group_minutes()
    config.parallel.timeout_minutes = 11
    process_state(config)
    ones = torch.ones(1)
    dist.all_reduce(ones)  # the group still works
    return {"processes": started, "at_start": at_start, "running": default_group_minutes(), "sum": ones.item()}


class Allocations(TorchDispatchMode):
    """The bytes of every tensor an op creates (not a view of its inputs; meta tensors left out), by dtype."""

    def __init__(self):
        super().__init__()
        self.largest = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {_storage(t) for t in tree_flatten((args, kwargs))[0]}
        for t in tree_flatten(out)[0]:
            if _storage(t) not in (None, *seen):
                key = str(t.dtype)
                self.largest[key] = max(self.largest.get(key, 0), t.untyped_storage().nbytes())
        return out


def _storage(t):
    """The data pointer of a plain tensor's storage (None for anything else: a wrapper subclass, a meta tensor)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


PIECE = 256  # bytes: far below the tiny model's expert tensors


def save_case() -> dict:
    """Streamed saves of layouts (EP 2 x FSDP, FSDP alone) in fp32 and bf16 against the one-process model's
    ``save_pretrained``, and the largest tensor each process allocated while saving."""
    import tempfile

    from ep_common import RANK, WORLD, prepare
    from safetensors.torch import load_file

    from fcsd.parallel.layout import ParallelDims, build_meshes, parallelize
    from fcsd.parallel.stream_save import write_weights

    results = {}
    for ep in (2, 1):
        model = prepare("qwen3_moe", "farskip_overlap")
        reference = prepare("qwen3_moe", "farskip_overlap")
        largest_param = max(p.numel() * p.element_size() for p in reference.parameters())
        parallelize(model, build_meshes(ParallelDims(WORLD, ep, True), "cpu"), "student")
        for dtype in (torch.float32, torch.bfloat16):
            folder = tempfile.mkdtemp() if RANK == 0 else None
            with Allocations() as allocations:
                weight_map = write_weights(model, folder, dtype, max_shard_bytes=40_000, piece_bytes=PIECE)
            case = {"largest": allocations.largest, "largest_param_fp32": largest_param}
            if RANK == 0:
                saved = {}
                for name in sorted(set(weight_map.values())):
                    saved.update(load_file(f"{folder}/{name}"))
                expected_folder = tempfile.mkdtemp()
                prepare("qwen3_moe", "farskip_overlap").to(dtype).save_pretrained(expected_folder)
                expected = load_file(f"{expected_folder}/model.safetensors")
                case["files"] = len(set(weight_map.values()))
                case["same_keys"] = sorted(saved) == sorted(expected)
                case["equal"] = all(torch.equal(saved[k], expected[k]) and saved[k].dtype == dtype for k in expected)
            results[f"ep{ep}/{str(dtype).removeprefix('torch.')}"] = case
    return results


def combine_case() -> dict:
    """Under bf16 autocast, the dtypes and shapes of the tensors each dispatcher's combine keeps for backward."""
    from fcsd.parallel.dispatchers import AllToAllDispatcher, DedupAllToAllDispatcher
    from fcsd.parallel.hierarchical import HierarchicalDispatcher, node_and_rail_groups

    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, hidden, top_k, local = 7 + 3 * rank, 24, 3, 2
    gen = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(local * world, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    maps = torch.randn(local * world, hidden, hidden, generator=torch.Generator().manual_seed(99))
    maps = maps[rank * local : (rank + 1) * local]
    node_group, rail_group = node_and_rail_groups(None, 1)
    result = {"hidden": hidden}
    for name, make in (
        ("plain", lambda: AllToAllDispatcher(num_local_experts=local)),
        ("dedup", lambda: DedupAllToAllDispatcher(num_local_experts=local)),
        (
            "hierarchical",
            lambda: HierarchicalDispatcher(
                num_local_experts=local, node_size=1, node_group=node_group, rail_group=rail_group
            ),
        ),
    ):
        dispatcher = make()
        xg, wg = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        saved = []

        def keep(t, saved=saved):
            saved.append([str(t.dtype).removeprefix("torch."), list(t.shape)])
            return t

        with torch.autocast("cpu", dtype=torch.bfloat16):
            pending = dispatcher.dispatch_async(xg, ids, wg)
            rows = pending.wait()
            y = torch.einsum("rd,rde->re", rows.tokens, maps[rows.expert_ids[:, 0]]) * rows.weights
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                out = dispatcher.combine_async(y, pending).wait()
        out.float().sum().backward()
        result[name] = {"saved": saved, "y_dtype": str(y.dtype), "grads": [xg.grad is not None, wg.grad is not None]}
    return result


def norm_case() -> dict:
    """The global gradient norm of an expert-parallel and an EP x FSDP model after a step's backward: the ops it
    runs, and its value against an fp64 sum of the same gradients."""
    from ep_common import RANK, WORLD, batch, loss_of, prepare
    from torch.distributed.tensor import DTensor

    from fcsd.parallel.layout import ParallelDims, build_meshes, parallelize
    from fcsd.parallel.training import clip_grad_norm_, reduce_and_clip

    result = {}
    for fsdp in (False, True):
        model = prepare("qwen3_moe", "farskip_overlap").train()
        parallelize(model, build_meshes(ParallelDims(WORLD, 2, fsdp), "cpu"), "student")
        logits = model(input_ids=batch(model)[RANK], use_cache=False).logits
        loss_of(logits).backward()
        reduce_and_clip(model, float("inf"))
        ops = Ops()
        with ops:
            norm = clip_grad_norm_(model, float("inf"))
        squares = torch.zeros(2, dtype=torch.float64)
        for p in model.parameters():
            if p.grad is not None:
                local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                squares[int(getattr(p, "fcsd_expert_shard", False) and not fsdp)] += local.double().pow(2).sum()
        if fsdp:
            dist.all_reduce(squares)
        else:
            dist.all_reduce(squares[1:], group=model.fcsd_expert_parallel.group)
        expected = float(squares.sum().sqrt())
        result["fsdp" if fsdp else "ep"] = {"norm": norm, "fp64": expected, "ops": ops.counts}
    return result


class Ops(TorchDispatchMode):
    """How many times each op ran."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


CASES = {"timeout": timeout_case, "save": save_case, "combine": combine_case, "norm": norm_case}

if __name__ == "__main__":
    out, which = sys.argv[1], sys.argv[2]
    if not dist.is_initialized() and which != "timeout":
        dist.init_process_group("gloo")
    result = CASES[which]()
    with open(f"{out}.{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
