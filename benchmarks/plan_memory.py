"""`fcsd plan`'s memory estimate against measured CPU training steps, on ~100M-parameter configs of three families.

For DeepSeek-V2, Qwen3-MoE and Llama-4 (text) configs of about 100M parameters (hidden 512, 16 experts, vocabulary
32,000, 6 layers), one FCSD training step (online teacher, fp32 on CPU, last 50% of the layers converted) is
estimated from the config alone (fake tensors, depth reduction: :func:`fcsd.plan.simulate.estimate_step`) and
measured for real (:mod:`fcsd.plan.measure`: the tensors alive before the step plus the CPU allocator's events
during it), in one process and in two expert-parallel gloo processes (EP=2, each rank measured). The ratio
estimated / measured of the peak is printed per family and rank, with the exact check of the weights and AdamW
bytes, and the time the estimate took.

    python benchmarks/plan_memory.py [--families deepseek_v2,qwen3_moe,llama4_text] [--seq-len 256] [--json]

Results are recorded in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import time

import transformers

COMMON = dict(vocab_size=32000, hidden_size=512, num_attention_heads=8, max_position_embeddings=4096)


def config_of(family: str, layers: int = 6):
    """A ~100M-parameter config of ``family`` (most of it in the routed experts and the embeddings)."""
    if family == "deepseek_v2":
        return transformers.DeepseekV2Config(
            **COMMON,
            num_key_value_heads=8,
            num_hidden_layers=layers,
            intermediate_size=2048,
            moe_intermediate_size=512,
            n_routed_experts=16,
            n_shared_experts=2,
            num_experts_per_tok=4,
            first_k_dense_replace=1,
            kv_lora_rank=128,
            q_lora_rank=None,
            qk_rope_head_dim=32,
            qk_nope_head_dim=64,
            v_head_dim=64,
            n_group=1,
            topk_group=1,
            topk_method="greedy",
            tie_word_embeddings=False,
        )
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **COMMON,
            num_key_value_heads=4,
            head_dim=64,
            num_hidden_layers=layers,
            intermediate_size=2048,
            moe_intermediate_size=512,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        )
    if family == "llama4_text":
        return transformers.Llama4TextConfig(
            **COMMON,
            num_key_value_heads=4,
            head_dim=64,
            num_hidden_layers=layers,
            intermediate_size=512,
            intermediate_size_mlp=2048,
            num_local_experts=16,
            num_experts_per_tok=1,
            interleave_moe_layer_step=1,
            attention_chunk_size=8192,
            tie_word_embeddings=False,
        )
    raise ValueError(f"unknown family {family!r}")


def run_config(seq_len: int, sequences: int):
    from fcsd.distill.config import FCSDConfig

    config = FCSDConfig()
    config.data.path = "unused"
    config.data.seq_len, config.train.batch_tokens = seq_len, seq_len * sequences
    config.farskip.layers = "last:50%"
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="deepseek_v2,qwen3_moe,llama4_text")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from fcsd.plan.measure import measure_jobs
    from fcsd.plan.run import Layout
    from fcsd.plan.simulate import estimate_step

    families = args.families.split(",")
    rows = []
    for layout, sequences in ((Layout("single", 1, micro_batch=2), 2), (Layout("ep", 2, ep_size=2, micro_batch=2), 4)):
        jobs = [(config_of(f), run_config(args.seq_len, sequences), layout) for f in families]
        estimates = []
        for job in jobs:
            start = time.perf_counter()
            estimates.append((estimate_step(*job, "cpu"), time.perf_counter() - start))
        for family, (estimate, seconds), measured in zip(families, estimates, measure_jobs(jobs), strict=True):
            params = sum(
                p.numel() for p in transformers.AutoModelForCausalLM.from_config(config_of(family)).parameters()
            )
            for rank, m in enumerate(measured):
                rows.append(
                    {
                        "family": family,
                        "params_m": round(params / 1e6, 1),
                        "layout": layout.short,
                        "rank": rank,
                        "estimated_mib": estimate.peak / 2**20,
                        "measured_mib": m.peak / 2**20,
                        "ratio": estimate.peak / m.peak,
                        "weights_exact": estimate.weights == m.weights,
                        "optimizer_exact": estimate.optimizer == m.optimizer,
                        "estimate_s": seconds,
                        "measured_step_s": m.step_seconds,
                    }
                )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"{'family':<13}{'params':>8} {'layout':<16}{'rank':>5}{'estimated':>11}{'measured':>10}{'ratio':>8}  exact  "
        f"{'estimate':>9}{'step':>8}"
    )
    for r in rows:
        exact = "yes" if r["weights_exact"] and r["optimizer_exact"] else "NO"
        print(
            f"{r['family']:<13}{r['params_m']:>7.1f}M {r['layout']:<16}{r['rank']:>5}{r['estimated_mib']:>9.1f}Mi"
            f"{r['measured_mib']:>8.1f}Mi{r['ratio']:>8.3f}  {exact:<5}{r['estimate_s']:>8.1f}s"
            f"{r['measured_step_s']:>7.1f}s"
        )


if __name__ == "__main__":
    main()
