"""Whether the export fits where ``fcsd plan`` says to serve it, and the smallest vLLM setting that does.

What a GPU holds under vLLM (counted from a meta-device build of the model, :func:`serving_model`):

- the weights at the export's format: its dtype (bf16 by default), or FP8 e4m3 with fp32 block scales
  (``ceil(out/128) x ceil(in/128)`` per matrix, one set per expert) when the source is block-FP8
  (``quantization_config.quant_method: fp8``, DeepSeek-V3's format): every linear weight and every routed expert's
  matrix in FP8, the embeddings, the LM head, the norms and the routers in bf16;
- laid out as vLLM lays them out: tensor parallelism splits the embeddings, the LM head, the attention and MLP
  projections and (``--enable-expert-parallel``) the experts over TP; norms, routers and MLA's latent
  down-projections (``q_a_proj``, ``kv_a_proj_with_mqa``) are replicated; K/V projections split over at most the KV
  heads; pipeline parallelism gives each stage vLLM's share of the layers (the embeddings to the first, the final
  norm and the head to the last);
- a KV cache for ``sequences`` sequences of ``context`` tokens (:data:`SERVE_CONTEXT` by default, at most the model's
  ``max_position_embeddings``; the serve line passes it as ``--max-model-len``): MLA keeps DeepSeek's compressed
  latent, ``kv_lora_rank + qk_rope_head_dim`` values per token and layer, on every TP rank; attention with KV heads
  keeps ``2 x kv_heads x head_dim`` values, split over at most the KV heads; in the activations' dtype (bf16 for an
  FP8 export). Sliding-window and chunked layers are counted at the full context (an upper bound).

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

SERVE_CONTEXT = 32768  # tokens of context a plan's serve line is checked for (and passes as --max-model-len)
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of a GPU's memory for weights, activations and KV cache
REPLICATED = ("q_a_proj", "kv_a_proj_with_mqa")  # MLA's latent down-projections: vLLM's replicated linears
KV_PROJECTIONS = ("k_proj", "v_proj")  # split over at most the KV heads (a rank keeps at least one whole head)
MAX_NODES = 128
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ServingModel:
    """An export's bytes as vLLM places them: per part ``(split over TP, split over the KV heads, replicated)``."""

    weights_format: str  # "bfloat16", "float32", or "fp8 e4m3 + 128x128 block scales"
    embed: tuple  # the input embeddings (the first pipeline stage)
    head: tuple  # the final norm and the LM head (the last stage); the tied embeddings where they are shared
    layers: tuple  # one triple per decoder layer
    tied: bool  # LM head and input embeddings share one tensor (a one-stage layout holds it once)
    kv_bytes: int  # KV cache per token and layer, whole (before any split)
    kv_heads: int | None  # heads the KV cache splits over; None: MLA's latent, on every TP rank
    kv_kind: str  # what the KV cache keeps, in words
    heads: int
    experts: int
    max_context: int | None

    @property
    def weights(self) -> int:
        """Bytes of the whole export (the tied embeddings once)."""
        total = sum(self.embed) + sum(sum(layer) for layer in self.layers) + sum(self.head)
        return total - (sum(self.embed) if self.tied else 0)


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
        return self.weights + self.kv_cache <= self.usable

    @property
    def needed(self) -> int:
        return self.weights + self.kv_cache

    @property
    def setting(self) -> str:
        nodes = f" on {self.nodes} node{'s' if self.nodes > 1 else ''}"
        return (f"TP {self.tp}" if self.pp == 1 else f"TP {self.tp} x PP {self.pp}") + nodes

    def to_dict(self) -> dict:
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


def export_format(model_config) -> tuple[str, int, tuple | None]:
    """``(name, bytes per unquantized value, FP8 block or None)`` of an export of ``model_config``'s source: FP8 with
    its block scales when the source is block-FP8 (a per-tensor FP8 source: one scale per matrix), else its dtype
    (bf16 when it names none)."""
    quantization = getattr(model_config, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    if quantization and quantization.get("quant_method") == "fp8":
        block = tuple(quantization.get("weight_block_size") or ()) or None
        scales = f"{block[0]}x{block[1]} block scales" if block else "per-tensor scales"
        return f"fp8 e4m3 + {scales}", 2, block or (0, 0)
    dtype = getattr(model_config, "dtype", None) or "bfloat16"
    name = str(dtype).removeprefix("torch.")
    return name, DTYPE_BYTES.get(name, 2), None


def _fp8_bytes(shape, block: tuple) -> int:
    """An FP8 matrix (or a stack of them, the leading dims) with its fp32 scales."""
    *lead, rows, cols = shape
    count = math.prod(lead)
    blocks = math.ceil(rows / block[0]) * math.ceil(cols / block[1]) if block[0] else 1
    return count * (rows * cols + 4 * blocks)


def serving_model(model_config, bf16: bool = False, model=None) -> ServingModel:
    """The :class:`ServingModel` of ``model_config``'s export (see the module docstring); ``bf16``: an export in
    bf16 whatever the source's format; ``model``: the text model already built on the meta device (else built
    here: seconds for a DeepSeek-size model)."""
    import torch.nn as nn

    from fcsd.connectivity.families import family_for_config, meta_model, moe_blocks, text_config

    text = text_config(model_config)
    name, value_bytes, block = ("bfloat16", 2, None) if bf16 else export_format(model_config)
    model = meta_model(text) if model is None else model
    family = family_for_config(model.config)
    blocks = moe_blocks(model, family)
    routers = {id(p) for mlp in blocks.values() for p in family.router(mlp).parameters()}
    experts = {id(p) for mlp in blocks.values() for p in getattr(mlp, family.experts_attr).parameters()}
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    fp8 = set()  # parameters stored in FP8: linear weights (not the head, not routers) and routed experts' matrices
    if block is not None:
        skip = _not_converted(model_config)
        for module_name, module in model.named_modules():
            if isinstance(module, nn.Linear) and module.weight is not head and not _kept(module_name, skip):
                fp8.add(id(module.weight))
        fp8 = (fp8 | experts) - routers
    layers = [[0, 0, 0] for _ in range(text.num_hidden_layers)]
    embed, rest = [0, 0, 0], [0, 0, 0]
    for param_name, param in model.named_parameters():
        if id(param) in fp8 and param.dim() >= 2:
            size = _fp8_bytes(tuple(param.shape), block)
        else:
            size = param.numel() * value_bytes
        module = param_name.rsplit(".", 2)[-2] if "." in param_name else ""
        if param.dim() <= 1 or id(param) in routers or module in REPLICATED:
            kind = 2
        elif module in KV_PROJECTIONS:
            kind = 1
        else:
            kind = 0
        parts = param_name.split(".")
        if param is embedding:
            embed[0] += size
        elif "layers" in parts and parts[parts.index("layers") + 1].isdigit():
            layers[int(parts[parts.index("layers") + 1])][kind] += size
        else:
            rest[kind] += size
    tied = head is embedding
    if tied:
        rest[0] += embed[0]
    heads = text.num_attention_heads
    activation_bytes = 4 if name == "float32" else 2
    if getattr(text, "kv_lora_rank", None):
        latent = text.kv_lora_rank + text.qk_rope_head_dim
        kv_bytes, kv_heads = latent * activation_bytes, None
        kind = f"MLA latent, {latent} values per token and layer"
    else:
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_bytes = 2 * kv_heads * head_dim * activation_bytes
        kind = f"K and V of {kv_heads} heads x {head_dim} per token and layer"
    from fcsd.perfmodel import model_shape

    return ServingModel(
        name,
        tuple(embed),
        tuple(rest),
        tuple(tuple(layer) for layer in layers),
        tied,
        kv_bytes,
        kv_heads,
        kind,
        heads,
        model_shape(model_config).num_experts,
        getattr(text, "max_position_embeddings", None),
    )


def _not_converted(model_config) -> list[str]:
    """Module names the FP8 source keeps unquantized beyond the head and the routers (``modules_to_not_convert``)."""
    quantization = model_config.quantization_config
    values = quantization if isinstance(quantization, dict) else quantization.to_dict()
    return list(values.get("modules_to_not_convert") or [])


def _kept(module_name: str, skip: list[str]) -> bool:
    """Whether ``modules_to_not_convert`` (``skip``: full names, or a last part such as ``lm_head`` for every module
    so named) keeps ``module_name`` unquantized."""
    return any(module_name == name or module_name.endswith("." + name) for name in skip)


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
    from fcsd.serving.vllm.families import farskip_architecture

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


def _gib(value: int) -> str:
    """Bytes in GiB, or MiB / KiB for a small model's figures."""
    unit, size = next(((u, s) for u, s in (("GiB", GIB), ("MiB", 2**20)) if value >= s), ("KiB", 2**10))
    return f"{value / size:,.1f} {unit}"


def serving_line(check: ServingCheck) -> str:
    """The report's one line: the setting and its memory per GPU, or that nothing fits and what would."""
    m, c = check.model, check.cluster
    usable = (
        f"{_gib(check.largest.usable)} ({GPU_MEMORY_UTILIZATION:g} x {c.gpu.memory_gib:g} GiB less "
        f"{c.reserve_gib:g} GiB reserve)"
    )
    what = f"{m.weights_format} export ({_gib(m.weights)} of weights)"
    f = check.fit or check.largest
    cache = f"KV cache of {f.sequences} x {f.context:,} tokens ({m.kv_kind})"
    if check.fit is not None:
        across = ", PP across nodes over a Ray cluster" if f.pp > 1 else ""
        return (
            f"serving    {what}: {f.setting}{across}: per GPU {_gib(f.weights)} of weights + {_gib(f.kv_cache)} "
            f"{cache} of {usable}; room for {f.room:,} such sequences"
        )
    would = (
        f"{check.beyond.setting} would ({_gib(check.beyond.needed)} per GPU)"
        if check.beyond is not None
        else f"nothing up to {MAX_NODES} nodes would"
    )
    return (
        f"serving    the {what} does not fit {c.nodes} x {c.gpus_per_node} {c.gpu.name}: at {f.setting} a GPU needs "
        f"{_gib(f.weights)} of weights + {_gib(f.kv_cache)} {cache} of {usable}; {would}"
    )
