"""What a checkpoint's ``config.json`` says it is, checked as a whole, so that FarSkip wiring never silently becomes
the stock one (paper Sec. 3; design §7). Standard library only: the vLLM plugin checks every config vLLM loads with
it, under vLLM's own transformers.

Three fields name a FarSkip checkpoint, and they must agree:

- ``model_type``: ``farskip_<stock type>`` in an export (stock transformers refuses it instead of loading it with
  regular connectivity), the stock type in an fcsd checkpoint that is not an export (a run's ``final/``);
- the ``farskip`` block: which layers are converted (``layers``, a non-empty list of layer indices);
- ``architectures``: ``FarSkip<stock class>`` in an export, the class fcsd's vLLM plugin serves it with: the one of
  the export's own family (its model type; ``FarSkipLlama4ForConditionalGeneration`` for a composite ``llama4``),
  since vLLM builds its model from this field. ``FarSkipForCausalLM`` (what exports of fcsd 0.1 named, family-less)
  still loads with fcsd; vLLM's plugin refuses it when it builds it.

:func:`identify` tells ``stock`` (no FarSkip field at all), ``converted`` (the stock model type and class with a
``farskip`` block: loads with :func:`fcsd.from_pretrained`, but a serving engine would run it with stock wiring) and
``export``; any other combination is an :class:`IdentityError` naming the field and how to export again.
"""

from __future__ import annotations

from fcsd.serving.served_families import (
    ARCHITECTURE_PREFIX,
    BY_ARCHITECTURE,
    EXPORTED_PREFIX,
    UNSERVED_ARCHITECTURE,
    farskip_architecture,
)

CONFIG_KEY = "farskip"  # fcsd.connectivity.patch.CONFIG_KEY
PARITY_RECORD = "fcsd_export.json"  # fcsd.export.save.PARITY_RECORD: written by `fcsd export` with the farskip block
REEXPORT = "export it again with `fcsd export RUN_OR_CHECKPOINT OUT_DIR`"


class IdentityError(ValueError):
    """A config whose FarSkip fields disagree (a damaged or hand-edited export)."""


def identify(values: dict, where: str = "config.json", recorded: dict | None = None) -> str:
    """``"stock"``, ``"converted"`` or ``"export"`` for the ``config.json`` values ``values`` (``where`` names the
    file in messages); :class:`IdentityError` when its FarSkip fields disagree. ``recorded`` (the ``farskip`` block of
    the folder's ``fcsd_export.json``) names the stock model type in the fix a message suggests."""
    model_type = values.get("model_type") if isinstance(values.get("model_type"), str) else ""
    listed = values.get("architectures")
    architectures = (
        [str(a) for a in listed] if isinstance(listed, list) else [listed] if isinstance(listed, str) else []
    )
    record = values.get(CONFIG_KEY)
    farskip_classes = [a for a in architectures if a.startswith(ARCHITECTURE_PREFIX)]
    if record is not None and not isinstance(record, dict):
        kind = type(record).__name__
        raise IdentityError(f"{where}: the `{CONFIG_KEY}` block is a {kind}, not an object; {REEXPORT}")
    if record is not None and "layers" not in record:  # what stays of it without conversion (a placement)
        record = None if not model_type.startswith(EXPORTED_PREFIX) else record
    if record is not None:
        _check_record(record, where)
    stock = _stock_type(model_type, record, recorded, farskip_classes)
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
        expected = farskip_architecture(base) or UNSERVED_ARCHITECTURE
        if not isinstance(listed, list) or not farskip_classes:
            raise IdentityError(
                f"{where}: {_architectures_said(values, record)}, but model type {model_type!r} and the "
                f"`{CONFIG_KEY}` block say FarSkip (a serving engine builds its model from that field, with stock "
                f'wiring or none); set "architectures": ["{expected}"], or {REEXPORT}'
            )
        foreign = [a for a in farskip_classes if a not in (expected, UNSERVED_ARCHITECTURE)]
        if foreign:  # a serving engine builds its model from this field: another family's class, other weights
            raise IdentityError(
                f"{where}: architectures {architectures} names a FarSkip class of another family, not "
                f"{expected!r}, the one of model type {model_type!r} (a serving engine builds its model from that "
                f'field); set "architectures": ["{expected}"], or {REEXPORT}'
            )
        others = [a for a in architectures if not a.startswith(ARCHITECTURE_PREFIX)]
        if others:  # a serving engine builds the first class it knows: a stock one beside the FarSkip one may win
            raise IdentityError(
                f"{where}: architectures {architectures} names {others} beside the FarSkip class of model type "
                f"{model_type!r} (a serving engine would build the first one it knows, with other wiring); set "
                f'"architectures": ["{expected}"], or {REEXPORT}'
            )
        return "export"
    if farskip_classes:
        held = f"holds {model_type!r}" if model_type else "is missing"
        wanted = EXPORTED_PREFIX + (stock or "<stock model type>")
        raise IdentityError(
            f'{where}: "model_type" {held}, not a FarSkip model type, but architectures {architectures} names a '
            f"FarSkip class (stock transformers would load it with regular connectivity); set "
            f'"model_type": "{wanted}", or {REEXPORT}'
        )
    return "stock" if record is None else "converted"


def _stock_type(model_type: str, record: dict | None, recorded: dict | None, farskip_classes: list) -> str | None:
    """The stock model type behind a config, from the first field that names it: the ``farskip`` block, the parity
    record, a served FarSkip class, the model type itself (``FARSKIP_QWEN3_MOE`` -> ``qwen3_moe``)."""
    for block in (record, recorded):
        if isinstance(block, dict) and isinstance(block.get("base_model_type"), str) and block["base_model_type"]:
            return block["base_model_type"]
    for name in farskip_classes:
        if name in BY_ARCHITECTURE:
            return BY_ARCHITECTURE[name].model_type
    lowered = model_type.lower()
    return lowered.removeprefix(EXPORTED_PREFIX) or None


def _architectures_said(values: dict, record: dict) -> str:
    """What ``architectures`` holds, in words: missing, null, empty, not a list, or the classes it names."""
    listed = values.get("architectures")
    if "architectures" not in values:
        return '"architectures" is missing'
    if listed is None or listed == []:
        return f'"architectures" is {"null" if listed is None else "empty"}'
    if not isinstance(listed, list):
        return f'"architectures" holds the {type(listed).__name__} {listed!r}, not a list of class names'
    stock = record.get("base_architectures") or [f.architecture for f in BY_ARCHITECTURE.values()]
    which = "the stock class" if all(a in stock for a in listed) else "no FarSkip class"
    return f'"architectures" holds {listed}, which names {which}'


def identify_folder(folder, values: dict, where: str = "config.json") -> str:
    """:func:`identify`, and for a folder ``fcsd export`` wrote (its parity record, ``fcsd_export.json``, names the
    converted layers the reload was checked with) the same layers in ``values``: a ``config.json`` edited after the
    export (layers dropped from ``farskip.layers``, every FarSkip field set back to stock) would load or serve those
    layers with stock wiring, and is refused naming the field."""
    import json
    from pathlib import Path

    try:
        block = json.loads((Path(folder) / PARITY_RECORD).read_text())[CONFIG_KEY]
        recorded = block["layers"]
    except (OSError, ValueError, TypeError, KeyError):
        return identify(values, where)  # no parity record (not an export folder) or none that names the layers
    kind = identify(values, where, block if isinstance(block, dict) else None)
    if not isinstance(recorded, list):
        return kind
    block = values.get(CONFIG_KEY) if isinstance(values.get(CONFIG_KEY), dict) else {}
    layers = block.get("layers")
    if kind == "export" and isinstance(layers, list) and sorted(set(layers)) == sorted(set(recorded)):
        return kind
    said = f"`{CONFIG_KEY}.layers` is {layers}"
    if kind != "export":
        what = "a stock model" if kind == "stock" else "an fcsd checkpoint that is not an export"
        said = f"model type {values.get('model_type')!r} and architectures {values.get('architectures')} say {what}"
    raise IdentityError(
        f"{where}: {said}, but {PARITY_RECORD} beside it records the export of FarSkip layers {recorded} (config.json "
        f"was edited after the export, and those layers would run with stock wiring); {REEXPORT}"
    )


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


def converted_layers(config, num_layers: int) -> list[int]:
    """The converted layer indices recorded in the export's ``farskip`` block, checked (one-line errors)."""
    record = getattr(config, "farskip", None)
    layers = record.get("layers") if isinstance(record, dict) else None
    if not isinstance(layers, list) or not layers:
        raise ValueError(
            "config.json has no usable `farskip.layers` list (the converted layer indices): not an fcsd export, or a "
            "damaged one; export it again with `fcsd export`"
        )
    bad = [i for i in layers if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"config.json farskip.layers holds {bad[:5]}: expected layer indices in 0..{num_layers - 1}")
    return sorted(set(layers))
