"""`fcsd plan`: the estimate against measured CPU runs (one process, two expert-parallel gloo processes, and four
processes laid out as EP 2 x FSDP 2 with and without checkpointing, EP 4 and FSDP2 alone: what `--measure` runs),
three families, layer stacks deep enough for the depth reduction), the depth reduction against a whole-stack
simulation, the candidate search and what it implies, the EP-beside-FSDP2 choice and its reason, the layer
recommendation, the commands (EP x FSDP2 launches and the multi-process teacher cache accepted by convert's parser),
--probe and --json, and the paper models' claims (an EP x FSDP2 layout fits DeepSeek-V2-Lite on 1 x 8 H100, Llama-4
Scout on 2 x 8 H200, DeepSeek-V3 on 16 x 8 H200), each simulated through its own layout; EP groups beyond a node
(candidates, simulated, launched with the node-aware dispatcher), the routing reach against counting every route,
the node-aware dispatch's price against a hand computation, the breakdown adding up to the step, and DeepSeek-V3's
fastest EP size spanning nodes."""

from __future__ import annotations

import json

import pytest
import torch
from shell_commands import check_command
from tiny_models import CONFIGS, save_chat_model

from fcsd.distill.config import FCSDConfig
from fcsd.plan.cluster import GPU, Cluster, make_cluster
from fcsd.plan.run import Layout
from fcsd.plan.simulate import estimate_step, simulate

FAMILIES = ["deepseek_v2", "qwen3_moe", "llama4_text"]
TOLERANCE = 0.10  # the bound: estimated peak within 10% of the measured one


def deep_config(family: str, layers: int = 5):
    """The tiny config of ``family`` with ``layers`` layers (runs longer than the depth reduction keeps)."""
    _, config = CONFIGS[family]()
    values = config.to_dict()
    for derived in ("layer_types", "no_rope_layers", "moe_layers", "model_type"):
        values.pop(derived, None)
    values["num_hidden_layers"] = layers
    return type(config)(**values)


def run_config(seq_len: int = 32, sequences: int = 4, layers: str = "last:50%") -> FCSDConfig:
    config = FCSDConfig()
    config.data.path = "unused"
    config.data.seq_len, config.train.batch_tokens = seq_len, seq_len * sequences
    config.train.loss_chunk_size = 8
    config.farskip.layers = layers
    return config


def check(estimate, measured) -> None:
    for m in measured:
        assert abs(estimate.peak / m.peak - 1) <= TOLERANCE, (estimate.layout.name, estimate.peak, m.peak)
    assert estimate.weights == measured[0].weights  # exact: the same parameters and buffers
    assert estimate.optimizer == measured[0].optimizer  # exact: AdamW's moments and step counters


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "layout",
    [Layout("single", 1, micro_batch=2), Layout("single", 1, teacher="cache", gradient_checkpointing=True)],
    ids=["online-mb2", "cache-ckpt"],
)
def test_estimate_matches_a_measured_step_on_one_process(family, layout):
    from fcsd.plan.measure import measure_processes

    model_config, config = deep_config(family), run_config()
    estimate = estimate_step(model_config, config, layout, "cpu")
    check(estimate, measure_processes(model_config, config, layout))


def test_estimate_matches_measured_steps_of_two_expert_parallel_processes():
    from fcsd.plan.measure import measure_jobs

    layout = Layout("ep", 2, ep_size=2, micro_batch=2)
    jobs = [(deep_config(family), run_config(seq_len=64), layout) for family in FAMILIES]
    for job, measured in zip(jobs, measure_jobs(jobs), strict=True):
        check(estimate_step(*job, "cpu"), measured)


@pytest.mark.parametrize("layout", [Layout("single", 1), Layout("ep", 2, ep_size=2, micro_batch=2)], ids=str)
def test_depth_reduction_equals_the_whole_stack(layout):
    """The few-layer simulations give what simulating every layer gives (static bytes, phase peaks, FLOPs)."""
    model_config, config = deep_config("qwen3_moe", layers=9), run_config()
    reduced = estimate_step(model_config, config, layout, "cuda")
    whole = simulate(model_config, config, layout, "cuda", tuple(range(9)))
    assert reduced.peak == pytest.approx(max(p["peak"] for p in whole["phases"].values()), rel=1e-3)
    assert reduced.weights == whole["static"]["weights"] and reduced.optimizer == whole["static"]["optimizer"]
    assert sum(reduced.flops.values()) == pytest.approx(sum(whole["flops"].values()), rel=1e-6)
    assert 0 < reduced.expert_flops == pytest.approx(whole["expert_flops"], rel=1e-6)  # priced at their own rate


def test_the_search_implies_only_what_simulations_confirm():
    """Candidates the search did not simulate are decided by implication; simulating them agrees."""
    from fcsd.plan.candidates import parameter_counts, search

    model_config, config = deep_config("qwen3_moe"), run_config()
    probe = estimate_step(model_config, config, Layout("single", 1, micro_batch=2), "cuda").peak
    cluster = Cluster(GPU("test", probe / 2**30, 100.0, 100.0, 10.0), gpus_per_node=1, reserve_gib=0, margin=0)
    result = search(model_config, config, cluster, parameter_counts(model_config), True)
    implied = [c for c in result.candidates if c.estimate is None and c.status in ("fits", "dominated")]
    simulated = [c for c in result.candidates if c.estimate is not None]
    assert implied and simulated and {c.status for c in result.candidates} >= {"fits", "exceeds"}
    for candidate in implied[:3]:
        peak = estimate_step(model_config, config, candidate.layout, "cuda").peak
        assert (peak <= cluster.budget) == (candidate.status == "fits"), (candidate.layout.name, candidate.note)


def test_layer_recommendation_follows_the_budget_or_the_probe():
    from fcsd.plan.layers import LayerOption, recommend

    options = [LayerOption(s, list(range(n)), 1 + n / 100, 1 + n / 50) for s, n in (("last:50%", 4), ("all", 8))]
    assert recommend(options, 2e9)[0].spec == "last:50%"
    assert recommend(options, 1e10)[0].spec == "all"
    options[0].kl, options[1].kl = 0.1, 1.0
    chosen, reason = recommend(options, 1e10)
    assert chosen.spec == "last:50%" and "0.250" in reason  # a quarter of all's KL
    assert recommend(options, 1e10, max_kl=2.0)[0].spec == "all"


def test_fused_adamw_only_for_groups_on_gpus():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fcsd.distill.optim import fuse_on_gpu

    with FakeTensorMode():
        gpu = torch.nn.Parameter(torch.empty(4, device="cuda"))
        cpu = torch.nn.Parameter(torch.empty(4))
        optimizer = torch.optim.AdamW([{"params": [gpu]}, {"params": [cpu]}])
        optimizer.state[gpu]["step"] = torch.tensor(3.0)  # as a restored checkpoint leaves it: on the CPU
        fuse_on_gpu(optimizer)
    assert [g["fused"] for g in optimizer.param_groups] == [True, None]
    step = optimizer.state[gpu]["step"]
    assert step.device.type == "cuda" and step.dtype == torch.float32  # what the fused kernel requires


def test_fully_converted_layers_stay_wrappable_by_accelerate():
    """accelerate's FSDP wrap policy finds decoder layers by the class names in _no_split_modules: with every layer
    converted the stock name is gone, so the FarSkip one must be listed (else `accelerate launch` FSDP fails)."""
    from accelerate.utils.dataclasses import get_module_class_from_name

    import fcsd

    model_class, config = CONFIGS["mixtral"]()
    model = model_class(config)
    stock = {name: dict(m.__dict__) for name, m in model.named_modules()}
    fcsd.apply_farskip(model, "all")
    assert all(get_module_class_from_name(model, name) is not None for name in model._no_split_modules)
    assert get_module_class_from_name(model, "MixtralDecoderLayer") is None  # why the names must follow
    fcsd.apply_farskip(model, "last:1")  # partly converted: both names
    assert set(model._no_split_modules) == {"MixtralDecoderLayer", "FarSkipMixtralDecoderLayer"}
    fcsd.remove_farskip(model)
    for name, module in model.named_modules():  # every instance attribute as it was, values and absences
        assert module.__dict__.get("_no_split_modules", "absent") == stock[name].get("_no_split_modules", "absent")
        assert "_farskip_stock_no_split" not in module.__dict__


def accepted_by_convert(line: str):
    """The config ``fcsd convert`` hands its trainer for a printed command line: the launcher's parser, fcsd's
    parser, overrides and checks (tests/shell_commands.py, which checks the manual's commands too)."""
    checked = check_command(line)
    assert checked.job == "fcsd.distill.convert.convert", checked.job
    return checked.config


PAPER_LAYOUTS = [  # (model, GPU, nodes, an EP x FSDP2 layout the plan finds fitting there)
    ("deepseek_v2_lite", "h100", 1, Layout("ep_fsdp", 8, 8, "online", 2, True)),
    ("llama4_scout", "h200", 2, Layout("ep_fsdp", 16, 8, "online", 1, True)),
]


@pytest.mark.parametrize("model,gpu,nodes,layout", PAPER_LAYOUTS, ids=[m for m, *_ in PAPER_LAYOUTS])
def test_paper_models_fit_with_ep_x_fsdp2(model, gpu, nodes, layout):
    """The issue's "done when", layout by layout: the plan's defaults (every parameter trains, fp32 master weights,
    AdamW, 2e9 tokens) from a local config.json; the step simulated through the trainer's own layout (EP x FSDP2
    over a fake process group of all the GPUs, the teacher laid out as the student, checkpointing replaying the
    exchanges) fits the GPU's budget, and every process holds a W-th of the student (nothing whole)."""
    from fcsd.plan.candidates import parameter_counts
    from fcsd.plan.model_configs import load_model_config
    from fcsd.plan.planner import run_config as plan_config

    source = load_model_config(model)
    cluster = make_cluster(gpu, 8, nodes)
    config, _, _ = plan_config(source, [], 2e9, cluster)
    estimate = estimate_step(source.config, config, layout)
    assert estimate.peak <= cluster.budget, (estimate.peak / 2**30, cluster.budget / 2**30)
    total = parameter_counts(source.config).total
    assert estimate.weights == pytest.approx(4 * total / layout.processes, rel=0.02)  # fp32 shard, FSDP2's padding
    assert estimate.optimizer == pytest.approx(2 * estimate.weights, rel=0.01)  # AdamW's two moments
    assert estimate.teacher == pytest.approx(estimate.weights / 2, rel=0.02)  # the bf16 teacher, sharded the same


def test_deepseek_v3_on_16_nodes_misses_by_what_more_gpus_cannot_shard():
    """DeepSeek-V3 on 16 x 8 H200 with EP 8 x FSDP 16, the frugal step (cached teacher, micro-batch 1,
    checkpointing) with the replay kept on the GPU: the static bytes fit (a 128th of the model), but more than half a
    GPU goes to what checkpointing under EP keeps (each layer's inputs and the rows its Dispatch and Combine received,
    for the replay), which grows with the tokens of a micro-batch, not with the model's share: the step does not fit
    (train.checkpoint_offload is what fits it, below), and the plan must say so rather than claim a fit."""
    from fcsd.plan.model_configs import load_model_config
    from fcsd.plan.planner import run_config as plan_config

    source = load_model_config("deepseek-v3")
    cluster = make_cluster("h200", 8, 16)
    config, _, _ = plan_config(source, [], 2e9, cluster)
    layout = Layout("ep_fsdp", 128, 8, "cache", 1, True)
    estimate = estimate_step(source.config, config, layout)
    static = estimate.weights + estimate.gradients + estimate.optimizer + estimate.teacher
    assert static < cluster.budget < estimate.peak
    assert estimate.peak - static > cluster.budget / 2  # the saved rows of 58 MoE layers, the layer inputs, ...
    assert estimate.activations > cluster.budget / 2


OFFLOADED_LAYOUTS = [  # (model, GPU, nodes, the frugal EP x FSDP2 step with its replayed rows in host memory)
    ("qwen3_30b_a3b", "h100", 1, Layout("ep_fsdp", 8, 8, "cache", 1, True, offload=True)),
    ("deepseek-v3", "h200", 16, Layout("ep_fsdp", 128, 8, "cache", 1, True, offload=True)),
]


@pytest.mark.parametrize("model,gpu,nodes,layout", OFFLOADED_LAYOUTS, ids=[m for m, *_ in OFFLOADED_LAYOUTS])
def test_checkpoint_offload_fits_expert_parallelism_where_the_replay_did_not(model, gpu, nodes, layout):
    """The issue's "done when" for the two models whose EP layouts missed (Qwen3-30B-A3B on 1 x 8 H100 by 3.4 GiB,
    DeepSeek-V3 on 16 x 8 H200 by 29 GiB): with train.checkpoint_offload the rows each Dispatch and Combine received
    wait in host memory (charged there, not to the GPU), the step fits, and a node's GPUs pin less host memory than
    the plan allows; the same step keeping them on the GPU does not fit."""
    from dataclasses import replace

    from fcsd.plan.model_configs import load_model_config
    from fcsd.plan.planner import run_config as plan_config

    source = load_model_config(model)
    cluster = make_cluster(gpu, 8, nodes)
    config, _, _ = plan_config(source, [], 2e9, cluster)
    offloaded = estimate_step(source.config, config, layout)
    kept = estimate_step(source.config, config, replace(layout, offload=False))
    assert offloaded.peak <= cluster.budget < kept.peak, (offloaded.peak / 2**30, kept.peak / 2**30)
    assert kept.host == 0 and 0 < offloaded.host * cluster.gpus_per_node <= cluster.host_budget
    assert kept.peak - offloaded.peak > offloaded.host / 2  # the rows left the GPU (one layer's come back at a time)


def test_host_memory_and_link_options_decide_the_offloaded_layout():
    """``--host-memory`` bounds what a node's GPUs may pin for the replayed rows (half of it): below what the
    offloaded Qwen3-30B-A3B step pins, the layout is refused naming the option; ``--host-gbps`` prices the copies:
    a slower host link exposes more of them per step; the prefetched replay hides the way back behind the backward
    but for the first layer's rows, and what a layer's copy takes beyond a layer's backward."""
    from fcsd.plan.candidates import _simulated
    from fcsd.plan.model_configs import load_model_config
    from fcsd.plan.planner import run_config as plan_config
    from fcsd.plan.timing import offload_exposure

    source = load_model_config("qwen3_30b_a3b")
    layout = OFFLOADED_LAYOUTS[0][3]
    roomy = make_cluster("h100", 8, 1)
    config, _, _ = plan_config(source, [], 2e9, roomy)
    fits = _simulated(source.config, config, layout, roomy)
    assert fits.status == "fits", fits
    pinned_gib = fits.estimate.host * roomy.gpus_per_node / 2**30
    tight = make_cluster("h100", 8, 1, host_memory=f"{pinned_gib:.3f}GiB")  # pins at most half: too little
    refused = _simulated(source.config, config, layout, tight)
    assert refused.status == "exceeds" and "(--host-memory)" in refused.note, refused
    assert fits.estimate.peak <= tight.budget  # refused for the host, not for the GPU
    slow = make_cluster("h100", 8, 1, host_gbps=roomy.gpu.host_gbps / 10)
    compute = 1.0
    fast_wait = offload_exposure(fits.estimate.host, compute, roomy)
    slow_wait = offload_exposure(fits.estimate.host, compute, slow)
    assert slow_wait > 5 * fast_wait > 0
    copy = fits.estimate.host / (slow.gpu.host_gbps * 1e9)
    assert slow_wait >= copy  # without the prefetch the way back is never hidden
    # the prefetched replay (48 layers): each layer's rows come back behind a layer's backward, but the first one's
    prefetched = offload_exposure(fits.estimate.host, compute, slow, 48, backward_compute=2 * copy)
    assert prefetched == pytest.approx(slow_wait - copy + copy / 48)
    starved = offload_exposure(fits.estimate.host, compute, slow, 48, backward_compute=copy / 2)
    assert starved == pytest.approx(prefetched + (copy / 2) * 47 / 48)


def test_plan_cli_json_with_probe(tmp_path, capsys):
    from fcsd.cli import main

    rows = [
        {"messages": [{"role": "user", "content": f"add {i} and {i}"}, {"role": "assistant", "content": str(2 * i)}]}
        for i in range(40)
    ]
    save_chat_model(tmp_path / "model", rows, vocab_size=120)
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["plan", str(tmp_path / "model"), "--gpus-per-node", "2", "--tokens", "1e6", "data.seq_len=32"]
    assert main([*argv, "--probe", str(data), "--layers", "last:1", "all", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and [o["spec"] for o in plan["layers"]] == ["last:1", "all"]
    assert all(o["kl"] is not None and o["kl"] >= 0 for o in plan["layers"])
    chosen = plan["chosen"]["layout"]
    assert "--num_processes 2" in plan["commands"]["train"] and "fcsd.cli convert" in plan["commands"]["train"]
    assert chosen["processes"] == 2 and plan["hours"] > 0
    config = accepted_by_convert(plan["commands"]["train"])  # a 15-step run: the 1000-step warm-up shortened
    assert config.train.warmup_steps <= 15 and any("train.warmup_steps lowered" in n for n in plan["notes"])
    # the LR rule: the peak LR the run will train at, the plain LR times the default recipe's multiple
    assert plan["lr"] == {"recipe": "guided", "train_lr": config.train.lr, "lr_scale": 4.0,
                          "peak": config.train.lr * 4.0}  # fmt: skip
    assert config.recovery.name == "guided" and config.recovery.lr_scale == 4.0


def test_plan_commands_name_what_accelerate_and_convert_need(tmp_path, capsys):
    """A DDP launch says --multi_gpu (no default accelerate config may turn it into FSDP); an objective the teacher
    cache cannot serve rules the cache out with that reason, and the command stays one `fcsd convert` accepts."""
    from fcsd.cli import main
    from fcsd.plan.printed_commands import launch_prefix

    assert "--multi_gpu" in launch_prefix(Layout("ddp", 2), make_cluster("h100", 2))
    assert "--multi_gpu" not in launch_prefix(Layout("fsdp2", 2), make_cluster("h100", 2))
    chat = [{"messages": [{"role": "user", "content": "add 1 and 1"}, {"role": "assistant", "content": "2"}]}]
    save_chat_model(tmp_path / "model", chat * 8, vocab_size=120)
    argv = ["plan", str(tmp_path / "model"), "--gpus-per-node", "2", "--tokens", "1e6", "train.objective=kl_l2"]
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    cached = [c for c in plan["candidates"] if c["layout"]["teacher"] == "cache"]
    assert cached and all(c["status"] == "invalid" and "train.objective=kl_l2" in c["note"] for c in cached)
    assert accepted_by_convert(plan["commands"]["train"]).train.objective == "kl_l2"

    # the user's farskip.layers is the spec planned, their output_dir kept, a setting the plan chooses is noted
    out = tmp_path / "my-run"
    argv = ["plan", str(tmp_path / "model"), "--gpus-per-node", "2", "--tokens", "1e6", "--json"]
    assert main([*argv, "farskip.layers=last:1", f"output_dir={out}", "train.micro_batch_size=7"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [o["spec"] for o in plan["layers"]] == ["last:1"]
    config = accepted_by_convert(plan["commands"]["train"])
    assert config.output_dir == str(out) and plan["commands"]["serve"].startswith(f"vllm serve {out}/export")
    assert any(n.startswith("train.micro_batch_size=7 replaced by the plan's") for n in plan["notes"])

    # train.max_steps shorter than --tokens ends the run first: the plan prices the steps fcsd convert makes
    assert main([*argv, "train.max_steps=10"]) == 0  # --tokens 1e6 alone: 15 steps
    plan = json.loads(capsys.readouterr().out)
    assert plan["steps"] == 10 and plan["tokens"] == 10 * plan["batch_tokens"]
    assert any(n.startswith("train.max_steps=10 ends the run at 10 steps") for n in plan["notes"])


MEASURED_LAYOUTS = [  # chosen layouts of the paper models' plans, run reduced (fcsd plan --measure) on 4 processes
    ("deepseek_v2_lite", "h100", 1, Layout("ep_fsdp", 8, 8, "online", 2, True)),
    ("llama4_scout", "h200", 2, Layout("ep_fsdp", 16, 8, "online", 1, True)),
    ("qwen3_30b_a3b", "h100", 1, Layout("ep_fsdp", 8, 8, "online", 1, False)),
    ("deepseek_v2_lite", "h100", 1, Layout("fsdp2", 8, 1, "online", 2, True)),
    ("qwen3_30b_a3b", "h100", 1, Layout("ep_fsdp", 8, 8, "cache", 1, True, offload=True)),
]


def test_reduced_measure_of_laid_out_layouts_on_four_processes():
    """What `fcsd plan --measure` runs for a chosen layout: the model cut down (same family and layer kinds), laid
    out on 4 gloo processes as the candidate is (EP x FSDP2 as EP 2 x FSDP 2, with and without checkpointing; FSDP2
    alone over 4), two real steps: every process's measured peak within 10% of the estimate, its weights and AdamW
    bytes exactly the estimate's."""
    from fcsd.plan.measure import measure_jobs
    from fcsd.plan.model_configs import load_model_config
    from fcsd.plan.planner import run_config as plan_config
    from fcsd.plan.self_check import reduced

    jobs = []
    for model, gpu, nodes, layout in MEASURED_LAYOUTS:
        source = load_model_config(model)
        config, _, _ = plan_config(source, [], 2e9, make_cluster(gpu, 8, nodes))
        jobs.append(reduced(source.config, config, layout))
    assert [job[2].shape for job in jobs] == ["EP=2xFSDP=2"] * 3 + ["FSDP2", "EP=2xFSDP=2"]
    for job, measured in zip(jobs, measure_jobs(jobs), strict=True):
        assert len(measured) == 4
        check(estimate_step(*job, "cpu"), measured)


def test_the_plan_times_ep_beside_fsdp2_and_says_why(tmp_path, capsys):
    """On 4 GPUs a small MoE has EP x FSDP2, EP and FSDP2-only candidates that fit: the plan times the fastest
    fitting one of each strategy it simulates, and leaves unsimulated only strategies whose lower bound (FSDP2's
    collectives and the all-to-alls nothing hides) is not below the chosen step; it chooses the quickest, says why
    against the other kind, breaks every timed step down into parts that add up to it, and prints a launch that
    convert's parser accepts with the chosen layout's parallel keys."""
    import re

    from fcsd.cli import main

    chat = [{"messages": [{"role": "user", "content": "add 1 and 1"}, {"role": "assistant", "content": "2"}]}]
    save_chat_model(tmp_path / "model", chat * 8, vocab_size=120)
    argv = ["plan", str(tmp_path / "model"), "--gpus-per-node", "4", "--tokens", "1e6", "data.seq_len=32"]
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    timed = plan["layouts_timed"]
    fastest = min(timed, key=lambda t: t["time"]["step_s"])
    chosen = plan["chosen"]["layout"]
    assert chosen == fastest["layout"]
    slower = [c for c in plan["candidates"] if c["status"] == "slower"]
    strategies = {t["layout"]["strategy"] for t in timed} | {c["layout"]["strategy"] for c in slower}
    assert {"ep_fsdp", "ep", "fsdp2"} <= strategies
    for candidate in slower:
        assert "memory" not in candidate  # not simulated
        found = re.search(r"at least ([0-9.]+) (s|ms|us) ", candidate["note"])
        bound = float(found.group(1)) * {"s": 1, "ms": 1e-3, "us": 1e-6}[found.group(2)]
        assert bound >= fastest["time"]["step_s"] * 0.995  # the note's two decimals in its own unit
    for t in timed:
        assert sum(t["time"]["breakdown_s"].values()) == pytest.approx(t["time"]["step_s"])
    assert plan["breakdown"]["step_s"] == pytest.approx(fastest["time"]["step_s"])
    other = "FSDP2" if chosen["ep_size"] > 1 else "EP"
    assert other in plan["layout_reason"] or "expert-parallel layout can be faster" in plan["layout_reason"]
    assert "as fast as" in plan["layout_reason"] or "can be faster" in plan["layout_reason"]
    config = accepted_by_convert(plan["commands"]["train"])
    expected_ep = chosen["ep_size"] if chosen["strategy"] in ("ep", "ep_fsdp") else 1
    assert config.parallel.ep_size == expected_ep
    assert config.parallel.fsdp == (chosen["strategy"] in ("ep_fsdp", "fsdp2"))
    assert config.train.gradient_checkpointing == chosen["gradient_checkpointing"]


def test_ep_x_fsdp2_commands_launch_the_run_and_the_multi_process_cache(tmp_path):
    """The printed commands of an EP x FSDP2 layout on 2 nodes: the training launch (a plain multi-process launch on
    every node, parallel.ep_size and parallel.fsdp=true) and, with the cached teacher, `fcsd cache-teacher` on the
    same processes laid out the same way (the teacher need not fit one GPU); both accepted by fcsd's parsers."""
    from dataclasses import replace

    from fcsd.plan.model_configs import load_model_config
    from fcsd.plan.planner import run_config as plan_config
    from fcsd.plan.printed_commands import plan_commands

    chat = [{"messages": [{"role": "user", "content": "add 1 and 1"}, {"role": "assistant", "content": "2"}]}]
    save_chat_model(tmp_path / "model", chat * 8, vocab_size=120)
    source = load_model_config(str(tmp_path / "model"))
    cluster = make_cluster("h200", 8, 2)
    config, defaults, _ = plan_config(source, [], 1e6, cluster)
    layout = Layout("ep_fsdp", 16, 4, "cache", 1, True)
    extra = ["data.path=chats.jsonl"]
    commands, _ = plan_commands(str(tmp_path / "model"), layout, "all", config, defaults, cluster, extra, ("x", None))
    train = accepted_by_convert(commands["train"])
    assert commands["train"].startswith("fcsd launch accelerate launch") and "--num_machines 2" in commands["train"]
    assert train.parallel.ep_size == 4 and train.parallel.fsdp and train.teacher.mode == "cache"
    cache = check_command(commands["cache_teacher"])
    assert cache.job == "fcsd.distill.teacher_cache.cache_teacher", cache.job
    assert "--num_machines 2" in commands["cache_teacher"]
    assert cache.config.parallel.ep_size == 4 and cache.config.parallel.fsdp
    assert cache.config.teacher.cache_dir == train.teacher.cache_dir
    # the default recipe is guided; the cache holds no hidden states, so convert runs the cached layout's command
    # without the guide (as the plan simulated it), and an online layout's command keeps it
    assert config.recovery.hidden_l2 > 0 and train.recovery.hidden_l2 == 0
    online = replace(layout, teacher="online")
    commands, _ = plan_commands(str(tmp_path / "model"), online, "all", config, defaults, cluster, extra, ("x", None))
    assert accepted_by_convert(commands["train"]).recovery.hidden_l2 == config.recovery.hidden_l2


def test_a_preset_caching_its_teacher_keeps_the_guide_for_the_online_layouts_the_plan_prices(tmp_path, capsys):
    """A run config whose teacher mode is the cache (the Llama-4 Scout preset's) keeps the guided recipe's guide
    until a layout chooses its teacher: an online layout is priced with it (as the command the plan prints for it
    runs), a cached one without, and the plan prints no note that the guide was turned off."""
    from fcsd.plan.model_configs import load_model_config
    from fcsd.plan.planner import run_config as plan_config
    from fcsd.plan.run import step_config

    chat = [{"messages": [{"role": "user", "content": "add 1 and 1"}, {"role": "assistant", "content": "2"}]}]
    save_chat_model(tmp_path / "model", chat * 8, vocab_size=120)
    source = load_model_config(str(tmp_path / "model"))
    config, _, _ = plan_config(source, ["teacher.mode=cache"], 1e6, make_cluster("h200", 8, 1))
    assert config.recovery.hidden_l2 == 4.0 and "hidden_l2" not in capsys.readouterr().err
    online, cached = Layout("ep_fsdp", 8, 4, "online", 1, True), Layout("ep_fsdp", 8, 4, "cache", 1, True)
    assert step_config(config, online, 8).recovery.hidden_l2 == 4.0
    assert step_config(config, cached, 8).recovery.hidden_l2 == 0.0


def test_a_plan_whose_sequences_exceed_the_models_positions_says_convert_refuses_it(tmp_path):
    """The plan prices the run it is given, but its printed command would be refused by ``fcsd convert`` (data.seq_len
    above max_position_embeddings): a note says so, with convert's own message."""
    from fcsd.plan.model_configs import load_model_config
    from fcsd.plan.planner import run_config as plan_config

    chat = [{"messages": [{"role": "user", "content": "add 1 and 1"}, {"role": "assistant", "content": "2"}]}]
    save_chat_model(tmp_path / "model", chat * 8, vocab_size=120)
    source = load_model_config(str(tmp_path / "model"))
    limit = source.config.max_position_embeddings
    cluster = make_cluster("h200", 8, 1)
    _, _, notes = plan_config(source, [f"data.seq_len={2 * limit}", f"train.batch_tokens={16 * limit}"], 1e6, cluster)
    refusal = f"fcsd convert refuses this run as it stands: data.seq_len={2 * limit} is above the model's"
    assert any(note.startswith(refusal) for note in notes), notes
    _, _, notes = plan_config(source, [f"data.seq_len={limit}", f"train.batch_tokens={16 * limit}"], 1e6, cluster)
    assert not any("fcsd convert refuses" in note for note in notes), notes


def test_a_layout_whose_step_raises_is_an_invalid_candidate(monkeypatch):
    """A step the trainer's code cannot run in some layout raises on fake tensors as on real ones: the search marks
    that candidate invalid with the error's first line and goes on with the others instead of crashing the plan."""
    from fcsd.plan import candidates

    def estimate(model_config, fcsd_config, layout, target="cuda"):
        if layout.teacher == "online" and not layout.gradient_checkpointing:
            raise RuntimeError("aten.mul.Tensor got mixed torch.Tensor and DTensor\nmore")
        return real(model_config, fcsd_config, layout, target)

    real = candidates.estimate_step
    monkeypatch.setattr(candidates, "estimate_step", estimate)
    model_config, config = deep_config("qwen3_moe", layers=3), run_config()
    cluster = Cluster(GPU("test", 64.0, 100.0, 100.0, 10.0), gpus_per_node=1, reserve_gib=0, margin=0)
    result = candidates.search(model_config, config, cluster, candidates.parameter_counts(model_config), True)
    failed = [c for c in result.candidates if c.status == "invalid"]
    assert failed and all(c.layout.teacher == "online" and not c.layout.gradient_checkpointing for c in failed)
    assert all(c.note.endswith("mixed torch.Tensor and DTensor") for c in failed)
    assert any(c.fits for c in result.candidates)


def test_fsdp2_alone_with_checkpointing_simulates_on_qwen3():
    """FSDP2 alone with checkpointing on Qwen3-MoE, every layer FarSkip (a MoE layer 0 whose ``o_0`` the next layer
    completes): the backward reaches layer 0's MLP side before its outputs, and the recomputation must gather the
    layer's own weights (it raised a Tensor/DTensor mix). It now simulates as a checkpointed step: fewer activations
    kept, the forward recomputed in the backward, the same weights."""
    model_config, config = deep_config("qwen3_moe", layers=3), run_config(layers="all")
    kept, whole = (
        estimate_step(model_config, config, Layout("fsdp2", 2, teacher="cache", gradient_checkpointing=flag), "cpu")
        for flag in (True, False)
    )
    assert kept.activations < whole.activations and kept.flops["backward"] > whole.flops["backward"]
    assert kept.weights == whole.weights and kept.peak < whole.peak


def brute_force_reach(experts: int, top_k: int, ep: int, node: int, n_group: int = 1, topk_group: int = 1):
    """Every equally likely route of one token (groups, then experts among them) from every GPU of the EP group,
    counted: distinct nodes and GPUs reached, remote nodes, and the rows a hierarchical fan-out moves (every GPU
    reached except the one its node's row lands on: the source's position in that node)."""
    import itertools

    per_group, per_gpu = experts // n_group, experts // ep
    totals, count = [0.0] * 4, 0
    for groups in itertools.combinations(range(n_group), topk_group):
        allowed = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
        for chosen in itertools.combinations(allowed, top_k):
            gpus = {e // per_gpu for e in chosen}
            nodes = {g // node for g in gpus}
            for source in range(ep):
                landing = {n: n * node + source % node for n in nodes}
                totals[0] += len(nodes)
                totals[1] += len(gpus)
                totals[2] += len(nodes - {source // node})
                totals[3] += sum(1 for g in gpus if g != landing[g // node])
                count += 1
    return [t / count for t in totals]


@pytest.mark.parametrize(
    "experts,top_k,ep,node,n_group,topk_group",
    [(8, 2, 4, 2, 1, 1), (8, 3, 8, 2, 1, 1), (8, 2, 4, 2, 4, 2), (16, 4, 8, 2, 4, 2), (12, 3, 6, 3, 2, 1)],
)
def test_routing_reach_equals_a_count_of_every_route(experts, top_k, ep, node, n_group, topk_group):
    """The expected nodes and GPUs a token's experts reach (uniform top-k, and group-limited routing with groups laid
    out contiguously), and the rows the node-aware dispatch moves from them, against counting every route from
    every GPU; the fixed-seed Monte Carlo used beyond the exact enumeration agrees."""
    from fcsd.plan.routing import reach

    found = reach(experts, top_k, ep, node, n_group, topk_group)
    nodes, gpus, remote, fan_out = brute_force_reach(experts, top_k, ep, node, n_group, topk_group)
    assert (found.nodes, found.gpus) == (pytest.approx(nodes), pytest.approx(gpus))
    assert (found.remote_nodes, found.fan_out_rows) == (pytest.approx(remote), pytest.approx(fan_out))
    sampled = reach(experts, top_k, ep, node, n_group, topk_group, max_exact=0)
    assert sampled.nodes == pytest.approx(nodes, abs=0.02) and sampled.gpus == pytest.approx(gpus, abs=0.02)


def test_group_limited_routing_bounds_the_nodes_deepseek_v3_reaches():
    """DeepSeek-V3 (256 experts, top-8 of 4 of 8 groups) over EP 64 on nodes of 8: a group per node, so a token
    reaches at most 4 nodes (uniform routing would reach more); a layout that cannot exist is one line naming it."""
    from fcsd.plan.model_configs import load_model_config
    from fcsd.plan.perfmodel import model_shape
    from fcsd.plan.routing import model_reach, reach

    source = load_model_config("deepseek-v3")
    limited = model_reach(model_shape(source.config), source.config, 64, 8)
    uniform = reach(256, 8, 64, 8)
    assert 1 < limited.nodes <= 4 < uniform.nodes and limited.num_nodes == 8
    with pytest.raises(ValueError, match="divisor or a multiple of the GPUs per node"):
        reach(256, 8, 12, 8)


def test_node_aware_dispatch_priced_against_a_hand_computation():
    """One MoE layer of 1,000 tokens per GPU, hidden 1,000, top-4, EP 8 over 4 nodes of 2 GPUs, a token reaching 2
    nodes and 4 GPUs: the hierarchical Dispatch + Combine cross nodes once per (token, remote node) (a bf16 row each
    way, the fp32 pairs of its remote experts on the way out) at the inter-node all-to-all bandwidth, and fan out
    one row per (token, GPU) but the landing one inside nodes; FarSkip's window (Eq. 9, twice in backward) hides the
    crossing, never the fan-out; a regular layer and the teacher expose both; the plain dispatcher sends a row per
    (token, remote expert)."""
    from fcsd.plan import perfmodel as pm
    from fcsd.plan.routing import Reach
    from fcsd.plan.timing import ep_breakdown, exchange

    cluster = Cluster(GPU("test", 80.0, 100.0, 60.0, 6.0), gpus_per_node=2, mfu=1.0)
    layer = pm.LayerShape(2e6, 8, 64, 64, True, gate_flops=1e4, routed_flops=8e6, shared_flops=4e6)
    shape = pm.ModelShape(hidden=1000, vocab=10, num_experts=16, top_k=4, layers=(layer,))
    reach = Reach(nodes=2.0, gpus=4.0, top_k=4, num_nodes=4, node_size=2)
    inter, intra = 6.0 * 5 / 6 * 1e9, 60.0 * 5 / 6 * 1e9  # all-to-all: 5/6 of the bus bandwidths
    crossing = 1000 * (2 * 1.5 * 2000 + 3 * 8) / inter  # 1.5 remote nodes, 3 remote pairs of 8 bytes
    fan_out = 1000 * (2 * 2 * 2000 + 2 * 8) / intra  # 2 of 4 GPUs off the landing one, their 2 pairs
    one = exchange(shape, 1000, 8, cluster, reach)
    assert one.hideable == pytest.approx(crossing) and one.exposed == pytest.approx(fan_out) and one.inter
    plain = exchange(shape, 1000, 8, cluster, reach, "plain")
    assert plain.hideable == pytest.approx(max(2 * 1000 * 3 * 2000 / inter, 2 * 1000 * 0.5 * 2000 / intra))
    times = pm.prefill_layer_times(shape, layer, 1, 1000, 1, 1, pm.Hardware(100.0, 100.0, 60.0, 50.0))
    window = times.compute - times.routed - times.gate
    farskip = ep_breakdown(shape, {0}, 1000, 1000, 8, cluster, teacher=False, reach=reach)
    assert farskip.inter == pytest.approx(max(0, crossing - window) + max(0, crossing - 2 * window))
    assert farskip.intra == pytest.approx(2 * fan_out)
    regular = ep_breakdown(shape, set(), 1000, 1000, 8, cluster, teacher=True, reach=reach)
    assert (regular.inter, regular.intra) == (pytest.approx(3 * crossing), pytest.approx(3 * fan_out))
    assert regular.hidden_inter == 0 and farskip.hidden_inter == pytest.approx(2 * crossing - farskip.inter)


def test_deepseek_v3_prices_an_ep_group_across_nodes_fastest():
    """DeepSeek-V3 on 16 x 8 H200, the same step (the same FLOPs, checkpointing with its replay in host memory, the
    online teacher) priced for every EP x FSDP2 size: EP 8 x FSDP 16 exposes most of FSDP2's gathers of the expert
    shards between 16 replicas on 16 nodes; the fastest EP size spans nodes (hierarchical dispatch, its all-to-alls
    across nodes mostly hidden by FarSkip's window), and every breakdown adds up to its step. (The whole plan, whose
    simulations decide memory too, chooses the same way: docs/planning.md.)"""
    from types import SimpleNamespace

    from fcsd.connectivity.layer_spec import converted_layers
    from fcsd.plan.candidates import parameter_counts
    from fcsd.plan.model_configs import load_model_config
    from fcsd.plan.perfmodel import model_shape
    from fcsd.plan.planner import _teacher_flops
    from fcsd.plan.planner import run_config as plan_config
    from fcsd.plan.pricing import Pricing, step_bound

    source = load_model_config("deepseek-v3")
    cluster = make_cluster("h200", 8, 16)
    config, _, _ = plan_config(source, [], 2e9, cluster)
    shape, counts = model_shape(source.config), parameter_counts(source.config)
    converted = set(converted_layers("last:50%", len(shape.layers)))
    pricing = Pricing(source.config, config, cluster, counts, shape, converted)
    tokens = config.data.seq_len
    flops = {"teacher": tokens * _teacher_flops(shape, tokens), "student": 4 * tokens * _teacher_flops(shape, tokens)}
    times = {}
    for ep in (8, 16, 32, 64, 128):
        layout = Layout("ep_fsdp", 128, ep, "online", 1, True, offload=True)
        stub = SimpleNamespace(
            layout=layout, flops=flops, tokens=tokens, gradients=0, accumulation=1, host=2**30, expert_flops=0.0
        )
        times[ep] = pricing.time(stub)
        assert sum(times[ep].breakdown().values()) == pytest.approx(times[ep].seconds)
        assert step_bound(layout, pricing) <= times[ep].seconds
        assert times[ep].dispatcher == ("hierarchical" if ep > 8 else "plain")
    fastest = min(times, key=lambda ep: times[ep].seconds)
    assert fastest > cluster.gpus_per_node and times[fastest].seconds < times[8].seconds / 1.5
    assert times[8].fsdp_s > times[8].compute_s and times[fastest].fsdp_s < times[8].fsdp_s / 4
    assert times[fastest].a2a_inter_s > 0 and times[fastest].mfu > times[8].mfu


def test_ep_groups_beyond_a_node_are_candidates_simulated_and_launched_hierarchical():
    """On 2 nodes of 2 GPUs an 8-expert MoE gets EP groups of 4 spanning both nodes (EP 4 x FSDP 1, EP 4 with the rest
    replicated) beside the groups inside a node; one is simulated through the trainer's layout over a fake process
    group of the 4 ranks (a 4th of the experts per GPU, nothing whole), priced with the node-aware dispatcher (its
    breakdown adding up to its step), and its launch names parallel.dispatcher=hierarchical, which a group inside a
    node does not."""
    from fcsd.plan.candidates import parameter_counts, strategies
    from fcsd.plan.perfmodel import model_shape
    from fcsd.plan.pricing import Pricing
    from fcsd.plan.printed_commands import plan_commands

    model_config, config = deep_config("qwen3_moe", layers=3), run_config(sequences=8)
    shape, counts = model_shape(model_config), parameter_counts(model_config)
    cluster = make_cluster("h100", 2, 2)
    found = strategies(cluster.gpus, shape.num_experts, cluster.gpus_per_node)
    assert ("ep_fsdp", 4) in found and ("ep", 4) in found and ("ep_fsdp", 2) in found
    wide = Layout("ep_fsdp", 4, 4, "online", 2, True)
    estimate = estimate_step(model_config, config, wide, "cuda")
    whole = estimate_step(model_config, config, Layout("single", 1, micro_batch=2, gradient_checkpointing=True))
    assert estimate.weights < whole.weights / 3  # every parameter sharded over the 4 ranks
    time = Pricing(model_config, config, cluster, counts, shape, {1, 2}).time(estimate)
    assert time.dispatcher == "hierarchical" and time.a2a_inter_s > 0 and time.a2a_intra_s > 0
    assert sum(time.breakdown().values()) == pytest.approx(time.seconds)
    for layout, named in ((wide, True), (Layout("ep_fsdp", 4, 2, "online", 2, True), False)):
        commands, _ = plan_commands("m", layout, "all", config, config, cluster, ["data.path=x.jsonl"], ("x", None))
        assert ("parallel.dispatcher=hierarchical" in commands["train"]) == named, commands["train"]
        parallel = accepted_by_convert(commands["train"]).parallel
        assert parallel.dispatcher == ("hierarchical" if named else "plain") and parallel.ep_size == layout.ep_size


def test_an_interrupted_plan_stops_its_simulation_workers_at_once():
    """Ctrl-C (or an error) inside a plan's simulation workers: the workers are terminated, not waited for (a
    simulation of a paper model runs for a minute), and none is left running."""
    import time

    from fcsd.plan import workers

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with workers.simulation_workers(2):
            pool = workers._ACTIVE[0]
            running = pool.executor.submit(time.sleep, 120)
            while not running.running():
                time.sleep(0.1)
            processes = list(pool.executor._processes.values())
            raise KeyboardInterrupt
    assert time.monotonic() - started < 60
    assert processes and not any(process.is_alive() for process in processes)
    assert workers._ACTIVE == []
