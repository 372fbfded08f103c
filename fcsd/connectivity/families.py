"""The registry of supported MoE families: one table row per Hugging Face model type.

A row says where the decoder layers, the MLP/MoE block and its parts are, where the router is and how to read it,
and which per-expert tensors a permutation of the experts moves (expert placement); the functions it names live in
:mod:`fcsd.connectivity.adapters`. Adding a family is one row here, an adapter only where the MoE block differs,
and one tiny config in ``tests/tiny_models.py``. Every decoder layer of a supported family must have ``self_attn``,
``input_layernorm`` and ``post_attention_layernorm`` (all the families below share that layout).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fcsd.connectivity.adapters import (
    Routing,
    TopK,
    deepseek_groups,
    gate_topk,
    llama4_experts,
    llama4_route,
    llama4_topk,
    mixtral_route,
    qwen2_gated_shared,
    shared_module,
    topk_route,
    weighted_experts,
)

MlpPart = Callable[[nn.Module, torch.Tensor], torch.Tensor]
RoutePart = Callable[[nn.Module, torch.Tensor], Routing]
ExpertsPart = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ReadTopK = Callable[[nn.Module, object], TopK]


@dataclass(frozen=True)
class MoEFamily:
    """How FarSkip finds its way around one model family."""

    name: str
    model_type: str  # config.model_type of the (text) decoder
    architectures: tuple[str, ...]  # the causal-LM classes users load, for messages
    decoder_layer: str  # class name of the decoder layer
    moe_block: str  # class name of the routed MoE block (other MLP classes in the stack are dense)
    route: RoutePart  # router of a MoE block: logits, top-k ids and weights (adapters.Routing)
    experts: ExpertsPart = weighted_experts  # routed experts on given rows, expert ids and weights
    shared: MlpPart | None = None  # shared-expert output of a MoE block, None if the family has none
    mlp_attr: str = "mlp"  # decoder-layer attribute that holds the MLP or MoE block
    experts_attr: str = "experts"  # MoE-block attribute holding the routed experts (parameter counts)
    top_k_attr: str = "num_experts_per_tok"  # config attribute: experts per token
    router_attr: str = "gate"  # MoE-block attribute holding the router module
    read_topk: ReadTopK = gate_topk  # (router, router forward output) -> (top-k ids, weights), as ``route`` reads it
    router_per_expert: tuple[str, ...] = ("weight",)  # router parameters/buffers with one row per expert (dim 0)
    experts_per_expert: tuple[str, ...] = ("gate_up_proj", "down_proj")  # fused expert tensors, dim 0 = expert
    groups: Callable[[object], int] | None = None  # (text config) -> expert groups of group-limited routing
    weights_on_input: bool = False  # the routing weight scales the expert input, not its output (Llama-4)

    def router(self, mlp: nn.Module) -> nn.Module:
        """The router module of the MoE block ``mlp`` (route recording hooks it)."""
        return getattr(mlp, self.router_attr)

    def routing_groups(self, config) -> int:
        """Contiguous expert groups the router's group-limited routing selects among (1 if none): a permutation of
        the experts keeps routing exact only if it maps every group onto a group."""
        return self.groups(text_config(config)) if self.groups is not None else 1

    def split_mlp(self, mlp: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(shared_k, routed_k)`` of design §2 for the block ``mlp`` on its input ``x``.

        A dense MLP counts wholly as shared; a family without shared experts returns ``None`` for that part.
        """
        if not self.is_moe(mlp):
            return mlp(x), None
        shared = self.shared(mlp, x) if self.shared is not None else None
        return shared, self.routed(mlp, x)

    def routed(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Routed-expert output of the MoE block ``mlp``: its router, then its experts on the chosen ids."""
        routing = self.route(mlp, x.reshape(-1, x.shape[-1]))
        return self.experts(mlp, routing.tokens, routing.topk_ids, routing.topk_weights).view(x.shape)

    def is_moe(self, mlp: nn.Module) -> bool:
        return type(mlp).__name__ == self.moe_block


FAMILIES: tuple[MoEFamily, ...] = (
    MoEFamily(
        name="DeepSeek-V2",
        model_type="deepseek_v2",
        architectures=("DeepseekV2ForCausalLM",),
        decoder_layer="DeepseekV2DecoderLayer",
        moe_block="DeepseekV2Moe",
        route=topk_route,
        shared=shared_module("shared_experts"),
        groups=deepseek_groups(always=False),
    ),
    MoEFamily(
        name="DeepSeek-V3",
        model_type="deepseek_v3",
        architectures=("DeepseekV3ForCausalLM",),
        decoder_layer="DeepseekV3DecoderLayer",
        moe_block="DeepseekV3MoE",
        route=topk_route,
        shared=shared_module("shared_experts"),
        router_per_expert=("weight", "e_score_correction_bias"),
        groups=deepseek_groups(always=True),
    ),
    MoEFamily(
        name="Qwen3-MoE",
        model_type="qwen3_moe",
        architectures=("Qwen3MoeForCausalLM",),
        decoder_layer="Qwen3MoeDecoderLayer",
        moe_block="Qwen3MoeSparseMoeBlock",
        route=topk_route,
    ),
    MoEFamily(
        name="Qwen2-MoE",
        model_type="qwen2_moe",
        architectures=("Qwen2MoeForCausalLM",),
        decoder_layer="Qwen2MoeDecoderLayer",
        moe_block="Qwen2MoeSparseMoeBlock",
        route=topk_route,
        shared=qwen2_gated_shared,
    ),
    MoEFamily(
        name="Llama-4",
        model_type="llama4_text",
        architectures=("Llama4ForCausalLM", "Llama4ForConditionalGeneration (text tower)"),
        decoder_layer="Llama4TextDecoderLayer",
        moe_block="Llama4TextMoe",
        route=llama4_route,
        experts=llama4_experts,
        shared=shared_module("shared_expert"),
        mlp_attr="feed_forward",
        router_attr="router",
        read_topk=llama4_topk,
        router_per_expert=("weight", "bias"),
        weights_on_input=True,
    ),
    MoEFamily(
        name="Mixtral",
        model_type="mixtral",
        architectures=("MixtralForCausalLM",),
        decoder_layer="MixtralDecoderLayer",
        moe_block="MixtralSparseMoeBlock",
        route=mixtral_route,
    ),
    MoEFamily(
        name="OLMoE",
        model_type="olmoe",
        architectures=("OlmoeForCausalLM",),
        decoder_layer="OlmoeDecoderLayer",
        moe_block="OlmoeSparseMoeBlock",
        route=topk_route,
    ),
)

_BY_MODEL_TYPE = {family.model_type: family for family in FAMILIES}


class UnsupportedModelError(ValueError):
    """The model is not a supported MoE family."""


def supported_families_text() -> str:
    return "; ".join(f"{f.name} ({f.model_type}: {', '.join(f.architectures)})" for f in FAMILIES)


EXPORTED_PREFIX = "farskip_"  # exported checkpoints carry model_type "farskip_<stock type>" (fcsd.export)


def base_model_type(model_type: str) -> str:
    """The stock transformers model type behind a (possibly exported FarSkip) model type."""
    return model_type.removeprefix(EXPORTED_PREFIX)


def text_config(config):
    """The decoder's config: ``config`` itself, or its ``text_config`` for a multimodal model (Llama-4)."""
    if base_model_type(config.model_type) in _BY_MODEL_TYPE:
        return config
    sub = getattr(config, "text_config", None)
    if sub is not None and getattr(sub, "model_type", None) in _BY_MODEL_TYPE:
        return sub
    return config


def text_model(model: nn.Module) -> nn.Module:
    """The causal text model to run on text-only input: the model itself, or the language model of a multimodal
    wrapper (Llama-4's ``Llama4ForConditionalGeneration``, whose own forward fails on text-only input in
    transformers 5)."""
    runner = getattr(model, "language_model", None)
    if text_config(model.config) is not model.config and isinstance(runner, nn.Module):
        return runner
    return model


def final_norm(model: nn.Module) -> nn.Module:
    """The decoder's final norm (the LM head's input). ``get_decoder()`` is not enough: transformers 5 returns a
    ``Llama4ForCausalLM`` itself (its base-model prefix names the multimodal wrapper's attribute), whose norm sits in
    ``.model``."""
    for decoder in (model.get_decoder(), getattr(model, "model", None)):
        if isinstance(getattr(decoder, "norm", None), nn.Module):
            return decoder.norm
    raise ValueError(f"{type(model).__name__}: no final norm found (expected get_decoder().norm or model.norm)")


def family_for_config(config) -> MoEFamily:
    """The family row for a transformers config, or :class:`UnsupportedModelError` listing what is supported; the
    config's shape is checked too (:func:`check_config_shape`), so every command that reads a config (inspect,
    perfmodel, plan, probe, routes, convert, the loaders) refuses an impossible one the same way."""
    decoder_config = text_config(config)
    family = _BY_MODEL_TYPE.get(base_model_type(decoder_config.model_type))
    if family is None:
        archs = ", ".join(getattr(config, "architectures", None) or []) or "unknown architecture"
        raise UnsupportedModelError(
            f"fcsd does not support model type {config.model_type!r} ({archs}). Supported families: "
            f"{supported_families_text()}. A new family is one row in fcsd/connectivity/families.py."
        )
    check_config_shape(decoder_config, family)
    return family


EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")  # routed experts, by family


class ConfigShapeError(ValueError):
    """A config whose numbers cannot describe a model (top-k above the expert count, ...)."""


def check_config_shape(config, family: MoEFamily) -> None:
    """Refuse, naming the field and its bound, a decoder config that no model can have: no layers or heads, a
    top-k of zero or above the routed-expert count, key/value heads that do not divide the heads, DeepSeek expert
    groups that do not divide the experts or cannot hold the top-k."""

    def value(*keys):
        return next((getattr(config, key) for key in keys if getattr(config, key, None) is not None), None)

    experts, top_k = value(*EXPERT_COUNT_KEYS), value(family.top_k_attr)
    heads, kv_heads = value("num_attention_heads"), value("num_key_value_heads")
    problems = []
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        if not isinstance(value(key), int) or value(key) < 1:
            problems.append(f"{key}={value(key)} (it must be a whole number of at least 1)")
    if isinstance(experts, int) and isinstance(top_k, int):
        if experts < 1 or not 1 <= top_k <= experts:
            bound = f"top-k must lie in 1..{experts}"
            problems.append(f"{family.top_k_attr}={top_k} with {experts} routed experts ({bound})")
    if isinstance(heads, int) and isinstance(kv_heads, int) and (kv_heads < 1 or heads % kv_heads):
        problems.append(f"num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")
    groups, topk_group = value("n_group"), value("topk_group")
    if family.groups is not None and isinstance(groups, int) and isinstance(experts, int):
        if groups < 1 or experts % groups:
            problems.append(f"n_group={groups} does not divide the {experts} routed experts")
        elif isinstance(topk_group, int) and not 1 <= topk_group <= groups:
            problems.append(f"topk_group={topk_group} is outside 1..n_group={groups}")
        elif isinstance(topk_group, int) and isinstance(top_k, int) and top_k > topk_group * experts // groups:
            problems.append(
                f"{family.top_k_attr}={top_k} is more than the {topk_group * experts // groups} experts of the "
                f"topk_group={topk_group} groups a token may use"
            )
    if problems:
        raise ConfigShapeError(
            f"the {family.name} config is impossible: {'; '.join(problems)}; fix config.json (or choose another "
            "checkpoint)"
        )


def find_decoder_layers(model: nn.Module, family: MoEFamily) -> nn.ModuleList:
    """The ``nn.ModuleList`` of the model's decoder layers (of the text tower for multimodal models)."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            if all(
                type(layer).__name__ == family.decoder_layer or _base_name(layer) == family.decoder_layer
                for layer in module
            ):
                return module
    raise UnsupportedModelError(
        f"found no list of {family.decoder_layer} modules in {type(model).__name__}; is this a {family.name} model?"
    )


def moe_blocks(model: nn.Module, family: MoEFamily) -> dict[int, nn.Module]:
    """``{decoder layer index: MoE block}`` for every MoE layer of ``model`` (dense layers skipped)."""
    blocks = {}
    for index, layer in enumerate(find_decoder_layers(model, family)):
        mlp = getattr(layer, family.mlp_attr, None)
        if mlp is not None and family.is_moe(mlp):
            blocks[index] = mlp
    return blocks


def _base_name(layer: nn.Module) -> str:
    base = getattr(type(layer), "_farskip_base", None)
    return base.__name__ if base is not None else ""


def meta_model(config):
    """The causal LM of ``config`` built on the ``meta`` device: exact shapes, no memory, no weights read."""
    import transformers

    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:
            arch = (getattr(config, "architectures", None) or [None])[0]
            if arch is None or not hasattr(transformers, arch):
                raise
            return getattr(transformers, arch)._from_config(config)


def expert_count(experts) -> int:
    """Number of routed experts in an experts module (a ModuleList or fused 3-D weights)."""
    if isinstance(experts, torch.nn.ModuleList):
        return len(experts)
    return next(experts.parameters()).shape[0]  # fused 3-D expert weights: (num_experts, ...)
