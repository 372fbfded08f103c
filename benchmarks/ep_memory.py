"""Per-process memory of an FCSD training run under the parallel layouts (paper Sec. 4.1; design §4 "EP at scale").

A Qwen3-MoE whose routed experts dominate (default: 4 layers x 32 experts of hidden 512 / intermediate 512) is saved
with a locally trained tokenizer; then the same short run (online teacher, 2 optimizer steps, fp32 on CPU) is made
in one process and on 4 gloo processes in four layouts:

- ``single``: one process (reference);
- ``ep2``: ``parallel.ep_size=2`` (experts over 2 processes, everything else replicated: two expert-parallel groups);
- ``ep2_fsdp2``: ``parallel.ep_size=2 parallel.fsdp=true`` (EP x FSDP2 on one mesh: nothing whole anywhere);
- ``ep2_fsdp2_ckpt``: the same with ``train.gradient_checkpointing=true`` (exchanges saved and replayed);
- ``fsdp4``: ``parallel.fsdp=true`` (FSDP2 over the 4 processes, no expert parallelism).

Each process reports: its host peak RSS while loading (student, teacher, data) and while writing ``final/`` (the
streamed stock-layout save), sampled every 10 ms; and, for the second optimizer step (a steady-state step: the
AdamW states exist), its tensor bytes by kind, counted op by op with ``fcsd plan``'s tracker
(:class:`fcsd.plan.tracker.MemoryTracker`): weights, gradients and optimizer states it holds, the teacher's
weights, the largest amount of activations alive, and the step's peak of everything together. Beside each layout the
plan's estimate of the same step (:func:`fcsd.plan.simulate.estimate_step` on fake tensors, ``target="cpu"``; every
layout is modelled, EP x FSDP2 with and without checkpointing included).

    python benchmarks/ep_memory.py [--experts 32] [--layers 4] [--hidden 512] [--seq-len 256]

Results are recorded in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

RUNS = {  # name -> (processes, overrides, plan layout or None)
    "single": (1, [], ("single", 1, 1, False)),
    "ep2": (4, ["parallel.ep_size=2"], ("ep", 4, 2, False)),
    "ep2_fsdp2": (4, ["parallel.ep_size=2", "parallel.fsdp=true"], ("ep_fsdp", 4, 2, False)),
    "ep2_fsdp2_ckpt": (
        4,
        ["parallel.ep_size=2", "parallel.fsdp=true", "train.gradient_checkpointing=true"],
        ("ep_fsdp", 4, 2, True),
    ),
    "fsdp4": (4, ["parallel.fsdp=true"], ("fsdp2", 4, 1, False)),
}
KINDS = ("weights", "gradients", "optimizer", "teacher", "activations", "peak")


def build_assets(folder: Path, args) -> None:
    import torch
    import transformers

    from fcsd.embedded.synthetic import make_dataset, write_jsonl
    from fcsd.embedded.tokenizer import train_tokenizer

    rows = make_dataset(200, seed=0)
    tokenizer = train_tokenizer((m["content"] for r in rows for m in r["messages"]), vocab_size=300)
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.hidden,
        moe_intermediate_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=args.hidden // 8,
        num_experts=args.experts,
        num_experts_per_tok=4,
        max_position_embeddings=max(256, args.seq_len),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    others = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    write_jsonl(rows, folder / "train.jsonl")
    (folder / "sizes.json").write_text(json.dumps({"expert_params": experts, "other_params": others}))


def overrides(folder: Path, out: Path, seq_len: int, extra: list[str]) -> list[str]:
    return [
        f"model.name={folder}/model",
        f"data.path={folder}/train.jsonl",
        f"data.cache_dir={folder}/cache",
        f"output_dir={out}",
        f"data.seq_len={seq_len}",
        "data.eval_sequences=4",
        f"train.batch_tokens={8 * seq_len}",
        "train.micro_batch_size=2",
        "train.max_steps=2",
        "train.warmup_steps=1",
        "train.eval_every=0",
        "recovery.batch_ramp=[]",  # whole steps: the step measured is the step the plan prices
        "recovery.batch_ramp_shares=[]",
        "export=false",
        "progress=false",
        "early_stop.enabled=false",
        *extra,
    ]


class RSSPeak:
    """The largest resident set size of this process while the block runs (sampled every 10 ms)."""

    def __init__(self):
        self.peak = 0

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    @contextmanager
    def sampling(self):
        done = threading.Event()

        def sample():
            while not done.wait(0.01):
                self.peak = max(self.peak, self.now())

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            done.set()
            thread.join()
            self.peak = max(self.peak, self.now())


def _local(tensor):
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def tracked_step(session, step: int, micro_batches, forward_backward) -> tuple:
    """Run ``forward_backward`` of ``step`` (its ``micro_batches``) under the plan's tracker; returns its result and the
    bytes by kind."""
    from types import SimpleNamespace

    from fcsd.plan.simulate import _phases
    from fcsd.plan.tracker import MemoryTracker

    tracker = MemoryTracker("cpu")
    model = session.unwrapped
    weights = [_local(t) for t in (*model.parameters(), *model.buffers())]
    teacher = [] if session.teacher is None else [_local(t) for t in (*session.teacher.parameters(),)]
    states = [_local(v) for s in session.optimizer.state.values() for v in s.values() if hasattr(v, "untyped_storage")]
    for tensors, kind in ((weights, "weights"), (teacher, "teacher"), (states, "optimizer")):
        for tensor in tensors:
            tracker.track(tensor, kind)
    run = SimpleNamespace(teacher=session.teacher, head_in_forward=session.head_in_forward, unwrapped=model)
    with _phases(run, tracker), tracker:
        result = forward_backward(session, step, micro_batches)
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    kinds = {
        "weights": tracker.bytes_of(weights),
        "gradients": tracker.bytes_of(grads),
        "optimizer": tracker.bytes_of(states),
        "teacher": tracker.bytes_of(teacher),
        "activations": tracker.largest.get("activations", 0) + tracker.largest.get("backward", 0),
        "peak": tracker.peak,
    }
    return result, kinds


def worker(args) -> None:
    """One process of a run: train (the second step tracked), write what it measured."""
    from fcsd.distill import checkpointing, trainer
    from fcsd.distill.config import compose, to_config
    from fcsd.distill.convert import convert

    measured = {"loading": RSSPeak(), "final": RSSPeak()}
    session_init, forward_backward = trainer.TrainingSession.__init__, trainer.TrainingSession.forward_backward
    save_model = checkpointing.save_model

    def init_measured(self, *a, **k):
        with measured["loading"].sampling():
            session_init(self, *a, **k)

    def forward_backward_tracked(self, step, micro_batches):
        if step != 1 or "step" in measured:  # step 1, its first update if a batch ramp splits it
            return forward_backward(self, step, micro_batches)
        result, measured["step"] = tracked_step(self, step, micro_batches, forward_backward)
        return result

    def save_measured(*a, **k):
        if a[4].name != "final":
            return save_model(*a, **k)
        with measured["final"].sampling():
            return save_model(*a, **k)

    trainer.TrainingSession.__init__ = init_measured
    trainer.TrainingSession.forward_backward = forward_backward_tracked
    trainer.save_model = save_measured
    convert(to_config(compose(overrides(Path(args.folder), Path(args.out), args.seq_len, args.extra))))
    result = {"loading_rss": measured["loading"].peak, "final_rss": measured["final"].peak, **measured["step"]}
    Path(f"{args.out}.mem{os.environ.get('RANK', '0')}").write_text(json.dumps(result))


def run(folder: Path, name: str, seq_len: int) -> list[dict]:
    processes, extra, _ = RUNS[name]
    out = folder / name
    command = [__file__, "--worker", "--folder", str(folder), "--out", str(out), "--seq-len", str(seq_len)]
    command += [f"--extra={item}" for item in extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    if processes == 1:
        subprocess.run([sys.executable, *command], check=True, env=env)
    else:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}"]
        subprocess.run([*launcher, f"--master_port={port}", *command], check=True, env=env)
    return [json.loads(Path(f"{out}.mem{rank}").read_text()) for rank in range(processes)]


def plan_estimate(folder: Path, name: str, seq_len: int) -> dict | None:
    """The plan's estimate of the tracked step for this layout (bytes by kind), or None where it has no model."""
    layout = RUNS[name][2]
    if layout is None:
        return None
    from transformers import AutoConfig

    from fcsd.distill.config import compose, to_config
    from fcsd.plan.run import Layout
    from fcsd.plan.simulate import estimate_step

    strategy, processes, ep, checkpointing = layout
    config = to_config(compose(overrides(folder, folder / "plan", seq_len, [])))
    plan_layout = Layout(strategy, processes, ep, "online", 2, checkpointing)
    estimate = estimate_step(AutoConfig.from_pretrained(folder / "model"), config, plan_layout, target="cpu")
    return {kind: getattr(estimate, kind) for kind in KINDS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of " + ", ".join(RUNS))
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--folder")
    parser.add_argument("--out")
    parser.add_argument("--extra", action="append", default=[])
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_assets(folder, args)
        sizes = json.loads((folder / "sizes.json").read_text())
        results = {}
        for name in args.runs.split(","):
            started = time.perf_counter()
            results[name] = {
                "ranks": run(folder, name, args.seq_len),
                "plan": plan_estimate(folder, name, args.seq_len),
            }
            results[name]["seconds"] = time.perf_counter() - started
    print(
        f"expert parameters {sizes['expert_params'] / 1e6:.1f}M ({sizes['expert_params'] * 4 / mib:.0f} MiB fp32), "
        f"others {sizes['other_params'] / 1e6:.1f}M ({sizes['other_params'] * 4 / mib:.0f} MiB)"
    )
    print("| run | process | " + " | ".join(KINDS) + " | RSS loading | RSS writing final/ |")
    print("|---|---|" + "---:|" * (len(KINDS) + 2))
    for name, result in results.items():
        for rank, values in enumerate(result["ranks"]):
            cells = " | ".join(f"{values[k] / mib:.1f}" for k in KINDS)
            print(
                f"| {name} | {rank} | {cells} | {values['loading_rss'] / mib:.0f} | {values['final_rss'] / mib:.0f} |"
            )
        if result["plan"] is not None:
            cells = " | ".join(f"{result['plan'][k] / mib:.1f}" for k in KINDS)
            print(f"| {name} | plan | {cells} | | |")
    print(
        "(MiB; tensor bytes by kind of the second optimizer step, per process; RSS: host peak while loading and "
        "while writing final/)"
    )
    print(json.dumps({"sizes": sizes, "results": results}))


if __name__ == "__main__":
    main()
