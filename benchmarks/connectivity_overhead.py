"""Forward/backward cost of FarSkip connectivity against the stock Hugging Face model, side by side in one run.

The rewiring computes the routed and shared experts separately and hands the partial stream between layers; this
measures what that costs on one device (no expert parallelism, so FarSkip cannot win anything here: a ratio near
1.0 is the goal). Prints median times and the ratio FarSkip / stock.

    python benchmarks/connectivity_overhead.py [--device cuda] [--dtype bfloat16] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

import fcsd


def qwen3_moe(hidden: int, layers: int, experts: int) -> transformers.Qwen3MoeConfig:
    return transformers.Qwen3MoeConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(hidden // 256, 1),
        head_dim=64,
        num_experts=experts,
        num_experts_per_tok=8,
        norm_topk_prob=True,
    )


def timed_pair(model, step, device: str, repeats: int) -> tuple[float, float]:
    """Median seconds of ``step`` with stock and FarSkip connectivity, interleaved so drift hits both alike."""
    samples: dict[bool, list[float]] = {False: [], True: []}
    for repeat in range(repeats + 1):
        for farskip in (False, True):
            fcsd.apply_farskip(model, "all" if farskip else "none")
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            if device == "cuda":
                torch.cuda.synchronize()
            if repeat:  # the first round is warm-up
                samples[farskip].append(time.perf_counter() - start)
    return statistics.median(samples[False]), statistics.median(samples[True])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per step (sequences of 512)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = qwen3_moe(args.hidden, args.layers, args.experts)
    model = transformers.Qwen3MoeForCausalLM(config).to(args.device, getattr(torch, args.dtype))
    ids = torch.randint(0, config.vocab_size, (max(args.tokens // 512, 1), min(args.tokens, 512)), device=args.device)

    def forward():
        with torch.no_grad():
            model(input_ids=ids)

    def train_step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    print(
        f"Qwen3-MoE {args.layers} layers, hidden {args.hidden}, {args.experts} experts top-8, "
        f"{ids.numel()} tokens, {args.device} {args.dtype}"
    )
    for name, step in (("forward", forward), ("forward+backward", train_step)):
        stock, farskip = timed_pair(model, step, args.device, args.repeats)
        print(
            f"{name:<17} stock {stock * 1e3:8.1f} ms   farskip {farskip * 1e3:8.1f} ms   "
            f"ratio farskip/stock {farskip / stock:.3f}"
        )


if __name__ == "__main__":
    main()
