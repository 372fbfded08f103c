"""FarSkip connectivity inside vLLM's layer loop (paper Sec. 3 and 4.2; design §2, §7).

vLLM's decoder layers pass ``(hidden, residual)`` whose sum is the full residual stream; a stock layer returns
``(mlp_out_k, h_k)`` and the next layer's fused add+norm forms ``o_k`` from them. A converted layer returns
``(routed_k, n_k)`` instead, whose sum is again ``o_k = n_k + routed_k``, so stock layers and the final norm need
no change; the next *converted* layer reads ``n_k`` alone for its attention and forms ``o_k`` only for its MoE
input::

    attn_in_k = norm(n_{k-1})                          n_{k-1} = residual (previous layer converted)
    mlp_in_k  = norm(o_{k-1})                          o_{k-1} = hidden + residual
    n_k = o_{k-1} + attn_k + shared_k                  returned as (routed_k, n_k)

After a stock layer (or at the first layer) ``n_{k-1} = o_{k-1}``. A converted dense layer counts its MLP as
``shared_k`` and returns ``(0, n_k)``. With the overlap on, ``routed_k``'s all-reduce is started at the end of layer
k under layer k's key and waited under that key by layer k+1 after its attention (keys fixed when the model is
built, so a compiled graph holds the same pairs, see :mod:`fcsd.serving.routed_allreduce`); a layer whose successor
is not converted, or is the last on this pipeline stage, reduces its own at once.
"""

from __future__ import annotations

import torch

from fcsd.serving.routed_allreduce import start_routed, wait_routed
from fcsd.serving.vllm.moe import shared_and_routed


class LayerWiring:
    """What a converted layer needs to know about its neighbours, fixed when the model is built."""

    def __init__(
        self, index: int, after_converted: bool, hands_over: bool, mlp_attr: str, attention, overlap, waits=None
    ):
        self.index = index
        self.after_converted = after_converted  # residual is n_{k-1} (else the stream's two parts sum to n = o)
        self.hands_over = hands_over  # the next layer is converted and on this stage: it may wait for routed_k
        self.mlp_attr = mlp_attr
        self.attention = attention  # (layer, positions, x, *extra) -> attention output
        self.overlap = overlap  # a RoutedAllReduce, or None for the blocking reference
        # with the overlap: the key this layer starts routed_k under (when it hands over), the one it waits for
        self.start_key = overlap.key(index) if overlap is not None and hands_over else None
        # waits: the predecessor may have started one (None: whenever it is converted)
        waits = after_converted if waits is None else waits
        self.wait_key = overlap.key(index - 1) if overlap is not None and waits else None


def is_moe_block(mlp) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp.experts, "moe_config")


class FarSkipDecoderLayerMixin:
    """Placed before vLLM's stock decoder-layer class in a generated subclass; weights and submodules unchanged."""

    _farskip: LayerWiring

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None, *extra):
        wiring = self._farskip
        if residual is None:  # the first layer: n = o = embeddings
            full = hidden_states
            attn_in = self.input_layernorm(hidden_states)
        elif wiring.after_converted:  # (routed_{k-1}, n_{k-1})
            full = None
            attn_in = self.input_layernorm(residual)
        else:  # a stock predecessor: n_{k-1} = o_{k-1} = hidden + residual (fused add+norm, in place)
            attn_in, full = self.input_layernorm(hidden_states, residual)
        attn_out = wiring.attention(self, positions, attn_in, *extra)
        if full is None:
            if wiring.wait_key is not None:  # routed_{k-1}'s all-reduce ran behind this attention
                hidden_states = wait_routed(hidden_states, attn_out, wiring.wait_key)
            mlp_in, full = self.post_attention_layernorm(hidden_states, residual)  # o_{k-1}; n_{k-1} is dead
        else:
            mlp_in = self.post_attention_layernorm(full)
        mlp = getattr(self, wiring.mlp_attr)
        partial = full + attn_out
        if not is_moe_block(mlp):
            partial = partial + mlp(mlp_in)  # a dense MLP counts as shared
            return torch.zeros_like(partial), partial
        shared, routed, needs_all_reduce = shared_and_routed(mlp, mlp_in)
        if shared is not None:
            partial = partial + shared
        routed = routed.reshape(partial.shape)
        if needs_all_reduce and wiring.start_key is not None:
            routed = routed.contiguous()
            start_routed(routed, wiring.start_key)  # layer k+1 waits for it after its attention
        elif needs_all_reduce:
            routed = blocking_all_reduce(routed)
        return routed, partial


def blocking_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """The reference: vLLM's own tensor-parallel all-reduce, where the stock MoE layer issues it."""
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(tensor)


def default_attention(layer, positions, x, *extra):
    return layer.self_attn(positions=positions, hidden_states=x)


def deepseek_attention(layer, positions, x, *extra):
    """DeepSeek's decoder layer passes ``llama_4_scaling`` to MLA / GQA attention, not to plain MHA."""
    if layer.use_mha:
        return layer.self_attn(positions, x)
    return layer.self_attn(positions, x, *extra)
