"""Worker of ``benchmarks/gpu_check.py``'s ``expert_parallel`` section: expert parallelism over gloo ranks that all
share one device (``cuda:0``, or the CPU), against one process on the same device.

Every rank builds the same tiny FarSkip Qwen3-MoE (same seed), runs a single-process reference forward/backward of
every rank's tokens, then lays a fresh copy out with :func:`fcsd.parallel.layout.parallelize` (EP over all ranks, no
FSDP, activation checkpointing with the exchanges replayed from host memory: ``checkpointing=True, offload=True``)
for each dispatcher and runs its own tokens. Errors are norm-relative, in fp32: logits (this rank's rows), the loss
summed over the ranks, the global gradient norm, and every parameter's gradient (an expert shard against its slice
of the reference's). Writes ``<out>.<rank>.json``.

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/gpu_check_ep.py OUT --device cpu
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tiny model builders

from tiny_models import build  # noqa: E402

import fcsd  # noqa: E402
from fcsd.parallel import recompute  # noqa: E402
from fcsd.parallel.grads import reduce_gradients  # noqa: E402
from fcsd.parallel.layout import ParallelDims, build_meshes, parallelize  # noqa: E402

LENGTH = 9


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def prepared(device):
    model = build("qwen3_moe")  # seeded: the same weights on every rank
    return fcsd.apply_farskip(model, "all").train().to(device)


def shares(world: int, vocab: int, device) -> list[torch.Tensor]:
    """Each rank's rows: uneven counts (rank 0 twice the others'), the same on every rank."""
    counts = [2] + [1] * (world - 1)
    ids = torch.randint(3, vocab, (sum(counts), LENGTH), generator=torch.Generator().manual_seed(0))
    return [part.to(device) for part in torch.split(ids, counts)]


@contextlib.contextmanager
def counting(counter: list):
    """Counts the exchanges' rows a checkpointed layer moves to host memory (``offload``)."""
    counter.append(1)
    yield


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    weights = torch.randn(logits.shape[-1], generator=torch.Generator().manual_seed(1)).to(logits.device)
    return (logits.float() * weights).sum()


def case(meshes, dispatcher: str, node_size: int | None, device, rank: int, world: int) -> dict:
    single = prepared(device)
    rows = shares(world, single.config.vocab_size, device)
    total, expected = 0.0, None
    for r, ids in enumerate(rows):
        logits = single(input_ids=ids, use_cache=False).logits
        total = total + loss_of(logits)
        if r == rank:
            expected = logits.detach()
    total.backward()
    total = total.detach()
    reference = dict(single.named_parameters())

    model = prepared(device)
    options = dict(mode="farskip_overlap", dispatcher=dispatcher, node_size=node_size)
    parallelize(model, meshes, "student", **options, checkpointing=True, offload=True)
    host_copies = []
    recompute.host_allocation = partial(counting, host_copies)  # proves the rows went to host memory
    start = time.perf_counter()
    logits = model(input_ids=rows[rank], use_cache=False).logits
    loss = loss_of(logits)
    loss.backward()
    reduce_gradients(model, op="sum")
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    recompute.host_allocation = contextlib.nullcontext

    summed = loss.detach().clone()
    dist.all_reduce(summed)
    dense_squares = torch.zeros((), dtype=torch.float64, device=device)
    expert_squares = torch.zeros((), dtype=torch.float64, device=device)
    worst_param, worst_name = 0.0, ""
    for name, param in model.named_parameters():
        want = reference[name].grad
        if want is None:
            continue
        got = param.grad if param.grad is not None else torch.zeros_like(param)
        if getattr(param, "fcsd_expert_shard", False):
            local = param.shape[0]
            want = want[rank * local : (rank + 1) * local]
            expert_squares += got.double().pow(2).sum()
        else:
            dense_squares += got.double().pow(2).sum()
        error = rel(got, want) if want.abs().max() > 0 else float(got.abs().max())
        if error > worst_param:
            worst_param, worst_name = error, name
    dist.all_reduce(expert_squares)
    norm = float((dense_squares + expert_squares).sqrt())
    reference_norm = float(
        torch.stack([p.grad.double().pow(2).sum() for p in reference.values() if p.grad is not None]).sum().sqrt()
    )
    return {
        "logits": rel(logits, expected),
        "loss": abs(float(summed) - float(total)) / abs(float(total)),
        "grad_norm": abs(norm - reference_norm) / reference_norm,
        "param_grad": worst_param,
        "worst_param": worst_name,
        "step_s": seconds,
        "host_copies": len(host_copies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dispatchers", default="plain,dedup,hierarchical")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons
        torch.backends.cudnn.allow_tf32 = False
    meshes = build_meshes(ParallelDims(world=world, ep=world, fsdp=False), device.type)
    results = {}
    for dispatcher in args.dispatchers.split(","):
        # hierarchical: two stand-in nodes (node_size = half the ranks), so every row crosses two hops
        node_size = max(world // 2, 1) if dispatcher == "hierarchical" else None
        try:
            results[dispatcher] = {**case(meshes, dispatcher, node_size, device, rank, world), "node_size": node_size}
        except Exception as error:  # noqa: BLE001 - reported per dispatcher; the other ranks fail alike
            results[dispatcher] = {"error": f"{type(error).__name__}: {error}"[:2000]}
            break  # a failed collective leaves the group unusable
    with open(f"{args.out}.{rank}.json", "w") as handle:
        json.dump({"rank": rank, "world": world, "device": str(device), "results": results}, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
