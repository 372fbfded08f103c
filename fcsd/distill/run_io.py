"""What a run writes while it trains: the output folder rule, metrics (JSONL + TensorBoard) and the PNG of the
training curves (the file names belong to :class:`fcsd.run_folder.RunFolder`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fcsd.run_folder import RunFolder


def check_output_dir(output_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to write into a non-empty folder unless the run resumes from it or ``overwrite`` is set."""
    if not output_dir.exists() or not any(output_dir.iterdir()) or resume:
        return
    if overwrite:
        shutil.rmtree(output_dir)
        return
    raise ValueError(
        f"output_dir {output_dir} is not empty; pass train.resume=true to continue the run it holds, "
        "overwrite=true to replace it, or another output_dir"
    )


def write_run_config(run: RunFolder, config) -> None:
    """The resolved config of the run, ``fcsd_config.yaml``."""
    from omegaconf import OmegaConf

    run.root.mkdir(parents=True, exist_ok=True)
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
        return [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.exists() else []

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
