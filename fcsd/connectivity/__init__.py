"""FarSkip-Collective connectivity (paper Sec. 3): layer specs, the family registry and its adapters, apply/remove,
and the config-only summary of ``fcsd inspect``. Single-device code: exports ship copies of these modules."""

from fcsd.connectivity.families import FAMILIES, MoEFamily, UnsupportedModelError, family_for_config
from fcsd.connectivity.layer_spec import format_layers, parse_layer_spec
from fcsd.connectivity.patch import apply_farskip, farskip_layers, remove_farskip

__all__ = [
    "FAMILIES",
    "MoEFamily",
    "UnsupportedModelError",
    "apply_farskip",
    "family_for_config",
    "farskip_layers",
    "format_layers",
    "parse_layer_spec",
    "remove_farskip",
]
