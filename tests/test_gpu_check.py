"""benchmarks/gpu_check.py, the prepared one-GPU check, run on the CPU (``--device cpu --quick``): every section that
can run on a CPU passes with its figures, the others say why they were skipped, and the exit status says so."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from processes import started

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
SECTIONS = ["one_process", "fsdp_one_process", "expert_parallel", "fp8_teacher", "memory", "bench", "sglang"]
SGLANG = (
    importlib.util.find_spec("sglang") is not None or (SCRIPT.parents[1] / ".venv-sglang" / "bin" / "python").exists()
)


def test_gpu_check_on_the_cpu_runs_every_cpu_section_and_says_why_it_skipped_the_others(tmp_path):
    out = tmp_path / "report.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--json", str(out)]
    with started(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        stdout, stderr = process.communicate(timeout=900)
    report = json.loads(out.read_text())
    assert process.returncode == 0, (stdout[-3000:], stderr[-3000:], {k: v.get("reason") for k, v in report.items()})
    assert set(SECTIONS) <= set(report)
    status = {name: report[name]["status"] for name in SECTIONS}
    expected = {**dict.fromkeys(SECTIONS, "ok"), "fp8_teacher": "skipped", "sglang": "ok" if SGLANG else "skipped"}
    assert status == expected, status

    one = report["one_process"]  # the trainer's step: every expert matmul in bf16 under autocast (fp32 masters)
    assert one["grouped_mm_input_dtypes"] and set(one["grouped_mm_input_dtypes"]) == {"c10::BFloat16 x c10::BFloat16"}
    assert one["experts_bf16"] and "n/a" in one["host_syncs_per_moe_layer"]
    assert {"hf_loop", "fcsd"} <= set(one["kd_step"]["methods"])
    assert all(m["tokens_per_s"] > 0 for m in one["kd_step"]["methods"].values())

    fsdp = report["fsdp_one_process"]  # killed after a DCP step checkpoint, resumed: the same run exactly
    assert fsdp["same_losses"] and fsdp["same_grad_norms"] and fsdp["same_final_weights"]
    assert len(fsdp["losses"]) == fsdp["steps"] and fsdp["dcp_files"] and fsdp["final_tensors"] > 0

    ep = report["expert_parallel"]
    assert set(ep["worst"]) == {"plain", "dedup", "hierarchical"} and ep["tolerance"] == 1e-5
    for dispatcher, worst in ep["worst"].items():
        assert max(worst[k] for k in ("logits", "loss", "grad_norm", "param_grad")) < 1e-5, (dispatcher, worst)
        assert worst["host_copies"] > 0  # checkpointed layers' exchanges went to host memory (offload)
    assert ep["worst"]["hierarchical"]["node_size"] == 1  # two stand-in nodes of one rank: two hops

    fp8 = report["fp8_teacher"]  # FP8 itself needs a GPU; the dequantized path ran
    assert "compute capability >= 8.9" in fp8["reason"]
    assert fp8["dequantized"]["shards"] > 0 and len(fp8["dequantized"]["losses"]) == 2

    memory = report["memory"]
    assert memory["cache_teacher_peak_gib"] < memory["cache_teacher_bound_gib"]
    head = memory["head_in_forward"]
    assert (
        head["loss_finite"] and head["largest_tensor"] <= head["chunk"] * head["vocab"] < head["tokens"] * head["vocab"]
    )
    assert 0 < head["extra_peak_bytes"] < head["chunk_bound_bytes"]

    bench = report["bench"]
    assert bench["cluster"]["tflops"] > 0 and bench["overlap"]["ranks"] == 2
    assert bench["overlap"]["step_speedup_over_regular"] > 0

    served = report["sglang"]  # SGLang's CPU engine with fcsd's plugin (.venv-sglang, as CI builds it)
    if SGLANG:
        assert served["tokens_match_fcsd"] and served["stock_mismatch"].startswith("prompt ")
        variants = {(row["layers"], row["overlap"]) for row in served["prefill"]}
        assert variants == {("none", "-"), ("all", "off"), ("all", "on")}, variants
    else:
        assert "make sglang-env" in served["reason"]
    table = out.with_suffix(".md").read_text()
    assert all(f"| {name} | {status[name]} |" in table for name in SECTIONS) and table in stdout
