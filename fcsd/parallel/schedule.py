"""The expert-parallel schedules of a decoder layer (paper Sec. 4.1 Fig. 4, Sec. 4.2; design §4).

:class:`FarSkipEPSchedule` is installed as ``layer._farskip_schedule`` in converted layers (the seam of
:mod:`fcsd.connectivity.patch`). With ``overlap=True`` a converted MoE layer ``k`` runs::

    attention part a (norm, q/k/v, rope)          <- inside the stock attention module
    between a and b:  wait Combine(k-1); route on o_{k-1}; launch Dispatch(k)
    attention part b (core attention, o_proj)
    wait Dispatch(k); routed experts; launch Combine(k); shared experts
    hand o_k = n_k + wait(Combine(k)) to layer k+1 pending (the last converted layer waits itself)

Attention is split without re-implementing any family's attention: every family calls
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager)`` right before its core kernel, so for the
duration of the attention call the *same* key is re-registered through ``transformers.AttentionInterface`` with a
wrapper that first runs the "between a and b" step, then the real kernel (the one registered before, or the family's
``eager_attention_forward``); masks and varlen paths, which pick their path by that key, are unchanged. If a family
never calls the interface the step runs after the attention (correct, just not overlapped).

In the all-reduce layout (inference, Sec. 4.2) routing needs no exchange: Combine(k-1) is waited after layer k's whole
attention. ``overlap=False`` (mode ``farskip_reference``) runs the same code with every wait immediate and o_k complete
at the end of each layer. :func:`ep_moe_forward` replaces the MoE block's forward in mode ``regular``.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from fcsd.connectivity.patch import HandOver
from fcsd.parallel import recompute
from fcsd.parallel.collectives import needs_backward
from fcsd.parallel.dispatchers import Dispatcher
from fcsd.parallel.events import record
from fcsd.parallel.segments import attention_core, segment


def run_routed(family, moe, dispatcher: Dispatcher, x_TD: torch.Tensor):
    """Route ``x_TD`` and launch Dispatch; returns ``(routing, dispatch pending)``. Whether the exchanges prepare a
    backward is decided by grad mode and the block's training state (the same on every rank)."""
    with segment("routing"):
        routing = family.route(moe, x_TD)
        pending = dispatcher.dispatch_async(
            routing.tokens,
            routing.topk_ids,
            routing.topk_weights,
            scale_inputs=family.weights_on_input,
            needs_backward=needs_backward(moe),
        )
    return routing, pending


def experts_then_combine(family, moe, dispatcher: Dispatcher, dispatch):
    """Wait Dispatch, run this rank's experts on the rows it received, launch Combine; returns its pending. Experts
    sharded by FSDP2 run through their ``fcsd_rows`` method (:func:`fcsd.parallel.layout.shard_fully`), which
    gathers their weights around the call."""
    rows = dispatch.wait()
    with segment("routed experts"):
        run = getattr(getattr(moe, family.experts_attr), "fcsd_rows", None)
        if run is not None:
            y_RD = run(rows.tokens, rows.expert_ids, rows.weights)
        else:
            y_RD = family.experts(moe, rows.tokens, rows.expert_ids, rows.weights)
        return dispatcher.combine_async(y_RD, dispatch)


class _AttentionSplit(threading.local):
    step = None  # the "between part a and part b" callable of the attention call in progress


_SPLIT = _AttentionSplit()
#: how often the "between a and b" step ran inside the attention call (split) or after it (family without the hook)
SPLIT_COUNTS = {"inside_attention": 0, "after_attention": 0}


def _kernel_wrapper(kernel):
    def between_then_kernel(*args, **kwargs):
        step, _SPLIT.step = _SPLIT.step, None
        if step is not None:
            SPLIT_COUNTS["inside_attention"] += 1
            step()
        record("attention", "", -1)
        attention_core()
        return kernel(*args, **kwargs)

    return between_then_kernel


@contextmanager
def attention_split(attention: torch.nn.Module, step):
    """Run ``step`` right before ``attention``'s core kernel (see the module docstring); restores the registry after."""
    key = attention.config._attn_implementation
    saved_global = AttentionInterface._global_mapping.get(key)
    saved_local = ALL_ATTENTION_FUNCTIONS._local_mapping.get(key)
    kernel = ALL_ATTENTION_FUNCTIONS.get(key) or sys.modules[type(attention).__module__].eager_attention_forward
    wrapper = _kernel_wrapper(kernel)
    AttentionInterface.register(key, wrapper)
    if saved_local is not None:  # a local override shadows the class-wide mapping
        ALL_ATTENTION_FUNCTIONS._local_mapping[key] = wrapper
    _SPLIT.step = step
    try:
        yield
    finally:
        _SPLIT.step = None
        if saved_global is not None:
            AttentionInterface.register(key, saved_global)
        else:
            AttentionInterface._global_mapping.pop(key, None)
        if saved_local is not None:
            ALL_ATTENTION_FUNCTIONS._local_mapping[key] = saved_local


def _refuse_checkpointing(layer) -> None:
    if layer.training and torch.is_grad_enabled() and not recompute.replays(layer):
        raise RuntimeError(
            "this activation checkpointing would recompute expert-parallel layers with their collectives, "
            "re-issued out of order across ranks: enable it with fcsd.parallel.recompute.enable(model) (which saves "
            "the exchanges' results and replays them) instead of model.gradient_checkpointing_enable()"
        )


class ReplayableHandOver(HandOver):
    """A :class:`~fcsd.connectivity.patch.HandOver` whose completion the recomputation of a checkpointed layer
    runs again (the same operations, nothing written), so that it rebuilds what the first completion saved
    (:mod:`fcsd.parallel.recompute`)."""

    def __init__(self, full, partial, combine):
        super().__init__(full, partial, combine.wait)
        self.combine = combine

    def complete(self) -> torch.Tensor:
        if self.routed is None and recompute.replaying():
            self.partial + self.combine.rerun().view(self.partial.shape)  # noqa: B018 (rebuilds the saved tensors)
            return self.full
        return super().complete()


class FarSkipEPSchedule:
    """A converted layer under expert parallelism (modes ``farskip_reference`` and ``farskip_overlap``)."""

    accepts_pending = True

    def __init__(self, dispatcher: Dispatcher, overlap: bool):
        self.dispatcher, self.overlap = dispatcher, overlap

    def __call__(self, layer, hidden_states, partial_states, farskip_pending=None, **kwargs):
        _refuse_checkpointing(layer)
        family = layer._farskip_family
        moe = getattr(layer, family.mlp_attr)
        shape = hidden_states.shape
        state = {}
        record("layer", "", getattr(layer.self_attn, "layer_idx", -1))

        def between():  # wait Combine(k-1); route on o_{k-1}; launch Dispatch(k)
            with segment("routing"):
                if farskip_pending is not None:
                    farskip_pending.complete()
                state["mlp_in"] = layer.post_attention_layernorm(hidden_states)
                if family.is_moe(moe):
                    state["routing"], state["dispatch"] = run_routed(
                        family, moe, self.dispatcher, state["mlp_in"].reshape(-1, shape[-1])
                    )

        attn_in = layer.input_layernorm(partial_states)
        if self.overlap and not self.dispatcher.routes_locally:
            with attention_split(layer.self_attn, between):
                attn_out = layer.self_attn(hidden_states=attn_in, **kwargs)[0]
        else:
            attn_out = layer.self_attn(hidden_states=attn_in, **kwargs)[0]
        if "mlp_in" not in state:
            SPLIT_COUNTS["after_attention"] += self.overlap and not self.dispatcher.routes_locally
            between()
        partial = hidden_states + attn_out.view(shape)
        if not family.is_moe(moe):  # a dense layer: its whole MLP counts as shared (design §2)
            with segment("shared experts"):
                partial = partial + moe(state["mlp_in"]).view(shape)
            return partial, partial, None
        combine = experts_then_combine(family, moe, self.dispatcher, state["dispatch"])
        if family.shared is not None:  # after the Combine launch: overlaps it
            with segment("shared experts"):
                partial = partial + family.shared(moe, state["mlp_in"]).view(shape)
            record("shared", "", -1)
        if self.overlap and layer._farskip_feeds_next:
            full = torch.empty_like(partial)
            return full, partial, ReplayableHandOver(full, partial, combine)
        return partial + combine.wait().view(shape), partial, None


def ep_moe_forward(family, moe, dispatcher: Dispatcher):
    """A MoE block forward with stock connectivity and blocking collectives (mode ``regular``): same return value as
    the stock block (Llama-4 returns ``(output, router_logits)``)."""

    def forward(hidden_states):
        shape = hidden_states.shape
        routing, dispatch = run_routed(family, moe, dispatcher, hidden_states.reshape(-1, shape[-1]))
        out = experts_then_combine(family, moe, dispatcher, dispatch).wait().view(shape)
        if family.shared is not None:
            with segment("shared experts"):
                out = out + family.shared(moe, hidden_states).view(shape)
        if family.model_type == "llama4_text":
            return out.reshape(-1, shape[-1]), routing.router_logits
        return out

    return forward
