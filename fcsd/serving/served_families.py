"""Which engine model class serves each family fcsd converts (vLLM's, SGLang's), and the architecture name an export
carries for it.

Standard library only: ``fcsd export`` imports this to name the serving class in ``config.json``; the plugins import
it inside the engines' environments. An export's ``architectures`` is ``FarSkip<stock architecture>`` (both engines
name their classes as transformers does, so one name serves in either) and its model type stays
``farskip_<stock type>`` (so nothing serves it with stock wiring by mistake).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

EXPORTED_PREFIX = "farskip_"  # the model-type prefix of an export (fcsd.connectivity.families.EXPORTED_PREFIX)
ARCHITECTURE_PREFIX = "FarSkip"


@dataclass(frozen=True)
class ServedFamily:
    """One family as vLLM builds it: its stock model class, its decoder-layer class and where the MLP sits."""

    model_type: str  # the stock transformers model type (of the exported config's top level)
    architecture: str  # vLLM's stock architecture name (the transformers class name)
    module: str  # vLLM module holding the stock class
    decoder_layer: str  # vLLM decoder-layer class name
    mlp_attr: str = "mlp"  # decoder-layer attribute of the MLP / MoE block
    verified_on_cpu: bool = True  # served and compared with fcsd's model by the tests (vLLM's CPU build)
    sglang: str | None = None  # SGLang module (under sglang.srt.models) of the stock class; None: not served there

    @property
    def farskip_architecture(self) -> str:
        return ARCHITECTURE_PREFIX + self.architecture


_MODELS = "vllm.model_executor.models."
SERVED_FAMILIES: tuple[ServedFamily, ...] = (
    ServedFamily("qwen3_moe", "Qwen3MoeForCausalLM", _MODELS + "qwen3_moe", "Qwen3MoeDecoderLayer", sglang="qwen3_moe"),
    ServedFamily("qwen2_moe", "Qwen2MoeForCausalLM", _MODELS + "qwen2_moe", "Qwen2MoeDecoderLayer"),
    ServedFamily(
        "deepseek_v2", "DeepseekV2ForCausalLM", _MODELS + "deepseek_v2", "DeepseekV2DecoderLayer", sglang="deepseek_v2"
    ),
    ServedFamily(
        "deepseek_v3", "DeepseekV3ForCausalLM", _MODELS + "deepseek_v2", "DeepseekV2DecoderLayer", sglang="deepseek_v2"
    ),
    ServedFamily("mixtral", "MixtralForCausalLM", _MODELS + "mixtral", "MixtralDecoderLayer", "block_sparse_moe"),
    ServedFamily("olmoe", "OlmoeForCausalLM", _MODELS + "olmoe", "OlmoeDecoderLayer"),
    # vLLM's CPU fused MoE refuses Llama-4's router weight on the input: written and unit-tested, not served here
    ServedFamily("llama4_text", "Llama4ForCausalLM", _MODELS + "llama4", "Llama4DecoderLayer", "feed_forward", False),
    ServedFamily(
        "llama4",
        "Llama4ForConditionalGeneration",
        _MODELS + "mllama4",
        "Llama4DecoderLayer",
        "feed_forward",
        False,
    ),
)
BY_ARCHITECTURE = {family.farskip_architecture: family for family in SERVED_FAMILIES}
BY_MODEL_TYPE = {family.model_type: family for family in SERVED_FAMILIES}


def farskip_architecture(model_type: str) -> str | None:
    """The architecture an export of stock ``model_type`` names in ``config.json`` (None if vLLM lacks the family)."""
    family = BY_MODEL_TYPE.get(model_type.removeprefix(EXPORTED_PREFIX))
    return family.farskip_architecture if family is not None else None


SGLANG_FAMILIES = tuple(family for family in SERVED_FAMILIES if family.sglang is not None)


def served_families_text(families: tuple[ServedFamily, ...] = SERVED_FAMILIES) -> str:
    return ", ".join(f"{family.model_type} ({family.architecture})" for family in families)


# what an export of a family vLLM lacks names (and what exports of fcsd 0.1 named): the plugin refuses it in one line
UNSERVED_ARCHITECTURE = "FarSkipForCausalLM"


def serve_command(folder: str, model_type: str) -> str | None:
    """The ``vllm serve`` command of an export (None if vLLM lacks its family); printed by ``fcsd export`` and the
    model card, the folder quoted for a shell."""
    if farskip_architecture(model_type) is None:
        return None
    return f"vllm serve {shlex.quote(folder)}"


def sglang_serve_command(folder: str, model_type: str) -> str | None:
    """SGLang's server command of an export (None if fcsd's SGLang plugin lacks its family), the folder quoted."""
    family = BY_MODEL_TYPE.get(model_type.removeprefix(EXPORTED_PREFIX))
    if family is None or family.sglang is None:
        return None
    return f"python -m sglang.launch_server --model-path {shlex.quote(folder)}"
