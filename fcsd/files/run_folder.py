"""The layout of a run folder of ``fcsd convert`` (the single owner of its file names).

::

    output_dir/
      fcsd_config.yaml      the resolved run config (also inside every saved checkpoint)
      metrics.jsonl         one JSON record per logged step; tensorboard/ has the same scalars
      curves.png            loss, LR, held-out KL (and MBPP+ when early stopping ran)
      run_summary.json      steps, held-out figures at step 0 and at the end, early-stopping summary
      checkpoints/step-N/   resumable training state (model, optimizer, scheduler, RNG, trainer state)
      final/                the last model state (loadable with fcsd.from_pretrained)
      best/                 the best MBPP+ state, when early stopping ran
      export/               ``fcsd export`` of best/ (or final/)
      eval/, eval_table.md  ``fcsd eval`` of the run
      teacher-cache/        ``fcsd cache-teacher``'s default folder (kept when the run is replaced)
      .fcsd-output          the marker written first: kind "run" and the manifest of what fcsd wrote here
      .fcsd-lock            held by the one command that writes the folder (see :mod:`fcsd.files.ownership`)
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

CONFIG = "fcsd_config.yaml"
CHECKPOINT_RECORD = "fcsd_checkpoint.json"  # in final/ and best/: which step the state is
TRAINER_STATE = "trainer_state.json"  # in checkpoints/step-N/: data position, spike guard, early stopping
FOREIGN_FILE = " is no file the run wrote"  # a user's file in a sound step checkpoint, as problems name it
# what accelerate's save_state writes for one process with one registered object (checkpoints that predate the
# file list in their trainer state)
LEGACY_CHECKPOINT_FILES = ("model.safetensors", "optimizer.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl")
# written in every step checkpoint's trainer state as "checkpoint_format": 2 and above record every file's SHA-256
CHECKPOINT_FORMAT = 2
SIZE_ONLY_NOTE = "checked by size only (written before checkpoints recorded SHA-256 digests)"


def is_step_checkpoint(folder: str | Path) -> bool:
    """Whether ``folder`` is a resumable step checkpoint (``checkpoints/step-N``), not a loadable model folder."""
    folder = Path(folder)
    return folder.parent.name == "checkpoints" and (folder / TRAINER_STATE).is_file()


@dataclass(frozen=True)
class RunFolder:
    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    config = property(lambda self: self.root / CONFIG)
    metrics = property(lambda self: self.root / "metrics.jsonl")
    tensorboard = property(lambda self: self.root / "tensorboard")
    curves = property(lambda self: self.root / "curves.png")
    summary = property(lambda self: self.root / "run_summary.json")
    checkpoints_dir = property(lambda self: self.root / "checkpoints")
    final = property(lambda self: self.root / "final")
    best = property(lambda self: self.root / "best")
    export = property(lambda self: self.root / "export")
    eval_dir = property(lambda self: self.root / "eval")
    eval_table = property(lambda self: self.root / "eval_table.md")
    teacher_cache = property(lambda self: self.root / "teacher-cache")  # teacher.cache_dir's default
    sweep_status = property(lambda self: self.root / "sweep_status.json")  # a sweep run that crashed: its error

    @classmethod
    def of_checkpoint(cls, checkpoint: str | Path) -> RunFolder:
        """The run folder that holds ``checkpoint`` (its ``final/`` or ``best/``, or ``checkpoints/step-N``)."""
        checkpoint = Path(checkpoint)
        return cls(checkpoint.parent.parent if is_step_checkpoint(checkpoint) else checkpoint.parent)

    def step_checkpoint(self, step: int) -> Path:
        return self.checkpoints_dir / f"step-{step}"

    def checkpoints(self) -> list[Path]:
        """Complete step checkpoints, oldest first (a partial one has a dotted staging name and is never listed)."""
        if not self.checkpoints_dir.exists():
            return []
        found = (p for p in self.checkpoints_dir.iterdir() if p.name.startswith("step-"))
        return sorted(found, key=lambda p: int(p.name[5:]))

    def resume_checkpoint(self, step: int | None = None) -> Path | None:
        """The checkpoint ``--resume`` continues: ``checkpoints/step-<step>`` (``train.resume_step``), else the
        newest; None when the run saved none."""
        if step is None:
            existing = self.checkpoints()
            return existing[-1] if existing else None
        chosen = self.step_checkpoint(step)
        if not chosen.is_dir():
            names = ", ".join(p.name for p in self.checkpoints()) or "none"
            raise ValueError(f"train.resume_step={step}: {self.root} has no {chosen.name} (checkpoints: {names})")
        return chosen

    def trainer_state(self, checkpoint: Path) -> dict:
        """The checkpoint's trainer state ({} when it is missing or cannot be read)."""
        path = checkpoint / TRAINER_STATE
        try:
            state = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            return {}
        return state if isinstance(state, dict) else {}

    def checkpoint_problems(self, checkpoint: Path, contents: bool = True) -> list[str]:
        """What ``checkpoint`` lacks to resume exactly, one entry per file (``optimizer.bin missing``,
        ``model.safetensors truncated (1,000 of 4,096 bytes)``, ``__1_0.distcp changed since it was written``): the
        files its trainer state lists with their sizes and, unless ``contents`` is false (sizes only), SHA-256
        (every byte is read: see :mod:`fcsd.files.checksums`), else accelerate's standard set for one process. A
        checkpoint written with digests (:data:`CHECKPOINT_FORMAT`, or any digest record) whose record is malformed or
        lacks a listed file's digest is damaged: an edited record proves nothing (see :meth:`checked_by_size_only`)."""
        from fcsd.files import checksums

        state = self.trainer_state(checkpoint)
        if not state:
            there = (checkpoint / TRAINER_STATE).exists()
            return [f"{TRAINER_STATE} {'is no JSON table (damaged or edited)' if there else 'missing'}"]
        counts = [state.get(key, 0) for key in ("step", "tokens", "checkpoint_format")]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
            return [f"{TRAINER_STATE}'s step, tokens or checkpoint_format were edited: {counts} are no counts"]
        if counts[2] > CHECKPOINT_FORMAT:
            return [f"{TRAINER_STATE} is of checkpoint format {counts[2]}, newer than this fcsd's {CHECKPOINT_FORMAT}"]
        expected = state.get("files") or {name: None for name in LEGACY_CHECKPOINT_FILES}
        if not isinstance(expected, dict) or not all(isinstance(n, int) for n in expected.values() if n is not None):
            return [f"{TRAINER_STATE}'s file list was edited: it is no table of file sizes"]
        problems = []
        for name, size in expected.items():
            path = checkpoint / name
            if not path.is_file():
                problems.append(f"{name} missing")
            elif size is not None and path.stat().st_size != size:
                problems.append(f"{name} {'truncated' if path.stat().st_size < size else 'of another size'} "
                                f"({path.stat().st_size:,} of {size:,} bytes)")  # fmt: skip
        if problems or self.checked_by_size_only(checkpoint):
            return problems
        recorded = state.get(checksums.ALGORITHM)
        if not isinstance(recorded, dict) or not all(_is_digest(d) for d in recorded.values()):
            return [f"{TRAINER_STATE}'s SHA-256 record was edited: it is no table of file digests"]
        unrecorded = [name for name in expected if name not in recorded]
        added = self.unlisted_files(checkpoint)  # put there since: a copied-in optimizer.bin, a user's notes
        unrecorded += [name for name in added if _is_state_file(name)]  # what a resume would load: the record's
        foreign = [name for name in added if not _is_state_file(name)]
        if unrecorded:
            return [f"{name} has no SHA-256 in {TRAINER_STATE}, whose record was edited" for name in unrecorded]
        changed = []
        if contents:
            found = checksums.digests([checkpoint / name for name in recorded if (checkpoint / name).is_file()])
            changed = [name for name, digest in recorded.items() if found.get(name, digest.lower()) != digest.lower()]
        if changed:
            return [
                f"{name} changed since it was written (its SHA-256 is not the one recorded then)" for name in changed
            ]
        return [f"{name}{FOREIGN_FILE}: move it out of the checkpoint" for name in foreign]  # all else is sound

    def checked_by_size_only(self, checkpoint: Path) -> bool:
        """Whether ``checkpoint`` was written before checkpoints recorded SHA-256 digests (no
        ``checkpoint_format`` and no digest record in its trainer state), so that only its files' sizes can be
        checked: what a resume or an export of it says in a note."""
        from fcsd.files import checksums

        state = self.trainer_state(checkpoint)
        return bool(state) and "checkpoint_format" not in state and checksums.ALGORITHM not in state

    def newest_sound_checkpoint(self, before: int) -> Path | None:
        """The newest step checkpoint older than step ``before`` that has no :meth:`checkpoint_problems`, or None:
        the sizes of all of them are checked first, then the contents of those of the right sizes, newest first,
        up to the first sound one (a multi-TB checkpoint is read only when it may be the answer)."""
        older = [c for c in reversed(self.checkpoints()) if int(c.name[5:]) < before]
        sized = [c for c in older if not self.checkpoint_problems(c, contents=False)]
        return next((c for c in sized if not self.checkpoint_problems(c)), None)

    def foreign_files(self) -> list[str]:
        """Files inside the run's own folders that fcsd did not write, as paths relative to the run (``overwrite=true``
        and a restart clear those folders whole): in ``final/`` and ``best/`` any file their record does not list (a
        record from before it listed them: none), in ``tensorboard/`` any but event files, in a step checkpoint any
        its trainer state does not list, in ``checkpoints/`` any but the step checkpoints."""
        from fcsd.files.names import is_lock_file, is_staging_leftover

        found = []
        for folder in (self.final, self.best):
            try:
                listed = json.loads((folder / CHECKPOINT_RECORD).read_text()).get("files")
            except (OSError, ValueError, AttributeError):
                listed = None
            if isinstance(listed, list):
                found += [f"{folder.name}/{p.name}" for p in sorted(folder.iterdir()) if p.name not in listed]
        if self.tensorboard.is_dir():
            events = (p for p in sorted(self.tensorboard.iterdir()) if not p.name.startswith("events.out.tfevents."))
            found += [f"{self.tensorboard.name}/{p.name}" for p in events]
        if self.checkpoints_dir.is_dir():
            for entry in sorted(self.checkpoints_dir.iterdir()):
                if is_lock_file(entry.name) or is_staging_leftover(entry.name):
                    continue
                if not re.fullmatch(r"(abandoned-)?step-\d+", entry.name):  # set aside by train.resume_step
                    found.append(f"checkpoints/{entry.name}")
                    continue
                found += [f"checkpoints/{entry.name}/{name}" for name in self.unlisted_files(entry)]
        return found

    def unlisted_files(self, checkpoint: Path) -> list[str]:
        """The files of a step checkpoint that its trainer state does not list (none for a checkpoint written before
        its state listed its files, or whose list is not a table)."""
        listed = self.trainer_state(checkpoint).get("files") if checkpoint.is_dir() else None
        if not isinstance(listed, dict):
            return []
        return sorted(p.name for p in checkpoint.iterdir() if p.is_file() and p.name not in {*listed, TRAINER_STATE})

    def prune_checkpoints(self, keep: int) -> None:
        """Remove the step checkpoints before the newest ``keep`` (0: none); one that also holds a file the run did
        not write is kept, and said once (a user's notes were removed with it)."""
        for old in self.checkpoints()[:-keep] if keep > 0 else []:
            foreign = self.unlisted_files(old)
            if foreign:
                print(f"kept {old}: it also holds files the run did not write ({', '.join(foreign)})")
                continue
            shutil.rmtree(old, ignore_errors=True)

    def records(self) -> list[dict]:
        """Every record of ``metrics.jsonl``, in order (none when the run has not logged yet); a line cut short by a
        killed process or a full disk is skipped."""
        if not self.metrics.exists():
            return []
        records = []
        for line in self.metrics.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "step" in record:
                records.append(record)
        return records

    def model_to_export(self) -> Path | None:
        """What ``fcsd export`` takes from the run: ``best/`` when early stopping kept one, else ``final/``."""
        return next((p for p in (self.best, self.final) if (p / "config.json").exists()), None)

    def checkpoint(self) -> Path | None:
        """What ``fcsd eval`` scores for the run: ``export/``, else ``best/``, else ``final/``; None if none."""
        return next((p for p in (self.export, self.best, self.final) if (p / "config.json").exists()), None)


def _is_state_file(name: str) -> bool:
    """A file name accelerate's ``load_state`` (or the expert-parallel state) reads from a step checkpoint."""
    import fnmatch

    patterns = ("*.safetensors", "*.bin", "*.pkl", "*.pt", "*.distcp", ".metadata")
    return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)


def _is_digest(value) -> bool:
    """Whether ``value`` is a SHA-256 hex digest (either case)."""
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdefABCDEF" for c in value)
