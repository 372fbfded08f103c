"""The FCSD trainer end to end on a tiny Qwen3-MoE checkpoint: outputs, loss normalisation, objectives, teacher
cache, exact resume after a kill, two gloo processes, NaN handling and input errors."""

import json
import os
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hub_server import no_hub_login
from launch import torchrun
from processes import started, wait_for
from tiny_models import build

import fcsd
from fcsd.cli import main
from fcsd.distill.config import compose, to_config
from fcsd.distill.convert import convert
from fcsd.distill.optim import SpikeGuard
from fcsd.embedded.assets import pretrain_teacher
from fcsd.embedded.synthetic import make_dataset, write_jsonl
from fcsd.embedded.tokenizer import train_tokenizer

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
    return pretrained_assets(tmp_path_factory.mktemp("assets"), rows=240, steps=150, batch_size=8)


def pretrained_assets(root: Path, rows: int, steps: int, batch_size: int) -> Path:
    """``root/model`` (a tiny Qwen3-MoE teacher pretrained ``steps`` steps on chat data, with its tokenizer) and
    ``root/train.jsonl`` (the data)."""
    data = make_dataset(rows, seed=5)
    tokenizer = train_tokenizer((m["content"] for r in data for m in r["messages"]), vocab_size=280)
    model = build("qwen3_moe")
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch_threads(1):  # the same teacher on any machine and after any test (sums depend on the thread count)
        pretrain_teacher(model, tokenizer, data, steps=steps, seq_len=64, batch_size=batch_size, lr=1e-2)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    write_jsonl(data, root / "train.jsonl")
    return root


def config_for(assets, out, *overrides, fast=FAST):
    base = [f"model.name={assets / 'model'}", f"data.path={assets / 'train.jsonl'}", f"output_dir={out}"]
    return to_config(compose([*base, f"data.cache_dir={assets / 'cache'}", *fast, *overrides]))


def losses_of(out) -> list[float]:
    return [
        r["train/loss"]
        for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines())
        if "train/loss" in r
    ]


@contextmanager
def torch_threads(count: int):
    """torch's intra-op thread count set to ``count`` for the block (and set back): a result that must reproduce
    does not depend on the machine's cores or on what an earlier test left."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_convert_writes_a_loadable_converted_checkpoint_and_reduces_kl(assets, tmp_path):
    # every layer converted: a held-out KL (~0.6) far above the noise of 4 held-out sequences (last:50% starts at
    # ~0.014, where 8 steps move it by less than that noise)
    with torch_threads(1):
        result = convert(
            config_for(assets, tmp_path / "run", "train.max_steps=8", "farskip.layers=all", "train.lr=3e-4")
        )
    assert result.eval_after["eval/kl"] < 0.85 * result.eval_before["eval/kl"]
    model = fcsd.from_pretrained(str(result.final_dir))
    assert fcsd.farskip_layers(model) == [0, 1, 2, 3]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval/kl" in r] == list(range(9))  # a short run: every tenth, at least 1
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, 9))
    assert all(r["train/tokens"] == 256 * r["step"] for r in records if "train/loss" in r)
    for name in ("curves.png", "fcsd_config.yaml", "run_summary.json", "final/fcsd_config.yaml", "export/config.json"):
        assert (tmp_path / "run" / name).stat().st_size > 0
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    recipe = json.loads((tmp_path / "run" / "export" / "config.json").read_text())["farskip"]["recipe"]
    assert (recipe["objective"], recipe["steps"], recipe["tokens"], recipe["lr"]) == ("kl", 8, 8 * 256, 3e-4)
    # the final checkpoint holds the trained student: its held-out KL is the one the run reported
    from fcsd.distill.heldout import heldout_metrics
    from fcsd.distill.run_data import load_run_data
    from fcsd.distill.student_teacher import load_models, load_tokenizer

    config = config_for(assets, tmp_path / "run")
    tokenizer = load_tokenizer(config)
    teacher, _ = load_models(config, tokenizer, torch.device("cpu"), need_student=False)
    _, held, _ = load_run_data(config, tokenizer)
    reloaded = heldout_metrics(model, held, config, teacher)
    assert reloaded["eval/kl"] == pytest.approx(result.eval_after["eval/kl"], rel=1e-4)


def records_of(out, key: str) -> list[float]:
    return [r[key] for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines()) if key in r]


def assert_same_training(a, b, **tolerance):
    """Same losses, same gradient norms (a constant gradient-scale error changes them, even where AdamW and
    clipping hide it in the losses) and the same parameters after the steps (``tolerance``: ``rtol`` and ``atol`` of
    the parameters, where many small updates carry another summation order further)."""
    for key in ("train/loss", "train/grad_norm"):
        torch.testing.assert_close(torch.tensor(records_of(a, key)), torch.tensor(records_of(b, key)))
    first, second = fcsd.from_pretrained(str(Path(a) / "final")), fcsd.from_pretrained(str(Path(b) / "final"))
    for (name, x), (_, y) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, msg=name, **tolerance)


def test_loss_does_not_depend_on_micro_batching(assets, tmp_path):
    extra = ["train.max_steps=2", "train.grad_clip=0", "export=false"]  # no clipping: gradients reach AdamW raw
    one = convert(config_for(assets, tmp_path / "a", *extra, "train.micro_batch_size=8"))
    four = convert(config_for(assets, tmp_path / "b", *extra, "train.micro_batch_size=2"))
    assert one.steps == four.steps == 2
    assert_same_training(tmp_path / "a", tmp_path / "b")


@pytest.mark.parametrize("objective", ["sft", "kl_l2"])
def test_other_objectives_train(assets, tmp_path, objective):
    out = tmp_path / objective
    convert(config_for(assets, out, "train.max_steps=6", f"train.objective={objective}", "train.lr=2.5e-3"))
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
    capsys.readouterr()
    assert main(["convert", *common, "teacher.mode=cache", "train.max_steps=3", f"output_dir={tmp_path / 'c'}"]) == 0
    printed = capsys.readouterr().out  # the figure a cache gives is its own (top-k, at the run's temperature)
    assert "final: held-out top-k KL (from the teacher cache)" in printed and "held-out KL" not in printed, printed
    # with every token cached the bucketed KL is the full KL: the same losses as the online teacher (the default
    # recipe's hidden-state guide off there too, as the cache runs it)
    online = ["convert", *common, "train.max_steps=3", "recovery.hidden_l2=0", f"output_dir={tmp_path / 'o'}"]
    assert main(online) == 0
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
    metrics = tmp_path / "k" / "metrics.jsonl"
    with started([*args, f"output_dir={tmp_path / 'k'}"], env=env, stderr=subprocess.DEVNULL) as killed:
        wait_for(lambda: metrics.exists() and len(losses_of(tmp_path / "k")) >= 7, 900, "step 7", killed, 0.05)
        killed.send_signal(signal.SIGKILL)
        assert killed.wait(timeout=120) == -signal.SIGKILL
    assert len(losses_of(tmp_path / "k")) < 40
    subprocess.run([*args, f"output_dir={tmp_path / 'k'}", "--resume"], env=env, check=True, capture_output=True)
    subprocess.run([*args, f"output_dir={tmp_path / 'u'}"], env=env, check=True, capture_output=True)
    resumed, uninterrupted = losses_of(tmp_path / "k"), losses_of(tmp_path / "u")
    assert len(resumed) == 40
    assert resumed == uninterrupted


def _killed_at_checkpoint(command: list[str], run: Path, env: dict) -> None:
    """Start a multi-process run and kill all its processes (torchrun's workers too) once its first step checkpoint
    is published."""
    import psutil

    with started(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as job:
        wait_for(lambda: list(run.glob("checkpoints/step-*")), 600, "the first step checkpoint", job)
        for process in [*psutil.Process(job.pid).children(recursive=True), psutil.Process(job.pid)]:
            process.kill()  # SIGKILL, workers first seen too: no clean stop, no last checkpoint
    assert not (run / "final").exists()


@pytest.fixture(scope="module")
def parallel_runs(assets, tmp_path_factory):
    """The same 3-step run (gradient clipping active, its first step split into 2 optimizer updates by a batch ramp:
    each update reduces its own gradients in every layout) in one process, in 2 DDP processes, and EP 2 x FSDP 2 on 4
    processes with activation checkpointing (``ep-fsdp``), killed after its first step checkpoint and resumed on 2
    expert-parallel processes (``ep``: experts sharded 2 ways, the rest replicated, with its export; DCP reshards),
    which is also the expert-parallel run the later tests use. (A resume into the same layout is
    tests/test_ep_fsdp.py's DCP round trip: a third 4-process launch here would cost minutes of CI.)"""
    from launch import free_port

    root = tmp_path_factory.mktemp("parallel")
    args = ["-m", "fcsd.cli", "convert", str(assets / "model"), f"data.path={assets / 'train.jsonl'}"]
    args += [f"data.cache_dir={assets / 'cache'}", *FAST, "train.max_steps=3", "train.micro_batch_size=4"]
    args += [
        "train.save_every=2",
        "train.grad_clip=0.05",
        "recovery.batch_ramp=[2]",
        "recovery.batch_ramp_shares=[0.3]",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    one = [sys.executable, *args, "export=false", f"output_dir={root / 'one'}"]
    subprocess.run(one, env=env, check=True, capture_output=True)
    torchrun(2, *args, "export=false", f"output_dir={root / 'ddp'}")
    folded = [*args, "parallel.ep_size=2", "parallel.fsdp=true", "train.gradient_checkpointing=true", "export=false"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", f"--master_port={free_port()}"]
    killed = root / "ep-fsdp"
    _killed_at_checkpoint([*launcher, *folded, "train.save_every=1", f"output_dir={killed}"], killed, env)
    shutil.copytree(killed, root / "ep")
    torchrun(2, *args, "parallel.ep_size=2", f"output_dir={root / 'ep'}", "--resume")
    return root


def test_two_gloo_processes_match_one(parallel_runs):
    assert_same_training(parallel_runs / "ddp", parallel_runs / "one")
    assert max(records_of(parallel_runs / "one", "train/grad_norm")) > 0.05  # clipping took part
    # the checkpoint was renamed into place only after both processes wrote their RNG states into it
    checkpoint = parallel_runs / "ddp" / "checkpoints" / "step-2"
    assert {p.name for p in checkpoint.glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}


def _chunks(checkpoint: Path, key: str) -> tuple[list, list]:
    """The global shape of a tensor of a DCP step checkpoint and its ``(offsets, sizes)`` chunks."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata[key]
    return list(metadata.size), [(list(chunk.offsets), list(chunk.sizes)) for chunk in metadata.chunks]


def test_expert_parallel_training_matches_one_process(parallel_runs):
    """parallel.ep_size=2 (resumed from EP 2 x FSDP 2's step 1): same losses, global gradient norms and final/
    (stock layout, streamed) as one process; the export loads with stock shapes; its step-2 checkpoint holds each
    process's own shards (DCP), each expert tensor as its two halves."""
    ep = parallel_runs / "ep"
    assert_same_training(ep, parallel_runs / "one")
    assert (ep / "export" / "config.json").exists()
    checkpoint = ep / "checkpoints" / "step-2"
    assert {p.name for p in checkpoint.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    expert = "model.model.layers.0.mlp.experts.gate_up_proj"
    _, halves = _chunks(checkpoint, expert)
    assert sorted(offsets[0] for offsets, _ in halves) == [0, 4] and all(sizes[0] == 4 for _, sizes in halves)
    assert json.loads((checkpoint / "trainer_state.json").read_text())["layout"] == {
        "format": "torch.distributed.checkpoint",
        "world": 2,
        "ep": 2,
        "fsdp": False,
    }


def test_ep_x_fsdp_killed_resumes_exactly_and_reshards_at_another_process_count(parallel_runs):
    """EP 2 x FSDP 2 with activation checkpointing, SIGKILLed after its first step checkpoint, resumed on 2
    expert-parallel processes without FSDP (DCP reshards): it trains exactly as one process did."""
    assert_same_training(parallel_runs / "ep", parallel_runs / "one")  # step 1 on 4 processes, then 2 and 3 on 2
    assert (parallel_runs / "ep" / "checkpoints" / "step-1" / "__3_0.distcp").exists()  # resumed from 4 processes
    checkpoint = sorted((parallel_runs / "ep-fsdp" / "checkpoints").glob("step-*"))[-1]
    shape, dense = _chunks(checkpoint, "model.model.embed_tokens.weight")  # 4 row blocks, one per process
    assert len(dense) == 4 and sum(sizes[0] for _, sizes in dense) == shape[0]


def test_step_checkpoints_export_with_the_expert_shards_consolidated(parallel_runs, tmp_path):
    """`fcsd export RUN/checkpoints/step-N`: a run that never reached final/ can be exported; the expert-parallel
    checkpoint's per-rank expert shards are consolidated into the stock layout, equal to the one-process run's."""
    from fcsd.cli import main

    for run in ("one", "ep"):
        assert main(["export", str(parallel_runs / run / "checkpoints" / "step-2"), str(tmp_path / run)]) == 0
    batch = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = {
        name: fcsd.from_pretrained(str(folder)).eval()(input_ids=batch).logits
        for name, folder in (
            ("one", tmp_path / "one"),
            ("ep", tmp_path / "ep"),
            ("final", parallel_runs / "ep" / "final"),
        )
    }
    torch.testing.assert_close(logits["ep"], logits["one"], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits["ep"], logits["final"], atol=1e-4)  # step 2, not the last step
    assert "| steps | 2 |" in (tmp_path / "ep" / "README.md").read_text()


def test_a_sharded_checkpoint_with_overwritten_bytes_is_refused_by_resume_and_export(parallel_runs, tmp_path, capsys):
    """The issue's reproduction: 4 KiB of one process's shards (``__1_0.distcp`` of an expert-parallel run's last
    checkpoint) overwritten with 0xFF, size kept, made `--resume` train NaN. Every file has its SHA-256 in the
    trainer state (the processes hashed their shares); --resume and `fcsd export` refuse it in one line naming the
    file and the older sound checkpoint."""
    from fcsd.distill.preflight import check_output_dir
    from fcsd.files.ownership import FolderError

    run = tmp_path / "ep"
    shutil.copytree(parallel_runs / "ep", run, ignore=shutil.ignore_patterns("final", "export", "run_summary.json"))
    checkpoint = run / "checkpoints" / "step-2"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert set(state["sha256"]) == set(state["files"]) >= {"__0_0.distcp", "__1_0.distcp", ".metadata"}
    shard = checkpoint / "__1_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as handle:
        handle.seek(size // 2)
        handle.write(b"\xff" * 4096)
    assert shard.stat().st_size == size
    config = saved_config(run)
    config.train.resume = True
    with pytest.raises(FolderError) as refused:
        check_output_dir(run, True, False, config)
    message = str(refused.value)
    assert "checkpoints/step-2 is damaged (__1_0.distcp changed since it was written" in message, message
    assert "continue from step-1: `" in message and message.endswith("train.resume_step=1`"), message
    assert main(["export", str(checkpoint), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "__1_0.distcp changed since it was written" in err and "step-1" in err, err


def saved_config(run: Path):
    """The run config saved in ``run``, as the typed object a command composes, with ``output_dir`` = ``run``."""
    from omegaconf import OmegaConf

    from fcsd.distill.config import FCSDConfig

    saved = OmegaConf.merge(OmegaConf.structured(FCSDConfig), OmegaConf.load(run / "fcsd_config.yaml"))
    config = OmegaConf.to_object(saved)
    config.output_dir = str(run)
    return config


def test_an_export_is_a_training_source(parallel_runs, assets, tmp_path):
    """An exported farskip_* folder trains like any checkpoint: the teacher is the export as it is (FarSkip on its
    recorded layers), so a student converted on the same layers starts at zero held-out KL."""
    export = parallel_runs / "ep" / "export"
    overrides = [f"model.name={export}", "train.max_steps=1", "train.warmup_steps=1", "export=false"]
    config = config_for(assets, tmp_path / "again", *overrides)
    result = convert(config)
    assert result.eval_before["eval/kl"] < 1e-6
    assert fcsd.farskip_layers(fcsd.from_pretrained(str(result.final_dir))) == [0, 1, 2, 3]


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
    with pytest.raises(RuntimeError, match="training diverged: 2 updates in a row"):
        guard.check(1.0, float("inf"))


def test_deepspeed_guard_never_reports_a_skip_it_cannot_make():
    guard = SpikeGuard(factor=0, window=3, max_bad=5, can_skip=False)
    assert guard.check(1.0, 1.0) is None
    with pytest.raises(RuntimeError, match="DeepSpeed, which has already applied it"):
        guard.check(float("nan"), 1.0)


def test_fp16_overflow_and_refused_steps_keep_the_loss_scaler_working():
    """A refused step must close the scaler's iteration (clipping unscaled the gradients); an overflow is the
    scaler's own skip and not a bad step. accelerate's fp16 optimizer wrapper, with torch's GradScaler on CPU."""
    from accelerate.optimizer import AcceleratedOptimizer

    from fcsd.distill.optim import apply_update

    model = torch.nn.Linear(4, 4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    optimizer = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)
    guard = SpikeGuard(factor=2.0, window=1, max_bad=3)

    def step(loss_value: float, poison: bool = False):
        loss = model(torch.ones(2, 4)).sum()
        scaler.scale(loss * (float("inf") if poison else 1.0)).backward()
        scaler.unscale_(optimizer.optimizer)  # what accelerate's clip_grad_norm_ does
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        result = apply_update(optimizer, scaler, guard, loss_value, norm)
        optimizer.zero_grad()
        return result

    assert step(1.0) == (True, None)
    applied, reason = step(100.0)  # a spike: refused
    assert not applied and "loss spike" in reason
    assert step(1.0) == (True, None)  # before the fix: "unscale_() has already been called"
    scale = scaler.get_scale()
    applied, reason = step(1.0, poison=True)
    assert not applied and "overflow" in reason and scaler.get_scale() < scale and guard.bad_streak == 0


def test_teacher_and_student_of_a_bf16_checkpoint_share_the_cache_fingerprint(assets, tmp_path):
    from fcsd.distill.student_teacher import load_models, load_tokenizer
    from fcsd.distill.teacher_cache import model_fingerprint

    bf16 = tmp_path / "bf16"
    model = fcsd.from_pretrained(str(assets / "model"), dtype=torch.bfloat16)
    model.save_pretrained(bf16)
    load_tokenizer(config_for(assets, tmp_path)).save_pretrained(bf16)
    config = config_for(assets, tmp_path / "run", f"model.name={bf16}")
    tokenizer = load_tokenizer(config)
    teacher, _ = load_models(config, tokenizer, torch.device("cpu"), need_student=False)  # fp32 on CPU
    _, student = load_models(config, tokenizer, torch.device("cpu"), need_teacher=False)  # config.dtype: bf16
    assert str(student.config.dtype).endswith("bfloat16")
    assert model_fingerprint(teacher) == model_fingerprint(student)
    other = fcsd.from_pretrained(str(assets / "model"))
    with torch.no_grad():
        other.get_output_embeddings().weight[0, 0] += 1
    assert model_fingerprint(other) != model_fingerprint(teacher)


def test_heldout_kl_from_a_cache_uses_its_temperature(assets, tmp_path):
    """eval/kl_topk at T=2 from a cache of the whole vocabulary equals the full KL at T=2 (scaled by T^2)."""
    from fcsd.distill import losses
    from fcsd.distill.heldout import heldout_metrics
    from fcsd.distill.objectives import teacher_targets
    from fcsd.distill.run_data import load_run_data
    from fcsd.distill.student_teacher import load_models, load_tokenizer

    config = config_for(assets, tmp_path, "train.temperature=2.0")
    tokenizer = load_tokenizer(config)
    teacher, student = load_models(config, tokenizer, torch.device("cpu"))
    _, held, _ = load_run_data(config, tokenizer)
    x, head, _ = teacher_targets(teacher, held)
    logits = head(x)
    logp, ids = losses.topk_teacher(logits, logits.shape[-1], temperature=2.0)

    class Cache:
        def rows(self, indices):
            return logp.view(len(held), -1, logp.shape[-1])[indices], ids.view(len(held), -1, ids.shape[-1])[indices]

    cached = heldout_metrics(student, held, config, cache=Cache())
    assert set(cached) == {"eval/kl_topk", "eval/nll"}
    student_logits = head(teacher_targets(student, held)[0])
    expected = losses.kl_divergence(student_logits, logits, temperature=2.0).mean()
    assert cached["eval/kl_topk"] == pytest.approx(float(expected), rel=1e-4)


def test_sweep_runs_follow_the_full_runs_schedule_and_stop_early(assets, tmp_path):
    from fcsd.distill.optim import build_optimizer, plan_steps
    from fcsd.distill.sweep import job_overrides

    assert "train.stop_after=30" in job_overrides(tmp_path, 30)
    assert "train.max_steps=30" in job_overrides(tmp_path, 30, "truncated")
    cosine = ["recovery=plain", "train.warmup_steps=10"]  # the paper's AdamW schedule (schedule_free has none)
    full = config_for(assets, tmp_path, "train.max_steps=100", *cosine)
    sweep = config_for(assets, tmp_path, "train.max_steps=100", *cosine, "train.stop_after=30")
    truncated = config_for(assets, tmp_path, "train.max_steps=30", *cosine)
    lrs = {}
    for name, config in (("full", full), ("sweep", sweep), ("truncated", truncated)):
        plan = plan_steps(config, 1)
        _, scheduler = build_optimizer(torch.nn.Linear(2, 2), config, plan)
        lrs[name] = []
        for _ in range(plan.total_steps):
            lrs[name].append(scheduler.get_last_lr()[0])
            scheduler.step()
    assert len(lrs["sweep"]) == len(lrs["truncated"]) == 30 and len(lrs["full"]) == 100
    assert lrs["sweep"] == lrs["full"][:30]
    assert lrs["truncated"][-1] < lrs["sweep"][-1]  # the truncated cosine has already annealed


def test_bad_input_errors(assets, tmp_path, capsys):
    model = str(assets / "model")
    small = tmp_path / "small-vocab"  # a checkpoint predicting fewer tokens than its tokenizer holds
    build("qwen3_moe").save_pretrained(small)
    train_tokenizer(["add 1 + 2"] * 5, vocab_size=300).save_pretrained(small)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [
        (
            ["convert", model, f"data.path={assets / 'train.jsonl'}", f"output_dir={tmp_path / 'full'}"],
            "fcsd did not write",
        ),
        (["convert", model, "train.objective=dpo", f"data.path={assets / 'train.jsonl'}"], "train.objective='dpo'"),
        (["convert", model, "train.lr=fast"], "train.lr"),
        (["convert", model, "train.not_a_key=1"], "not_a_key"),
        (["convert", model, *FAST, f"data.path={assets / 'train.jsonl'}", "train.batch_tokens=100"], "multiple of"),
        (["convert", model], "data.path is required"),
        (["convert", model, *FAST, f"data.path={tmp_path / 'missing.jsonl'}"], "missing.jsonl: no such file"),
        (["convert", str(tmp_path / "no-model"), f"data.path={assets / 'train.jsonl'}"], "no-model: no such folder"),
        (["convert", str(small), *FAST, f"data.path={assets / 'train.jsonl'}"], "vocabulary mismatch"),
        (["convert", model, *FAST, f"data.path={assets / 'train.jsonl'}", "train.jsd_beta=0"], "strictly between"),
        (["convert", model, *FAST, f"data.path={assets / 'train.jsonl'}", "train.temperature=0"], "must be > 0"),
        (
            ["convert", model, f"data.path={assets / 'train.jsonl'}", "train.max_steps=300", "recovery=plain"],
            "train.warmup_steps=1000 is longer than the run (300 steps)",  # the default recipe warms up by share
        ),
        (
            ["convert", model, *FAST, f"data.path={assets / 'train.jsonl'}", "teacher.mode=cache"]
            + ["train.divergence=reverse_kl"],
            "train.divergence=reverse_kl needs the full teacher distribution",
        ),
    ]
    for argv, message in cases:
        assert main([*argv, f"output_dir={tmp_path / 'new'}"] if "output_dir" not in argv[-1] else argv) == 2, argv
        assert message in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # a run refused on its inputs leaves nothing behind


def test_cfg_job_prints_the_resolved_config(capsys):
    assert main(["convert", "some/model", "train.lr=4e-5", "--cfg", "job"]) == 0
    printed = capsys.readouterr().out
    assert "name: some/model" in printed and "lr: 4.0e-05" in printed and "batch_tokens: 65536" in printed


@pytest.mark.parametrize("objective", ["kl", "sft", "kl_l2", "guided"])
def test_head_inside_or_outside_the_forward_gives_the_same_loss_and_gradients(objective):
    """The FSDP path (LM head inside the forward, full micro-batch logits) equals the chunked-head path."""
    from types import SimpleNamespace

    from fcsd.distill.data import pack_documents
    from fcsd.distill.objectives import micro_batch_loss

    teacher = build("qwen3_moe").requires_grad_(False)
    student = fcsd.apply_farskip(build("qwen3_moe"), "all")
    batch = pack_documents([torch.randint(3, 90, (n,)).tolist() for n in (9, 14, 11)], seq_len=16)
    guide = 4.0 if objective == "guided" else 0.0  # the guided recipe: KL + the relative hidden-state guide
    objective = "kl" if objective == "guided" else objective
    train = dict(objective=objective, divergence="forward_kl", temperature=1.0, jsd_beta=0.5, l2_coef=0.1)
    config = SimpleNamespace(
        train=SimpleNamespace(**train, loss_chunk_size=5, router_aux_coef=0.01),
        recovery=SimpleNamespace(hidden_l2=guide),
    )
    results = []
    for inside in (False, True):
        student.zero_grad()
        parts = micro_batch_loss(student, student, batch, config, teacher, head_in_forward=inside)
        assert ("hidden" in parts.terms) == (guide > 0)
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


def test_experts_implementation_reaches_teacher_and_student(assets, tmp_path):
    from fcsd.distill.student_teacher import load_models, load_tokenizer

    config = config_for(assets, tmp_path, "model.experts_implementation=batched_mm")
    teacher, student = load_models(config, load_tokenizer(config), torch.device("cpu"))
    assert teacher.config._experts_implementation == student.config._experts_implementation == "batched_mm"


def test_only_the_command_line_imports_the_demo_job():
    """The library never depends on the demo (it once imported the trainer while the trainer imported it)."""
    import ast

    package = Path(fcsd.__file__).parent
    importers = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""]
            if any(name == "fcsd.cli.demo" or name.startswith("fcsd.cli.demo.") for name in names):
                importers.append(path.relative_to(package).as_posix())
    assert importers and all(path.startswith("cli/") for path in importers), importers
