"""Live tensor memory and FLOPs of one training step, counted op by op (a ``TorchDispatchMode``).

Every tensor an op creates is charged to the step's current *phase* (teacher, activations, loss, backward,
optimizer, ...) until its storage dies, so the tracker knows the live bytes at every moment, their peak, and what was
live at the peak. It works on fake tensors (``FakeTensorMode``: shapes and dtypes, no data) exactly as on real ones,
which is how :mod:`fcsd.plan.simulate` runs a training step of a 30B model on a laptop. It follows torch's own
``torch.distributed._tools.mem_tracker.MemTracker`` (storages tracked by weak reference, ``UntypedStorage.resize_``
watched for FSDP2's unsharded parameters) with fewer categories and no per-module snapshots, so that it stays fast
on models with thousands of modules.

FLOPs come from torch's FLOP formulas (``torch.utils.flop_counter``), plus ``_grouped_mm`` (transformers' expert
kernel) and the CPU flash-attention kernels, which torch does not count. Attention in a causal LM computes half of
its score matrix: attention FLOPs are halved.
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten
CUDA_BLOCK = 512  # the CUDA caching allocator hands out multiples of 512 bytes
HOST = "host"  # the category of tensors in host memory (the replayed rows of train.checkpoint_offload): not counted
# in the GPU's live bytes or peak, their own largest amount kept in ``largest["host"]``


def _round(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def attention_backward_scratch(args, target: str) -> int:
    """Bytes the flash-attention backward kernel allocates for itself (invisible to a dispatch mode, which sees
    only an op's outputs), for ``aten._scaled_dot_product_flash_attention_for_cpu_backward``'s ``args``.

    ``target="cpu"``: torch's CPU kernel (``FlashAttentionKernel.cpp``) holds, per thread, two fp32 tiles of a query
    block by a key block (scores and their gradient; plus their bf16/fp16 copies for reduced types), one query
    block's row sums, and a contiguous copy of ``grad_out`` when it is not laid out (batch, sequence, heads, dim):
    measured equal to the CPU allocator's events (``tests/test_plan.py``). ``target="cuda"``: FlashAttention-2's
    backward (torch's CUDA flash kernel) holds an fp32 ``dq`` accumulator of (batch, sequence rounded up to 128,
    heads, head size rounded up to 32) and the fp32 row sums ``softmax_d``: from the kernel's source, not measured
    here."""
    grad_out, query, key = args[0], args[1], args[2]
    batch, heads, q_len, head_size = (int(n) for n in query.shape)
    if target == "cuda":
        rows = _round(q_len, 128)
        return 4 * batch * heads * rows * (_round(head_size, 32) + 1)
    q_block = min(256 if q_len >= 768 else 64 if q_len >= 192 else 32, q_len)
    tile = q_block * min(512, int(key.shape[2]))
    reduced = query.dtype in (torch.bfloat16, torch.float16)
    per_thread = 2 * tile * 4 + (2 * tile * query.element_size() if reduced else 0)
    scratch = torch.get_num_threads() * per_thread + 4 * q_block
    if not grad_out.transpose(1, 2).is_contiguous():
        scratch += grad_out.numel() * grad_out.element_size()
    return scratch


def _grouped_mm_flops(a_shape, b_shape, out_shape) -> float:
    """``_grouped_mm``: (M, K) x (G, K, N) -> (M, N), (K, M) x (M, N) -> (G, K, N) (weight gradients), or batched."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2.0 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2.0 * math.prod(out_shape) * a_shape[-1]


def _attention_flops(query, key, value, backward: bool) -> float:
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    shapes = (tuple(query.shape), tuple(key.shape), tuple(value.shape))
    if backward:
        return sdpa_backward_flop_count(shapes[0], *shapes) / 2
    return sdpa_flop_count(*shapes) / 2


def count_flops(func, args, kwargs, out) -> float:
    """FLOPs of one aten op (0 for ops without a formula: element-wise work is not counted, as in MFU)."""
    from torch.utils.flop_counter import flop_registry

    packet = func._overloadpacket
    if packet is aten._grouped_mm:
        return _grouped_mm_flops(tuple(args[0].shape), tuple(args[1].shape), tuple(out.shape))
    if packet is aten._scaled_dot_product_flash_attention_for_cpu:
        return _attention_flops(*args[:3], backward=False)
    if packet is aten._scaled_dot_product_flash_attention_for_cpu_backward:
        return _attention_flops(*args[1:4], backward=True)
    formula = flop_registry.get(packet)
    if formula is None:
        return 0.0
    flops = float(formula(*args, **(kwargs or {}), out_val=out))
    return flops / 2 if "attention" in packet.__name__ else flops


# what a fake tensor reads as on the host (``item()``, ``float()``): a gradient norm of 1.0 (no clipping), 0 for counts
_FAKE_SCALARS = {True: 1.0, False: 0}


def _fake_grouped_mm(func, args, kwargs):
    """``_grouped_mm`` on fake tensors of another dtype than bf16: its meta kernel knows only bf16 (the CUDA kernel's
    old limit) while the CPU kernel and transformers' experts also take fp32 (the student's master weights): the
    shape is computed in bf16 and the result given the inputs' dtype."""
    a, b = args[0], args[1]
    low = [t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args]
    return func(*low, **(kwargs or {})).to(a.dtype if a.dtype == b.dtype else torch.promote_types(a.dtype, b.dtype))


class MemoryTracker(TorchDispatchMode):
    """Counts live tensor bytes by category while active; ``peak`` is the largest total seen and ``at_peak`` what
    it was made of. ``phase`` names the category new tensors are charged to; :meth:`retag` moves a tensor to another
    (a gradient stored into ``.grad``). ``target`` ("cpu" or "cuda") decides the allocator's rounding (CUDA: every
    storage rounded up to 512 bytes) and the attention kernels' own scratch (:func:`attention_backward_scratch`),
    charged while the op runs."""

    def __init__(self, target: str = "cpu"):
        super().__init__()
        self.target = target
        self.block = CUDA_BLOCK if target == "cuda" else 1
        self.phase = "activations"
        self.live: dict[str, int] = defaultdict(int)
        self.largest: dict[str, int] = defaultdict(int)
        self.total = 0
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self.peak_phase = ""
        self.phase_peaks: dict[str, tuple[int, dict[str, int]]] = {}  # phase -> (its peak, what was alive then)
        self.flops: dict[str, float] = defaultdict(float)
        self.expert_flops = 0.0  # of them, the routed experts' grouped GEMMs (``_grouped_mm``), every phase
        self._storages = WeakIdKeyDictionary()  # storage -> [bytes, category]
        self._resize = None

    # -- bookkeeping -------------------------------------------------------------------------------------------
    def _bytes(self, nbytes: int) -> int:
        return -(-nbytes // self.block) * self.block if nbytes else 0

    def _change(self, category: str, delta: int) -> None:
        if category == HOST:  # not on the GPU: counted apart
            self.live[HOST] += delta
            self.largest[HOST] = max(self.largest[HOST], self.live[HOST])
            return
        self.live[category] += delta
        self.total += delta
        if delta > 0:
            self.largest[category] = max(self.largest[category], self.live[category])
            best = self.phase_peaks.get(self.phase)
            if best is None or self.total > best[0]:
                self.phase_peaks[self.phase] = (self.total, {k: v for k, v in self.live.items() if v and k != HOST})
            if self.total > self.peak:
                self.peak, self.peak_phase = self.total, self.phase
                self.at_peak = self.phase_peaks[self.phase][1]

    def _released(self, info, _ref) -> None:
        self._change(info[1], -info[0])

    def track(self, tensor: torch.Tensor, category: str | None = None) -> None:
        """Charge ``tensor``'s storage to ``category`` (default: the current phase) unless it is tracked already."""
        storage = _storage(tensor)
        if storage is None or storage in self._storages:
            return
        info = [self._bytes(storage.nbytes()), category or self.phase]
        self._storages[storage] = info
        weakref.finalize(storage, self._released, info, None)
        self._change(info[1], info[0])

    def retag(self, tensor: torch.Tensor, category: str) -> None:
        """Move ``tensor``'s storage to ``category`` (tracking it first if needed)."""
        storage = _storage(tensor)
        if storage is None:
            return
        info = self._storages.get(storage)
        if info is None:
            self.track(tensor, category)
            return
        if info[1] != category:
            self._change(info[1], -info[0])
            info[1] = category
            self._change(category, info[0])

    def bytes_of(self, tensors) -> int:
        """What the storages of ``tensors`` take (each storage once), rounded as the tracker rounds."""
        seen, total = set(), 0
        for tensor in tensors:
            storage = _storage(tensor)
            if storage is not None and id(storage) not in seen:
                seen.add(id(storage))
                total += self._bytes(storage.nbytes())
        return total

    @contextmanager
    def phase_as(self, name: str):
        """Charge tensors created in the block to ``name``."""
        saved, self.phase = self.phase, name
        try:
            yield
        finally:
            self.phase = saved

    # -- the mode ----------------------------------------------------------------------------------------------
    def __enter__(self):
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):  # FSDP2 frees and re-allocates unsharded parameters this way
            result = original(storage, size)
            info = tracker._storages.get(storage)
            if info is not None:
                new = tracker._bytes(storage.nbytes())
                tracker._change(info[1], new - info[0])
                info[0] = new
            elif size:
                tracker._storages[storage] = info = [tracker._bytes(storage.nbytes()), tracker.phase]
                weakref.finalize(storage, tracker._released, info, None)
                tracker._change(info[1], info[0])
            return result

        self._resize, torch.UntypedStorage.resize_ = original, resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        fake_grouped = func._overloadpacket is aten._grouped_mm and any(
            isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.bfloat16 for t in args[:2]
        )
        if fake_grouped and _is_fake(args[0]):
            out = _fake_grouped_mm(func, args, kwargs)
        elif func is aten._local_scalar_dense.default and _is_fake(args[0]):
            return _FAKE_SCALARS[args[0].dtype.is_floating_point]
        elif func._overloadpacket is aten._scaled_dot_product_flash_attention_for_cpu_backward:
            scratch = self._bytes(attention_backward_scratch(args, self.target))
            self._change(self.phase, scratch)  # held while the kernel runs
            out = func(*args, **(kwargs or {}))
            self._change(self.phase, -scratch)
        else:
            out = func(*args, **(kwargs or {}))
        flops = count_flops(func, args, kwargs, out)
        self.flops[self.phase] += flops
        if func._overloadpacket is aten._grouped_mm:
            self.expert_flops += flops
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.track(tensor)
        return out


def _is_fake(tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def _storage(tensor: torch.Tensor):
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    if tensor.device.type == "meta" and not _is_fake(tensor):
        return None
    try:
        return tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):  # sparse or wrapper subclasses without a storage
        return None
