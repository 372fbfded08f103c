"""``generate`` under expert parallelism, correct by construction (paper Sec. 4.2; design §4).

Every decoding step of an expert-parallel model is a collective: each rank must run the same number of forwards.

- Layout ``all_to_all`` (each rank its own prompts): ranks that finish early keep running forwards, without
  producing tokens, until every rank is done (transformers' ``synced_gpus``).
- Layout ``all_reduce`` (every rank the same tokens): the prompt comes from rank 0 of the group, and so do the scores
  each step's token is chosen from (broadcast after the logits processors) and the sampling seed, so every rank picks
  the same token even when a kernel differs in its last bit on one rank. Sampling therefore follows rank 0's seed.

:func:`install` makes ``model.generate`` do this (:func:`fcsd.parallel.expert_parallel` calls it).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from transformers import LogitsProcessor, LogitsProcessorList


class _RankZeroScores(LogitsProcessor):
    """Replaces every rank's scores with rank 0's (runs last among the logits processors the caller passes)."""

    def __init__(self, group):
        self.group, self.src = group, _source(group)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.contiguous()
        dist.broadcast(scores, src=self.src, group=self.group)
        return scores


def _source(group) -> int:
    return dist.get_global_rank(group, 0) if group is not None else 0


def _broadcast(tensor: torch.Tensor | None, group) -> torch.Tensor | None:
    """Rank 0's tensor on every rank of ``group`` (shape included)."""
    if tensor is None:
        return None
    src = _source(group)
    shape = torch.tensor([tensor.dim(), *tensor.shape, *[0] * (8 - tensor.dim())], device=tensor.device)
    dist.broadcast(shape, src=src, group=group)
    dims = int(shape[0])
    out = tensor if dist.get_rank() == src else tensor.new_empty([int(d) for d in shape[1 : 1 + dims]])
    dist.broadcast(out.contiguous(), src=src, group=group)
    return out


def expert_parallel_generate(model, input_ids=None, **kwargs):
    """``model.generate`` of an expert-parallel model (see the module docstring); arguments as transformers'."""
    state = model.fcsd_expert_parallel
    stock = type(model).generate
    input_ids = kwargs.pop("inputs", input_ids)  # transformers names its first argument `inputs`
    kwargs.setdefault("synced_gpus", True)
    if state.layout != "all_reduce":
        return stock(model, input_ids, **kwargs)
    group = state.group
    input_ids = _broadcast(input_ids, group)
    if kwargs.get("attention_mask") is not None:
        kwargs["attention_mask"] = _broadcast(kwargs["attention_mask"], group)
    processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
    processors.append(_RankZeroScores(group))
    device = next(model.parameters()).device
    seed = torch.randint(0, 2**62, (1,), device=device)
    dist.broadcast(seed, src=_source(group), group=group)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.manual_seed(int(seed))
        return stock(model, input_ids, logits_processor=processors, **kwargs)


def install(model) -> None:
    """Make ``model.generate`` the expert-parallel one (an instance attribute; the class is untouched)."""
    model.generate = types.MethodType(expert_parallel_generate, model)
