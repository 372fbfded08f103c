"""FarSkip faded in over a run's first steps (issue 37 item 3): a converted layer's inputs move from the stock
model's to FarSkip's, so the student starts as its teacher and meets the rewiring gradually.

With ``beta`` in [0, 1], layer ``k`` reads::

    attn_in_k = n_{k-1} + beta (o_{k-1} - n_{k-1})     beta = 1: o_{k-1}, the stock input; 0: FarSkip's partial one
    mlp_in_k  = o_{k-1} + beta attn_k                   beta = 1: the stock input; 0: FarSkip's outdated one

It is installed from outside, as the schedule of each converted layer (the seam ``fcsd.parallel`` uses), and
removed when ``beta`` reaches 0: from then on the layers run FarSkip's own schedule.
"""

from __future__ import annotations

import torch

from fcsd.connectivity.patch import STOCK_SCHEDULE, FarSkipLayerMixin, StockSchedule


class FadeInSchedule(StockSchedule):
    """The schedule of design §2 with the rewiring scaled by ``1 - beta`` (``beta = 0``: :class:`StockSchedule`)."""

    def __init__(self, beta: float = 1.0):
        self.beta = beta

    def __call__(self, layer, hidden_states: torch.Tensor, partial_states: torch.Tensor, **kwargs):
        if self.beta == 0:
            return STOCK_SCHEDULE(layer, hidden_states, partial_states, **kwargs)
        family = layer._farskip_family
        attn_in = torch.lerp(partial_states, hidden_states, self.beta)
        attn_out = layer.self_attn(hidden_states=layer.input_layernorm(attn_in), **kwargs)[0].view(hidden_states.shape)
        mlp = getattr(layer, family.mlp_attr)
        shared, routed = family.split_mlp(mlp, layer.post_attention_layernorm(hidden_states + self.beta * attn_out))
        partial = hidden_states + attn_out
        if shared is not None:
            partial = partial + shared.view(hidden_states.shape)
        full = partial + routed.view(hidden_states.shape) if routed is not None else partial
        return full, partial, None


def install_fade_in(model, beta: float) -> FadeInSchedule | None:
    """Give every converted layer of ``model`` one :class:`FadeInSchedule` at ``beta`` (None: no converted layer)."""
    layers = [m for m in model.modules() if isinstance(m, FarSkipLayerMixin)]
    if not layers:
        return None
    schedule = FadeInSchedule(beta)
    for layer in layers:
        layer._farskip_schedule = schedule
    return schedule


def remove_fade_in(model) -> None:
    """Back to FarSkip's own schedule in every converted layer."""
    for layer in model.modules():
        if isinstance(layer, FarSkipLayerMixin):
            layer.__dict__.pop("_farskip_schedule", None)
