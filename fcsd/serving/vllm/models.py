"""The model classes vLLM serves FarSkip exports with: ``FarSkip<Arch>`` is vLLM's stock ``<Arch>`` whose converted
decoder layers get :class:`~fcsd.serving.vllm.wiring.FarSkipDecoderLayerMixin` (paper Sec. 3, 4.2; design §7).

Everything else is the stock class: weight loading, packed projections, fused MoE, MLA, tensor / expert / pipeline
parallelism. The classes are generated on first access (``module:FarSkip<Arch>``, as vLLM's registry imports them),
so importing this module imports only the stock module of the family asked for.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from fcsd.serving.identity import converted_layers
from fcsd.serving.routed_allreduce import (
    ABOVE_TOKENS_KEY,
    OVERLAP_KEY,
    RoutedAllReduce,
    resolve_above_tokens,
    resolve_overlap,
    split_at_routed_ops,
)
from fcsd.serving.served_families import BY_ARCHITECTURE, UNSERVED_ARCHITECTURE, ServedFamily, served_families_text
from fcsd.serving.vllm.moe import check_runner
from fcsd.serving.vllm.wiring import (
    FarSkipDecoderLayerMixin,
    LayerWiring,
    blocking_all_reduce,
    deepseek_attention,
    default_attention,
    is_moe_block,
)

_LAYER_CLASSES: dict[type, type] = {}


def farskip_layer_class(stock: type) -> type:
    """The generated FarSkip subclass of a vLLM decoder-layer class (module-level, so it pickles)."""
    if stock not in _LAYER_CLASSES:
        name = f"FarSkip{stock.__name__}"
        cls = type(name, (FarSkipDecoderLayerMixin, stock), {"__module__": __name__, "__qualname__": name})
        globals()[name] = cls
        _LAYER_CLASSES[stock] = cls
    return _LAYER_CLASSES[stock]


def _decoder_layers(model: nn.Module, family: ServedFamily, num_layers: int):
    """``(layer list, owner)``: the ``nn.ModuleList`` of ``num_layers`` decoder layers (stock class or vLLM's
    ``PPMissingLayer`` for another pipeline stage's) and the module holding it."""
    for owner in model.modules():
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
            if any(type(layer).__name__ == family.decoder_layer for layer in layers):
                return layers, owner
    raise ValueError(f"no list of {num_layers} {family.decoder_layer} modules in {type(model).__name__}")


def _execution(vllm_config) -> tuple[str, bool, bool]:
    """``(what runs, piecewise, unsplit_graphs)``: "eager" or "compiled (<mode>)" (with the CUDA-graph mode when
    graphs are on); whether vLLM compiles piecewise, split at attention (the routed ops can be splitting ops too);
    whether CUDA graphs are on without such splits (full graphs of an eager model, breakable graphs, or splitting ops
    without attention), which no started all-reduce may run inside."""
    from vllm.config import CompilationMode

    compilation = vllm_config.compilation_config
    enforce_eager = vllm_config.model_config.enforce_eager
    cudagraphs = getattr(compilation, "cudagraph_mode", None)
    graphs = not enforce_eager and torch.cuda.is_available() and bool(cudagraphs)
    split_at_attention = getattr(compilation, "is_attention_compiled_piecewise", None)
    piecewise = not enforce_eager and (
        split_at_attention()
        if split_at_attention is not None
        else compilation.mode == CompilationMode.VLLM_COMPILE and compilation.splitting_ops_contain_attention()
    )
    eager = enforce_eager or compilation.mode == CompilationMode.NONE
    what = "eager" if eager else f"compiled ({compilation.mode.name})"
    return what + (f", CUDA graphs {cudagraphs}" if graphs else ""), piecewise, graphs and not piecewise


def _place_routed_ops(vllm_config, piecewise: bool, log) -> None:
    """With the overlap on under piecewise compilation: the routed ops split vLLM's graphs too. The CUDA-graph mode
    stays as vLLM set it: full graphs (decode) capture the routed ops' blocking path, as every captured forward takes
    it (:meth:`~fcsd.serving.routed_allreduce.RoutedAllReduce.overlaps`)."""
    if piecewise:
        split_at_routed_ops(vllm_config.compilation_config)


def _above_tokens(vllm_config, setting) -> int:
    """:func:`~fcsd.serving.routed_allreduce.resolve_above_tokens` at vLLM's largest CUDA-graph capture size (where
    CUDA graphs are on)."""
    compilation = vllm_config.compilation_config
    graphs = not vllm_config.model_config.enforce_eager and torch.cuda.is_available()
    mode = getattr(compilation, "cudagraph_mode", None)  # an Enum: CUDAGraphMode.NONE is truthy
    graphs = graphs and mode is not None and getattr(mode, "name", str(mode)) != "NONE"
    capture = getattr(compilation, "max_cudagraph_capture_size", None) if graphs else None
    return resolve_above_tokens(setting, capture)


def convert(model: nn.Module, family: ServedFamily, vllm_config) -> list[int]:
    """Rewire the converted decoder layers of a freshly built stock ``model`` held on this pipeline stage; returns
    the converted indices. Refuses (one line) a config or parallel setup it cannot serve exactly."""
    from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group
    from vllm.logger import init_logger

    text_config = vllm_config.model_config.hf_text_config
    num_layers = text_config.num_hidden_layers
    converted = converted_layers(vllm_config.model_config.hf_config, num_layers)
    layers, owner = _decoder_layers(model, family, num_layers)
    start, end = getattr(owner, "start_layer", 0), getattr(owner, "end_layer", num_layers)
    dtype = vllm_config.model_config.dtype
    if family.model_type.startswith("deepseek") and dtype == torch.float16:
        raise ValueError(
            "FarSkip serving of DeepSeek in float16 is not supported (vLLM rescales its residual): use --dtype bfloat16"
        )
    tp_size = get_tensor_model_parallel_world_size()
    log = init_logger("vllm.farskip")
    execution, piecewise, unsplit_graphs = _execution(vllm_config)
    additional = vllm_config.additional_config or {}
    overlap_on = resolve_overlap(additional.get(OVERLAP_KEY), tp_size, unsplit_graphs)
    above = _above_tokens(vllm_config, additional.get(ABOVE_TOKENS_KEY))
    overlap = None
    if overlap_on:
        group = get_tp_group().make_sibling_device_group("farskip_routed")
        overlap = RoutedAllReduce(group, above, reduce_now=blocking_all_reduce)
        _place_routed_ops(vllm_config, piecewise, log)
    chosen = set(converted)
    # the layers that may start a routed all-reduce for their successor: MoE layers (a converted dense one has no
    # routed part), whose successor is converted and on this stage
    starts = {
        i
        for i in converted
        if start <= i < end - 1 and i + 1 in chosen and is_moe_block(getattr(layers[i], family.mlp_attr))
    }
    attention = deepseek_attention if family.model_type.startswith("deepseek") else default_attention
    for index in converted:
        if not start <= index < end:
            continue  # another pipeline stage holds it
        layer = layers[index]
        mlp = getattr(layer, family.mlp_attr)
        if is_moe_block(mlp):
            check_runner(mlp.experts, index, dtype)
        if getattr(layer, "use_sequence_parallel_moe", False):
            raise ValueError(f"FarSkip layer {index}: sequence-parallel MoE is not supported; drop that option")
        wiring = LayerWiring(
            index,
            # also across a pipeline-stage boundary: vLLM passes hidden and residual on as they are, (routed, n)
            after_converted=index - 1 in chosen,
            hands_over=index in starts,
            waits=index - 1 in starts,
            mlp_attr=family.mlp_attr,
            attention=attention,
            overlap=overlap,
        )
        layer.__class__ = farskip_layer_class(type(layer))
        layer._farskip = wiring
    log.info(
        "FarSkip connectivity on layers %s of %d (%s); routed all-reduce %s (tensor-parallel size %d), %s%s",
        converted,
        num_layers,
        family.architecture,
        "overlapped" if overlap_on else "blocking",
        tp_size,
        execution,
        f"; overlapped in forwards of more than {above} tokens (smaller ones and CUDA graphs: blocking)"
        if overlap_on
        else "",
    )
    return converted


def _farskip_model_class(family: ServedFamily) -> type:
    stock = getattr(importlib.import_module(family.module), family.architecture)

    def __init__(self, *, vllm_config, prefix: str = ""):
        stock.__init__(self, vllm_config=vllm_config, prefix=prefix)
        self.farskip_layers = convert(self, family, vllm_config)

    name = family.farskip_architecture
    doc = f"vLLM's {family.architecture} with FarSkip-Collective connectivity on the layers in config.farskip."
    return type(name, (stock,), {"__init__": __init__, "__module__": __name__, "__qualname__": name, "__doc__": doc})


class FarSkipForCausalLM(nn.Module):
    """What an export of a family vLLM lacks names (and fcsd 0.1's exports did): refused in one line when vLLM
    builds it. It has the text-generation interface vLLM checks first, so that this refusal is what the user sees."""

    def embed_input_ids(self, input_ids):  # never reached: __init__ refuses
        raise NotImplementedError

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        raise NotImplementedError

    def compute_logits(self, hidden_states):
        raise NotImplementedError

    def __init__(self, *, vllm_config, prefix: str = ""):
        model_type = getattr(vllm_config.model_config.hf_config, "model_type", "unknown")
        raise ValueError(
            f"vLLM has no FarSkip serving class for this export (model type {model_type!r}, architectures "
            f"[{UNSERVED_ARCHITECTURE!r}]): fcsd serves {served_families_text()}; re-export a served family with "
            "this fcsd's `fcsd export`"
        )


def __getattr__(name: str):
    family = BY_ARCHITECTURE.get(name)
    if family is None:
        raise AttributeError(name)
    cls = globals()[name] = _farskip_model_class(family)
    return cls
