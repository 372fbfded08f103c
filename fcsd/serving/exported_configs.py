"""Config classes for exported model types (``farskip_<stock type>``), registered by the serving plugins (vLLM's,
SGLang's) so that an export loads without remote code (design §7).

Each class is the stock transformers config class under the export's model type; an instance reports the *stock*
model type, because the engines select kernels and conversions by it (MLA attention, for instance, is chosen for
``deepseek_v2`` / ``deepseek_v3`` only). The ``farskip`` block of ``config.json`` stays on the config, where the
plugins' model classes read it.
"""

from __future__ import annotations

from fcsd.serving.served_families import EXPORTED_PREFIX, SERVED_FAMILIES

_CLASSES: dict[str, type] = {}


def _stock_config_class(model_type: str) -> type:
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def farskip_config_class(model_type: str) -> type:
    """The config class of the exported model type ``farskip_<model_type>`` (generated once, module-level so that an
    engine's worker processes unpickle it)."""
    if model_type not in _CLASSES:
        stock = _stock_config_class(model_type)
        name = f"FarSkip{stock.__name__}"

        def __init__(self, **kwargs):
            stock.__init__(self, **kwargs)
            self.model_type = model_type  # the instance reports the stock type (the class keeps the exported one)

        cls = type(name, (stock,), {"model_type": EXPORTED_PREFIX + model_type, "__init__": __init__})
        cls.__module__ = __name__
        globals()[name] = cls
        _CLASSES[model_type] = cls
    return _CLASSES[model_type]


def __getattr__(name: str):  # unpickling in a fresh worker process: rebuild the class by its name
    for family in SERVED_FAMILIES:
        if name == f"FarSkip{_stock_config_class(family.model_type).__name__}":
            return farskip_config_class(family.model_type)
    raise AttributeError(name)
