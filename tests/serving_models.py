"""Tiny random models the serving engines run on CPU, and the comparison of their outputs with fcsd's. vLLM's CPU
build's attention kernels take head sizes of 32 and up, and its CPU MLA backend DeepSeek's real latent sizes
(kv_lora_rank 512 + qk_rope_head_dim 64)."""

from __future__ import annotations

import torch
import transformers

PROMPTS = [[5, 17, 33, 8, 90, 41, 12], [7, 7, 100, 3, 250, 61, 9, 44, 18, 4, 77]]
MAX_TOKENS, TOP_N, LOGPROB_ATOL = 8, 5, 1e-2  # fp32; vLLM's CPU MLA differs from transformers by ~2e-3

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


YARN = dict(  # DeepSeek's YaRN (SGLang's CPU RoPE for MLA requires a scaling), 32 -> 128 positions
    rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=10000.0, mscale=1.0,
    mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
)  # fmt: skip


def _deepseek(version: int, **overrides):
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
        **{**extra, **overrides},
    )


def _with(config, **values):
    for key, value in values.items():
        setattr(config, key, value)
    return config


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
    # SGLang's cases: its Qwen3-MoE has MoE layers only; tied embeddings (no lm_head.weight in the files), weights
    # large enough that greedy tokens vary; DeepSeek-V2 and V3 (q LoRA, biased sigmoid router) with MLA and YaRN
    "qwen3_moe_tied": lambda: _with(
        CONFIGS["qwen3_moe"](), tie_word_embeddings=True, initializer_range=0.3, mlp_only_layers=[]
    ),
    "deepseek_v2_yarn": lambda: _with(_deepseek(2, rope_parameters=YARN), initializer_range=0.1),
    "deepseek_v3_yarn": lambda: _with(_deepseek(3, rope_parameters=YARN), initializer_range=0.1),
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


@torch.no_grad()
def reference(model) -> list[dict]:
    """fcsd's greedy tokens and each step's top-N log-probabilities (transformers, fp32)."""
    results = []
    for ids in PROMPTS:
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
        steps = []
        for logits in out.logits:
            logprobs = torch.log_softmax(logits[0].float(), dim=-1)
            top = torch.topk(logprobs, TOP_N)
            steps.append({str(i): v for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)})
        results.append({"tokens": out.sequences[0, len(ids) :].tolist(), "logprobs": steps})
    return results


def mismatch(expected: list[dict], got: list[dict], min_equal: int = MAX_TOKENS // 2) -> str | None:
    """vLLM's `check_logprobs_close`: compare tokens up to the first mismatch, where each side's token must be in
    the other's top-N; matched tokens' log-probabilities must agree within LOGPROB_ATOL. Stricter than vLLM's: the
    greedy tokens must be equal for at least ``min_equal`` steps of every prompt (a near-tie may end a sequence's
    comparison only after that). None when close."""
    for p, (ref, out) in enumerate(zip(expected, got, strict=True)):
        for step, (token, other) in enumerate(zip(ref["tokens"], out["tokens"], strict=True)):
            ref_top, out_top = ref["logprobs"][step], out["logprobs"][step]
            if token == other:
                diff = abs(ref_top[str(token)] - out_top[str(token)])
                if diff > LOGPROB_ATOL:
                    return f"prompt {p} step {step}: log-probability of token {token} differs by {diff:.3g}"
                continue
            if str(other) not in ref_top or str(token) not in out_top:
                return f"prompt {p} step {step}: token {token} (fcsd), {other} (served) not in each other's top {TOP_N}"
            if step < min_equal:
                return f"prompt {p}: greedy tokens differ at step {step} ({token} vs {other}), before step {min_equal}"
            break  # a near-tie: the sequences diverge from here, as vLLM's own tests allow
    return None
