"""Rows and bytes that cross nodes: the real plain, deduplicating and node-aware dispatchers (fcsd.parallel) on gloo
ranks standing in for nodes, on DeepSeek-V3's group-limited routing laid out with an expert group per node
(design §4 "EP across nodes"; DeepSeek-V3 report: node-limited routing, each token reaches at most 4 nodes).

    python benchmarks/node_dispatch.py [--ep 16 --node-size 2] [--step-tokens 4096] [--layers 4]

One launch of ``--ep`` CPU gloo processes (torchrun), cut into nodes of ``--node-size`` consecutive ranks. Routes
come from transformers' own DeepSeek-V3 router (``DeepseekV3TopkRouter``: sigmoid scores, the top ``topk_group`` of
``n_group`` expert groups by their two best scores, then the top-k experts inside them) with random weights, on
random hidden states of one held-out-sized step of ``--step-tokens`` tokens split over the ranks, for ``--layers``
layers (a router each). The experts are scaled down from V3's 256 (``--experts``, top ``--top-k``), in ``n_group`` =
the node count groups, so that a group is a node, as V3 lays them out; ``--topk-group`` (V3: 4) against no limit
(every group). Each layer's routes go through each dispatcher (dispatch + combine, identity experts). Reported, summed
over ranks and layers: rows and bytes of the dispatch that cross nodes and that stay inside them, the ratio of the
node-aware dispatcher's node-crossing rows to plain's, and the mean nodes a token reaches. CPU seconds are not
reported: the processes share two cores and no network.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path


def _routes(args, nodes: int, topk_group: int):
    """(layers, tokens, top_k) expert ids and weights from DeepSeek-V3's router, the same on every rank."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(
        hidden_size=args.hidden, n_routed_experts=args.experts, num_experts_per_tok=args.top_k, n_group=nodes,
        topk_group=topk_group, norm_topk_prob=True,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    ids, weights = [], []
    for _ in range(args.layers):
        router = DeepseekV3TopkRouter(config)
        router.weight.data = torch.randn(router.weight.shape, generator=generator) / args.hidden**0.5
        hidden = torch.randn(args.step_tokens, args.hidden, generator=generator)
        _, layer_weights, layer_ids = router(hidden)
        ids.append(layer_ids)
        weights.append(layer_weights)
    return ids, weights


def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    from fcsd.parallel.dispatchers import AllToAllDispatcher, DedupAllToAllDispatcher
    from fcsd.parallel.hierarchical import HierarchicalDispatcher, node_and_rail_groups

    dist.init_process_group("gloo")
    rank, ep = dist.get_rank(), dist.get_world_size()
    nodes = ep // args.node_size
    node_group, rail_group = node_and_rail_groups(None, args.node_size)
    mine = torch.arange(args.step_tokens).tensor_split(ep)[rank]  # contiguous slices (plain sequence parallelism)
    local = args.experts // ep
    out = {}
    for limit in (args.topk_group, nodes):
        ids, weights = _routes(args, nodes, limit)
        x = torch.randn(mine.numel(), args.hidden)
        row = {}
        for kind in ("plain", "dedup", "hierarchical"):
            common = {"num_local_experts": local, "node_size": args.node_size}
            if kind == "hierarchical":
                dispatcher = HierarchicalDispatcher(**common, node_group=node_group, rail_group=rail_group)
            else:
                dispatcher = {"plain": AllToAllDispatcher, "dedup": DedupAllToAllDispatcher}[kind](**common)
            for layer_ids, layer_weights in zip(ids, weights, strict=True):
                pending = dispatcher.dispatch_async(x, layer_ids[mine], layer_weights[mine])
                rows = pending.wait()
                dispatcher.combine_async(rows.tokens * rows.weights, pending).wait()
            d = dispatcher
            totals = [
                d.dispatch_rows_sent,
                d.dispatch_bytes_sent,
                d.dispatch_inter_rows_sent,
                d.dispatch_inter_bytes_sent,
            ]
            totals = torch.tensor(totals, dtype=torch.float64)
            dist.all_reduce(totals)
            rows_sent, bytes_sent, inter_rows, inter_bytes = (int(v) for v in totals.tolist())
            row[kind] = {
                "inter_rows": inter_rows,
                "inter_bytes": inter_bytes,
                "intra_rows": rows_sent - inter_rows,
                "intra_bytes": bytes_sent - inter_bytes,
            }
        reach = torch.cat(ids) // (args.experts // nodes)  # the node of each selected expert
        row["nodes_per_token"] = sum(len(set(r)) for r in reach.tolist()) / reach.shape[0]
        out[f"topk_group={limit}"] = row
    if rank == 0:
        Path(args.json_out).write_text(json.dumps(out))
    dist.destroy_process_group()


def _launch(args) -> dict:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={args.ep}",
            f"--master_port={port}",
        ]
        command += [__file__, "--worker", "--json-out", str(out)]
        for key in ("node_size", "step_tokens", "layers", "experts", "top_k", "topk_group", "hidden"):
            command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, default=16, help="processes (one expert-parallel group)")
    parser.add_argument("--node-size", type=int, default=2, help="processes per node (ep / node-size nodes)")
    parser.add_argument("--step-tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64, help="routed experts (DeepSeek-V3: 256)")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token (DeepSeek-V3: 8)")
    parser.add_argument("--topk-group", type=int, default=4, help="groups (= nodes) a token may reach (V3: 4)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size on the wire (fp32)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    if args.ep % args.node_size or args.experts % args.ep:
        parser.error("--node-size must divide --ep, and --ep must divide --experts")
    results = _launch(args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    nodes = args.ep // args.node_size
    print(f"EP {args.ep} = {nodes} nodes x {args.node_size}; {args.experts} experts top-{args.top_k} in {nodes} groups")
    print(
        "| routing | nodes/token | dispatcher | rows across nodes | MB across | rows inside nodes | MB inside "
        "| across vs plain |"
    )
    print("|---" * 8 + "|")
    for name, row in results.items():
        plain = row["plain"]["inter_rows"]
        for kind in ("plain", "dedup", "hierarchical"):
            r = row[kind]
            print(
                f"| {name} | {row['nodes_per_token']:.2f} | {kind} | {r['inter_rows']:,} "
                f"| {r['inter_bytes'] / 1e6:.3f} | {r['intra_rows']:,} | {r['intra_bytes'] / 1e6:.3f} "
                f"| {r['inter_rows'] / max(plain, 1):.3f}x |"
            )


if __name__ == "__main__":
    main()
