"""An independent, hand-written implementation of the FarSkip equations (design §2) for the tests.

It uses only the stock sub-modules' own forwards: the routed-expert output is *derived* as ``mlp(x) - shared(x)``
from the stock MoE block, so it shares no code with fcsd's adapters. Per-layer masks and rotary embeddings are
captured from a stock forward pass (they do not depend on the residual streams).
"""

from __future__ import annotations

import torch


def causal_lm(model):
    return model.language_model if hasattr(model, "language_model") else model


def decoder_layers(model):
    return causal_lm(model).model.layers


def mlp_of(layer):
    return layer.feed_forward if hasattr(layer, "feed_forward") else layer.mlp


def is_moe(mlp) -> bool:
    return hasattr(mlp, "experts")


def shared_of(mlp, x):
    """The shared-expert output of a stock MoE block (zero where the family has none)."""
    if hasattr(mlp, "shared_experts"):  # DeepSeek
        return mlp.shared_experts(x)
    if hasattr(mlp, "shared_expert_gate"):  # Qwen2-MoE
        return torch.sigmoid(mlp.shared_expert_gate(x)) * mlp.shared_expert(x)
    if hasattr(mlp, "shared_expert"):  # Llama-4
        return mlp.shared_expert(x)
    return torch.zeros_like(x)


def router_logits_of(mlp, x):
    flat = x.reshape(-1, x.shape[-1])
    return mlp.router(flat)[1] if hasattr(mlp, "router") else mlp.gate(flat)[0]


def capture_layer_kwargs(model, input_ids):
    captured = []
    handles = [
        layer.register_forward_pre_hook(lambda m, a, kw: captured.append(kw), with_kwargs=True)
        for layer in decoder_layers(model)
    ]
    try:
        with torch.no_grad():
            causal_lm(model)(input_ids=input_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return captured


@torch.no_grad()
def farskip_reference(model, input_ids, converted):
    """Logits, the full stream after each layer, and router logits of MoE layers, for the stock ``model``."""
    lm = causal_lm(model)
    kwargs = capture_layer_kwargs(model, input_ids)
    o = n = lm.model.embed_tokens(input_ids)
    fulls, routers = [], []
    for k, layer in enumerate(decoder_layers(model)):
        kw = kwargs[k]
        mlp = mlp_of(layer)
        if k in converted:
            attn = layer.self_attn(
                hidden_states=layer.input_layernorm(n),
                attention_mask=kw["attention_mask"],
                position_embeddings=kw["position_embeddings"],
            )[0]
            x = layer.post_attention_layernorm(o)
            whole = mlp(x)
            whole = (whole[0] if isinstance(whole, tuple) else whole).view(x.shape)
            shared = shared_of(mlp, x) if is_moe(mlp) else whole
            routed = whole - shared
            n_new = o + attn + shared
            o_new = n_new + routed
        else:
            x = None
            o_new = layer(o, **kw)
            n_new = o_new
        if is_moe(mlp):
            if x is None:  # a regular layer's MLP input: the residual after its attention
                attn = layer.self_attn(
                    hidden_states=layer.input_layernorm(o),
                    attention_mask=kw["attention_mask"],
                    position_embeddings=kw["position_embeddings"],
                )[0]
                x = layer.post_attention_layernorm(o + attn)
            routers.append(router_logits_of(mlp, x))
        o, n = o_new, n_new
        fulls.append(o)
    return lm.lm_head(lm.model.norm(o)), fulls, routers
