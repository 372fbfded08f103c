"""Where models and data come from: a hub id, a local folder, a run folder of ``fcsd convert``, or the embedded
``demo`` (built on first use by :mod:`fcsd.embedded`). Every command resolves its inputs here."""

from __future__ import annotations

import os
from pathlib import Path

DEMO_NAME = "demo"


def cache_root() -> Path:
    """fcsd's user cache: ``$FCSD_CACHE``, else ``~/.cache/fcsd`` (the demo assets, packed-token caches)."""
    return Path(os.environ.get("FCSD_CACHE", Path.home() / ".cache" / "fcsd"))


def looks_local(name: str) -> bool:
    """A name that can only mean a local path (a hub id never starts with ``.``, ``/`` or ``~``)."""
    return name.startswith((".", "/", "~"))


def resolve_model(name: str) -> str:
    """``demo`` -> the demo checkpoint folder (built on first use); a local-looking path that does not exist is a
    clear error (not a hub lookup); anything else (a folder, a hub id) unchanged."""
    if name == DEMO_NAME:
        from fcsd.embedded import prepare_demo

        return str(prepare_demo() / "model")
    if looks_local(name) and not Path(name).expanduser().exists():
        raise ValueError(f"model {name}: no such folder (give a local checkpoint folder, a hub id, or 'demo')")
    return name


def resolve_data(name: str | None) -> str | None:
    """``demo`` / ``demo-heldout`` -> the demo's training / held-out file; anything else unchanged."""
    from fcsd.embedded import DEMO_DATA

    if name not in DEMO_DATA:
        return name
    from fcsd.embedded import prepare_demo

    return str(prepare_demo() / "data" / DEMO_DATA[name])


def default_data(model: str) -> str | None:
    """The held-out data a model comes with: the demo's for ``demo``, None for any other model."""
    return resolve_data("demo-heldout") if model == DEMO_NAME else None


def resolve_checkpoint(ref: str) -> str:
    """The folder (or hub id) to load for ``ref``: ``demo``; a run folder (see :meth:`RunFolder.checkpoint`); an
    exported or converted folder; a stock checkpoint; or a hub id."""
    from fcsd.run_folder import RunFolder

    path = Path(ref).expanduser()
    if not path.exists():
        return resolve_model(ref)
    if (path / "config.json").exists():
        return str(path)
    checkpoint = RunFolder(path).checkpoint()
    if checkpoint is None:
        raise ValueError(f"{ref} holds no checkpoint: expected config.json, or a run folder with export/ or final/")
    return str(checkpoint)
