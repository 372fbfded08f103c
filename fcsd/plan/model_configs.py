"""Where ``fcsd plan`` gets a model's config: a local folder, ``demo``, an embedded copy of a public checkpoint's
``config.json`` (the paper's models, so that a plan needs no hub: the recipes' hub ids, their preset names and
``deepseek-v3``), else the hub (``config.json`` only)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fcsd.plan.perfmodel import PRESETS as PERFMODEL_PRESETS

# the architecture fields of each public config.json (routing details that do not change shapes are left out)
EMBEDDED = {
    "Qwen/Qwen3-30B-A3B": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    "deepseek-ai/DeepSeek-V2-Lite-Chat": dict(
        model_type="deepseek_v2",
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_shared_experts=2,
        n_routed_experts=64,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
        max_position_embeddings=163840,
        tie_word_embeddings=False,
    ),
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": dict(  # the text model, which FCSD trains
        model_type="llama4_text",
        vocab_size=202048,
        hidden_size=5120,
        intermediate_size=8192,
        intermediate_size_mlp=16384,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        num_local_experts=16,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        attention_chunk_size=8192,
        use_qk_norm=True,
        max_position_embeddings=10485760,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
    "deepseek-ai/DeepSeek-V3": dict(
        PERFMODEL_PRESETS["deepseek-v3"],
        max_position_embeddings=163840,
        # the release is block-FP8: an export keeps that format (fcsd plan's serving check counts its bytes)
        quantization_config=dict(
            quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128], activation_scheme="dynamic"
        ),
    ),
}
ALIASES = {
    "qwen3_30b_a3b": "Qwen/Qwen3-30B-A3B",
    "deepseek_v2_lite": "deepseek-ai/DeepSeek-V2-Lite-Chat",
    "deepseek-ai/DeepSeek-V2-Lite": "deepseek-ai/DeepSeek-V2-Lite-Chat",
    "llama4_scout": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "deepseek_v3": "deepseek-ai/DeepSeek-V3",
}


@dataclass
class ModelSource:
    name: str  # what the printed ``fcsd convert`` command names (a hub id, a folder, or demo)
    config: object  # the transformers config
    origin: str  # where the config came from, in words


def load_model_config(name: str) -> ModelSource:
    """The config of ``name`` (see the module docstring); a dense or unsupported model is refused by the caller."""
    from transformers import AutoConfig

    if Path(name).expanduser().is_dir():
        from fcsd.loading import load_config

        return ModelSource(name, load_config(str(Path(name).expanduser())), f"{name}/config.json")
    if name == "demo":
        from fcsd.embedded.assets import demo_config, demo_dir

        built = demo_dir() / "model"
        if (built / "config.json").exists():
            from fcsd.loading import load_config

            return ModelSource("demo", load_config(str(built)), "the demo checkpoint")
        return ModelSource("demo", demo_config(300), "the demo's config (the demo is not built yet)")
    hub_id = ALIASES.get(name, name)
    if hub_id in EMBEDDED:
        values = dict(EMBEDDED[hub_id])
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        return ModelSource(hub_id, config, f"embedded copy of {hub_id}'s config.json")
    from fcsd.loading import load_config
    from fcsd.sources import resolve_model

    return ModelSource(name, load_config(resolve_model(name)), f"{name} config.json (hub)")


SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
SHAPE_FIELDS += ("moe_intermediate_size", "intermediate_size", "n_routed_experts", "num_experts", "num_local_experts")


def embedded_name(source: ModelSource) -> str | None:
    """The hub id of the embedded config ``source``'s architecture matches (a local copy of a paper model's
    ``config.json`` included), else None: what published figures are looked up by."""
    from fcsd.connectivity.families import text_config

    if source.name in EMBEDDED:
        return source.name
    text = text_config(source.config)
    for hub_id, values in EMBEDDED.items():
        if all(getattr(text, key, None) == values[key] for key in SHAPE_FIELDS if key in values):
            return hub_id
    return None
