"""An export's bytes as vLLM places them on its GPUs, counted from a meta-device build of the model
(:func:`serving_model`): what ``fcsd plan``'s serving check (:mod:`fcsd.plan.serving_fit`) fits on a cluster, and what
the FP8 teacher's price (:mod:`fcsd.plan.teacher_dtype`) counts.

- the weights at the export's format: its dtype (bf16 by default), or FP8 e4m3 with fp32 block scales
  (``ceil(out/128) x ceil(in/128)`` per matrix, one set per expert) when the source is block-FP8
  (``quantization_config.quant_method: fp8``, DeepSeek-V3's format): every linear weight and every routed expert's
  matrix in FP8, the embeddings, the LM head, the norms and the routers in bf16;
- laid out as vLLM lays them out: tensor parallelism splits the embeddings, the LM head, the attention and MLP
  projections and (``--enable-expert-parallel``) the experts over TP; norms, routers and MLA's latent
  down-projections (``q_a_proj``, ``kv_a_proj_with_mqa``) are replicated; K/V projections split over at most the KV
  heads; pipeline parallelism gives each stage vLLM's share of the layers (the embeddings to the first, the final
  norm and the head to the last);
- a KV cache for ``sequences`` sequences of ``context`` tokens (:data:`fcsd.plan.serving_fit.SERVE_CONTEXT` by default,
  at most the model's ``max_position_embeddings``; the serve line passes it as ``--max-model-len``): MLA keeps
  DeepSeek's compressed latent, ``kv_lora_rank + qk_rope_head_dim`` values per token and layer, on every TP rank;
  attention with KV heads keeps ``2 x kv_heads x head_dim`` values, split over at most the KV heads; in the
  activations' dtype (bf16 for an FP8 export). Sliding-window and chunked layers are counted at the full context
  (an upper bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fcsd.plan.cluster import GIB

REPLICATED = ("q_a_proj", "kv_a_proj_with_mqa")  # MLA's latent down-projections: vLLM's replicated linears
KV_PROJECTIONS = ("k_proj", "v_proj")  # split over at most the KV heads (a rank keeps at least one whole head)
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
    from fcsd.plan.perfmodel import model_shape

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


def gib(value: int) -> str:
    """Bytes in GiB, or MiB / KiB for a small model's figures."""
    unit, size = next(((u, s) for u, s in (("GiB", GIB), ("MiB", 2**20)) if value >= s), ("KiB", 2**10))
    return f"{value / size:,.1f} {unit}"
