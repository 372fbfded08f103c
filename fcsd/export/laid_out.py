"""The end-of-run export of a parallel run, without any process holding the whole model (design §4 "EP at scale").

``final/`` (or ``best/``) of such a run is already in the stock layout and the model's dtype, as safetensors shards
with an index (:mod:`fcsd.parallel.stream_save`): the export copies those files as they are (file to file, no tensor
in memory), adds what :func:`fcsd.export.save.export` adds (remote code, config, model card), and checks reload
parity laid out: every process loads the source and the staged export over the run's meshes, reading only its
slices (:func:`fcsd.parallel.load.from_pretrained_parallel`), and compares their logits on the same fixed batch;
the largest difference over all processes must be within the dtype's tolerance, as for a one-process export. The
main process writes the parity record and publishes the folder.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from fcsd.weight_files import INDEX, WEIGHTS

COPIED = ("*.safetensors", INDEX, "config.json", "generation_config.json")


def export_laid_out(
    source: Path,
    out_dir: Path,
    meshes,
    overwrite: bool = False,
    export_format: str = "source",
    text_only: bool = False,
) -> Path:
    """Export ``source`` (a parallel run's ``final/`` or ``best/``) to ``out_dir``; a collective: every process.
    From a block-FP8 source, the main process rewrites the copied files in that format one at a time unless
    ``export_format="bf16"`` (:mod:`fcsd.export.fp8`). The text tower of a multimodal source is exported as that
    composite unless ``text_only`` (:mod:`fcsd.export.composite`: the main process copies the vision tower's bytes)."""
    import gc

    from fcsd.export.composite import check_format as check_composite_format
    from fcsd.export.composite import compose, composite_source
    from fcsd.export.fp8 import (
        check_format,
        check_names,
        finish_config,
        format_name,
        quantize_folder,
        source_quantization,
    )
    from fcsd.export.save import (
        ExportError,
        check_export_target,
        complete_export,
        parity_tolerance,
        write_parity_record,
    )
    from fcsd.files.run_folder import RunFolder
    from fcsd.files.staging import atomic_dir
    from fcsd.loading import load_config, tokenizer_from_pretrained
    from fcsd.parallel.load import concrete_class

    gc.collect()  # the training run's models (their hooks hold cycles)
    source, out_dir = Path(source), Path(out_dir).resolve()
    main = dist.get_rank() == 0
    check_export_target(out_dir, overwrite, [source], run_root=RunFolder.of_checkpoint(source).root)  # everywhere
    composite = composite_source(source, text_only, say=print if main else None)  # the note: rank 0 alone
    config = load_config(str(source))
    dtype = getattr(torch, config.dtype) if isinstance(config.dtype, str) else config.dtype or torch.float32
    record = source_quantization(config) if check_format(export_format) == "source" else None
    check_composite_format(composite, record)  # every process refuses alike, before anything is written
    if record is not None:
        check_names(source, record)  # final/'s files are the export's: checked here by every process
    with contextlib.ExitStack() as stack:
        staging = (
            [str(stack.enter_context(atomic_dir(out_dir, kind="export", replace=overwrite, what="OUT_DIR")))]
            if main
            else [None]
        )
        dist.broadcast_object_list(staging, src=0)
        staging = Path(staging[0])
        farskip = [None]
        if main:
            for pattern in COPIED:
                for path in sorted(source.glob(pattern)):
                    shutil.copy2(path, staging / path.name)
            tokenizer_from_pretrained(str(source)).save_pretrained(staging)
            model_config, model_class = config, concrete_class(str(source), True, config)
            if composite is not None:
                model_config, model_class = compose(staging, *composite)
            farskip = [complete_export(staging, model_config, model_class, source, format_name(record, dtype))]
            if record is not None:
                quantize_folder(staging, record)
            finish_config(staging, record)
        dist.broadcast_object_list(farskip, src=0)  # the staged folder is complete before anyone reads it
        difference, expected = _parity(source, staging, meshes)
        tolerance = parity_tolerance(staging, expected, dtype)
        if not difference <= tolerance:
            raise ExportError(
                f"reload parity failed: max |logit difference| {difference:.3g} (tolerance {tolerance:g}) between "
                f"{source} and its export; the export was not written"
            )
        if main:
            write_parity_record(staging, difference, format_name(record, dtype), farskip[0])
            if not (staging / WEIGHTS).exists() and not (staging / INDEX).exists():
                raise ExportError(f"{source} holds no safetensors weights to export")
        dist.barrier()
    dist.barrier()  # published
    return out_dir


@torch.no_grad()
def _parity(source: Path, staging: Path, meshes) -> tuple[float, torch.Tensor]:
    """The largest logit difference, over every process, between ``source`` and its staged export loaded laid out,
    and the source's logits."""
    from fcsd.export.save import parity_batch, text_logits
    from fcsd.parallel.load import from_pretrained_parallel

    device = torch.device(meshes.device_type if meshes.device_type != "cuda" else f"cuda:{torch.cuda.current_device()}")
    logits = []
    for folder in (source, staging):
        # text_only: a composite export's text tower, as the source (a text model) is
        model = from_pretrained_parallel(str(folder), meshes, "teacher", text_only=True, device=device, dtype="auto")
        model.eval()
        logits.append(text_logits(model, parity_batch(model).to(device)))
        del model
    difference = (logits[0] - logits[1]).abs().max().reshape(1)
    dist.all_reduce(difference, op=dist.ReduceOp.MAX)
    return float(difference), logits[0]
