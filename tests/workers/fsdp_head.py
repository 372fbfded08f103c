"""Worker for test_fsdp_units: the head-in-forward loss of a student and an online teacher laid out FSDP 2 on 2 gloo
processes (vocabulary 151,936, hidden size 32): the largest tensor any op creates in the loss's forward and
backward, and the loss and gradients against one process's chunked loss on both processes' rows. Writes
``<out>.<rank>.json``."""

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from tiny_models import CONFIGS
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import fcsd
from fcsd.distill.data import pack_documents
from fcsd.distill.objectives import micro_batch_loss
from fcsd.parallel.layout import ParallelDims, build_meshes, parallelize

VOCAB, SEQ, ROWS = 151_936, 32, 2
dist.init_process_group("gloo")
RANK, WORLD = dist.get_rank(), dist.get_world_size()


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def model(student: bool):
    cls, config = CONFIGS["qwen3_moe"]()
    config.vocab_size, config._attn_implementation = VOCAB, "eager"
    torch.manual_seed(0)
    built = cls(config)
    return fcsd.apply_farskip(built, "all").train() if student else built.eval().requires_grad_(False)


def rows(rank):
    gen = torch.Generator().manual_seed(rank)
    return pack_documents([torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (20, 30, 14)], seq_len=SEQ)


train = dict(objective="kl", divergence="forward_kl", temperature=1.0, jsd_beta=0.5, l2_coef=0.0)
config = SimpleNamespace(
    train=SimpleNamespace(**train, loss_chunk_size=8, router_aux_coef=0.0), recovery=SimpleNamespace(hidden_l2=0.0)
)
reference, reference_teacher = model(True), model(False)
expected = 0.0
for rank in range(WORLD):  # one process, every rank's rows: the gradient FSDP averages over the processes
    expected += float(micro_batch_loss(reference, reference, rows(rank), config, reference_teacher).total.detach())
    micro_batch_loss(reference, reference, rows(rank), config, reference_teacher).total.backward()

meshes = build_meshes(ParallelDims(WORLD, 1, True), "cpu")
student = parallelize(model(True), meshes, "student")
teacher = parallelize(model(False), meshes, "teacher")
batch = rows(RANK)
with LargestTensor() as largest:
    parts = micro_batch_loss(student, student, batch, config, teacher, head_in_forward=True)
    parts.total.backward()
total = parts.total.detach().clone()
dist.all_reduce(total)
errors = []
for param, ref in zip(student.parameters(), reference.parameters(), strict=True):
    grad = param.grad.full_tensor() if param.grad is not None else torch.zeros_like(ref)
    errors.append(float((grad - ref.grad / WORLD).norm() / ref.grad.norm().clamp_min(1e-30)))
result = {
    "largest": largest.largest,
    "tokens_x_vocab": batch.input_ids.numel() * VOCAB,
    "head": VOCAB * student.config.hidden_size,
    "loss": abs(float(total) - expected) / abs(expected),
    "grad": max(errors),
    "teacher_resharded": all(isinstance(p, DTensor) for p in teacher.parameters()),
}
with open(f"{sys.argv[1]}.{RANK}.json", "w") as handle:
    json.dump(result, handle)
dist.destroy_process_group()
