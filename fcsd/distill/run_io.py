"""What a run writes while it trains: its config and summary, metrics (JSONL + TensorBoard) and the PNG of the
training curves (the file names belong to :class:`fcsd.files.run_folder.RunFolder`; what may be written where is the
pre-flight's, :mod:`fcsd.distill.preflight`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fcsd.files import ownership, staging
from fcsd.files.run_folder import RunFolder


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
    from fcsd.run_facts import KL_KEYS, kl_of

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
