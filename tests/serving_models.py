"""Tiny random models that vLLM's CPU build can serve: its attention kernels take head sizes of 32 and up, and its
CPU MLA backend DeepSeek's real latent sizes (kv_lora_rank 512 + qk_rope_head_dim 64)."""

from __future__ import annotations

import torch
import transformers

COMMON = dict(
    hidden_size=64,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,  # sublayers that move the residual stream: stock and FarSkip wiring then disagree clearly
)


def _deepseek(version: int):
    cls = transformers.DeepseekV2Config if version == 2 else transformers.DeepseekV3Config
    extra = (
        dict(topk_method="group_limited_greedy")
        if version == 2
        else dict(norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid")  # as DeepSeek-V3's config.json
    )
    # vLLM 0.32's stock DeepSeek attention drifts from transformers' as weights grow (0.34 in log-probability at
    # initializer_range 0.1, stock checkpoints, no FarSkip involved; ~2e-3 at 0.02, where FarSkip vs stock wiring
    # still differs by 0.03): keep transformers' default scale so the comparison sees the wiring
    return cls(
        **{**COMMON, "initializer_range": 0.02},
        num_hidden_layers=3,
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        q_lora_rank=None if version == 2 else 48,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
        **extra,
    )


CONFIGS = {
    # Qwen3-MoE: a dense layer (mlp_only_layers) between MoE layers
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        num_hidden_layers=4,
        head_dim=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        norm_topk_prob=True,
    ),
    # Qwen2-MoE: gated shared expert, a dense first layer
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON,
        num_hidden_layers=3,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=32,
        mlp_only_layers=[0],
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, num_hidden_layers=3, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2
    ),
    "olmoe": lambda: transformers.OlmoeConfig(
        **COMMON, num_hidden_layers=3, intermediate_size=32, num_experts=4, num_experts_per_tok=2
    ),
    "deepseek_v2": lambda: _deepseek(2),
    "deepseek_v3": lambda: _deepseek(3),
}


def build(name: str, vocab_size: int, seed: int = 0):
    """A tiny random fp32 causal LM of family ``name`` with real router scores (zero routers route degenerately)."""
    config = CONFIGS[name]()
    config.vocab_size = vocab_size
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for module_name, param in [*model.named_parameters(), *model.named_buffers()]:
            if module_name.endswith("gate.weight") or "shared_expert_gate" in module_name:
                param.normal_(0.0, 0.5)
            if module_name.endswith("e_score_correction_bias"):
                param.normal_(0.0, 0.1)
    return model
