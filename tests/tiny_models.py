"""Tiny random configs of every supported family, built locally (no hub access)."""

from __future__ import annotations

import torch
import transformers

COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _deepseek(version: int):
    cls = transformers.DeepseekV2Config if version == 2 else transformers.DeepseekV3Config
    extra = dict(topk_method="group_limited_greedy") if version == 2 else dict(norm_topk_prob=True)
    common = {**COMMON, "num_key_value_heads": COMMON["num_attention_heads"]}  # MLA: one KV head per head
    return cls(
        **common,
        num_hidden_layers=4,
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=8,
        q_lora_rank=None if version == 2 else 12,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        head_dim=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
        **extra,
    )


CONFIGS = {
    "deepseek_v2": lambda: (transformers.DeepseekV2ForCausalLM, _deepseek(2)),
    "deepseek_v3": lambda: (transformers.DeepseekV3ForCausalLM, _deepseek(3)),
    "qwen3_moe": lambda: (
        transformers.Qwen3MoeForCausalLM,
        transformers.Qwen3MoeConfig(
            **COMMON,
            num_hidden_layers=4,
            head_dim=8,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        ),
    ),
    "qwen2_moe": lambda: (
        transformers.Qwen2MoeForCausalLM,
        transformers.Qwen2MoeConfig(
            **COMMON,
            num_hidden_layers=3,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=24,
            mlp_only_layers=[0],
        ),
    ),
    "llama4_text": lambda: (transformers.Llama4ForCausalLM, _llama4_text()),
    "llama4_multimodal": lambda: (
        transformers.Llama4ForConditionalGeneration,
        transformers.Llama4Config(
            text_config=_llama4_text().to_dict(),
            # a vision tower that runs: pixel shuffle (ratio 0.5) of 2 x 2 patches of 8 px makes 1 image token of
            # 4 x 16 = 64 features, the adapter's input (intermediate_size)
            vision_config=dict(
                hidden_size=16,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=16,
                patch_size=8,
                vision_output_dim=16,
                projector_input_dim=16,
                projector_output_dim=16,
            ),
            image_token_index=96,
        ),
    ),
    "mixtral": lambda: (
        transformers.MixtralForCausalLM,
        transformers.MixtralConfig(
            **COMMON, num_hidden_layers=3, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2
        ),
    ),
    "olmoe": lambda: (
        transformers.OlmoeForCausalLM,
        transformers.OlmoeConfig(
            **COMMON, num_hidden_layers=3, intermediate_size=24, num_experts=4, num_experts_per_tok=2
        ),
    ),
}

TEXT_FAMILIES = [name for name in CONFIGS if name != "llama4_multimodal"]


def _llama4_text():
    # 4 layers: MoE on odd layers (interleaved dense), chunked attention with a short chunk, a NoPE layer.
    return transformers.Llama4TextConfig(
        **COMMON,
        num_hidden_layers=4,
        head_dim=8,
        intermediate_size=16,
        intermediate_size_mlp=40,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        attention_chunk_size=6,
        no_rope_layer_interval=2,
    )


def build(name: str, seed: int = 0, dtype=torch.float32):
    """A tiny random model of family ``name`` in eval mode, eager attention, deterministic weights."""
    model_cls, config = CONFIGS[name]()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    # routers initialised at zero would make routing degenerate; give them real scores
    with torch.no_grad():
        for module_name, param in model.named_parameters():
            if "router" in module_name or module_name.endswith("gate.weight") or "shared_expert_gate" in module_name:
                param.normal_(0.0, 0.5)
    return model


def save_chat_model(folder, rows: list[dict], family: str = "qwen3_moe", vocab_size: int = 280):
    """A tiny random ``family`` model with a tokenizer trained locally on the chat ``rows``, both saved in
    ``folder``; returns the tokenizer."""
    from fcsd.embedded.tokenizer import train_tokenizer

    tokenizer = train_tokenizer((m["content"] for r in rows for m in r["messages"]), vocab_size=vocab_size)
    model = build(family)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return tokenizer
