"""FarSkip-Collective connectivity (paper Sec. 3): layer specs, the family registry, apply/remove, loading."""

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
