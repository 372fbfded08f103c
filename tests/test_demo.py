"""The embedded demo assets: built offline once, reused, and `demo` resolves in every command."""

import json

from fcsd import demo_assets
from fcsd.cli import main
from fcsd.distill.synthetic import GENERAL_TASKS


def test_demo_is_built_once_and_resolves(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FCSD_CACHE", str(tmp_path))
    monkeypatch.setattr(demo_assets, "PRETRAIN_STEPS", 30)
    root = demo_assets.prepare_demo()
    config = json.loads((root / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    # the conversion data covers other tasks than the scored ones (the paper's setting)
    rows = (root / "data" / "train.jsonl").read_text().splitlines()
    assert (
        {json.loads(r)["task"] for r in rows} == set(GENERAL_TASKS) == {"copy", "desc", "max", "min", "sub", "lookup"}
    )
    rows = (root / "data" / "heldout.jsonl").read_text().splitlines()
    assert {json.loads(r)["task"] for r in rows} == {"add", "sort", "reverse", "recall"}
    stamp = (root / "model" / "config.json").stat().st_mtime_ns
    assert demo_assets.prepare_demo() == root and (root / "model" / "config.json").stat().st_mtime_ns == stamp
    assert main(["inspect", "demo", "--layers", "last:50%", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["converted_layers"] == [3, 4, 5]


def test_teacher_pretraining_learns(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    from fcsd.distill.synthetic import make_dataset
    from fcsd.distill.tokenizer import train_tokenizer

    rows = make_dataset(300)
    tokenizer = train_tokenizer((m["content"] for r in rows for m in r["messages"]), vocab_size=300)
    model = Qwen3MoeForCausalLM(demo_assets.demo_config(len(tokenizer)))
    losses = demo_assets.pretrain_teacher(model, tokenizer, rows, steps=40, batch_size=4, seq_len=64)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


def test_convert_demo_prints_the_comparison_table(tmp_path, monkeypatch, capsys):
    """`fcsd convert demo` end to end on a tiny budget: FCSD and SFT runs, then the four-row report."""
    monkeypatch.setenv("FCSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo_assets, "PRETRAIN_STEPS", 30)
    out = tmp_path / "demo"
    argv = ["convert", "demo", "train.max_steps=2", "train.warmup_steps=1", f"output_dir={out}", "progress=false"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for row in ("| teacher |", "| converted, before training |", "| after FCSD (KL) |", "| after SFT, same budget |"):
        assert row in printed
    assert "FCSD and SFT trained on the same conversion data, other tasks the teacher knows" in printed
    report = json.loads((out / "demo_report.json").read_text())
    assert report["teacher"]["kl"] == 0.0 and report["converted, before training"]["kl"] > 0
    assert set(report["teacher"]) == {"kl", "add", "sort", "reverse", "recall", "all", "conversion tasks"}
    for run in ("fcsd-kl", "fcsd-sft"):
        assert (out / run / "final" / "config.json").exists()
    # it ends with lm-eval on the demo suite: teacher vs the FCSD model, the table also in the export's card
    assert set(report["lm-eval"]) == {"original", "converted", "delta"}
    assert set(report["lm-eval"]["converted"]) == {"demo-gen", "demo-choice", "Avg"}
    assert "| converted (" in (out / "fcsd-kl" / "export" / "README.md").read_text()
    # `make demo` again: the demo replaces its own runs (evaluation and export included), nothing else
    (out / "notes.txt").write_text("mine")
    assert main([*argv[:2], "train.max_steps=1", *argv[3:]]) == 0
    assert json.loads((out / "fcsd-kl" / "final" / "fcsd_checkpoint.json").read_text())["step"] == 1
    assert (out / "notes.txt").read_text() == "mine"
