"""What a run leaves on disk: the output folder rules, atomic folder writes, metrics (JSONL + TensorBoard) and the
PNG of the training curves."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"


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


@contextmanager
def atomic_dir(target: Path):
    """Yield a staging folder beside ``target``; on success it replaces ``target`` in one rename."""
    staging = target.with_name(f".{target.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = target.with_name(f".{target.name}.old")
    if target.exists():
        os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)


def checkpoints(output_dir: Path) -> list[Path]:
    """Complete step checkpoints, oldest first (a partial one is never listed: it has a dotted staging name)."""
    folder = output_dir / CHECKPOINTS
    if not folder.exists():
        return []
    return sorted((p for p in folder.iterdir() if p.name.startswith("step-")), key=lambda p: int(p.name[5:]))


def prune_checkpoints(output_dir: Path, keep: int) -> None:
    for old in checkpoints(output_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


class MetricsLog:
    """Append-only JSONL metrics plus TensorBoard scalars; on resume, records after the checkpoint are dropped."""

    def __init__(self, output_dir: Path, resume_step: int | None = None, enabled: bool = True):
        self.path = output_dir / METRICS
        self.enabled = enabled
        self.writer = None
        if not enabled:
            return
        if resume_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(output_dir / "tensorboard"), purge_step=resume_step)
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
    evals = [r for r in records if "eval/kl" in r]
    mbpp = [r for r in records if "early_stop/mbpp_plus" in r]
    figure, axes = plt.subplots(1, 3 if mbpp else 2, figsize=(16 if mbpp else 11, 4))
    ax_loss, ax_lr = axes[:2]
    ax_loss.plot([r["step"] for r in train], [r["train/loss"] for r in train], label="training loss (per token)")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval/kl"] for r in evals], "o-", label="held-out KL")
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
