"""`fcsd plan` with ``teacher.dtype=fp8``: the FP8 teacher priced (e4m3 weights and fp32 block scales
where the source scaled, bf16 elsewhere) against a count of a tiny block-FP8 checkpoint's own tensors; only where the
run keeps FP8 modules (one process, DDP), the laid-out commands saying teacher.dtype=auto as the runtime requires;
refusals in one line; the config's dtype keys checked."""

from __future__ import annotations

import json

import pytest
from fp8_models import write_fp8_checkpoint
from safetensors import safe_open
from test_plan import accepted_by_convert, run_config

from fcsd.plan.cluster import GPU, Cluster, make_cluster
from fcsd.plan.model_configs import load_model_config
from fcsd.plan.printed_commands import plan_commands
from fcsd.plan.run import LAID_OUT, STRATEGIES, Layout
from fcsd.plan.simulate import estimate_step
from fcsd.plan.teacher_dtype import FP8_STRATEGIES, check_fp8_teacher, fp8_note, teacher_weights


@pytest.fixture(scope="module")
def fp8_source(tmp_path_factory):
    """A tiny block-FP8 DeepSeek-V3 (``fp8/``) and its bf16 copy (``bf16/``)."""
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8"), "deepseek_v3")


def tensor_bytes(folder) -> int:
    """Bytes of every tensor a checkpoint folder stores."""
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())


def test_the_fp8_teacher_is_priced_as_the_checkpoint_stores_it(fp8_source):
    """One process: the FP8 teacher takes what the FP8 checkpoint's tensors take (e4m3 weights, fp32 block scales,
    bf16 norms/router/embeddings/head), the bf16 teacher what its bf16 copy's take; the peak drops by the
    difference; the student is untouched. DDP prices it the same; a laid-out candidate keeps the bf16 teacher."""
    source = load_model_config(str(fp8_source / "fp8"))
    saving = tensor_bytes(fp8_source / "bf16") - tensor_bytes(fp8_source / "fp8")  # the same buffers in both
    sizes = teacher_weights(source.config)
    assert saving > 0 and sizes["bf16"] - sizes["fp8"] == saving
    bf16, fp8 = run_config(), run_config()
    fp8.teacher.dtype = "fp8"
    for layout in (Layout("single", 1), Layout("ddp", 2)):
        plain, quantized = (estimate_step(source.config, c, layout) for c in (bf16, fp8))
        assert plain.teacher - quantized.teacher == saving
        assert plain.peak - quantized.peak == saving
        assert plain.at_peak["teacher"] - quantized.at_peak["teacher"] == saving
        assert (plain.weights, plain.optimizer) == (quantized.weights, quantized.optimizer)
    laid_out = Layout("ep", 2, 2)
    assert estimate_step(source.config, fp8, laid_out).teacher == estimate_step(source.config, bf16, laid_out).teacher


def test_the_fp8_teacher_is_counted_from_one_build_per_config(fp8_source, monkeypatch):
    """A plan prices the FP8 teacher on every one-process / DDP candidate it simulates and in its note: the count
    comes from one meta-device build of the config (two per candidate before: seconds each for DeepSeek-V3)."""
    import sys

    import fcsd.connectivity.families as families
    from fcsd.plan import teacher_dtype

    builds, build = [], families.meta_model

    def counted(*args, **kwargs):
        if sys._getframe(1).f_globals["__name__"] in ("fcsd.plan.serving_fit", "fcsd.plan.teacher_dtype"):
            builds.append(args)
        return build(*args, **kwargs)

    monkeypatch.setattr(families, "meta_model", counted)
    monkeypatch.setattr(teacher_dtype, "_TEACHER_WEIGHTS", {}, raising=False)  # a fresh count
    source = load_model_config(str(fp8_source / "fp8"))
    config = run_config()
    config.teacher.dtype = "fp8"
    sizes = teacher_weights(source.config)
    for layout in (Layout("single", 1), Layout("single", 1, micro_batch=2), Layout("ddp", 2), Layout("ddp", 4)):
        assert estimate_step(source.config, config, layout).extra["fp8_saving"] == sizes["bf16"] - sizes["fp8"]
    assert "the teacher's weights take" in fp8_note(source.config)
    assert len(builds) == 1
    again = load_model_config(str(fp8_source / "fp8")).config  # the same config read again: the same count
    assert teacher_weights(again) == sizes and len(builds) == 1


def test_plan_and_runtime_agree_where_fp8_runs(fp8_source):
    """The plan keeps teacher.dtype=fp8 on the strategies the runtime loads it in (no parallel layout: the runtime
    refuses fp8 under parallel.ep_size / parallel.fsdp), and prints teacher.dtype=auto with a note elsewhere; both
    lines are accepted by convert's parser."""
    assert set(FP8_STRATEGIES) == set(STRATEGIES) - set(LAID_OUT)
    source = load_model_config(str(fp8_source / "fp8"))
    config = run_config()
    config.teacher.dtype = "fp8"
    cluster = make_cluster("h100", 2)
    extra = ["teacher.dtype=fp8", f"data.path={fp8_source}"]
    serving = (source.config.model_type, None)
    for layout, kept in ((Layout("ddp", 2), "fp8"), (Layout("ep", 2, 2), "auto"), (Layout("fsdp2", 2), "auto")):
        commands, notes = plan_commands(str(fp8_source / "fp8"), layout, "all", config, config, cluster, extra, serving)
        assert accepted_by_convert(commands["train"]).teacher.dtype == kept, commands["train"]
        replaced = [n for n in notes if n.startswith("teacher.dtype=fp8 replaced by the plan's teacher.dtype=auto")]
        assert bool(replaced) == (kept == "auto") and all("one process or DDP" in n for n in replaced)
    cached = Layout("ep", 2, 2, teacher="cache")
    commands, _ = plan_commands(str(fp8_source / "fp8"), cached, "all", config, config, cluster, extra, serving)
    assert "teacher.dtype=auto" in commands["cache_teacher"] and "teacher.dtype=fp8" not in commands["cache_teacher"]


def test_fp8_plan_reports_what_it_priced_and_refuses_what_cannot_run(fp8_source, capsys):
    from fcsd.cli import main

    argv = ["plan", str(fp8_source / "fp8"), "--gpus-per-node", "2", "--tokens", "1e6", "--json"]
    assert main([*argv, "teacher.dtype=fp8"]) == 0
    plan = json.loads(capsys.readouterr().out)
    sizes = teacher_weights(load_model_config(str(fp8_source / "fp8")).config)
    assert any(n.startswith("teacher.dtype=fp8: the teacher's weights take") for n in plan["notes"]), plan["notes"]
    chosen = plan["chosen"]["layout"]["strategy"]
    assert plan["teacher_priced"].startswith("FP8") == (
        chosen in FP8_STRATEGIES and plan["chosen"]["layout"]["teacher"] == "online"
    )
    assert sizes["fp8"] < sizes["bf16"]

    assert main(["plan", str(fp8_source / "bf16"), "--tokens", "1e6", "teacher.dtype=fp8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "teacher.dtype=fp8" in err and "not FP8: use auto" in err and "\n" not in err
    a100 = Cluster(GPU("NVIDIA A100-SXM4-80GB", 79.2, 312.0, 240.0, 25.0), 8, 1)
    config = run_config()
    config.teacher.dtype = "fp8"
    with pytest.raises(ValueError, match=r"needs FP8 kernels .* A100.*: use teacher.dtype=auto"):
        check_fp8_teacher(config, load_model_config(str(fp8_source / "fp8")).config, a100)


def test_deepseek_v3_fp8_teacher_weights_are_about_half_of_bf16():
    """The embedded DeepSeek-V3 config (the release's block-FP8 quantization_config): its FP8 teacher's weights
    are e4m3 plus 1/4096 of fp32 scales on nearly all of its 671B parameters, against two bytes each in bf16."""
    sizes = teacher_weights(load_model_config("deepseek-v3").config)
    assert 671e9 * 2 * 0.99 < sizes["bf16"] < 685e9 * 2
    assert 0.5 < sizes["fp8"] / sizes["bf16"] < 0.52


@pytest.mark.parametrize(
    ("key", "value"), [("teacher.dtype", "bf16"), ("teacher.dtype", "e4m3"), ("model.dtype", "fp8")]
)
def test_a_misspelt_dtype_is_one_line_naming_the_choices(key, value):
    from fcsd.distill.config import compose, to_config

    with pytest.raises(ValueError, match=rf"^{key}='{value}': choose one of .*bfloat16") as caught:
        to_config(compose(["model.name=x", "data.path=x", f"{key}={value}"]))
    choices = str(caught.value).split("choose one of")[1].replace(",", " ").split()
    assert "\n" not in str(caught.value) and ("fp8" in choices) == (key == "teacher.dtype")


def test_plan_and_runtime_decide_fp8_kernels_by_one_compute_capability_rule(fp8_source, monkeypatch):
    """FP8 kernels from compute capability 8.9 (fcsd.block_fp8.fp8_kernels_available), asked of the cluster's GPUs by
    the plan and of this machine's GPU by the runtime: an RTX A6000 or RTX 3090 (8.6), which no GPU-name list caught, is
    refused; an L40S (8.9) and the H100/H200 presets (9.0) pass; MI300X (ROCm: e4m3fnuz, no kernels in transformers'
    fine-grained FP8) and a GPU of no known capability are refused; a cluster file carries the measured capability."""
    import torch

    from fcsd.block_fp8 import fp8_kernels_available
    from fcsd.plan.cluster import GPUS, cluster_from_data

    config = run_config()
    config.teacher.dtype = "fp8"
    model_config = load_model_config(str(fp8_source / "fp8")).config

    def cluster(name, capability):
        return Cluster(GPU(name, 47.5, 300.0, 50.0, 25.0, compute_capability=capability), 8, 1)

    for name, capability in (("NVIDIA RTX A6000", (8, 6)), ("NVIDIA GeForce RTX 3090", (8, 6))):
        with pytest.raises(ValueError, match=rf"needs FP8 kernels .*{name} \(compute capability 8.6\) lacks") as e:
            check_fp8_teacher(config, model_config, cluster(name, capability))
        assert "\n" not in str(e.value)
    check_fp8_teacher(config, model_config, cluster("NVIDIA L40S", (8, 9)))
    for preset in ("h100", "h200"):
        check_fp8_teacher(config, model_config, make_cluster(preset, 8))
    for refused in (make_cluster("mi300x", 8), cluster("unknown", None)):
        with pytest.raises(ValueError, match=r"has none known .*: use teacher.dtype=auto"):
            check_fp8_teacher(config, model_config, refused)
    assert GPUS["mi300x"].compute_capability is None
    # the runtime's answer on this machine's GPU follows the same rule
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    for capability, expected in (((8, 6), False), ((8, 9), True), ((9, 0), True), ((8, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert fp8_kernels_available() is expected is fp8_kernels_available(capability)
    monkeypatch.setattr(torch.version, "hip", "6.2")  # ROCm reports 9.4 for MI300X
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))
    assert not fp8_kernels_available()
    # a cluster file measured on CUDA GPUs records their capability; one without it knows none
    data = {
        "name": "NVIDIA RTX A6000", "gpu_memory_gib": 47.5, "tflops": 150.0, "intra_gbps": 20.0,
        "inter_gbps": 10.0, "host_gbps": 20.0, "host_memory_gib": 256.0, "gpus_per_node": 4, "nodes": 1,
    }  # fmt: skip
    assert cluster_from_data({**data, "compute_capability": [8, 6]}).gpu.compute_capability == (8, 6)
    assert cluster_from_data(data).gpu.compute_capability is None
