"""How the FarSkip layer loop (:mod:`fcsd.serving.sglang.stack`) calls one family's SGLang sub-blocks: attention,
a dense MLP, and a MoE block split into its shared part (complete) and its routed part (this rank's partial sum),
each with SGLang's own kernels (design §7)."""

from __future__ import annotations

import importlib

import torch


def reduced(tensor: torch.Tensor, unreduced: bool) -> torch.Tensor:
    """``tensor`` summed over the tensor-parallel group when its producer left it unreduced."""
    if not unreduced:
        return tensor
    from sglang.srt.distributed.communication_op import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(tensor)


class Qwen3MoeCalls:
    """SGLang's ``qwen3_moe``: GQA attention with q/k norms, a MoE block of routed experts only."""

    def __init__(self, module):
        self.module = module

    def per_forward(self, model, positions, forward_batch):
        return None

    def attention(self, layer, positions, x, forward_batch, extras):
        return layer.self_attn(positions=positions, hidden_states=x, forward_batch=forward_batch)

    def is_moe(self, mlp) -> bool:
        return hasattr(mlp, "experts")

    def dense(self, mlp, x, forward_batch):
        return mlp(x)

    def shared_and_routed(self, mlp, x, forward_batch, unreduced: bool):
        return None, mlp.forward_normal(x)

    def producers(self, layer) -> list:
        """The sub-modules whose ``reduce_results`` says whether SGLang left their output unreduced."""
        mlp = layer.mlp
        return [layer.self_attn.o_proj, mlp.experts if self.is_moe(mlp) else mlp.down_proj]

    def check_layer(self, layer, index: int) -> None:
        """Refuse (one line) a layer SGLang built in a way the loop would sum or split wrongly."""
        where = f"FarSkip layer {index} in SGLang"
        for producer in self.producers(layer):
            if getattr(producer, "reduce_results", False):
                raise ValueError(
                    f"{where}: this SGLang reduces inside {type(producer).__name__}, which the FarSkip loop does not "
                    "expect: use the SGLang release in README"
                )
        mlp = layer.mlp
        if not self.is_moe(mlp) and getattr(mlp, "is_replicated", False):
            raise ValueError(
                f"{where}: a replicated dense MLP (--moe-dense-tp-size 1) is not covered: drop that option"
            )
        if self.is_moe(mlp) and getattr(mlp, "num_fused_shared_experts", 0):
            raise ValueError(
                f"{where}: shared experts fused into the routed kernel are not covered (FarSkip adds them to the "
                "partial stream): drop --enforce-shared-experts-fusion"
            )


class DeepseekCalls(Qwen3MoeCalls):
    """SGLang's ``deepseek_v2`` (DeepSeek-V2 and V3): MLA attention, shared experts, a routed scaling factor."""

    def per_forward(self, model, positions, forward_batch):
        # the scratch buffer SGLang's DeepSeek model hands its attention layers, two floats per layer
        return self.module.BumpAllocator(
            buffer_size=(model.end_layer - model.start_layer) * 2, dtype=torch.float32, device=positions.device
        )

    def attention(self, layer, positions, x, forward_batch, extras):
        attention, context = layer.self_attn, self.module.get_attn_tp_context()
        if attention.q_lora_rank is not None:  # MLA with a q LoRA reads its latent from inputs the boundary publishes
            from sglang.srt.layers.layer_boundary import AttentionInputs

            context.set_attn_inputs(AttentionInputs(x, forward_batch, attention.prepare_qkv_latent))
        try:
            with attention.maybe_use_decode_attn_tp(forward_batch):
                out = attention(
                    positions=positions,
                    hidden_states=x,
                    forward_batch=forward_batch,
                    zero_allocator=extras,
                    llama_4_scaling=None,
                    input_on_attn_tp_slices=False,
                    prev_topk_indices=None,
                )
        finally:
            context.clear_attn_inputs()
        return out[0] if isinstance(out, tuple) else out

    def shared_and_routed(self, mlp, x, forward_batch, unreduced: bool):
        out = mlp(x, forward_batch, None, return_moe_output=True)
        if not isinstance(out, self.module.MoEOutput) or not isinstance(out.routed, torch.Tensor):
            raise ValueError(
                "FarSkip serving needs SGLang's DeepSeek MoE split into shared and routed parts, which this path "
                "(fused CPU AMX, or a GPU kernel that defers its finalize) does not give: serve without that backend"
            )
        routed = self.module.maybe_fuse_routed_scale_and_shared_add(
            out.experts, out.routed, None, out.routed_scaling_factor
        )
        shared = out.shared
        if shared is not None and not out.shared_is_replicated:
            shared = reduced(shared, unreduced)
        return shared, routed

    def producers(self, layer) -> list:
        mlp = layer.mlp
        found = super().producers(layer)
        shared = getattr(mlp, "shared_experts", None) if self.is_moe(mlp) else None
        return found + ([shared.down_proj] if shared is not None else [])


CALLS = {"qwen3_moe": Qwen3MoeCalls, "deepseek_v2": DeepseekCalls}


def calls_for(family):
    """The calls of ``family`` (a :class:`~fcsd.serving.served_families.ServedFamily` SGLang serves)."""
    module = importlib.import_module("sglang.srt.models." + family.sglang)
    return CALLS[family.sglang](module)
