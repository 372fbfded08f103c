"""Variants of an export folder with other connectivity and the same weights (standard library only): the stock
checkpoint (``none``: what an engine serves without FarSkip) and FarSkip on other layers. Used by the prefill benchmark
and the serving tests' negative control. A variant is not the export whose reload parity was checked: its parity
record (``fcsd_export.json``, which would name other layers) is not copied."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

PARITY_RECORD = "fcsd_export.json"  # fcsd.export.save.PARITY_RECORD


def _copy(export: Path, out: Path) -> None:
    shutil.copytree(export, out, ignore=shutil.ignore_patterns(PARITY_RECORD))


def stock_copy(export: Path, out: Path) -> Path:
    """``export`` as a stock checkpoint: stock model type and class, no ``farskip`` block, no remote code."""
    _copy(export, out)
    config = json.loads((out / "config.json").read_text())
    farskip = config.pop("farskip")
    config.pop("auto_map", None)
    config.update(model_type=farskip["base_model_type"], architectures=farskip["base_architectures"])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for code in out.glob("*farskip*.py"):
        code.unlink()
    return out


def with_layers(export: Path, out: Path, layers: list[int]) -> Path:
    """``export`` with FarSkip connectivity on ``layers`` instead (the weights are unchanged)."""
    _copy(export, out)
    config = json.loads((out / "config.json").read_text())
    config["farskip"] = {**config["farskip"], "layers": sorted(layers), "spec": ",".join(map(str, sorted(layers)))}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def num_layers(export: Path) -> int:
    config = json.loads((Path(export) / "config.json").read_text())
    return (config.get("text_config") or config)["num_hidden_layers"]
