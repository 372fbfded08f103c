"""The embedded demo assets: built offline once, reused, and `demo` resolves in every command."""

import json

from fcsd import demo
from fcsd.cli import main


def test_demo_is_built_once_and_resolves(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FCSD_CACHE", str(tmp_path))
    monkeypatch.setattr(demo, "PRETRAIN_STEPS", 30)
    root = demo.prepare_demo()
    config = json.loads((root / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    rows = (root / "data" / "train.jsonl").read_text().splitlines()
    assert {json.loads(r)["task"] for r in rows} == {"add", "sort", "reverse", "recall"}
    stamp = (root / "model" / "config.json").stat().st_mtime_ns
    assert demo.prepare_demo() == root and (root / "model" / "config.json").stat().st_mtime_ns == stamp
    assert main(["inspect", "demo", "--layers", "last:50%", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["converted_layers"] == [3, 4, 5]


def test_teacher_pretraining_learns(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    from fcsd.distill.synthetic import make_dataset
    from fcsd.distill.tokenizer import train_tokenizer

    rows = make_dataset(300)
    tokenizer = train_tokenizer((m["content"] for r in rows for m in r["messages"]), vocab_size=300)
    model = Qwen3MoeForCausalLM(demo.demo_config(len(tokenizer)))
    losses = demo.pretrain_teacher(model, tokenizer, rows, steps=40, batch_size=4, seq_len=64)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
