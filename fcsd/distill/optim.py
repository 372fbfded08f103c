"""Optimisation of an FCSD run (paper Sec. 5.1; design §3): how ``train.batch_tokens`` becomes micro-batches, AdamW
with linear warm-up and cosine annealing to ``train.min_lr_ratio`` (or schedule-free AdamW, the
``recovery.optimizer=schedule_free`` recipe), and the spike guard that decides whether a step's update is applied."""

from __future__ import annotations

import math
import statistics
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fcsd.distill.config import FCSDConfig, peak_lr
from fcsd.run_facts import schedule_steps, warmup_steps


@dataclass
class StepPlan:
    """How ``train.batch_tokens`` becomes micro-batches: ``sequences`` rows per step, ``accumulation`` micro-batches
    of ``micro_batch_size`` rows per process; the LR schedule spans ``schedule_steps`` steps and the run stops after
    ``total_steps`` (fewer when ``train.stop_after`` cuts it short, as sweep runs do)."""

    sequences: int
    micro_batch_size: int
    accumulation: int
    world_size: int
    total_steps: int
    schedule_steps: int

    def rows(self, step: int, num_rows: int, seed: int) -> list[int]:
        """The packed rows of ``step`` (all processes), in a seeded order reshuffled every epoch."""
        first = step * self.sequences
        out: list[int] = []
        while len(out) < self.sequences:
            epoch, offset = divmod(first + len(out), num_rows)
            order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
            out.extend(order[offset : offset + self.sequences - len(out)])
        return out

    @property
    def per_process(self) -> int:
        """Sequences of a step on each process."""
        return self.sequences // self.world_size

    def fit_split(self, split: int) -> int:
        """The largest number of optimizer updates, at most ``split``, that one step's rows share evenly, every
        process holding the same number of rows in each (``recovery.batch_ramp``)."""
        return largest_divisor(self.per_process, split)

    def update_rows(self, rows: list[int], split: int, rank: int) -> list[list[list[int]]]:
        """This process's micro-batches for each of ``split`` optimizer updates sharing one step's ``rows`` (a
        split that :meth:`fit_split` allows): update ``u`` takes the ``u``-th consecutive slice of the step and
        spreads it over the processes as a whole step is spread (split 1: the step itself), so every process count
        trains on the same rows in each update."""
        size = len(rows) // split
        per_process = size // self.world_size
        micro = largest_divisor(per_process, self.micro_batch_size)
        updates = []
        for update in range(split):
            share = rows[update * size : (update + 1) * size]
            starts = [(i * self.world_size + rank) * micro for i in range(per_process // micro)]
            updates.append([share[start : start + micro] for start in starts])
        return updates


def largest_divisor(count: int, cap: int) -> int:
    """The largest divisor of ``count`` that is at most ``cap`` (a micro-batch size, a number of updates)."""
    return max(size for size in range(1, min(cap, count) + 1) if count % size == 0)


def plan_steps(config: FCSDConfig, world_size: int) -> StepPlan:
    """How a step is split: ``train.batch_tokens / data.seq_len`` sequences shared evenly by the processes, each
    share in micro-batches of the largest size up to ``train.micro_batch_size`` that divides it (so a preset runs
    under any process count that divides its step; the loss does not depend on the micro-batch size)."""
    train, seq_len = config.train, config.data.seq_len
    if train.batch_tokens % seq_len:
        raise ValueError(
            f"train.batch_tokens={train.batch_tokens} is not a multiple of data.seq_len={seq_len}; "
            "a step holds whole packed sequences"
        )
    sequences = train.batch_tokens // seq_len
    if sequences % world_size:
        usable = seq_len * world_size * max(1, round(sequences / world_size))
        raise ValueError(
            f"a step of {sequences} sequences (train.batch_tokens={train.batch_tokens} / data.seq_len={seq_len}) "
            f"does not split over {world_size} processes: use train.batch_tokens={usable} (a multiple of "
            f"{seq_len * world_size}) or a process count dividing {sequences}"
        )
    per_process = sequences // world_size
    micro = largest_divisor(per_process, train.micro_batch_size)
    horizon = schedule_steps(train)
    total = min(horizon, train.stop_after) if train.stop_after is not None else horizon
    return StepPlan(sequences, micro, per_process // micro, world_size, total, horizon)


def build_optimizer(student, config: FCSDConfig, plan: StepPlan):
    """AdamW and cosine annealing with linear warm-up to ``train.min_lr_ratio * lr`` over the schedule's horizon
    (paper Sec. 5.1); ``train.freeze_embeddings`` freezes the input embeddings and LM head.
    ``recovery.optimizer=schedule_free``: schedule-free AdamW at a constant LR after the linear warm-up
    (:func:`schedule_free`); ``recovery.lr_scale`` multiplies the peak LR either way."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    train = config.train
    peak, warmup = peak_lr(config), warmup_steps(config)
    if train.freeze_embeddings:  # paper Tab. 2 "KL embed."
        student.get_input_embeddings().requires_grad_(False)
        student.get_output_embeddings().requires_grad_(False)
    params = [p for p in student.parameters() if p.requires_grad]
    if hasattr(student, "fcsd_layout"):  # one group per device mesh (fused AdamW cannot mix them)
        from fcsd.parallel.training import parameter_groups

        params = parameter_groups(student, params)
    if config.recovery.optimizer == "schedule_free":
        return schedule_free(params, peak, warmup, train)
    optimizer = torch.optim.AdamW(params, lr=peak, betas=tuple(train.adam_betas), weight_decay=train.weight_decay)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, warmup, max(plan.schedule_steps, 1), min_lr_rate=train.min_lr_ratio
    )
    return optimizer, scheduler


def schedule_free(params, lr: float, warmup: int, train):
    """Schedule-free AdamW (Defazio et al. 2024, "The Road Less Scheduled"; the ``schedulefree`` package) at ``lr``
    after a linear warm-up of ``warmup`` steps (applied by the returned LambdaLR, which the optimizer reads as its
    scheduled LR), then constant: no horizon to anneal towards. Its training iterate runs ahead of an average of the
    steps; :func:`evaluation_weights` puts that average into the model, and it is what a run scores and saves. In the
    recovery benchmark it reached the plain recipe's KL in about half the tokens (BENCHMARKS.md): the distillation is
    limited by gradient noise, which the average removes without lowering the LR."""
    import schedulefree

    optimizer = schedulefree.AdamWScheduleFree(
        params, lr=lr, betas=tuple(train.adam_betas), weight_decay=train.weight_decay, warmup_steps=0
    )
    optimizer.train()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, LinearWarmup(warmup))
    return optimizer, scheduler


class LinearWarmup:
    """LR factor ``(step + 1) / (warmup + 1)`` for ``warmup`` steps, then 1 (a plain object: the scheduler's state
    dict saves it)."""

    def __init__(self, warmup: int):
        self.warmup = warmup

    def __call__(self, step: int) -> float:
        return (step + 1) / (self.warmup + 1) if step < self.warmup else 1.0


@contextmanager
def evaluation_weights(optimizer):
    """The weights to score and save in the model for the duration: a schedule-free optimizer's average (its
    ``eval`` mode), restored to the training iterate afterwards; nothing to do for AdamW."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    if not (hasattr(inner, "eval") and inner.param_groups[0].get("train_mode")):  # AdamW, or already switched
        yield
        return
    inner.eval()
    try:
        yield
    finally:
        inner.train()


def fuse_on_gpu(optimizer) -> None:
    """torch's fused AdamW for every parameter group held on GPUs (the transformers Trainer's default there): one
    kernel per step, and none of the foreach implementation's temporaries, which hold a copy of the second moments
    (4 bytes per parameter) at the end of every step, the peak of a sharded run (``fcsd plan`` counts it). Called
    again after a checkpoint is restored (loading a state dict brings back the saved group settings); the fused
    kernel wants its step counters as float32 on the parameters' device."""
    state = getattr(optimizer, "optimizer", optimizer).state  # accelerate's wrapper or the optimizer itself
    for group in optimizer.param_groups:
        if group["params"] and all(p.device.type == "cuda" for p in group["params"]):
            group["fused"], group["foreach"] = True, False
            for param in group["params"]:
                step = state.get(param, {}).get("step")
                if isinstance(step, torch.Tensor):
                    state[param]["step"] = step.to(param.device, torch.float32)


class Diverged(RuntimeError):
    """The spike guard stopped the run (``train.max_bad_steps`` updates in a row skipped, or a bad one DeepSpeed had
    already applied): the trainer says it in one line with the way on (:func:`fcsd.distill.finite.diverged`)."""


class SpikeGuard:
    """Decides whether a step's update is applied: its loss and gradient norm must be finite and the loss below
    ``factor`` times the median of the last ``window`` applied steps (``factor`` 0: no spike test). ``max_bad``
    refusals in a row stop the run.

    ``can_skip=False`` (DeepSpeed, which steps its optimizer inside ``backward``, before the guard can look): a bad
    step cannot be undone, so it stops the run at once instead of being logged as a skip that never happened.
    """

    def __init__(self, factor: float, window: int, max_bad: int, history=None, bad_streak=0, can_skip=True):
        self.factor, self.window, self.max_bad, self.can_skip = factor, window, max_bad, can_skip
        self.history: list[float] = list(history or [])
        self.bad_streak = bad_streak

    def check(self, loss: float, grad_norm: float) -> str | None:
        """``None`` when the step is good, else the reason it is skipped."""
        reason = None
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            reason = f"non-finite loss {loss} or gradient norm {grad_norm}"
        elif self.factor and len(self.history) >= self.window and loss > self.factor * statistics.median(self.history):
            reason = f"loss spike {loss:.4g} > {self.factor} x median {statistics.median(self.history):.4g}"
        if reason is None:
            self.history = (self.history + [loss])[-self.window :]
            self.bad_streak = 0
            return None
        if not self.can_skip:
            raise Diverged(
                f"a bad step ({reason}) under DeepSpeed, which has already applied it (its optimizer steps inside "
                "backward)"
            )
        self.bad_streak += 1
        if self.bad_streak >= self.max_bad:
            raise Diverged(f"training diverged: {self.bad_streak} updates in a row were skipped (last: {reason})")
        return reason

    def state(self) -> dict:
        return {"history": self.history, "bad_streak": self.bad_streak}


@contextmanager
def scaled_lr(optimizer, factor: float):
    """Every parameter group's LR times ``factor`` inside the block (one update of a split step under
    ``recovery.batch_ramp``), restored after: the scheduler keeps its own values."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] *= factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr


def apply_update(optimizer, scaler, guard: SpikeGuard, loss: float, grad_norm: float) -> tuple[bool, str | None]:
    """Step ``optimizer`` unless ``guard`` refuses the step; returns ``(applied, reason it was not)``.

    With an fp16 loss ``scaler`` an infinite gradient norm is an overflow, which is normal: the scaler skips that
    step itself and lowers its scale, and the guard does not count it. A step the guard refuses still closes the
    scaler's iteration (clipping has unscaled the gradients; without ``update`` the next step fails)."""
    if scaler is not None and math.isfinite(loss) and not math.isfinite(grad_norm):
        optimizer.step()  # the scaler sees the inf and skips the update
        return False, "fp16 overflow (the loss scaler skipped the step and lowered its scale)"
    reason = guard.check(loss, grad_norm)
    if reason is None:
        optimizer.step()
        return True, None
    if scaler is not None:
        scaler.update()
    return False, reason
