"""Worker for test_overlap_link: the `mid` benchmark model (Qwen3-MoE shapes, 4 MoE layers, 512 tokens per rank),
mode farskip_overlap, training steps over a modelled link, then the same model with FCSD_EP_SYNC=1 (every
collective waited at once). Writes ``<out>.<rank>.json``: per phase and collective kind, this rank's figures, and per
phase the hidden share of each transfer of the last step (``"transfers"``)."""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from fcsd.bench import overlap as bench
from fcsd.bench.hidden_share import summarise, transfer_figures
from fcsd.bench.modelled_link import ModelledLink, parse_link
from fcsd.bench.modelled_run import LinkStep, bench_inputs
from fcsd.parallel import collectives

out, link_text, iters = sys.argv[1], sys.argv[2], int(sys.argv[3])
env = bench.setup("gloo", "cpu", "float32")
torch.set_num_threads(1)
args = argparse.Namespace(config="mid", model=None, dispatcher="plain")
model, batch, seq = bench._model_for("farskip_overlap", args, env)
ids = bench_inputs(model, batch, seq, same_on_every_rank=False, device=env.device)  # as `fcsd bench overlap` runs
collectives.LINK = link = ModelledLink(parse_link(link_text))
step = LinkStep(model, ids, link)


def measure(steps: int) -> dict:
    step.run()  # warm-up
    taken = [step.run().transfers for _ in range(steps)]
    table = summarise(taken)
    figures = {phase: {kind: f.as_dict(steps) for kind, f in kinds.items()} for phase, kinds in table.items()}
    shares = {}
    for transfer, f in transfer_figures(taken[-1]):
        if not transfer.blocking:  # the routing counts block by design
            shares.setdefault(transfer.phase, []).append(f.hidden / f.link)
    return {**figures, "transfers": shares}


results = {"overlapped": measure(iters)}
os.environ["FCSD_EP_SYNC"] = "1"  # read at every exchange: the same model now waits each collective at once
results["sync"] = measure(1)
with open(f"{out}.{dist.get_rank()}.json", "w") as handle:
    json.dump(results, handle, indent=1)
dist.destroy_process_group()
