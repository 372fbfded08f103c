"""The exported model types' config classes (:mod:`fcsd.serving.exported_configs`) as SGLang reads them.

SGLang chooses some paths by the class names in ``architectures`` (MLA attention and its KV cache for the DeepSeek
classes) and reads fields that configs saved by transformers 5 no longer carry (DeepSeek's ``moe_layer_freq``, its
``scoring_func``). An SGLang config instance therefore lists the stock class *after* the FarSkip one (SGLang builds
the first class its registry knows: the FarSkip one, registered by the same plugin) and fills those fields in.
"""

from __future__ import annotations

from fcsd.serving.exported_configs import farskip_config_class
from fcsd.serving.served_families import ARCHITECTURE_PREFIX, SERVED_FAMILIES

_CLASSES: dict[str, type] = {}
# fields SGLang's DeepSeek class reads that configs saved by transformers 5 leave out, at the values transformers'
# own DeepSeek models behave as (V2 routes with a softmax, V3 with a biased sigmoid)
MISSING_DEFAULTS = {
    "deepseek_v2": {"moe_layer_freq": 1, "scoring_func": "softmax"},
    "deepseek_v3": {"moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc"},
}


def stock_fields(model_type: str) -> dict:
    """What SGLang's own class of stock ``model_type`` needs beside a transformers 5 config (for stock copies)."""
    return dict(MISSING_DEFAULTS.get(model_type, {}))


def sglang_config_class(model_type: str) -> type:
    if model_type not in _CLASSES:
        base = farskip_config_class(model_type)

        def __init__(self, **kwargs):
            base.__init__(self, **kwargs)
            listed = list(getattr(self, "architectures", None) or [])
            stock = [a.removeprefix(ARCHITECTURE_PREFIX) for a in listed if a.startswith(ARCHITECTURE_PREFIX)]
            self.architectures = listed + [a for a in stock if a not in listed]
            for key, value in MISSING_DEFAULTS.get(model_type, {}).items():
                if getattr(self, key, None) is None:
                    setattr(self, key, value)

        name = f"SGLang{base.__name__}"
        cls = type(name, (base,), {"__init__": __init__, "__module__": __name__, "__qualname__": name})
        globals()[name] = cls
        _CLASSES[model_type] = cls
    return _CLASSES[model_type]


def __getattr__(name: str):  # unpickling in a fresh process: rebuild the class by its name
    for family in SERVED_FAMILIES:
        if name == f"SGLang{farskip_config_class(family.model_type).__name__}":
            return sglang_config_class(family.model_type)
    raise AttributeError(name)


def register_configs() -> None:
    """Make transformers' ``AutoConfig`` (which SGLang loads configs with) read ``farskip_*`` configs with these
    classes instead of the export's remote code (every family's: one SGLang lacks then reaches the plugin's refusal)."""
    from transformers import AutoConfig

    for family in SERVED_FAMILIES:
        cls = sglang_config_class(family.model_type)
        AutoConfig.register(cls.model_type, cls, exist_ok=True)
