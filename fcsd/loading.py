"""Loading checkpoints with their FarSkip connectivity applied."""

from __future__ import annotations

from fcsd.connectivity.patch import CONFIG_KEY, apply_farskip


def from_pretrained(name_or_path: str, layers=None, **kwargs):
    """Load a causal LM (hub id or local folder) with ``AutoModelForCausalLM`` and apply FarSkip connectivity.

    ``layers`` overrides the selection; by default the layers recorded in the checkpoint's ``config.farskip`` are
    converted (none for a stock checkpoint). ``kwargs`` go to ``from_pretrained`` (``dtype``, ``device_map``, ...).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    if layers is None:
        record = getattr(model.config, CONFIG_KEY, None) or {}
        layers = record.get("layers", [])
    return apply_farskip(model, layers)
