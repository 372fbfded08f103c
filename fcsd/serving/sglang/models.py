"""The model classes SGLang serves FarSkip exports with: ``FarSkip<Arch>`` is SGLang's stock ``<Arch>`` whose inner
model runs the FarSkip layer loop (:mod:`fcsd.serving.sglang.stack`; paper Sec. 3, 4.2; design §7).

Everything else is the stock class: weight loading, packed projections, fused MoE, MLA, tensor parallelism, the
logits. A tied-embedding export gets its head tied (SGLang's Qwen3-MoE class never ties: it would read zeros).
What the loop does not cover is refused in one line when the model is built, never served with stock wiring:
pipeline parallelism, data-parallel attention, expert-parallel all-to-all backends, two-batch overlap, replicated
dense MLPs, shared experts fused into the routed kernel, and configs SGLang's class builds differently from
transformers (a Qwen3-MoE with dense layers).
"""

from __future__ import annotations

import importlib
import logging

import torch
from torch import nn

from fcsd.serving.identity import converted_layers
from fcsd.serving.routed_allreduce import (
    ABOVE_TOKENS_KEY,
    OVERLAP_KEY,
    RoutedAllReduce,
    resolve_above_tokens,
    resolve_overlap,
)
from fcsd.serving.served_families import (
    ARCHITECTURE_PREFIX,
    SERVED_FAMILIES,
    SGLANG_FAMILIES,
    UNSERVED_ARCHITECTURE,
    ServedFamily,
    served_families_text,
)
from fcsd.serving.sglang.families import calls_for
from fcsd.serving.sglang.stack import LayerPlan, StackPlan, blocking_all_reduce, run_layers

_INNER_CLASSES: dict[type, type] = {}


def check_config(config, family: ServedFamily) -> None:
    """Refuse (one line) a config the FarSkip class of ``family`` cannot serve exactly: one SGLang's stock class builds
    other than transformers does, FP8 without kernels for it, DeepSeek's llama_4_scaling."""
    if family.model_type == "qwen3_moe":
        dense = list(getattr(config, "mlp_only_layers", None) or [])
        step = getattr(config, "decoder_sparse_step", 1)
        if dense or step != 1:
            raise ValueError(
                f"SGLang's Qwen3-MoE makes every layer a MoE layer, but this export has dense layers (mlp_only_layers "
                f"{dense}, decoder_sparse_step {step}): serve it with vLLM (`vllm serve EXPORT`)"
            )
    quantization = getattr(config, "quantization_config", None) or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method == "fp8" and not _fp8_kernels():
        raise ValueError(
            "FP8 linears need SGLang's AMX CPU kernels or a GPU, and this machine has neither: serve the FP8 export "
            "on a GPU, or export the run in bf16 (`fcsd export RUN OUT --format bf16`)"
        )
    if family.sglang == "deepseek_v2" and getattr(config, "llama_4_scaling", None) is not None:
        raise ValueError("FarSkip serving in SGLang does not cover DeepSeek's llama_4_scaling: serve it with vLLM")


def _fp8_kernels() -> bool:
    from sglang.srt.utils import cpu_has_amx_support

    return torch.cuda.is_available() or cpu_has_amx_support()


def check_parallel(model) -> int:
    """Refuse the parallel setups the FarSkip loop does not cover; returns the tensor-parallel size."""
    from sglang.srt.distributed.parallel_state import get_tp_group
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.layers.moe import get_moe_a2a_backend
    from sglang.srt.layers.moe.utils import is_sbo_enabled, is_tbo_enabled

    unsupported = {
        "pipeline parallelism (--pp-size)": model.pp_group.world_size > 1,
        "data-parallel attention (--enable-dp-attention)": is_dp_attention_enabled(),
        "an expert-parallel all-to-all backend (--moe-a2a-backend)": not get_moe_a2a_backend().is_none(),
        "two-batch or single-batch overlap (--enable-two-batch-overlap, --enable-single-batch-overlap)": (
            is_tbo_enabled() or is_sbo_enabled()
        ),
    }
    for what, present in unsupported.items():
        if present:
            raise ValueError(f"FarSkip serving in SGLang does not support {what}: serve with tensor parallelism only")
    return get_tp_group().world_size


def _sibling_group():
    """A process group with the tensor-parallel ranks and its own communicator, for the started all-reduces."""
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    return dist.new_group(ranks=list(tp.ranks), backend=dist.get_backend(tp.device_group))


def convert(model: nn.Module, family: ServedFamily, config) -> list[int]:
    """Give SGLang's freshly built stock inner ``model`` (``layers``, ``norm``) the FarSkip layer loop; returns the
    converted layer indices. Refuses (one line) what it cannot serve exactly."""
    tp_size = check_parallel(model)
    num_layers = config.num_hidden_layers
    converted = converted_layers(config, num_layers)
    calls = calls_for(family)
    unreduced = tp_size > 1
    for index in range(model.start_layer, model.end_layer):
        calls.check_layer(model.layers[index], index)
    overlap_on = resolve_overlap(getattr(config, OVERLAP_KEY, None), tp_size)
    overlap = None
    if overlap_on:
        above = resolve_above_tokens(getattr(config, ABOVE_TOKENS_KEY, None), None)
        overlap = RoutedAllReduce(_sibling_group(), above, reduce_now=blocking_all_reduce)
    chosen = set(converted)
    moe = {i: calls.is_moe(model.layers[i].mlp) for i in range(model.start_layer, model.end_layer)}
    # a MoE layer hands its routed all-reduce to a converted successor (which waits after its attention)
    starts = {i for i in converted if moe.get(i) and i + 1 in chosen and i + 1 < model.end_layer}
    layers = [
        LayerPlan(
            i,
            i in chosen,
            moe[i],
            overlap.key(i) if overlap is not None and i in starts else None,
            overlap.key(i - 1) if overlap is not None and i - 1 in starts else None,
        )
        for i in range(model.start_layer, model.end_layer)
    ]
    model._farskip = StackPlan(layers, calls, unreduced)
    model.__class__ = farskip_inner_class(type(model))
    logging.getLogger("sglang.farskip").info(
        "FarSkip connectivity on layers %s of %d (%s); routed all-reduce %s (tensor-parallel size %d)%s",
        converted,
        num_layers,
        family.architecture,
        "overlapped" if overlap_on else "blocking",
        tp_size,
        f"; overlapped in forwards of more than {overlap.above_tokens} tokens" if overlap is not None else "",
    )
    return converted


def _inner_forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None, *_, **__):
    hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
    return run_layers(self, self._farskip, hidden, positions, forward_batch)


def farskip_inner_class(stock: type) -> type:
    """The FarSkip subclass of an SGLang inner model class (its ``forward`` is the FarSkip loop)."""
    if stock not in _INNER_CLASSES:
        name = f"FarSkip{stock.__name__}"
        cls = type(name, (stock,), {"forward": _inner_forward, "__module__": __name__, "__qualname__": name})
        globals()[name] = cls
        _INNER_CLASSES[stock] = cls
    return _INNER_CLASSES[stock]


def _farskip_model_class(family: ServedFamily) -> type:
    stock = getattr(importlib.import_module("sglang.srt.models." + family.sglang), family.architecture)

    def __init__(self, config, quant_config=None, prefix: str = ""):
        check_config(config, family)
        stock.__init__(self, config, quant_config=quant_config, prefix=prefix)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head = self.model.embed_tokens  # the export has no lm_head.weight
        self.farskip_layers = convert(self.model, family, config)

    name = family.farskip_architecture
    doc = f"SGLang's {family.architecture} with FarSkip-Collective connectivity on the layers in config.farskip."
    return type(name, (stock,), {"__init__": __init__, "__module__": __name__, "__qualname__": name, "__doc__": doc})


def torch_native_mla() -> None:
    """SGLang's DeepSeek attention picks its forward method by attention backend and sends an unknown one, such as
    ``torch_native`` (its CPU backend without AMX), down the MHA prefill path of its Triton handler, which the torch
    backend cannot run on an MLA KV cache (a shape error in prefill, stock checkpoints too). The torch backend is
    given the absorbed MLA path for every forward instead, as SGLang's MLA-only backends get."""
    from sglang.srt.models.deepseek_common import attention_backend_handler as handlers

    if "torch_native" not in handlers.AttentionBackendRegistry._handlers:
        handlers.AttentionBackendRegistry.register("torch_native", handlers._dispatch_mla_subtype)


def _refusing_class(name: str, model_type: str) -> type:
    """What an export of a family this plugin lacks names (and fcsd 0.1's ``FarSkipForCausalLM``): refused in one
    line when SGLang builds it, instead of SGLang's fallbacks."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        raise ValueError(
            f"fcsd's SGLang plugin has no FarSkip class for this export (model type {model_type!r}, architectures "
            f"[{name!r}]): it serves {served_families_text(SGLANG_FAMILIES)}; serve this one with vLLM "
            "(`vllm serve EXPORT`)"
        )

    return type(name, (nn.Module,), {"__init__": __init__, "__module__": __name__, "__qualname__": name})


def model_classes() -> dict[str, type]:
    """``{FarSkip architecture: class}`` for SGLang's registry: the served families' classes (their stock modules are
    imported here) and a refusing class for every other name an export may carry."""
    classes = {}
    names = [(f.farskip_architecture, f) for f in SERVED_FAMILIES] + [(UNSERVED_ARCHITECTURE, None)]
    for name, family in names:
        cls = globals().get(name)
        if cls is None:
            served = family is not None and family.sglang is not None
            model_type = family.model_type if family is not None else "unknown"
            cls = _farskip_model_class(family) if served else _refusing_class(name, model_type)
            globals()[name] = cls
        classes[name] = cls
    return classes


def __getattr__(name: str):  # unpickling in a fresh process
    if name.startswith(ARCHITECTURE_PREFIX) and name in model_classes():
        return globals()[name]
    raise AttributeError(name)
