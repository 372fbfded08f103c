"""A step checkpoint (``RUN/checkpoints/step-N``) as a model: what ``fcsd export`` takes from a run that never
reached ``final/`` (design §3). The run's config rebuilds the student; the checkpoint's record proves the weights."""

from __future__ import annotations

import shlex
from pathlib import Path

import torch

from fcsd.command_line import command_line
from fcsd.files.run_folder import SIZE_ONLY_NOTE, RunFolder
from fcsd.parallel.processes import print_once


def load_step_checkpoint(checkpoint: Path):
    """The student of a step checkpoint (``checkpoints/step-N``) and its tokenizer, rebuilt from the run's config
    (model, revision, layers, placement) with the checkpoint's weights (expert-parallel shards consolidated, see
    :func:`fcsd.parallel.step_state.stock_tensors`), in the checkpoint's source dtype: what ``fcsd export``
    takes from a run that never reached ``final/``."""
    from omegaconf import OmegaConf
    from safetensors.torch import load_file

    from fcsd.loading import from_pretrained, load_config, tokenizer_from_pretrained
    from fcsd.sources import resolve_model

    checkpoint = Path(checkpoint)
    run = RunFolder.of_checkpoint(checkpoint)
    problems = run.checkpoint_problems(checkpoint) or ([] if run.config.exists() else [f"{run.config} missing"])
    if problems:
        raise ValueError(f"{checkpoint} cannot be exported: {', '.join(problems)}{_older_export(run, checkpoint)}")
    if run.checked_by_size_only(checkpoint):
        print_once(f"note: {checkpoint} {SIZE_ONLY_NOTE}")
    config = OmegaConf.load(run.config)
    name, revision = resolve_model(config.model.name), config.model.revision
    options = {"revision": revision} if revision else {}
    # built in the source's dtype as a fresh load builds it (buffers such as RoPE's inv_freq stay as transformers
    # keeps them): casting a fp32 model afterwards would cast those too, and the export's parity check would compare
    # the reload with another model
    dtype = load_config(name, revision).dtype or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = from_pretrained(name, layers=config.farskip.layers, text_only=True, dtype=dtype, **options)
    if config.parallel.placement:
        from fcsd.placement import apply_placement

        apply_placement(model, config.parallel.placement)
    if (checkpoint / "model.safetensors").exists():  # accelerate's save_state of a single or data-parallel run
        state = load_file(str(checkpoint / "model.safetensors"))
    else:  # the shards of a parallel layout, read back tensor by tensor in the stock layout
        from fcsd.parallel.step_state import stock_tensors

        state = dict(stock_tensors(checkpoint))
    absent, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.get_text_config().tie_word_embeddings else set()
    if set(absent) - tied or unexpected:
        raise ValueError(f"{checkpoint} does not match {config.model.name}: missing {absent}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval(), tokenizer_from_pretrained(name, revision=revision)


def _older_export(run: RunFolder, checkpoint: Path) -> str:
    """The advice that follows a refused export of a step checkpoint: the ``fcsd export`` of the newest sound older
    one, in place of the checkpoint in the command being run."""
    older = run.newest_sound_checkpoint(int(checkpoint.name[5:])) if checkpoint.name[5:].isdigit() else None
    if older is None:
        return "; no sound older checkpoint is left"
    given = str(checkpoint)
    line = command_line(replace={given: str(older), given + "/": str(older)})
    if shlex.quote(str(older)) not in line:  # the command does not name the checkpoint so (the Python API)
        line = f"fcsd export {shlex.quote(str(older))} OUT"
    return f"; export the newest sound one instead: `{line}`"
