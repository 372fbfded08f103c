"""Worker for test_parallel: shard a tiny teacher with FSDP2 over gloo processes and write what it computes."""

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
from tiny_models import build

from fcsd.distill.data import pack_documents
from fcsd.distill.objectives import teacher_targets
from fcsd.parallel.inference_shard import shard_for_inference

dist.init_process_group("gloo")
torch.manual_seed(0)
batch = pack_documents([torch.randint(3, 90, (n,)).tolist() for n in (7, 12, 13)], seq_len=16)
reference = build("qwen3_moe").eval()
teacher = build("qwen3_moe").eval().requires_grad_(False)
shard_for_inference(teacher, SimpleNamespace(distributed_type=DistributedType.FSDP))
logits, head, _ = teacher_targets(teacher, batch, head_in_forward=True)
with torch.no_grad():
    expected = reference(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
local = sum(p.to_local().numel() for p in teacher.parameters())
result = {
    "max_abs_diff": float((head(logits) - expected.reshape(-1, expected.shape[-1])).abs().max()),
    "local_params": local,
    "total_params": sum(p.numel() for p in reference.parameters()),
}
with open(f"{sys.argv[1]}.{dist.get_rank()}.json", "w") as handle:
    json.dump(result, handle)
dist.destroy_process_group()
