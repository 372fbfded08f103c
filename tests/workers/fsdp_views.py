"""Worker for test_ep_fsdp's view-warning test: one training step (the guided recipe's outputs: hidden states and
router logits beside the logits) under FSDP 2 and EP 2 x FSDP 1 on 2 gloo processes, recording every FSDP2 "returned
a view tensor" warning; and the same FSDP 2 step with fcsd's copy of the root's views turned off (planted: the
warning must be caught). Writes ``<out>.<rank>.json``."""

import json
import sys
import warnings

import torch.distributed as dist
from ep_common import RANK, WORLD, batch, loss_of, prepare

from fcsd.parallel import layout
from fcsd.parallel.layout import ParallelDims, build_meshes, parallelize


def view_warnings(family: str, ep: int) -> list[str]:
    """The FSDP2 view warnings of one forward and backward of ``family`` laid out EP ``ep`` x FSDP ``WORLD / ep``."""
    model = prepare(family, "farskip_overlap").train()
    parallelize(model, build_meshes(ParallelDims(WORLD, ep, True), "cpu"), "student")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = model(input_ids=batch(model)[RANK], use_cache=False, output_hidden_states=True)
        loss = loss_of(output.logits) + sum(state.float().pow(2).sum() for state in output.hidden_states[1:])
        loss.backward()
    return [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]


results = {
    "fsdp2": view_warnings("qwen3_moe", 1),
    "ep2xfsdp1": view_warnings("deepseek_v3", 2),
}
copy = layout.without_views
layout.without_views = lambda module, args, output: output  # planted: the root's views handed on as they are
results["planted"] = view_warnings("qwen3_moe", 1)
layout.without_views = copy
with open(f"{sys.argv[1]}.{RANK}.json", "w") as handle:
    json.dump(results, handle, indent=1)
dist.destroy_process_group()
