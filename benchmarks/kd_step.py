"""Throughput of one knowledge-distillation step: the plain Hugging Face loop, TRL's KD loss, and fcsd, side by side.

One step = frozen teacher forward + FarSkip student forward/backward + forward KL(teacher || student) over every
position + AdamW, on the same model, weights and token batch for all three:

* ``hf_loop``: full logits of both models, ``F.kl_div`` on fp32 log-softmaxes of the whole batch;
* ``trl``: TRL's distillation loss (``GKDTrainer.generalized_jsd_loss`` with beta=0, its forward KL) on full logits,
  i.e. the compute of TRL's ``compute_loss`` without the Trainer's data-loading overhead;
* ``fcsd``: :func:`fcsd.distill.objectives.micro_batch_loss`, the trainer's step (LM head and loss chunked over
  tokens, no full-vocabulary logits), on a student whose experts compute in the autocast dtype (``fcsd.precision``).

``hf_loop`` and ``trl`` run transformers' model as it comes: with fp32 master weights its grouped experts kernel
computes in fp32 under bf16 autocast. On a GPU their ratio to ``fcsd`` therefore includes that precision fix, not
only the chunked loss; ``--same-experts`` gives them fcsd's compute-dtype experts too, to separate the two.

Prints tokens/s, peak memory (CUDA) and ratios against ``hf_loop``.

    python benchmarks/kd_step.py                      # CPU-sized model
    python benchmarks/kd_step.py --preset paper       # Qwen3-MoE 64 experts top-8, vocab 151,936, 4 x 2048 tokens
    python benchmarks/kd_step.py --preset tiny --steps 2 --json kd.json   # seconds on a CPU (a smoke check)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import transformers

import fcsd
from fcsd.distill.config import RecoveryConfig, TrainConfig
from fcsd.distill.data import Packed
from fcsd.distill.objectives import micro_batch_loss
from fcsd.precision import experts_in_compute_dtype

PRESETS = {
    # ~1.2B total / ~0.3B active with the 151,936-token vocabulary (the design's reference model)
    "paper": dict(vocab=151936, hidden=1024, layers=12, experts=64, moe=512, heads=16, batch=4, seq=2048),
    "cpu": dict(vocab=32000, hidden=256, layers=4, experts=16, moe=128, heads=4, batch=4, seq=256),
    # the paper model's vocabulary and experts with 4 layers: loads and steps in seconds on one GPU
    "gpu_check": dict(vocab=151936, hidden=1024, layers=4, experts=64, moe=512, heads=16, batch=4, seq=2048),
    "tiny": dict(vocab=4096, hidden=64, layers=2, experts=8, moe=32, heads=4, batch=2, seq=64),
}


def build(preset: dict, device: str, experts_implementation: str | None):
    config = transformers.Qwen3MoeConfig(
        vocab_size=preset["vocab"],
        hidden_size=preset["hidden"],
        intermediate_size=4 * preset["hidden"],
        moe_intermediate_size=preset["moe"],
        num_hidden_layers=preset["layers"],
        num_attention_heads=preset["heads"],
        num_key_value_heads=max(preset["heads"] // 4, 1),
        head_dim=preset["hidden"] // preset["heads"],
        num_experts=preset["experts"],
        num_experts_per_tok=8,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    if experts_implementation:
        config._experts_implementation = experts_implementation
    torch.manual_seed(0)
    teacher = transformers.Qwen3MoeForCausalLM(config).to(device).eval().requires_grad_(False)
    student = transformers.Qwen3MoeForCausalLM(config).to(device)
    student.load_state_dict(teacher.state_dict())
    return teacher, fcsd.apply_farskip(student, "all")


def compute_dtype_copy(student, device: str):
    """A FarSkip student with ``student``'s weights whose experts run in the autocast dtype (the trainer's student:
    :func:`fcsd.distill.student_teacher.load_models` applies :func:`fcsd.precision.experts_in_compute_dtype`)."""
    copy = fcsd.apply_farskip(transformers.Qwen3MoeForCausalLM(student.config), "all")
    copy.load_state_dict(student.state_dict())
    experts_in_compute_dtype(copy)
    return copy.to(device)


def full_logits_step(student, teacher, batch: Packed, loss_fn) -> torch.Tensor:
    with torch.no_grad():
        teacher_logits = teacher(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    student_logits = student(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    return loss_fn(student_logits, teacher_logits)


def hf_kl(student_logits, teacher_logits):
    s = F.log_softmax(student_logits.float(), dim=-1).flatten(0, 1)
    t = F.log_softmax(teacher_logits.float(), dim=-1).flatten(0, 1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def trl_kl(student_logits, teacher_logits):
    from trl.experimental.gkd import GKDTrainer

    return GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, beta=0.0)


def make_step(name: str, student, teacher, batch: Packed, optimizer, autocast, loss_chunk_size: int):
    # forward KL, fused chunked head (no hidden-state guide: the step compared is the KL's)
    config = SimpleNamespace(train=TrainConfig(loss_chunk_size=loss_chunk_size), recovery=RecoveryConfig())
    tokens = batch.input_ids.numel()

    def step():
        with autocast():
            if name == "fcsd":
                loss = micro_batch_loss(student, student, batch, config, teacher).total / tokens
            else:
                loss = full_logits_step(student, teacher, batch, hf_kl if name == "hf_loop" else trl_kl)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None, help="default: on for CUDA")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--methods", default="hf_loop,trl,fcsd")
    parser.add_argument("--experts-implementation", help="e.g. eager, grouped_mm (default: the model's default)")
    chunk_help = "tokens per chunk of fcsd's fused LM head + loss (train.loss_chunk_size)"
    parser.add_argument("--loss-chunk-size", type=int, default=TrainConfig.loss_chunk_size, help=chunk_help)
    parser.add_argument("--json", metavar="OUT", help="also write the results to this JSON file")
    same = "every method's student computes its experts in the autocast dtype (default: fcsd's alone)"
    parser.add_argument("--same-experts", action="store_true", help=same)
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    bf16 = args.device == "cuda" if args.bf16 is None else args.bf16
    teacher, student = build(preset, args.device, args.experts_implementation)
    if bf16:
        teacher.to(torch.bfloat16)

    def autocast():
        return torch.autocast(args.device, dtype=torch.bfloat16, enabled=bf16)

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(preset["vocab"], (preset["batch"], preset["seq"]), generator=generator).to(args.device)
    batch = Packed(ids, torch.arange(preset["seq"], device=args.device).expand_as(ids))
    tokens = ids.numel()
    results = {}
    methods = args.methods.split(",")
    if "trl" in methods and importlib.util.find_spec("trl") is None:
        print("trl is not installed (pip install -e '.[bench]'): running without the TRL competitor")
        methods.remove("trl")
    for name in methods:
        model = student
        if name == "fcsd" or args.same_experts:  # the trainer's student: experts in the autocast dtype (the stock
            # model is left as it is, parked in host memory meanwhile so that it does not count in this method's peak)
            model = compute_dtype_copy(student.to("cpu"), args.device)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
        step = make_step(name, model, teacher, batch, optimizer, autocast, args.loss_chunk_size)
        step()  # warm-up (allocations, kernels, AdamW state)
        if args.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
        results[name] = (tokens / statistics.median(times), peak)
        del optimizer, step, model
        student.to(args.device)
    print(f"KD step, preset {args.preset}, {tokens} tokens/step, {args.device}, bf16={bf16}, "
          f"loss chunks of {args.loss_chunk_size} tokens")  # fmt: skip
    print(f"{'method':<10}{'tokens/s':>12}{'peak GiB':>10}{'vs hf_loop':>12}")
    base = results.get("hf_loop", next(iter(results.values())))[0]
    for name, (rate, peak) in results.items():
        print(f"{name:<10}{rate:>12,.0f}{peak:>10.1f}{rate / base:>11.3f}x")
    if args.json:
        report = {
            "preset": args.preset,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
            "bf16": bf16,
            "tokens_per_step": tokens,
            "steps": args.steps,
            "methods": {
                name: {"tokens_per_s": rate, "peak_gib": None if peak != peak else peak, "vs_base": rate / base}
                for name, (rate, peak) in results.items()
            },
            "base": "hf_loop" if "hf_loop" in results else next(iter(results)),
            "skipped": [name for name in args.methods.split(",") if name not in results],
        }
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
