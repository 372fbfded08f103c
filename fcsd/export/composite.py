"""Exports of composite checkpoints: a text MoE tower inside a multimodal model (Llama-4 Scout and Maverick ship as
``Llama4ForConditionalGeneration``: vision model, multimodal projector, text MoE; design §8).

FCSD trains only the text tower (teacher and student are text models, the vision tower is never loaded), so a run's
``final/`` is a text model. Its export puts it back into the composite the run started from: the text tensors under
the composite's names, every other tensor of the source (vision tower, projector) copied byte for byte from the
source's safetensors files (a header rewritten and byte ranges copied: no tensor is ever in memory), the source's
composite ``config.json`` with the trained text config as its ``text_config`` and fcsd's ``farskip`` block on top,
and ``architectures`` ``FarSkip<composite class>``. ``export_text_only=true`` / ``fcsd export --text-only`` writes the
text model alone instead, and says so in one line.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from fcsd.block_fp8 import RECORD_KEY, SCALE_SUFFIX
from fcsd.connectivity.families import base_model_type, text_config
from fcsd.connectivity.patch import CONFIG_KEY
from fcsd.weight_files import INDEX, WEIGHTS, folder_tensor_names, read_header, tensor_names, write_index

CHUNK_BYTES = 64 * 2**20  # byte ranges are copied in pieces of at most this size
#: the source's processor files an image-text export needs beside the tokenizer (copied when the source has them)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.json", "chat_template.jinja")
SINGLE_TEXT_FILE = "model-00001-of-00001.safetensors"
DROPPED_NOTE = (
    "text-only export: the vision tower and projector of {source}{count} are left out; the export loads "
    "as {text_class} (drop export_text_only / --text-only to keep them)"
)
#: config key of a text model trained from a composite: the composite's class (``fcsd convert`` records it)
SOURCE_KEY = "fcsd_composite_source"
#: model types of composites' text towers: a ``final/`` of one without :data:`SOURCE_KEY` (written before fcsd
#: recorded it) reads its source to find out
TEXT_TOWERS = ("llama4_text",)
# keys of the text model's saved config that describe the saved checkpoint, not the text tower
_NOT_TEXT_CONFIG = (
    "architectures",
    "auto_map",
    "transformers_version",
    "_name_or_path",
    CONFIG_KEY,
    SOURCE_KEY,
    RECORD_KEY,
)


class CompositeError(ValueError):
    """A composite export that cannot be assembled from the run's source."""


def run_source(checkpoint: str | Path) -> tuple[str, str | None] | None:
    """``(model.name, model.revision)`` of the ``fcsd convert`` run that wrote ``checkpoint`` (its ``final/``,
    ``best/`` or a step checkpoint), from the run config saved with it; None for a checkpoint no run wrote."""
    from omegaconf import OmegaConf

    from fcsd.files.run_folder import CONFIG, RunFolder

    paths = (Path(checkpoint) / CONFIG, RunFolder.of_checkpoint(checkpoint).config)
    path = next((p for p in paths if p.is_file()), None)
    if path is None:
        return None
    model = OmegaConf.to_container(OmegaConf.load(path)).get("model") or {}
    return (model["name"], model.get("revision")) if model.get("name") else None


def record_source(model_config, source_config) -> None:
    """Record on the config of a model trained from ``source_config`` (the student's, saved into ``final/``) the
    composite class its text tower came from (:data:`SOURCE_KEY`), when the source is a composite; nothing
    otherwise. The export reads the source only for checkpoints that carry it (:func:`composite_source`)."""
    if text_config(source_config) is not source_config:
        architectures = getattr(source_config, "architectures", None) or [source_config.model_type]
        setattr(model_config, SOURCE_KEY, architectures[0])


def composite_source(checkpoint: str | Path, text_only: bool = False, say=print) -> tuple[str, str | None] | None:
    """The composite checkpoint (``(folder or hub id, revision)``) whose vision tower the export of ``checkpoint``
    puts back, None when ``checkpoint`` is no text tower trained from one. Only a checkpoint whose config records a
    composite source (:data:`SOURCE_KEY`, written by ``fcsd convert``), a ``final/`` written before fcsd recorded it
    whose model type is a composite's text tower (:data:`TEXT_TOWERS`), or a step checkpoint (rebuilt from the
    source anyway) reads the run's source: a text model's export never needs it. With ``text_only`` it is None, and
    ``say`` (None: silent) gets the one line telling that the vision tower is dropped. A composite source that
    cannot be read any more is refused in one line (its vision tower would be lost silently), unless ``text_only``."""
    from fcsd.loading import load_config
    from fcsd.sources import resolve_model

    path = Path(checkpoint) / "config.json"
    own = json.loads(path.read_text()) if path.is_file() else None
    recorded = (own or {}).get(SOURCE_KEY)
    if own is not None:
        if isinstance(own.get("text_config"), dict):
            return _no_tower(checkpoint, text_only, say, "a multimodal checkpoint itself, exported whole")
        if not recorded and base_model_type(own.get("model_type", "")) not in TEXT_TOWERS:
            return _no_tower(checkpoint, text_only, say)  # a text model: its export never reads the source
    own_class = ((own or {}).get("architectures") or ["the text model"])[0]
    found = run_source(checkpoint)
    if found is None:
        return _no_tower(checkpoint, text_only, say)
    name, revision = found
    if text_only and recorded:
        if say is not None:
            say(_dropped_note(checkpoint, name, revision, own_class))
        return None
    try:
        source = resolve_model(name)
        config = load_config(source, revision)
    except (OSError, ValueError) as error:
        if text_only:
            return None
        raise CompositeError(
            f"the run's source {name} (model.name) cannot be read ({str(error).splitlines()[0][:120]}), so its "
            "vision tower cannot be put back into the export: restore it, or export the text model alone with "
            "--text-only (export_text_only=true)"
        ) from None
    if text_config(config) is config:
        return _no_tower(checkpoint, text_only, say)
    if text_only:
        if say is not None:
            say(_dropped_note(checkpoint, name, revision, own_class))
        return None
    return source, revision


def _no_tower(checkpoint, text_only: bool, say, what: str = "a text model, exported as it is") -> None:
    """None (no vision tower to put back), saying in one line through ``say`` that ``text_only`` changes nothing."""
    if text_only and say is not None:
        say(f"--text-only changes nothing: {checkpoint} is {what} (no multimodal source's vision tower to leave out)")


def _dropped_note(checkpoint, name: str, revision: str | None, text_class: str) -> str:
    """The line of a text-only export: which source's vision tower is left out, with how many tensors when the
    source's file list is at hand without downloading anything."""
    count = _dropped(checkpoint, name, revision)
    return DROPPED_NOTE.format(source=name, count="" if count is None else f" ({count} tensors)", text_class=text_class)


def _dropped(checkpoint, name: str, revision: str | None) -> int | None:
    """How many of the source's tensors a text-only export of ``checkpoint`` leaves out, from the source's index or
    headers as they are on this machine (a local folder, or a hub id's cached files: nothing is downloaded); None
    when they are not at hand."""
    from fcsd.sources import resolve_model

    trained = sorted(Path(checkpoint).glob("*.safetensors"))
    try:
        names = local_tensor_names(resolve_model(name), revision)
        if not trained or names is None:
            return None
        return len(split_source(set(tensor_names(trained)), dict.fromkeys(names))[1])
    except (OSError, ValueError):  # CompositeError included: the note goes without its count
        return None


def source_folder(source: str, revision: str | None = None) -> Path:
    """The folder of checkpoint ``source``: itself, or a hub id's cached snapshot of its weights and JSON files
    (downloaded once; the run has read them already)."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source, revision=revision, allow_patterns=["*.safetensors", "*.json", "*.jinja"]))


def source_files(source: str, revision: str | None = None) -> list[Path]:
    """The safetensors files of checkpoint ``source`` (:func:`source_folder`)."""
    files = sorted(source_folder(source, revision).glob("*.safetensors"))
    if not files:
        raise CompositeError(f"{source} holds no safetensors files to copy the vision tower from")
    return files


def local_tensor_names(source: str, revision: str | None = None) -> list[str] | None:
    """The tensor names of checkpoint ``source`` from what this machine holds (a local folder, or a hub id's cached
    index or single weights file; nothing is downloaded), None when they are not at hand."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        return folder_tensor_names(folder)
    from huggingface_hub import try_to_load_from_cache

    for name in (INDEX, WEIGHTS):
        found = try_to_load_from_cache(source, name, revision=revision)
        if isinstance(found, str):
            path = Path(found)
            return sorted(json.loads(path.read_text())["weight_map"]) if name == INDEX else sorted(tensor_names([path]))
    return None


def copy_tensors(items: list[tuple[Path, str, str]], out: Path, metadata: dict | None = None) -> int:
    """Write the safetensors file ``out`` holding, for each ``(file, name, new name)``, that tensor of ``file`` byte
    for byte under its new name: the header is rebuilt and the data copied in byte ranges, nothing is decoded.
    Returns the bytes of tensor data written."""
    headers: dict[Path, tuple[int, dict]] = {}
    entries, ranges, offset = {}, [], 0
    for file, name, new in items:
        start, header = headers.setdefault(file, read_header(file))
        info = header[name]
        begin, end = info["data_offsets"]
        entries[new] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [offset, offset + end - begin]}
        ranges.append((file, start + begin, end - begin))
        offset += end - begin
    head = json.dumps({"__metadata__": metadata or {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(out, "wb") as sink:
        sink.write(struct.pack("<Q", len(head)) + head)
        for file, position, size in ranges:
            with open(file, "rb") as source:
                source.seek(position)
                while size:
                    piece = source.read(min(size, CHUNK_BYTES))
                    sink.write(piece)
                    size -= len(piece)
    return offset


def text_prefix(text_keys: set[str], source_keys: set[str]) -> str:
    """The prefix under which the composite source stores its text tower (``language_model.`` in Llama-4's files):
    the one that maps every tensor of the text model onto a tensor of the source."""
    probe = min(text_keys)
    candidates = {key[: len(key) - len(probe)] for key in source_keys if key.endswith("." + probe)}
    fitting = sorted(p for p in candidates if all(p + key in source_keys for key in text_keys))
    if len(fitting) != 1:
        raise CompositeError(
            f"the source's tensors do not hold the trained text model under one prefix ({len(fitting)} fit): it is "
            "not the checkpoint this run was trained from; export the text model alone with --text-only"
        )
    return fitting[0]


def split_source(text_keys: set[str], original: dict[str, Path]) -> tuple[str, list[str]]:
    """``(prefix of the text tower, the source's other tensors)`` for a text model's tensor names and the source's
    (name -> file); refuses a source whose text tower holds tensors the text model lacks (but the block scales of
    its weights)."""
    prefix = text_prefix(text_keys, set(original))
    # a block-FP8 source's scales of text weights: the trained weights replace them (the export is bf16)
    leftover = sorted(
        key
        for key in original
        if key.startswith(prefix)
        and key[len(prefix) :] not in text_keys
        and key[len(prefix) :].removesuffix(SCALE_SUFFIX) not in text_keys
    )
    if leftover:
        raise CompositeError(
            f"the source's text tower holds {len(leftover)} tensors the trained model lacks ({leftover[0]}, ...): "
            "export the text model alone with --text-only"
        )
    return prefix, sorted(key for key in original if not key.startswith(prefix))


def check_format(composite: tuple[str, str | None] | None, fp8_record: dict | None) -> None:
    """Refuse, before anything is written, the export of a composite in a block-FP8 source's format
    (``fp8_record``: :func:`fcsd.export.fp8.source_quantization` of the format chosen): composites are exported in
    bf16 (``--format bf16``) or as the text model alone."""
    if composite is not None and fp8_record is not None:
        raise CompositeError(
            "a composite of a block-FP8 source is exported in bf16: pass --format bf16 (export_format=bf16), or "
            "export the text model alone in FP8 with --text-only"
        )


def compose(staging: Path, source: str, revision: str | None = None) -> tuple[object, type]:
    """Turn the staged export of a text model (``staging``: its safetensors and ``config.json``) into the export of
    the composite ``source`` it was trained from; returns the composite's config and class (for
    :func:`fcsd.export.save.complete_export`). The text files are rewritten under the composite's names (one file at
    a time, atomically), the source's other tensors are copied next to them (one output file per source file that
    holds any), and ``model.safetensors.index.json`` lists them all; the source's processor files
    (:data:`PROCESSOR_FILES`) are copied too."""
    from fcsd.files.staging import atomic_file
    from fcsd.loading import hub_config_file, load_config, model_class_for

    staged_config = json.loads((staging / "config.json").read_text())
    staged = tensor_names(sorted(staging.glob("*.safetensors")))
    files = source_files(source, revision)
    original = tensor_names(files)
    prefix, extra = split_source(set(staged), original)
    scaled = [key for key in extra if key.endswith(SCALE_SUFFIX)]
    if scaled:  # the export is bf16 (check_format): a block-FP8 vision tower cannot be copied into it as it is
        raise CompositeError(
            f"the source's vision tower is block-FP8 ({scaled[0]}), which a bf16 composite export cannot copy: "
            "export the text model alone with --text-only"
        )
    placed, total = {}, 0
    for path in sorted(staging.glob("*.safetensors")):
        _, header = read_header(path)
        names = [(path, key, prefix + key) for key in header if key != "__metadata__"]
        # transformers reads a model.safetensors alone, ignoring any index beside it: the text goes to a numbered file
        target = path.with_name(SINGLE_TEXT_FILE) if path.name == "model.safetensors" else path
        with atomic_file(target) as partial:
            total += copy_tensors(names, partial, header.get("__metadata__"))
        if target != path:
            path.unlink()
        placed.update((new, target.name) for _, _, new in names)
    holders = sorted({original[key] for key in extra})
    for number, file in enumerate(holders, 1):
        name = f"composite-{number:05d}-of-{len(holders):05d}.safetensors"
        chosen = [(file, key, key) for key in extra if original[key] == file]
        total += copy_tensors(chosen, staging / name)
        placed.update((key, name) for _, key, _ in chosen)
    for name in PROCESSOR_FILES:  # image preprocessing as the source does it; the trained tokenizer's files stay
        found = source_folder(source, revision) / name
        if found.is_file() and not (staging / name).exists():
            shutil.copyfile(found, staging / name)
    write_index(staging, placed, total)

    local = Path(source).expanduser() / "config.json"
    values = json.loads((local if local.is_file() else hub_config_file(source, revision)).read_text())
    values.pop("quantization_config", None)  # a block-FP8 source's composite exports in bf16 (check_format)
    if isinstance(values.get(CONFIG_KEY), dict):  # the source is an export itself: its stock form underneath
        values["architectures"] = values[CONFIG_KEY].get("base_architectures")
        values["model_type"] = base_model_type(values["model_type"])
        values.pop("auto_map", None)
    sub = {k: v for k, v in staged_config.items() if k not in _NOT_TEXT_CONFIG}
    values["text_config"] = {**(values.get("text_config") or {}), **sub}
    values[CONFIG_KEY] = staged_config[CONFIG_KEY]
    values["dtype"] = staged_config.get("dtype", values.get("dtype"))
    (staging / "config.json").write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    config = load_config(source, revision)
    return config, model_class_for(source, False, config, revision)
