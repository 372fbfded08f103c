"""The export of a model trained from a block-FP8 source, in the source's own format (design §8; issue 39).

A model read from a block-FP8 checkpoint carries ``config.fcsd_source_quantization`` (:mod:`fcsd.fp8`): the
source's ``quantization_config``, the weights it kept unquantized and how many it quantized. ``final/`` is saved in
bf16 like any run; its export is rewritten shard by shard (one safetensors file in memory at a time, each replaced
in one rename inside the staging folder) into e4m3 weights with ``weight_scale_inv`` block scales computed from the
trained weights (:func:`fcsd.fp8.quantize_blocks`: a block's largest magnitude / 448), exactly the tensors that had
a scale in the source quantized, the source's ``quantization_config`` in ``config.json``. ``format="bf16"``
(``fcsd export --format bf16``, ``export_format=bf16``) keeps the bf16 export instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fcsd.fp8 import RECORD_KEY, SCALE_SUFFIX, quantize_blocks, scaled_record

FORMATS = ("source", "bf16")
#: reload parity of an FP8 export: max |logit difference| to the model it was written from, relative to that
#: model's largest |logit| (e4m3 keeps 3 mantissa bits: a weight moves by up to 1/16 of itself, ~1/40 on average)
FP8_PARITY_RELATIVE = 0.1


def source_quantization(config) -> dict | None:
    """The FP8 source record of a model's config (a dict, or a config object), None for another source."""
    record = config.get(RECORD_KEY) if isinstance(config, dict) else getattr(config, RECORD_KEY, None)
    return record if isinstance(record, dict) and record.get("quantization_config") else None


def check_format(export_format: str) -> str:
    """Refuse an unknown export format in one line."""
    if export_format not in FORMATS:
        raise ValueError(f"export format {export_format!r}: choose source (an FP8 source's own format) or bf16")
    return export_format


def format_name(record: dict | None, dtype) -> str:
    """The format an export's weights are written in, for its model card and parity record: the model's dtype
    (``bfloat16``), or block FP8 when ``record`` (the FP8 source record the export writes back) is given."""
    if record is None:
        return str(dtype).removeprefix("torch.")
    b0, b1 = record["quantization_config"]["weight_block_size"]
    return f"float8_e4m3fn with {b0}x{b1} block scales ({str(dtype).removeprefix('torch.')} where unquantized)"


def finish_config(folder: Path, record: dict | None) -> None:
    """The export's ``config.json`` without fcsd's source records (FP8, composite), with the source's
    ``quantization_config`` when the weights were written in FP8 (``record``)."""
    from fcsd.export.composite import SOURCE_KEY

    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.pop(RECORD_KEY, None)
    config.pop(SOURCE_KEY, None)
    if record is not None:
        config["quantization_config"] = record["quantization_config"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def to_quantize(key: str, info: dict, kept: set[str]) -> bool:
    """Whether the export quantizes tensor ``key`` (its safetensors header entry ``info``): a floating weight of a
    linear (2 dims or more) that the source did not keep unquantized."""
    floating = info["dtype"].startswith(("F", "BF"))
    return key.endswith(".weight") and len(info["shape"]) >= 2 and floating and key not in kept


def check_names(folder: Path, record: dict) -> None:
    """Refuse, in one line and before any file is rewritten, an FP8 export whose weights to quantize (read from the
    headers of ``folder``'s safetensors files) are not the ones the source quantized (the record's count and
    SHA-256 of their names, :func:`fcsd.fp8.scaled_record`): nothing would say which to quantize."""
    from fcsd.weight_files import read_header

    kept = set(record.get("kept", []))
    names = [
        key
        for path in sorted(Path(folder).glob("*.safetensors"))
        for key, info in read_header(path)[1].items()
        if key != "__metadata__" and to_quantize(key, info, kept)
    ]
    found = scaled_record(names)
    expected = {key: record[key] for key in found if key in record}  # a record written before the names: the count
    if {key: found[key] for key in expected} != expected:
        raise ValueError(
            f"the export would quantize {found['quantized']} weights where its FP8 source quantized "
            f"{record.get('quantized')} (their names differ from the source's, so nothing says which to quantize): "
            "export with --format bf16"
        )


def quantize_folder(folder: Path, record: dict) -> int:
    """Rewrite the safetensors files of a staged export in the source's block-FP8 format, one file at a time, and
    its index; returns how many weights were quantized. First refuses (``ValueError``, nothing rewritten) an
    export whose weights to quantize are not those the source quantized (:func:`check_names`)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from fcsd.staging import atomic_file
    from fcsd.weight_files import INDEX, read_header, write_index

    check_names(folder, record)
    settings = record["quantization_config"]
    block, kept = settings["weight_block_size"], set(record.get("kept", []))
    power_of_two = settings.get("scale_fmt") == "ue8m0"
    scale_dtype = getattr(torch, record.get("scale_dtype", "float32"))  # the source's (a record from before: fp32)
    placed, quantized, total = {}, 0, 0
    for path in sorted(folder.glob("*.safetensors")):
        tensors, header = {}, read_header(path)[1]
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {"format": "pt"}
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                if to_quantize(key, header[key], kept):
                    tensor, tensors[key + SCALE_SUFFIX] = quantize_blocks(tensor, block, power_of_two, scale_dtype)
                    quantized += 1
                tensors[key] = tensor
        with atomic_file(path) as staging:
            save_file(tensors, str(staging), metadata=metadata)
        placed.update((key, path.name) for key in tensors)
        total += sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        del tensors
    if (folder / INDEX).exists():
        write_index(folder, placed, total)
    return quantized


def parity_tolerance(expected: torch.Tensor) -> float:
    """The reload-parity tolerance of an FP8 export: :data:`FP8_PARITY_RELATIVE` of the largest |logit|."""
    return FP8_PARITY_RELATIVE * float(expected.abs().max())
