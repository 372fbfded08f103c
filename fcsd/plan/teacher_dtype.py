"""The teacher's dtype in a plan: ``teacher.dtype=fp8`` keeps a block-FP8 source's FP8 modules.

What the run accepts (:func:`fcsd.distill.student_teacher.load_models`, :func:`fcsd.block_fp8.check_fp8_modules`): a
block-FP8 source, GPUs with FP8 kernels (compute capability >= 8.9: Ada, Hopper and later), and the teacher loaded
whole, so one process or DDP; fcsd's parallel layouts (``parallel.ep_size`` / ``parallel.fsdp``) do not shard FP8
modules and refuse it. The plan keeps to that: it refuses ``teacher.dtype=fp8`` in one line where the source or the
cluster's GPUs rule it out, prices the FP8 teacher on the candidates that can run it (:data:`FP8_STRATEGIES`, online
teacher), and prices the others' teacher in bf16, their printed commands saying ``teacher.dtype=auto`` with a note.

How an FP8 teacher is priced: the step is simulated with a bf16 teacher (transformers' FP8 modules run Triton
kernels, which fake tensors cannot), then corrected by the bytes FP8 saves: the weights the source scaled (linear
weights and routed experts' matrices, not the head, the routers or ``modules_to_not_convert``) in e4m3, one byte a
value, plus an fp32 scale per 128 x 128 block; the rest (norms, routers, embeddings, head) stays bf16. The count is
:func:`fcsd.plan.serving_bytes.serving_model`'s, the one the serving check makes of an FP8 export. The whole teacher
is on every GPU for those strategies, so the saving comes off the teacher and off the peak alike.
"""

from __future__ import annotations

import dataclasses

FP8_STRATEGIES = ("single", "ddp")  # where the runtime keeps FP8 modules: the teacher loaded whole on each GPU


def check_fp8_teacher(config, model_config, cluster) -> None:
    """Refuse ``teacher.dtype=fp8`` in one line where no candidate could run it: a source that is not block-FP8,
    or a cluster whose GPUs lack FP8 kernels."""
    if config.teacher.dtype != "fp8":
        return
    from fcsd.block_fp8 import fp8_kernels_available, fp8_settings

    if fp8_settings(model_config) is None:
        raise ValueError(
            "teacher.dtype=fp8 keeps a block-FP8 checkpoint's FP8 modules, but this one is not FP8: use auto"
        )
    gpu = cluster.gpu
    if gpu.compute_capability is None:
        raise ValueError(
            f"teacher.dtype=fp8 needs FP8 kernels (a CUDA GPU of compute capability >= 8.9); the cluster's {gpu.name} "
            "has none known (a ROCm GPU, or a cluster file without compute_capability: measure it again with fcsd "
            "bench cluster): use teacher.dtype=auto (the teacher dequantized to bf16)"
        )
    if not fp8_kernels_available(gpu.compute_capability):
        major, minor = gpu.compute_capability
        raise ValueError(
            f"teacher.dtype=fp8 needs FP8 kernels (compute capability >= 8.9), which the cluster's {gpu.name} "
            f"(compute capability {major}.{minor}) lacks: use teacher.dtype=auto (the teacher dequantized to bf16)"
        )


def fp8_teacher(config, layout) -> bool:
    """Whether ``layout``'s run keeps the FP8 teacher: ``teacher.dtype=fp8``, an online teacher, no parallel
    layout (:data:`FP8_STRATEGIES`)."""
    return config.teacher.dtype == "fp8" and layout.teacher == "online" and layout.strategy in FP8_STRATEGIES


def runnable_teacher_dtype(config, layout) -> str:
    """The ``teacher.dtype`` ``layout``'s command runs with: the config's, except ``fp8`` under a parallel layout
    (refused there), which runs ``auto``."""
    if config.teacher.dtype == "fp8" and layout.strategy not in FP8_STRATEGIES:
        return "auto"
    return config.teacher.dtype


def teacher_weights(model_config) -> dict[str, int]:
    """Bytes of the whole teacher's weights: ``fp8`` (e4m3 + fp32 block scales on the weights the source scaled,
    bf16 for the rest) and ``bf16``. Counted from one meta-device build per config (seconds for DeepSeek-V3) and
    kept: every simulated FP8 candidate of a plan and its note ask for it."""
    from fcsd.connectivity.families import meta_model, text_config
    from fcsd.plan.serving_bytes import serving_model

    key = f"{type(model_config).__qualname__}:{model_config.to_json_string(use_diff=False)}"
    if key not in _TEACHER_WEIGHTS:
        model = meta_model(text_config(model_config))
        fp8, bf16 = (serving_model(model_config, bf16=b, model=model).weights for b in (False, True))
        _TEACHER_WEIGHTS[key] = {"fp8": fp8, "bf16": bf16}
    return dict(_TEACHER_WEIGHTS[key])


_TEACHER_WEIGHTS: dict[str, dict[str, int]] = {}  # the model config's JSON -> teacher_weights' answer


def with_fp8_teacher(estimate, model_config):
    """``estimate`` (a :class:`fcsd.plan.simulate.StepEstimate` simulated with a bf16 teacher held whole) with the
    teacher's weights in FP8: the saving off ``teacher``, the peak and the teacher alive at the peak."""
    sizes = teacher_weights(model_config)
    saving = max(0, sizes["bf16"] - sizes["fp8"])
    at_peak = dict(estimate.at_peak)
    if "teacher" in at_peak:
        at_peak["teacher"] -= saving
    extra = {**estimate.extra, "teacher_dtype": "fp8", "fp8_saving": saving}
    return dataclasses.replace(
        estimate, teacher=estimate.teacher - saving, peak=estimate.peak - saving, at_peak=at_peak, extra=extra
    )


def fp8_note(model_config) -> str:
    """The plan's note on ``teacher.dtype=fp8``: the whole teacher's weights in FP8 and in bf16, and where it runs."""
    from fcsd.plan.serving_bytes import gib

    sizes = teacher_weights(model_config)
    return (
        f"teacher.dtype=fp8: the teacher's weights take {gib(sizes['fp8'])} in FP8 (e4m3 and fp32 128x128 block scales "
        f"on the weights the source scaled, bf16 for the rest) against {gib(sizes['bf16'])} in bf16; fcsd keeps FP8 "
        "modules on one process or DDP only, so the candidates laid out over GPUs (EP, FSDP2) are priced, and run, "
        "with teacher.dtype=auto (bf16)"
    )


def priced_teacher(config, layout) -> str:
    """What the plan priced ``layout``'s teacher as, for the report: FP8, bf16, fp32, or the top-k cache."""
    if layout.teacher == "cache":
        return "the top-k cache (no teacher weights on the GPUs)"
    if fp8_teacher(config, layout):
        return "FP8 (e4m3 + fp32 128x128 block scales, bf16 for the rest; teacher.dtype=fp8)"
    dtype = runnable_teacher_dtype(config, layout)
    name = {"auto": "bf16", "bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(dtype, dtype)
    return f"{name} (teacher.dtype={dtype})"
