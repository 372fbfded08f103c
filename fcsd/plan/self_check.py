"""``fcsd plan --measure``: the plan's estimate checks itself on whatever device is here.

The chosen candidate (or, when nothing fits, the closest one) is run for real at a reduced size: the model's widths
cut down (:func:`reduced_config`: hidden 256, experts 8, top-k at most 4, vocabulary 4096, at most 4 layers with
the same kinds of layers), sequences of 128 tokens, at most 4 processes (local gloo processes on a CPU; one GPU
each where there are enough) laid out as the candidate is (EP x FSDP2 as EP 2 x FSDP 2, expert parallelism alone
over all of them, FSDP2 over all of them), one micro-batch per step. The planner estimates the same reduced run
from its config alone; both peak memories and step times are printed. Step time is estimated from the step's FLOPs
at the speed this device reaches on a large matrix product (measured here, so the figure checks the FLOP count, not
a preset).
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import torch

WIDTHS = {  # attribute -> reduced value (only attributes the config has are changed)
    "hidden_size": 256,
    "intermediate_size": 512,
    "intermediate_size_mlp": 512,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 256,
    "num_attention_heads": 4,
    "head_dim": 64,
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 48,
    "v_head_dim": 64,
}
EXPERTS = ("num_experts", "n_routed_experts", "num_local_experts")
SEQ_LEN, MAX_PROCESSES, MAX_LAYERS = 128, 4, 4


def reduced_config(model_config):
    """A small config of the same family and layer pattern (see the module docstring)."""
    from fcsd.connectivity.families import text_config

    config = copy.deepcopy(text_config(model_config))
    values = config.to_dict()
    for key, value in WIDTHS.items():
        if values.get(key) is not None:
            values[key] = value
    if values.get("q_lora_rank"):
        values["q_lora_rank"] = 96
    if values.get("qk_rope_head_dim") and values.get("head_dim") is not None:
        values["head_dim"] = values["qk_rope_head_dim"]  # DeepSeek-V3's rotary size is its head_dim
    if "num_key_value_heads" in values:
        mla = values.get("kv_lora_rank") is not None
        values["num_key_value_heads"] = 4 if mla else min(values["num_key_value_heads"], 2)
    for key in EXPERTS:
        if values.get(key):
            values[key] = min(values[key], 8)
    values["num_experts_per_tok"] = min(values.get("num_experts_per_tok", 1), 4)
    for key, limit in (("n_group", 4), ("topk_group", 2)):
        if values.get(key):
            values[key] = min(values[key], limit)
    values["vocab_size"] = min(values["vocab_size"], 4096)
    values["num_hidden_layers"] = min(values["num_hidden_layers"], MAX_LAYERS)
    if values.get("first_k_dense_replace"):
        values["first_k_dense_replace"] = 1
    for derived in ("layer_types", "no_rope_layers", "moe_layers"):
        values.pop(derived, None)
    if values.get("mlp_only_layers"):
        values["mlp_only_layers"] = [i for i in values["mlp_only_layers"] if i < values["num_hidden_layers"]]
    values.pop("model_type", None)
    return type(config)(**values)


def reduced_run(plan):
    """``(model config, run config, layout)`` of the reduced run of the plan's chosen (or closest) candidate."""
    candidate = plan.chosen or _closest(plan)
    return reduced(plan.source.config, plan.config, candidate.layout)


def reduced(model_config, fcsd_config, layout):
    """``(model config, run config, layout)``: ``layout``'s run at the reduced size (see the module docstring)."""
    processes = min(layout.processes, MAX_PROCESSES)
    if processes == 1:
        layout = replace(layout, strategy="single", processes=1, ep_size=1, offload=False)
    else:
        ep = {"ep": processes, "ep_fsdp": max(2, min(layout.ep_size, processes // 2))}.get(layout.strategy, 1)
        layout = replace(layout, processes=processes, ep_size=ep)
    config = copy.deepcopy(fcsd_config)
    config.data.seq_len = SEQ_LEN
    config.train.batch_tokens = SEQ_LEN * layout.micro_batch * processes
    config.train.max_tokens = max(config.train.max_tokens, config.train.batch_tokens)
    config.train.warmup_steps = 0
    config.train.loss_chunk_size = min(config.train.loss_chunk_size, SEQ_LEN)
    return reduced_config(model_config), config, layout


def _closest(plan):
    searched = plan.fallback or plan.search
    simulated = [c for c in searched.candidates if c.estimate is not None]
    return min(simulated, key=lambda c: c.estimate.peak) if simulated else searched.candidates[0]


def matmul_rate(device: torch.device) -> float:
    """FLOP/s this device reaches on a large matrix product (bf16 on a GPU, fp32 on a CPU)."""
    cuda = device.type == "cuda"
    size = 4096 if cuda else 512
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    a @ a  # warm-up
    repeats = 20 if cuda else 5
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ a
    _sync(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def check_plan(plan) -> dict:
    """Estimate and measure the reduced run of the plan's chosen candidate (see the module docstring); the figures as
    a dict."""
    return check_run(*reduced_run(plan))


def check_run(model_config, config, layout) -> dict:
    """Estimate and measure ``layout``'s run here (:func:`check_plan` on a reduced run); the figures as a dict."""
    from fcsd.plan.measure import measure_processes
    from fcsd.plan.simulate import estimate_step

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    multi_gpu = device.type == "cuda" and torch.cuda.device_count() >= layout.processes
    if layout.processes > 1 and device.type == "cuda" and not multi_gpu:
        device = torch.device("cpu")  # several ranks need a GPU each (NCCL); gloo processes on the CPU otherwise
    target = device.type
    estimate = estimate_step(model_config, config, layout, target)
    measured = measure_processes(model_config, config, layout, str(device))
    rate = matmul_rate(device)
    flops = sum(estimate.flops.values()) * estimate.accumulation
    peak = max(m.peak for m in measured)
    seconds = max(m.step_seconds for m in measured)
    return {
        "device": str(device),
        "layout": layout.name,
        "processes": layout.processes,
        "config": {k: getattr(model_config, k, None) for k in ("hidden_size", "num_hidden_layers", "vocab_size")},
        "estimated_peak": estimate.peak,
        "measured_peak": peak,
        "peak_ratio": estimate.peak / peak if peak else None,
        "estimated_step_s": flops / rate,
        "measured_step_s": seconds,
        "time_ratio": flops / rate / seconds if seconds else None,
        "matmul_tflops": rate / 1e12,
        "weights_exact": all(m.weights == estimate.weights for m in measured[:1]),
        "optimizer_exact": all(m.optimizer == estimate.optimizer for m in measured[:1]),
    }


def format_check(result: dict) -> str:
    mib = 2**20
    return "\n".join(
        [
            "",
            f"measure    {result['layout']} at reduced size ({result['config']}), on {result['device']}:",
            f"           peak memory: estimated {result['estimated_peak'] / mib:.1f} MiB, measured "
            f"{result['measured_peak'] / mib:.1f} MiB (x{result['peak_ratio']:.3f}); weights and AdamW bytes "
            + ("exact" if result["weights_exact"] and result["optimizer_exact"] else "DIFFERENT"),
            f"           step time: estimated {result['estimated_step_s'] * 1e3:.1f} ms (FLOPs at "
            f"{result['matmul_tflops']:.2f} TFLOP/s, this device's matrix product), measured "
            f"{result['measured_step_s'] * 1e3:.1f} ms (x{result['time_ratio']:.2f})",
        ]
    )
