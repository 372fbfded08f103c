"""fcsd: FarSkip-Collective conversion, self-distillation and expert-parallel tooling for Hugging Face MoE models.

The public functions load lazily (PEP 562): ``import fcsd`` imports nothing heavy, so that a serving engine's plugin
(:mod:`fcsd.serving`) runs under the engine's own transformers without the rest of fcsd."""

__version__ = "0.1.0"

_PUBLIC = {
    "apply_farskip": "fcsd.connectivity",
    "farskip_layers": "fcsd.connectivity",
    "parse_layer_spec": "fcsd.connectivity",
    "remove_farskip": "fcsd.connectivity",
    "from_pretrained": "fcsd.loading",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'fcsd' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
