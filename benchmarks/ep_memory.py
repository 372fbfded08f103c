"""Peak host memory of an FCSD training run: one process vs 2 expert-parallel processes (paper Sec. 4.1).

A Qwen3-MoE whose routed experts dominate (default: 4 layers x 64 experts of hidden 512 / intermediate 512, ~201M
expert parameters, ~5M others) is saved with a locally trained tokenizer; then the same short run (online teacher,
2 optimizer steps, fp32 on CPU) is made three ways, each process reporting its own peak RSS:

- ``single``: one process (teacher, student, gradients and AdamW moments of every expert);
- ``ep2``: ``torchrun --nproc_per_node 2 ... parallel.ep_size=2``: each process loads only its experts (student and
  teacher), so it should hold about half the experts plus the non-expert weights;
- ``ep2_full_load``: the same, but each process first loads the whole checkpoint and then keeps its half (how
  expert parallelism loaded before the sharded loader), for comparison.

Each process reports its peak RSS so far after loading (models, data, optimizer), after training (before ``final/``)
and at the end (the main process gathers the experts to write ``final/`` in the stock layout).

    python benchmarks/ep_memory.py [--experts 64] [--layers 4] [--hidden 512]

Results are recorded in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path


def build_assets(folder: Path, args) -> None:
    import torch
    import transformers

    from fcsd.distill.synthetic import make_dataset, write_jsonl
    from fcsd.distill.tokenizer import train_tokenizer

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
        max_position_embeddings=256,
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


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(args) -> None:
    """One process of a run: train, then write this process's peak RSS after loading, after training (before
    final/ is written) and at the end."""
    from fcsd.distill import trainer
    from fcsd.distill.config import compose, to_config
    from fcsd.distill.convert import convert

    peaks = {}
    session_init, finish = trainer.TrainingSession.__init__, trainer.TrainingSession.finish

    def init_then_measure(self, *a, **k):
        session_init(self, *a, **k)
        peaks["loaded"] = _peak()

    def measure_then_finish(self, *a, **k):
        peaks["trained"] = _peak()
        return finish(self, *a, **k)

    trainer.TrainingSession.__init__, trainer.TrainingSession.finish = init_then_measure, measure_then_finish

    if args.full_load:  # load everything, then keep this process's experts (the loader before sharded loading)
        load_models = trainer.load_models
        trainer.load_models = lambda *a, expert_group=None, **k: load_models(*a, **k)
    overrides = [
        f"model.name={args.folder}/model",
        f"data.path={args.folder}/train.jsonl",
        f"data.cache_dir={args.folder}/cache",
        f"output_dir={args.out}",
        "data.seq_len=64",
        "data.eval_sequences=2",
        "train.batch_tokens=256",
        "train.micro_batch_size=2",
        "train.max_steps=2",
        "train.warmup_steps=1",
        "train.eval_every=0",
        "export=false",
        "progress=false",
        "early_stop.enabled=false",
        f"parallel.ep_size={args.ep}",
    ]
    convert(to_config(compose(overrides)))
    peaks["end"] = _peak()
    Path(f"{args.out}.rss{os.environ.get('RANK', '0')}").write_text(json.dumps(peaks))


def run(folder: Path, name: str, ranks: int, full_load: bool = False) -> list[dict]:
    out = folder / name
    command = [__file__, "--worker", "--folder", str(folder), "--out", str(out), "--ep", str(ranks)]
    command += ["--full-load"] if full_load else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    if ranks == 1:
        subprocess.run([sys.executable, *command], check=True, env=env)
    else:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={port}"]
        subprocess.run([*launcher, *command], check=True, env=env)
    return [json.loads(Path(f"{out}.rss{rank}").read_text()) for rank in range(ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--folder")
    parser.add_argument("--out")
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--full-load", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_assets(folder, args)
        sizes = json.loads((folder / "sizes.json").read_text())
        peaks = {
            "single": run(folder, "single", 1),
            "ep2": run(folder, "ep2", 2),
            "ep2_full_load": run(folder, "ep2_full_load", 2, full_load=True),
        }
    gib = 2**30
    experts_gib, others_gib = sizes["expert_params"] * 4 / gib, sizes["other_params"] * 4 / gib
    print(
        f"expert parameters {sizes['expert_params'] / 1e6:.1f}M ({experts_gib:.2f} GiB fp32), others "
        f"{sizes['other_params'] / 1e6:.1f}M ({others_gib:.2f} GiB)"
    )
    single = peaks["single"][0]
    print("| run | process | peak RSS after loading | after training | at the end (final/ written) | vs single |")
    print("|---|---|---:|---:|---:|---:|")
    for name, per_rank in peaks.items():
        for rank, values in enumerate(per_rank):
            cells = " | ".join(f"{values[k] / gib:.2f} GiB" for k in ("loaded", "trained", "end"))
            ratios = "/".join(f"{values[k] / single[k]:.2f}" for k in ("loaded", "trained", "end"))
            print(f"| {name} | {rank} | {cells} | {ratios} |")
    print(json.dumps({"sizes": sizes, "peak_bytes": peaks}))


if __name__ == "__main__":
    main()
