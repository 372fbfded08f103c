"""What a checkpoint's ``config.json`` says it is, checked as a whole, so that FarSkip wiring never silently becomes
the stock one (paper Sec. 3; design §7). Standard library only: the vLLM plugin checks every config vLLM loads with
it, under vLLM's own transformers.

Three fields name a FarSkip checkpoint, and they must agree:

- ``model_type``: ``farskip_<stock type>`` in an export (stock transformers refuses it instead of loading it with
  regular connectivity), the stock type in an fcsd checkpoint that is not an export (a run's ``final/``);
- the ``farskip`` block: which layers are converted (``layers``, a non-empty list of layer indices);
- ``architectures``: ``FarSkip<stock class>`` in an export, the class fcsd's vLLM plugin serves it with.

:func:`identify` tells ``stock`` (no FarSkip field at all), ``converted`` (the stock model type and class with a
``farskip`` block: loads with :func:`fcsd.from_pretrained`, but a serving engine would run it with stock wiring) and
``export``; any other combination is an :class:`IdentityError` naming the field and how to export again.
"""

from __future__ import annotations

from fcsd.serving.vllm.families import ARCHITECTURE_PREFIX, EXPORTED_PREFIX, farskip_architecture

CONFIG_KEY = "farskip"  # fcsd.connectivity.patch.CONFIG_KEY
REEXPORT = "export it again with `fcsd export RUN_OR_CHECKPOINT OUT_DIR`"


class IdentityError(ValueError):
    """A config whose FarSkip fields disagree (a damaged or hand-edited export)."""


def identify(values: dict, where: str = "config.json") -> str:
    """``"stock"``, ``"converted"`` or ``"export"`` for the ``config.json`` values ``values`` (``where`` names the
    file in messages); :class:`IdentityError` when its FarSkip fields disagree."""
    model_type = str(values.get("model_type") or "")
    architectures = [str(a) for a in values.get("architectures") or []]
    record = values.get(CONFIG_KEY)
    farskip_classes = [a for a in architectures if a.startswith(ARCHITECTURE_PREFIX)]
    if record is not None and not isinstance(record, dict):
        kind = type(record).__name__
        raise IdentityError(f"{where}: the `{CONFIG_KEY}` block is a {kind}, not an object; {REEXPORT}")
    if record is not None and "layers" not in record:  # what stays of it without conversion (a placement)
        record = None if not model_type.startswith(EXPORTED_PREFIX) else record
    if record is not None:
        _check_record(record, where)
    if model_type.startswith(EXPORTED_PREFIX):
        base = model_type.removeprefix(EXPORTED_PREFIX)
        if record is None:
            raise IdentityError(
                f"{where}: model type {model_type!r} says FarSkip but the `{CONFIG_KEY}` block (which layers are "
                f"converted) is missing, so the model would run with stock wiring; {REEXPORT}"
            )
        if record.get("base_model_type") not in (None, base):
            raise IdentityError(
                f"{where}: model type {model_type!r} but `{CONFIG_KEY}.base_model_type` is "
                f"{record['base_model_type']!r}; {REEXPORT}"
            )
        if not farskip_classes:
            expected = farskip_architecture(base) or f"{ARCHITECTURE_PREFIX}ForCausalLM"
            named = f"architectures {architectures} names the stock class" if architectures else "no architectures"
            raise IdentityError(
                f"{where}: {named}, but model type {model_type!r} and the `{CONFIG_KEY}` block say FarSkip (a serving "
                f'engine would run it with stock wiring); set "architectures": ["{expected}"], or {REEXPORT}'
            )
        return "export"
    if farskip_classes:
        raise IdentityError(
            f"{where}: architectures {architectures} names a FarSkip class but model type {model_type!r} is the stock "
            f"one (stock transformers would load it with regular connectivity); set "
            f'"model_type": "{EXPORTED_PREFIX}{model_type}", or {REEXPORT}'
        )
    return "stock" if record is None else "converted"


def _check_record(record: dict, where: str) -> None:
    layers = record.get("layers")
    if not isinstance(layers, list) or not layers:
        raise IdentityError(
            f"{where}: the `{CONFIG_KEY}` block has no list of converted layers (`{CONFIG_KEY}.layers`), so which "
            f"layers are FarSkip is unknown; {REEXPORT}"
        )
    bad = [i for i in layers if not isinstance(i, int) or isinstance(i, bool) or i < 0]
    if bad:
        raise IdentityError(f"{where}: `{CONFIG_KEY}.layers` holds {bad[:5]}, not layer indices; {REEXPORT}")
