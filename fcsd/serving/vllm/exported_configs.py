"""The exported model types' config classes (:mod:`fcsd.serving.exported_configs`), registered with vLLM."""

from __future__ import annotations

from fcsd.serving.exported_configs import farskip_config_class
from fcsd.serving.served_families import SERVED_FAMILIES


def register_configs() -> None:
    """Make vLLM (and transformers' ``AutoConfig``, for the tokenizer) load ``farskip_*`` configs with these
    classes instead of the export's remote code."""
    from transformers import AutoConfig
    from vllm.transformers_utils import config as vllm_config

    for family in SERVED_FAMILIES:
        cls = farskip_config_class(family.model_type)
        vllm_config._CONFIG_REGISTRY[cls.model_type] = cls  # vLLM's own registry of config classes by model type
        AutoConfig.register(cls.model_type, cls, exist_ok=True)
