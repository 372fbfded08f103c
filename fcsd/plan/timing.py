"""How long a plan trains, and what FarSkip saves on a cluster (paper Sec. 4.1 / Eq. 9, Appendix B).

A training step's time per GPU is its FLOPs (counted through the real step by :mod:`fcsd.plan.simulate`: student
forward and backward, recomputation under checkpointing, the loss, the online teacher's forward) at ``mfu`` of the
GPU's peak, plus the communication the step cannot hide:

- expert parallelism: each MoE layer's Dispatch and Combine all-to-alls (``tokens x top_k x hidden`` bf16 each), in
  forward and in backward; a FarSkip layer hides them behind Eq. 9's window ``T_layer - T_routed - T_gate`` (twice
  the window in backward), a regular layer exposes them, and so does the online teacher (regular, forward only);
  then the data-parallel all-reduce of the fp32 gradients (non-expert weights over every GPU, experts over their
  replicas), after the backward;
- FSDP2 (alone, or under EP x FSDP2 where the routed experts' shards are FSDP2-sharded over their ``W / P``
  replicas and the rest over all ``W`` GPUs): per micro-batch the all-gathers of the bf16 weights (forward, and
  again in backward: every unit reshards after forward), the fp32 reduce-scatter of the gradients and the online
  teacher's all-gathers (forward only), each over its group's bandwidth (consecutive ranks inside a node, the
  replicas of an expert shard ``P`` apart), prefetched behind the compute (only what exceeds it is exposed); EP x
  FSDP2 adds the expert-parallel all-to-alls above;
- DDP: the fp32 gradient all-reduce, overlapped with the backward;
- ``train.checkpoint_offload``: each micro-batch's replayed rows go to host memory during its forward (a side
  stream: hidden behind the forward, a quarter of a checkpointed micro-batch's compute, up to its length) and come
  back when each layer is recomputed (exposed: nothing prefetches them), over the host link (``host_gbps``).

Per-layer compute times come from :func:`fcsd.perfmodel.prefill_layer_times` at ``peak x mfu``, bandwidths from the
cluster (inside a node, or between nodes once a group spans several).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fcsd import perfmodel as pm
from fcsd.plan.cluster import Cluster


def hardware(cluster: Cluster, ranks: int) -> pm.Hardware:
    """The perfmodel's accelerator for ``ranks`` GPUs of ``cluster``: every GEMM and attention at ``peak x mfu``;
    all-to-all at 5/6 of the all-reduce bus bandwidth (perfmodel's 300 vs 400 GB/s)."""
    rate = cluster.gpu.tflops * cluster.mfu
    bandwidth = cluster.bandwidth(ranks)
    return pm.Hardware(rate, rate, bandwidth, bandwidth * 5 / 6)


def _moe_layers(shape: pm.ModelShape) -> list[int]:
    return [i for i, layer in enumerate(shape.layers) if layer.moe]


def ep_exposure(
    shape: pm.ModelShape, converted: set[int], tokens: int, seq_len: int, ep: int, hw: pm.Hardware, teacher: bool
) -> float:
    """Seconds of all-to-all a training step of ``tokens`` tokens per GPU exposes under expert parallelism over
    ``ep`` GPUs (Eq. 9 for the FarSkip layers ``converted``; everything for the others and the teacher)."""
    if ep <= 1:
        return 0.0
    exposed = 0.0
    for index in _moe_layers(shape):
        layer = shape.layers[index]
        times = pm.prefill_layer_times(shape, layer, max(1, tokens // seq_len), seq_len, 1, 1, hw)
        a2a = 2 * pm.alltoall_s(tokens * shape.top_k * shape.hidden * 2, ep, hw)
        if index in converted:
            window = times.compute - times.routed - times.gate
            exposed += max(0.0, a2a - window) + max(0.0, a2a - 2 * window)
        else:
            exposed += 2 * a2a
        if teacher:
            exposed += a2a
    return exposed


def training_speedup(
    shape: pm.ModelShape, converted: set[int], tokens: int, seq_len: int, ep: int, hw: pm.Hardware
) -> float:
    """Step time with every layer regular over step time with ``converted`` FarSkip layers, for the student's
    forward and backward under expert parallelism over ``ep`` GPUs (Sec. 4.1, Eq. 9; the teacher and the loss,
    the same either way, left out)."""
    compute = 0.0
    for layer in shape.layers:
        compute += 3 * pm.prefill_layer_times(shape, layer, max(1, tokens // seq_len), seq_len, 1, 1, hw).compute
    regular = compute + ep_exposure(shape, set(), tokens, seq_len, ep, hw, teacher=False)
    farskip = compute + ep_exposure(shape, converted, tokens, seq_len, ep, hw, teacher=False)
    return regular / farskip


def prefill_speedup(shape: pm.ModelShape, converted: set[int], cluster: Cluster, batch: int, context: int) -> float:
    """Appendix B's prefill model on one node of the cluster (TP = EP = GPUs per node), regular over FarSkip on the
    layers ``converted`` (the others, and dense layers, stay regular)."""
    ranks = cluster.gpus_per_node
    hw = hardware(cluster, ranks)
    times = [pm.prefill_layer_times(shape, layer, batch, context, ranks, ranks, hw) for layer in shape.layers]
    regular = sum(t.regular for t in times)
    farskip = sum(t.farskip if i in converted else t.regular for i, t in enumerate(times))
    return regular / farskip


@dataclass
class StepTime:
    compute_s: float
    exposed_comm_s: float
    tokens_per_gpu: int
    processes: int

    @property
    def seconds(self) -> float:
        return self.compute_s + self.exposed_comm_s

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of the whole cluster."""
        return 0.0 if self.seconds == 0 else self.tokens_per_gpu * self.processes / self.seconds

    def to_dict(self) -> dict:
        return {**asdict(self), "step_s": self.seconds}


def gather_seconds(layout, counts, cluster: Cluster, accumulation: int) -> float:
    """Seconds of FSDP2 collectives one GPU makes per optimizer step under ``layout`` (``ep_fsdp`` or ``fsdp2``; see
    the module docstring): ring collectives moving ``(n-1)/n`` of the gathered (reduced) bytes of each group."""
    processes, ep = layout.processes, layout.ep_size
    teacher = layout.teacher == "online"
    groups = [(counts.total - counts.experts, processes, hardware(cluster, processes))]  # the dense mesh
    efsdp = processes // ep
    if efsdp > 1:  # the replicas of one expert shard: ranks ep apart, in other nodes once ep x efsdp spans several
        spread = processes if processes > cluster.gpus_per_node else efsdp
        groups.append((counts.experts // ep, efsdp, hardware(cluster, spread)))
    seconds = 0.0
    for parameters, ranks, hw in groups:
        if ranks <= 1:
            continue
        moved = (2 * 2 + 4 + (2 if teacher else 0)) * parameters  # bf16 gathers fwd + bwd, fp32 reduce, teacher
        seconds += moved * (ranks - 1) / ranks / (hw.allreduce_gbps * 1e9)
    return accumulation * seconds


def step_time(
    estimate, shape: pm.ModelShape, converted: set[int], cluster: Cluster, batch_tokens: int, seq_len: int, counts
):
    """:class:`StepTime` of one optimizer step (``batch_tokens`` over the cluster) of the simulated candidate;
    ``counts``: the model's :class:`fcsd.plan.candidates.Counts` (what FSDP2 gathers)."""
    layout = estimate.layout
    processes = layout.processes
    tokens = batch_tokens // processes  # per GPU and step
    flops_per_token = sum(estimate.flops.values()) / estimate.tokens
    compute = tokens * flops_per_token / (cluster.gpu.tflops * cluster.mfu * 1e12)
    exposed = 0.0
    grad_bytes = estimate.gradients  # fp32 gradients held by this GPU
    if layout.ep_size > 1:
        hw = hardware(cluster, layout.ep_size)
        exposed += ep_exposure(shape, converted, tokens, seq_len, layout.ep_size, hw, layout.teacher == "online")
    if layout.strategy == "ep":
        exposed += pm.allreduce_s(grad_bytes, processes, hardware(cluster, processes))
    elif layout.strategy in ("ep_fsdp", "fsdp2"):
        exposed += max(0.0, gather_seconds(layout, counts, cluster, estimate.accumulation) - compute)
    elif layout.strategy == "ddp":
        comm = pm.allreduce_s(grad_bytes, processes, hardware(cluster, processes))
        exposed += max(0.0, comm - compute * 2 / 3)  # overlapped with the backward (two thirds of the compute)
    if layout.offload:
        exposed += estimate.accumulation * offload_exposure(estimate.host, compute / estimate.accumulation, cluster)
    return StepTime(compute, exposed, tokens, processes)


def offload_exposure(host_bytes: int, micro_batch_compute: float, cluster: Cluster) -> float:
    """Seconds a checkpointed micro-batch of ``micro_batch_compute`` seconds waits for ``host_bytes`` of replayed
    rows going to host memory and back (see the module docstring)."""
    copy = host_bytes / (cluster.gpu.host_gbps * 1e9)
    return max(0.0, copy - micro_batch_compute / 4) + copy
