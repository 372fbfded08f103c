"""The README's expert-parallel command, as a user starts it: ``torchrun --nproc_per_node 2 -m fcsd.cli convert demo
parallel.ep_size=2`` on the embedded default (a shorter training budget), end to end: exit 0, every message and
table once, the reports, the lm-eval table and the exports from the main process."""

import json

from launch import torchrun

from fcsd.embedded import assets as demo_assets


def test_readme_expert_parallel_demo_command_runs_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("FCSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo_assets, "PRETRAIN_STEPS", 30)
    demo_assets.prepare_demo()  # a quickly pretrained demo teacher, found by both processes in FCSD_CACHE
    out = tmp_path / "demo"
    budget = ["train.max_steps=2", "train.warmup_steps=1", "progress=false", f"output_dir={out}"]
    result = torchrun(2, "-m", "fcsd.cli", "convert", "demo", "parallel.ep_size=2", *budget, check=False, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    printed = result.stdout
    assert printed.count("demo: training the converted model with train.objective=kl") == 1
    assert printed.count("| teacher |") == 1 and printed.count("| after FCSD (KL) |") == 1
    # the demo preset's micro-batch of 16 does not divide a process's 8 sequences: 8 is used, said once
    assert printed.count("micro-batches of 8") == 2  # once per run (FCSD, SFT)
    assert "Traceback" not in result.stderr
    report = json.loads((out / "demo_report.json").read_text())
    assert report["converted, before training"]["kl"] > 0
    assert set(report["lm-eval"]) == {"original", "converted", "delta"}
    for run in ("fcsd-kl", "fcsd-sft"):
        assert (out / run / "export" / "config.json").exists()
        summary = json.loads((out / run / "run_summary.json").read_text())
        assert summary["steps"] == 2
