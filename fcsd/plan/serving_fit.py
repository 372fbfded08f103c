"""Whether the export fits where ``fcsd plan`` says to serve it, and the smallest vLLM setting that does.

What a GPU holds under vLLM: the export's weights at its format, laid out as vLLM lays them out, and a KV cache for
``sequences`` sequences of ``context`` tokens (:data:`SERVE_CONTEXT` by default, at most the model's
``max_position_embeddings``; the serve line passes it as ``--max-model-len``), as :mod:`fcsd.plan.serving_bytes`
counts them.

It fits when the fullest GPU's weights and KV cache stay within vLLM's share of its memory
(``--gpu-memory-utilization``, :data:`GPU_MEMORY_UTILIZATION`) less the cluster's reserve (CUDA context, NCCL buffers
and the activations of vLLM's profiling forward). The settings tried, smallest first: TP 1, 2, 4, ... on one node
(the sizes vLLM accepts, :func:`tp_sizes`), then the largest TP of a node with pipeline parallelism across 2, 3, ...
nodes (vLLM's guideline for a model larger than a node: TP = GPUs per node, PP = nodes, over a Ray cluster).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from fcsd.plan.cluster import GIB, Cluster
from fcsd.plan.serving_bytes import ServingModel, gib, serving_model

SERVE_CONTEXT = 32768  # tokens of context a plan's serve line is checked for (and passes as --max-model-len)
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of a GPU's memory for weights, activations and KV cache
MAX_NODES = 128


@dataclass(frozen=True)
class ServingFit:
    """One vLLM setting: per GPU of its fullest pipeline stage, weights and KV cache against what vLLM may fill."""

    tp: int
    pp: int
    nodes: int
    weights: int  # bytes per GPU
    kv_cache: int  # bytes per GPU for sequences x context tokens
    usable: int  # bytes per GPU for weights and KV cache
    context: int
    sequences: int
    room: int  # sequences of `context` tokens the KV cache can hold at this setting (vLLM takes all the rest)

    @property
    def fits(self) -> bool:
        """Whether the fullest GPU's weights and KV cache stay within what vLLM may fill (:attr:`usable`)."""
        return self.weights + self.kv_cache <= self.usable

    @property
    def needed(self) -> int:
        """Bytes the fullest GPU needs: its weights and its KV cache."""
        return self.weights + self.kv_cache

    @property
    def setting(self) -> str:
        """The setting in words: ``TP 8 on 1 node``, ``TP 8 x PP 2 on 2 nodes``."""
        nodes = f" on {self.nodes} node{'s' if self.nodes > 1 else ''}"
        return (f"TP {self.tp}" if self.pp == 1 else f"TP {self.tp} x PP {self.pp}") + nodes

    def to_dict(self) -> dict:
        """The fields (bytes per GPU) with ``fits`` and ``needed``, for the plan's ``--json``."""
        return {**asdict(self), "fits": self.fits, "needed": self.needed}


@dataclass(frozen=True)
class ServingCheck:
    """The check's answer: the smallest setting that fits on ``cluster`` (``fit``), else the largest one it has
    (``largest``, what it misses by) and the smallest beyond it that fits (``beyond``; None: none up to
    :data:`MAX_NODES` nodes)."""

    model: ServingModel
    cluster: Cluster
    fit: ServingFit | None
    largest: ServingFit
    beyond: ServingFit | None

    def to_dict(self) -> dict:
        """The plan's ``serving`` in ``--json``: the export's format and bytes, what its KV cache keeps, whether it
        fits and at which setting (:meth:`ServingFit.to_dict`), the cluster's largest setting and the smallest
        beyond the cluster that would fit (None: none up to :data:`MAX_NODES` nodes)."""
        m = self.model
        return {
            "weights_format": m.weights_format,
            "weights_bytes": m.weights,
            "kv_cache": m.kv_kind,
            "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
            "fits": self.fit is not None,
            "setting": None if self.fit is None else self.fit.to_dict(),
            "largest_on_cluster": self.largest.to_dict(),
            "would_fit": None if self.beyond is None else self.beyond.to_dict(),
        }


def stage_layers(num_layers: int, pp: int) -> list[int]:
    """Layers of each pipeline stage as vLLM splits them (``get_pp_indices``): an even share, the remainder to the
    stages before the last."""
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    return sizes


def tp_sizes(gpus_per_node: int, heads: int, kv_heads: int | None, experts: int) -> list[int]:
    """Tensor-parallel sizes on one node vLLM accepts for the model, smallest first: each divides the node's GPUs,
    the attention heads and (the experts split over the same GPUs) the experts; it and the KV heads divide one
    another."""
    return [
        size
        for size in range(1, gpus_per_node + 1)
        if not gpus_per_node % size
        and not heads % size
        and not experts % size
        and (kv_heads is None or not kv_heads % size or not size % kv_heads)
    ]


def serving_fit(model: ServingModel, cluster: Cluster, tp: int, pp: int, context: int, sequences: int) -> ServingFit:
    """Per GPU of the fullest stage of ``tp`` x ``pp``: weights and a KV cache of ``sequences`` x ``context``."""
    kv_split = 1 if model.kv_heads is None else min(tp, model.kv_heads)
    usable = int(GPU_MEMORY_UTILIZATION * cluster.gpu.memory_gib * GIB - cluster.reserve_gib * GIB)
    tokens = context * sequences
    worst, start = None, 0
    sizes = stage_layers(len(model.layers), pp)
    for stage, count in enumerate(sizes):
        parts = list(model.layers[start : start + count])
        start += count
        if stage == 0 and not (model.tied and pp == 1):
            parts.append(model.embed)
        if stage == pp - 1:
            parts.append(model.head)
        weights = sum(split / tp + kv / min(tp, model.kv_heads or tp) + replicated for split, kv, replicated in parts)
        per_token = count * model.kv_bytes / kv_split
        if worst is None or weights + per_token * tokens > worst[0] + worst[1] * tokens:
            worst = (weights, per_token)
    weights, per_token = worst
    room = int((usable - weights) // (per_token * context)) if per_token and usable > weights else 0
    nodes = math.ceil(tp * pp / cluster.gpus_per_node)
    return ServingFit(tp, pp, nodes, int(weights), int(per_token * tokens), usable, context, sequences, room)


def plan_serving(model_config, cluster: Cluster, context: int | None, sequences: int, config=None):
    """``fcsd plan``'s serving check (:func:`check_serving`; None when vLLM has no FarSkip class for the family); a
    run config asking for a bf16 export (``export_format=bf16``) is checked in bf16 whatever the source's format."""
    from fcsd.connectivity.families import text_config
    from fcsd.serving.served_families import farskip_architecture

    if farskip_architecture(text_config(model_config).model_type) is None:
        return None
    return check_serving(model_config, cluster, context, sequences, getattr(config, "export_format", "source"))


def check_serving(
    model_config, cluster: Cluster, context: int | None = None, sequences: int = 1, export: str = "source"
) -> ServingCheck:
    """The smallest vLLM setting on ``cluster`` that holds the export and its KV cache (see the module docstring);
    when none does, the largest one's figures and the smallest beyond the cluster that fits. ``context``: tokens per
    sequence (default :data:`SERVE_CONTEXT`, at most the model's maximum); ``sequences``: served at once;
    ``export``: ``source`` (the source's format: FP8 stays FP8) or ``bf16``."""
    model = serving_model(model_config, bf16=export == "bf16")
    if context is None:
        context = min(SERVE_CONTEXT, model.max_context or SERVE_CONTEXT)
    if context < 1 or sequences < 1:
        raise ValueError(
            f"--serve-context {context} --serve-sequences {sequences}: give at least one sequence of one token, "
            f"e.g. --serve-context {SERVE_CONTEXT} --serve-sequences 1"
        )
    if model.max_context and context > model.max_context:
        raise ValueError(
            f"--serve-context {context}: the model takes at most {model.max_context} tokens "
            f"(max_position_embeddings); give at most --serve-context {model.max_context}"
        )
    return _check_settings(model, cluster, context, sequences)


def serving_on(check: ServingCheck, cluster: Cluster) -> ServingCheck:
    """``check`` (the same export, context and sequences) made again on ``cluster``: the plan's commands target the
    larger cluster it falls back to when nothing fits the one asked for, so the serve line is checked there."""
    return _check_settings(check.model, cluster, check.largest.context, check.largest.sequences)


def _check_settings(model: ServingModel, cluster: Cluster, context: int, sequences: int) -> ServingCheck:
    """The settings of ``cluster`` tried smallest first (see the module docstring) and the answer of the check."""
    sizes = tp_sizes(cluster.gpus_per_node, model.heads, model.kv_heads, model.experts) or [1]
    settings = [(tp, 1) for tp in sizes]
    most = min(len(model.layers), MAX_NODES * cluster.gpus_per_node // sizes[-1])
    settings += [(sizes[-1], pp) for pp in range(2, most + 1)]
    fits = [serving_fit(model, cluster, tp, pp, context, sequences) for tp, pp in settings]
    inside = [f for f in fits if f.tp * f.pp <= cluster.gpus]
    fit = next((f for f in inside if f.fits), None)
    beyond = None if fit is not None else next((f for f in fits if f.fits), None)
    return ServingCheck(model, cluster, fit, inside[-1], beyond)


def serving_line(check: ServingCheck) -> str:
    """The report's one line: the setting and its memory per GPU, or that nothing fits and what would."""
    m, c = check.model, check.cluster
    usable = (
        f"{gib(check.largest.usable)} ({GPU_MEMORY_UTILIZATION:g} x {c.gpu.memory_gib:g} GiB less "
        f"{c.reserve_gib:g} GiB reserve)"
    )
    what = f"{m.weights_format} export ({gib(m.weights)} of weights)"
    f = check.fit or check.largest
    cache = f"KV cache of {f.sequences} x {f.context:,} tokens ({m.kv_kind})"
    if check.fit is not None:
        across = ", PP across nodes over a Ray cluster" if f.pp > 1 else ""
        return (
            f"serving    {what}: {f.setting}{across}: per GPU {gib(f.weights)} of weights + {gib(f.kv_cache)} "
            f"{cache} of {usable}; room for {f.room:,} such sequences"
        )
    would = (
        f"{check.beyond.setting} would ({gib(check.beyond.needed)} per GPU)"
        if check.beyond is not None
        else f"nothing up to {MAX_NODES} nodes would"
    )
    return (
        f"serving    the {what} does not fit {c.nodes} x {c.gpus_per_node} {c.gpu.name}: at {f.setting} a GPU needs "
        f"{gib(f.weights)} of weights + {gib(f.kv_cache)} {cache} of {usable}; {would}"
    )
