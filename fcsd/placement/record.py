"""Routing capture (second paper, Sec. II-B): forward hooks on every MoE layer's router record each token's top-k
expert ids and weights while the model reads text.

Works on stock and FarSkip-converted models alike: both call the same router module once per MoE layer and
forward pass (a converted layer calls it through its routed-expert adapter). Dense layers have no router and are
skipped. The family specifics (where the router is, how to read its output: the same reader the family's ``route``
adapter uses) come from the family table (:mod:`fcsd.connectivity.families`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from fcsd.connectivity.families import family_for_config, moe_blocks, text_config
from fcsd.placement.traces import Routes, model_fingerprint


def routes_header(model: nn.Module, name: str | None = None) -> dict:
    """The model part of a routes header: family, MoE layers, experts, top-k, fingerprint, applied placement."""
    family = family_for_config(model.config)
    blocks = moe_blocks(model, family)
    if not blocks:
        raise ValueError(f"{name or type(model).__name__} has no MoE layer: there are no routes to record")
    first = next(iter(blocks.values()))
    num_experts = family.router(first).weight.shape[0]
    cfg = text_config(model.config)
    top_k = int(getattr(cfg, family.top_k_attr))
    layers = sorted(blocks)
    placement = (getattr(model.config, "farskip", None) or {}).get("placement")
    return {
        "model": name or getattr(model.config, "_name_or_path", "") or type(model).__name__,
        "model_type": family.model_type,
        "model_fingerprint": model_fingerprint(family.model_type, layers, num_experts, top_k, cfg.hidden_size),
        "layers": layers,
        "num_experts": int(num_experts),
        "top_k": top_k,
        "hidden_size": int(cfg.hidden_size),
        "routing_groups": family.routing_groups(model.config),
        "placement": placement,
    }


class RouteRecorder:
    """Context manager: while active, every router call of ``model`` appends its top-k ids/weights per MoE layer.

    ``recorder.routes()`` stacks what was captured, layer by layer, in call order.
    """

    def __init__(self, model: nn.Module):
        self.family = family_for_config(model.config)
        self.blocks = moe_blocks(model, self.family)
        self.ids: dict[int, list[torch.Tensor]] = {index: [] for index in self.blocks}
        self.weights: dict[int, list[torch.Tensor]] = {index: [] for index in self.blocks}
        self._handles = []

    def __enter__(self) -> RouteRecorder:
        for index, block in self.blocks.items():
            router = self.family.router(block)
            self._handles.append(router.register_forward_hook(self._hook(index)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, index: int):
        def hook(router, inputs, output):
            ids, weights = self.family.read_topk(router, output)
            self.ids[index].append(ids.detach().to("cpu", torch.int32))
            self.weights[index].append(weights.detach().to("cpu", torch.float16))

        return hook

    def routes(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, weights)`` of shape ``(L, T, k)``."""
        ids = np.stack([torch.cat(self.ids[i]).numpy() for i in sorted(self.blocks)])
        weights = np.stack([torch.cat(self.weights[i]).float().numpy() for i in sorted(self.blocks)])
        return ids, weights


def _text_runner(model: nn.Module) -> nn.Module:
    # a multimodal Llama-4 reads text through its language model (its own forward needs image inputs in 5.x)
    runner = getattr(model, "language_model", None)
    if isinstance(runner, nn.Module) and hasattr(runner, "get_output_embeddings"):
        return runner
    return model


@torch.no_grad()
def record_routes(
    model: nn.Module,
    input_ids: torch.Tensor,
    batch_size: int = 8,
    progress: bool = False,
    name: str | None = None,
) -> Routes:
    """Run ``model`` over the token rows ``input_ids`` ``(n, seq_len)`` and return their :class:`Routes`.

    Batched, on the model's device, in eval mode; only the last position's logits are computed. The header has
    the model part of :func:`routes_header` plus ``seq_len``; the caller adds the data part.
    """
    header = routes_header(model, name)
    runner = _text_runner(model)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    batches: Iterable = range(0, input_ids.shape[0], batch_size)
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc="routes", unit="batch")
    try:
        with RouteRecorder(model) as recorder:
            for start in batches:
                batch = input_ids[start : start + batch_size].to(device)
                runner(input_ids=batch, use_cache=False, logits_to_keep=1)
    finally:
        model.train(was_training)
    ids, weights = recorder.routes()
    expected = input_ids.numel()
    if ids.shape[1] != expected:
        raise RuntimeError(f"captured {ids.shape[1]} routed tokens per layer for {expected} input tokens")
    header["seq_len"] = int(input_ids.shape[1])
    return Routes(ids, header, weights)
