"""Where the Hydra recipes are, in a checkout and after ``pip install``.

The recipes are ``recipes/`` of the source tree (Hydra YAML, the accelerate configs and their DeepSpeed JSON). The
package ships them as ``fcsd/recipes/`` (package data; in the source tree a link to ``../recipes``), so an installed
fcsd composes its configs and names launch files without a checkout. ``$FCSD_RECIPES`` points at another folder.

Recipes name files by their path in a checkout (``recipes/accelerate/zero3.json``, ``model.accelerate_config:
recipes/accelerate/fsdp2_8gpu.yaml``), which is what the manual's commands type from the repository's root.
:func:`recipe_file` finds the shipped copy of such a path when the working directory has none, and
:func:`resolve_deepspeed_config` does so for the DeepSpeed JSON that ``accelerate launch`` hands to the training
processes (it reads the config file's ``deepspeed_config_file`` as it is written, relative to the working
directory; the processes open it).
"""

from __future__ import annotations

import os
from pathlib import Path

PREFIX = "recipes/"  # how recipes name a shipped file
DEEPSPEED_ENV = "ACCELERATE_DEEPSPEED_CONFIG_FILE"  # what `accelerate launch` passes a config's JSON as


def shipped_recipes() -> Path:
    """The recipes this fcsd carries: ``fcsd/recipes/`` of the package (the source tree's ``recipes/`` folder in a
    checkout, through its link)."""
    return (Path(__file__).resolve().parent / "recipes").resolve()


def recipes_dir() -> Path:
    """``$FCSD_RECIPES``, else the recipes shipped with fcsd (:func:`shipped_recipes`)."""
    given = os.environ.get("FCSD_RECIPES")
    return Path(given) if given else shipped_recipes()


def display_path(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it (a checkout's root), else absolute."""
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def recipe_file(name: str) -> str:
    """``name`` as given when it exists, else the shipped file a ``recipes/...`` path names (as
    :func:`display_path` writes it); anything else is returned as given, for its user to find."""
    if Path(name).expanduser().exists() or not name.startswith(PREFIX):
        return name
    shipped = shipped_recipes() / name[len(PREFIX) :]
    return display_path(shipped) if shipped.is_file() else name


def resolve_deepspeed_config() -> str | None:
    """Point ``accelerate launch``'s DeepSpeed JSON (``$ACCELERATE_DEEPSPEED_CONFIG_FILE``) at the shipped file when
    it is a ``recipes/...`` path the working directory lacks (a shipped config used outside a checkout); call before
    the ``Accelerator`` is made. Returns the path in effect (None: no DeepSpeed JSON)."""
    given = os.environ.get(DEEPSPEED_ENV)
    if not given or given == "none":
        return None
    found = recipe_file(given)
    if found != given:
        os.environ[DEEPSPEED_ENV] = str(shipped_recipes() / given[len(PREFIX) :])
    return os.environ[DEEPSPEED_ENV]
