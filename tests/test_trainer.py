"""The FCSD trainer end to end on a tiny Qwen3-MoE checkpoint: outputs, loss normalisation, objectives, teacher
cache, exact resume after a kill, two gloo processes, NaN handling and input errors."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hub_server import no_hub_login
from launch import torchrun
from tiny_models import build

import fcsd
from fcsd.cli import main
from fcsd.demo import pretrain_teacher
from fcsd.distill.config import compose, to_config
from fcsd.distill.synthetic import make_dataset, write_jsonl
from fcsd.distill.tokenizer import train_tokenizer
from fcsd.distill.trainer import SpikeGuard, convert

FAST = [
    "data.seq_len=32",
    "data.eval_sequences=4",
    "train.batch_tokens=256",
    "train.micro_batch_size=4",
    "train.warmup_steps=2",
    "train.lr=1e-3",
    "progress=false",
    "early_stop.enabled=false",
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny teacher briefly pretrained on the chat data (so FarSkip conversion visibly hurts it), its tokenizer
    and the data."""
    root = tmp_path_factory.mktemp("assets")
    rows = make_dataset(240, seed=5)
    tokenizer = train_tokenizer((m["content"] for r in rows for m in r["messages"]), vocab_size=280)
    model = build("qwen3_moe")
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    pretrain_teacher(model, tokenizer, rows, steps=150, seq_len=64, batch_size=8, lr=1e-2)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    write_jsonl(rows, root / "train.jsonl")
    return root


def config_for(assets, out, *overrides):
    base = [f"model.name={assets / 'model'}", f"data.path={assets / 'train.jsonl'}", f"output_dir={out}"]
    return to_config(compose([*base, f"data.cache_dir={assets / 'cache'}", *FAST, *overrides]))


def losses_of(out) -> list[float]:
    return [
        r["train/loss"]
        for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines())
        if "train/loss" in r
    ]


def test_convert_writes_a_loadable_converted_checkpoint_and_reduces_kl(assets, tmp_path):
    result = convert(
        config_for(assets, tmp_path / "run", "train.max_steps=8", "farskip.layers=last:50%", "train.lr=3e-4")
    )
    assert result.eval_after["eval/kl"] < 0.85 * result.eval_before["eval/kl"]
    model = fcsd.from_pretrained(str(result.final_dir))
    assert fcsd.farskip_layers(model) == [2, 3]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval/kl" in r] == [0, 8]
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, 9))
    assert all(r["train/tokens"] == 256 * r["step"] for r in records if "train/loss" in r)
    for name in ("curves.png", "fcsd_config.yaml", "run_summary.json", "final/fcsd_config.yaml", "export/config.json"):
        assert (tmp_path / "run" / name).stat().st_size > 0
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    recipe = json.loads((tmp_path / "run" / "export" / "config.json").read_text())["farskip"]["recipe"]
    assert (recipe["objective"], recipe["steps"], recipe["tokens"], recipe["lr"]) == ("kl", 8, 8 * 256, 3e-4)
    # the final checkpoint holds the trained student: its held-out KL is the one the run reported
    from fcsd.distill.trainer import heldout_metrics, load_data, load_models, load_tokenizer

    config = config_for(assets, tmp_path / "run")
    tokenizer = load_tokenizer(config)
    teacher, _ = load_models(config, tokenizer, torch.device("cpu"), need_student=False)
    _, held, _ = load_data(config, tokenizer)
    reloaded = heldout_metrics(model, held, config, teacher)
    assert reloaded["eval/kl"] == pytest.approx(result.eval_after["eval/kl"], rel=1e-4)


def test_loss_does_not_depend_on_micro_batching(assets, tmp_path):
    one = convert(config_for(assets, tmp_path / "a", "train.max_steps=3", "train.micro_batch_size=8"))
    four = convert(config_for(assets, tmp_path / "b", "train.max_steps=3", "train.micro_batch_size=2"))
    assert one.steps == four.steps == 3
    torch.testing.assert_close(torch.tensor(losses_of(tmp_path / "a")), torch.tensor(losses_of(tmp_path / "b")))


@pytest.mark.parametrize("objective", ["sft", "kl_l2"])
def test_other_objectives_train(assets, tmp_path, objective):
    out = tmp_path / objective
    convert(config_for(assets, out, "train.max_steps=6", f"train.objective={objective}", "train.lr=1e-2"))
    curve = losses_of(out)
    assert curve[-1] < curve[0]
    if objective == "kl_l2":
        record = json.loads((out / "metrics.jsonl").read_text().splitlines()[1])
        assert record["train/l2"] > 0


def test_frozen_embeddings_stay_put(assets, tmp_path):
    result = convert(config_for(assets, tmp_path / "f", "train.max_steps=2", "train.freeze_embeddings=true"))
    trained, original = fcsd.from_pretrained(str(result.final_dir)), fcsd.from_pretrained(str(assets / "model"))
    assert torch.equal(trained.get_input_embeddings().weight, original.get_input_embeddings().weight)
    assert torch.equal(trained.get_output_embeddings().weight, original.get_output_embeddings().weight)
    assert not torch.equal(
        trained.model.layers[0].self_attn.q_proj.weight, original.model.layers[0].self_attn.q_proj.weight
    )


def test_training_from_the_teacher_cache(assets, tmp_path, capsys):
    cache = tmp_path / "cache"
    base = [str(assets / "model"), f"data.path={assets / 'train.jsonl'}", f"data.cache_dir={assets / 'cache'}"]
    common = [*base, *FAST, f"teacher.cache_dir={cache}", "teacher.top_k=280"]
    assert main(["cache-teacher", *common]) == 0
    meta = json.loads((cache / "meta.json").read_text())
    assert meta["top_k"] == 280 and meta["rows"] > 4
    assert main(["convert", *common, "teacher.mode=cache", "train.max_steps=3", f"output_dir={tmp_path / 'c'}"]) == 0
    # with every token cached the bucketed KL is the full KL: the same losses as the online teacher
    assert main(["convert", *common, "train.max_steps=3", f"output_dir={tmp_path / 'o'}"]) == 0
    torch.testing.assert_close(torch.tensor(losses_of(tmp_path / "c")), torch.tensor(losses_of(tmp_path / "o")))
    capsys.readouterr()
    stale = ["convert", *common, "teacher.mode=cache", "data.seq_len=16", f"output_dir={tmp_path / 'x'}"]
    assert main(stale) == 2
    assert "was made from another model, data or setting" in capsys.readouterr().err


def test_killed_run_resumes_exactly(assets, tmp_path):
    """SIGKILL a run mid-way; the resumed run's loss sequence equals an uninterrupted run's."""
    args = [sys.executable, "-m", "fcsd.cli", "convert", str(assets / "model"), f"data.path={assets / 'train.jsonl'}"]
    args += [f"data.cache_dir={assets / 'cache'}", *FAST, "train.max_steps=40", "train.save_every=3"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.Popen([*args, f"output_dir={tmp_path / 'k'}"], env=env, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "k" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and len(losses_of(tmp_path / "k")) >= 7):
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    assert len(losses_of(tmp_path / "k")) < 40
    subprocess.run([*args, f"output_dir={tmp_path / 'k'}", "--resume"], env=env, check=True, capture_output=True)
    subprocess.run([*args, f"output_dir={tmp_path / 'u'}"], env=env, check=True, capture_output=True)
    resumed, uninterrupted = losses_of(tmp_path / "k"), losses_of(tmp_path / "u")
    assert len(resumed) == 40
    assert resumed == uninterrupted


def test_two_gloo_processes_match_one(assets, tmp_path):
    args = ["-m", "fcsd.cli", "convert", str(assets / "model"), f"data.path={assets / 'train.jsonl'}"]
    args += [f"data.cache_dir={assets / 'cache'}", *FAST, "train.max_steps=3", "train.micro_batch_size=4"]
    torchrun(2, *args, f"output_dir={tmp_path / 'two'}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, *args, f"output_dir={tmp_path / 'one'}"], env=env, check=True, capture_output=True)
    torch.testing.assert_close(torch.tensor(losses_of(tmp_path / "two")), torch.tensor(losses_of(tmp_path / "one")))


def test_non_finite_and_spiking_steps_are_skipped(assets, tmp_path, monkeypatch):
    from fcsd.distill import trainer

    real = trainer.micro_batch_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        parts = real(*args, **kwargs)
        if calls["n"] == 3:  # the third micro-batch (step 2 with 2 micro-batches a step) turns NaN
            parts.total = parts.total * float("nan")
        return parts

    monkeypatch.setattr(trainer, "micro_batch_loss", poisoned)
    config = config_for(assets, tmp_path / "nan", "train.max_steps=4", "train.micro_batch_size=4")
    convert(config)
    records = [json.loads(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in records if r.get("train/skipped")]
    assert skipped == [2]
    assert all(torch.isfinite(p).all() for p in fcsd.from_pretrained(str(tmp_path / "nan" / "final")).parameters())


def test_spike_guard_decisions():
    guard = SpikeGuard(factor=3.0, window=3, max_bad=2)
    assert [guard.check(x, 1.0) for x in (1.0, 1.2, 0.9)] == [None, None, None]
    assert guard.check(2.9, 1.0) is None  # below 3x the median 1.0... after it joins the history
    assert "loss spike" in guard.check(10.0, 1.0)
    assert guard.check(1.0, 1.0) is None  # a good step resets the streak
    assert "non-finite" in guard.check(float("nan"), 1.0)
    with pytest.raises(RuntimeError, match="training diverged: 2 steps in a row"):
        guard.check(1.0, float("inf"))


def test_bad_input_errors(assets, tmp_path, capsys):
    model = str(assets / "model")
    small = tmp_path / "small-vocab"  # a checkpoint predicting fewer tokens than its tokenizer holds
    build("qwen3_moe").save_pretrained(small)
    train_tokenizer(["add 1 + 2"] * 5, vocab_size=300).save_pretrained(small)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [
        (["convert", model, f"data.path={assets / 'train.jsonl'}", f"output_dir={tmp_path / 'full'}"], "is not empty"),
        (["convert", model, "train.objective=dpo", f"data.path={assets / 'train.jsonl'}"], "train.objective='dpo'"),
        (["convert", model, "train.lr=fast"], "train.lr"),
        (["convert", model, "train.not_a_key=1"], "not_a_key"),
        (["convert", model, *FAST, f"data.path={assets / 'train.jsonl'}", "train.batch_tokens=100"], "multiple of"),
        (["convert", model], "data.path is required"),
        (["convert", model, f"data.path={tmp_path / 'missing.jsonl'}"], "missing.jsonl: no such file"),
        (["convert", str(tmp_path / "no-model"), f"data.path={assets / 'train.jsonl'}"], "no-model: no such folder"),
        (["convert", str(small), *FAST, f"data.path={assets / 'train.jsonl'}"], "vocabulary mismatch"),
    ]
    for argv, message in cases:
        assert main([*argv, f"output_dir={tmp_path / 'new'}"] if "output_dir" not in argv[-1] else argv) == 2, argv
        assert message in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # a run refused on its inputs leaves nothing behind


def test_cfg_job_prints_the_resolved_config(capsys):
    assert main(["convert", "some/model", "train.lr=4e-5", "--cfg", "job"]) == 0
    printed = capsys.readouterr().out
    assert "name: some/model" in printed and "lr: 4.0e-05" in printed and "batch_tokens: 65536" in printed


@pytest.mark.parametrize("objective", ["kl", "sft", "kl_l2"])
def test_head_inside_or_outside_the_forward_gives_the_same_loss_and_gradients(objective):
    """The FSDP path (LM head inside the forward, full micro-batch logits) equals the chunked-head path."""
    from types import SimpleNamespace

    from fcsd.distill.data import pack_documents
    from fcsd.distill.objectives import micro_batch_loss

    teacher = build("qwen3_moe").requires_grad_(False)
    student = fcsd.apply_farskip(build("qwen3_moe"), "all")
    batch = pack_documents([torch.randint(3, 90, (n,)).tolist() for n in (9, 14, 11)], seq_len=16)
    train = dict(objective=objective, divergence="forward_kl", temperature=1.0, jsd_beta=0.5, l2_coef=0.1)
    config = SimpleNamespace(train=SimpleNamespace(**train, loss_chunk_size=5, router_aux_coef=0.01))
    results = []
    for inside in (False, True):
        student.zero_grad()
        parts = micro_batch_loss(student, student, batch, config, teacher, head_in_forward=inside)
        parts.total.backward()
        results.append((parts.total.detach(), [p.grad.clone() for p in student.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for outside, inside in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(outside, inside)


def test_push_to_hub_without_a_token_fails_before_training(assets, tmp_path, monkeypatch, capsys):
    no_hub_login(monkeypatch, tmp_path)
    argv = ["convert", str(assets / "model"), f"data.path={assets / 'train.jsonl'}", "push_to_hub=me/x"]
    assert main([*argv, f"output_dir={tmp_path / 'run'}"]) == 2
    assert "needs a hub token: set HF_TOKEN" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
