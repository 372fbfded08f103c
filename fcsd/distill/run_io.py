"""What a run writes while it trains: the output folder rule, metrics (JSONL + TensorBoard) and the PNG of the
training curves (the file names belong to :class:`fcsd.run_folder.RunFolder`)."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

from fcsd import ownership, staging
from fcsd.run_folder import RunFolder


def run_inputs(config) -> dict:
    """The local inputs of a run (name -> path) that its output folders must never be, contain or lie inside."""
    inputs = {
        "model": config.model.name,
        "data file": config.data.path,
        "eval data": config.data.eval_path,
        "MBPP+ file": config.early_stop.data,
    }
    if config.teacher.cache_dir:
        inputs["teacher cache"] = config.teacher.cache_dir
    return inputs


OUTPUT_FIX = "choose another output_dir"


def check_output_dir(output_dir: Path, resume: bool, overwrite: bool, config=None) -> str:
    """What ``fcsd convert`` may do with ``output_dir``, decided before anything is written (see
    :mod:`fcsd.ownership` for the ownership rules): ``"new"`` (empty or absent), ``"resume"`` (``--resume``, after
    :func:`fcsd.distill.resume.check_resume`), ``"restart"`` (a run folder that holds no checkpoint yet: a run that
    failed after it started) or ``"replace"`` (``overwrite=true`` on a run folder). Anything else is refused in one
    line: an input (or the current / home folder), a folder of another kind (an export, a teacher cache), files fcsd
    did not write, or a run folder without ``--resume`` / ``overwrite``."""
    if config is not None:
        ownership.check_not_an_input(output_dir, "output_dir", run_inputs(config))
    run = RunFolder(output_dir)
    if resume:
        from fcsd.distill.resume import check_resume

        check_resume(run, config)
        return "resume"
    if not _run_entries(output_dir):
        return "new"
    ownership.check_replaceable(output_dir, "run", "output_dir", OUTPUT_FIX)
    if not run.checkpoints() and not run.final.exists() and not run.best.exists():
        return "restart"  # a failed start: nothing worth keeping
    if overwrite:
        return "replace"
    raise ownership.FolderError(
        f"output_dir {output_dir} holds a run; pass --resume (train.resume=true) to continue it, overwrite=true to "
        "replace it, or choose another output_dir"
    )


def _run_entries(output_dir: Path) -> list[str]:
    """What ``output_dir`` holds besides fcsd's marker and lock, staging leftovers and a kept teacher cache."""
    if not output_dir.is_dir():
        return [output_dir.name] if output_dir.exists() else []
    marker = ownership.read_marker(output_dir)
    if marker is not None and not marker.is_kind("run"):
        return [ownership.MARKER]  # another kind of fcsd folder (or a damaged marker): never empty for a run
    return [
        p.name
        for p in output_dir.iterdir()
        if p.name != ownership.MARKER
        and not ownership.is_lock_file(p.name)
        and not ownership.is_staging_leftover(p.name)
        and not (p.name == RunFolder(output_dir).teacher_cache.name and ownership.is_marked(p))
    ]


@contextmanager
def output_dir_claimed(config, is_main: bool = True, checked: bool = False):
    """Hold ``output_dir`` for the whole run: check it (unless ``checked``: :func:`fcsd.distill.preflight.preflight`
    did), take its lock (one run per folder), check it again under the lock (another command may have written there
    since), then remove staging leftovers of a dead run and clear what a restart or ``overwrite=true`` replaces.
    Only the main process checks and locks."""
    if not is_main:
        yield
        return
    output_dir = Path(config.output_dir)
    if not checked:
        ownership.check_not_in_use(output_dir, "output_dir")
        check_output_dir(output_dir, config.train.resume, config.overwrite, config)
        check_export_dir(config)
    with ownership.folder_lock(output_dir, "output_dir"):
        action = check_output_dir(output_dir, config.train.resume, config.overwrite, config)  # now that it is ours
        stale = ownership.remove_stale_staging(output_dir)
        if stale:
            print(f"removed staging leftovers of an earlier run that died: {', '.join(stale)}")
        if action in ("restart", "replace"):
            ownership.clear(output_dir, "run", "output_dir", OUTPUT_FIX)
        if action == "resume" and config.train.resume_step is not None:
            set_aside_newer_checkpoints(RunFolder(output_dir), config.train.resume_step)
        yield


def set_aside_newer_checkpoints(run: RunFolder, step: int) -> None:
    """``--resume train.resume_step=N`` abandons the checkpoints after N: they are renamed
    ``checkpoints/abandoned-step-M`` (kept, never resumed from or pruned into the new trajectory's)."""
    newer = [c for c in run.checkpoints() if int(c.name[5:]) > step]
    for checkpoint in newer:
        target = checkpoint.with_name(f"abandoned-{checkpoint.name}")
        if target.exists():
            shutil.rmtree(target)
        checkpoint.rename(target)
    if newer:
        names = ", ".join(c.name for c in newer)
        print(f"resuming from step-{step}: set aside the later checkpoints {names} as checkpoints/abandoned-step-*")


def check_export_dir(config) -> None:
    """An explicit ``export_dir`` is checked before training: not an input, not a folder around the run, and
    empty, or (with ``overwrite=true``) an export fcsd wrote that holds nothing else."""
    if not (config.export and config.export_dir):
        return
    from fcsd.export.save import check_export_target

    export_dir = Path(config.export_dir)
    ownership.check_not_an_input(export_dir, "export_dir", run_inputs(config))
    check_export_target(export_dir, config.overwrite, [], "export_dir", run_root=Path(config.output_dir))


def write_run_config(run: RunFolder, config) -> None:
    """The resolved config of the run, ``fcsd_config.yaml`` (after the marker that makes the folder fcsd's)."""
    from omegaconf import OmegaConf

    ownership.mark(run.root, "run")
    OmegaConf.save(OmegaConf.structured(config), run.config)
    ownership.record(run.config)


def write_summary(run: RunFolder, summary: dict) -> None:
    run.summary.write_text(json.dumps(summary, indent=2))
    ownership.record(run.summary)


class MetricsLog:
    """Append-only JSONL metrics plus TensorBoard scalars. A run that starts at ``start_step`` (0: from scratch)
    first drops the records after it, so a restarted or resumed run never logs a step twice."""

    def __init__(self, output_dir: Path, start_step: int = 0, enabled: bool = True):
        run = RunFolder(output_dir)
        self.path = run.metrics
        self.enabled = enabled
        self.writer = None
        if not enabled:
            return
        if self.path.exists():  # a last line cut short by a kill or a full disk is dropped too
            kept = [json.dumps(r) for r in run.records() if start_step and r["step"] <= start_step]
            with staging.atomic_file(self.path) as temporary:
                temporary.write_text("".join(line + "\n" for line in kept))
        if not start_step:
            shutil.rmtree(run.tensorboard, ignore_errors=True)
        for path in (self.path, run.tensorboard):
            ownership.record(path)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run.tensorboard), purge_step=start_step or None)
        except ImportError:  # tensorboard is a dependency; tolerate its absence rather than lose the run
            self.writer = None

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float):
                    self.writer.add_scalar(key.replace(".", "/"), value, record["step"])

    def records(self) -> list[dict]:
        return RunFolder(self.path.parent).records()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def plot_curves(records: list[dict], path: Path, title: str) -> None:
    """Training loss and learning rate per step, with the held-out KL evaluations (and MBPP+ pass@1 when early
    stopping ran), as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "train/loss" in r]
    from fcsd.distill.heldout import KL_KEYS, kl_of

    evals = [r for r in records if any(key in r for key in KL_KEYS)]
    mbpp = [r for r in records if "early_stop/mbpp_plus" in r]
    figure, axes = plt.subplots(1, 3 if mbpp else 2, figsize=(16 if mbpp else 11, 4))
    ax_loss, ax_lr = axes[:2]
    ax_loss.plot([r["step"] for r in train], [r["train/loss"] for r in train], label="training loss (per token)")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [kl_of(r) for r in evals], "o-", label="held-out KL")
    ax_loss.set_xlabel("step")
    values = [r["train/loss"] for r in train] + [kl_of(r) for r in evals]
    if values and min(values) > 0:  # a log axis cannot show a loss of 0 (matplotlib would warn)
        ax_loss.set_yscale("log")
    ax_loss.legend()
    ax_loss.set_title(title)
    ax_lr.plot([r["step"] for r in train], [r["train/lr"] for r in train])
    ax_lr.set_xlabel("step")
    ax_lr.set_ylabel("learning rate")
    if mbpp:
        steps = [r["step"] for r in mbpp]
        axes[2].plot(steps, [r["early_stop/mbpp_plus"] for r in mbpp], "o-", label="MBPP+ (base + extra tests)")
        axes[2].plot(steps, [r["early_stop/mbpp_base"] for r in mbpp], "s--", label="MBPP (base tests)")
        axes[2].set_xlabel("step")
        axes[2].set_ylabel("pass@1 (%)")
        axes[2].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    ownership.record(path)
