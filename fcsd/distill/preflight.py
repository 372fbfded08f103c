"""``fcsd convert``'s pre-flight: what a run will touch, resolved and checked in one pass before anything is loaded or
written, into one :class:`Checked` value that the trainer consumes.

In order: the output folder (not in use by another command, not an input, what the run may do with it: new, resume
after :func:`fcsd.distill.resume.check_resume`, restart, replace), the export target, the model source (``demo``
built, a missing local folder refused) and its ``config.json`` (family, shape, ``farskip.layers``, ``data.seq_len``,
``parallel.placement``: :func:`fcsd.distill.models.check_model_config`), the data sources. Later steps take the
resolved sources from here: nothing downstream resolves a name again. Only the folder checks are the main process's
(it alone writes); every process resolves the sources it reads. The lock
(:func:`fcsd.distill.run_io.output_dir_claimed`) is taken after this pass and checks the folder once more under it:
another command may have written there since.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fcsd.distill.config import FCSDConfig
from fcsd.run_folder import RunFolder


@dataclass(frozen=True)
class Checked:
    """A run's inputs after :func:`preflight`: the config as given, its run folder, what the main process may do
    with it (``action``; None on the other processes), the model source resolved (a local folder or a hub id) with
    its ``config.json``, and the data sources resolved."""

    config: FCSDConfig
    run: RunFolder
    action: str | None
    model: str
    model_config: Any
    data: str | None
    eval_data: str | None


def preflight(config: FCSDConfig, is_main: bool = True) -> Checked:
    """Resolve and check everything ``config`` will touch (see the module docstring); raises one-line errors."""
    from fcsd import ownership
    from fcsd.distill import run_io
    from fcsd.distill.models import check_model_config
    from fcsd.sources import resolve_data, resolve_model

    run, action = RunFolder(config.output_dir), None
    if is_main:
        ownership.check_not_in_use(Path(config.output_dir), "output_dir")
        action = run_io.check_output_dir(run.root, config.train.resume, config.overwrite, config)
        run_io.check_export_dir(config)
    model = resolve_model(config.model.name)
    model_config = check_model_config(config, model)
    data = resolve_data(config.data.path)
    eval_data = resolve_data(config.data.eval_path) if config.data.eval_path else None
    return Checked(config, run, action, model, model_config, data, eval_data)
