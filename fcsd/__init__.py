"""fcsd: FarSkip-Collective conversion, self-distillation and expert-parallel tooling for Hugging Face MoE models."""

__version__ = "0.1.0"

from fcsd.connectivity import apply_farskip, farskip_layers, parse_layer_spec, remove_farskip  # noqa: E402
from fcsd.loading import from_pretrained  # noqa: E402

__all__ = ["__version__", "apply_farskip", "farskip_layers", "from_pretrained", "parse_layer_spec", "remove_farskip"]
