"""What a run writes while it trains: the output folder rule, metrics (JSONL + TensorBoard) and the PNG of the
training curves (the file names belong to :class:`fcsd.run_folder.RunFolder`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fcsd import safe_io
from fcsd.run_folder import RunFolder

# Keys a resumed run must share with the run it continues (the rest, e.g. train.max_steps or progress, may change).
RESUME_KEYS = (
    "model.name",
    "model.revision",
    "farskip.layers",
    "data.path",
    "data.split",
    "data.seq_len",
    "data.max_rows",
    "data.eval_path",
    "train.objective",
    "train.batch_tokens",
    "train.micro_batch_size",
    "train.seed",
    "teacher.mode",
    "parallel.ep_size",  # checkpoints hold one optimizer state per expert-parallel process
    "parallel.placement",  # the weights are permuted by it
)


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


def check_output_dir(output_dir: Path, resume: bool, overwrite: bool, config=None) -> None:
    """Refuse to write into a non-empty folder unless the run resumes from it or ``overwrite`` is set; never accept
    an input (or the current / home folder) as the output folder; clear only a run folder fcsd wrote, and restart
    without ``overwrite`` a run folder that holds no checkpoint yet (a run that failed before its first save)."""
    if config is not None:
        safe_io.check_not_an_input(output_dir, "output_dir", run_inputs(config))
    run = RunFolder(output_dir)
    own = {run.teacher_cache.name, safe_io.MARKER}  # cache-teacher's default folder is the run's own
    if not output_dir.exists() or not {p.name for p in output_dir.iterdir()} - own:
        return
    if resume:
        if config is not None:
            check_resume(run, config)
        return
    if safe_io.is_marked(output_dir) and not run.checkpoints() and not run.final.exists() and not run.best.exists():
        _clear_run(run)  # a failed start: nothing worth keeping
        return
    if overwrite:
        if not safe_io.is_marked(output_dir):
            raise ValueError(
                f"output_dir {output_dir} holds files fcsd did not write (no {safe_io.MARKER} marker), so overwrite "
                "will not remove them; choose another output_dir"
            )
        _clear_run(run)
        return
    raise ValueError(
        f"output_dir {output_dir} is not empty; pass train.resume=true to continue the run it holds, "
        "overwrite=true to replace it, or another output_dir"
    )


def check_export_dir(config) -> None:
    """An explicit ``export_dir`` is checked before training: not an input, not a folder around the run, and
    replaceable (empty, or an export fcsd wrote)."""
    if not (config.export and config.export_dir):
        return
    from fcsd.export.save import check_export_target

    export_dir = Path(config.export_dir)
    safe_io.check_not_an_input(export_dir, "export_dir", run_inputs(config))
    run_root = Path(config.output_dir).resolve()
    if export_dir.resolve() in (run_root, *run_root.parents):
        raise ValueError(f"export_dir {export_dir} is or contains output_dir; choose another export_dir")
    check_export_target(export_dir, True, [])


def _clear_run(run: RunFolder) -> None:
    """Remove what a run wrote, keeping the teacher cache (an input of the next run, rebuilt only on request)."""
    for entry in run.root.iterdir():
        if entry.name == run.teacher_cache.name:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def check_resume(run: RunFolder, config) -> None:
    """A resumed run must continue the same run: the same model, data and the keys that shape the data order."""
    from omegaconf import OmegaConf

    if not safe_io.is_marked(run.root) and not run.config.exists():
        raise ValueError(f"output_dir {run.root} holds no fcsd run to resume; choose another output_dir")
    if not run.config.exists():
        return
    saved = OmegaConf.load(run.config)
    current = OmegaConf.structured(config)
    different = [
        f"{key}: run {OmegaConf.select(saved, key)!r} vs now {OmegaConf.select(current, key)!r}"
        for key in RESUME_KEYS
        if OmegaConf.select(saved, key) != OmegaConf.select(current, key)
    ]
    if different:
        raise ValueError(
            f"--resume: {run.root} is a different run ({'; '.join(different)}); use the run's settings to continue "
            "it, or another output_dir for a new run"
        )


def write_run_config(run: RunFolder, config) -> None:
    """The resolved config of the run, ``fcsd_config.yaml`` (after the marker that makes the folder fcsd's)."""
    from omegaconf import OmegaConf

    safe_io.mark(run.root, "run")
    OmegaConf.save(OmegaConf.structured(config), run.config)


def write_summary(run: RunFolder, summary: dict) -> None:
    run.summary.write_text(json.dumps(summary, indent=2))


class MetricsLog:
    """Append-only JSONL metrics plus TensorBoard scalars; on resume, records after the checkpoint are dropped."""

    def __init__(self, output_dir: Path, resume_step: int | None = None, enabled: bool = True):
        self.path = RunFolder(output_dir).metrics
        self.enabled = enabled
        self.writer = None
        if not enabled:
            return
        if resume_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(RunFolder(output_dir).tensorboard), purge_step=resume_step)
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
