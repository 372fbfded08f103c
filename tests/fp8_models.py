"""Tiny checkpoints in the hub's block-FP8 layout (DeepSeek-V3, the Qwen3 -FP8 releases), written here: e4m3
weights with a ``weight_scale_inv`` per block, the router, norms, embeddings, head and ``modules_to_not_convert``
left unquantized, the hub's ``quantization_config``; and the same model dequantized (what fcsd must read)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tiny_models import build

from fcsd.block_fp8 import quantize_blocks

BLOCK = [16, 16]  # the tiny models' sizes are multiples of 16, except MLA's 12-wide projections (partial blocks)
NOT_CONVERTED = {
    "deepseek_v3": ["model.layers.2.self_attn.kv_b_proj"],
    "qwen3_moe": ["model.layers.2.self_attn.o_proj"],
}


def unquantized(key: str, family: str) -> bool:
    """Tensors the hub's FP8 releases keep in bf16: everything but the weights of linears (router included)."""
    module = key.removesuffix(".weight")
    return (
        not key.endswith(".weight")
        or "norm" in key
        or key.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight"))
        or module in NOT_CONVERTED[family]
    )


def write_fp8_checkpoint(
    folder: Path,
    family: str,
    seed: int = 0,
    model=None,
    power_of_two: bool = False,
    tokenizer=None,
    ignored_layer: bool = False,
) -> Path:
    """``folder/fp8`` (the block-FP8 checkpoint, bf16 where unquantized) and ``folder/bf16`` (the same model
    dequantized to bf16, saved as a plain checkpoint) of a tiny ``family`` model (or ``model``), with ``tokenizer``
    saved beside; returns ``folder``. ``power_of_two``: scales are powers of two (``scale_fmt: ue8m0``), so that
    the bf16 copy holds the dequantized weights exactly (an e4m3 value times a power of two is a bf16 value).
    ``ignored_layer``: both also hold a copy of the last layer's tensors as layer ``num_hidden_layers``, which the
    model does not load (as DeepSeek-V3 ships its multi-token prediction layer, model.layers.61, beside 61 layers).
    """
    model = model if model is not None else build(family, seed)
    model.to(torch.bfloat16).save_pretrained(folder / "source")
    state = load_file(str(folder / "source" / "model.safetensors"))
    if ignored_layer:
        last = model.config.num_hidden_layers - 1
        state.update(
            (key.replace(f".{last}.", f".{last + 1}.", 1), tensor.clone())
            for key, tensor in list(state.items())
            if key.startswith(f"model.layers.{last}.")
        )
    fp8, dequantized = {}, {}
    for key, tensor in state.items():
        if tensor.ndim < 2 or unquantized(key, family):
            fp8[key] = dequantized[key] = tensor
            continue
        weight, scale = quantize_blocks(tensor, BLOCK, power_of_two)
        fp8[key], fp8[key + "_scale_inv"] = weight, scale
        expanded = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[
            : tensor.shape[0], : tensor.shape[1]
        ]
        dequantized[key] = (weight.float() * expanded).to(torch.bfloat16)
    config = json.loads((folder / "source" / "config.json").read_text())
    for name, tensors in (("fp8", fp8), ("bf16", dequantized)):
        (folder / name).mkdir(parents=True)
        save_file(tensors, str(folder / name / "model.safetensors"), metadata={"format": "pt"})
        values = {**config, "dtype": "bfloat16"}
        if name == "fp8":
            values["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "weight_block_size": BLOCK,
                "activation_scheme": "dynamic",
                "modules_to_not_convert": NOT_CONVERTED[family],
            }
            if power_of_two:
                values["quantization_config"]["scale_fmt"] = "ue8m0"
        (folder / name / "config.json").write_text(json.dumps(values, indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(folder / name)
    return folder
