"""Settings fcsd removed, refused in one line wherever a config is read (design §3): the recovery recipes and levers
that lost in the measurements (docs/recovery.md, BENCHMARKS.md). A command-line override, a recipe file and a run's
saved config are all checked by :func:`check_removed`."""

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
