"""The facts of a run that its trainer derives and its readers (the model card, the demo's report) read again, so that
both derive them one way (paper Sec. 5.1; design §3): the schedule in steps (its horizon, warm-up and batch-ramp stages)
and the held-out KL of a metrics record. Plain arithmetic on a run's config (:class:`fcsd.distill.config.FCSDConfig`
or its saved ``config.yaml``)."""

KL_KEYS = ("eval/kl", "eval/kl_topk")

# Recipes and levers that lost in the measurements (docs/recovery.md, BENCHMARKS.md), removed from fcsd after the
# commit below: setting -> (why, the value that turned it off). A config naming one is refused by
# :func:`check_removed`; a preset name stands for the setting it set.
REMOVED_IN = "3769dc9"
_WARM = "the layer-local warm start needed more tokens than plain KL"
_PROGRESSIVE = "progressive conversion needed more tokens than plain KL"
_GROUPS = "parameter groups needed more tokens than plain KL, or never reached it"
_ECHO = "data echoing never won on compute"
REMOVED = {
    "recovery.warm_share": (_WARM, 0.0),
    "recovery.warm_lr_mult": (_WARM, 10.0),
    "recovery=warm_start": (_WARM, None),
    "recovery.progressive": (_PROGRESSIVE, []),
    "recovery.progressive_shares": (_PROGRESSIVE, []),
    "recovery.trainable": (_GROUPS, "all"),
    "recovery.lr_mult": (_GROUPS, {}),
    "recovery=non_expert": (_GROUPS, None),
    "recovery.echo": (_ECHO, 1),
    "recovery.echo_share": (_ECHO, 0.0),
}
_ABSENT = object()


def check_removed(settings, saved_in=None) -> None:
    """Refuse in one line the first setting of :data:`REMOVED` that ``settings`` names: command-line overrides
    (``key=value``, a preset ``group=name``, or a bare key) or a config (a mapping). ``saved_in``: the run folder
    whose saved config ``settings`` is; such a config records every key of the fcsd that wrote it, so there a
    removed key at the value that turned it off is no use of it and is ignored."""
    for name, value in _named(settings):
        why, off = REMOVED[name]
        if saved_in is not None and value == off:
            continue
        fix = f"the run in {saved_in} used it: resume or export it with fcsd at that commit" if saved_in else ""
        fix = fix or ("drop it (recovery=guided is the default)" if "=" in name else "drop it from the config")
        where = f"its code is in commit {REMOVED_IN}, its figures in BENCHMARKS.md"
        raise ValueError(f"{name} was removed ({why}; {where}): {fix}")


def _named(settings):
    """``(entry of REMOVED, value)`` for each setting of ``settings`` that one names."""
    if hasattr(settings, "keys"):  # a config: each removed key it holds
        for name in REMOVED:
            value = _select(settings, name)
            if value is not _ABSENT:
                yield name, value
        return
    for setting in settings:
        key, _, value = str(setting).partition("=")
        key = key.lstrip("+~")
        for name in REMOVED:
            if name in (key, f"{key}={value}") or key.startswith(f"{name}."):
                yield name, value


def _select(config, dotted: str):
    """``config``'s value at ``dotted`` (a mapping, nested), or :data:`_ABSENT`."""
    for part in dotted.split("."):
        if not hasattr(config, "keys") or part not in config:
            return _ABSENT
        config = config[part]
    return config


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
    """The held-out KL of a record of :func:`heldout_metrics`, whichever kind it is."""
    return next(metrics[key] for key in KL_KEYS if key in metrics)
