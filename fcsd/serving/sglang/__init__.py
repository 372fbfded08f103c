"""The SGLang model plugin for FarSkip exports (paper Sec. 4.2, 6.2; design §7).

SGLang calls :func:`register` through the ``sglang.srt.plugins`` entry point in every process it starts. It
registers, for each family SGLang serves (:data:`fcsd.serving.served_families.SGLANG_FAMILIES`), a model class
``FarSkip<stock architecture>`` (SGLang's stock class whose layer stack runs FarSkip connectivity,
:mod:`fcsd.serving.sglang.models`), a class that refuses in one line for every other FarSkip name an export may
carry, and a config class for each exported model type ``farskip_<stock type>``
(:mod:`fcsd.serving.sglang.exported_configs`), so ``python -m sglang.launch_server --model-path EXPORT`` needs no
remote code. ``FCSD_SGLANG_PLUGIN=0`` leaves SGLang as it is (comparisons): it then refuses an export (its model
type is not a stock one); with ``--trust-remote-code`` SGLang 0.5.23 refuses it too (its transformers backend finds
no class for the export's architecture), never serving stock wiring. Importing this package imports neither SGLang
nor the rest of fcsd.
"""

from __future__ import annotations

import os

SWITCH = "FCSD_SGLANG_PLUGIN"  # "0" switches the registration off


def enabled() -> bool:
    return os.environ.get(SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def register() -> None:
    """SGLang's plugin hook: register the FarSkip model and config classes (idempotent)."""
    if not enabled():
        return
    from sglang.srt.models.registry import ModelRegistry

    from fcsd.serving.sglang.exported_configs import register_configs
    from fcsd.serving.sglang.models import model_classes, torch_native_mla

    register_configs()
    ModelRegistry.models.update(model_classes())
    torch_native_mla()
