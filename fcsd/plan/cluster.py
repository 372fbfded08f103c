"""The cluster a plan is made for: GPU presets (memory, peak bf16 FLOP/s, link bandwidths), overridable.

Memory is what the driver reports for the whole GPU (H100 SXM 80 GB: 79.6 GiB; H200: 139.8 GiB; MI300X: 192 GiB).
Peak FLOP/s are the vendors' dense bf16 figures (no sparsity). Bandwidths are *bus* bandwidths in NCCL's convention
(as :mod:`fcsd.perfmodel` uses them), i.e. what ``nccl-tests`` report, not the links' nominal sum: inside a node
NVLink 4 (900 GB/s bidirectional per GPU) gives about 360 GB/s for an all-reduce and 300 GB/s for an all-to-all
(MI300X's Infinity Fabric a little less), between nodes one 400 Gb/s NIC per GPU gives about 45 GB/s. These are the
planner's stated assumptions, not measurements: override them with ``--intra-gbps`` / ``--inter-gbps`` (and
``--gpu-memory``, ``--gpu-tflops``) for your cluster. The host link (what ``train.checkpoint_offload`` copies over)
is a PCIe Gen5 x16 per GPU, shared with its neighbour behind one switch as in DGX/HGX nodes: about 25 GB/s each way
per GPU while all copy (``--host-gbps``); a node has 2 TiB of host memory, of which a plan pins at most half
(``--host-memory``).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace

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


GPUS = {
    "h100": GPU("H100 SXM 80GB", 79.6, 989.0, 360.0, 45.0),
    "h200": GPU("H200 141GB", 139.8, 989.0, 360.0, 45.0),
    "mi300x": GPU("MI300X 192GB", 192.0, 1307.0, 300.0, 45.0),
}
HOST_SHARE = 0.5  # of a node's host memory, what a plan may pin (the rest: the OS, data loading, the page cache)


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

    def bandwidth(self, ranks: int) -> float:
        """Bus bandwidth (GB/s) of a collective over ``ranks`` consecutive GPUs: inside a node, or between nodes."""
        return self.gpu.intra_gbps if ranks <= self.gpus_per_node else self.gpu.inter_gbps

    def describe(self) -> str:
        g = self.gpu
        budget = f"({g.memory_gib:g} - {self.reserve_gib:g} GiB reserve) x {1 - self.margin:.0%}"
        return (
            f"{self.nodes} x {self.gpus_per_node} {g.name} ({g.memory_gib:g} GiB, {g.tflops:g} TFLOP/s bf16, "
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
    if gpus_per_node < 1 or nodes < 1:
        raise ValueError(
            f"--gpus-per-node {gpus_per_node} --nodes {nodes}: a cluster needs at least one node of one GPU"
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
        if value is not None and value <= 0:
            raise ValueError(f"{options.get(key, '--' + key.replace('_', '-'))} {value}: it must be more than 0")
    chosen = replace(base, **{k: v for k, v in changes.items() if v is not None})
    cluster = Cluster(chosen, gpus_per_node, nodes, mfu, margin=margin)
    if chosen.memory_gib <= cluster.reserve_gib:
        raise ValueError(
            f"--gpu-memory {gpu_memory}: {chosen.memory_gib:.2f} GiB is not more than the {cluster.reserve_gib:g} GiB "
            "a GPU keeps for the CUDA context, NCCL and the allocator; give the GPU's whole memory, e.g. 80GiB"
        )
    return cluster
