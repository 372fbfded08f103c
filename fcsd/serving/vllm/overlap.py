"""The routed-expert all-reduce of a converted layer, blocking or overlapped with the next layer's attention
(paper Sec. 4.2, design §7).

In vLLM's MoE layout (activations replicated over the tensor-parallel group, experts sharded over it, or over the
expert-parallel group built from it), each MoE layer ends with an all-reduce of its expert outputs. In a FarSkip
layer k the routed part of that all-reduce is needed only to form ``o_k``, which layer k+1 reads after its
attention: the all-reduce is started at the end of layer k and waited in layer k+1 right before its MoE input.

- CPU (gloo): ``torch.distributed.all_reduce(async_op=True)`` on a sibling process group, waited with
  ``Work.wait()``.
- CUDA: the all-reduce is issued on a side stream after that stream waits for the routed output, an event is
  recorded behind it, and the consumer's stream waits on the event: no host synchronisation.

The sibling group (same ranks as vLLM's tensor-parallel group, its own communicator) keeps these collectives apart
from the blocking ones vLLM issues meanwhile (attention's all-reduce, vLLM's custom all-reduce buffers). Overlap needs
eager execution: under ``torch.compile`` (``fullgraph``) and CUDA graphs a started collective cannot cross into the
next layer, so there the all-reduce stays blocking (see :func:`resolve_overlap`).
"""

from __future__ import annotations

import torch


class Pending:
    """An all-reduce in flight on ``tensor`` (in place); :meth:`wait` makes the caller's stream see the result."""

    def __init__(self, tensor: torch.Tensor, work=None, event=None):
        self.tensor, self._work, self._event = tensor, work, event

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._event is not None:
            torch.cuda.current_stream(self.tensor.device).wait_event(self._event)
            self._event = None
        return self.tensor


class RoutedAllReduce:
    """Starts the routed all-reduces of one model on ``group`` (a process group with the tensor-parallel ranks)."""

    def __init__(self, group):
        self.group = group
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}

    def start(self, tensor: torch.Tensor) -> Pending:
        """Launch the sum of ``tensor`` over the group, in place, without waiting for it."""
        import torch.distributed as dist

        if tensor.device.type != "cuda":
            return Pending(tensor, work=dist.all_reduce(tensor, group=self.group, async_op=True))
        current = torch.cuda.current_stream(tensor.device)
        side = self._side_streams.get(tensor.device)
        if side is None:
            side = self._side_streams[tensor.device] = torch.cuda.Stream(tensor.device)
        side.wait_stream(current)  # the routed output is complete on the side stream
        with torch.cuda.stream(side):
            dist.all_reduce(tensor, group=self.group)  # NCCL: the side stream waits, the host does not
            done = torch.cuda.Event()
            done.record(side)
        tensor.record_stream(side)  # the allocator must not reuse it before the side stream is done
        return Pending(tensor, event=done)


def blocking_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """The reference: vLLM's own tensor-parallel all-reduce, where the stock MoE layer issues it."""
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(tensor)


def resolve_overlap(setting, tp_size: int, eager: bool) -> bool:
    """Whether converted layers overlap their routed all-reduce: ``setting`` is vLLM's
    ``additional_config["farskip_overlap"]`` (``"auto"``/None: on when the tensor-parallel group has more than one
    rank and the model runs eagerly; ``True``/``False`` force it). ``True`` without eager execution is refused."""
    if isinstance(setting, str):
        setting = {"auto": None, "true": True, "on": True, "false": False, "off": False}.get(setting.lower(), setting)
    if setting not in (None, True, False):
        raise ValueError(f"farskip_overlap={setting!r}: expected true, false or auto")
    if setting is None:
        return tp_size > 1 and eager
    if setting and not eager:
        raise ValueError(
            "farskip_overlap=true needs eager execution (a started all-reduce cannot cross torch.compile or CUDA "
            "graph boundaries): add --enforce-eager, or leave farskip_overlap unset"
        )
    return setting
