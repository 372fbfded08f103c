"""A vLLM MoE block's output as its two parts, ``shared_k`` and ``routed_k`` (design §2), from vLLM's own kernels.

vLLM's ``MoERunner.forward`` runs the router, the fused routed experts and the shared experts, then adds the two
outputs and all-reduces the sum. A FarSkip layer needs them apart (``shared_k`` joins the partial stream ``n_k``,
``routed_k`` only the full stream ``o_k``), so :func:`shared_and_routed` follows the runner's own steps up to that
sum and stops there: the same custom op, kernels and expert-parallel dispatch, the shared part all-reduced, the routed
part returned for the caller to all-reduce (blocking or overlapped). It uses the runner's internals of the pinned
vLLM release; :func:`check_runner` refuses a runner whose features this does not cover.
"""

from __future__ import annotations

import torch

_RUNNER_INTERNALS = (
    "_forward_entry",
    "_encode_layer_name",
    "_maybe_pad_hidden_states",
    "_maybe_apply_routed_scale_to_output",
    "_fused_output_is_reduced",
    "apply_routed_input_transform",
)


def check_runner(runner, layer_index: int, dtype: torch.dtype) -> None:
    """Refuse, in one line, a MoE runner whose output :func:`shared_and_routed` cannot split exactly."""
    missing = [name for name in _RUNNER_INTERNALS if not hasattr(runner, name)]
    where = f"FarSkip layer {layer_index}"
    if missing:
        raise ValueError(f"{where}: this vLLM's MoERunner lacks {', '.join(missing)}; use the vLLM release in README")
    unsupported = {
        "a routed input/output transform (latent MoE)": runner.routed_input_transform is not None
        or runner.routed_output_transform is not None,
        "sequence-parallel MoE": runner.moe_config.is_sequence_parallel,
        "a zero-expert router": type(runner.router).__name__ == "ZeroExpertRouter",
        "float16 with a routed scaling factor (use bfloat16)": dtype == torch.float16
        and runner.routed_scaling_factor != 1.0,
    }
    for feature, present in unsupported.items():
        if present:
            raise ValueError(f"{where}: FarSkip serving does not support {feature}")


def router_logits(block, x: torch.Tensor) -> torch.Tensor:
    """The router logits the block passes its runner (a runner holding the gate computes them itself)."""
    if block.experts.gate is not None:
        return x
    gate = getattr(block, "gate", None) or block.router
    return gate(x)[0]


def shared_and_routed(block, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, bool]:
    """``(shared_k, routed_k, routed_needs_all_reduce)`` of the MoE ``block`` on rows ``x`` (tokens, hidden):
    ``shared_k`` is complete (all-reduced over tensor parallelism), ``routed_k`` is this rank's partial sum unless
    the kernel already reduced it."""
    from vllm.distributed import tensor_model_parallel_all_reduce

    runner = block.experts
    logits = router_logits(block, x)
    hidden, shared_input = runner.apply_routed_input_transform(x)
    hidden, trim_routed, trim_output = runner._maybe_pad_hidden_states(shared_input, hidden)
    unpadded = runner.moe_config.hidden_dim_unpadded if runner._quant_method.has_unpadded_output else 0
    result = runner._forward_entry(hidden, logits, shared_input, None, runner._encode_layer_name(), unpadded)
    shared, routed = result if isinstance(result, tuple) else (None, result)
    for trim in (trim_routed, trim_output):
        if trim is not None:
            routed = routed[..., :trim]
    reduced = runner._fused_output_is_reduced
    shared, routed = runner._maybe_apply_routed_scale_to_output(shared, routed)
    if shared is not None:
        shared = tensor_model_parallel_all_reduce(shared)
    config = runner.moe_config
    needs_all_reduce = not reduced and (config.tp_size > 1 or config.ep_size > 1)
    return shared, routed, needs_all_reduce
