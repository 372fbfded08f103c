"""The routed-expert all-reduce of a converted layer, blocking or overlapped with the next layer's attention
(paper Sec. 4.2, design §7), eager or compiled; shared by the vLLM and SGLang plugins, each passing its engine's
blocking all-reduce.

In the engines' MoE layout (activations replicated over the tensor-parallel group, experts sharded over it, or over the
expert-parallel group built from it), each MoE layer ends with an all-reduce of its expert outputs. In a FarSkip
layer k the routed part of that all-reduce is needed only to form ``o_k``, which layer k+1 reads after its
attention: the all-reduce is started at the end of layer k and waited in layer k+1 right before its MoE input.

- CPU (gloo): ``torch.distributed.all_reduce(async_op=True)`` on a sibling process group, waited with
  ``Work.wait()``.
- CUDA: the all-reduce is issued on a side stream after that stream waits for the routed output, an event is
  recorded behind it, and the consumer's stream waits on the event: no host synchronisation.

The sibling group (same ranks as the engine's tensor-parallel group, its own communicator) keeps these collectives
apart from the blocking ones the engine issues meanwhile (attention's all-reduce, vLLM's custom all-reduce buffers).

**Compiled.** The start and the wait are two custom ops: ``fcsd::farskip_routed_start`` mutates the routed tensor
(the in-flight sum), ``fcsd::farskip_routed_wait`` copies the finished sum into a buffer of the graph's and takes the
next attention's output as an argument, so that a compiler keeps it after that attention (Inductor otherwise moves
each wait next to its start). The layer pairs them by a key fixed when the model is built (the starting layer's);
the handle lives on the host between them.

- vLLM's default CPU compilation (one Dynamo trace, Inductor) calls both ops from the compiled code (SGLang's plugin
  runs eager);
- vLLM's piecewise compilation (GPUs) gets both as splitting ops (:func:`split_at_routed_ops`): they run eagerly
  between the compiled pieces, so the pieces can be captured as CUDA graphs while the all-reduce runs beside the
  next piece.

**Where it overlaps.** The start decides per forward, at run time, by the forward's token count (static per captured
graph size): a forward of more than ``above_tokens`` tokens (``farskip_overlap_above_tokens``; default vLLM's largest
CUDA-graph capture size, 512 without graphs and in SGLang) overlaps; a smaller one, and any forward being captured
into a CUDA graph, reduces at once with the engine's own all-reduce (``reduce_now``; vLLM's custom all-reduce on
GPUs), in place, and the wait finds nothing pending. Decode keeps the engine's CUDA graphs (nothing started is ever
captured) and prefill-sized batches, which run outside graphs, overlap.
"""

from __future__ import annotations

import torch

_CHANNELS: dict[str, RoutedAllReduce] = {}  # name -> the model's RoutedAllReduce (one model per engine worker)
# what this process did: all-reduces started and waited, and how many of those calls came from compiled code
# and the routed all-reduces a small forward reduced at once (blocking), with the fewest tokens a started one had and
# the most a blocking one had
STATS = {
    "started": 0,
    "waited": 0,
    "compiled_calls": 0,
    "blocking": 0,
    "started_min_tokens": 0,
    "blocking_max_tokens": 0,
}
# the engines' settings (vLLM's additional_config, SGLang's --json-model-override-args): "auto" (default), true, false
OVERLAP_KEY = "farskip_overlap"
ABOVE_TOKENS_KEY = "farskip_overlap_above_tokens"  # forwards of more tokens overlap: "auto" (default) or a number
DEFAULT_ABOVE_TOKENS = 512  # without CUDA graphs: forwards of more tokens overlap (vLLM's default capture size)
ROUTED_OPS = ("fcsd::farskip_routed_start", "fcsd::farskip_routed_wait")


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
    """Starts the routed all-reduces of one model on ``group`` (a process group with the tensor-parallel ranks) and
    holds each started one under its layer's key until it is waited."""

    def __init__(self, group, above_tokens: int = 0, reduce_now=None):
        self.group = group
        self.reduce_now = reduce_now  # the engine's blocking all-reduce (tensor -> summed tensor), for small forwards
        self.above_tokens = above_tokens  # forwards of more tokens overlap; the others reduce at once
        self.name = "routed"  # a fixed name: compiled graphs (and vLLM's cache of them) hold it as a constant
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pending: dict[str, Pending] = {}
        _CHANNELS[self.name] = self

    def key(self, layer_index: int) -> str:
        """The key layer ``layer_index`` starts its all-reduce under (and its successor waits for)."""
        return f"{self.name}/{layer_index}"

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

    def overlaps(self, tensor: torch.Tensor) -> bool:
        """Whether the forward of ``tensor`` (tokens x hidden) overlaps: more than :attr:`above_tokens` tokens and
        not being captured into a CUDA graph (the same on every rank: the tokens are replicated over the group)."""
        if tensor.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        return tensor.shape[0] > self.above_tokens

    def park(self, key: str, tensor: torch.Tensor) -> None:
        """Start ``tensor``'s sum under ``key`` where the forward overlaps (:meth:`overlaps`), else sum it now in place
        with the engine's all-reduce; one still pending under ``key`` (never waited) is completed first, so that
        every rank keeps issuing the same collectives."""
        stale = self._pending.pop(key, None)
        if stale is not None:
            stale.wait()
        if not self.overlaps(tensor):
            tensor.copy_(self.reduce_now(tensor))
            STATS["blocking"] += 1
            STATS["blocking_max_tokens"] = max(STATS["blocking_max_tokens"], tensor.shape[0])
            return
        self._pending[key] = self.start(tensor)
        low = STATS["started_min_tokens"]
        STATS["started_min_tokens"] = tensor.shape[0] if not STATS["started"] else min(low, tensor.shape[0])
        STATS["started"] += 1

    def take(self, key: str) -> None:
        """Wait for the sum started under ``key``; nothing when none was (the predecessor's kernel reduced)."""
        pending = self._pending.pop(key, None)
        if pending is not None:
            pending.wait()
            STATS["waited"] += 1


def _channel(key: str) -> RoutedAllReduce:
    return _CHANNELS[key.split("/", 1)[0]]


@torch.library.custom_op("fcsd::farskip_routed_start", mutates_args=("routed",))
def _start_op(routed: torch.Tensor, key: str) -> None:
    STATS["compiled_calls"] += 1
    _channel(key).park(key, routed)


@_start_op.register_fake
def _(routed, key):
    return None


@torch.library.custom_op("fcsd::farskip_routed_wait", mutates_args=("out",))
def _wait_op(out: torch.Tensor, routed: torch.Tensor, after: torch.Tensor, key: str) -> None:
    STATS["compiled_calls"] += 1
    _channel(key).take(key)
    out.copy_(routed)


@_wait_op.register_fake
def _(out, routed, after, key):
    return None


def start_routed(routed: torch.Tensor, key: str) -> None:
    """Start the routed all-reduce of ``routed`` (in place) under ``key`` (:meth:`RoutedAllReduce.key`)."""
    if torch.compiler.is_compiling():
        torch.ops.fcsd.farskip_routed_start.default(routed, key)
    else:
        _channel(key).park(key, routed)


def wait_routed(routed: torch.Tensor, after: torch.Tensor, key: str) -> torch.Tensor:
    """The finished sum started under ``key`` on ``routed``, waited once ``after`` (the attention output the sum
    ran behind) exists: ``routed`` itself when eager; traced, a copy in a buffer the graph allocates (a fixed address
    under CUDA graphs, as vLLM's attention writes its output), so that no compiler pass reads ``routed`` early."""
    if torch.compiler.is_compiling():
        out = torch.empty_like(routed)
        torch.ops.fcsd.farskip_routed_wait.default(out, routed, after, key)
        return out
    _channel(key).take(key)
    return routed


def split_at_routed_ops(compilation_config) -> None:
    """Under vLLM's piecewise compilation, make the two ops splitting ops (run eagerly between compiled pieces, out
    of CUDA graphs); vLLM reads the list when it compiles, after the model is built."""
    ops = compilation_config.splitting_ops
    if ops is not None:
        ops.extend(op for op in ROUTED_OPS if op not in ops)


def resolve_above_tokens(setting, capture_size: int | None) -> int:
    """Forwards of more tokens than this overlap: ``setting`` is ``farskip_overlap_above_tokens`` (vLLM's
    ``additional_config``, SGLang's ``--json-model-override-args``; ``"auto"``/None: ``capture_size``, vLLM's largest
    CUDA-graph capture size where graphs are on, else :data:`DEFAULT_ABOVE_TOKENS`; 0 overlaps every forward outside
    a capture)."""
    if setting is None or (isinstance(setting, str) and setting.lower() == "auto"):
        return capture_size if capture_size else DEFAULT_ABOVE_TOKENS
    try:
        value = int(setting) if not isinstance(setting, bool) and float(setting) == int(setting) else -1
    except (TypeError, ValueError):
        value = -1
    if value < 0:
        raise ValueError(f"farskip_overlap_above_tokens={setting!r}: expected a whole number of tokens >= 0, or auto")
    return value


def resolve_overlap(setting, tp_size: int, unsplit_graphs: bool = False) -> bool:
    """Whether converted layers overlap their routed all-reduce: ``setting`` is ``farskip_overlap`` (vLLM's
    ``additional_config``, SGLang's ``--json-model-override-args``; ``"auto"``/None: on when the tensor-parallel group
    has more than one rank; ``True``/``False`` force it). ``unsplit_graphs``: CUDA graphs not split at attention by
    vLLM's piecewise compilation (full graphs of an eager model, breakable graphs, splitting ops without attention),
    which the routed ops cannot run between: ``auto`` is off there and ``True`` is refused."""
    if isinstance(setting, str):
        setting = {"auto": None, "true": True, "on": True, "false": False, "off": False}.get(setting.lower(), setting)
    if setting not in (None, True, False):
        raise ValueError(f"farskip_overlap={setting!r}: expected true, false or auto")
    if setting is None:
        return tp_size > 1 and not unsplit_graphs
    if setting and unsplit_graphs:
        raise ValueError(
            "farskip_overlap=true cannot run inside CUDA graphs that vLLM's piecewise compilation does not split at "
            "attention (full graphs of an eager model, VLLM_USE_BREAKABLE_CUDAGRAPH, splitting ops without attention): "
            "a started all-reduce cannot cross a captured graph; keep vLLM's default compilation or add --enforce-eager"
        )
    return setting


def overlap_stats(_worker=None) -> dict:
    """This process's counts of routed all-reduces started and waited by the overlap, and of the routed ops called
    from compiled code (through vLLM's ``LLM.collective_rpc(overlap_stats)``, one dict per worker)."""
    return dict(STATS)
