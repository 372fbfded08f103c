"""A cache of the teacher's top-k log-probabilities per token (design §3: a teacher that does not fit beside the
student is replaced by logits computed once and reused by every run of a sweep; arcee-ai/DistillKit's approach).

Layout of a cache folder: ``meta.json`` (what it was made from) and ``shard-NNNNN.safetensors`` files holding
``logp`` ``(rows, seq_len, k)`` and ``ids`` ``(rows, seq_len, k)`` for consecutive packed rows. The residual mass of
each token is ``1 - sum(exp(logp))``. A cache is only used when its model, data and settings match the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from fcsd.block_fp8 import RECORD_KEY
from fcsd.distill.data import Packed
from fcsd.distill.losses import chunked_topk_teacher
from fcsd.distill.objectives import teacher_targets

SHARD_ROWS = 256
FORMAT = 1


class TeacherCacheError(ValueError):
    """A cache that is missing or was made from another model, data or setting."""


RUNTIME_CONFIG_KEYS = {  # how a model was loaded or run, not which model it is
    "farskip",
    "dtype",
    "torch_dtype",
    "_name_or_path",
    "transformers_version",
    "attn_implementation",
    "_attn_implementation",
    "_experts_implementation",
    "use_cache",
    "architectures",
    "auto_map",
    "model_type",  # an export's farskip_<type> is the same model as <type>
    "fcsd_composite_source",  # the student's record of the composite its text tower came from (export/composite.py)
}


def model_fingerprint(model) -> str:
    """What identifies a model, not how it was loaded: its architecture config (without runtime fields such as
    the dtype or the attention kernel) and the values of its embedding and LM-head weights (compared in fp32, so a
    bf16 checkpoint loaded in fp32 or in bf16 has one fingerprint)."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in RUNTIME_CONFIG_KEYS}
    source = source_format(config.pop("quantization_config", None), config.pop(RECORD_KEY, None))
    if source is not None:  # a plain checkpoint's fingerprint is what it was
        config["source_format"] = source
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    from torch.distributed.tensor import DTensor

    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        weight = module.weight.detach()
        weight = weight.full_tensor() if isinstance(weight, DTensor) else weight  # FSDP2: a collective
        digest.update(weight.float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def source_format(quantization: dict | None, record: dict | None) -> dict | None:
    """The block-FP8 format a model was read from, alike for a teacher that keeps its FP8 modules
    (``teacher.dtype=fp8``: transformers keeps the ``quantization_config``) and a model fcsd dequantized (its
    :data:`~fcsd.block_fp8.RECORD_KEY` record), so that a cache made by an FP8 teacher is the dequantized run's
    model."""
    settings = (record or {}).get("quantization_config") or quantization
    if not settings:
        return None
    return {  # not modules_to_not_convert: transformers renames its entries when it keeps FP8 modules
        "fmt": settings.get("fmt") or "e4m3",
        "weight_block_size": [int(b) for b in settings.get("weight_block_size") or []],
        "activation_scheme": settings.get("activation_scheme") or "dynamic",
    }


def cache_dir(config) -> Path:
    """``teacher.cache_dir``, else ``output_dir/teacher-cache``."""
    from fcsd.files.run_folder import RunFolder

    return Path(config.teacher.cache_dir or RunFolder(config.output_dir).teacher_cache)


def run_meta(model, rows: Packed, config) -> dict:
    """What a teacher cache for this run (its packed ``rows``: training then held-out) must have been made from."""
    from fcsd.distill.data import tokens_fingerprint

    fingerprint = tokens_fingerprint(rows.input_ids)
    train = config.train
    return expected_meta(model, fingerprint, len(rows), config.data.seq_len, config.teacher.top_k, train.temperature)


def cache_teacher(config, batch_size: int = 4) -> Path:
    """``fcsd cache-teacher``: run the teacher once over the run's packed rows (training, then held-out) and store
    its top-k log-probabilities in ``teacher.cache_dir``. Under ``torchrun`` the teacher is laid out over the
    processes as ``parallel.*`` says (FSDP2 over all of them when it says nothing) and each process caches its share
    of the shards (:func:`share_cache`)."""
    from fcsd.connectivity.families import text_config
    from fcsd.distill.preflight import check_data_cache_dir, check_model_config, check_top_k, run_inputs
    from fcsd.distill.run_data import all_rows, load_run_data
    from fcsd.distill.student_teacher import load_models, load_tokenizer
    from fcsd.files import ownership

    config = dataclasses.replace(config, export=False)  # a cache exports nothing: no export format is checked
    folder = cache_dir(config)  # checked before anything is loaded
    inputs = {name: path for name, path in run_inputs(config).items() if name != "teacher cache"}
    ownership.check_not_an_input(folder, "teacher.cache_dir", inputs, "teacher-cache")
    check_cache_folder(folder)
    check_data_cache_dir(config)
    model_config = check_model_config(config, loads_teacher=True)
    if config.teacher.mode != "cache":  # check_model_config checks it for a run that reads the cache
        check_top_k(config, text_config(model_config))
    from fcsd.parallel.processes import main_process_first

    meshes = cache_meshes(config)
    device = torch.device(meshes.device_type if meshes is not None else "cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(config, model_config=model_config)
    with main_process_first():
        train_rows, held_rows, _ = load_run_data(config, tokenizer)
    teacher, _ = load_models(config, tokenizer, device, need_student=False, meshes=meshes)
    rows = all_rows(train_rows, held_rows)
    meta = run_meta(teacher, rows, config)
    if meshes is not None:
        return share_cache(teacher, rows, cache_dir(config), meta, batch_size, config.progress, config.overwrite)
    return build_cache(teacher, rows, cache_dir(config), meta, batch_size, config.progress, config.overwrite)


def expected_meta(model, data_fingerprint: str, rows: int, seq_len: int, top_k: int, temperature: float) -> dict:
    return {
        "format": FORMAT,
        "model": model_fingerprint(model),
        "data": data_fingerprint,
        "rows": rows,
        "seq_len": seq_len,
        "top_k": top_k,
        "temperature": temperature,
    }


def check_cache_folder(folder: Path) -> None:
    """A ``teacher.cache_dir`` must be new, empty or a teacher cache; anything else is refused before any work."""
    from fcsd.files import ownership

    if Path(folder).exists() and not Path(folder).is_dir():
        raise TeacherCacheError(
            f"teacher.cache_dir {folder} is a file, not a folder; point teacher.cache_dir at a new or empty folder"
        )
    marker = ownership.read_marker(folder)
    cache = (Path(folder) / "meta.json").exists() and (marker is None or marker.is_kind("teacher-cache"))
    if not ownership.is_empty(folder) and not cache:
        raise TeacherCacheError(
            f"teacher.cache_dir {folder} holds other files and no teacher cache; point teacher.cache_dir at a new or "
            "empty folder"
        )


def build_cache(
    teacher,
    packed: Packed,
    folder: str | Path,
    meta: dict,
    batch_size: int = 4,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Run ``teacher`` over every row of ``packed`` and write the cache to ``folder`` atomically (the old cache stays
    until the new one is complete). A matching cache is reused; a mismatched one is replaced only with
    ``overwrite`` and only if it is a teacher cache fcsd wrote holding nothing else (:mod:`fcsd.files.ownership`)."""
    from fcsd.files.staging import atomic_dir

    folder = Path(folder)
    if reusable(folder, meta, overwrite):
        return folder
    with atomic_dir(folder, kind="teacher-cache", replace=overwrite, what="teacher.cache_dir") as staging:
        bar = tqdm(total=len(packed), desc="caching teacher logits", unit="seq", disable=not progress)
        for shard, batches in enumerate(shard_batches(len(packed), batch_size)):
            write_shard(teacher, packed, batches, meta, staging / shard_name(shard), bar.update)
        bar.close()
        (staging / "meta.json").write_text(json.dumps(meta, indent=2))
    return folder


def cache_meshes(config):
    """The teacher's meshes under a multi-process launch (``WORLD_SIZE`` > 1), else None (one process)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import PartialState

    from fcsd.parallel.layout import ParallelDims, build_meshes

    state = PartialState(cpu=not torch.cuda.is_available())  # initialises the process group, as the trainer does
    parallel = config.parallel
    fsdp = parallel.fsdp or parallel.ep_size == 1
    return build_meshes(ParallelDims(state.num_processes, parallel.ep_size, fsdp), state.device.type)


def share_cache(teacher, packed, folder, meta: dict, batch_size: int, progress: bool, overwrite: bool) -> Path:
    """:func:`build_cache` with the shards spread over the processes; every process calls it and gets the folder.

    A teacher larger than one GPU is laid out as a training run would lay out its teacher (``parallel.*``, or FSDP2
    over every process, :func:`cache_meshes`). Cache shard ``s`` (256 packed rows) is written by process ``s mod W``
    into the staging folder the main process created; every forward of a laid-out model is a collective, so a
    process with fewer rows to run repeats a forward on row 0 (discarded) until every process has run the same number.
    The main process writes ``meta.json`` once all shards are written and publishes the folder in one rename
    (:func:`fcsd.files.staging.atomic_dir`): the cache is the one a single process would write, shard for shard."""
    from fcsd.files.staging import atomic_dir
    from fcsd.parallel.layout import head_unit

    folder = Path(folder)
    world, rank = dist.get_world_size(), dist.get_rank()
    if reusable(folder, meta, overwrite):  # every process reads the same folder, before anything is written
        return folder
    head_in_forward = teacher.fcsd_layout.dims.fsdp  # the LM head is sharded: applied in chunks, gathered once
    shards = shard_batches(len(packed), batch_size)
    forwards = max(sum(len(batches) for batches in shards[r::world]) for r in range(world))
    with contextlib.ExitStack() as stack:
        staging = (
            [
                str(
                    stack.enter_context(
                        atomic_dir(folder, kind="teacher-cache", replace=overwrite, what="teacher.cache_dir")
                    )
                )
            ]
            if rank == 0
            else [None]
        )
        dist.broadcast_object_list(staging, src=0)
        staging = Path(staging[0])
        bar = tqdm(total=len(packed), desc="caching teacher logits", unit="seq", disable=not progress or rank)
        done = 0
        for shard in range(rank, len(shards), world):
            batches = shards[shard]
            write_shard(teacher, packed, batches, meta, staging / shard_name(shard), bar.update, head_in_forward)
            done += len(batches)
        for _ in range(forwards - done):  # the other processes' forwards need this one's collectives
            teacher_topk(teacher, packed, 0, min(batch_size, len(packed)), meta, head_in_forward)
        unit = head_unit(teacher)  # the LM head stays gathered over the forwards (no logits are computed in them)
        if unit is not None:
            unit.reshard()
        bar.close()
        dist.barrier()  # every shard is in the staging folder
        if rank == 0:
            (staging / "meta.json").write_text(json.dumps(meta, indent=2))
    dist.barrier()  # published
    return folder


def reusable(folder: Path, meta: dict, overwrite: bool) -> bool:
    """Whether ``folder`` already holds the cache ``meta`` describes; a mismatched one is refused unless
    ``overwrite`` and it is a teacher cache fcsd wrote holding nothing else (then False: it is rebuilt)."""
    from fcsd.files import ownership

    check_cache_folder(folder)
    if ownership.is_empty(folder):
        return False
    if not overwrite:
        validate_cache(folder, meta, fix="add overwrite=true to this command to rebuild it")
        return True
    try:
        validate_cache(folder, meta)
        return True
    except TeacherCacheError:
        fix = "remove it by hand, or choose another teacher.cache_dir"
        ownership.check_replaceable(folder, "teacher-cache", "teacher.cache_dir", fix)
    return False


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}.safetensors"


def shard_batches(rows: int, batch_size: int) -> list[list[tuple[int, int]]]:
    """Per cache shard, the ``(begin, end)`` row ranges of its teacher forwards."""
    return [
        [
            (begin, min(begin + batch_size, start + SHARD_ROWS, rows))
            for begin in range(start, min(start + SHARD_ROWS, rows), batch_size)
        ]
        for start in range(0, rows, SHARD_ROWS)
    ]


def teacher_topk(teacher, packed: Packed, begin: int, end: int, meta: dict, head_in_forward: bool = False):
    """The teacher's top-k ``(log-probabilities, int32 ids)`` of rows ``[begin, end)``, on the host."""
    device = next(teacher.parameters()).device
    rows = packed.rows(slice(begin, end))
    rows = Packed(rows.input_ids.to(device), rows.position_ids.to(device))
    hidden, head, _ = teacher_targets(teacher, rows, head_in_forward=head_in_forward)
    logp, top = chunked_topk_teacher(hidden, head, meta["top_k"], meta["temperature"])
    return logp.view(*rows.input_ids.shape, -1).cpu(), top.view(*rows.input_ids.shape, -1).to(torch.int32).cpu()


def write_shard(teacher, packed: Packed, batches, meta: dict, path: Path, progress, head_in_forward=False) -> None:
    """Run the teacher over ``batches`` and write them as one cache shard."""
    from safetensors.torch import save_file

    logps, ids = [], []
    for begin, end in batches:
        logp, top = teacher_topk(teacher, packed, begin, end, meta, head_in_forward)
        logps.append(logp)
        ids.append(top)
        progress(end - begin)
    save_file({"logp": torch.cat(logps), "ids": torch.cat(ids)}, str(path))


def validate_cache(folder: str | Path, expected: dict, fix: str | None = None) -> None:
    """Raise :class:`TeacherCacheError` naming each field where the cache differs from the run (and ``fix``)."""
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        raise TeacherCacheError(
            f"no teacher cache at {folder}; build it first with `fcsd cache-teacher MODEL` and the same overrides "
            "(data.*, teacher.top_k, train.temperature, teacher.cache_dir)"
        )
    meta = json.loads(meta_path.read_text())
    wrong = [
        f"{key}: cache {meta.get(key)!r} vs run {value!r}" for key, value in expected.items() if meta.get(key) != value
    ]
    if wrong:
        raise TeacherCacheError(
            f"the teacher cache at {folder} was made from another model, data or setting ({'; '.join(wrong)}); "
            + (
                fix
                or "rebuild it with `fcsd cache-teacher MODEL` and this run's overrides plus overwrite=true, or "
                "point teacher.cache_dir elsewhere"
            )
        )


class TeacherCache:
    """Read access to a validated cache: ``rows(indices)`` -> ``(logp, ids)`` for packed rows ``indices``."""

    def __init__(self, folder: str | Path, expected: dict):
        validate_cache(folder, expected)
        from safetensors import safe_open

        self.folder = Path(folder)
        self.rows_total = expected["rows"]
        self._files = [
            safe_open(str(self.folder / shard_name(i)), framework="pt")
            for i in range((self.rows_total + SHARD_ROWS - 1) // SHARD_ROWS)
        ]

    def rows(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        logps, ids = [], []
        for index in indices:
            handle = self._files[index // SHARD_ROWS]
            offset = index % SHARD_ROWS
            logps.append(handle.get_slice("logp")[offset : offset + 1])
            ids.append(handle.get_slice("ids")[offset : offset + 1])
        return torch.cat(logps), torch.cat(ids)
