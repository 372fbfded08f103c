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

from fcsd.fp8 import RECORD_KEY, SCALE_SUFFIX, quantize_blocks

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


def quantize_folder(folder: Path, record: dict) -> int:
    """Rewrite the safetensors files of a staged export in the source's block-FP8 format, one file at a time, and
    its index; returns how many weights were quantized. Raises ``ValueError`` when they are not as many as the
    source quantized (the tensors' names differ from the source's: nothing would say which to quantize)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from fcsd.staging import atomic_file

    settings = record["quantization_config"]
    block, kept = settings["weight_block_size"], set(record.get("kept", []))
    power_of_two = settings.get("scale_fmt") == "ue8m0"
    placed, quantized, total = {}, 0, 0
    for path in sorted(folder.glob("*.safetensors")):
        tensors = {}
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {"format": "pt"}
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                if key.endswith(".weight") and tensor.ndim >= 2 and tensor.is_floating_point() and key not in kept:
                    tensor, tensors[key + SCALE_SUFFIX] = quantize_blocks(tensor, block, power_of_two)
                    quantized += 1
                tensors[key] = tensor
        with atomic_file(path) as staging:
            save_file(tensors, str(staging), metadata=metadata)
        placed.update((key, path.name) for key in tensors)
        total += sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        del tensors
    if quantized != record.get("quantized", quantized):
        raise ValueError(
            f"the export would quantize {quantized} weights where its FP8 source quantized {record['quantized']}: "
            "its tensor names differ from the source's; export with --format bf16"
        )
    _write_index(folder, placed, total)
    return quantized


def _write_index(folder: Path, placed: dict, total: int) -> None:
    from fcsd.parallel.stream_save import INDEX
    from fcsd.staging import atomic_file

    path = folder / INDEX
    if not path.exists():
        return
    index = json.loads(path.read_text())
    index["weight_map"] = dict(sorted(placed.items()))
    index.setdefault("metadata", {})["total_size"] = total
    with atomic_file(path) as staging:
        staging.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def parity_tolerance(expected: torch.Tensor) -> float:
    """The reload-parity tolerance of an FP8 export: :data:`FP8_PARITY_RELATIVE` of the largest |logit|."""
    return FP8_PARITY_RELATIVE * float(expected.abs().max())
