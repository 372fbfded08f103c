"""Recipes (model presets, data blocks, sweeps, accelerate configs) compose and validate; presets are picked by
name or hub id; `fcsd sweep demo` runs both stages, writes its table / CSV / plot / selection, and a restart runs
nothing again."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from fcsd.cli import main
from fcsd.distill.config import compose, preset_for, presets, recipes_dir, to_config
from fcsd.embedded import assets as demo_assets

RECIPES = recipes_dir()


@pytest.mark.parametrize("group", ["model", "data", "sweep"])
def test_every_recipe_composes_and_validates(group):
    options = sorted(path.stem for path in (RECIPES / group).glob("*.yaml"))
    assert options
    for option in options:
        extra = [] if group == "model" else ["model.name=some/model"]
        config = to_config(compose([f"{group}={option}", *extra, "data.path=x.jsonl"]))
        assert config.model.name


def test_presets_set_the_paper_models_and_are_picked_by_hub_id(capsys):
    assert presets() == {
        "deepseek_v2_lite": "deepseek-ai/DeepSeek-V2-Lite-Chat",
        "demo": "demo",
        "llama4_scout": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
        "qwen3_30b_a3b": "Qwen/Qwen3-30B-A3B",
    }
    assert preset_for("Qwen/Qwen3-30B-A3B") == "qwen3_30b_a3b" and preset_for("some/other-model") is None
    assert main(["convert", "model=qwen3_30b_a3b", "--cfg", "job"]) == 0
    by_preset = yaml.safe_load(capsys.readouterr().out)
    assert main(["convert", "Qwen/Qwen3-30B-A3B", "--cfg", "job"]) == 0
    by_hub_id = yaml.safe_load(capsys.readouterr().out)
    assert by_preset == by_hub_id
    assert by_preset["model"]["accelerate_config"] == "recipes/accelerate/fsdp2_8gpu.yaml"
    assert by_preset["train"]["gradient_checkpointing"] is True and by_preset["early_stop"]["enabled"] is True
    assert main(["convert", "model=llama4_scout", "data=tulu3_sft_mixture", "--cfg", "job"]) == 0
    scout = yaml.safe_load(capsys.readouterr().out)
    assert scout["teacher"]["mode"] == "cache" and scout["data"]["path"] == "allenai/tulu-3-sft-mixture"
    assert main(["convert", "model=nope", "--cfg", "job"]) == 2
    assert "nope" in capsys.readouterr().err


def test_accelerate_configs_load():
    from accelerate.commands.config.config_args import load_config_from_file

    files = sorted((RECIPES / "accelerate").glob("*.yaml"))
    assert len(files) == 5
    for path in files:
        config = load_config_from_file(str(path))
        assert config.distributed_type in ("FSDP", "DEEPSPEED", "MULTI_GPU")  # MULTI_GPU: the expert-parallel one
        assert config.num_processes == 8 * config.num_machines
        if config.deepspeed_config:
            assert (Path.cwd() / config.deepspeed_config["deepspeed_config_file"]).exists()


def test_missing_cluster_launcher_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "hydra_plugins.hydra_submitit_launcher", None)  # as if not installed
    assert main(["sweep", "model.name=x", "data.path=x.jsonl", "sweep.launcher=submitit_slurm"]) == 2
    assert "pip install 'fcsd[slurm]'" in capsys.readouterr().err


def run_losses(run: Path, last: int) -> float:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    return sum(losses[-last:]) / last


@pytest.fixture
def small_demo(tmp_path, monkeypatch):
    monkeypatch.setenv("FCSD_CACHE", str(tmp_path / "cache"))  # the sweep's processes find this small demo
    monkeypatch.setattr(demo_assets, "PRETRAIN_STEPS", 30)
    demo_assets.prepare_demo()


def test_demo_sweep_selects_and_does_not_rerun(small_demo, tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["sweep", "demo", f"output_dir={out}", "sweep.steps=4", "sweep.select_last=2", "progress=false"]
    # 1000 tokens are not whole 128-token sequences: that run crashes, the others go on
    argv += ["sweep.batch_tokens=[1024,2048,1000]", "sweep.lrs=[0.001,0.002]", "train.micro_batch_size=8"]
    argv += ["teacher.mode=cache", "teacher.top_k=16"]  # one teacher cache for every run
    assert main(argv) == 0
    printed = capsys.readouterr().out
    root = out / "sweep"
    for name in ("sweep_table.md", "sweep.csv", "sweep_losses.png", "selection.json"):
        assert (root / name).stat().st_size > 0
    rows = (root / "sweep.csv").read_text().splitlines()
    assert rows[0] == "stage,batch_tokens,lr,status,steps,loss,run" and len(rows) == 6
    assert [row.split(",")[3] for row in rows[1:]] == ["finished", "finished", "crashed", "finished", "finished"]
    stage1 = {b: run_losses(root / "stage1" / f"bt{b}-lr0.001", 2) for b in (1024, 2048)}
    chosen = min(stage1, key=stage1.get)
    # stage 2 trains only the new LR: the stage-1 run of the chosen batch size stands in for LR 0.001
    assert [p.name for p in (root / "stage2").glob("bt*")] == [f"bt{chosen}-lr0.002"]
    assert rows[4].split(",")[-1] == f"stage1/bt{chosen}-lr0.001"
    stage2 = {0.001: stage1[chosen], 0.002: run_losses(root / "stage2" / f"bt{chosen}-lr0.002", 2)}
    selection = json.loads((root / "selection.json").read_text())
    assert (selection["batch_tokens"], selection["lr"]) == (chosen, min(stage2, key=stage2.get))
    assert selection["peak_lr"] == selection["lr"] * 4  # the guided default's LR rule: 4 x train.lr
    assert f"peak LR {selection['peak_lr']:g}" in (root / "sweep_table.md").read_text()
    settings = f"train.batch_tokens={chosen} train.lr={selection['lr']:g}"
    kept = "model=demo model.name=demo progress=false train.micro_batch_size=8 teacher.mode=cache teacher.top_k=16 "
    kept += f"teacher.cache_dir={root / 'teacher-cache'} output_dir={out / 'fcsd'}"  # the full run reuses the cache
    assert selection["command"] == f"fcsd convert {kept} {settings}"
    assert f"full conversion: {selection['command']}" in printed
    status = json.loads((root / "stage1" / "bt1000-lr0.001" / "sweep_status.json").read_text())
    assert "batch_tokens=1000 is not a multiple of data.seq_len=128" in status["error"]
    cache = root / "teacher-cache"
    configs = [yaml.safe_load(path.read_text()) for path in root.glob("stage*/bt*/fcsd_config.yaml")]
    assert [(c["teacher"]["mode"], c["teacher"]["cache_dir"]) for c in configs] == [("cache", str(cache))] * 3
    # a restart runs nothing again: the finished runs keep their files, the crashed one stays crashed
    stamps = {p: p.stat().st_mtime_ns for p in [*root.glob("stage*/bt*/metrics.jsonl"), cache / "meta.json"]}
    assert len(stamps) == 4
    assert main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert json.loads((root / "selection.json").read_text()) == selection


def test_a_multimodal_llama4_checkpoint_trains_its_text_model(tmp_path):
    """What the llama4_scout preset relies on: fcsd convert on a Llama4ForConditionalGeneration checkpoint."""
    import torch
    from test_trainer import FAST
    from tiny_models import CONFIGS

    import fcsd
    from fcsd.distill.convert import convert
    from fcsd.embedded.synthetic import make_dataset, write_jsonl
    from fcsd.embedded.tokenizer import train_tokenizer

    rows = make_dataset(120, seed=3)
    tokenizer = train_tokenizer((m["content"] for r in rows for m in r["messages"]), vocab_size=200)
    cls, config = CONFIGS["llama4_multimodal"]()
    config.text_config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path / "scout")
    tokenizer.save_pretrained(tmp_path / "scout")
    write_jsonl(rows, tmp_path / "chat.jsonl")
    overrides = [f"model.name={tmp_path / 'scout'}", f"data.path={tmp_path / 'chat.jsonl'}", *FAST]
    result = convert(to_config(compose([*overrides, "train.max_steps=2", f"output_dir={tmp_path / 'run'}"])))
    assert result.eval_before["eval/kl"] > 0
    assert json.loads((result.final_dir / "config.json").read_text())["architectures"] == ["Llama4ForCausalLM"]
    text_model = fcsd.from_pretrained(str(result.final_dir))
    assert fcsd.farskip_layers(text_model) == list(range(config.text_config.num_hidden_layers))


def test_sweep_through_the_submitit_launcher(small_demo, tmp_path):
    """The cluster launcher option, with submitit's local executor standing in for SLURM."""
    out = tmp_path / "demo"
    argv = ["sweep", "demo", f"output_dir={out}", "sweep.steps=2", "sweep.select_last=1", "progress=false"]
    argv += ["sweep.batch_tokens=[1024]", "sweep.lrs=[0.002]", "train.micro_batch_size=8"]
    assert main([*argv, "sweep.launcher=submitit_local"]) == 0
    root = out / "sweep"
    assert json.loads((root / "selection.json").read_text())["batch_tokens"] == 1024
    for run in ("stage1/bt1024-lr0.001", "stage2/bt1024-lr0.002"):
        assert (root / run / "run_summary.json").exists()
        assert list((root / run.split("/")[0] / ".submitit").iterdir())  # the job went through submitit


def test_sweep_selects_on_the_divergence_not_the_guided_total(tmp_path):
    """Under the guided recipe a run logs train/loss = KL + weight x guide, the weight fading at each run's own pace
    (its length depends on its batch size): the sweep compares runs on the KL (train/kl), and on train/loss where that
    is all a step logs (the guide faded, or another recipe)."""
    from fcsd.distill.sweep import read_run

    rows = [
        {"step": 1, "train/loss": 9.0, "train/kl": 1.0, "train/hidden": 2.0},
        {"step": 2, "train/loss": 2.0},
        {"step": 3, "train/loss": 5.0, "train/skipped": True},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "run_summary.json").write_text("{}")
    run = read_run(tmp_path, select_last=2)
    assert run["status"] == "finished" and run["curve"] == [(1, 1.0), (2, 2.0)] and run["loss"] == 1.5
