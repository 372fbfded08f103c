"""Checkpoints of an FCSD run (design §3: resume must be exact; nothing half-written is ever visible).

A step checkpoint (``checkpoints/step-N/``) holds accelerate's ``save_state`` (model, optimizer, scheduler, every
process's RNG) plus the trainer state (data position, spike-guard and early-stopping state); ``final/`` and
``best/`` hold the model in the checkpoint's dtype with the tokenizer and the run config. Each is written under a
dotted staging name and renamed into place once every process has finished writing.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path

import torch

from fcsd.distill.config import FCSDConfig
from fcsd.files import checksums, ownership
from fcsd.files.run_folder import CHECKPOINT_FORMAT, CHECKPOINT_RECORD, CONFIG, SIZE_ONLY_NOTE, TRAINER_STATE, RunFolder
from fcsd.files.staging import atomic_dir, disk_full_reported
from fcsd.parallel.processes import print_once


def save_checkpoint(
    accelerator, run: RunFolder, step: int, trainer_state: dict, keep: int, expert_parallel=None
) -> Path:
    """``checkpoints/step-<step>/``, staged and renamed into place after every process has written its files.
    ``expert_parallel``: ``(model, optimizer)`` of a student laid out by :mod:`fcsd.parallel.layout`, whose shards
    every process writes with ``torch.distributed.checkpoint`` beside accelerate's state (scheduler, RNG)."""
    target = run.step_checkpoint(step)
    staging = target.with_name(f".{target.name}.partial")
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        ownership.record(run.checkpoints_dir)
    accelerator.wait_for_everyone()
    with disk_full_reported(run.checkpoints_dir):
        accelerator.save_state(str(staging))
        if expert_parallel is not None:
            from fcsd.parallel import step_state

            step_state.save(*expert_parallel, staging)
        accelerator.wait_for_everyone()  # every process's RNG file is in the staging folder before it is renamed
        hashes = _content_hashes(accelerator, staging)
        if accelerator.is_main_process:
            # the files a resume needs, with their sizes and SHA-256: --resume and `fcsd export` refuse a checkpoint
            # that lost one or whose bytes changed since
            files = {p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file()}
            from fcsd.distill.resume import RUN_RECORD, checkpoint_record

            state = {
                **trainer_state,
                RUN_RECORD: checkpoint_record(run),  # whose checkpoint this is: --resume refuses another run's
                "checkpoint_format": CHECKPOINT_FORMAT,
                "files": files,
                checksums.ALGORITHM: hashes,
            }
            (staging / TRAINER_STATE).write_text(json.dumps(state))
            if target.exists():  # a checkpoint of a run resumed from an older one (train.resume_step)
                shutil.rmtree(target)
            os.replace(staging, target)
            run.prune_checkpoints(keep)
    accelerator.wait_for_everyone()
    return target


def _content_hashes(accelerator, staging: Path) -> dict[str, str]:
    """SHA-256 of every file in the staged checkpoint, each process hashing its share (a collective:
    :func:`fcsd.files.checksums.gathered_digests`); a file another process could not read is hashed by the main one,
    which alone uses them."""
    files = sorted(p for p in staging.iterdir() if p.is_file())
    found = checksums.gathered_digests(files, accelerator.process_index, accelerator.num_processes)
    if not accelerator.is_main_process:  # only the main process records them (and may rename the folder now)
        return found
    return {p.name: found.get(p.name) or checksums.file_digest(p) for p in files}


def restore_checkpoint(accelerator, run: RunFolder, expert_parallel=None, step: int | None = None) -> dict | None:
    """Load the newest checkpoint (or ``checkpoints/step-<step>``) into the prepared objects (and
    ``expert_parallel``'s model and optimizer, see :func:`save_checkpoint`); its trainer state, or None if there is
    none. :func:`fcsd.distill.resume.check_resume` checked it is complete."""
    checkpoint = run.resume_checkpoint(step)
    if checkpoint is None:
        print_once(f"--resume: {run.root} holds no checkpoint yet, so the run starts at step 0")
        return None
    from fcsd.parallel import step_state

    trainer_state = json.loads((checkpoint / TRAINER_STATE).read_text())
    layout = expert_parallel[0].fcsd_layout.dims.name if expert_parallel is not None else None
    step_state.check_resumable(trainer_state.get("layout"), checkpoint, layout)
    optimizers = [expert_parallel[1]] if expert_parallel is not None else accelerator._optimizers
    before = _schedule_state(optimizers, accelerator._custom_objects)
    accelerator.load_state(str(checkpoint))
    if expert_parallel is not None:
        step_state.load(*expert_parallel, checkpoint)
    _check_loaded_state(run, checkpoint, before, _schedule_state(optimizers, accelerator._custom_objects))
    _check_scheduler_step(run, checkpoint, accelerator._custom_objects, trainer_state.get("step"))
    print_once(
        f"resuming from {checkpoint}" + (f" (note: {SIZE_ONLY_NOTE})" if run.checked_by_size_only(checkpoint) else "")
    )
    return trainer_state


def _schedule_state(optimizers, objects) -> dict:
    """What a step checkpoint's state sets that the run's own settings decide: each optimizer group's peak LR,
    betas and weight decay, and each scheduler's base LRs."""
    found = {}
    for i, optimizer in enumerate(optimizers):
        for j, group in enumerate(optimizer.param_groups):
            for key in ("initial_lr", "betas", "weight_decay"):
                if key in group:
                    value = group[key]
                    found[f"optimizer group {j}{f' of optimizer {i}' if i else ''} {key}"] = (
                        list(value) if isinstance(value, tuple | list) else value
                    )
    for i, scheduler in enumerate(o for o in objects if hasattr(o, "base_lrs")):
        found[f"scheduler{f' {i}' if i else ''} base LRs"] = list(scheduler.base_lrs)
    return found


def _check_loaded_state(run: RunFolder, checkpoint: Path, before: dict, after: dict) -> None:
    """A checkpoint's optimizer and scheduler state must carry the run's own LR schedule and optimizer settings
    (those of a checkpoint with no run record, or an edited one, are only known once loaded)."""
    changed = [
        f"{key}: {after.get(key)} vs the run's {value}" for key, value in before.items() if after.get(key) != value
    ]
    if changed:
        raise ownership.FolderError(
            f"--resume: {checkpoint.relative_to(run.root)} holds another LR schedule or optimizer than the run's "
            f"({'; '.join(changed[:3])}): it is no checkpoint of this run; move it out of {run.checkpoints_dir} and "
            f"resume from the run's own, or train from it as a new run with `train.init_from={checkpoint}`"
        )


def _check_scheduler_step(run: RunFolder, checkpoint: Path, objects, step) -> None:
    """The scheduler's position (one step per training step) must be the checkpoint's step."""
    positions = [o.last_epoch for o in objects if hasattr(o, "base_lrs") and hasattr(o, "last_epoch")]
    if isinstance(step, int) and any(position != step for position in positions):
        raise ownership.FolderError(
            f"--resume: {checkpoint.relative_to(run.root)} is at step {step} but its LR schedule at step "
            f"{positions[0]}: its trainer state or scheduler state was edited or copied from elsewhere; resume from "
            "another of the run's checkpoints (`--resume train.resume_step=N`)"
        )


def save_model(
    student, state_dict, tokenizer, config: FCSDConfig, folder: Path, record: dict, is_main: bool = True
) -> None:
    """``final/`` (or ``best/``): the converted checkpoint in the source dtype (``config.dtype``, which
    :func:`~fcsd.distill.student_teacher.load_models` set to the checkpoint's) with its ``config.farskip`` record, the
    tokenizer, the resolved run config and ``record`` (which step this is); atomic. ``state_dict=None``: a model
    laid out by :mod:`fcsd.parallel.layout`, streamed by every process (``is_main``: the one that writes)."""
    from omegaconf import OmegaConf

    dtype = student.config.dtype or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if state_dict is None:
        from fcsd.parallel import stream_save

        if not is_main:
            stream_save.write_weights(student, None, dtype)
            return
    with atomic_dir(folder) as staging:
        if state_dict is None:
            stream_save.write_weights(student, staging, dtype)
            stream_save.save_config(student, staging)
        else:  # tied copies left out as the streamed layout leaves them (a cast copy no longer shares storage)
            from fcsd.parallel.stream_save import stock_keys

            state_dict = {k: state_dict[k] for k in stock_keys(student, state_dict)}
            state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
            student.save_pretrained(staging, state_dict=state_dict)
        set_saved_dtype(staging, dtype)
        tokenizer.save_pretrained(staging)
        OmegaConf.save(OmegaConf.structured(config), staging / CONFIG)
        files = sorted({*(p.name for p in staging.iterdir()), CHECKPOINT_RECORD})  # what a replace may remove
        record = {**record, **_final_identity(folder.parent, config)}
        (staging / CHECKPOINT_RECORD).write_text(json.dumps({**record, "files": files}, indent=2))


def set_saved_dtype(folder: Path, dtype: torch.dtype) -> None:
    """``save_pretrained`` writes the dtype of the parameters in memory (fp32 master weights) into config.json,
    not that of the tensors it was given: record the dtype the weights were saved in, so that ``dtype="auto"`` (the
    export, ``fcsd eval``) loads them as they are."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name
    if isinstance(config.get("text_config"), dict) and "dtype" in config["text_config"]:
        config["text_config"]["dtype"] = name
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _final_identity(root: Path, config) -> dict:
    """``final/``'s (and ``best/``'s) record of the run it belongs to and where its weights started
    (``train.init_from``)."""
    marker = ownership.read_marker(root)
    found = {"run_id": marker.run_id} if marker is not None and marker.run_id else {}
    if config.train.init_from:
        found["init_from"] = init_source(Path(config.train.init_from))
    return found


@functools.cache  # read once at the start: the source run may prune that checkpoint before this run's final save
def init_source(checkpoint: Path) -> dict:
    """How a run records the step checkpoint it started from: its path, step and run id."""
    record = RunFolder.of_checkpoint(checkpoint).trainer_state(checkpoint).get("run")
    run_id = record.get("id") if isinstance(record, dict) else None
    return {"path": str(checkpoint), "step": int(checkpoint.name[5:]), "run_id": run_id}


def load_init_weights(student, config, run: RunFolder) -> None:
    """``train.init_from``: the student starts from the weights of another run's step checkpoint (its optimizer and
    schedule are this run's own, fresh); nothing to do when ``--resume`` restores a checkpoint of this run."""
    if not config.train.init_from:
        return
    if config.train.resume and run.resume_checkpoint(config.train.resume_step) is not None:
        return
    from safetensors.torch import load_file

    checkpoint = Path(config.train.init_from)
    if (checkpoint / "model.safetensors").exists():
        state = load_file(str(checkpoint / "model.safetensors"))
    else:  # the shards of a parallel layout, read back in the stock layout
        from fcsd.parallel.step_state import stock_tensors

        state = dict(stock_tensors(checkpoint))
    absent, unexpected = student.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if student.config.get_text_config().tie_word_embeddings else set()
    if set(absent) - tied or unexpected:
        raise ValueError(
            f"train.init_from={checkpoint} does not hold this model's weights (missing {sorted(absent)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}); give a step checkpoint of a run of {config.model.name}"
        )
    student.tie_weights()
    source = init_source(checkpoint)
    print_once(
        f"train.init_from: starting from the weights of {checkpoint} (run id {source['run_id']}, step "
        f"{source['step']}), with a fresh optimizer and this run's LR schedule"
    )
