"""FCSD's two models from one checkpoint (paper Sec. 3.1): the frozen teacher (the checkpoint as it is) and the
student (the same weights with FarSkip connectivity on ``farskip.layers``). Both load through
:func:`fcsd.loading.from_pretrained`, so a stock checkpoint, an exported ``farskip_*`` folder, a hub id and ``demo``
are all valid sources."""

from __future__ import annotations

import torch

from fcsd.distill import losses
from fcsd.distill.config import FCSDConfig
from fcsd.parallel.processes import sharded_by_accelerate
from fcsd.sources import resolve_model


def load_tokenizer(config: FCSDConfig, source: str | None = None, model_config=None):
    """The checkpoint's tokenizer (an export's without its remote code), checked against the model's vocabulary.
    ``source`` and ``model_config``: the resolved model and its config (:mod:`fcsd.distill.preflight`); without
    them :func:`fcsd.distill.preflight.check_model_config` runs first (the model's config read before any
    weights)."""
    from fcsd.distill.preflight import check_model_config
    from fcsd.loading import check_tokenizer_fits, tokenizer_from_pretrained

    name = source or resolve_model(config.model.name)
    model_config = model_config or check_model_config(config, name)
    tokenizer = tokenizer_from_pretrained(name, revision=config.model.revision)
    check_tokenizer_fits(tokenizer, model_config, name)
    return tokenizer


def load_models(
    config: FCSDConfig,
    tokenizer,
    device,
    need_teacher: bool = True,
    need_student: bool = True,
    meshes=None,
    teacher_meshes=None,
    source: str | None = None,
):
    """Frozen teacher and FarSkip student (each ``None`` when not needed) from the same checkpoint.

    The student's master weights are fp32 (``model.dtype=auto``; bf16 compute comes from autocast, the experts'
    included: :mod:`fcsd.precision`) and its
    ``config.dtype`` is the checkpoint's, which is what ``final/`` is saved in. A multimodal checkpoint contributes
    its text model (what FCSD trains and exports). ``meshes`` (``parallel.ep_size`` > 1 or ``parallel.fsdp``,
    :func:`fcsd.parallel.training.run_meshes`): both are built on the meta device, laid out by
    :func:`fcsd.parallel.layout.parallelize` and filled by reading only this process's slices
    (:func:`fcsd.parallel.load.from_pretrained_parallel`); ``teacher_meshes`` lays out the teacher alone that way
    (an FSDP2 run of accelerate, whose student accelerate shards). ``source``: ``model.name`` already resolved."""
    from fcsd.loading import from_pretrained, load_config
    from fcsd.precision import experts_in_compute_dtype

    student_load = teacher_load = from_pretrained
    if meshes is not None or teacher_meshes is not None:
        from fcsd.parallel.training import laid_out_loader

        teacher_load = laid_out_loader(config, meshes or teacher_meshes, "teacher", device)
        if meshes is not None:
            student_load = laid_out_loader(config, meshes, "student", device)

    path = source or resolve_model(config.model.name)
    cuda = device.type == "cuda"
    common = {"trust_remote_code": config.model.trust_remote_code, "text_only": True}
    if config.model.revision:
        common["revision"] = config.model.revision
    if config.model.attn_implementation:
        common["attn_implementation"] = config.model.attn_implementation
    if config.model.experts_implementation:
        common["experts_implementation"] = config.model.experts_implementation
    teacher = student = None
    if need_teacher:
        keep_fp8 = config.teacher.dtype == "fp8"  # a block-FP8 source's FP8 modules (fcsd.block_fp8); else dequantized
        dtype = _dtype("bfloat16" if keep_fp8 else config.teacher.dtype, cuda, "float32", "bfloat16")
        if keep_fp8 and teacher_load is not from_pretrained:  # its kernels: fcsd.block_fp8.check_fp8_modules
            raise ValueError(
                "teacher.dtype=fp8 loads the teacher whole with transformers' FP8 modules, which fcsd's parallel "
                "layouts (parallel.ep_size / parallel.fsdp) do not shard: use teacher.dtype=auto"
            )
        fp8 = {"keep_fp8": True} if keep_fp8 else {}
        placed = straight_to(device) if teacher_load is from_pretrained else {}
        teacher = teacher_load(path, dtype=dtype, **common, **fp8, **placed)
        teacher.eval().requires_grad_(False).to(device)
    if need_student:
        from fcsd.export.composite import record_source

        source_config = load_config(path, revision=config.model.revision)  # an export's: its stock config
        dtype = _dtype(config.model.dtype, cuda, "float32", "float32")
        placed = straight_to(device) if student_load is from_pretrained and not sharded_by_accelerate() else {}
        student = student_load(path, layers=config.farskip.layers, dtype=dtype, **common, **placed)
        student.config.dtype = source_config.dtype
        record_source(student.config, source_config)  # final/ says whether its export puts a vision tower back
    for model in (teacher, student):
        if model is not None:
            experts_in_compute_dtype(model)  # fp32 masters, bf16 expert matmuls under autocast in every layout
    if teacher is not None and student is not None:
        vocab = student.get_output_embeddings().out_features
        losses.check_vocabularies(vocab, teacher.get_output_embeddings().out_features)
    return teacher, student


def straight_to(device: torch.device) -> dict:
    """Load options that read the weights straight onto ``device`` (transformers builds the model on the meta device
    and fills it from the files), so that no process of a DDP job holds a whole fp32 model in host memory on its way
    to its GPU; on the CPU too, so that the path is tested there. Not under DeepSpeed ZeRO-3, whose loader refuses a
    ``device_map``."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return {} if is_deepspeed_zero3_enabled() else {"device_map": {"": device}}


def _dtype(name: str, cuda: bool, cpu_default: str, gpu_default: str) -> torch.dtype:
    return getattr(torch, (gpu_default if cuda else cpu_default) if name == "auto" else name)
