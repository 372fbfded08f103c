"""Nothing is written from non-finite weights (design §3: a run's outputs are what it trained).

A skipped step leaves the weights as they were, so a run whose loss is not finite on ``train.max_nonfinite_steps``
batches in a row holds weights that are broken themselves (a checkpoint damaged on disk, an update that diverged):
:class:`NonFiniteStop` ends it in one line before it writes ``final/``, an export or a summary, naming the checkpoint
to resume from. :func:`check_weights_finite` is the last word before ``final/``: a run too short for the streak (a
resume one step before its end) is caught there.
"""

from __future__ import annotations

import math

import torch


class NonFiniteRun(ValueError):
    """A run stopped because its weights give (or are) non-finite values: one line, status 2."""


class NonFiniteStop:
    """Counts the steps in a row whose loss was not finite (their updates were skipped); ``limit`` of them stop the
    run (0: never). ``streak``: the count a resumed run starts from (saved in its checkpoint).

    Not :class:`fcsd.distill.optim.SpikeGuard`'s ``bad_streak``, which counts another thing: skipped *updates* (a
    batch-ramp step makes several), for any reason (a loss spike, a non-finite gradient norm of a finite loss),
    while this counts *steps* whose loss was not finite, a spike-skipped step ending the streak."""

    def __init__(self, limit: int, streak: int = 0):
        self.limit, self.streak = limit, streak

    def step_done(self, done: int, loss: float, applied: bool, run) -> None:
        """Record step ``done``'s loss; raise :class:`NonFiniteRun` once ``limit`` steps in a row were non-finite."""
        self.streak = self.streak + 1 if not applied and not math.isfinite(loss) else 0
        if self.limit and self.streak >= self.limit:
            first = done - self.streak + 1
            raise NonFiniteRun(
                f"training stopped at step {done}: the loss was not finite in each of the last {self.streak} steps "
                f"(all skipped, train.max_nonfinite_steps={self.limit}), so the weights themselves are broken (a "
                f"damaged checkpoint, or a diverged update); nothing was written from them (no final/, export or "
                f"summary); {resume_advice(run, first)}"
            )


def resume_advice(run, first_bad: int) -> str:
    """How to go on: resume from the newest checkpoint saved before step ``first_bad``, with its command; if the
    run diverged, a new run with a tenth of its ``train.lr`` (a resume keeps the run's LR schedule: it refuses
    another)."""
    from fcsd.distill.resume import resume_command

    again = f"start a new run with a lower train.lr (a resume keeps the run's own): `{_lower_lr_command(run)}`"
    before = [c for c in run.checkpoints() if int(c.name[5:]) < first_bad]
    if not before:
        return again
    step = int(before[-1].name[5:])
    return (
        f"resume from {before[-1].name} (the newest checkpoint saved before step {first_bad}): "
        f"`{resume_command(step)}`, or if it diverged, {again}"
    )


def diverged(error: Exception, done: int, run) -> NonFiniteRun:
    """The one-line stop of a run whose spike guard gave up at step ``done``
    (:class:`fcsd.distill.optim.Diverged`): resuming would repeat the same updates at the same LR, so the way on is
    a new run with a tenth of its ``train.lr``."""
    return NonFiniteRun(
        f"training stopped at step {done}: {error}; nothing was written from its weights (no final/, export or "
        f"summary), and a resume would repeat the same updates at the same train.lr, which it keeps: start a new "
        f"run with a lower one: `{_lower_lr_command(run)}`"
    )


def _lower_lr_command(run) -> str:
    """The command being run as a new run over the same folder with a tenth of the run's ``train.lr``."""
    from omegaconf import OmegaConf

    from fcsd.distill.resume import restart_command

    lr = OmegaConf.select(OmegaConf.load(run.config), "train.lr") if run.config.exists() else None
    return restart_command(**({"train.lr": f"{lr / 10:g}"} if isinstance(lr, (int, float)) else {}))


def check_weights_finite(model: torch.nn.Module, accelerator, done: int, run) -> None:
    """Raise :class:`NonFiniteRun` when any process holds a non-finite weight (each checks its own shards; a
    collective)."""
    bad = [name for name, param in model.named_parameters() if not torch.isfinite(_local(param)).all()]
    count = torch.tensor(len(bad), device=accelerator.device)
    if accelerator.num_processes > 1:
        count = accelerator.reduce(count, "sum")
    if int(count):
        where = f" (first: {bad[0]})" if bad else ""
        raise NonFiniteRun(
            f"training stopped at step {done}: {int(count)} weight tensors hold non-finite values{where}; nothing was "
            f"written from them (no final/, export or summary); {resume_advice(run, done)}"
        )


def _local(param: torch.Tensor) -> torch.Tensor:
    """This process's own elements of ``param``: a DTensor's local shard, DeepSpeed ZeRO-3's partition."""
    param = getattr(param, "ds_tensor", param)
    return param.to_local() if hasattr(param, "to_local") else param
