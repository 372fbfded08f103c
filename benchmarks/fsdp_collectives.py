"""FSDP2 collectives per decoder layer of one training step under ``parallel.fsdp=true`` (design §4 "EP at scale";
:mod:`fcsd.parallel.layout`): on GPUs each is latency-bound when its unit is small (a norm, a router), so the layout
groups a layer's small modules into one unit.

Two gloo processes (FSDP 2, no EP) run one forward and backward of tiny FarSkip models (every layer MoE, mode
``farskip_overlap``) laid out by :func:`fcsd.parallel.layout.parallelize`; every call of the ``torch.distributed``
collectives FSDP2 issues (all-gathers, reduce-scatters, all-reduces) is counted. Per layer is the difference between
a 4-layer and a 2-layer model, halved; the rest (embeddings, ``[final norm, LM head]``, root) is what remains.

    python benchmarks/fsdp_collectives.py [--json FILE]

"before" is the figure of the unit split up to commit e3874b2 (a unit per router, shared expert, shared-expert gate
and post-attention norm), measured with this script on that commit; "after" is measured now.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

FAMILIES = ("qwen2_moe", "qwen3_moe", "deepseek_v3")
BEFORE = {"qwen2_moe": 18, "qwen3_moe": 12, "deepseek_v3": 15}  # per layer, measured on commit e3874b2
KINDS = (
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_reduce",
)


def tiny_model(family: str, layers: int):
    """A tiny random ``family`` model of ``layers`` MoE layers, FarSkip-converted (every layer)."""
    import torch
    import transformers

    import fcsd

    common = dict(vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers)
    common.update(max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0, moe_intermediate_size=16)
    if family == "qwen2_moe":
        cls, config = (
            transformers.Qwen2MoeForCausalLM,
            transformers.Qwen2MoeConfig(
                **common, intermediate_size=48, num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=24
            ),
        )
    elif family == "qwen3_moe":
        cls, config = (
            transformers.Qwen3MoeForCausalLM,
            transformers.Qwen3MoeConfig(
                **common, head_dim=8, intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
            ),
        )
    else:
        common.update(num_key_value_heads=4, intermediate_size=48, n_routed_experts=8, n_shared_experts=1)
        common.update(num_experts_per_tok=2, norm_topk_prob=True)
        common.update(first_k_dense_replace=0, kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4)
        common.update(qk_nope_head_dim=4, v_head_dim=8, head_dim=4, n_group=4, topk_group=2)
        cls, config = transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config(**common)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config)
    fcsd.apply_farskip(model, "all")
    return model.train()


@contextlib.contextmanager
def counting(counts: dict):
    """Count the calls of the ``torch.distributed`` collectives in :data:`KINDS` (the outermost call only)."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in KINDS if hasattr(dist, name)}
    depth = [0]

    def counted(name, fn):
        def call(*args, **kwargs):
            if not depth[0]:
                counts[name] = counts.get(name, 0) + 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def step_collectives(family: str, layers: int) -> dict:
    """The collectives (by kind) of one training forward and backward of ``family`` with ``layers`` layers, laid out
    FSDP over every process."""
    import torch
    import torch.distributed as dist

    from fcsd.parallel.layout import ParallelDims, build_meshes, parallelize

    model = tiny_model(family, layers)
    parallelize(model, build_meshes(ParallelDims(dist.get_world_size(), 1, True), "cpu"), "student")
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=ids, use_cache=False).logits.float().pow(2).mean().backward()  # warm-up: FSDP2's lazy init
    model.zero_grad()
    with counting({}) as counts:
        model(input_ids=ids, use_cache=False).logits.float().pow(2).mean().backward()
    return counts


def measure() -> dict:
    """Per family: collectives per layer (by kind and in total) and outside the layers, on this process."""
    results = {}
    for family in FAMILIES:
        two, four = step_collectives(family, 2), step_collectives(family, 4)
        per_kind = {kind: (four.get(kind, 0) - two.get(kind, 0)) / 2 for kind in sorted(set(two) | set(four))}
        total = sum(per_kind.values())
        results[family] = {"per_layer": total, "per_layer_by_kind": per_kind, "rest": sum(two.values()) - 2 * total}
    return results


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--out", help=argparse.SUPPRESS)  # a worker's: write <out>.<rank>.json
    args = parser.parse_args()
    if "RANK" in os.environ:  # a worker of the launch below
        import torch.distributed as dist

        dist.init_process_group("gloo")
        results = measure()
        Path(f"{args.out}.{dist.get_rank()}.json").write_text(json.dumps(results))
        dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "counts")
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([*command, __file__, "--out", out], check=True, env=env)
        ranks = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(2)]
    if ranks[0] != ranks[1]:
        raise SystemExit(f"the two processes counted differently: {ranks}")
    results = ranks[0]
    print("FSDP2 collectives per decoder layer, one training step (FSDP 2 on 2 gloo processes)")
    print(f"{'family':<12} {'before':>7} {'after':>6}  after by kind; outside the layers")
    for family, result in results.items():
        kinds = ", ".join(f"{kind} {count:g}" for kind, count in result["per_layer_by_kind"].items() if count)
        print(f"{family:<12} {BEFORE[family]:>7} {result['per_layer']:>6g}  {kinds}; rest {result['rest']:g}")
    if args.json:
        Path(args.json).write_text(json.dumps({"before": BEFORE, "after": results}, indent=1))


if __name__ == "__main__":
    main()
