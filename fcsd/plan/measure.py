"""Real training steps of a candidate, measured, so that the planner's estimate checks itself (``fcsd plan
--measure``, the tests and ``benchmarks/plan_memory.py``).

The same :class:`fcsd.plan.run.Run` that the estimate runs on fake tensors runs here on real ones (random
weights). Peak memory is read independently of the planner's tracker: on a GPU ``torch.cuda.max_memory_allocated``
over the measured step; on a CPU the bytes of every tensor alive before the last step (each storage the garbage
collector finds) plus the allocator's own events during it (``torch.profiler`` with ``profile_memory``), at their
highest. The measured steps follow a first one (steady state: the optimizer states exist, as in the estimate).
An expert-parallel layout is measured with the estimate's routing assumption, every rank receiving the same number
of rows (:func:`balanced_experts`): random weights route unevenly, and by chance, so that the comparison would test
the luck of the draw rather than the estimate. A real run's imbalance comes on top of the estimate, within the
plan's margin (``--margin``). Step time is the wall time of the last step on a GPU (synchronised); on a CPU the
fastest of :data:`TIMED_STEPS` further steps run without the profiler (its memory events slow every op), each
started together on every process (a barrier), the fastest being the one other work on the machine disturbed least.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass

import torch

from fcsd.plan.tracker import CUDA_BLOCK

STEPS = 4  # a first step (the optimizer states appear), then the steady-state steps measured
TIMED_STEPS = 3  # on a CPU, unprofiled steps timed after the measured ones (the fastest is reported)


@dataclass
class Measured:
    peak: int  # bytes, this process
    step_seconds: float
    weights: int  # bytes of this process's student parameters and buffers
    optimizer: int  # bytes of its AdamW states

    def to_dict(self) -> dict:
        return asdict(self)


def measure_step(model_config, fcsd_config, layout, device: str = "cpu", steps: int = STEPS) -> Measured:
    """Build ``layout``'s models for real on ``device`` (this process's share, laid out over the initialised job as
    the trainer lays them out) and run ``steps`` optimizer steps; measure the last on a GPU; on a CPU each step after
    the first, keeping the lowest peak of the step's own tensors (:func:`_step_memory_events`: gloo's worker threads
    allocate beside the main one, and where their buffers fell against its peak moved a reduced model's measured
    peak by up to 14% from step to step)."""
    target = "cuda" if torch.device(device).type == "cuda" else "cpu"
    with balanced_experts() if layout.ep_size > 1 else contextlib.nullcontext():
        if target == "cuda":
            return _measure_cuda(model_config, fcsd_config, layout, device, steps)
        return _measure_cpu(model_config, fcsd_config, layout, target, device, steps)


def _measure_cpu(model_config, fcsd_config, layout, target, device, steps) -> Measured:
    from torch.profiler import ProfilerActivity, profile

    outside = live_tensor_bytes()  # the process's own tensors (and an earlier job's not yet collected): not the run's
    run = _build(model_config, fcsd_config, layout, target, device)
    run.step()  # the optimizer states exist from here on
    lowest = None
    for _ in range(max(1, steps - 1)):  # steady-state steps: the least disturbed one (see measure_step)
        before = live_tensor_bytes() - outside
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            start = time.perf_counter()
            run.step()
            seconds = time.perf_counter() - start
        events = sorted(_step_memory_events(prof), key=lambda item: item[0])
        live = peak = before
        for _, nbytes in events:
            live += nbytes
            peak = max(peak, live)
        lowest = min(lowest or (peak, seconds), (peak, seconds))
    return Measured(lowest[0], _fastest_step(run), *_static(run))


def _fastest_step(run, steps: int = TIMED_STEPS) -> float:
    """Seconds of the fastest of ``steps`` unprofiled steps, each begun on every process at once (see the module
    docstring)."""
    import torch.distributed as dist

    fastest = float("inf")
    for _ in range(steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        run.step()
        fastest = min(fastest, time.perf_counter() - start)
    return fastest


def _step_memory_events(prof) -> list[tuple[int, int]]:
    """``(time, bytes)`` of the allocator events of the step's own tensors: those of the thread that allocates most
    (the step's), and of any other thread whose allocations are not all freed again on it during the step. A thread
    whose bytes net to zero is a communication library's worker holding its own temporaries while a collective runs
    (gloo's reduce-scatter and all-gather: 6-31 MB per thread and step on a reduced EP x FSDP2 layout, measured):
    not tensors of the step, and where they fall against its peak varies from step to step."""
    from collections import defaultdict

    by_thread = defaultdict(list)
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]":
            by_thread[e.start_thread_id()].append((e.start_ns(), e.nbytes()))
    if not by_thread:
        return []
    main = max(by_thread, key=lambda t: sum(n for _, n in by_thread[t] if n > 0))
    return [
        event
        for thread, events in by_thread.items()
        if thread == main or sum(n for _, n in events) != 0
        for event in events
    ]


@contextlib.contextmanager
def balanced_experts():
    """Every family's router runs as usual (its memory and FLOPs), then token ``t``'s ``j``-th expert becomes
    ``(t * K + j) mod E``: each expert, hence each expert-parallel rank, receives the same number of rows, as the
    estimate assumes (:func:`fcsd.plan.simulate.balanced_routing`)."""
    from fcsd.connectivity.families import FAMILIES

    def balanced(route):
        def route_balanced(mlp, x):
            routing = route(mlp, x)
            tokens, k = routing.topk_ids.shape
            device = routing.topk_ids.device
            ids = torch.arange(tokens, device=device)[:, None] * k + torch.arange(k, device=device)
            return routing._replace(topk_ids=(ids % routing.router_logits.shape[-1]).to(routing.topk_ids.dtype))

        return route_balanced

    originals = [family.route for family in FAMILIES]
    for family, route in zip(FAMILIES, originals, strict=True):
        object.__setattr__(family, "route", balanced(route))  # a frozen dataclass
    try:
        yield
    finally:
        for family, route in zip(FAMILIES, originals, strict=True):
            object.__setattr__(family, "route", route)


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process (found by the garbage collector after a collection, so
    that tensors only unreachable cycles hold are not counted; each storage once)."""
    import gc
    import warnings

    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # isinstance() reads __class__, which torch.distributed.reduce_op deprecates
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        if obj.device.type == "cpu" and not isinstance(obj, FakeTensor):
            try:  # wrapper subclasses have no storage; FSDP2's freed unsharded parameters an invalid one
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (NotImplementedError, RuntimeError):
                continue
    return sum(storages.values())


def _measure_cuda(model_config, fcsd_config, layout, device, steps: int) -> Measured:
    torch.cuda.synchronize()
    outside = torch.cuda.memory_allocated()
    run = _build(model_config, fcsd_config, layout, "cuda", device)
    for _ in range(steps - 1):
        run.step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    run.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return Measured(torch.cuda.max_memory_allocated() - outside, seconds, *_static(run, CUDA_BLOCK))


def _build(model_config, fcsd_config, layout, target, device):
    from fcsd.plan.run import build_run, run_meshes

    meshes = run_meshes(layout, torch.device(device).type) if layout.processes > 1 else None
    with torch.device(device):
        return build_run(model_config, fcsd_config, layout, target, meshes)


def _static(run, block: int = 1) -> tuple[int, int]:
    """Bytes of this process's student weights (and buffers) and AdamW states, each storage rounded up to the
    allocator's ``block`` as the estimate rounds it (CUDA: 512 bytes)."""
    from fcsd.plan.simulate import _local, _optimizer_tensors

    def size(tensor) -> int:
        return -(-tensor.untyped_storage().nbytes() // block) * block

    tensors = [_local(t) for t in (*run.unwrapped.parameters(), *run.unwrapped.buffers())]
    weights = sum({id(t.untyped_storage()): size(t) for t in tensors}.values())
    optimizer = sum(size(t) for t in _optimizer_tensors(run.optimizer))
    return weights, optimizer


def measure_processes(model_config, fcsd_config, layout, device: str = "cpu", steps: int = STEPS) -> list[Measured]:
    """:func:`measure_step` on every process of ``layout`` (one process: here; several: spawned local processes on
    gloo, or NCCL with a GPU each); one result per rank."""
    return measure_jobs([(model_config, fcsd_config, layout)], device, steps)[0]


def measure_jobs(jobs: list, device: str = "cpu", steps: int = STEPS) -> list[list[Measured]]:
    """:func:`measure_processes` of several ``(model config, run config, layout)`` jobs of the same process count,
    one after another in one set of processes (starting processes is the slow part)."""
    processes = {layout.processes for _, _, layout in jobs}
    if len(processes) != 1:
        raise ValueError(f"jobs of different process counts ({sorted(processes)}) cannot share processes")
    count = processes.pop()
    if count == 1:
        return [[measure_step(*job, device, steps)] for job in jobs]
    import json
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    from fcsd.stopping import joined

    with tempfile.TemporaryDirectory() as folder:  # a stopped plan stops its workers before it ends
        joined(mp.start_processes(_worker, args=(jobs, device, steps, folder), nprocs=count, join=False))
        results = json.loads((Path(folder) / "rank0.json").read_text())
        others = [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(1, count)]
    return [[Measured(**r) for r in ranks] for ranks in zip(results, *others, strict=True)]


def _worker(rank: int, jobs: list, device: str, steps: int, folder: str) -> None:
    import json
    from pathlib import Path

    import torch.distributed as dist

    from fcsd.distill.config import process_group_timeout
    from fcsd.stopping import die_with_parent

    die_with_parent()
    count = jobs[0][2].processes
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    store = dist.FileStore(str(Path(folder) / "store"), count)
    timeout = process_group_timeout(jobs[0][1].parallel.timeout_minutes)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=count, timeout=timeout)
    try:
        results = []
        for model_config, fcsd_config, layout in jobs:
            results.append(measure_step(model_config, fcsd_config, layout, device, steps).to_dict())
        (Path(folder) / f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
