"""The cluster a plan is made for: GPU presets (memory, peak bf16 FLOP/s, link bandwidths), overridable.

Memory is what the driver reports for the whole GPU (H100 SXM 80 GB: 79.6 GiB; H200: 139.8 GiB; MI300X: 192 GiB).
Peak FLOP/s are the vendors' dense bf16 figures (no sparsity). Bandwidths are *bus* bandwidths in NCCL's convention
(as :mod:`fcsd.plan.perfmodel` uses them), i.e. what ``nccl-tests`` report, not the links' nominal sum: inside a node
NVLink 4 (900 GB/s bidirectional per GPU) gives about 360 GB/s for an all-reduce and 300 GB/s for an all-to-all
(MI300X's Infinity Fabric a little less), between nodes one 400 Gb/s NIC per GPU gives about 45 GB/s. These are the
planner's stated assumptions, not measurements: override them with ``--intra-gbps`` / ``--inter-gbps`` (and
``--gpu-memory``, ``--gpu-tflops``) for your cluster. The host link (what ``train.checkpoint_offload`` copies over)
is a PCIe Gen5 x16 per GPU, shared with its neighbour behind one switch as in DGX/HGX nodes: about 25 GB/s each way
per GPU while all copy (``--host-gbps``); a node has 2 TiB of host memory, of which a plan pins at most half
(``--host-memory``).

A cluster file (``fcsd bench cluster``, :mod:`fcsd.plan.calibrate`) replaces the presets with figures measured on
the machines at hand: ``fcsd plan --cluster FILE`` (:func:`load_cluster_file`). Its GEMM rate is the effective one
(``peak x mfu`` replaced: ``mfu`` is 1), the routed experts' FLOPs priced at their own grouped-GEMM rate where the
file measured it (:meth:`Calibration.expert_rate`), and it carries the costs the time model leaves out
(:class:`Calibration`: per-op dispatch time, elementwise memory bandwidth, per-collective latency), which the
calibrated prediction of ``--measure``'s reduced steps adds.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

GIB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # per GPU, as the driver reports it
    tflops: float  # dense bf16 peak
    intra_gbps: float  # bus bandwidth inside a node (all-reduce; all-to-all uses 5/6 of it)
    inter_gbps: float  # bus bandwidth between nodes, per GPU
    host_gbps: float = 25.0  # GPU <-> host copies, per GPU and direction, every GPU of the node copying
    host_gib: float = 2048.0  # host memory of a node
    # CUDA (major, minor); None: not known, a CPU or a ROCm GPU. Decides FP8 kernels
    # (fcsd.block_fp8.fp8_kernels_available)
    compute_capability: tuple | None = None


GPUS = {
    "h100": GPU("H100 SXM 80GB", 79.6, 989.0, 360.0, 45.0, compute_capability=(9, 0)),
    "h200": GPU("H200 141GB", 139.8, 989.0, 360.0, 45.0, compute_capability=(9, 0)),
    "mi300x": GPU("MI300X 192GB", 192.0, 1307.0, 300.0, 45.0),  # ROCm: no compute capability (FP8 is e4m3fnuz)
}
HOST_SHARE = 0.5  # of a node's host memory, what a plan may pin (the rest: the OS, data loading, the page cache)
CLUSTER_FORMAT, CLUSTER_VERSION = "fcsd-cluster", 1
COLLECTIVES = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Calibration:
    """What ``fcsd bench cluster`` measured beyond the preset fields (all optional for a :class:`Cluster`): the
    per-op cost of dispatching one tensor op (``op_us``: Python, dispatcher and autograd, every rank busy),
    elementwise memory bandwidth (``memory_gbps``), each collective's latency by group size (``latency_us``:
    ``((kind, ranks, microseconds), ...)``), the grouped expert GEMMs' rate on one EP rank by EP size
    (``expert_tflops``: ``((ep, TFLOP/s), ...)``; ``reduced_expert_tflops``: ``((tokens, ep, TFLOP/s), ...)`` at the
    reduced shapes), the all-to-all bus bandwidths (``alltoall_intra_gbps`` /
    ``alltoall_inter_gbps``), the GEMM rate at the reduced shapes ``fcsd plan --measure`` runs
    (``reduced_tflops``: ``((tokens, TFLOP/s), ...)``), and where it was measured (``device``, ``backend``,
    ``threads``: torch's intra-op threads per process, ``model``), and how much of a collective hides behind
    compute running at the same time (``overlap``: 1 where the GPU's copy engines and NICs move the bytes beside its
    compute, about 0 on a CPU whose every core computes, where the collective's copies take cores from the
    compute; the time model hides only this share of each window: :attr:`Cluster.overlap`)."""

    op_us: float = 0.0
    memory_gbps: float | None = None  # None: no elementwise term
    latency_us: tuple = ()
    alltoall_intra_gbps: float | None = None
    alltoall_inter_gbps: float | None = None
    reduced_tflops: tuple = ()
    device: str = ""
    backend: str = ""
    threads: int = 0
    model: str = ""
    assumed: tuple = ()  # the cluster fields not measured (kept from a preset), e.g. inter_gbps on one node
    overlap: float = 1.0  # the share of a collective's time that hides behind compute running beside it
    expert_tflops: tuple = ()  # ((ep, TFLOP/s), ...): grouped expert GEMMs on one EP rank; () prices them at tflops
    reduced_expert_tflops: tuple = ()  # ((tokens, ep, TFLOP/s), ...) at the reduced shapes

    def expert_rate(self, ep: int) -> float | None:
        """FLOP/s of the routed experts' grouped GEMMs on a rank of EP ``ep``: the measured EP size nearest to it
        (None: not measured, the experts are priced at the GEMM rate)."""
        if not self.expert_tflops:
            return None
        return min(self.expert_tflops, key=lambda item: (abs(math.log(item[0] / max(ep, 1))), item[0]))[1] * 1e12

    def reduced_experts(self, tokens: int) -> tuple:
        """``((ep, TFLOP/s), ...)`` of the grouped expert GEMMs at the reduced shapes nearest ``tokens`` tokens."""
        if not self.reduced_expert_tflops:
            return ()
        near = min({t for t, _, _ in self.reduced_expert_tflops}, key=lambda t: abs(math.log(t / max(tokens, 1))))
        return tuple((ep, v) for t, ep, v in self.reduced_expert_tflops if t == near)

    def latency(self, kind: str, ranks: int) -> float:
        """Seconds of latency of one ``kind`` collective over ``ranks`` ranks: the measured group size nearest above
        (else the largest measured), 0 when none of that kind was measured or ``ranks`` is 1."""
        sizes = sorted((n, us) for k, n, us in self.latency_us if k == kind)
        if ranks <= 1 or not sizes:
            return 0.0
        return next((us for n, us in sizes if n >= ranks), sizes[-1][1]) * 1e-6

    def reduced_rate(self, tokens: int) -> float | None:
        """FLOP/s of the reduced run's GEMMs at the measured token count nearest to ``tokens`` (None: none)."""
        if not self.reduced_tflops:
            return None
        return min(self.reduced_tflops, key=lambda item: abs(math.log(item[0] / max(tokens, 1))))[1] * 1e12


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` GPUs of one kind, with the planner's allowances: ``mfu`` (the share of the
    peak FLOP/s a training step reaches), ``reserve_gib`` (what the CUDA context, NCCL and the caching allocator's
    own bookkeeping take outside tensors) and ``margin`` (the share of the rest kept free for fragmentation)."""

    gpu: GPU
    gpus_per_node: int = 8
    nodes: int = 1
    mfu: float = 0.3
    reserve_gib: float = 2.0
    margin: float = 0.1
    calibration: Calibration | None = field(default=None, compare=False)  # from a cluster file (fcsd bench cluster)

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def budget(self) -> int:
        """Bytes of tensors a GPU can hold in a plan that fits: memory less the reserve, less the margin."""
        return int((self.gpu.memory_gib - self.reserve_gib) * (1 - self.margin) * GIB)

    @property
    def host_budget(self) -> int:
        """Bytes of a node's host memory a plan may pin (:data:`HOST_SHARE` of it)."""
        return int(self.gpu.host_gib * HOST_SHARE * GIB)

    def with_nodes(self, nodes: int) -> Cluster:
        return replace(self, nodes=nodes)

    @property
    def overlap(self) -> float:
        """The share of a collective's time that can hide behind compute beside it: measured in a cluster file,
        1 (all of it, the presets' assumption) otherwise."""
        return self.calibration.overlap if self.calibration is not None else 1.0

    def expert_rate(self, ep: int) -> float:
        """FLOP/s the routed experts' GEMMs run at on a rank of EP ``ep``: the grouped-GEMM rate a cluster file
        measured (:meth:`Calibration.expert_rate`), else the GEMM rate (``peak x mfu``)."""
        measured = self.calibration.expert_rate(ep) if self.calibration is not None else None
        return measured if measured is not None else self.gpu.tflops * self.mfu * 1e12

    def bandwidth(self, ranks: int) -> float:
        """Bus bandwidth (GB/s) of a collective over ``ranks`` consecutive GPUs: inside a node, or between nodes."""
        return self.gpu.intra_gbps if ranks <= self.gpus_per_node else self.gpu.inter_gbps

    def describe(self) -> str:
        g = self.gpu
        budget = f"({g.memory_gib:g} - {self.reserve_gib:g} GiB reserve) x {1 - self.margin:.0%}"
        rate = f"{g.tflops:g} TFLOP/s bf16"
        if self.calibration is not None:
            rate = f"{g.tflops * self.mfu:.3g} TFLOP/s measured at the model's GEMMs"
        return (
            f"{self.nodes} x {self.gpus_per_node} {g.name} ({g.memory_gib:g} GiB, {rate}, "
            f"{g.intra_gbps:g} GB/s in a node, {g.inter_gbps:g} GB/s between nodes); fits = peak <= {budget} = "
            f"{self.budget / GIB:.1f} GiB"
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "gpus": self.gpus, "budget_bytes": self.budget}


def parse_memory(text: str, option: str = "--gpu-memory") -> float:
    """``80GB`` / ``80GiB`` / ``80`` (GiB) / ``81920MiB`` / ``2TiB`` -> GiB. GB are 10^9 bytes, GiB 2^30."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?[bB])?\s*", str(text))
    if not found:
        raise ValueError(f"{option} {text!r}: give a size such as 80GB, 141GiB, 2TiB or 80 (GiB)")
    value, unit = float(found.group(1)), (found.group(2) or "GiB").lower()
    power = "kmgt".index(unit[0]) + 1
    size = value * (1024**power if "i" in unit else 1000**power) / GIB
    if size <= 0:
        raise ValueError(f"{option} {text!r}: it must be more than 0")
    return size


def make_cluster(
    gpu: str = "h100",
    gpus_per_node: int = 8,
    nodes: int = 1,
    gpu_memory: str | None = None,
    gpu_tflops: float | None = None,
    intra_gbps: float | None = None,
    inter_gbps: float | None = None,
    mfu: float = 0.3,
    margin: float = 0.1,
    host_gbps: float | None = None,
    host_memory: str | None = None,
) -> Cluster:
    """A :class:`Cluster` from the command line's options, with one-line errors for impossible values."""
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is not a preset: choose one of {', '.join(GPUS)} (and --gpu-memory to adjust)")
    if gpus_per_node < 1 or nodes < 1 or gpus_per_node * nodes > MAX_GPUS:
        raise ValueError(
            f"--gpus-per-node {gpus_per_node} --nodes {nodes}: a cluster holds 1 to {MAX_GPUS:,} GPUs, at least one "
            "node of one GPU"
        )
    if not 0 < mfu <= 1:
        raise ValueError(f"--mfu {mfu}: the share of peak FLOP/s a step reaches lies in (0, 1], e.g. 0.3")
    if not 0 <= margin < 1:
        raise ValueError(f"--margin {margin}: the share of memory kept free lies in [0, 1), e.g. 0.1")
    base = GPUS[gpu]
    changes = {
        "memory_gib": parse_memory(gpu_memory) if gpu_memory else None,
        "tflops": gpu_tflops,
        "intra_gbps": intra_gbps,
        "inter_gbps": inter_gbps,
        "host_gbps": host_gbps,
        "host_gib": parse_memory(host_memory, "--host-memory") if host_memory else None,
    }
    options = {"memory_gib": "--gpu-memory", "tflops": "--gpu-tflops", "host_gib": "--host-memory"}
    for key, value in changes.items():
        if value is not None and not positive_number(value):  # NaN compared false: it planned a NaN step time
            flag = options.get(key, "--" + key.replace("_", "-"))
            raise ValueError(f"{flag} {value}: it must be a finite number > 0")
    chosen = replace(base, **{k: v for k, v in changes.items() if v is not None})
    cluster = Cluster(chosen, gpus_per_node, nodes, mfu, margin=margin)
    if chosen.memory_gib <= cluster.reserve_gib:
        raise ValueError(
            f"--gpu-memory {gpu_memory}: {chosen.memory_gib:.2f} GiB is not more than the {cluster.reserve_gib:g} GiB "
            "a GPU keeps for the CUDA context, NCCL and the allocator; give the GPU's whole memory, e.g. 80GiB"
        )
    return cluster


# -- cluster files (fcsd bench cluster writes them, fcsd plan --cluster reads them) ---------------------------------

REMEASURE = "measure it again: `fcsd bench cluster --model MODEL --out FILE` (under torchrun for several processes)"
NUMBERS = ("gpu_memory_gib", "host_memory_gib", "tflops", "intra_gbps", "inter_gbps", "host_gbps")
COUNTS = ("nodes", "gpus_per_node")
MAX_GPUS = 2**17  # the largest cluster fcsd plans for (its searches grow with the GPU count)
OPTIONAL = ("alltoall_intra_gbps", "alltoall_inter_gbps")  # null where not measured
REQUIRED = (*COUNTS, *NUMBERS, "op_us", "memory_gbps", "latency_us", "reduced_tflops")  # besides format, version
TEXTS = ("name", "device", "backend", "model")
FIGURES = (*NUMBERS, *OPTIONAL, "op_us", "memory_gbps")  # what "assumed" may name


def write_cluster_file(path, data: dict) -> Path:
    """Write the cluster file ``data`` (checked first: :func:`check_cluster_data`) to ``path`` atomically
    (:func:`fcsd.files.staging.atomic_file`: a reader never sees half a file)."""
    from fcsd.files.staging import atomic_file

    check_cluster_data(data, str(path))
    path = Path(path).expanduser()
    with atomic_file(path) as temporary:
        temporary.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    return path


def is_cluster_file(path) -> bool:
    """Whether ``path`` is a cluster file fcsd wrote (what ``fcsd bench cluster --out`` may replace)."""
    try:
        read_cluster_file(path)
    except (ValueError, OSError):
        return False
    return True


def read_cluster_file(path) -> dict:
    """The checked contents of the cluster file ``path`` (one-line ``ValueError`` naming the problem and the fix)."""
    where = f"--cluster {path}"
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"{where}: no such file; write one with `fcsd bench cluster --model MODEL --out {path}`")
    try:
        data = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{where}: not JSON ({error}); {REMEASURE}") from None
    check_cluster_data(data, str(path))
    return data


def check_cluster_data(data, path: str = "FILE") -> None:
    """Refuse, in one line naming the field and the fix, a cluster file's contents that ``fcsd plan`` cannot use."""
    where = f"--cluster {path}"
    if not isinstance(data, dict) or data.get("format") != CLUSTER_FORMAT:
        raise ValueError(f'{where}: not a cluster file (no "format": "{CLUSTER_FORMAT}"); {REMEASURE}')
    version = data.get("version")
    if not isinstance(version, int) or version > CLUSTER_VERSION or version < 1:
        raise ValueError(
            f"{where}: cluster file version {version!r}, this fcsd reads version {CLUSTER_VERSION}; upgrade fcsd or "
            + REMEASURE
        )
    missing = [key for key in REQUIRED if key not in data]
    if missing:
        names = ", ".join(repr(key) for key in missing)
        raise ValueError(
            f"{where}: the field{'s' if len(missing) > 1 else ''} {names} "
            f"{'are' if len(missing) > 1 else 'is'} missing; {REMEASURE}"
        )
    for key, value, problem in _field_problems(data):
        raise ValueError(f"{where}: {key} is {value!r}, {problem}; {REMEASURE}")


def _field_problems(data: dict):
    """``(field, value, what it should be)`` for each field of ``data`` of the wrong type or range (absent optional
    ones pass), in the file's schema order."""
    for key in COUNTS:
        if not _whole(data[key], 1):
            yield key, data.get(key), "not a whole number of at least 1"
    if all(_whole(data[key], 1) for key in COUNTS) and data["nodes"] * data["gpus_per_node"] > MAX_GPUS:
        yield "nodes", data["nodes"], f"more than {MAX_GPUS:,} GPUs in all with gpus_per_node {data['gpus_per_node']}"
    for key in NUMBERS + ("memory_gbps",):
        if not positive_number(data[key]):
            yield key, data.get(key), "not a number above 0"
    if not (positive_number(data["op_us"]) or data["op_us"] == 0) or isinstance(data["op_us"], bool):
        yield "op_us", data.get("op_us"), "not a number of at least 0 (microseconds)"
    for key in OPTIONAL:
        if data.get(key) is not None and not positive_number(data[key]):
            yield key, data.get(key), "not a number above 0 (or null: not measured)"
    for key in TEXTS:
        if key in data and not isinstance(data[key], str):
            yield key, data.get(key), "not a text"
    if "threads" in data and not _whole(data["threads"], 1):
        yield "threads", data.get("threads"), "not a whole number of at least 1 (torch's threads per process)"
    overlap = data.get("overlap", 1.0)
    if not isinstance(overlap, (int, float)) or isinstance(overlap, bool) or not 0 <= overlap <= 1:
        yield "overlap", data.get("overlap"), "not a share between 0 and 1"
    assumed = data.get("assumed", [])
    if not isinstance(assumed, list) or not all(isinstance(name, str) and name in FIGURES for name in assumed):
        yield "assumed", data.get("assumed"), f"not a list of the file's figures (of {', '.join(FIGURES)})"
    capability = data.get("compute_capability")
    if capability is not None and not (
        isinstance(capability, list) and len(capability) == 2 and all(_whole(part, 0) for part in capability)
    ):
        yield (
            "compute_capability",
            data.get("compute_capability"),
            "not CUDA's [major, minor] such as [9, 0] (or null: none known)",
        )
    latency = data["latency_us"]
    if not isinstance(latency, dict) or any(kind not in COLLECTIVES for kind in latency):
        yield "latency_us", data.get("latency_us"), f"not a map of {', '.join(COLLECTIVES)} to {{ranks: us}}"
    else:
        for kind, sizes in latency.items():
            if not isinstance(sizes, dict) or not all(
                str(n).isdigit() and positive_number(us) for n, us in sizes.items()
            ):
                yield f"latency_us.{kind}", sizes, "not {ranks: microseconds}"
    reduced = data["reduced_tflops"]
    if not isinstance(reduced, dict) or not all(str(n).isdigit() and positive_number(v) for n, v in reduced.items()):
        yield "reduced_tflops", data.get("reduced_tflops"), "not {tokens: TFLOP/s}"
    if not _rates(data.get("expert_tflops", {})):
        yield "expert_tflops", data.get("expert_tflops"), "not {ep: TFLOP/s}"
    reduced = data.get("reduced_expert_tflops", {})
    if not isinstance(reduced, dict) or not all(str(n).isdigit() and _rates(v) for n, v in reduced.items()):
        yield "reduced_expert_tflops", data.get("reduced_expert_tflops"), "not {tokens: {ep: TFLOP/s}}"
    if not isinstance(data.get("measurements", {}), dict):
        yield "measurements", data.get("measurements"), "not a map of the raw tables"


def _whole(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _rates(value) -> bool:
    """``{whole number: TFLOP/s}`` with every rate a positive number."""
    if not isinstance(value, dict):
        return False
    return all(str(n).isdigit() and int(n) > 0 and positive_number(v) for n, v in value.items())


def positive_number(value) -> bool:
    """A real number (not a bool), finite and > 0: NaN compares false both ways, so `<= 0` lets it through."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def cluster_from_data(data: dict, margin: float = 0.1) -> Cluster:
    """The :class:`Cluster` a checked cluster file describes: its memory, its measured GEMM rate as the effective
    FLOP/s (``mfu`` 1), its bandwidths, and the :class:`Calibration` beside them."""
    gpu = GPU(
        str(data.get("name") or data.get("device") or "measured"),
        float(data["gpu_memory_gib"]),
        float(data["tflops"]),
        float(data["intra_gbps"]),
        float(data["inter_gbps"]),
        float(data["host_gbps"]),
        float(data["host_memory_gib"]),
        compute_capability=tuple(data["compute_capability"]) if data.get("compute_capability") else None,
    )
    latency = tuple(
        (kind, int(n), float(us)) for kind, sizes in data.get("latency_us", {}).items() for n, us in sizes.items()
    )
    calibration = Calibration(
        op_us=float(data.get("op_us", 0.0)),
        memory_gbps=data.get("memory_gbps"),
        latency_us=latency,
        alltoall_intra_gbps=data.get("alltoall_intra_gbps"),
        alltoall_inter_gbps=data.get("alltoall_inter_gbps"),
        reduced_tflops=tuple(sorted((int(n), float(v)) for n, v in data.get("reduced_tflops", {}).items())),
        device=str(data.get("device", "")),
        backend=str(data.get("backend", "")),
        threads=int(data.get("threads", 0) or 0),
        model=str(data.get("model", "")),
        assumed=tuple(data.get("assumed", ())),
        overlap=float(data.get("overlap", 1.0)),
        expert_tflops=tuple(sorted((int(ep), float(v)) for ep, v in data.get("expert_tflops", {}).items())),
        reduced_expert_tflops=tuple(
            sorted(
                (int(t), int(ep), float(v))
                for t, sizes in data.get("reduced_expert_tflops", {}).items()
                for ep, v in sizes.items()
            )
        ),
    )
    return Cluster(gpu, data["gpus_per_node"], data["nodes"], 1.0, margin=margin, calibration=calibration)


def load_cluster_file(path, margin: float = 0.1, **changes) -> Cluster:
    """``fcsd plan --cluster FILE``: the measured :class:`Cluster` of the file ``path``; ``changes`` (the plan's
    options given beside it: ``gpus_per_node``, ``nodes``, ``gpu_memory``, ``intra_gbps``, ``inter_gbps``,
    ``host_gbps``, ``host_memory``; None: the file's) override its figures, checked as :func:`make_cluster` checks
    them."""
    cluster = cluster_from_data(read_cluster_file(path), margin)
    if not 0 <= margin < 1:
        raise ValueError(f"--margin {margin}: the share of memory kept free lies in [0, 1), e.g. 0.1")
    layout = {k: changes.pop(k) for k in ("gpus_per_node", "nodes") if changes.get(k) is not None}
    for key, value in layout.items():
        if value < 1:
            raise ValueError(f"--{key.replace('_', '-')} {value}: a cluster needs at least one node of one GPU")
    gpu = {}
    for key, value in changes.items():
        if value is None:
            continue
        if key in ("gpu_memory", "host_memory"):
            gpu["memory_gib" if key == "gpu_memory" else "host_gib"] = parse_memory(value, "--" + key.replace("_", "-"))
        elif not positive_number(value):
            raise ValueError(f"--{key.replace('_', '-')} {value}: it must be a finite number > 0")
        else:
            gpu[key] = value
    cluster = replace(cluster, gpu=replace(cluster.gpu, **gpu), **layout)
    if cluster.gpu.memory_gib <= cluster.reserve_gib:
        raise ValueError(
            f"--cluster {path}: {cluster.gpu.memory_gib:.2f} GiB per GPU is not more than the {cluster.reserve_gib:g} "
            "GiB a GPU keeps for the CUDA context, NCCL and the allocator; give the GPU's memory with --gpu-memory"
        )
    return cluster
