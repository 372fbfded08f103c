"""The facts of a run that its trainer derives and its readers (the model card, the demo's report) read again, so that
both derive them one way (paper Sec. 5.1; design §3): the schedule in steps (its horizon, warm-up and batch-ramp stages)
and the held-out KL of a metrics record. Plain arithmetic on a run's config (:class:`fcsd.distill.config.FCSDConfig`
or its saved ``config.yaml``)."""

KL_KEYS = ("eval/kl", "eval/kl_topk")


def schedule_steps(train) -> int:
    """The LR schedule's horizon: the run's length from ``train.max_tokens`` and ``train.max_steps`` (the smaller
    wins); ``train.stop_after`` ends a run early without changing it."""
    total = train.max_tokens // train.batch_tokens
    return min(total, train.max_steps) if train.max_steps is not None else total


def end_step(train) -> int:
    """The step a run ends at: the schedule's horizon, or ``train.stop_after`` when that comes first."""
    horizon = schedule_steps(train)
    return min(horizon, train.stop_after) if train.stop_after is not None else horizon


def stage_ends(shares, horizon: int) -> list[int]:
    """The step each of a run's first stages ends before, for their ``shares`` of its ``horizon`` steps in order."""
    ends, end = [], 0
    for share in shares:
        end += round(share * horizon)
        ends.append(end)
    return ends


def ramp_stages(config) -> list[tuple[int, int, int]]:
    """``(first step, end step, split)`` of each ``recovery.batch_ramp`` stage that holds a step (the guided
    recipe: small batches first, as the batch-size ramps of GPT-3 and DeepSeek-V3, because early in recovery more
    updates buy more than larger batches)."""
    ends = stage_ends(config.recovery.batch_ramp_shares, schedule_steps(config.train))
    stages = zip([0, *ends], ends, config.recovery.batch_ramp, strict=False)
    return [(start, end, split) for start, end, split in stages if end > start]


def warmup_steps(config) -> int:
    """Linear warm-up steps: ``recovery.warmup_share`` of the schedule's horizon when set, else
    ``train.warmup_steps``."""
    share = config.recovery.warmup_share
    return config.train.warmup_steps if share is None else round(share * schedule_steps(config.train))


def kl_of(metrics: dict) -> float:
    """The held-out KL of a record of :func:`fcsd.distill.heldout.heldout_metrics`, whichever kind it is."""
    return next(metrics[key] for key in KL_KEYS if key in metrics)
