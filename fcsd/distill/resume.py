"""What ``--resume`` checks before it continues a run (design §3: resume must be exact): the same run (settings, not
finished), the same LR schedule, a complete checkpoint, and the same inputs by content - the model's weights, the
tokenizer, the chat template and the packed data - each named by itself when it differs.

The settings are compared with the run's ``fcsd_config.yaml`` before anything loads (:func:`check_resume`); the
inputs by fingerprints recorded in every checkpoint's trainer state (:func:`input_fingerprints`,
:func:`check_resume_inputs`), once the tokenizer and the data are read and before the weights are.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from pathlib import Path

from fcsd.command_line import command_line
from fcsd.files import ownership
from fcsd.files.run_folder import FOREIGN_FILE, RunFolder
from fcsd.removed_settings import check_removed

# Keys a resumed run must share with the run it continues (the rest, e.g. progress, may change).
RESUME_KEYS = (
    "model.name",
    "model.revision",
    "farskip.layers",
    "data.path",
    "data.split",
    "data.seq_len",
    "data.max_rows",
    "data.eval_path",
    "data.eval_sequences",
    "train.objective",
    # the loss the run's steps were trained with (a resume under another one trains a different run and its
    # fcsd_config.yaml would misdescribe the steps before it)
    "train.divergence",
    "train.temperature",
    "train.jsd_beta",
    "train.l2_coef",
    "train.router_aux_coef",
    "train.grad_clip",
    "train.batch_tokens",
    "train.micro_batch_size",
    "train.seed",
    "train.init_from",  # the weights the run started from
    # the optimizer's parameter groups: which parameters train (a resume of other groups fails to load the
    # optimizer's state), and their settings, which loading that state puts back whatever the command says
    "train.freeze_embeddings",
    "train.weight_decay",
    "train.adam_betas",
    "teacher.mode",
    "parallel.placement",  # the weights are permuted by it
    "recovery.optimizer",  # its state (schedule-free's average) means nothing to the other
    "recovery.hidden_l2",  # part of the loss, with the share of the run it fades over
    "recovery.hidden_l2_share",
    "recovery.batch_ramp",  # how many updates the ramp's steps make
    "recovery.batch_ramp_shares",
)
PATH_KEYS = (
    "model.name",
    "data.path",
    "data.eval_path",
    "parallel.placement",
    "train.init_from",
)  # equal when they name one file
MOVABLE_KEYS = ("model.name", "data.path")  # a recorded path gone is taken for a move: their content is fingerprinted
# The LR schedule is rebuilt from these on a resume and its position restored from the checkpoint: another value
# would bend the curve where the run continues (the LR of the next step jumps) without a word.
SCHEDULE_KEYS = (
    "train.lr",
    "train.min_lr_ratio",
    "train.warmup_steps",
    "recovery.lr_scale",
    "recovery.warmup_share",
)
# What every step checkpoint records of the run it belongs to (:func:`checkpoint_record`) beside the run's id: the
# LR schedule and the optimizer whose state it holds, compared with the run's by :func:`check_belongs`.
OPTIMIZER_KEYS = ("train.weight_decay", "train.adam_betas", "train.freeze_embeddings", "recovery.optimizer")
RUN_RECORD = "run"  # the record's key in the trainer state

OUTPUT_FIX = "choose another output_dir"


def check_resume(run: RunFolder, config) -> None:
    """``--resume`` continues the same, unfinished run from a complete checkpoint, or is refused before anything
    is written: a folder that does not exist or is no run, other settings (:data:`RESUME_KEYS`), a finished run,
    an end at or below the checkpoint's step, another LR schedule, a checkpoint with a missing or truncated file.
    The inputs' content is compared once they are read (:func:`check_resume_inputs`)."""
    from omegaconf import OmegaConf

    root = run.root
    if not root.exists():
        raise ownership.FolderError(
            f"--resume: output_dir {root} does not exist, so there is no run to resume; drop --resume to start one"
        )
    marker = ownership.read_marker(root)
    if marker is None or not marker.is_kind("run"):
        what = "no fcsd run (no .fcsd-output marker)" if marker is None else marker.description()
        raise ownership.FolderError(f"--resume: output_dir {root} holds {what}, not a run to resume; {OUTPUT_FIX}")
    saved = OmegaConf.load(run.config) if run.config.exists() and config is not None else None
    if saved is not None:
        check_removed(saved, saved_in=root)
        current = OmegaConf.structured(config)
        different = [
            f"{key}: run {_saved_value(saved, key)!r} vs now {OmegaConf.select(current, key)!r}"
            for key in RESUME_KEYS
            if not _same_setting(key, _saved_value(saved, key), OmegaConf.select(current, key))
        ]
        if different:
            raise ownership.FolderError(
                f"--resume: {root} is a different run ({'; '.join(different)}); use the run's settings to continue "
                "it, or another output_dir for a new run"
            )
    if run.summary.exists() or run.final.exists():
        raise ownership.FolderError(_finished_message(run))
    if config is None:
        return
    checkpoint = run.resume_checkpoint(config.train.resume_step)
    if checkpoint is None:
        return
    from fcsd.parallel.step_state import check_resumable, config_layout

    try:  # a sharded checkpoint reshards between layouts (parallel.ep_size may change); across formats it cannot
        check_resumable(
            run.trainer_state(checkpoint).get("layout"), checkpoint.relative_to(root), config_layout(config)
        )
    except ValueError as error:
        raise ownership.FolderError(str(error)) from None
    _check_length_and_schedule(run, checkpoint, config, saved)
    check_belongs(run, checkpoint, marker.run_id, saved)
    problems = run.checkpoint_problems(checkpoint)
    if problems and all(FOREIGN_FILE in p for p in problems):  # sound, beside a file of the user's: say that
        names = ", ".join(p.split(FOREIGN_FILE, 1)[0] for p in problems)
        raise ownership.FolderError(
            f"--resume: {checkpoint.relative_to(root)} also holds files the run did not write ({names}): move them "
            "out of it and run the same command again"
        )
    if problems:
        older = run.newest_sound_checkpoint(int(checkpoint.name[5:]))
        way = (
            f"continue from {older.name}: `{resume_command(int(older.name[5:]))}`"
            if older is not None
            else "no complete older checkpoint is left: start the run again with overwrite=true and no --resume"
        )
        raise ownership.FolderError(
            f"--resume: {checkpoint.relative_to(root)} is {checkpoint_state(problems)} ({', '.join(problems)}); {way}"
        )


def resume_command(step: int) -> str:
    """The command being run as the ``--resume`` of ``checkpoints/step-<step>`` (its own ``--resume`` and
    ``train.resume_step`` replaced): what every message that names a checkpoint to resume from prints."""
    import shlex

    words = shlex.split(command_line())
    kept = [w for w in words if w not in ("--resume", "train.resume=true") and not w.startswith("train.resume_step=")]
    return shlex.join([*kept, "--resume", f"train.resume_step={step}"])


def restart_command(**settings: str) -> str:
    """The command being run as a new run over the same folder: ``--resume`` dropped, ``overwrite=true`` and
    ``settings`` (``{"train.lr": "1e-05"}``) in place of the command's own values of those keys. What a message
    advises when a resume cannot help (a resume refuses another LR schedule: :data:`SCHEDULE_KEYS`)."""
    import shlex

    settings = {"overwrite": "true", **settings}
    dropped = ("--resume", "train.resume")
    words = [w for w in shlex.split(command_line()) if w not in dropped]
    kept = [w for w in words if w.split("=", 1)[0].lstrip("+") not in (*settings, *dropped, "train.resume_step")]
    return shlex.join([*kept, *(f"{key}={value}" for key, value in settings.items())])


def checkpoint_state(problems: list[str]) -> str:
    """``incomplete`` when a file is missing or cut short, ``damaged`` when only their bytes (or their record)
    changed."""
    return "damaged" if all(" changed since " in p or " edited" in p for p in problems) else "incomplete"


def continued_config(run: RunFolder, config, is_main: bool = True):
    """The config a resumed run trains with, as its ``fcsd_config.yaml`` will record it. :func:`check_resume` holds
    every setting of the recovery recipe to the run's (:data:`RESUME_KEYS`, :data:`SCHEDULE_KEYS`), so a resume
    continues the run's recipe whatever recipe name it is given (``recovery.name``): it records the run's own name,
    with a note."""
    from omegaconf import OmegaConf

    if not config.train.resume or not run.config.exists():
        return config
    try:
        name = OmegaConf.select(OmegaConf.load(run.config), "recovery.name")
    except (OSError, ValueError):
        return config
    if not name or name == config.recovery.name:
        return config
    if is_main:
        print(
            f"note: --resume continues the run's recovery recipe {name!r} (its settings are the run's); "
            f"recovery.name={config.recovery.name!r} would only rename it, so the run keeps recording {name!r}"
        )
    config = copy.deepcopy(config)
    config.recovery.name = name
    return config


def _saved_value(saved, key: str):
    """``key`` in a run's saved config; a key the run's fcsd did not have yet reads as today's default."""
    from omegaconf import OmegaConf

    value = OmegaConf.select(saved, key, default=_ABSENT)
    return OmegaConf.select(_schema_defaults(), key) if value is _ABSENT else value


_ABSENT = object()


@functools.cache
def _schema_defaults():
    from omegaconf import OmegaConf

    from fcsd.distill.config import FCSDConfig

    return OmegaConf.structured(FCSDConfig)


def _same_setting(key: str, saved, current) -> bool:
    """Equal values, or two spellings of one local file (``data.jsonl`` and its absolute path), or, for the model
    and the data, a path the run recorded that is gone and one that exists (a project moved to another folder or
    machine): their content is compared once read (:func:`check_resume_inputs`)."""
    if saved == current:
        return True
    if key not in PATH_KEYS or not saved or not current:
        return False
    first, second = Path(str(saved)).expanduser(), Path(str(current)).expanduser()
    if key in MOVABLE_KEYS and first.is_absolute() and not first.exists() and second.exists():
        return True
    return first.exists() and second.exists() and first.resolve() == second.resolve()


def _finished_message(run: RunFolder) -> str:
    """Why a finished run is not resumed, naming what it wrote (``final/``, ``export/``) as they are."""
    steps = "its last step"
    if run.summary.exists():
        try:
            steps = json.loads(run.summary.read_text()).get("steps", steps)
        except (OSError, ValueError, AttributeError):
            pass
    kept = [f"{p.name}/" for p in (run.final, run.best, run.export) if p.exists()]
    holds = f"; {' and '.join(kept)} {'hold' if len(kept) > 1 else 'holds'} it" if kept else ""
    source = "its final/" if run.final.exists() else "its export or a checkpoint"
    export = ""
    if run.final.exists() and not run.export.exists():  # stopped while it exported (or a run with export=false)
        export = f"; its export/ is missing (stopped while exporting?): `fcsd export {run.root} {run.export}`"
    return (
        f"--resume: the run in {run.root} finished (step {steps}{holds}), and resuming would write over it; train "
        f"further from it as a new run (MODEL = {source}) in another output_dir, or replace it with overwrite=true "
        f"and no --resume{export}"
    )


def _check_length_and_schedule(run: RunFolder, checkpoint: Path, config, saved) -> None:
    """The resumed run must end after the checkpoint's step and keep the LR schedule the run started with."""
    from omegaconf import OmegaConf

    from fcsd.run_facts import end_step, schedule_steps

    step = int(checkpoint.name[5:])
    end = end_step(config.train)
    where = checkpoint.relative_to(run.root)
    if end <= step:
        raise ownership.FolderError(
            f"--resume: the run would end at step {end} (train.max_steps / max_tokens / stop_after), at or below "
            f"step {step} of {where}: there is nothing left to train; set train.max_steps above {step}"
        )
    if saved is None:
        return
    horizon, saved_horizon = schedule_steps(config.train), schedule_steps(saved.train)
    changed = [
        f"{key}={OmegaConf.select(OmegaConf.structured(config), key)} (the run: {_saved_value(saved, key)})"
        for key in SCHEDULE_KEYS
        if _saved_value(saved, key) != OmegaConf.select(OmegaConf.structured(config), key)
    ]
    if horizon != saved_horizon:
        keys = [k for k in ("max_steps", "max_tokens") if getattr(config.train, k) != saved.train.get(k)]
        changed.insert(
            0,
            " and ".join(f"train.{k}={getattr(config.train, k)}" for k in keys or ["max_steps"])
            + f" (the run's schedule spans {saved_horizon} steps, this one {horizon})",
        )
    if changed:
        keep = " ".join(
            f"train.{k}={'null' if saved.train.get(k) is None else saved.train.get(k)}"
            for k in ("max_steps", "max_tokens", "lr", "min_lr_ratio", "warmup_steps")
            if saved.train.get(k) != getattr(config.train, k)
        )
        raise ownership.FolderError(
            f"--resume: {'; '.join(changed)} would change the LR schedule the run follows from {where} on (the "
            f"warm-up and cosine are planned over the whole run, so the LR of the next steps would jump); resume "
            f"with the run's own `{keep}` (use train.stop_after to stop earlier), then train further from its final/ "
            "as a new run"
        )


def weights_fingerprint(source: str, revision: str | None = None) -> str | None:
    """A cheap content fingerprint of the weight files of a resolved model source (a local folder, or a hub id
    already in the hub cache; None otherwise): per file its name, size, safetensors header and 16 evenly spread
    4 KiB samples. Other weights of the same shapes (another fine-tune) change it; it costs milliseconds per file."""
    folder = _local_folder(source, revision)
    if folder is None:
        return None
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt") and p.is_file())
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as handle:
            head = handle.read(8)
            digest.update(head)
            if path.suffix == ".safetensors" and len(head) == 8:
                digest.update(handle.read(min(int.from_bytes(head, "little"), 1 << 24)))
            for i in range(16):
                handle.seek(size * i // 16)
                digest.update(handle.read(4096))
    return digest.hexdigest()[:16]


def _local_folder(name: str, revision: str | None) -> Path | None:
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    from fcsd.sources import hub_id

    if hub_id(name) is None:
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the hub cache (yet): nothing to compare
        return None


def tokenizer_fingerprints(tokenizer) -> dict:
    """Fingerprints of the tokenizer (vocabulary, added and special tokens) and, separately, of its chat template:
    a resume names which of the two changed."""

    def digest(value) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]

    specials = {k: getattr(tokenizer, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    vocab = sorted(tokenizer.get_vocab().items())
    return {"tokenizer": digest([vocab, specials]), "chat_template": digest(getattr(tokenizer, "chat_template", None))}


def input_fingerprints(config, tokenizer, data_fingerprint: str, source: str) -> dict:
    """What a checkpoint records of its inputs' content (see the module docstring); ``source``: ``model.name``
    resolved (:mod:`fcsd.distill.preflight`)."""
    weights = weights_fingerprint(source, config.model.revision)
    return {"model": weights, **tokenizer_fingerprints(tokenizer), "data": data_fingerprint}


INPUTS = {  # fingerprint -> how a message names it and the setting that chose it
    "model": ("the model's weights", "model.name"),
    "tokenizer": ("the tokenizer (its vocabulary or special tokens)", "model.name"),
    "chat_template": ("the chat template (how chats are rendered into training text)", "model.name"),
    "data": ("the training data", "data.path"),
}


def check_resume_inputs(run: RunFolder, config, fingerprints: dict) -> None:
    """Refuse a ``--resume`` whose inputs' content changed since the checkpoint it resumes was saved (a path says
    nothing: a file can be rewritten in place), naming the first that changed in the order of :data:`INPUTS` (a
    new chat template also changes the packed data: it is named, not the data)."""
    checkpoint = run.resume_checkpoint(config.train.resume_step)
    if checkpoint is None:
        return
    state = run.trainer_state(checkpoint)
    saved = {**state.get("inputs", {}), "data": state.get("data")}
    for key, (what, setting) in INPUTS.items():
        then, now = saved.get(key), fingerprints.get(key)
        if then is not None and now is not None and then != now:
            value = config.model.name if setting == "model.name" else config.data.path
            raise ownership.FolderError(
                f"--resume: {what} changed since {checkpoint.relative_to(run.root)} was saved (content fingerprint "
                f"{then} then, {now} now, {setting}={value}); resume with the inputs it was trained on, or start a "
                "new run in another output_dir"
            )


def run_settings(config) -> dict:
    """The settings a step checkpoint's state depends on: LR schedule, its horizon, optimizer (JSON values)."""
    from omegaconf import OmegaConf

    from fcsd.run_facts import schedule_steps

    def value(key):
        found = _saved_value(config, key)
        return OmegaConf.to_container(found) if OmegaConf.is_config(found) else found

    settings = {key: value(key) for key in (*SCHEDULE_KEYS, *OPTIMIZER_KEYS)}
    return {**settings, "schedule steps": schedule_steps(config.train)}


def checkpoint_record(run: RunFolder) -> dict:
    """What a step checkpoint records of its run: the run's id and folder and :func:`run_settings` of its
    ``fcsd_config.yaml`` (written before the first step)."""
    from omegaconf import OmegaConf

    marker = ownership.read_marker(run.root)
    record = {"id": marker.run_id if marker is not None else None, "folder": str(run.root.resolve())}
    if run.config.exists():
        saved = OmegaConf.load(run.config)
        record["settings"] = run_settings(saved)
        record["init_from"] = _saved_value(saved, "train.init_from")
    return record


def check_belongs(run: RunFolder, checkpoint: Path, run_id: str | None, saved) -> None:
    """Refuse a checkpoint of another run (its recorded id is not the run's) or whose recorded LR schedule,
    optimizer or schedule length differ from the run's ``saved`` config. A checkpoint with no record (written before
    checkpoints recorded their run) is checked when its state loads (:mod:`fcsd.distill.checkpointing`)."""
    record = run.trainer_state(checkpoint).get(RUN_RECORD)
    if not isinstance(record, dict):
        return
    where = checkpoint.relative_to(run.root)
    theirs = record.get("id")
    if theirs != run_id:
        raise ownership.FolderError(
            f"--resume: {where} belongs to another run ({_run_name(theirs)}, written in {record.get('folder')}), not "
            f"to the run in {run.root} ({_run_name(run_id)}); move it out of {run.checkpoints_dir} and resume from "
            "the run's own checkpoints, or train from it as a new run in another output_dir with "
            f"`train.init_from={checkpoint}`"
        )
    recorded = record.get("settings")
    if saved is None or not isinstance(recorded, dict):
        return
    own = run_settings(saved)
    changed = [
        f"{key}: {recorded.get(key)!r} vs the run's {value!r}"
        for key, value in own.items()
        if recorded.get(key) != value
    ]
    if changed:
        raise ownership.FolderError(
            f"--resume: {where} records another LR schedule or optimizer than the run's ({'; '.join(changed)}): its "
            f"state would train on with them; resume from another of the run's checkpoints "
            "(`--resume train.resume_step=N`), or start the run again with overwrite=true and no --resume"
        )


def _run_name(run_id) -> str:
    return f"run id {run_id}" if run_id else "a run that records no id"
