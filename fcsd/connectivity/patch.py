"""Apply and remove FarSkip-Collective connectivity on a loaded Hugging Face model (paper Sec. 3, Fig. 2; design §2).

A converted decoder layer ``k`` reads two residual streams: ``o`` (full) and ``n`` (full minus the previous layer's
routed experts)::

    attn_in_k = n_{k-1}          partial: does not wait for routed_{k-1}
    mlp_in_k  = o_{k-1}          outdated: does not wait for attn_k
    n_k = o_{k-1} + attn_k + shared_k
    o_k = n_k + routed_k

How it is wired into an unmodified transformers model: the model's own layer loop passes only ``o`` from layer to
layer, so each converted layer hands ``n_k`` to the next one through a small per-model side channel
(:class:`_PartialStream`). The next layer takes it only if the tensor it receives *is* ``o_k`` (same object);
otherwise (first layer, a regular layer in between, a new forward pass) ``n = o``, which is exactly design §2's rule
that a regular layer has ``n_k = o_k`` and that ``n_0 = o_0``. Both streams enter the layer's ``forward`` as
positional tensors, so gradient checkpointing recomputes the layer from the right inputs.

A converted layer's class is swapped for a generated subclass (``FarSkip<Stock>DecoderLayer``) and swapped back by
:func:`remove_farskip`; parameters, buffers, state-dict keys and hooks are untouched.
"""

from __future__ import annotations

import threading
import types
import weakref

import torch
from torch import nn

from fcsd.connectivity.families import MoEFamily, family_for_config, find_decoder_layers
from fcsd.connectivity.layer_spec import format_layers, parse_layer_spec

CONFIG_KEY = "farskip"
KEPT_KEYS = ("placement",)  # parts of the config block that are not about connectivity (fcsd.placement)


class _PartialStream(threading.local):
    """Carries ``n_k`` from one converted layer to the next within one forward pass (per thread), and optionally a
    :class:`HandOver` still completing ``o_k`` (a schedule installed from outside may leave it pending)."""

    def __init__(self):
        self.full_ref = None
        self.partial = None
        self.pending = None

    def take(self, full: torch.Tensor):
        """``(n_{k-1}, pending)`` if ``full`` is the ``o_{k-1}`` handed over by the previous layer, else
        ``(full, None)``."""
        handed_over = self.full_ref is not None and self.full_ref() is full
        partial, pending = (self.partial, self.pending) if handed_over else (full, None)
        self.full_ref = self.partial = self.pending = None
        return partial, pending

    def hand_over(self, full: torch.Tensor, partial: torch.Tensor | None, pending=None) -> None:
        self.full_ref = weakref.ref(full) if partial is not None else None
        self.partial, self.pending = partial, pending


class StockSchedule:
    """The math of one converted layer (design §2), on one device; the seam of the expert-parallel runtime.

    A schedule is called as ``schedule(layer, o_prev, n_prev, **kwargs) -> (o_k, n_k, pending)``. ``fcsd.parallel``
    installs its own schedule object as ``layer._farskip_schedule`` (design §4: parallelism is injected from
    outside); such a schedule may return ``pending``: a :class:`HandOver`-like object whose ``complete()`` fills the
    returned ``o_k`` in place (``o_k = n_k + wait(Combine(k))``). The next converted layer receives it when its
    schedule has ``accepts_pending = True``; otherwise it is completed before that layer runs. ``o_k`` is the object
    the model's layer loop (and ``output_hidden_states``) sees, so once completed it reports the full stream.
    """

    accepts_pending = False

    def __call__(self, layer, hidden_states: torch.Tensor, partial_states: torch.Tensor, **kwargs):
        family = layer._farskip_family
        attn_out = layer.self_attn(hidden_states=layer.input_layernorm(partial_states), **kwargs)[0]
        mlp = getattr(layer, family.mlp_attr)
        shared, routed = family.split_mlp(mlp, layer.post_attention_layernorm(hidden_states))
        partial = hidden_states + attn_out.view(hidden_states.shape)
        if shared is not None:
            partial = partial + shared.view(hidden_states.shape)
        full = partial + routed.view(hidden_states.shape) if routed is not None else partial
        return full, partial, None


STOCK_SCHEDULE = StockSchedule()


class HandOver:
    """``o_k`` handed to the next layer before it is known: ``complete()`` writes ``n_k + routed_k`` into ``full``
    (the tensor already returned to the model's layer loop) once ``routed_k``, a callable, can be waited for."""

    def __init__(self, full: torch.Tensor, partial: torch.Tensor, routed):
        self.full, self.partial, self.routed = full, partial, routed

    def complete(self) -> torch.Tensor:
        if self.routed is not None:
            self.full.copy_(self.partial + self.routed().view(self.partial.shape))
            self.routed = None
        return self.full


class FarSkipLayerMixin:
    """Turns a stock decoder layer into a FarSkip one; placed before the stock class in the generated subclass."""

    _farskip_base: type
    _farskip_family: MoEFamily
    _farskip_stream: _PartialStream
    _farskip_feeds_next: bool
    _farskip_schedule = STOCK_SCHEDULE

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args:
            raise TypeError("a FarSkip decoder layer takes the hidden states as its only positional argument")
        partial, pending = self._farskip_stream.take(hidden_states)
        if pending is not None:
            if self._farskip_schedule.accepts_pending:
                kwargs["farskip_pending"] = pending
            else:
                pending.complete()
        full, partial, pending = super().__call__(hidden_states, partial, **kwargs)
        if pending is not None and not self._farskip_feeds_next:
            full, pending = pending.complete(), None
        self._farskip_stream.hand_over(full, partial if self._farskip_feeds_next else None, pending)
        return full

    def forward(self, hidden_states: torch.Tensor, partial_states: torch.Tensor, **kwargs):
        """Design §2 for one layer: returns ``(o_k, n_k, pending)`` from ``(o_{k-1}, n_{k-1})`` through the layer's
        schedule (:class:`StockSchedule` unless ``fcsd.parallel`` installed another)."""
        return self._farskip_schedule(self, hidden_states, partial_states, **kwargs)


_SUBCLASSES: dict[type, type] = {}


def _farskip_class(stock: type) -> type:
    """The generated FarSkip subclass of a stock decoder-layer class (cached; module-level so pickling works)."""
    if stock not in _SUBCLASSES:
        name = f"FarSkip{stock.__name__}"
        cls = type(name, (FarSkipLayerMixin, stock), {"_farskip_base": stock, "__module__": __name__})
        cls.__qualname__ = name
        globals()[name] = cls
        _SUBCLASSES[stock] = cls
    return _SUBCLASSES[stock]


def _rebind_accelerate_forward(layer: nn.Module) -> None:
    # accelerate's device-map hooks call a bound `_old_forward` captured when the hook was added; point it at the
    # forward of the layer's current class so that the class swap takes effect under `device_map=...` too.
    if hasattr(layer, "_hf_hook") and hasattr(layer, "_old_forward"):
        layer._old_forward = types.MethodType(type(layer).forward, layer)


def _check_own_forward(layer: nn.Module, index: int) -> None:
    # An instance attribute `forward` (set by another patching tool) wins over the swapped class, so the conversion
    # would silently have no effect: refuse it (accelerate's device-map wrapper is rebound instead, see above).
    if "forward" in layer.__dict__ and not hasattr(layer, "_hf_hook"):
        raise ValueError(
            f"decoder layer {index} has its own `forward` attribute (set by another patching tool), which would win "
            "over FarSkip connectivity: apply FarSkip before that tool, or remove it first (del layer.forward)"
        )


def _is_converted(layer: nn.Module) -> bool:
    """A FarSkip layer whose FarSkip forward is the one that runs (no instance `forward` shadows it)."""
    if not isinstance(layer, FarSkipLayerMixin):
        return False
    if "forward" not in layer.__dict__:
        return True
    return (
        hasattr(layer, "_hf_hook")
        and getattr(getattr(layer, "_old_forward", None), "__func__", None) is type(layer).forward
    )


def apply_farskip(model: nn.Module, layers="all") -> nn.Module:
    """Convert the decoder layers selected by ``layers`` to FarSkip connectivity, in place, keeping every weight.

    ``layers`` follows :mod:`fcsd.connectivity.layer_spec` (``"all"``, ``"last:50%"``, ``"0,3,5-7"``, a list...).
    Applying again replaces the previous selection. A selected layer whose instance carries its own ``forward``
    attribute (another patching tool's) is refused with a ``ValueError``, since it would shadow the conversion.
    The selection is recorded in ``model.config.farskip`` so that a saved checkpoint reloads with the same
    connectivity through :func:`fcsd.from_pretrained`. Returns ``model``.
    Implements paper Sec. 3 (Fig. 2) as specified in design §2.
    """
    family = family_for_config(model.config)
    decoder_layers = find_decoder_layers(model, family)
    selected = parse_layer_spec(layers, len(decoder_layers))
    for index in selected:
        _check_own_forward(decoder_layers[index], index)
    remove_farskip(model)
    kept = getattr(model.config, CONFIG_KEY, None) or {}
    stream = _PartialStream()
    chosen = set(selected)
    for index in selected:
        layer = decoder_layers[index]
        layer.__class__ = _farskip_class(type(layer))
        layer._farskip_family = family
        layer._farskip_stream = stream
        layer._farskip_feeds_next = index + 1 in chosen
        _rebind_accelerate_forward(layer)
    _name_no_split_modules(model)
    if selected:
        from fcsd import __version__

        record = {"layers": selected, "spec": format_layers(selected), "fcsd_version": __version__}
        setattr(model.config, CONFIG_KEY, {**kept, **record})
    return model


_STOCK_NO_SPLIT = "_farskip_stock_no_split"  # an instance's own _no_split_modules before conversion (or _ABSENT)
_ABSENT = object()


def _name_no_split_modules(model: nn.Module) -> None:
    """Name the FarSkip layer classes in ``_no_split_modules``, which accelerate's FSDP ``TRANSFORMER_BASED_WRAP``
    policy and device maps read by class name (accelerate refuses a name no module has: with every layer converted
    the stock layer class is gone, so an FSDP run could not start). Set on the instances, whose own value (if any:
    transformers' ``post_init`` sets one) :func:`remove_farskip` puts back."""
    present = {type(module).__name__ for module in model.modules()}
    for module in model.modules():
        stock = module.__dict__.get("_no_split_modules", getattr(type(module), "_no_split_modules", None))
        if not stock:
            continue
        names = []
        for name in stock:
            converted = f"FarSkip{name}"
            names += [n for n in (name, converted) if n in present] if converted in present else [name]
        if set(names) != set(stock):
            setattr(module, _STOCK_NO_SPLIT, module.__dict__.get("_no_split_modules", _ABSENT))
            module._no_split_modules = type(stock)(names) if isinstance(stock, (set, list, tuple)) else names


def _restore_no_split_modules(model: nn.Module) -> None:
    for module in model.modules():
        if _STOCK_NO_SPLIT not in module.__dict__:
            continue
        stock = module.__dict__.pop(_STOCK_NO_SPLIT)
        if stock is _ABSENT:
            module.__dict__.pop("_no_split_modules", None)
        else:
            module._no_split_modules = stock


def remove_farskip(model: nn.Module) -> nn.Module:
    """Restore the stock connectivity of every converted layer (bit-identical to the unconverted model).

    The config's ``farskip`` block loses its connectivity record; an expert placement recorded there stays (the
    weights keep their permuted order)."""
    for module in model.modules():
        if isinstance(module, FarSkipLayerMixin):
            module.__class__ = module._farskip_base
            for attr in ("_farskip_family", "_farskip_stream", "_farskip_feeds_next"):
                delattr(module, attr)
            module.__dict__.pop("_farskip_schedule", None)
            _rebind_accelerate_forward(module)
    _restore_no_split_modules(model)
    record = getattr(model.config, CONFIG_KEY, None)
    if record is not None:
        kept = {key: value for key, value in record.items() if key in KEPT_KEYS}
        if kept:
            setattr(model.config, CONFIG_KEY, kept)
        else:
            delattr(model.config, CONFIG_KEY)
    return model


def farskip_layers(model: nn.Module) -> list[int]:
    """Sorted indices of the decoder layers that currently have FarSkip connectivity (a converted layer whose
    FarSkip forward is shadowed by an instance ``forward`` attribute is not reported)."""
    family = family_for_config(model.config)
    return [i for i, layer in enumerate(find_decoder_layers(model, family)) if _is_converted(layer)]
