"""How long a plan trains, where the time goes, and what FarSkip saves on a cluster (paper Sec. 4.1 / Eq. 9,
Appendix B).

A training step's time per GPU is its FLOPs (counted through the real step by :mod:`fcsd.plan.simulate`: student
forward and backward, recomputation under checkpointing, the loss, the online teacher's forward) at ``mfu`` of the
GPU's peak (with a cluster file: the measured GEMM rate, and the routed experts' grouped GEMMs at the rate measured
for the layout's EP size, :meth:`~fcsd.plan.cluster.Cluster.expert_rate`), plus the communication the step cannot
hide (:class:`StepTime` keeps each part):

- expert parallelism over ``P`` GPUs (:func:`exchange`), each MoE layer's Dispatch and Combine, forward and backward.
  Inside a node (``P`` at most the GPUs of a node: the plain dispatcher) one all-to-all each of ``tokens x top_k``
  rows of ``hidden`` bf16 values. Across nodes (``P`` a multiple of the node: the node-aware ``hierarchical``
  dispatcher) a token's rows for one remote node cross the node boundary once: one row of ``hidden`` bf16 values
  plus an fp32 (weight, expert id) pair per (token, expert) there, per (token, destination node), at the inter-node
  bandwidth; then they fan out inside the destination node, one row per (token, destination GPU) with its pairs, at
  the intra-node bandwidth; the Combine sums inside the node and crosses back once per (token, node). How many
  nodes and GPUs a token reaches comes from the routing (:mod:`fcsd.plan.routing`: uniform top-k, or DeepSeek-V3's
  group-limited routing). The asynchronous part (the node-crossing hop; the whole all-to-all inside a node) hides
  in a FarSkip layer behind Eq. 9's window ``T_layer - T_routed - T_gate`` (twice the window in backward); the
  fan-out inside the node is issued at the wait and is exposed; a regular layer exposes everything, and so does the
  online teacher (regular, forward only). Activation checkpointing replays the exchanges' saved rows (never issues
  them again);
- FSDP2 (alone, or under EP x FSDP2 where the routed experts' shards are FSDP2-sharded over their ``W / P``
  replicas and the rest over all ``W`` GPUs): per micro-batch the all-gathers of the bf16 weights (forward, and
  again in backward: every unit reshards after forward), the fp32 reduce-scatter of the gradients and the online
  teacher's all-gathers (forward only), each over its group's bandwidth (consecutive ranks inside a node, the
  replicas of an expert shard ``P`` apart: across nodes once the GPUs span several), prefetched behind the compute;
  only what exceeds it is exposed, and a group crossing nodes shares the NICs with the hidden all-to-alls across
  nodes (their time is taken from what can hide the gathers);
- DP all-reduce: expert parallelism with the rest replicated all-reduces the fp32 gradients after the backward
  (exposed); DDP overlaps its all-reduce with the backward;
- ``train.checkpoint_offload``: each micro-batch's replayed rows go to host memory during its forward (a side
  stream: hidden behind the forward, a quarter of a checkpointed micro-batch's compute, up to its length) and come
  back prefetched (a layer's rows while the backward recomputes the layer after it: hidden behind a layer's share
  of the backward, except the first layer's), over the host link (``host_gbps``); under the node-aware dispatcher
  the rows are its own (:func:`replay_scale`).

Each "hidden behind the compute" above hides :attr:`~fcsd.plan.cluster.Cluster.overlap` of it: all of it on the
presets' GPUs, the measured share with a cluster file (on a CPU whose every core computes, about none: a collective's
copies there take the cores the compute runs on).

Per-layer compute times come from :func:`fcsd.plan.perfmodel.prefill_layer_times` at ``peak x mfu``, bandwidths from the
cluster: bus bandwidths, an all-to-all at 5/6 of them (perfmodel's 300 vs 400 GB/s). Model FLOPs utilisation
(:func:`model_flops_per_token`) counts ``6 x active parameters`` per token for the student and ``2 x active`` for
an online teacher's forward (active: what a token passes through, its ``top_k`` routed experts, the output head;
not the input embedding, a lookup; attention's score FLOPs left out, the usual ``6N`` convention).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fcsd.plan import perfmodel as pm
from fcsd.plan.cluster import Cluster

ROW_BYTES = 2  # bf16 hidden values on the wire
PAIR_BYTES = 8  # fp32 weight + expert id per (token, expert) beside a hierarchical row
A2A_SHARE = 5 / 6  # all-to-all bandwidth over the all-reduce bus bandwidth


def hardware(cluster: Cluster, ranks: int) -> pm.Hardware:
    """The perfmodel's accelerator for ``ranks`` GPUs of ``cluster``: every GEMM and attention at ``peak x mfu``;
    all-to-all at 5/6 of the all-reduce bus bandwidth (perfmodel's 300 vs 400 GB/s)."""
    rate = cluster.gpu.tflops * cluster.mfu
    bandwidth = cluster.bandwidth(ranks)
    return pm.Hardware(rate, rate, bandwidth, bandwidth * A2A_SHARE)


def dispatcher_for(ep: int, gpus_per_node: int) -> str:
    """The dispatcher a plan runs EP over ``ep`` GPUs with: ``hierarchical`` once the group spans nodes, else
    ``plain``."""
    return "hierarchical" if ep > gpus_per_node else "plain"


@dataclass(frozen=True)
class Exchange:
    """Seconds of one MoE layer's Dispatch + Combine in one direction (forward; the backward's are the same):
    ``hideable`` (asynchronous: the FarSkip window may hide it), ``exposed`` (done at the wait), and which link
    carries the hideable part (``inter``: between nodes)."""

    hideable: float
    exposed: float = 0.0
    inter: bool = False


def exchange(
    shape: pm.ModelShape, tokens: int, ep: int, cluster: Cluster, reach=None, dispatcher: str = ""
) -> Exchange:
    """One MoE layer's Dispatch + Combine for ``tokens`` tokens per GPU under EP over ``ep`` GPUs of ``cluster``
    (see the module docstring). ``reach``: :func:`fcsd.plan.routing.reach` of the layout (needed across nodes);
    ``dispatcher``: ``plain`` or ``hierarchical`` (default: :func:`dispatcher_for`)."""
    node = cluster.gpus_per_node
    dispatcher = dispatcher or dispatcher_for(ep, node)
    row = shape.hidden * ROW_BYTES
    intra_bw = cluster.gpu.intra_gbps * A2A_SHARE * 1e9
    inter_bw = cluster.gpu.inter_gbps * A2A_SHARE * 1e9
    if ep <= 1:
        return Exchange(0.0)
    if ep <= node:  # one node: an all-to-all of every (token, expert) row
        return Exchange(2 * pm.alltoall_s(tokens * shape.top_k * row, ep, hardware(cluster, ep)))
    if reach is None:
        from fcsd.plan.routing import reach as routing_reach

        reach = routing_reach(shape.num_experts, shape.top_k, ep, node)
    if dispatcher == "plain":  # one row per (token, expert): to remote nodes and to the node's other GPUs at once
        inter = 2 * tokens * reach.remote_pairs * row / inter_bw
        intra = 2 * tokens * reach.node_local_pairs * row / intra_bw
        return Exchange(max(inter, intra), inter=True)
    crossing = tokens * (2 * reach.remote_nodes * row + reach.remote_pairs * PAIR_BYTES) / inter_bw
    fan_out = tokens * (2 * reach.fan_out_rows * row + reach.fan_out_pairs * PAIR_BYTES) / intra_bw
    return Exchange(crossing, fan_out, inter=True)


def _moe_layers(shape: pm.ModelShape) -> list[int]:
    return [i for i, layer in enumerate(shape.layers) if layer.moe]


@dataclass
class Exposure:
    """Seconds of all-to-all a step exposes, by link, and the hideable seconds across nodes it hid (they occupy the
    NICs that FSDP2's gathers across nodes also need)."""

    intra: float = 0.0
    inter: float = 0.0
    hidden_inter: float = 0.0

    @property
    def total(self) -> float:
        return self.intra + self.inter


def ep_breakdown(
    shape: pm.ModelShape,
    converted: set[int],
    tokens: int,
    seq_len: int,
    ep: int,
    cluster: Cluster,
    teacher: bool,
    reach=None,
    dispatcher: str = "",
) -> Exposure:
    """The :class:`Exposure` of a training step of ``tokens`` tokens per GPU under EP over ``ep`` GPUs (Eq. 9 for the
    FarSkip layers ``converted``; everything for the others and the teacher)."""
    found = Exposure()
    if ep <= 1:
        return found
    hw = hardware(cluster, 1)
    one = exchange(shape, tokens, ep, cluster, reach, dispatcher)
    for index in _moe_layers(shape):
        layer = shape.layers[index]
        times = pm.prefill_layer_times(shape, layer, max(1, tokens // seq_len), seq_len, 1, 1, hw)
        passes = 2 + (1 if teacher else 0)  # forward, backward, the teacher's forward
        if index in converted:
            window = (times.compute - times.routed - times.gate) * cluster.overlap
            shown = max(0.0, one.hideable - window) + max(0.0, one.hideable - 2 * window)
            shown += one.hideable if teacher else 0.0
        else:
            shown = passes * one.hideable
        found.intra += passes * one.exposed
        if one.inter:
            found.inter += shown
            found.hidden_inter += passes * one.hideable - shown
        else:
            found.intra += shown
    return found


def ep_exposure(
    shape: pm.ModelShape,
    converted: set[int],
    tokens: int,
    seq_len: int,
    ep: int,
    hw: pm.Hardware,
    teacher: bool,
    cluster: Cluster | None = None,
    reach=None,
) -> float:
    """Seconds of all-to-all a training step of ``tokens`` tokens per GPU exposes under expert parallelism over
    ``ep`` GPUs (Eq. 9 for the FarSkip layers ``converted``; everything for the others and the teacher). Without
    ``cluster``: one all-to-all group at ``hw``'s bandwidth (the layer table's one-node estimate)."""
    if cluster is not None:
        return ep_breakdown(shape, converted, tokens, seq_len, ep, cluster, teacher, reach).total
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
    """One optimizer step per GPU: ``compute_s`` and the communication it exposes (``exposed_comm_s``, the sum of
    the parts: all-to-all inside and across nodes, FSDP2's collectives, the DP all-reduce, the host copies),
    ``tokens_per_gpu`` per step on each of ``processes`` GPUs, the ``dispatcher`` EP runs with, and the model FLOPs
    per GPU and step with the GPU's peak (for :attr:`mfu`)."""

    compute_s: float
    exposed_comm_s: float
    tokens_per_gpu: int
    processes: int
    a2a_intra_s: float = 0.0
    a2a_inter_s: float = 0.0
    fsdp_s: float = 0.0
    dp_allreduce_s: float = 0.0
    host_s: float = 0.0
    dispatcher: str = ""
    model_flops: float = 0.0
    peak_flops: float = 0.0

    @property
    def seconds(self) -> float:
        return self.compute_s + self.exposed_comm_s

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of the whole cluster."""
        return 0.0 if self.seconds == 0 else self.tokens_per_gpu * self.processes / self.seconds

    @property
    def tokens_per_gpu_s(self) -> float:
        return 0.0 if self.seconds == 0 else self.tokens_per_gpu / self.seconds

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation of the step (see the module docstring for the FLOPs counted)."""
        return 0.0 if not self.seconds or not self.peak_flops else self.model_flops / self.seconds / self.peak_flops

    def breakdown(self) -> dict[str, float]:
        """Seconds per part of the step; they add up to :attr:`seconds`."""
        return {
            "compute": self.compute_s,
            "all-to-all inside nodes": self.a2a_intra_s,
            "all-to-all across nodes": self.a2a_inter_s,
            "FSDP2 collectives": self.fsdp_s,
            "DP all-reduce": self.dp_allreduce_s,
            "host copies": self.host_s,
        }

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "step_s": self.seconds,
            "tokens_per_gpu_s": self.tokens_per_gpu_s,
            "mfu": self.mfu,
            "breakdown_s": self.breakdown(),
        }


def fsdp_parts(layout, counts, cluster: Cluster, accumulation: int) -> tuple[float, float]:
    """``(inside nodes, across nodes)``: seconds of FSDP2 collectives one GPU makes per optimizer step under
    ``layout`` (``ep_fsdp`` or ``fsdp2``; see the module docstring): ring collectives moving ``(n-1)/n`` of the
    gathered (reduced) bytes of each group."""
    processes, ep = layout.processes, layout.ep_size
    teacher = layout.teacher == "online"
    groups = [(counts.total - counts.experts, processes, processes)]  # the dense mesh
    efsdp = processes // ep
    if efsdp > 1:  # the replicas of one expert shard: ranks ep apart, in other nodes once ep x efsdp spans several
        groups.append((counts.experts // ep, efsdp, processes if processes > cluster.gpus_per_node else efsdp))
    parts = [0.0, 0.0]
    for parameters, ranks, spread in groups:
        if ranks <= 1:
            continue
        moved = (2 * 2 + 4 + (2 if teacher else 0)) * parameters  # bf16 gathers fwd + bwd, fp32 reduce, teacher
        seconds = moved * (ranks - 1) / ranks / (hardware(cluster, spread).allreduce_gbps * 1e9)
        parts[spread > cluster.gpus_per_node] += accumulation * seconds
    return parts[0], parts[1]


def gather_seconds(layout, counts, cluster: Cluster, accumulation: int) -> float:
    """Seconds of FSDP2 collectives one GPU makes per optimizer step under ``layout`` (:func:`fsdp_parts`, both)."""
    return sum(fsdp_parts(layout, counts, cluster, accumulation))


def model_flops_per_token(counts, shape: pm.ModelShape, teacher: bool) -> float:
    """Model FLOPs per token of a distillation step (see the module docstring): ``6 x active`` for the student,
    ``2 x active`` more for an online teacher's forward."""
    untied = max(0, counts.embeddings - shape.vocab * shape.hidden)  # the input embedding when not tied to the head
    active = counts.total - counts.experts + counts.experts * shape.top_k / shape.num_experts - untied
    return (6 + (2 if teacher else 0)) * active


def step_time(
    estimate,
    shape: pm.ModelShape,
    converted: set[int],
    cluster: Cluster,
    batch_tokens: int,
    seq_len: int,
    counts,
    reach=None,
):
    """:class:`StepTime` of one optimizer step (``batch_tokens`` over the cluster) of the simulated candidate;
    ``counts``: the model's :class:`fcsd.plan.candidates.Counts` (what FSDP2 gathers); ``reach``: the layout's
    :class:`fcsd.plan.routing.Reach` when EP spans nodes (default: uniform routing)."""
    layout = estimate.layout
    processes = layout.processes
    tokens = batch_tokens // processes  # per GPU and step
    flops_per_token = sum(estimate.flops.values()) / estimate.tokens
    expert_per_token = min(estimate.expert_flops / estimate.tokens, flops_per_token)
    peak = cluster.gpu.tflops * 1e12
    compute = tokens * (flops_per_token - expert_per_token) / (peak * cluster.mfu)
    compute += tokens * expert_per_token / cluster.expert_rate(layout.ep_size)
    online = layout.teacher == "online"
    a2a, fsdp, dp, host = Exposure(), 0.0, 0.0, 0.0
    grad_bytes = estimate.gradients  # fp32 gradients held by this GPU
    if layout.ep_size > 1:
        a2a = ep_breakdown(shape, converted, tokens, seq_len, layout.ep_size, cluster, online, reach)
    if layout.strategy == "ep":
        dp = pm.allreduce_s(grad_bytes, processes, hardware(cluster, processes))
    elif layout.strategy in ("ep_fsdp", "fsdp2"):
        intra, inter = fsdp_parts(layout, counts, cluster, estimate.accumulation)
        behind = compute * cluster.overlap - (a2a.hidden_inter if inter else 0.0)  # the NICs carry those too
        fsdp = max(0.0, intra + inter - max(0.0, behind))
    elif layout.strategy == "ddp":
        comm = pm.allreduce_s(grad_bytes, processes, hardware(cluster, processes))
        dp = max(0.0, comm - compute * 2 / 3 * cluster.overlap)  # overlapped with the backward (2/3 of the compute)
    if layout.offload:
        rows = estimate.host * replay_scale(layout, cluster, reach)
        backward = compute * estimate.flops.get("backward", 0.0) / max(sum(estimate.flops.values()), 1.0)
        share = 1 / estimate.accumulation
        moe = len(_moe_layers(shape))
        host = estimate.accumulation * offload_exposure(rows, compute * share, cluster, moe, backward * share)
    exposed = a2a.total + fsdp + dp + host
    dispatcher = dispatcher_for(layout.ep_size, cluster.gpus_per_node) if layout.ep_size > 1 else ""
    flops = tokens * model_flops_per_token(counts, shape, online)
    return StepTime(compute, exposed, tokens, processes, a2a.intra, a2a.inter, fsdp, dp, host, dispatcher, flops, peak)


def offload_exposure(
    host_bytes: int, micro_batch_compute: float, cluster: Cluster, layers: int = 0, backward_compute: float = 0.0
) -> float:
    """Seconds a checkpointed micro-batch of ``micro_batch_compute`` seconds waits for ``host_bytes`` of replayed
    rows going to host memory and back (see the module docstring). With ``layers`` (the layers whose rows wait
    there) the way back is the prefetched replay's: the rows of the layer the backward recomputes next come back
    while it recomputes this one, so each layer's copy hides behind a layer's share of ``backward_compute`` (the
    backward with its recomputation), except the first one's; without, every copy back is exposed."""
    copy = host_bytes / (cluster.gpu.host_gbps * 1e9)
    out = max(0.0, copy - micro_batch_compute / 4 * cluster.overlap)
    if layers < 1:
        return out + copy
    return out + copy / layers + max(0.0, copy - backward_compute * cluster.overlap) * (layers - 1) / layers


def replay_scale(layout, cluster: Cluster, reach) -> float:
    """The replayed rows of ``layout``'s dispatcher over the plain one's, which the simulation runs (its buffers;
    :mod:`fcsd.plan.simulate`): the node-aware dispatcher records, per MoE layer, the rows its experts received (one
    per (token, GPU) reached) and the rows that came home (one per (token, node) reached; its forwarding hops are not
    replayed), where the plain one records a row per (token, expert) each way."""
    if reach is None or dispatcher_for(layout.ep_size, cluster.gpus_per_node) != "hierarchical":
        return 1.0
    return (reach.nodes + reach.gpus) / (2 * reach.top_k)
