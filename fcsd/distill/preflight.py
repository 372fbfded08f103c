"""``fcsd convert``'s pre-flight: what a run will touch, resolved and checked in one pass before anything is loaded or
written, into one :class:`Checked` value that the trainer consumes.

In order: the output folder (not in use by another command, not an input, what the run may do with it: new, resume
after :func:`fcsd.distill.resume.check_resume`, restart, replace), the export target, the model source (``demo``
built, a missing local folder refused) and its ``config.json`` (family, shape, ``farskip.layers``, ``data.seq_len``,
``parallel.placement``: :func:`check_model_config`), the data sources. Later steps take the resolved sources from
here: nothing downstream resolves a name again. Only the folder checks are the main process's (it alone writes);
every process resolves the sources it reads, and in a launch every process hashes its share of the checkpoint a
``--resume`` continues (:func:`fcsd.files.checksums.hashed_together`). The lock (:func:`output_dir_claimed`) is taken
after this pass and checks the folder once more under it: another command may have written there since.
"""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fcsd.command_line import torchrun_line
from fcsd.distill.config import FCSDConfig
from fcsd.distill.resume import OUTPUT_FIX
from fcsd.files import checksums, ownership
from fcsd.files.run_folder import RunFolder
from fcsd.loading import check_tokenizer_files
from fcsd.sources import resolve_data, resolve_model


@dataclass(frozen=True)
class Checked:
    """A run's inputs after :func:`preflight`: the config as given (its local inputs absolute), its run folder, the
    model source resolved (a local folder or a hub id) with its ``config.json``, and the data sources resolved."""

    config: FCSDConfig
    run: RunFolder
    model: str
    model_config: Any
    data: str | None
    eval_data: str | None


def preflight(config: FCSDConfig, is_main: bool = True) -> Checked:
    """Resolve and check everything ``config`` will touch (see the module docstring); raises one-line errors."""
    run = RunFolder(config.output_dir)
    # the checksums of a checkpoint --resume continues are read by every process of a launch, each its share,
    # before the process group's first barrier: one process reading TBs alone would time the others out
    with checksums.hashed_together(is_main):
        if is_main:
            ownership.check_not_in_use(run.root, "output_dir")
            check_output_dir(run.root, config.train.resume, config.overwrite, config)
            check_export_dir(config)
            check_data_cache_dir(config)
    if config.train.resume:  # what the resumed run trains with, as its fcsd_config.yaml will say
        from fcsd.distill.resume import continued_config

        config = continued_config(run, config, is_main)
    config = absolute_inputs(config)
    model = resolve_model(config.model.name)
    model_config = check_model_config(config, model)
    check_tokenizer_files(model)  # before the run folder is made: the run trains with the checkpoint's tokenizer
    check_init_from(config, model, is_main)
    data = resolve_data(config.data.path)
    eval_data = resolve_data(config.data.eval_path) if config.data.eval_path else None
    check_launcher(config)  # last: what the command would be refused for under torchrun is said first
    return Checked(config, run, model, model_config, data, eval_data)


#: a run's inputs: how messages name them -> their setting (the placement is read, never written around)
INPUTS = {
    "model": "model.name",
    "data file": "data.path",
    "eval data": "data.eval_path",
    "MBPP+ file": "early_stop.data",
    "teacher cache": "teacher.cache_dir",
    "placement": "parallel.placement",
    "train.init_from checkpoint": "train.init_from",
}


def absolute_inputs(config: FCSDConfig) -> FCSDConfig:
    """``config`` with each input that names a local file or folder (:data:`INPUTS`) made absolute, as the run's
    ``fcsd_config.yaml`` records it: a resume or an export started from another folder then reads the run's own
    source (a composite's vision tower, the tokenizer), where the relative name would name another folder or none.
    The demo's names and hub ids stay as given."""
    import copy
    import os

    from fcsd.sources import DEMO_DATA, DEMO_NAME

    config = copy.deepcopy(config)
    for key in INPUTS.values():
        group, name = key.split(".")
        value = getattr(getattr(config, group), name)
        if isinstance(value, str) and value not in ("", DEMO_NAME, *DEMO_DATA) and not Path(value).is_absolute():
            if Path(value).expanduser().exists():
                setattr(getattr(config, group), name, os.path.abspath(Path(value).expanduser()))
    return config


def check_init_from(config, model: str, is_main: bool = True) -> None:
    """``train.init_from`` names a sound step checkpoint of a run of the same model (its weights in the same
    placement), and the student loads in one piece (not laid out by ``parallel.ep_size`` / ``parallel.fsdp``)."""
    source = config.train.init_from
    if not source or (config.train.resume and RunFolder(config.output_dir).checkpoints()):
        return  # a resume continues from the run's own checkpoint (the source may be pruned since)
    from fcsd.files.run_folder import is_step_checkpoint

    checkpoint, where = Path(source), f"train.init_from={source}"
    if not checkpoint.exists():
        raise ValueError(f"{where} does not exist; give a step checkpoint of another run (RUN/checkpoints/step-N)")
    if not checkpoint.is_dir() or not is_step_checkpoint(checkpoint) or not checkpoint.name[5:].isdigit():
        raise ValueError(
            f"{where} is no step checkpoint (RUN/checkpoints/step-N with its trainer_state.json); give one, or give a "
            "run's final/ or an export as MODEL to train further from it"
        )
    run = RunFolder.of_checkpoint(checkpoint)
    problems = run.checkpoint_problems(checkpoint, contents=is_main)
    if not run.config.exists():
        problems.append(f"{run.config} missing")
    if problems:
        raise ValueError(f"{where} cannot be trained from: {', '.join(problems)}; give a sound step checkpoint")
    from omegaconf import OmegaConf

    from fcsd.distill.resume import _same_setting, weights_fingerprint

    theirs = OmegaConf.load(run.config)
    recorded = (run.trainer_state(checkpoint).get("inputs") or {}).get("model")
    now = weights_fingerprint(model, config.model.revision) if recorded else None
    name = OmegaConf.select(theirs, "model.name")
    same = recorded == now if recorded and now else _same_setting("model.name", name, config.model.name)
    if not same:
        raise ValueError(
            f"{where} is a checkpoint of another model ({name}), not of model.name={config.model.name}; give a step "
            "checkpoint of a run of this model"
        )
    placement = OmegaConf.select(theirs, "parallel.placement")
    if not _same_setting("parallel.placement", placement, config.parallel.placement):
        raise ValueError(
            f"{where} holds its experts in the order of parallel.placement={placement}, this run "
            f"{config.parallel.placement}: set parallel.placement={placement}"
        )
    from fcsd.parallel.processes import sharded_by_accelerate

    if config.parallel.ep_size > 1 or config.parallel.fsdp or sharded_by_accelerate(deepspeed_only=True):
        raise ValueError(
            f"{where} loads into a student in one piece: drop parallel.ep_size / parallel.fsdp (and DeepSpeed, which "
            "partitions the student as it loads), or use accelerate's DDP or FSDP (recipes/accelerate/)"
        )


def check_launcher(config) -> None:
    """``parallel.ep_size > 1`` and ``parallel.fsdp=true`` lay the model out over processes that a launcher starts
    (``torchrun``, ``accelerate launch``): in one plain process torch would fail later with "Default process group
    has not been initialized". Refused in one line with the ``torchrun`` line that runs the same command."""
    import os

    parallel = config.parallel
    if not (parallel.ep_size > 1 or parallel.fsdp) or "WORLD_SIZE" in os.environ:
        return
    import torch

    nproc = parallel.ep_size if parallel.ep_size > 1 else max(2, torch.cuda.device_count())
    asked = " and ".join(
        [f"parallel.ep_size={parallel.ep_size}"] * (parallel.ep_size > 1) + ["parallel.fsdp=true"] * parallel.fsdp
    )
    raise ValueError(
        f"{asked} lays the model out over several processes, which a launcher starts, and this is one plain process: "
        f"launch it with `{torchrun_line(nproc)}` (one process per GPU; parallel.ep_size must divide their "
        "number), or drop the parallel settings to train in one process"
    )


def run_inputs(config) -> dict:
    """The local inputs of a run (name -> path; unset ones are None) that its output folders must never be, contain
    or lie inside."""
    inputs = {}
    for name, key in INPUTS.items():
        group, setting = key.split(".")
        inputs[name] = getattr(getattr(config, group), setting)
    return inputs


def check_output_dir(output_dir: Path, resume: bool, overwrite: bool, config=None) -> str:
    """What ``fcsd convert`` may do with ``output_dir``, decided before anything is written (see
    :mod:`fcsd.files.ownership` for the ownership rules): ``"new"`` (empty or absent), ``"resume"`` (``--resume``, after
    :func:`fcsd.distill.resume.check_resume`), ``"restart"`` (a run folder that holds no checkpoint yet: a run that
    failed after it started) or ``"replace"`` (``overwrite=true`` on a run folder). Anything else is refused in one
    line: an input (or the current / home folder), a folder of another kind (an export, a teacher cache), files fcsd
    did not write, or a run folder without ``--resume`` / ``overwrite``."""
    if config is not None:
        ownership.check_not_an_input(output_dir, "output_dir", run_inputs(config), "run")
    run = RunFolder(output_dir)
    if resume:
        from fcsd.distill.resume import check_resume

        check_resume(run, config)
        return "resume"
    if not _run_entries(output_dir):
        return "new"
    ownership.check_replaceable(output_dir, "run", "output_dir", OUTPUT_FIX)
    if not run.checkpoints() and not run.final.exists() and not run.best.exists():
        return "restart"  # a failed start: nothing worth keeping
    if overwrite:
        return "replace"
    raise ownership.FolderError(
        f"output_dir {output_dir} holds a run; pass --resume (train.resume=true) to continue it, overwrite=true to "
        "replace it, or choose another output_dir"
    )


def _run_entries(output_dir: Path) -> list[str]:
    """What ``output_dir`` holds besides fcsd's marker and lock, staging leftovers and a kept teacher cache."""
    if not output_dir.is_dir():
        return [output_dir.name] if output_dir.exists() else []
    marker = ownership.read_marker(output_dir)
    if marker is not None and not marker.is_kind("run"):
        return [ownership.MARKER]  # another kind of fcsd folder (or a damaged marker): never empty for a run
    return [
        p.name
        for p in output_dir.iterdir()
        if p.name != ownership.MARKER
        and not ownership.is_lock_file(p.name)
        and not ownership.is_staging_leftover(p.name)
        and not (p.name == RunFolder(output_dir).teacher_cache.name and ownership.is_marked(p))
    ]


@contextmanager
def output_dir_claimed(config, is_main: bool = True, checked: bool = False):
    """Hold ``output_dir`` for the whole run: check it (unless ``checked``: :func:`fcsd.distill.preflight.preflight`
    did), take its lock (one run per folder), check it again under the lock (another command may have written there
    since), then remove staging leftovers of a dead run and clear what a restart or ``overwrite=true`` replaces.
    Only the main process checks and locks."""
    if not is_main:
        yield
        return
    output_dir = Path(config.output_dir)
    if not checked:
        ownership.check_not_in_use(output_dir, "output_dir")
        check_output_dir(output_dir, config.train.resume, config.overwrite, config)
        check_export_dir(config)
    with ownership.folder_lock(output_dir, "output_dir"):
        action = check_output_dir(output_dir, config.train.resume, config.overwrite, config)  # now that it is ours
        stale = ownership.remove_stale_staging(output_dir)
        if stale:
            print(f"removed staging leftovers of an earlier run that died: {', '.join(stale)}")
        if action in ("restart", "replace"):
            ownership.clear(output_dir, "run", "output_dir", OUTPUT_FIX)
        if action == "resume" and config.train.resume_step is not None:
            set_aside_newer_checkpoints(RunFolder(output_dir), config.train.resume_step)
        yield


def set_aside_newer_checkpoints(run: RunFolder, step: int) -> None:
    """``--resume train.resume_step=N`` abandons the checkpoints after N: they are renamed
    ``checkpoints/abandoned-step-M`` (kept, never resumed from or pruned into the new trajectory's)."""
    newer = [c for c in run.checkpoints() if int(c.name[5:]) > step]
    for checkpoint in newer:
        target = checkpoint.with_name(f"abandoned-{checkpoint.name}")
        if target.exists():
            shutil.rmtree(target)
        checkpoint.rename(target)
    if newer:
        from fcsd.parallel.processes import print_once

        names = ", ".join(c.name for c in newer)
        print_once(
            f"resuming from step-{step}: set aside the later checkpoints {names} as checkpoints/abandoned-step-*"
        )


def check_data_cache_dir(config) -> None:
    """``data.cache_dir`` (the packed-data cache, shared by runs) must be a folder of its own: not the run's
    ``output_dir`` nor any folder fcsd owns, nor inside one (the packed files would be entries the folder's command
    did not write: a run would refuse ``overwrite=true`` over them, a clear could delete another run's cache)."""
    if not config.data.cache_dir:
        return
    cache = Path(config.data.cache_dir).expanduser().resolve()
    output_dir = Path(config.output_dir).expanduser().resolve()
    in_run = cache == output_dir or output_dir in cache.parents  # the run's folder may not be marked yet
    found = (output_dir, None) if in_run else ownership.nearest_marked(cache)
    if found is None:
        return
    folder, marker = found
    what = "the run's output_dir" if marker is None else marker.description()
    relation = "is" if folder == cache else "lies inside"
    raise ownership.FolderError(
        f"data.cache_dir {cache} {relation} {what} {folder}; give the packed-data cache a folder of its own "
        "(unset, it is the user cache's packed/)"
    )


def check_export_dir(config) -> None:
    """An explicit ``export_dir`` is checked before training: not an input, not a folder around the run, and
    empty, or (with ``overwrite=true``) an export fcsd wrote that holds nothing else."""
    if not (config.export and config.export_dir):
        return
    from fcsd.export.save import check_export_target

    export_dir = Path(config.export_dir)
    ownership.check_not_an_input(export_dir, "export_dir", run_inputs(config), "export")
    run, target = RunFolder(Path(config.output_dir).expanduser().resolve()), export_dir.expanduser().resolve()
    if run.root in target.parents and target != run.export:  # the export would be refused there after training
        raise ValueError(
            f"export_dir {config.export_dir} lies inside the run's output_dir {run.root}, which the run writes: choose "
            f"a folder outside it, or leave export_dir unset for {run.export}"
        )
    check_export_target(export_dir, config.overwrite, [], "export_dir", run_root=Path(config.output_dir))


def check_model_config(config: FCSDConfig, source: str | None = None, loads_teacher: bool = False):
    """What the model's ``config.json`` decides about the run, checked before any weights load: a supported family
    of a possible shape (:func:`~fcsd.connectivity.families.family_for_config`), ``farskip.layers`` converting at
    least one of its layers, ``data.seq_len`` within its ``max_position_embeddings`` (above, it would train
    positions the model never learned, silently), ``parallel.placement`` made for it and, where the teacher loads
    (``loads_teacher``, or not ``teacher.mode=cache``), an FP8 teacher's kernels. Returns the config. ``source``:
    ``model.name`` already resolved."""
    from fcsd.connectivity.families import family_for_config, text_config
    from fcsd.connectivity.layer_spec import converted_layers
    from fcsd.loading import load_config

    name = source or resolve_model(config.model.name)
    model_config = load_config(name, config.model.revision)
    family_for_config(model_config)
    decoder = text_config(model_config)
    converted_layers(config.farskip.layers, decoder.num_hidden_layers, "farskip.layers")
    check_seq_len(config, decoder)
    check_placement_file(config, model_config)
    check_export_format(config, model_config, decoder)
    if config.teacher.mode == "cache":
        check_top_k(config, decoder)
    if config.teacher.dtype == "fp8" and (loads_teacher or config.teacher.mode != "cache"):
        from fcsd.block_fp8 import check_fp8_modules, fp8_settings

        check_fp8_modules(fp8_settings(model_config), name)  # its kernels too, before any weights load
    return model_config


def check_seq_len(config: FCSDConfig, decoder) -> None:
    """``data.seq_len`` within the model's ``max_position_embeddings`` (``decoder``: its text config): above, the run
    would train positions the model never learned, silently."""
    limit = getattr(decoder, "max_position_embeddings", None)
    if limit and config.data.seq_len > limit:
        raise ValueError(
            f"data.seq_len={config.data.seq_len} is above the model's max_position_embeddings ({limit}); set "
            f"data.seq_len={limit} or less"
        )


def check_top_k(config: FCSDConfig, decoder) -> None:
    """``teacher.top_k`` within the vocabulary of ``decoder`` (the model's text config): the teacher cache keeps that
    many log-probabilities per token and the rest of the mass as one bucket."""
    top_k, vocab = config.teacher.top_k, decoder.vocab_size
    if not 1 <= top_k <= vocab:
        raise ValueError(
            f"teacher.top_k={top_k}: the cache keeps 1 to {vocab} of the teacher's {vocab} log-probabilities per token "
            "(the rest of the mass as one bucket); e.g. teacher.top_k=64"
        )


def check_export_format(config: FCSDConfig, model_config, decoder) -> None:
    """The run's export must be one fcsd writes: a composite of a block-FP8 source (``decoder``, its text config, is
    not ``model_config``) is exported in bf16 or as the text model alone, refused before training, not after it."""
    if not config.export or config.export_text_only or config.export_format != "source" or decoder is model_config:
        return
    from fcsd.block_fp8 import fp8_settings
    from fcsd.export.composite import check_format

    check_format((config.model.name, config.model.revision), fp8_settings(model_config))


def check_placement_file(config: FCSDConfig, model_config) -> None:
    """``parallel.placement`` must fit the model and the run before anything loads: a placement made for another
    expert count, expert-parallel size or other MoE layers is refused in one line (its routes' model fingerprint is
    compared once the weights are loaded)."""
    if not config.parallel.placement:
        return
    from fcsd.model_summary import summarize
    from fcsd.placement.format import load_placement

    placement = load_placement(config.parallel.placement)
    model = summarize(config.model.name, config=model_config)
    where = f"parallel.placement={config.parallel.placement}"
    if placement.num_experts != model.num_experts:
        raise ValueError(f"{where} is for {placement.num_experts} experts per layer, the model has {model.num_experts}")
    if placement.ep != config.parallel.ep_size:
        raise ValueError(f"{where} places experts on {placement.ep} ranks; set parallel.ep_size={placement.ep}")
    unknown = sorted(set(placement.layers) - set(model.moe_layers))
    if unknown:
        raise ValueError(f"{where} names layer(s) {unknown}, not MoE layers of the model ({model.moe_layers})")
