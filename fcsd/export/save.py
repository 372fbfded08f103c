"""``fcsd export``: a converted checkpoint as a folder that loads everywhere and never silently runs the wrong
connectivity, verified by reloading it (design §3: "export must reload and match")."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from fcsd.connectivity.families import EXPORTED_PREFIX, base_model_type, text_config, text_model
from fcsd.connectivity.patch import CONFIG_KEY, farskip_layers
from fcsd.export import ExportError
from fcsd.export.model_card import read_run_facts, recipe_summary, render_card, run_config
from fcsd.export.remote_code import write_remote_code
from fcsd.files import ownership
from fcsd.files.run_folder import RunFolder
from fcsd.serving.served_families import UNSERVED_ARCHITECTURE, farskip_architecture

PARITY_RECORD = "fcsd_export.json"  # written only after the reload-parity check passed; `fcsd push` requires it
PARITY_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def export(
    model,
    tokenizer,
    out_dir: str | Path,
    overwrite: bool = False,
    source: str | Path | None = None,
    export_format: str = "source",
    composite: tuple[str, str | None] | None = None,
) -> Path:
    """Write ``model`` (FarSkip layers applied) and ``tokenizer`` to ``out_dir`` atomically and check reload parity.

    The folder holds safetensors shards in the model's dtype, the config with its ``farskip`` record, model type
    ``farskip_<stock type>`` and an ``auto_map`` to the shipped modeling code, the generation config and the
    tokenizer. A non-empty ``out_dir`` is refused unless ``overwrite``; ``source`` (the checkpoint exported) is never
    written into. The export is a folder of its own in fcsd's ownership model (:mod:`fcsd.files.ownership`): one writer
    holds its lock from before staging to the rename, which checks the target again
    (:func:`fcsd.files.staging.atomic_dir`). A model trained from a block-FP8 source is written in that format unless
    ``export_format="bf16"`` (:mod:`fcsd.export.fp8`). ``composite`` (``(source, revision)``,
    :func:`fcsd.export.composite.composite_source`): ``model`` is the text tower of that multimodal checkpoint, and the
    export is the whole composite with its vision tower and projector copied from the source's files
    (:func:`fcsd.export.composite.compose`).
    """
    from fcsd.export.composite import check_format as check_composite_format
    from fcsd.export.fp8 import check_format, finish_config, format_name, quantize_folder, source_quantization
    from fcsd.files.staging import atomic_dir

    record = source_quantization(model.config) if check_format(export_format) == "source" else None
    check_composite_format(composite, record)

    out_dir = Path(out_dir).resolve()
    if not farskip_layers(model):
        raise ExportError("the model has no FarSkip layers: convert it (fcsd convert / fcsd.apply_farskip) first")
    check_export_target(out_dir, overwrite, [source] if source is not None else [])
    with atomic_dir(out_dir, kind="export", replace=overwrite, what="OUT_DIR") as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        config, model_class = model.config, type(model)
        if composite is not None:
            from fcsd.export.composite import compose

            config, model_class = compose(staging, *composite)
        written = format_name(record, model.dtype)  # what the card and the parity record say the weights are
        farskip = complete_export(staging, config, model_class, source, written)
        if record is not None:
            quantize_folder(staging, record)
        finish_config(staging, record)
        difference = check_parity(model, staging)
        write_parity_record(staging, difference, written, farskip)
    return out_dir


def complete_export(staging: Path, model_config, model_class: type, source, dtype: torch.dtype | str) -> dict:
    """What an export adds to a saved checkpoint folder: the remote modeling code, the config's ``farskip`` record,
    model type and ``auto_map``, the model card (``dtype``: the weights' dtype or format,
    :func:`fcsd.export.fp8.format_name`); returns the ``farskip`` record."""
    auto_map = write_remote_code(staging, model_config, model_class)
    config_path = staging / "config.json"
    config = json.loads(config_path.read_text())
    base_type = base_model_type(config["model_type"])
    facts = read_run_facts(Path(source or "."))
    config[CONFIG_KEY].update(base_model_type=base_type, base_architectures=config.get("architectures"))
    config[CONFIG_KEY]["recipe"] = recipe_summary(facts)
    # `architectures` names the class fcsd's vLLM plugin serves it with; transformers loads it through auto_map
    served_by = farskip_architecture(base_type) or UNSERVED_ARCHITECTURE
    config.update(model_type=EXPORTED_PREFIX + base_type, architectures=[served_by], auto_map=auto_map)
    if config.get("num_nextn_predict_layers"):  # transformers loads no multi-token-prediction layer: none is written
        config["num_nextn_predict_layers"] = 0
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    num_layers = int(text_config(model_config).num_hidden_layers)
    name = str(dtype).removeprefix("torch.")
    (staging / "README.md").write_text(render_card(config[CONFIG_KEY], facts, num_layers, name))
    return config[CONFIG_KEY]


def write_parity_record(staging: Path, difference: float, dtype: torch.dtype | str, farskip: dict) -> None:
    """The record ``fcsd push`` requires: written only once the reload-parity check passed; ``dtype``: the weights'
    dtype or format as written (:func:`fcsd.export.fp8.format_name`). An FP8 export's record and model card also
    say what its check proved and the logit drift FP8 rounding causes (:func:`fcsd.export.fp8.take_check`)."""
    from fcsd.export.fp8 import CHECK_FILE, take_check
    from fcsd.export.model_card import with_fp8_check

    record = {"parity_max_abs_diff": difference, "dtype": str(dtype).removeprefix("torch."), "farskip": farskip}
    if (staging / CHECK_FILE).exists():
        record["fp8"] = take_check(staging, difference)
        card = staging / "README.md"
        if card.exists():
            card.write_text(with_fp8_check(card.read_text(), record["fp8"]))
    (staging / PARITY_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def check_export_target(
    out_dir: str | Path, overwrite: bool, sources: list, what: str = "OUT_DIR", run_root: Path | None = None
) -> None:
    """Refuse an ``out_dir`` that is, contains or lies inside a source (a checkpoint) or the run folder ``run_root``
    (except the run's own ``export/``), is another run's ``export/``, is the current or the home folder; a non-empty
    one unless ``overwrite``, and even then unless it is an export fcsd wrote that holds nothing else
    (:mod:`fcsd.files.ownership`: never a run folder, a teacher cache or a folder of other files, whatever its marker
    says)."""
    out_dir = Path(out_dir).expanduser().resolve()
    owner = ownership.read_marker(out_dir.parent)
    roots = [Path(run_root)] if run_root is not None else []
    roots += [RunFolder.of_checkpoint(Path(source).expanduser().resolve()).root for source in sources if source]
    own_run = any(root.expanduser().resolve() == out_dir.parent for root in roots)  # a run's own export/
    if owner is not None and owner.is_kind("run") and out_dir == RunFolder(out_dir.parent).export and not own_run:
        raise ExportError(
            f"{what} {out_dir} is the export of the run in {out_dir.parent}, which fcsd eval and fcsd push read as "
            f"that run's: choose another {what}"
        )
    try:
        for source in [*sources, None]:  # None: the current and home folder checks even without a source
            ownership.check_not_an_input(out_dir, what, {"source": source}, "export")
        if run_root is not None:  # the folder around a checkpoint; a run folder also keeps what lies inside it
            marker = ownership.read_marker(run_root)
            inside = marker is not None and marker.is_kind("run")
            allowed = RunFolder(run_root).export
            ownership.check_not_around(out_dir, what, "run folder", run_root, allowed=allowed, refuse_inside=inside)
        if ownership.is_empty(out_dir):
            return
        ownership.check_replaceable(out_dir, "export", what, f"choose another {what} (only an fcsd export is replaced)")
    except ownership.FolderError as error:
        raise ExportError(str(error)) from None
    if not overwrite:
        how = "pass --overwrite" if what == "OUT_DIR" else "set overwrite=true"
        raise ExportError(f"{what} {out_dir} holds an export; {how} to replace it")


def parity_batch(model, length: int = 32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    vocab = model.get_output_embeddings().out_features
    return torch.randint(vocab, (2, length), generator=generator)


def text_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits of a text-only batch (a multimodal model answers through its text model, see
    :func:`~fcsd.connectivity.families.text_model`)."""
    return text_model(model)(input_ids=input_ids).logits.float()


@torch.no_grad()
def check_parity(model, folder: Path) -> float:
    """Reload ``folder`` (stock transformers classes + fcsd, no remote code) and compare its logits with ``model``'s
    on a fixed batch; raises :class:`ExportError` with the numbers when they differ beyond the dtype's tolerance.
    An FP8 export must store what it was written from (:func:`fcsd.export.fp8.read_check`) and reload every tensor it
    left unquantized exactly; its logit difference is FP8 rounding's drift, reported rather than bounded."""
    from fcsd.export.fp8 import read_check
    from fcsd.loading import from_pretrained

    fp8 = _is_fp8(folder)
    if fp8:
        read_check(folder)  # before the reload: a tensor stored wrongly is refused as such
    device = next(model.parameters()).device
    batch = parity_batch(model).to(device)
    was_training = model.training
    model.eval()
    expected = text_logits(model, batch)
    model.train(was_training)
    reloaded = from_pretrained(str(folder), dtype="auto").to(device).eval()
    got = text_logits(reloaded, batch)
    difference = float((got - expected).abs().max())
    tolerance = _tolerance(folder, expected, next(model.parameters()).dtype)
    if reloaded.dtype != model.dtype or not difference <= tolerance:
        raise ExportError(
            f"reload parity failed: max |logit difference| {difference:.3g} (tolerance {tolerance:g}), dtype "
            f"{reloaded.dtype} vs {model.dtype}; the export was not written"
        )
    if fp8:
        _check_unquantized(model, reloaded)
    return difference


def _is_fp8(folder: Path) -> bool:
    return "quantization_config" in json.loads((Path(folder) / "config.json").read_text())


def _check_unquantized(model, reloaded) -> None:
    """Refuse an FP8 export whose reload changed a tensor it stores unquantized (the source's unscaled weights, the
    norms, biases and buffers)."""
    from fcsd.export.fp8 import source_quantization

    kept = set((source_quantization(model.config) or {}).get("kept", []))
    got = reloaded.state_dict()
    for name, tensor in model.state_dict().items():
        if (name in kept or tensor.ndim < 2) and not (name in got and torch.equal(got[name].to(tensor), tensor)):
            raise ExportError(
                f"reload parity failed: {name}, stored unquantized, reloads with other values; the export was not "
                "written"
            )


def parity_tolerance(folder: Path, expected: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest |logit difference| the reload of the export in ``folder`` may show: the dtype's; none for block-FP8
    weights, whose check is that they store what they were written from (:func:`fcsd.export.fp8.read_check`, which
    refuses one that does not), the drift FP8 rounding causes recorded beside it (relative to ``expected``'s largest
    |logit|). Every process of a laid-out export calls it: they wait for each other, so that all have read the
    FP8 proof before the main process takes it out of the folder (:func:`write_parity_record`)."""
    import torch.distributed as dist

    tolerance = _tolerance(folder, expected, dtype)
    if _is_fp8(folder) and dist.is_available() and dist.is_initialized():
        dist.barrier()
    return tolerance


def _tolerance(folder: Path, expected: torch.Tensor, dtype: torch.dtype) -> float:
    from fcsd.export.fp8 import record_drift

    if _is_fp8(folder):
        record_drift(folder, expected)
        return math.inf
    return PARITY_TOLERANCE.get(dtype, 1e-2)


def check_one_process() -> None:
    """Refuse ``fcsd export`` under a multi-process launch: it runs in one process (a step checkpoint's expert-parallel
    shards are consolidated there), and the launch's processes would each export to, and lock, the same OUT_DIR.
    Not for :func:`export_checkpoint` itself: a data-parallel ``fcsd convert`` calls it on its main process."""
    import os

    world = int(os.environ.get("WORLD_SIZE") or 1)
    if world > 1:
        raise ExportError(
            f"fcsd export runs in one process, but this launch started {world}; run `fcsd export SOURCE OUT_DIR` "
            "alone, without a launcher"
        )


def export_checkpoint(
    run_or_checkpoint: str | Path,
    out_dir: str | Path,
    overwrite: bool = False,
    export_format: str = "source",
    text_only: bool = False,
) -> Path:
    """``fcsd export``: export a run folder (its ``best/`` when MBPP+ early stopping kept one, else ``final/``), a
    converted checkpoint folder, or a run's step checkpoint (``checkpoints/step-N``, expert-parallel shards
    consolidated: the state of a run that never reached ``final/``) to ``out_dir``; ``export_format``: ``source``
    (a block-FP8 source's own format, else the checkpoint's dtype) or ``bf16``. The text tower of a multimodal
    checkpoint (Llama-4 Scout) is exported as that composite, its vision tower and projector copied from the run's
    source (:mod:`fcsd.export.composite`); ``text_only`` writes the text model alone and says so in one line."""
    from fcsd.export.composite import composite_source
    from fcsd.files.run_folder import is_step_checkpoint
    from fcsd.files.staging import restore_stale_siblings
    from fcsd.loading import from_pretrained, tokenizer_from_pretrained

    source = Path(run_or_checkpoint)
    if not source.exists():
        raise ExportError(
            f"{run_or_checkpoint}: no such folder; give a run folder, a converted checkpoint or a step checkpoint"
        )
    if not (source / "config.json").exists() and not is_step_checkpoint(source):
        source = RunFolder(source).model_to_export() or source
    if not (source / "config.json").exists() and not is_step_checkpoint(source):
        raise ExportError(
            f"{run_or_checkpoint}: neither a converted checkpoint, a run folder with final/, nor a step checkpoint"
        )
    run_root = RunFolder.of_checkpoint(source).root
    check_export_target(out_dir, overwrite, [source], run_root=run_root)  # before loading anything
    run_config(source)  # a run that used a setting fcsd removed is refused before anything loads
    composite = composite_source(source, text_only)
    target = Path(out_dir).expanduser().resolve()
    with ownership.folder_lock(target, "OUT_DIR", beside=True):  # one export at a time, from now to the rename
        if restore_stale_siblings(target):  # what a killed export left is back: check the target as it is now
            check_export_target(out_dir, overwrite, [source], run_root=run_root)
        if is_step_checkpoint(source):
            from fcsd.export.step_checkpoint import load_step_checkpoint

            model, tokenizer = load_step_checkpoint(source)
        else:
            model, tokenizer = from_pretrained(str(source), dtype="auto"), tokenizer_from_pretrained(str(source))
        if export_format == "bf16" and model.dtype != torch.bfloat16:  # bf16 declines FP8, it casts nothing
            name = str(model.dtype).removeprefix("torch.")
            print(f"--format bf16 writes the weights unquantized as they are: {name}, this checkpoint's dtype")
        return export(
            model,
            tokenizer,
            out_dir,
            overwrite=overwrite,
            source=source,
            export_format=export_format,
            composite=composite,
        )
