"""The routed experts in the compute dtype (design: "Precision"; paper Sec. 5.1 trains in bf16).

transformers' experts kernels read the experts' weights as stored: ``grouped_mm`` (the default) is not an autocast
op and casts its *input* to the weight's dtype, so fp32 master weights ran every expert matmul in fp32 under bf16
autocast, off the tensor cores, wherever FSDP2's mixed precision did not cast them first (one process, DDP, every EP
layout without ``parallel.fsdp``). :func:`experts_in_compute_dtype` gives each experts module of a model a class whose
forward reads its weights cast once to the autocast dtype (as autocast casts an ``nn.Linear``'s weight), whatever
kernel ``experts_implementation`` names; outside autocast, or with weights already in that dtype (FSDP2's
``param_dtype``, a bf16 teacher), it is the stock forward. The cast is differentiable: gradients reach the fp32
masters in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from fcsd.connectivity.adapters import in_compute_dtype

_CLASSES: dict[type, type] = {}


class _CastView:
    """``module`` as its forward sees it, with some attributes (its weights) replaced."""

    def __init__(self, module: nn.Module, replaced: dict[str, torch.Tensor]):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_replaced", replaced)

    def __getattr__(self, name):
        replaced = object.__getattribute__(self, "_replaced")
        return replaced[name] if name in replaced else getattr(object.__getattribute__(self, "_module"), name)


def _compute_dtype_class(stock: type) -> type:
    if stock not in _CLASSES:
        stock_forward = stock.forward

        def forward(self, *args, **kwargs):
            cast = in_compute_dtype(self)
            return stock_forward(_CastView(self, cast) if cast else self, *args, **kwargs)

        # named so that pickle finds it again (module __getattr__ below): Qwen3MoeExperts keeps its __name__
        qualname = f"InComputeDtype__{stock.__module__.replace('.', '__')}__{stock.__qualname__}"
        attributes = {"forward": forward, "_fcsd_stock_class": stock, "__qualname__": qualname}
        _CLASSES[stock] = type(stock.__name__, (stock,), attributes)
    return _CLASSES[stock]


def __getattr__(name: str) -> type:
    """The compute-dtype class of a stock experts class by its pickled name (``InComputeDtype__<module>__<class>``)."""
    import importlib

    prefix = "InComputeDtype__"
    if not name.startswith(prefix):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, stock = name[len(prefix) :].rpartition("__")
    return _compute_dtype_class(getattr(importlib.import_module(module.replace("__", ".")), stock))


def is_experts_module(module: nn.Module) -> bool:
    """A routed-experts module whose forward runs transformers' experts kernels (``use_experts_implementation``)."""
    return hasattr(module, "is_transposed") and hasattr(module, "has_gate") and hasattr(module, "_apply_gate")


def experts_in_compute_dtype(model: nn.Module) -> int:
    """Give every experts module of ``model`` the compute-dtype forward (see the module docstring); returns how many.
    Idempotent; state dicts, FSDP2 and the expert-parallel runtime see the same module."""
    count = 0
    for module in model.modules():
        if is_experts_module(module) and not hasattr(type(module), "_fcsd_stock_class"):
            module.__class__ = _compute_dtype_class(type(module))
            count += 1
    return count
