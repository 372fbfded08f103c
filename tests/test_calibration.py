"""`fcsd bench cluster` and `fcsd plan --cluster FILE`: the cluster file round-trips (written atomically), its bad
forms are refused in one line naming the field and the fix, the plan prices a step with the file's figures (a
changed bandwidth or GEMM rate moves the step by the hand-computed amount), the benchmark under two gloo processes
writes a file the plan reads, and `--measure --json` sets each measured step beside its calibrated estimate. No
assertion on absolute speed: CPU timings here are shared and noisy."""

from __future__ import annotations

import json
import math

import pytest
from launch import torchrun

from fcsd.plan.cluster import (
    Cluster,
    cluster_from_data,
    load_cluster_file,
    read_cluster_file,
    write_cluster_file,
)


def rank_result(tflops: float, op_us: float, latency: float, gbps: float, device: str = "CPU") -> dict:
    """One rank's :func:`fcsd.plan.calibrate.measure_rank` result, made up (two ranks, one node)."""
    collectives = [
        {"scope": "intra", "kind": kind, "ranks": 2, "latency_us": latency, "gbps": gbps}
        for kind in ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")
    ]
    return {
        "model": "demo",
        "tokens": 512,
        "gemm": {"tflops": tflops, "shapes": [{"m": 512, "k": 96, "n": 96, "count": 1, "tflops": tflops}]},
        "reduced_gemm": {"128": tflops / 2, "256": tflops},
        "op_us": op_us,
        "ops_per_step": 100,
        "memory_gbps": 10.0,
        "host": {"gbps": 3.0, "what": "memcpy (CPU: no host link)"},
        "collectives": collectives,
        "memory_gib": 12.0,
        "device_name": device,
        "host_memory_gib": 24.0,
        "threads": 1,
    }


def made_up_file(tmp_path, name: str = "cluster.json", **changes) -> tuple:
    from fcsd.plan.calibrate import combine

    data = combine([rank_result(0.04, 10.0, 500.0, 0.5), rank_result(0.06, 20.0, 700.0, 0.4)], 2, 2, "gloo")
    data.update(changes)
    return write_cluster_file(tmp_path / name, data), data


def test_cluster_file_round_trips_and_combines_the_ranks(tmp_path):
    """What combine() makes of two ranks (GEMM and dispatch averaged, collectives at their slowest rank), written
    and read back unchanged, and the Cluster the plan prices with: the measured rate as the effective FLOP/s."""
    path, data = made_up_file(tmp_path)
    assert data["tflops"] == pytest.approx(0.05) and data["op_us"] == pytest.approx(15.0)
    assert data["latency_us"]["all_gather"]["2"] == 700.0  # the slowest rank's
    assert data["intra_gbps"] == pytest.approx(0.4) and data["alltoall_intra_gbps"] == pytest.approx(0.4)
    assert data["assumed"] == ["inter_gbps"]  # one node: not measured, and the file says so
    assert read_cluster_file(path) == data
    assert not [p for p in tmp_path.iterdir() if p.name != "cluster.json"]  # no temporary file left behind
    cluster = load_cluster_file(path)
    assert isinstance(cluster, Cluster)
    assert (cluster.nodes, cluster.gpus_per_node, cluster.mfu) == (1, 2, 1.0)
    assert cluster.gpu.tflops == pytest.approx(0.05) and cluster.gpu.memory_gib == 12.0
    assert cluster.gpu.intra_gbps == pytest.approx(0.4) and cluster.gpu.host_gbps == 3.0
    calibration = cluster.calibration
    assert calibration.latency("all_gather", 2) == pytest.approx(700e-6)
    assert calibration.latency("all_gather", 4) == pytest.approx(700e-6)  # beyond the measured: the largest
    assert calibration.latency("all_gather", 1) == 0.0
    assert calibration.reduced_rate(128) == pytest.approx(0.025e12) and calibration.reduced_rate(300) == 0.05e12
    overridden = load_cluster_file(path, nodes=4, intra_gbps=7.0, gpu_memory="80GiB")
    assert (overridden.nodes, overridden.gpu.intra_gbps, overridden.gpu.memory_gib) == (4, 7.0, 80.0)


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path, data = made_up_file(tmp_path)
    before = path.read_text()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(json, "dumps", broken)
    with pytest.raises(OSError, match="disk full"):
        write_cluster_file(path, {**data, "tflops": 9.0})
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.json"]


BAD_FILES = [
    ("not json {", "not JSON"),
    ("[1, 2]", "not a cluster file"),
    (lambda d: {**d, "format": "other"}, "not a cluster file"),
    (lambda d: {**d, "version": 99}, "version 99"),
    (lambda d: {k: v for k, v in d.items() if k != "intra_gbps"}, "'intra_gbps' is missing"),
    (lambda d: {**d, "nodes": 10**12}, "more than 131,072 GPUs in all"),  # the plan searched for minutes
    (lambda d: {**d, "tflops": -1.0}, "tflops is -1.0"),
    (lambda d: {**d, "host_gbps": "fast"}, "host_gbps is 'fast'"),
    (lambda d: {**d, "gpus_per_node": 0}, "gpus_per_node is 0"),
    (lambda d: {**d, "latency_us": {"broadcast": {"2": 1.0}}}, "latency_us is {'broadcast'"),
    (lambda d: {**d, "latency_us": {"all_gather": {"two": 1.0}}}, "latency_us.all_gather"),
    (lambda d: {**d, "reduced_tflops": {"128": 0}}, "reduced_tflops"),
    (lambda d: {**d, "overlap": 1.5}, "overlap is 1.5"),
    (lambda d: {**d, "expert_tflops": {"2": 0}}, "expert_tflops is"),
    (lambda d: {**d, "reduced_expert_tflops": {"128": {"x": 1.0}}}, "reduced_expert_tflops is"),
    # every field's type and range, and every required field (a schema, not the first use's TypeError)
    (lambda d: {**d, "assumed": 5}, "assumed is 5, not a list of the file's figures"),
    (lambda d: {**d, "assumed": ["bogus"]}, "assumed is ['bogus']"),
    (lambda d: {**d, "compute_capability": "9.0"}, "compute_capability is '9.0', not CUDA's [major, minor]"),
    (lambda d: {**d, "threads": "two"}, "threads is 'two', not a whole number"),
    (lambda d: {**d, "threads": -1}, "threads is -1, not a whole number of at least 1"),
    (lambda d: {**d, "op_us": -2.0}, "op_us is -2.0"),
    (lambda d: {**d, "name": 7}, "name is 7, not a text"),
    (lambda d: {**d, "alltoall_intra_gbps": "x"}, "alltoall_intra_gbps is 'x'"),
    (lambda d: {**d, "measurements": []}, "measurements is []"),
    *[
        (lambda d, key=key: {k: v for k, v in d.items() if k != key}, f"the field {key!r} is missing")
        for key in ("op_us", "memory_gbps", "latency_us", "reduced_tflops", "host_memory_gib")
    ],
    (
        lambda d: {k: v for k, v in d.items() if k not in ("op_us", "latency_us")},
        "the fields 'op_us', 'latency_us' are missing",
    ),
]


@pytest.mark.parametrize(("content", "problem"), BAD_FILES, ids=[p for _, p in BAD_FILES])
def test_bad_cluster_files_are_refused_in_one_line(tmp_path, capsys, content, problem):
    """Each bad form: a one-line error naming the problem and the fix, from the library and from `fcsd plan`."""
    from fcsd.cli import main

    _, data = made_up_file(tmp_path)
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content(data)))
    with pytest.raises(ValueError, match="fcsd bench cluster") as error:
        load_cluster_file(path)
    assert problem in str(error.value) and "\n" not in str(error.value)
    capsys.readouterr()
    assert main(["plan", "demo", "--cluster", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and problem in err and "fcsd bench cluster" in err


def test_an_fp8_plan_on_a_file_with_a_text_compute_capability_is_refused_in_one_line(tmp_path, capsys):
    from fcsd.cli import main

    path, _ = made_up_file(tmp_path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "compute_capability": "9.0"}))
    assert main(["plan", "demo", "--cluster", str(path), "teacher.dtype=fp8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--cluster {path}: compute_capability is '9.0'" in err, err


def test_one_process_keeps_the_presets_links_and_says_so():
    """No collective measured: both links are the preset's (not a memcpy rate), listed under assumed and said."""
    from fcsd.plan.calibrate import combine, format_cluster
    from fcsd.plan.cluster import GPUS

    alone = {**rank_result(0.04, 10.0, 500.0, 0.5), "collectives": []}
    data = combine([alone], 1, 1, "none")
    assert (data["intra_gbps"], data["inter_gbps"]) == (GPUS["h100"].intra_gbps, GPUS["h100"].inter_gbps)
    assert data["assumed"] == ["intra_gbps", "inter_gbps"] and data["host_gbps"] == 3.0
    note = [line for line in format_cluster(data).splitlines() if line.startswith("assumed")]
    assert note == [
        "assumed    intra_gbps, inter_gbps kept from the H100 SXM 80GB preset (360 / 45 GB/s): one process "
        "measures no collective; run it under torchrun, or give --intra-gbps / --inter-gbps"
    ]


def test_plan_refuses_preset_options_beside_a_cluster_file(tmp_path, capsys):
    from fcsd.cli import main

    path, _ = made_up_file(tmp_path)
    for option in (["--mfu", "0.5"], ["--gpu", "h200"], ["--gpu-tflops", "100"]):
        assert main(["plan", "demo", "--cluster", str(path), *option]) == 2
        err = capsys.readouterr().err.strip()
        assert option[0] in err and "leave" in err and err.count("\n") == 0
    assert main(["plan", "demo", "--cluster", str(tmp_path / "absent.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def ddp_estimate():
    """A simulated DDP step of the reduced demo over 2 processes (what the priced-step tests price)."""
    from fcsd.plan.model_configs import load_model_config
    from fcsd.plan.planner import run_config
    from fcsd.plan.run import Layout
    from fcsd.plan.self_check import reduced
    from fcsd.plan.simulate import estimate_step

    source = load_model_config("demo")
    cluster = cluster_from_data(_data_only())
    config, _, _ = run_config(source, [], 2e9, cluster)
    model_config, config, layout = reduced(source.config, config, Layout("ddp", 2, micro_batch=1))
    return model_config, config, layout, estimate_step(model_config, config, layout, "cpu")


def _data_only() -> dict:
    from fcsd.plan.calibrate import combine

    return combine([rank_result(0.05, 10.0, 500.0, 0.5)] * 2, 2, 2, "gloo")


def test_a_cluster_files_figures_price_the_step(tmp_path):
    """`fcsd plan --cluster FILE` prices with the file: a DDP step's gradient all-reduce (exposed beyond two thirds
    of the compute) at a tenth of the bandwidth takes 2 (n-1)/n x gradient bytes x (1/b' - 1/b) longer, and twice the
    GEMM rate halves its compute."""
    from fcsd.plan import perfmodel as pm
    from fcsd.plan.candidates import parameter_counts
    from fcsd.plan.timing import step_time

    model_config, config, layout, estimate = ddp_estimate()
    shape = pm.model_shape(model_config)
    counts = parameter_counts(model_config)
    slow, fast = 0.001, 0.01  # GB/s: slow enough that the all-reduce outlasts the backward
    priced = {}
    for name, changes in {"slow": {}, "fast": {"intra_gbps": fast}, "double": {"tflops": 0.1}}.items():
        path, _ = made_up_file(tmp_path, f"{name}.json", **{"intra_gbps": slow, **changes})
        cluster = load_cluster_file(path)
        priced[name] = step_time(estimate, shape, set(), cluster, config.train.batch_tokens, 128, counts)
    n, grads = layout.processes, estimate.gradients
    expected = 2 * (n - 1) / n * grads * (1 / slow - 1 / fast) / 1e9
    assert priced["slow"].seconds > priced["fast"].seconds
    assert priced["slow"].seconds - priced["fast"].seconds == pytest.approx(expected, rel=1e-9)
    tokens = config.train.batch_tokens // n
    flops = sum(estimate.flops.values()) / estimate.tokens * tokens
    assert priced["slow"].compute_s == pytest.approx(flops / 0.05e12, rel=1e-9)
    assert priced["double"].compute_s == pytest.approx(priced["slow"].compute_s / 2, rel=1e-9)


def test_the_measured_overlap_is_the_share_of_each_window_the_step_hides(tmp_path):
    """combine() pools the ranks' overlap times; a file measuring no overlap (a CPU whose every core computes) prices
    a DDP step's all-reduce whole, beside the compute instead of behind the backward, and one measuring full overlap
    as the presets do (two thirds of the compute hide it)."""
    from fcsd.plan import perfmodel as pm
    from fcsd.plan.calibrate import combine, pooled_overlap
    from fcsd.plan.candidates import parameter_counts
    from fcsd.plan.timing import hardware, step_time

    ranks = [{"work_s": 1.0, "comm_s": 0.5, "both_s": 1.5}, {"work_s": 1.0, "comm_s": 0.5, "both_s": 1.0}]
    assert pooled_overlap(ranks) == pytest.approx(0.5)
    assert pooled_overlap([{"work_s": 1.0, "comm_s": 0.5, "both_s": 2.0}]) == 0.0  # slower than serial: none
    results = [{**rank_result(0.05, 10.0, 500.0, 0.5), "overlap": r} for r in ranks]
    assert combine(results, 2, 2, "gloo")["overlap"] == pytest.approx(0.5)
    model_config, config, layout, estimate = ddp_estimate()
    shape, counts = pm.model_shape(model_config), parameter_counts(model_config)
    steps = {}
    for overlap in (0.0, 1.0):
        path, _ = made_up_file(tmp_path, f"overlap{overlap}.json", intra_gbps=0.05, overlap=overlap)
        cluster = load_cluster_file(path)
        assert cluster.overlap == overlap
        steps[overlap] = step_time(estimate, shape, set(), cluster, config.train.batch_tokens, 128, counts)
    comm = pm.allreduce_s(estimate.gradients, layout.processes, hardware(cluster, layout.processes))
    assert steps[0.0].dp_allreduce_s == pytest.approx(comm)
    assert steps[1.0].dp_allreduce_s == pytest.approx(max(0.0, comm - steps[1.0].compute_s * 2 / 3))
    assert steps[0.0].seconds > steps[1.0].seconds
    preset = Cluster(cluster.gpu, cluster.gpus_per_node, cluster.nodes, 1.0)  # no file: the presets' full overlap
    assert preset.overlap == 1.0


def test_the_calibrated_prediction_adds_the_measured_overheads(tmp_path):
    """predict_step: the time model at the file's figures plus every op at the per-op time, the elementwise bytes at
    the measured bandwidth, each collective at its latency (none for DDP here: its reducer is not simulated), and a
    file with twice the per-op time predicts exactly the extra dispatch time."""
    from fcsd.plan.predict import predict_step, step_counts

    model_config, config, layout, estimate = ddp_estimate()
    path, _ = made_up_file(tmp_path)
    cluster = load_cluster_file(path)
    counts = step_counts(model_config, config, layout)
    assert counts["ops"] > counts["gemms"] > 0 and counts["bytes"] > 0
    base = predict_step(model_config, config, layout, cluster, estimate)
    extra = base["beyond_time_model"]
    assert extra["ops"] == counts["ops"]
    assert extra["dispatch_s"] == pytest.approx(counts["ops"] * 15e-6)
    assert extra["elementwise_s"] == pytest.approx(counts["bytes"] / 10e9)
    timed = base["time_model"]
    total = timed["compute_s"] + timed["exposed_comm_s"] + sum(extra[k] for k in extra if k.endswith("_s"))
    assert base["estimated_step_seconds"] == pytest.approx(total)
    path2, _ = made_up_file(tmp_path, "slower.json", op_us=30.0)
    slower = predict_step(model_config, config, layout, load_cluster_file(path2), estimate)
    assert slower["estimated_step_seconds"] - base["estimated_step_seconds"] == pytest.approx(counts["ops"] * 15e-6)


def test_step_counts_see_the_collectives_of_a_laid_out_step():
    """An EP 2 step over a fake process group: all-to-alls of 2 ranks in every MoE layer, forward and backward."""
    from fcsd.plan.model_configs import load_model_config
    from fcsd.plan.planner import run_config
    from fcsd.plan.predict import step_counts
    from fcsd.plan.run import Layout
    from fcsd.plan.self_check import reduced

    source = load_model_config("demo")
    config, _, _ = run_config(source, [], 2e9, cluster_from_data(_data_only()))
    model_config, config, layout = reduced(source.config, config, Layout("ep", 2, 2, micro_batch=1))
    counts = step_counts(model_config, config, layout)
    moe_layers = model_config.num_hidden_layers
    assert counts["collectives"][("all_to_all", 2)] >= 4 * moe_layers  # dispatch + combine, forward + backward


def test_bench_cluster_under_two_gloo_processes_writes_a_file_the_plan_reads(tmp_path):
    out = tmp_path / "cluster.json"
    command = ["-m", "fcsd.cli", "bench", "cluster", "--model", "demo", "--out", str(out), "--quick"]
    done = torchrun(2, *command, timeout=600)
    data = read_cluster_file(out)
    assert (data["nodes"], data["gpus_per_node"], data["backend"], data["device"]) == (1, 2, "gloo", "cpu")
    assert set(data["latency_us"]) == {"all_to_all", "all_gather", "reduce_scatter", "all_reduce"}
    assert all(set(sizes) == {"2"} for sizes in data["latency_us"].values())
    assert data["threads"] == 1 and data["assumed"] == ["inter_gbps"]
    assert {"128", "256"} == set(data["reduced_tflops"])
    assert 0 <= data["overlap"] <= 1 and len(data["measurements"]["overlap"]) == 2  # both ranks' times
    assert all(row["tflops"] > 0 for row in data["measurements"]["gemm"])
    assert "cluster file:" in done.stdout and done.stdout.count("cluster file:") == 1  # rank 0 alone reports
    cluster = load_cluster_file(out)
    assert cluster.gpus == 2 and math.isclose(cluster.gpu.tflops, data["tflops"])


def test_bench_cluster_refuses_bad_options_in_one_line(tmp_path, capsys):
    from fcsd.cli import main

    assert main(["bench", "cluster", "--model", "demo"]) == 2
    assert "--out FILE" in capsys.readouterr().err
    assert main(["bench", "cluster", "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    notes = tmp_path / "notes.json"  # a file fcsd did not write is never replaced
    notes.write_text('{"mine": true}')
    assert main(["bench", "cluster", "--model", "demo", "--out", str(notes)]) == 2
    assert "exists and is not a cluster file fcsd wrote" in capsys.readouterr().err
    assert notes.read_text() == '{"mine": true}'
    assert main(["bench", "cluster", "--out", str(tmp_path / "c.json"), "--tokens", "0"]) == 2
    assert "--tokens 0" in capsys.readouterr().err


def test_measure_json_sets_the_estimate_beside_the_measured_step(tmp_path, capsys):
    """`fcsd plan demo --cluster FILE --measure --json` on a one-GPU cluster file (one process, here): the measured
    reduced layout carries measured.step_seconds beside measured.estimated_step_seconds (the calibrated
    prediction, with its parts) and their ratio."""
    from fcsd.cli import main

    path, _ = made_up_file(tmp_path, gpus_per_node=1, gpu_memory_gib=24.0)
    assert main(["plan", "demo", "--cluster", str(path), "--measure", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cluster"]["gpu"]["tflops"] == pytest.approx(0.05) and report["cluster"]["gpus"] == 1
    measure = report["measure"]
    assert measure["layouts"] and measure["measured"] == measure["layouts"][0]["measured"]
    for entry in measure["layouts"]:
        measured = entry["measured"]
        assert measured["calibrated"] is True
        assert measured["step_seconds"] > 0 and measured["estimated_step_seconds"] > 0
        assert measured["ratio"] == pytest.approx(measured["estimated_step_seconds"] / measured["step_seconds"])
        assert measured["prediction"]["beyond_time_model"]["ops"] > 0


class GroupedCalls:
    """A ``TorchDispatchMode`` recording each ``aten._grouped_mm`` call's operand shapes, dtypes and offsets."""

    def __new__(cls):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        class Recording(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.calls = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func._overloadpacket is torch.ops.aten._grouped_mm:
                    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
                    a, b = args[0], args[1]
                    self.calls.append((tuple(a.shape), tuple(b.shape), a.dtype, b.dtype, offs.tolist()))
                return func(*args, **kwargs)

        return Recording()


def test_the_benchmark_times_the_experts_as_grouped_gemms_at_an_ep_ranks_rows():
    """`fcsd bench cluster`'s measurement (one CPU process, --quick) times the demo model's experts through
    aten._grouped_mm, in the CPU run's fp32, at each EP size's rank: the tokens x top_k rows it receives, split evenly
    over its experts / ep local experts, through (hidden -> 2 x inter) and (inter -> hidden), forward and backward;
    its dense GEMMs leave the fused experts out; the cluster file carries the rate per EP size."""
    import torch

    from fcsd.plan.calibrate import combine, measure_rank
    from fcsd.plan.model_configs import load_model_config

    text = load_model_config("demo").config
    hidden, inter, experts, top_k = text.hidden_size, text.moe_intermediate_size, text.num_experts, 4
    assert text.num_experts_per_tok == top_k
    tokens = 64
    recording = GroupedCalls()
    with recording:
        result = measure_rank("demo", tokens, torch.device("cpu"), quick=True)
    assert set(result["experts"]) == {"1", "2", "4", "8", "16"}
    rows = tokens * top_k  # each of the ep ranks sends tokens x top_k / ep rows to each rank
    for ep in (1, 2, 4, 8, 16):
        local = experts // ep
        offsets = [rows // local * (i + 1) for i in range(local)]
        forward = {(a, b) for a, b, _, _, offs in recording.calls if offs == offsets and len(a) == 2 and len(b) == 3}
        assert ((rows, hidden), (local, hidden, 2 * inter)) in forward  # up (and gate), forward
        assert ((rows, inter), (local, inter, hidden)) in forward  # down, forward
        weight_grads = {  # (K or N, rows) x (rows, N or K): each weight's gradient, per group
            tuple(sorted((a[0], b[1])))
            for a, b, _, _, offs in recording.calls
            if offs == offsets and len(a) == 2 and a[1] == rows and b[0] == rows
        }
        assert {tuple(sorted((hidden, 2 * inter))), tuple(sorted((inter, hidden)))} <= weight_grads
        assert result["experts"][str(ep)]["tflops"] > 0
    assert {(x, w) for _, _, x, w, _ in recording.calls} == {(torch.float32, torch.float32)}
    shapes = {(row["k"], row["n"]) for row in result["gemm"]["shapes"]}
    assert (hidden, 2 * inter) not in shapes and (inter, hidden) not in shapes  # no dense stand-in for the experts
    assert set(result["reduced_experts"]) == {"128", "256"}
    data = combine([result], 1, 1, "none")
    assert data["expert_tflops"] == {ep: row["tflops"] for ep, row in result["experts"].items()}
    assert [row["rank_rows"] for row in data["measurements"]["experts"]] == [rows] * 5


def test_the_plan_prices_the_experts_at_the_measured_grouped_rate(tmp_path):
    """A cluster file's `expert_tflops` prices the step's grouped expert FLOPs (counted by the simulation) at the rate
    of the layout's EP size and the rest at `tflops`: halving the EP-1 rate adds exactly the experts' FLOPs over it;
    an EP-2 layout reads the EP-2 rate; a file without it (an older one) prices everything at `tflops`; the reduced
    prediction reads the reduced rates."""
    from dataclasses import replace

    from fcsd.plan import perfmodel as pm
    from fcsd.plan.candidates import parameter_counts
    from fcsd.plan.predict import calibrated_for
    from fcsd.plan.run import Layout
    from fcsd.plan.timing import step_time

    model_config, config, layout, estimate = ddp_estimate()
    shape, counts = pm.model_shape(model_config), parameter_counts(model_config)
    assert 0 < estimate.expert_flops < sum(estimate.flops.values())
    tokens = config.train.batch_tokens // layout.processes
    experts = estimate.expert_flops / estimate.tokens * tokens
    rest = sum(estimate.flops.values()) / estimate.tokens * tokens - experts

    def compute(name, estimate=estimate, **changes):
        path, _ = made_up_file(tmp_path, f"{name}.json", **changes)
        cluster = load_cluster_file(path)
        return step_time(estimate, shape, set(), cluster, config.train.batch_tokens, 128, counts).compute_s

    old = compute("old")
    assert old == pytest.approx((rest + experts) / 0.05e12, rel=1e-9)
    fast = compute("fast", expert_tflops={"1": 0.2, "2": 0.4})
    slow = compute("slow", expert_tflops={"1": 0.1, "2": 0.4})
    assert fast == pytest.approx(rest / 0.05e12 + experts / 0.2e12, rel=1e-9)
    assert slow - fast == pytest.approx(experts / 0.1e12 - experts / 0.2e12, rel=1e-9)
    ep2 = replace(estimate, layout=Layout("ep", 2, 2, micro_batch=1))
    assert compute("ep2", ep2, expert_tflops={"1": 0.1, "2": 0.4}) == pytest.approx(
        rest / 0.05e12 + experts / 0.4e12, rel=1e-9
    )
    path, _ = made_up_file(
        tmp_path, "reduced.json", expert_tflops={"1": 0.2}, reduced_expert_tflops={"128": {"1": 0.3}}
    )
    cluster = calibrated_for(load_cluster_file(path), 128)
    assert cluster.expert_rate(1) == pytest.approx(0.3e12) and cluster.gpu.tflops == pytest.approx(0.025)
    path, _ = made_up_file(tmp_path, "no-reduced.json", expert_tflops={"1": 0.2})
    assert calibrated_for(load_cluster_file(path), 128).expert_rate(1) == pytest.approx(0.025e12)
