"""Measuring the overlap of expert-parallel collectives honestly (paper Sec. 4, Appendix C; design §4).

For forward and backward separately, the slowest rank's median time of:

- ``T_regular``: stock connectivity, blocking collectives (mode ``regular``);
- ``T_ref``: FarSkip, blocking collectives (mode ``farskip_reference``): the same work as ``T_ovl``, serialised;
- ``T_ovl``: FarSkip, overlapped schedule (mode ``farskip_overlap``);
- ``T_comp``: no communication: every expert local on every rank (an expert-parallel group of one);
- ``T_comm``: the layers' dispatch and combine all-to-alls alone, same sizes.

Effective overlap = (T_ref - T_ovl) / (T_ref - T_comp): the share of the exposed communication the schedule hides.
Step speedup = T_regular / T_ovl, forward + backward. ``--dispatcher dedup`` runs every all-to-all mode with the
deduplicating dispatcher (one row per (token, destination rank)); the result also holds the rows and bytes sent.

Where it runs: one device per rank. On GPUs (NCCL when every local rank has its own GPU, else gloo with CUDA tensors,
e.g. several ranks on one GPU) the times are CUDA-event times (:class:`fcsd.bench.timeline.StepTimer`) and the
model is in bf16 (``--dtype``); under NCCL a profiled run with device activity gives, per step, the communication
kernels' time and the part of it no compute kernel overlaps (``trace``: ``comm_ms``, ``exposed_comm_ms``; ``--trace
DIR`` keeps the traces). On CPU the times are ``perf_counter`` readings. Under gloo (whose waits block the host) the
wait-only overlap, 1 - (time blocked in waits) / T_comm, is reported too (it overstates: collectives also slow the
compute they overlap; an NCCL wait returns at once, so it is not reported there). Run as
``python -m torch.distributed.run --nproc_per_node N -m fcsd.bench.overlap ...`` (``fcsd bench overlap`` does that).

With ``--link BANDWIDTH[,LATENCY]`` every collective goes through a modelled link instead and the figures are those of
:mod:`fcsd.bench.modelled_run` (hidden share, structural limit, schedule efficiency per collective and phase, every
layout): overlap seen without a cluster, CPU contention left out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

import fcsd
from fcsd.bench.timeline import StepTimer, Timeline
from fcsd.connectivity.families import family_for_config, moe_blocks
from fcsd.parallel import collectives
from fcsd.parallel.apply_ep import DISPATCHERS, expert_parallel

CONFIGS = {  # "tiny", "mid": Qwen3-MoE shapes; "mid" is sized so that a layer's compute is not negligible next to
    # its all-to-all. "dsv3": DeepSeek-V3's layer (MLA with low-rank q and kv, 1 shared expert, 256 routed experts
    # top-8 in 8 groups of which 4 are picked) with every width divided by about 28-32 (hidden 7168 -> 256), 6 MoE
    # layers as the paper's short DS-V3 (L=6) of Table 4.
    "tiny": dict(hidden=64, layers=2, experts=8, top_k=2, inter=64, heads=4, batch=2, seq=64),
    "mid": dict(hidden=256, layers=4, experts=8, top_k=2, inter=512, heads=8, batch=2, seq=256),
    "dsv3": dict(hidden=256, layers=6, experts=256, top_k=8, inter=72, heads=8, batch=2, seq=256, family="deepseek_v3"),
}


def build_model(config_name: str | None, model_path: str | None, seed: int = 0):
    """The benchmark's model on every rank (same weights) and its per-rank batch size and sequence length."""
    import transformers

    if model_path:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        return model.eval(), 2, 256
    c = CONFIGS[config_name]
    if c.get("family") == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            vocab_size=1024,
            hidden_size=c["hidden"],
            num_hidden_layers=c["layers"],
            first_k_dense_replace=0,
            num_attention_heads=c["heads"],
            num_key_value_heads=c["heads"],
            q_lora_rank=56,  # DeepSeek-V3: 1536
            kv_lora_rank=16,  # 512
            qk_nope_head_dim=64,  # 128 (128 heads: 8 here)
            qk_rope_head_dim=32,  # 64
            head_dim=32,
            v_head_dim=64,  # 128
            moe_intermediate_size=c["inter"],  # 2048
            intermediate_size=4 * c["inter"],  # the shared expert's width is moe_intermediate_size x n_shared_experts
            n_routed_experts=c["experts"],
            num_experts_per_tok=c["top_k"],
            n_shared_experts=1,
            n_group=8,
            topk_group=4,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            max_position_embeddings=4096,
            attn_implementation="sdpa",
        )
        torch.manual_seed(seed)
        return _spread_routing(transformers.DeepseekV3ForCausalLM(config).eval()), c["batch"], c["seq"]
    config = transformers.Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=c["hidden"],
        num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"],
        num_key_value_heads=c["heads"],
        head_dim=c["hidden"] // c["heads"],
        intermediate_size=c["inter"],
        moe_intermediate_size=c["inter"],
        num_experts=c["experts"],
        num_experts_per_tok=c["top_k"],
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return _spread_routing(transformers.Qwen3MoeForCausalLM(config).eval()), c["batch"], c["seq"]


def _spread_routing(model):
    """Router weights large enough that tokens spread over the experts (a fresh init routes almost uniformly at
    random, but ties and near-ties make the routing of an untrained model depend on rounding)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0.0, 0.5)
    return model


@dataclass
class BenchEnv:
    """Where the benchmark runs: this rank's device, the process-group backend, the weights' dtype."""

    device: torch.device
    backend: str
    dtype: torch.dtype


def plan_device(backend: str, device: str, local_rank: int, local_world: int, gpus: int) -> tuple[str, str]:
    """``(backend, device)`` of a rank: its own GPU (``LOCAL_RANK`` modulo the visible GPUs) when there is one, NCCL
    when every local rank has its own GPU, else gloo (several ranks on one GPU work only with gloo; CPU uses gloo).
    Refuses, in one line, a request the machine cannot meet."""
    if device == "cuda" and gpus == 0:
        raise ValueError("--device cuda: no CUDA device is visible; use --device cpu")
    where = f"cuda:{local_rank % gpus}" if gpus and device != "cpu" else "cpu"
    if backend == "auto":
        backend = "nccl" if where != "cpu" and gpus >= local_world else "gloo"
    if backend == "nccl" and (where == "cpu" or gpus < local_world):
        raise ValueError(
            f"--backend nccl needs one CUDA device per rank ({local_world} ranks, {gpus} GPUs visible): use --backend "
            "gloo (several ranks on one GPU, or CPU)"
        )
    return backend, where


def setup(backend: str = "auto", device: str = "auto", dtype: str = "auto") -> BenchEnv:
    """This rank's device and the process group (:func:`plan_device`); bf16 weights on GPUs, fp32 on CPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend, where = plan_device(backend, device, local_rank, local_world, gpus)
    where = torch.device(where)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    from fcsd.distill.config import process_group_timeout

    dist.init_process_group(backend, device_id=where if backend == "nccl" else None, timeout=process_group_timeout())
    chosen = getattr(torch, dtype) if dtype != "auto" else (torch.bfloat16 if where.type == "cuda" else torch.float32)
    return BenchEnv(where, backend, chosen)


def _slowest(seconds: float, env: BenchEnv) -> float:
    value = torch.tensor([seconds], dtype=torch.float64, device=env.device)  # NCCL reduces device tensors only
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _time_steps(model, input_ids, iters: int, env: BenchEnv, warmup: int = 1, profiler=None):
    """Slowest rank's median forward and backward seconds (CUDA events on GPU, so GPU time, not queueing time)."""
    forward, backward = [], []
    timer = StepTimer(env.device)
    for step in range(warmup + iters):
        dist.barrier()
        timer.mark("forward")
        loss = model(input_ids=input_ids, use_cache=False).logits.float().square().mean()
        timer.mark("backward")
        loss.backward()
        timer.mark("end")
        phases = timer.seconds()
        model.zero_grad(set_to_none=True)
        if profiler is not None:
            profiler.step()
        if step >= warmup:
            forward.append(phases["forward"])
            backward.append(phases["backward"])
    return _slowest(statistics.median(forward), env), _slowest(statistics.median(backward), env)


def _model_for(mode, args, env: BenchEnv, group=None, layout: str = "all_to_all"):
    model, batch, seq = build_model(args.config, args.model)
    model.to(env.device, env.dtype)
    if mode != "regular":
        fcsd.apply_farskip(model, "all")
    node_size = getattr(args, "node_size", None)  # the modelled-link benchmark's arguments have none
    options = {"mode": mode, "layout": layout, "dispatcher": args.dispatcher, "node_size": node_size}
    model = expert_parallel(model, group=group, **options)
    return model, batch, seq


def _comm_only(model, input_ids, iters: int, env: BenchEnv):
    """Dispatch + combine of every MoE layer alone, with the routing the model produces, forward then backward."""
    state = model.fcsd_expert_parallel
    family = family_for_config(model.config)
    captured = []

    def capture(router, args, output):
        ids, weights = family.read_topk(router, output)
        captured.append((args[0].detach(), ids, weights.detach()))

    hooks = [family.router(moe).register_forward_hook(capture) for moe in moe_blocks(model, family).values()]
    with torch.no_grad():
        model(input_ids=input_ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    dispatcher = replace(state.dispatcher, blocking=True)  # the model's kind, groups and node size; fresh counters
    forward, backward = [], []
    timer = StepTimer(env.device)
    for _ in range(iters + 1):
        xs = [x.clone().requires_grad_(True) for x, _, _ in captured]
        dist.barrier()
        timer.mark("forward")
        outs = []
        for x, (_, ids, weights) in zip(xs, captured):
            pending = dispatcher.dispatch_async(x, ids, weights, needs_backward=True)
            outs.append(dispatcher.combine_async(pending.wait().tokens, pending).wait())
        timer.mark("backward")
        torch.stack([o.sum() for o in outs]).sum().backward()
        timer.mark("end")
        phases = timer.seconds()
        forward.append(phases["forward"])
        backward.append(phases["backward"])
    return _slowest(statistics.median(forward[1:]), env), _slowest(statistics.median(backward[1:]), env)


def _exposed_from_trace(model, input_ids, iters: int, env: BenchEnv, trace_dir: str | None, mode: str) -> dict:
    """On CUDA: profile ``iters`` steps with device activity and read, from the kernels, the communication time per
    step that no compute kernel overlaps (:meth:`Timeline.exposed`), and the communication time itself."""
    from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

    handler = tensorboard_trace_handler(f"{trace_dir}/{mode}") if trace_dir else None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], on_trace_ready=handler) as prof:
        _time_steps(model, input_ids, iters, env, warmup=0)
    timeline = Timeline.from_profiler(prof)
    per_step_ms = 1e-3 / iters  # profiler times are microseconds
    return {
        "comm_ms": _slowest(timeline.busy("comm") * per_step_ms, env),
        "exposed_comm_ms": _slowest(timeline.exposed() * per_step_ms, env),
    }


def _trace_only(model, input_ids, iters: int, env: BenchEnv, trace_dir: str, mode: str) -> None:
    from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.device.type == "cuda" else [])
    with profile(activities=activities, on_trace_ready=tensorboard_trace_handler(f"{trace_dir}/{mode}")):
        _time_steps(model, input_ids, iters, env, warmup=0)


def _header(args, env: BenchEnv) -> dict:
    batch, seq = (2, 256) if args.model else (CONFIGS[args.config]["batch"], CONFIGS[args.config]["seq"])
    result = {"ranks": dist.get_world_size(), "config": args.model or args.config, "tokens_per_rank": batch * seq}
    result.update(device=env.device.type, backend=env.backend, dtype=str(env.dtype).removeprefix("torch."))
    return result


def measure(args, env: BenchEnv) -> dict:
    """All figures of the module docstring, as a dict (the same on every rank)."""
    ranks, rank = dist.get_world_size(), dist.get_rank()
    times, traces = {}, {}
    for mode in ("regular", "farskip_reference", "farskip_overlap"):
        model, batch, seq = _model_for(mode, args, env)
        gen = torch.Generator().manual_seed(100 + rank)
        input_ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=gen).to(env.device)
        collectives.WAIT_SECONDS.update(forward=0.0, backward=0.0)
        times[mode] = _time_steps(model, input_ids, args.iters, env)
        if mode == "farskip_overlap":
            waits = {k: _slowest(v / (args.iters + 1), env) for k, v in collectives.WAIT_SECONDS.items()}
            sent = model.fcsd_expert_parallel.dispatcher
            node_size = sent.node_size
            counted = [sent.dispatch_rows_sent, sent.dispatch_bytes_sent, sent.rows_sent, sent.dispatch_inter_rows_sent]
            traffic = torch.tensor(counted, dtype=torch.float64).to(env.device)
            dist.all_reduce(traffic)
            comm = _comm_only(model, input_ids, args.iters, env)
        if env.backend == "nccl" and mode != "regular":  # gloo has no communication kernels to read
            traces[mode] = _exposed_from_trace(model, input_ids, args.iters, env, args.trace, mode)
        elif args.trace:
            _trace_only(model, input_ids, args.iters, env, args.trace, mode)
    singles = [dist.new_group([r]) for r in range(ranks)]
    model, batch, seq = _model_for("farskip_overlap", args, env, group=singles[rank])
    times["compute_only"] = _time_steps(model, input_ids, args.iters, env)
    result = _header(args, env)
    steps = args.iters + 1  # the overlapped model's forwards (warm-up included), summed over ranks
    result.update(dispatcher=args.dispatcher, dispatch_rows_per_step=float(traffic[0]) / steps)
    result.update(dispatch_bytes_per_step=float(traffic[1]) / steps, rows_per_step=float(traffic[2]) / steps)
    result.update(node_size=node_size)
    result.update(dispatch_rows_crossing_nodes_per_step=float(traffic[3]) / steps)
    waits_meaningful = env.backend == "gloo"  # gloo waits block the host; an NCCL wait returns at once
    for index, phase in enumerate(("forward", "backward")):
        t_reg, t_ref, t_ovl = (times[m][index] for m in ("regular", "farskip_reference", "farskip_overlap"))
        t_comp, t_comm = times["compute_only"][index], comm[index]
        exposed = t_ref - t_comp
        result[phase] = {
            "T_regular_ms": 1e3 * t_reg,
            "T_ref_ms": 1e3 * t_ref,
            "T_ovl_ms": 1e3 * t_ovl,
            "T_comp_ms": 1e3 * t_comp,
            "T_comm_ms": 1e3 * t_comm,
            "effective_overlap": (t_ref - t_ovl) / exposed if exposed > 0 else float("nan"),
            "wait_only_overlap": 1.0 - waits[phase] / t_comm if t_comm > 0 and waits_meaningful else float("nan"),
        }
    total = {m: sum(times[m]) for m in times}
    result["step_speedup_over_regular"] = total["regular"] / total["farskip_overlap"]
    result["step_speedup_over_farskip_reference"] = total["farskip_reference"] / total["farskip_overlap"]
    if traces:  # per step, forward + backward, slowest rank: read from the device kernels of the trace
        result["trace"] = traces
    return result


def format_table(result: dict) -> str:
    """The figures as a small text table."""
    where = f" on {result['device']} ({result['backend']}, {result['dtype']})" if "device" in result else ""
    lines = [f"ranks={result['ranks']} model={result['config']} tokens/rank={result['tokens_per_rank']}{where}"]
    if "dispatcher" in result:
        lines.append(
            f"dispatcher={result['dispatcher']}: per step, all ranks, remote rows dispatched "
            f"{result['dispatch_rows_per_step']:.0f} ({result['dispatch_bytes_per_step'] / 1e6:.3f} MB), "
            f"dispatch + combine rows {result['rows_per_step']:.0f}"
        )
        if result.get("node_size", result["ranks"]) < result["ranks"]:
            lines.append(
                f"nodes of {result['node_size']} ranks: remote rows dispatched across nodes "
                f"{result['dispatch_rows_crossing_nodes_per_step']:.0f} per step"
            )
    keys = ("T_regular_ms", "T_ref_ms", "T_ovl_ms", "T_comp_ms", "T_comm_ms", "effective_overlap", "wait_only_overlap")
    lines.append(f"{'':10}" + "".join(f"{k:>19}" for k in keys))
    for phase in ("forward", "backward"):
        lines.append(f"{phase:10}" + "".join(f"{result[phase][k]:>19.3f}" for k in keys))
    lines.append(f"step speedup of farskip_overlap over regular: {result['step_speedup_over_regular']:.3f}")
    lines.append(f"step speedup over farskip_reference: {result['step_speedup_over_farskip_reference']:.3f}")
    for mode, figures in result.get("trace", {}).items():
        lines.append(
            f"trace, {mode}: communication kernels {figures['comm_ms']:.3f} ms per step, "
            f"{figures['exposed_comm_ms']:.3f} ms of it with no compute kernel alongside"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    from fcsd.stopping import die_with_parent

    die_with_parent()  # a rank never outlives the command that started it (torchrun passes stops on; a kill -9 not)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--model", default=None, help="a saved (MoE) causal LM folder instead of --config")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--trace", default=None, help="folder for torch.profiler traces")
    parser.add_argument("--dispatcher", choices=sorted(DISPATCHERS), default="plain")
    parser.add_argument("--node-size", type=int, default=None, help="ranks per stand-in node (default: all)")
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--link", default=None, help="a modelled link, BANDWIDTH[,LATENCY] or a preset")
    parser.add_argument("--timeline", action="store_true", help="with --link: record one step per mode and rank")
    args = parser.parse_args(argv)
    env = setup(args.backend, args.device, args.dtype)
    if env.device.type == "cpu":
        torch.set_num_threads(1)
    if args.link:
        from fcsd.bench.modelled_run import measure_link

        result = _header(args, env)
        result.update(measure_link(args, env, lambda mode, layout: _model_for(mode, args, env, layout=layout)))
    else:
        result = measure(args, env)
    if dist.get_rank() == 0:
        if args.json_out:
            with open(args.json_out, "w") as handle:
                json.dump(result, handle, indent=1)
        else:
            print(format_result(result))
    dist.destroy_process_group()


def format_result(result: dict) -> str:
    """The text tables of a result: the modelled-link figures when it was measured with ``--link``."""
    if "link" in result:
        from fcsd.bench.modelled_run import format_link_table

        where = f"ranks={result['ranks']} model={result['config']} tokens/rank={result['tokens_per_rank']} on "
        return f"{where}{result['device']} ({result['backend']}, {result['dtype']})\n" + format_link_table(result)
    return format_table(result)


def run_overlap_benchmark(
    ranks: int,
    config: str = "tiny",
    model: str | None = None,
    iters: int = 5,
    trace=None,
    dispatcher: str = "plain",
    device: str = "auto",
    backend: str = "auto",
    dtype: str = "auto",
    link: str | None = None,
    timeline: bool = False,
    node_size: int | None = None,
):
    """Launch the benchmark on ``ranks`` local processes (torchrun): one GPU each when there are enough (NCCL), else
    gloo (CPU, or several ranks sharing a GPU); returns the result dict. With ``link`` (``--link`` text) the schedules
    run over that modelled link instead (:mod:`fcsd.bench.modelled_run`; ``timeline``: one recorded step per mode
    and rank; ``node_size``: ranks per stand-in node, for the node-aware dispatcher and the count of rows crossing
    nodes). Bad input (rank count, model, link, node size) is refused here, in one line, before any process starts."""
    import socket
    import sys
    import tempfile

    from fcsd.stopping import run_child

    shape = CONFIGS[config]
    moe_layers, hidden, top_k, tokens = shape["layers"], shape["hidden"], shape["top_k"], shape["batch"] * shape["seq"]
    num_experts = shape["experts"]
    if model:  # a local folder, a hub id or demo; its config alone says how many experts it has
        from fcsd.loading import load_config
        from fcsd.model_summary import summarize
        from fcsd.sources import resolve_model

        model = resolve_model(model)
        summary = summarize(model)
        num_experts, moe_layers, top_k, tokens = summary.num_experts, len(summary.moe_layers), summary.top_k, 512
        hidden = load_config(model).get_text_config().hidden_size
    if ranks < 1 or num_experts % ranks:
        raise ValueError(f"--ranks {ranks}: it must be at least 1 and divide the model's {num_experts} experts")
    if node_size is not None and (node_size < 1 or ranks % min(node_size, ranks)):
        raise ValueError(f"--node-size {node_size}: it must be at least 1 and divide --ranks {ranks} (whole nodes)")
    if link:
        from fcsd.bench.modelled_link import parse_link
        from fcsd.bench.modelled_run import check_link_time, link_time

        spec = parse_link(link)
        if spec.preset is None:  # a preset is scaled to this device's speed: its transfers keep pace with compute
            steps = 1 + iters + (1 if timeline else 0)
            byte_size = 2.0 if dtype == "bfloat16" else 4.0
            check_link_time(link, link_time(spec, ranks, moe_layers, tokens, hidden, top_k, steps, byte_size))
        if trace:
            raise ValueError("--trace profiles the real collectives; over a modelled --link use --timeline FILE.png")
    elif timeline:
        raise ValueError("--timeline draws the transfers of a modelled link: add --link, e.g. --link 1GB/s")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "result.json")
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={port}"]
        command += ["-m", "fcsd.bench.overlap", "--config", config, "--iters", str(iters), "--json-out", out]
        command += ["--model", model] if model else []
        command += ["--trace", trace] if trace else []
        command += ["--dispatcher", dispatcher, "--device", device, "--backend", backend, "--dtype", dtype]
        command += ["--node-size", str(node_size)] if node_size else []
        command += ["--link", link] if link else []
        command += ["--timeline"] if timeline else []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
        run_child(command, env=env)  # a stop reaches every rank (torchrun passes it on), none outlives the command
        with open(out) as handle:
            return json.load(handle)


if __name__ == "__main__":
    main()
