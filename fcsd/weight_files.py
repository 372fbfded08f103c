"""Safetensors weight files as checkpoints lay them out: one file's header, a folder's tensor names, and the
``model.safetensors.index.json`` that maps each tensor to its file (one reader and one writer for every module that
rewrites a checkpoint's files: the streamed save, the FP8 export, the composite export)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read_header(path: str | Path) -> tuple[int, dict]:
    """``(offset of the data, header)`` of a safetensors file; ``ValueError`` when the header cannot be read (a
    truncated or corrupt file)."""
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: no safetensors header")
        length = struct.unpack("<Q", head)[0]
        if length > os.fstat(handle.fileno()).st_size - 8:  # a truncated file, or garbage: never read that much
            raise ValueError(f"{path}: its safetensors header runs past the end of the file")
        text = handle.read(length)
    try:
        header = json.loads(text) if len(text) == length else None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header cannot be read")
    return 8 + length, header


def tensor_names(files: list[Path]) -> dict[str, Path]:
    """Every tensor name of safetensors ``files`` -> the file holding it."""
    return {key: file for file in files for key in read_header(file)[1] if key != "__metadata__"}


def folder_tensor_names(folder: Path) -> list[str] | None:
    """The tensor names of a checkpoint folder, from its index or else its files' headers; None when it has
    neither."""
    index = folder / INDEX
    if index.is_file():
        return sorted(json.loads(index.read_text()).get("weight_map", {}))
    files = sorted(folder.glob("*.safetensors"))
    return sorted(tensor_names(files)) if files else None


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    """Write ``folder``'s ``model.safetensors.index.json`` (tensor name -> file, total bytes of tensor data)
    atomically."""
    from fcsd.files.staging import atomic_file

    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    with atomic_file(Path(folder) / INDEX) as partial:
        partial.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
