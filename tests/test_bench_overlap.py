"""`fcsd bench overlap` without a GPU: the device/backend plan, the trace arithmetic that reads exposed communication
on GPUs, and the CPU gloo fallback end to end (2 processes)."""

import types

import pytest
import torch

from fcsd.bench.overlap import plan_device, run_overlap_benchmark
from fcsd.bench.timeline import StepTimer, Timeline


@pytest.mark.parametrize(
    "request_, expected",
    [
        (("auto", "auto", 1, 2, 0), ("gloo", "cpu")),  # CPU machine
        (("auto", "auto", 1, 2, 2), ("nccl", "cuda:1")),  # one GPU per rank
        (("auto", "auto", 1, 2, 1), ("gloo", "cuda:0")),  # two ranks share one GPU: only gloo can
        (("gloo", "auto", 3, 4, 2), ("gloo", "cuda:1")),
        (("auto", "cpu", 0, 2, 8), ("gloo", "cpu")),
    ],
)
def test_device_plan(request_, expected):
    assert plan_device(*request_) == expected


def test_device_plan_refusals():
    with pytest.raises(ValueError, match="no CUDA device"):
        plan_device("auto", "cuda", 0, 2, 0)
    with pytest.raises(ValueError, match="one CUDA device per rank"):
        plan_device("nccl", "auto", 0, 2, 1)


def test_exposed_communication_is_what_no_compute_overlaps():
    timeline = Timeline()
    timeline.add("compute", 0, 10)
    timeline.add("compute", 12, 20)
    timeline.add("comm", 5, 14)  # 5-10 and 12-14 hidden, 10-12 exposed
    timeline.add("comm", 18, 25)  # 18-20 hidden, 20-25 exposed
    timeline.add("comm", 21, 23)  # inside the previous one: counted once
    assert timeline.busy("comm") == 16 and timeline.busy("compute") == 18
    assert timeline.exposed() == 2 + 5


def test_timeline_reads_device_kernels_of_a_profiler_run():
    def kernel(name, start, end, device=torch.autograd.DeviceType.CUDA):
        return types.SimpleNamespace(
            name=name, time_range=types.SimpleNamespace(start=start, end=end), device_type=device
        )

    events = [
        kernel("ampere_bf16_s16816gemm", 0, 100),
        kernel("ncclDevKernel_SendRecv(ncclDevComm*)", 50, 180),
        kernel("aten::mm", 0, 300, torch.autograd.DeviceType.CPU),  # host-side: ignored
    ]
    timeline = Timeline.from_profiler(types.SimpleNamespace(events=lambda: events))
    assert timeline.busy("comm") == 130 and timeline.exposed() == 80


def test_step_timer_on_cpu():
    timer = StepTimer(torch.device("cpu"))
    timer.mark("a")
    timer.mark("b")
    timer.mark("end")
    phases = timer.seconds()
    assert set(phases) == {"a", "b"} and all(v >= 0 for v in phases.values())


def test_cpu_fallback_runs_end_to_end():
    result = run_overlap_benchmark(2, "tiny", iters=1)
    assert (result["device"], result["backend"], result["dtype"]) == ("cpu", "gloo", "float32")
    for phase in ("forward", "backward"):
        figures = result[phase]
        assert all(figures[k] > 0 for k in ("T_regular_ms", "T_ref_ms", "T_ovl_ms", "T_comp_ms", "T_comm_ms"))
    assert "trace" not in result  # device kernels exist only on a GPU
    assert result["dispatch_rows_per_step"] > 0


def test_node_aware_dispatch_benchmark_counts_rows_crossing_stand_in_nodes():
    """`fcsd bench overlap --dispatcher hierarchical --node-size 1` on 2 ranks: two stand-in nodes, so every remote
    row crosses a node; the node-aware dispatcher sends one per (token, node), fewer than plain's per (token,
    expert)."""
    rows = {}
    for kind in ("plain", "hierarchical"):
        result = run_overlap_benchmark(2, "tiny", iters=1, dispatcher=kind, node_size=1)
        assert result["node_size"] == 1
        assert result["dispatch_rows_crossing_nodes_per_step"] == result["dispatch_rows_per_step"] > 0
        rows[kind] = result["dispatch_rows_per_step"]
    assert rows["hierarchical"] < rows["plain"]
    with pytest.raises(ValueError, match="--node-size 3: it must be at least 1 and divide --ranks 4"):
        run_overlap_benchmark(4, "tiny", iters=1, node_size=3)
