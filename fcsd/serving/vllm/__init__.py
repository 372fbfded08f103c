"""The vLLM model plugin for FarSkip exports (paper Sec. 4.2, 6.2; design §7).

vLLM calls :func:`register` through the ``vllm.general_plugins`` entry point in every process it starts. It
registers, for each family in :mod:`fcsd.serving.served_families`, a model class ``FarSkip<stock architecture>``
(vLLM's stock class with the converted layers rewired, :mod:`fcsd.serving.vllm.models`) and a config class for the
export's model type ``farskip_<stock type>`` (:mod:`fcsd.serving.vllm.exported_configs`), so ``vllm serve EXPORT`` needs
no remote code; and it checks every config vLLM loads (:mod:`fcsd.serving.vllm.guard`). Importing this package imports
neither vLLM nor the rest of fcsd.
"""

from __future__ import annotations


def register() -> None:
    """vLLM's plugin hook: register the FarSkip model and config classes (idempotent, cheap: nothing is built)."""
    from vllm import ModelRegistry

    from fcsd.serving.served_families import SERVED_FAMILIES, UNSERVED_ARCHITECTURE
    from fcsd.serving.vllm import guard
    from fcsd.serving.vllm.exported_configs import register_configs

    guard.install()  # every config vLLM loads is checked: FarSkip wiring is never served as the stock one
    for family in SERVED_FAMILIES:
        ModelRegistry.register_model(
            family.farskip_architecture, f"fcsd.serving.vllm.models:{family.farskip_architecture}"
        )
    ModelRegistry.register_model(UNSERVED_ARCHITECTURE, f"fcsd.serving.vllm.models:{UNSERVED_ARCHITECTURE}")
    register_configs()
