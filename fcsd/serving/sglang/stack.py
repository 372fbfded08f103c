"""FarSkip connectivity as SGLang's layer loop (paper Sec. 3 and 4.2; design §2, §7).

SGLang 0.5.2x leaves each layer's attention output and MoE output unreduced and lets "layer boundaries" reduce,
add and normalise them between layers. A FarSkip model runs its own loop instead, over the stock layers' modules
(attention, norms, MLP / MoE: SGLang's kernels, weights and tensor parallelism unchanged), holding the two streams
of the paper: the partial stream ``n`` and the routed output ``routed_k`` whose sum is the full stream ``o``::

    converted layer k:  a_k = attn_k(norm1(n_{k-1}))          attention reads the partial stream
                        o_{k-1} = n_{k-1} + routed_{k-1}       routed_{k-1}'s all-reduce waited here, behind a_k
                        n_k = o_{k-1} + a_k + shared_k(norm2(o_{k-1}))
                        routed_k = experts_k(norm2(o_{k-1}))   its all-reduce started now (Sec. 4.2)
    stock layer k:      h = o_{k-1} + attn_k(norm1(o_{k-1})),  n_k = o_k = h + mlp_k(norm2(h))

A converted dense layer counts its MLP as ``shared_k``. ``routed_k``'s all-reduce is started at the end of layer k
and waited in layer k+1 after its attention when layer k+1 is converted and the overlap is on
(:mod:`fcsd.serving.routed_allreduce`: gloo's async all-reduce on CPU, a side stream with events on GPUs);
otherwise it is reduced at once (the blocking reference).
"""

from __future__ import annotations

import torch

from fcsd.serving.routed_allreduce import STATS, start_routed, wait_routed
from fcsd.serving.sglang.families import reduced

STATS_DIR = "FCSD_OVERLAP_STATS_DIR"  # where each process writes its overlap counts after a forward (tests, benchmarks)


def write_stats(folder: str | None) -> None:
    """This process's counts of routed all-reduces started, waited and reduced at once, as ``<folder>/<pid>.json``
    (SGLang's RPC returns no values, so the tests and the GPU check read these files); nothing without a folder."""
    if folder:
        import json
        import os

        path = os.path.join(folder, f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as stream:
            json.dump(STATS, stream)
        os.replace(path + ".tmp", path)


def blocking_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """SGLang's own tensor-parallel all-reduce, where its stock layer boundary issues it."""
    return reduced(tensor, True)


class LayerPlan:
    """What the loop needs to know about one layer, fixed when the model is built."""

    def __init__(self, index: int, converted: bool, moe: bool, start_key: str | None, wait_key: str | None):
        self.index, self.converted, self.moe = index, converted, moe
        self.start_key = start_key  # routed_k's all-reduce is started under this key (the successor waits for it)
        self.wait_key = wait_key  # routed_{k-1}'s started all-reduce is waited under this key


class StackPlan:
    """The layers of one model, the family's sub-block calls, and whether their outputs need a sum (TP > 1)."""

    def __init__(self, layers: list[LayerPlan], calls, unreduced: bool):
        import os

        self.layers, self.calls, self.unreduced = layers, calls, unreduced
        self.stats_dir = os.environ.get(STATS_DIR)  # read once: the forward only writes there when it is set


def _mlp_parts(plan: StackPlan, step: LayerPlan, mlp, x, forward_batch):
    """``(complete part, routed part or None)`` of layer ``step``'s MLP on ``x``: a dense MLP is all complete; a MoE
    block's shared part is complete and its routed part is this rank's partial sum."""
    if not step.moe:
        return reduced(plan.calls.dense(mlp, x, forward_batch), plan.unreduced), None
    return plan.calls.shared_and_routed(mlp, x, forward_batch, plan.unreduced)


def run_layers(model, plan: StackPlan, hidden: torch.Tensor, positions, forward_batch) -> torch.Tensor:
    """The FarSkip layer loop of ``model`` (SGLang's inner model: ``layers``, ``norm``) from the embeddings
    ``hidden``; returns the final norm's output."""
    calls, unreduced = plan.calls, plan.unreduced
    extras = calls.per_forward(model, positions, forward_batch)
    partial, routed = hidden, None  # n_{-1} = o_{-1} = the embeddings; routed: routed_{k-1}, not yet in n
    for step in plan.layers:
        layer = model.layers[step.index]
        if not step.converted:  # the stock equations on o_{k-1}
            full = partial if routed is None else partial + routed
            attn_in = layer.input_layernorm(full)
            mid = full + reduced(calls.attention(layer, positions, attn_in, forward_batch, extras), unreduced)
            complete, routed_part = _mlp_parts(
                plan, step, layer.mlp, layer.post_attention_layernorm(mid), forward_batch
            )
            partial = mid if complete is None else mid + complete  # n_k = o_k
            if routed_part is not None:
                partial = partial + reduced(routed_part.reshape(partial.shape), unreduced)
            routed = None
            continue
        attn_in = layer.input_layernorm(partial)  # n_{k-1}: without routed_{k-1}
        attn = reduced(calls.attention(layer, positions, attn_in, forward_batch, extras), unreduced)
        if routed is not None and step.wait_key is not None:
            routed = wait_routed(routed, attn, step.wait_key)  # its all-reduce ran behind this attention
        full = partial if routed is None else partial + routed  # o_{k-1}
        complete, routed_part = _mlp_parts(plan, step, layer.mlp, layer.post_attention_layernorm(full), forward_batch)
        partial = full + attn if complete is None else full + attn + complete  # n_k
        routed = None
        if routed_part is not None:
            routed = routed_part.reshape(partial.shape).contiguous()
            if step.start_key is not None:
                start_routed(routed, step.start_key)  # layer k+1 waits for it after its attention
            elif unreduced:
                routed = blocking_all_reduce(routed)
    write_stats(plan.stats_dir)
    return model.norm(partial if routed is None else partial + routed)
