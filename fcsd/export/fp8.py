"""The export of a model trained from a block-FP8 source, in the source's own format (design §8).

A model read from a block-FP8 checkpoint carries ``config.fcsd_source_quantization`` (:mod:`fcsd.block_fp8`): the
source's ``quantization_config``, the weights it kept unquantized and how many it quantized. ``final/`` is saved in
bf16 like any run; its export is rewritten shard by shard (one safetensors file in memory at a time, each replaced
in one rename inside the staging folder) into e4m3 weights with ``weight_scale_inv`` block scales computed from the
trained weights (:func:`fcsd.block_fp8.quantize_blocks`: a block's largest magnitude / 448), exactly the tensors that
had a scale in the source quantized, the source's ``quantization_config`` in ``config.json``. ``format="bf16"``
(``fcsd export --format bf16``, ``export_format=bf16``) keeps the bf16 export instead.

The check of an FP8 export proves what it stores (:func:`quantize_folder`): each quantized weight, read back from the
written file by fcsd's reader, equals the block quantization of the trained weight
(:func:`fcsd.block_fp8.quantize_blocks`, dequantized) bit for bit, every other tensor is stored exactly. The logit drift
that FP8 rounding causes is measured on the reload and reported beside it (``fcsd_export.json``, the model card), not
held to a tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fcsd import block_fp8 as reader
from fcsd.block_fp8 import RECORD_KEY, SCALE_SUFFIX, DequantizedSlice, quantize_blocks, scaled_record

FORMATS = ("source", "bf16")
#: the staged export's proof of what it stores (:func:`quantize_folder`), read by the parity check of every process
#: and folded into ``fcsd_export.json`` (:func:`take_check`); never published
CHECK_FILE = "fcsd_fp8_check.json"


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
    SHA-256 of their names, :func:`fcsd.block_fp8.scaled_record`): nothing would say which to quantize."""
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

    from fcsd.files.staging import atomic_file
    from fcsd.weight_files import INDEX, read_header, write_index

    check_names(folder, record)
    settings = record["quantization_config"]
    block, kept = settings["weight_block_size"], set(record.get("kept", []))
    power_of_two = settings.get("scale_fmt") == "ue8m0"
    scale_dtype = getattr(torch, record.get("scale_dtype", "float32"))  # the source's (a record from before: fp32)
    placed, quantized, total, wrong = {}, 0, 0, []
    for path in sorted(folder.glob("*.safetensors")):
        tensors, trained, header = {}, {}, read_header(path)[1]
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {"format": "pt"}
            for key in handle.keys():
                tensor = trained[key] = handle.get_tensor(key)
                if to_quantize(key, header[key], kept):
                    tensor, tensors[key + SCALE_SUFFIX] = quantize_blocks(tensor, block, power_of_two, scale_dtype)
                    quantized += 1
                tensors[key] = tensor
        with atomic_file(path) as staging:
            save_file(tensors, str(staging), metadata=metadata)
        placed.update((key, path.name) for key in tensors)
        total += sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        del tensors
        wrong += stored_wrongly(path, trained, settings, scale_dtype)
        del trained
    if (folder / INDEX).exists():
        write_index(folder, placed, total)
    check = {"quantized_weights": quantized, "stored_exactly": not wrong, "wrong": wrong[:3], "wrong_count": len(wrong)}
    with atomic_file(folder / CHECK_FILE) as staging:
        staging.write_text(json.dumps(check) + "\n")
    return quantized


def stored_wrongly(path: Path, trained: dict, settings: dict, scale_dtype) -> list[str]:
    """The tensors of the written file ``path`` that are not what they must be: a quantized weight whose values, read
    back as fcsd reads FP8 (:class:`fcsd.block_fp8.DequantizedSlice`), differ in any bit from ``trained[key]`` quantized
    by :func:`fcsd.block_fp8.quantize_blocks` and dequantized, any other tensor not equal to ``trained[key]``."""
    from safetensors import safe_open

    block, power_of_two = settings["weight_block_size"], settings.get("scale_fmt") == "ue8m0"
    wrong = []
    with safe_open(str(path), framework="pt") as handle:
        keys = set(handle.keys())
        for key, tensor in trained.items():
            if key + SCALE_SUFFIX in keys:
                codes, scale = reader.quantize_blocks(tensor, block, power_of_two, scale_dtype)
                rows, cols = (torch.arange(n) // b for n, b in zip(codes.shape[-2:], block, strict=True))
                expected = codes.float() * scale.float()[..., rows, :][..., cols]
                got = DequantizedSlice(handle.get_slice(key), handle.get_slice(key + SCALE_SUFFIX), block)[...]
                same = handle.get_slice(key).get_dtype() == "F8_E4M3" and torch.equal(got, expected)
            else:
                same = key in keys and torch.equal(handle.get_tensor(key), tensor)
                same = same and handle.get_tensor(key).dtype == tensor.dtype
            if not same:
                wrong.append(key)
    return wrong


def read_check(folder: Path) -> dict:
    """The staged FP8 export's proof (:func:`quantize_folder`); refuses, in one line, an export that stores any
    tensor wrongly or was never checked."""
    path = Path(folder) / CHECK_FILE
    check = json.loads(path.read_text()) if path.exists() else {"stored_exactly": False, "wrong": ["(unchecked)"]}
    if not check["stored_exactly"]:
        from fcsd.export import ExportError

        raise ExportError(
            f"reload parity failed: {check.get('wrong_count', 1)} tensors of the FP8 export are not stored as "
            f"they must be (first {check['wrong'][0]}: its written values are not the block quantization of the "
            "trained weight); the export was not written"
        )
    return check


def record_drift(folder: Path, expected: torch.Tensor) -> None:
    """Add the largest |logit| of the model the export was written from to its proof (the drift's scale); refuse,
    as :func:`read_check`, one that stores a tensor wrongly. Only the main process writes (rank 0)."""
    import torch.distributed as dist

    from fcsd.files.staging import atomic_file

    check = {**read_check(folder), "max_abs_logit": float(expected.abs().max())}
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    with atomic_file(Path(folder) / CHECK_FILE) as staging:
        staging.write_text(json.dumps(check) + "\n")


def take_check(folder: Path, difference: float) -> dict:
    """What ``fcsd_export.json`` records of an FP8 export (its proof and the logit drift FP8 rounding causes, max
    |logit difference| and relative to the largest |logit|); the proof file leaves the staged folder."""
    path = Path(folder) / CHECK_FILE
    check = read_check(folder)
    path.unlink()
    largest = check.get("max_abs_logit")
    relative = difference / largest if largest else None
    return {
        "quantized_weights": check["quantized_weights"],
        "stored_exactly": True,
        "logit_drift": {"max_abs": difference, "relative": relative},
    }
