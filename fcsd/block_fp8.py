"""Block-FP8 checkpoints (design §8: DeepSeek-V3, the Qwen3 ``-FP8`` releases), read and written by fcsd itself.

The hub's format: every quantized linear stores an ``e4m3`` weight and a ``weight_scale_inv`` of
``ceil(out/B0) x ceil(in/B1)`` fp32 scales (``B = quantization_config.weight_block_size``, ``[128, 128]`` on the hub);
the weight is ``fp8 * scale`` block by block. Norms, embeddings, the head, the router and ``modules_to_not_convert``
carry no scale and stay as they are.

Reading (:func:`dequantizing_class`): fcsd dequantizes explicitly instead of letting transformers do it, because
transformers' own dequantization (``Fp8Dequantize``) sees a slice of a weight without its scales under shard-on-read
(EP x FSDP2: a rank's rows of a tensor do not line up with the 128 x 128 blocks). The checkpoint's tensors reach the
loader as lazy :class:`DequantizedSlice` objects: whatever slice a rank asks for, it reads the enclosing whole blocks
of the weight and the matching scales, dequantizes them (transformers' ``_dequantize_fp8_weight``) and cuts the slice
out, so one code path serves one process, expert parallelism and EP x FSDP2. The model is built without its
``quantization_config`` (plain modules in the training dtype: fp32 master weights as for any source), and
``config.fcsd_source_quantization`` (:data:`RECORD_KEY`) records what the source was, so that ``final/`` and the
export know it (:mod:`fcsd.export.fp8` writes the source's format back).
"""

from __future__ import annotations

import copy
from contextlib import ExitStack

import torch

#: the largest e4m3 value: a block's scale is its largest magnitude over this (DeepSeek-V3's convention)
FP8_MAX = 448.0
#: config.json key recording an FP8 source's ``quantization_config`` and which of its weights carried no scale
RECORD_KEY = "fcsd_source_quantization"
SCALE_SUFFIX = "_scale_inv"


def fp8_settings(config) -> dict | None:
    """The ``quantization_config`` of a block-FP8 checkpoint as a plain dict (None for an unquantized config); a
    variant fcsd cannot read (another format, per-tensor scales, static activation scales) is refused in one line."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    settings = dict(quantization) if isinstance(quantization, dict) else quantization.to_dict()
    method = settings.get("quant_method")
    if getattr(method, "value", method) != "fp8":
        return None  # fcsd.loading.check_quantization refuses the other methods
    block = settings.get("weight_block_size")
    whole = isinstance(block, (list, tuple)) and len(block) == 2
    whole = whole and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    if block is not None and not whole:
        raise ValueError(
            f"quantization_config.weight_block_size {block!r} in config.json is no block: it must be two positive "
            "whole numbers, e.g. [128, 128], the block the checkpoint's weight_scale_inv tensors were made for"
        )
    problem = (
        f"format {settings.get('fmt')!r} (fmt)"
        if settings.get("fmt", "e4m3") != "e4m3"
        else "per-tensor scales (no weight_block_size)"
        if block is None
        else f"activation_scheme {settings.get('activation_scheme')!r}"
        if settings.get("activation_scheme", "dynamic") != "dynamic"
        else None
    )
    if problem is not None:
        raise ValueError(
            f"FP8 checkpoint with {problem}: fcsd reads block-FP8 e4m3 checkpoints with dynamic activation scales "
            "(the DeepSeek-V3 / Qwen3 -FP8 format); dequantize it to bf16 and save_pretrained the result"
        )
    settings["quant_method"] = "fp8"
    settings["weight_block_size"] = [int(b) for b in block]
    return settings


FP8_CAPABILITY = (8, 9)  # the CUDA compute capability from which transformers keeps FP8 modules (Ada, Hopper, ...)


def fp8_kernels_available(capability: tuple[int, int] | None = None) -> bool:
    """Whether transformers' FP8 modules run on a CUDA GPU of compute ``capability`` (``(major, minor)``; default:
    this machine's GPU): 8.9 or more (Ada, Hopper and later); elsewhere transformers dequantizes to bf16 by itself.
    ``fcsd plan`` asks the same of its cluster's GPUs (:attr:`fcsd.plan.cluster.GPU.compute_capability`). A ROCm
    GPU counts as without: transformers' fine-grained FP8 path stores OCP e4m3fn weights and has no kernels for
    e4m3fnuz, MI300X's FP8 (unverified there, so refused rather than guessed)."""
    if capability is None:
        if not torch.cuda.is_available() or torch.version.hip:
            return False
        capability = torch.cuda.get_device_capability()
    return tuple(capability) >= FP8_CAPABILITY


def check_fp8_modules(settings: dict | None, name: str) -> None:
    """Refuse, in one line, to keep FP8 modules (``teacher.dtype=fp8``) for a checkpoint that is not block-FP8 or
    on a machine without FP8 kernels."""
    if settings is None:
        raise ValueError(
            f"teacher.dtype=fp8 keeps a block-FP8 checkpoint's FP8 modules, but {name} is not FP8: use auto"
        )
    if not fp8_kernels_available():
        raise ValueError(
            "teacher.dtype=fp8 needs FP8 kernels (a CUDA GPU of compute capability >= 8.9), which this machine lacks: "
            "use teacher.dtype=auto (the teacher dequantized) or bfloat16"
        )
    check_fp8_kernel()


def check_fp8_kernel() -> None:
    """Load transformers' Triton FP8 kernel now, the one every FP8 module can fall back to: the ``kernels`` package
    fetches it from the hub at the first forward otherwise, so that an offline run (``HF_HUB_OFFLINE=1``) without it
    in the cache failed after its data, student and teacher had loaded."""
    from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

    try:
        load_finegrained_fp8_kernel()
    except Exception as error:  # ImportError, the hub's offline and not-found errors, a build for another torch
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0].split(". ")[0].rstrip(".")[:200]
        raise ValueError(
            f"teacher.dtype=fp8 needs transformers' FP8 kernel (kernels-community/finegrained-fp8, fetched by the "
            f"`kernels` package), which could not be loaded ({reason}): fetch it once online (pip install kernels; it "
            "is cached), or use teacher.dtype=auto (the teacher dequantized)"
        ) from None


def without_quantization(config):
    """A copy of ``config`` without its ``quantization_config``: the model transformers builds from it has plain
    modules, which fcsd fills with dequantized weights."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


class DequantizedSlice:
    """A checkpoint tensor with block scales, read lazily as the loader reads a safetensors slice: ``get_shape()``
    and ``[index]`` (slices of any dims, or ``...``) return the dequantized fp32 values of just that part."""

    def __init__(self, weight, scale, block: list[int]):
        self.weight, self.scale, self.block = weight, scale, block

    def get_shape(self) -> list[int]:
        return list(self.weight.get_shape())

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index) -> torch.Tensor:
        from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

        shape = self.get_shape()
        bounds, squeeze = _bounds(index, shape)
        (r0, r1), (c0, c1) = bounds[-2:]
        (b0, b1), (rows, cols) = self.block, shape[-2:]
        # the whole blocks around the slice: their weight and their scales, dequantized, then the slice cut out
        lo_r, lo_c = r0 // b0 * b0, c0 // b1 * b1
        hi_r, hi_c = min(-(-r1 // b0) * b0, rows), min(-(-c1 // b1) * b1, cols)
        lead = tuple(slice(a, b) for a, b in bounds[:-2])
        weight = self.weight[(*lead, slice(lo_r, hi_r), slice(lo_c, hi_c))]
        scale = self.scale[(*lead, slice(lo_r // b0, -(-hi_r // b0)), slice(lo_c // b1, -(-hi_c // b1)))]
        if not scale.dtype.is_floating_point or scale.element_size() < 2:
            raise ValueError(f"block scales stored as {scale.dtype}: fcsd reads fp32 / bf16 weight_scale_inv")
        values = _dequantize_fp8_weight(weight, scale, self.block, torch.float32)
        values = values[..., r0 - lo_r : r1 - lo_r, c0 - lo_c : c1 - lo_c]
        return values[tuple(0 if dim in squeeze else slice(None) for dim in range(values.ndim))]


def _bounds(index, shape: list[int]) -> tuple[list[tuple[int, int]], set[int]]:
    """``(start, stop)`` of every dim that ``index`` (slices with step 1, ints, one ``...``) selects, and the dims
    an int index drops."""
    parts = list(index) if isinstance(index, tuple) else [index]
    if any(part is Ellipsis for part in parts):
        at = parts.index(Ellipsis)
        parts[at : at + 1] = [slice(None)] * (len(shape) - len(parts) + 1)
    parts += [slice(None)] * (len(shape) - len(parts))
    bounds, squeeze = [], set()
    for dim, (part, size) in enumerate(zip(parts, shape, strict=True)):
        if isinstance(part, int):
            part, _ = slice(part % size, part % size + 1), squeeze.add(dim)
        start, stop, step = part.indices(size)
        if step != 1:
            raise ValueError(f"a strided read ({part}) of a block-FP8 tensor")
        bounds.append((start, max(start, stop)))
    return bounds, squeeze


def dequantized_state_dict(files: list[str], block: list[int], stack: ExitStack) -> tuple[dict, dict]:
    """The tensors of safetensors ``files`` for transformers' loader, each weight that has a ``weight_scale_inv``
    as a :class:`DequantizedSlice` (its scales consumed), the rest as safetensors slices; the files stay open until
    ``stack`` closes. Also returns the record of the source's format (:data:`RECORD_KEY`)."""
    from safetensors import safe_open

    entries = {}
    for file in files:
        handle = stack.enter_context(safe_open(file, framework="pt"))
        entries.update((key, handle.get_slice(key)) for key in handle.keys())
    static = sorted(key for key in entries if key.endswith((".activation_scale", ".input_scale")))
    if static:
        raise ValueError(f"{static[0]}: static activation scales; fcsd reads block-FP8 with dynamic activations")
    scaled = [key for key in entries if key.endswith(".weight" + SCALE_SUFFIX)]
    for scale_key in scaled:
        key = scale_key.removesuffix(SCALE_SUFFIX)
        if key not in entries:
            raise ValueError(f"{scale_key} has no weight {key} in the checkpoint: copy or download it again")
        if "F8" not in entries[key].get_dtype() or len(entries[key].get_shape()) < 2:
            raise ValueError(
                f"{scale_key} scales {key}, which is not stored in FP8 ({entries[key].get_dtype()}, shape "
                f"{list(entries[key].get_shape())}): the checkpoint is damaged; remove that scale or download it again"
            )
        entries[key] = DequantizedSlice(entries[key], entries.pop(scale_key), block)
    check_block_scales(
        {k: (e.get_shape(), e.scale.get_shape()) for k, e in entries.items() if k + SCALE_SUFFIX in scaled}, block
    )
    unscaled = sorted(k for k, e in entries.items() if not isinstance(e, DequantizedSlice) and "F8" in e.get_dtype())
    if unscaled:  # read as they are, e4m3 codes would be weights up to 448 times too large, silently
        raise ValueError(
            f"{unscaled[0]} is stored in FP8 without its scale {unscaled[0]}{SCALE_SUFFIX} ({len(unscaled)} such "
            "tensors): the checkpoint is incomplete; copy or download it again"
        )
    # weights without a scale that the export must leave unquantized too (embeddings, head, router, skipped modules)
    kept = sorted(
        key
        for key, entry in entries.items()
        if not isinstance(entry, DequantizedSlice) and key.endswith(".weight") and len(entry.get_shape()) >= 2
    )
    scale_dtypes = {entries[key].scale.get_dtype() for key in (k.removesuffix(SCALE_SUFFIX) for k in scaled)}
    return entries, {
        "kept": kept,
        "scaled": sorted(key.removesuffix(SCALE_SUFFIX) for key in scaled),
        "scale_dtype": "bfloat16" if scale_dtypes == {"BF16"} else "float32",  # as the export writes them back
    }


def check_block_scales(shapes: dict, block: list[int]) -> None:
    """Refuse, in one line, scales that do not fit the declared ``block``: ``shapes`` maps each scaled weight to
    ``(weight shape, scale shape)`` (headers only); a scale must be the weight's shape divided by the block, rounded
    up. Read with another block, the weights would be dequantized with the wrong scales, silently or not at all."""
    wrong = [(key, w, s) for key, (w, s) in sorted(shapes.items()) if list(s) != expected_scale_shape(w, block)]
    if not wrong:
        return
    key, weight, scale = wrong[0]
    implied = implied_block(list(shapes.values()))
    fix = (
        f"the scales are for {implied} blocks: set quantization_config.weight_block_size to {implied} in config.json"
        if implied is not None
        else "no one block size fits them all: the checkpoint is damaged; copy or download it again"
    )
    raise ValueError(
        f"{key}{SCALE_SUFFIX} has shape {list(scale)}, but weight {list(weight)} in the declared weight_block_size "
        f"{list(block)} needs {expected_scale_shape(weight, block)} ({len(wrong)} such scales): {fix}"
    )


def expected_scale_shape(weight_shape, block: list[int]) -> list[int]:
    """The shape of a weight's block scales: its leading dims, then its last two divided by ``block``, rounded up."""
    *lead, rows, cols = weight_shape
    return [*lead, -(-rows // block[0]), -(-cols // block[1])]


def implied_block(pairs) -> list[int] | None:
    """The block size (the smallest power of two, else the smallest size) that every ``(weight shape, scale
    shape)`` of ``pairs`` fits, or None when none does."""
    bounds = [[1, None], [1, None]]  # per dim: the smallest and largest block that fit every tensor
    for weight, scale in pairs:
        if len(weight) < 2 or len(scale) != len(weight) or list(scale[:-2]) != list(weight[:-2]):
            return None
        for dim, (size, count) in enumerate(zip(weight[-2:], scale[-2:], strict=True)):
            if not 0 < count <= size:
                return None
            bounds[dim][0] = max(bounds[dim][0], -(-size // count))
            if count > 1:  # ceil(size / b) == count: b < size / (count - 1)
                high = (size - 1) // (count - 1)
                bounds[dim][1] = high if bounds[dim][1] is None else min(bounds[dim][1], high)
    found = []
    for low, high in bounds:
        if high is not None and low > high:
            return None
        power = 1 << (low - 1).bit_length()
        found.append(power if high is None or power <= high else low)
    return found


def dropped_on_load(keys, unexpected, model) -> set[str]:
    """The checkpoint ``keys`` a model did not take: those its class ignores
    (``_keys_to_ignore_on_load_unexpected``) and those transformers reported ``unexpected``, which it names after
    its own conversions (a layer's per-expert weights as the one fused ``...mlp.experts.gate_up_proj``: every key
    under the module of an unexpected key counts)."""
    import re

    patterns = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    modules = tuple(key.rsplit(".", 1)[0] + "." for key in unexpected)
    return {k for k in keys if k in unexpected or k.startswith(modules) or any(p.search(k) for p in patterns)}


def own_names(kept: list[str], scaled: list[str], model_keys) -> tuple[list[str], list[str]]:
    """The record's names (``kept``, ``scaled``) as the model names its tensors. A composite's text tower read alone
    (Llama-4 Scout's, which its files store under ``language_model.``) drops that prefix, the one prefix that maps
    the scaled weights the model does not name as they are onto its own, and the other towers' weights, which the
    model does not hold, are left out; any other model's names are its file's."""
    model_keys = set(model_keys)
    prefixes = {
        name[: i + 1]
        for name in scaled
        if name not in model_keys
        for i, char in enumerate(name)
        if char == "." and name[i + 1 :] in model_keys
    }
    if len(prefixes) != 1:
        return kept, scaled
    (prefix,) = prefixes

    def own(names):
        return sorted(name[len(prefix) :] for name in names if name.startswith(prefix))

    return own(kept), own(scaled)


def scaled_record(names) -> dict:
    """How the record names the weights a source quantized: their count and the SHA-256 of their sorted names
    (DeepSeek-V3 scales ~45,000 weights: the names themselves would make ``config.json`` megabytes long)."""
    import hashlib

    names = sorted(names)
    return {"quantized": len(names), "scaled_sha256": hashlib.sha256("\n".join(names).encode()).hexdigest()}


def dequantizing_class(model_class: type, settings: dict) -> type:
    """A subclass of a transformers model class (built from a config :func:`without_quantization`) whose
    ``from_pretrained`` reads a block-FP8 checkpoint dequantized (:func:`dequantized_state_dict`) and records the
    source's format on the model's config (:data:`RECORD_KEY`). Works below the other loaders' subclasses
    (:mod:`fcsd.parallel.load`): they slice what this one dequantizes."""

    def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, expected_keys=None):
        from transformers.integrations import is_deepspeed_zero3_enabled

        if state_dict is not None or not checkpoint_files or not checkpoint_files[0].endswith(".safetensors"):
            raise ValueError("a block-FP8 checkpoint is read from its .safetensors files: copy them in")
        if is_deepspeed_zero3_enabled():
            raise ValueError(
                "a block-FP8 source under DeepSpeed ZeRO-3: fcsd dequantizes FP8 as it reads slices, which ZeRO-3's "
                "loader does not do; use recipes/accelerate's FSDP2 config or parallel.fsdp=true"
            )
        with ExitStack() as stack:
            entries, found = dequantized_state_dict(checkpoint_files, settings["weight_block_size"], stack)
            loaded = model_class._load_pretrained_model(model, entries, checkpoint_files, load_config, expected_keys)
        # only the scaled weights the model took: transformers drops some on load (DeepSeek-V3's multi-token
        # prediction layer, model.layers.61, _keys_to_ignore_on_load_unexpected), and the export never writes them
        dropped = dropped_on_load(found["scaled"], loaded[0].unexpected_keys, model)
        kept, scaled = own_names(found["kept"], [k for k in found["scaled"] if k not in dropped], model.state_dict())
        record = {"quantization_config": settings, "kept": kept, "scale_dtype": found["scale_dtype"]}
        setattr(model.config, RECORD_KEY, {**record, **scaled_record(scaled)})
        return loaded

    return type(model_class.__name__, (model_class,), {"_load_pretrained_model": staticmethod(_load_pretrained_model)})


def quantize_blocks(weight: torch.Tensor, block: list[int], power_of_two: bool = False, scale_dtype=torch.float32):
    """``(e4m3 weight, weight_scale_inv)`` of ``weight`` (``(..., out, in)``) in ``block`` blocks, partial blocks at
    the edges included: each block's scale is its largest magnitude / 448 (a power of two above it with
    ``power_of_two``, the ``ue8m0`` scale format), an all-zero block's 1, stored as ``scale_dtype`` (the weight is
    divided by the scale as stored)."""
    rows, cols = weight.shape[-2:]
    b0, b1 = block
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % b1, 0, -rows % b0))
    blocks = padded.unflatten(-1, (-1, b1)).unflatten(-3, (-1, b0))  # (..., R, b0, C, b1)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = scale.to(scale_dtype).float()
    quantized = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    quantized = quantized.flatten(-4, -3).flatten(-2, -1)[..., :rows, :cols].contiguous()
    return quantized, scale.to(scale_dtype).contiguous()


def e4m3_step(scale: torch.Tensor, block: list[int], shape) -> torch.Tensor:
    """The largest rounding step of e4m3 in each block, expanded to a weight of ``shape``: 32 (the step between 256
    and 448) times the block's scale. A dequantized weight is within half of it of the weight it was made from."""
    step = scale.float() * 32.0
    step = step.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return step[..., : shape[-2], : shape[-1]]
