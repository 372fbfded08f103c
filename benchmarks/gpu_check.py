"""A prepared one-GPU check of fcsd, the first run on a GPU (about 10 minutes on one H100 or H200).

On the GPU machine, from the repository root (one command; every section has its own time budget, enforced by
subprocess timeouts, so one hang cannot eat the others' time, and a failed section does not stop the others):

    python benchmarks/gpu_check.py --json gpu_check.json

On a CPU (every section that can run there, small sizes; a few minutes on 2 cores; tests/test_gpu_check.py runs it):

    python benchmarks/gpu_check.py --device cpu --quick --json gpu_check_cpu.json

Options: ``--device {cuda,cpu}`` (default cuda when available), ``--quick`` (smaller sizes, fewer steps),
``--json OUT`` (the report; the markdown summary goes beside it as OUT with a .md suffix, and is printed),
``--sections a,b,...`` (default: all), ``--jobs N`` (sections run at once; default 1 on CUDA, so that peak memory and
timings do not mix, 2 on a CPU). Exit status 0 when every section that was not skipped is ok, else 1.

The report has one key per section, each ``{"status": "ok" | "failed" | "skipped", "reason": ..., figures...}``
(and ``_run``: the device, options and wall time). Times and peaks are labelled with the device that gave them.

Sections:

- ``one_process``: a tiny Qwen3-MoE loaded as ``fcsd convert`` loads it
  (:func:`fcsd.distill.student_teacher.load_models`: fp32 master weights, experts in the autocast dtype), one step of
  the trainer's loss (:func:`fcsd.distill.objectives.micro_batch_loss`) + backward + AdamW under bf16 autocast: host
  synchronisations counted by ``torch.cuda.set_sync_debug_mode("warn")`` (per MoE layer; n/a on a CPU), the input dtypes
  of every ``aten::_grouped_mm`` (the experts) and ``aten::mm`` in ``torch.profiler`` (and on CUDA the grouped GEMMs'
  kernel names); then ``benchmarks/kd_step.py`` (plain Hugging Face KD loop, TRL's loss when installed, fcsd) for step
  throughput and peak memory at one batch.
- ``fsdp_one_process``: ``fcsd convert`` under ``torchrun --nproc_per_node 1`` with ``parallel.fsdp=true`` and a DCP
  step checkpoint every step; a second run stopped early (``train.stop_after``) and resumed with ``--resume`` must
  end with the uninterrupted run's losses, gradient norms and ``final/`` weights exactly; peak memory per process.
- ``expert_parallel``: ``benchmarks/gpu_check_ep.py`` on 2 (quick) or 4 gloo ranks sharing the device: EP with the
  plain, dedup and hierarchical dispatchers, activation checkpointing with the exchanges replayed from host memory,
  against one process (logits, loss, gradient norm, every gradient); under the CUDA sanitizer on CUDA.
- ``fp8_teacher``: ``fcsd cache-teacher`` of a tiny block-FP8 DeepSeek-V3 with ``teacher.dtype=fp8`` offline (without
  the kernel in the hub cache fcsd refuses in one line: ok, with that line), then a cached run; on a CPU the FP8 part
  is skipped, but the dequantized path (``teacher.dtype=auto``) cache-teacher + cached run still runs.
- ``memory``: peak memory of ``fcsd cache-teacher`` at vocabulary 151,936 x 4,096-token rows (quick: 1,024) and of
  the head-in-forward loss of an FSDP2-laid-out student and teacher (one process) against the full logits' size.
- ``bench``: ``fcsd bench cluster --quick`` on one process and ``fcsd bench overlap`` on 2 gloo ranks.
- ``sglang``: where SGLang is installed (this interpreter, or ``.venv-sglang`` from ``make sglang-env``; skipped
  otherwise): a tiny FarSkip export served by SGLang with fcsd's plugin at TP 1 gives fcsd's greedy tokens and its
  stock copy does not; ``benchmarks/sglang_prefill.py`` times stock, FarSkip blocking and overlapped side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
SECTIONS = ["one_process", "fsdp_one_process", "expert_parallel", "fp8_teacher", "memory", "bench", "sglang"]
# seconds per section: (full, quick); without SGLang (skipped where it is not installed) the full budgets add up to 9
# minutes, so that a 10-minute slot suffices; a node prepared with `make sglang-env` needs 2 more
BUDGETS = {
    "one_process": (120, 150),
    "fsdp_one_process": (90, 240),
    "expert_parallel": (90, 180),
    "fp8_teacher": (60, 180),
    "memory": (90, 180),
    "bench": (80, 150),
    "sglang": (120, 240),
}
GIB = 2**30
VOCAB = 151_936
CHUNK = 256  # train.loss_chunk_size's default
FAST = [  # tests/test_trainer.py's fast run
    "data.seq_len=32",
    "data.eval_sequences=4",
    "train.batch_tokens=256",
    "train.micro_batch_size=4",
    "train.warmup_steps=2",
    "train.lr=1e-3",
    "progress=false",
    "early_stop.enabled=false",
    "export=false",
]


class SectionSkipped(Exception):
    """Raised by a section that cannot run here; its message is the reason."""


# ---------------------------------------------------------------------------------------------------------------
# processes


def child_env(**extra: str) -> dict:
    env = {**os.environ, **extra}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def kill_tree(process: subprocess.Popen, reap: bool = True) -> None:
    """SIGKILL ``process``'s session and every descendant seen (torchrun's workers included)."""
    try:
        import psutil

        tree = psutil.Process(process.pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - psutil missing or the process gone
        tree = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    for child in tree:
        with contextlib.suppress(Exception):
            child.kill()
    if reap:
        with contextlib.suppress(Exception):
            process.wait(timeout=30)


def run(argv: list[str], timeout: float, env: dict | None = None, cwd=None) -> dict:
    """Run ``argv`` in a session of its own with a timeout (the whole tree is killed when it passes); returns
    ``{"rc", "stdout", "stderr", "seconds", "maxrss_bytes", "timed_out"}`` (``maxrss``: the largest resident set of
    the process and the descendants it waited for, from ``wait4``)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(
            argv, stdout=out, stderr=err, env=env or child_env(), cwd=cwd, start_new_session=True
        )
        expired = threading.Event()

        def expire():
            expired.set()
            kill_tree(process, reap=False)  # the caller's wait4 reaps it

        timer = threading.Timer(max(timeout, 1), expire)
        timer.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)
        finally:
            timer.cancel()
        timed_out = expired.is_set()
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return {
            "rc": process.returncode,
            "stdout": out.read().decode(errors="replace"),
            "stderr": err.read().decode(errors="replace"),
            "seconds": time.perf_counter() - start,
            "maxrss_bytes": usage.ru_maxrss * 1024,  # kilobytes on Linux
            "timed_out": timed_out,
        }


def killed_at_first_checkpoint(argv: list[str], run_dir: Path, timeout: float) -> str:
    """Start a training launch, SIGKILL it (every process) as soon as its first step checkpoint is published, and
    return that checkpoint's name: a run stopped at a step, with no clean shutdown and no final/."""
    deadline, published = time.time() + timeout, []
    with tempfile.TemporaryFile() as err:
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=child_env(), start_new_session=True)
        try:
            while time.time() < deadline and process.poll() is None:
                published = sorted(run_dir.glob("checkpoints/step-*"))
                if published:
                    break
                time.sleep(0.01)
        finally:
            kill_tree(process)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    if not published:
        raise RuntimeError(f"no step checkpoint was published (exit {process.returncode}): {stderr[-1500:]}")
    if (run_dir / "final").exists():
        raise RuntimeError("the run finished before it could be killed after its first checkpoint")
    return published[0].name


def checked(result: dict, what: str) -> dict:
    if result["timed_out"]:
        raise RuntimeError(f"{what} timed out after {result['seconds']:.0f} s")
    if result["rc"] != 0:
        tail = (result["stderr"].strip() or result["stdout"].strip())[-1500:]
        raise RuntimeError(f"{what} exited {result['rc']}: {tail}")
    return result


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]


def fcsd_cli() -> list[str]:
    return [sys.executable, "-m", "fcsd.cli"]


def peak_cli(out: Path) -> list[str]:
    """This script as a wrapper of ``fcsd.cli.main`` that records the CUDA peak of each process (``out.RANK.json``)."""
    return [str(Path(__file__).resolve()), "--cli-peak", str(out), "--"]


def cli_peak(out: str, argv: list[str]) -> int:
    import torch

    from fcsd.cli import main

    code = main(argv)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    with open(f"{out}.{os.environ.get('RANK', '0')}.json", "w") as handle:
        json.dump({"code": code, "cuda_peak_bytes": peak}, handle)
    return code


def read_peaks(out: Path) -> list[int | None]:
    return [json.loads(p.read_text())["cuda_peak_bytes"] for p in sorted(out.parent.glob(out.name + ".*.json"))]


def json_in(text: str):
    """The first JSON value in ``text`` (a command's output may have lines before it)."""
    start = text.index("{")
    return json.JSONDecoder().raw_decode(text[start:])[0]


# ---------------------------------------------------------------------------------------------------------------
# shared assets


def chat_model(folder: Path, rows: int = 60) -> tuple[Path, Path]:
    """A tiny Qwen3-MoE with a locally trained tokenizer (``folder/model``) and synthetic chat data
    (``folder/train.jsonl``)."""
    from tiny_models import save_chat_model

    from fcsd.embedded.synthetic import make_dataset, write_jsonl

    data = make_dataset(rows, seed=5)
    save_chat_model(folder / "model", data)
    write_jsonl(data, folder / "train.jsonl")
    return folder / "model", folder / "train.jsonl"


def losses_of(run_dir: Path, key: str = "train/loss") -> list[float]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r[key] for r in records if key in r]


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({os.cpu_count()} cores)"


# ---------------------------------------------------------------------------------------------------------------
# sections: each takes the context and returns its figures (status ok), or raises (failed) / SectionSkipped


def one_process(ctx) -> dict:
    import warnings

    import torch
    from torch.profiler import ProfilerActivity, profile

    from fcsd.connectivity.families import family_for_config, moe_blocks
    from fcsd.distill.config import compose, to_config
    from fcsd.distill.data import Packed
    from fcsd.distill.objectives import micro_batch_loss
    from fcsd.distill.student_teacher import load_models, load_tokenizer

    cuda = ctx.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model_dir, data = chat_model(ctx.work)
    overrides = [f"model.name={model_dir}", f"data.path={data}", f"output_dir={ctx.work / 'run'}", *FAST]
    config = to_config(compose(overrides))
    tokenizer = load_tokenizer(config)
    teacher, student = load_models(config, tokenizer, device)
    student.train()
    batch_size, seq = (4, 32) if ctx.quick else (8, 256)
    vocab = student.config.vocab_size
    ids = torch.randint(3, vocab, (batch_size, seq), generator=torch.Generator().manual_seed(0)).to(device)
    batch = Packed(ids, torch.arange(seq, device=device).expand_as(ids))
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-4)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = micro_batch_loss(student, student, batch, config, teacher).total / ids.numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: allocations, AdamW state
    moe_layers = len(moe_blocks(student, family_for_config(student.config)))
    figures = {"device": device_name(ctx.device), "moe_layers": moe_layers, "tokens": ids.numel()}
    if cuda:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
        figures["host_syncs_step"] = len(syncs)
        figures["host_syncs_per_moe_layer"] = len(syncs) / max(moe_layers, 1)
        figures["host_sync_kinds"] = sorted(set(syncs))[:10]
    else:
        figures["host_syncs_per_moe_layer"] = "n/a (CPU: no device to host copies)"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    matmuls: dict[str, dict[str, int]] = {"aten::_grouped_mm": {}, "aten::mm": {}}
    kernels: set[str] = set()
    for event in prof.events():
        if event.name not in matmuls:
            continue
        dtypes = [d for d in (getattr(event, "input_dtypes", None) or []) if d][:2]
        key = " x ".join(dtypes) or "unknown"
        matmuls[event.name][key] = matmuls[event.name].get(key, 0) + 1
        if event.name == "aten::_grouped_mm":
            kernels.update(k.name for k in getattr(event, "kernels", []) or [])
            stack = list(getattr(event, "cpu_children", []) or [])
            while stack:
                child = stack.pop()
                kernels.update(k.name for k in getattr(child, "kernels", []) or [])
                stack.extend(getattr(child, "cpu_children", []) or [])
    figures["grouped_mm_input_dtypes"] = matmuls["aten::_grouped_mm"]
    figures["mm_input_dtypes"] = matmuls["aten::mm"]
    if cuda:
        figures["grouped_gemm_kernels"] = sorted(kernels)
    grouped = matmuls["aten::_grouped_mm"]
    experts_bf16 = bool(grouped) and set(grouped) == {"c10::BFloat16 x c10::BFloat16"}
    figures["experts_bf16"] = experts_bf16

    kd_out = ctx.work / "kd_step.json"
    preset, steps = ("tiny", 2) if ctx.quick else ("gpu_check", 5)
    kd = [sys.executable, str(ROOT / "benchmarks" / "kd_step.py"), "--preset", preset, "--steps", str(steps)]
    kd += ["--device", ctx.device, "--json", str(kd_out)]
    result = checked(run(kd, ctx.remaining() - 5), "benchmarks/kd_step.py")
    report = json.loads(kd_out.read_text())
    figures["kd_step"] = report
    methods = report["methods"]
    figures["kd_step_ratios"] = {name: round(m["vs_base"], 3) for name, m in methods.items()}
    figures["kd_step_stdout"] = result["stdout"].strip().splitlines()[-5:]
    if not experts_bf16:
        raise RuntimeError(f"the experts' grouped matmuls did not all run in bf16: {grouped}")
    syncs = figures.get("host_syncs_per_moe_layer")
    rate = ", ".join(f"{n} {m['tokens_per_s']:,.0f} tok/s" for n, m in methods.items())
    peak = ", ".join(f"{n} {m['peak_gib']:.1f} GiB" for n, m in methods.items() if m.get("peak_gib") is not None)
    figures["summary"] = (
        f"experts' grouped_mm {', '.join(grouped)}; syncs/MoE layer {syncs if cuda else 'n/a'}; kd_step {preset} "
        f"({report['device']}): {rate}{'; peak ' + peak if peak else ''}"
        + (f"; not run: {', '.join(report['skipped'])} (not installed)" if report["skipped"] else "")
    )
    return figures


def fsdp_one_process(ctx) -> dict:
    import torch
    from safetensors.torch import load_file

    model_dir, data = chat_model(ctx.work)
    steps = 4 if ctx.quick else 8
    common = ["convert", str(model_dir), f"data.path={data}", f"data.cache_dir={ctx.work / 'packed'}", *FAST]
    common += [f"train.max_steps={steps}", "train.save_every=1", "parallel.fsdp=true"]
    peaks = ctx.work / "peak"
    launch = [*torchrun(1), *peak_cli(peaks)]
    budget = (ctx.remaining() - 10) / 3
    whole = checked(run([*launch, *common, f"output_dir={ctx.work / 'a'}"], budget), "the uninterrupted run")
    cuda_peak = max((p or 0) for p in read_peaks(peaks)) if ctx.device == "cuda" else None
    killed_at = killed_at_first_checkpoint([*launch, *common, f"output_dir={ctx.work / 'b'}"], ctx.work / "b", budget)
    checkpoints = sorted(p.name for p in (ctx.work / "b" / "checkpoints").glob("step-*"))
    checked(run([*launch, *common, f"output_dir={ctx.work / 'b'}", "--resume"], budget), "the resumed run")
    a, b = ctx.work / "a", ctx.work / "b"
    same_losses = losses_of(a) == losses_of(b) and len(losses_of(a)) == steps
    same_norms = losses_of(a, "train/grad_norm") == losses_of(b, "train/grad_norm")
    weights_a = {k: v for f in sorted((a / "final").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    weights_b = {k: v for f in sorted((b / "final").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    same_weights = bool(weights_a) and weights_a.keys() == weights_b.keys()
    same_weights = same_weights and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    dcp = sorted(p.name for p in (a / "checkpoints").glob("step-*/*.distcp"))
    figures = {
        "device": device_name(ctx.device),
        "steps": steps,
        "killed_after_checkpoint": killed_at,
        "checkpoints_at_kill": checkpoints,
        "dcp_files": dcp,
        "losses": losses_of(a),
        "resumed_losses": losses_of(b),
        "same_losses": same_losses,
        "same_grad_norms": same_norms,
        "same_final_weights": same_weights,
        "final_tensors": len(weights_a),
        "peak_rss_gib": whole["maxrss_bytes"] / GIB,
        "cuda_peak_gib": None if cuda_peak is None else cuda_peak / GIB,
        "run_seconds": whole["seconds"],
        "note": "the trainer's metrics hold no memory figure: the peak is the launch's largest resident set (and, "
        "on CUDA, max_memory_allocated read by a wrapper of fcsd.cli.main)",
    }
    if not (same_losses and same_norms and same_weights and dcp):
        raise RuntimeError(f"the resumed run differs from the uninterrupted one: {figures}")
    memory = f"CUDA peak {cuda_peak / GIB:.2f} GiB" if cuda_peak else f"peak RSS {figures['peak_rss_gib']:.2f} GiB"
    figures["summary"] = (
        f"{steps} steps, DCP every step, SIGKILLed after {killed_at} + --resume: losses, grad norms and final/ "
        f"({len(weights_a)} tensors) identical; {memory} ({figures['device']})"
    )
    return figures


def expert_parallel(ctx) -> dict:
    ranks = 2 if ctx.quick else 4
    tolerance = 1e-4 if ctx.device == "cuda" else 1e-5
    out = ctx.work / "ep"
    env = child_env(**({"TORCH_CUDA_SANITIZER": "1"} if ctx.device == "cuda" else {}))
    worker = [*torchrun(ranks), str(ROOT / "benchmarks" / "gpu_check_ep.py"), str(out), "--device", ctx.device]
    result = checked(run(worker, ctx.remaining() - 5, env=env), f"the {ranks}-rank worker")
    per_rank = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(ranks)]
    keys = ("logits", "loss", "grad_norm", "param_grad")
    worst, problems = {}, []
    for dispatcher in ("plain", "dedup", "hierarchical"):
        cases = [r["results"].get(dispatcher) for r in per_rank]
        if any(c is None or "error" in c for c in cases):
            errors = [c.get("error") for c in cases if c and "error" in c]
            problems.append(f"{dispatcher}: {errors[0] if errors else 'not run'}")
            continue
        worst[dispatcher] = {k: max(c[k] for c in cases) for k in keys}
        worst[dispatcher]["host_copies"] = min(c["host_copies"] for c in cases)
        worst[dispatcher]["node_size"] = cases[0]["node_size"]
        if any(worst[dispatcher][k] > tolerance for k in keys):
            problems.append(f"{dispatcher}: errors above {tolerance:g}: {worst[dispatcher]}")
        if worst[dispatcher]["host_copies"] == 0:
            problems.append(f"{dispatcher}: no exchange rows went to host memory (offload did not run)")
    sanitizer = ctx.device == "cuda"
    if sanitizer and "CSAN" in result["stderr"]:
        problems.append("the CUDA sanitizer reported: " + result["stderr"][-1500:])
    figures = {
        "device": device_name(ctx.device),
        "ranks": ranks,
        "backend": "gloo",
        "cuda_sanitizer": sanitizer,
        "tolerance": tolerance,
        "worst": worst,
        "seconds": result["seconds"],
    }
    if problems:
        raise RuntimeError("; ".join(problems))
    parts = [f"{d} {max(w[k] for k in keys):.1e}" for d, w in worst.items()]
    figures["summary"] = (
        f"{ranks} gloo ranks on one {ctx.device} device, checkpointing + offload"
        f"{', CUDA sanitizer' if sanitizer else ''}: worst error vs one process {', '.join(parts)} (< {tolerance:g})"
    )
    return figures


def fp8_teacher(ctx) -> dict:
    import torch
    from fp8_models import write_fp8_checkpoint
    from tiny_models import build

    from fcsd.embedded.synthetic import make_dataset, write_jsonl
    from fcsd.embedded.tokenizer import train_tokenizer

    rows = make_dataset(20, seed=3)
    tokenizer = train_tokenizer((m["content"] for r in rows for m in r["messages"]), vocab_size=200)
    model = build("deepseek_v3")
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    write_fp8_checkpoint(ctx.work / "source", "deepseek_v3", model=model, tokenizer=tokenizer)
    write_jsonl(rows, ctx.work / "train.jsonl")
    source = ctx.work / "source" / "fp8"
    env = child_env(HF_HUB_OFFLINE="1")
    common = [str(source), f"data.path={ctx.work / 'train.jsonl'}", f"data.cache_dir={ctx.work / 'packed'}", *FAST]

    def cache_and_train(dtype: str, tag: str) -> dict:
        cache = ctx.work / f"cache-{tag}"
        argv = [*fcsd_cli(), "cache-teacher", *common, f"teacher.dtype={dtype}", f"teacher.cache_dir={cache}"]
        cached = run([*argv, f"output_dir={ctx.work / ('c-' + tag)}"], ctx.remaining() / 2, env=env)
        if cached["rc"] != 0:
            return {"cache_teacher": cached}
        train = [*fcsd_cli(), "convert", *common, f"teacher.dtype={dtype}", "teacher.mode=cache"]
        train += [f"teacher.cache_dir={cache}", "train.max_steps=2", f"output_dir={ctx.work / ('r-' + tag)}"]
        trained = checked(run(train, ctx.remaining() - 5, env=env), f"the cached run (teacher.dtype={dtype})")
        return {
            "cache_teacher": cached,
            "convert": trained,
            "shards": len(list(cache.glob("shard-*.safetensors"))),
            "losses": losses_of(ctx.work / ("r-" + tag)),
        }

    figures = {"device": device_name(ctx.device)}
    capable = ctx.device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    fp8_reason = None
    if capable:
        fp8 = cache_and_train("fp8", "fp8")
        cached = fp8["cache_teacher"]
        if cached["rc"] != 0:
            # fcsd's refusal: exit 2, one line naming the kernel and teacher.dtype=auto (library warnings may precede)
            lines = [line for line in cached["stderr"].strip().splitlines() if "teacher.dtype=auto" in line]
            if cached["timed_out"] or cached["rc"] != 2 or len(lines) != 1:
                raise RuntimeError(f"fcsd cache-teacher teacher.dtype=fp8 failed: {cached['stderr'][-1500:]}")
            figures["fp8"] = {"outcome": "refused", "line": lines[0]}
            fp8_reason = "the FP8 kernel is not in the hub cache (offline): fcsd refused in one line, as it should"
        else:
            figures["fp8"] = {"outcome": "ran", "shards": fp8["shards"], "losses": fp8["losses"]}
    else:
        fp8_reason = "FP8 kernels need a CUDA GPU of compute capability >= 8.9"
    plain = cache_and_train("auto", "dequantized")
    checked(plain["cache_teacher"], "fcsd cache-teacher teacher.dtype=auto")
    figures["dequantized"] = {"shards": plain["shards"], "losses": plain["losses"]}
    if not plain["shards"] or len(plain["losses"]) != 2:
        raise RuntimeError(f"the dequantized cached run is incomplete: {figures['dequantized']}")
    done = f"dequantized cache-teacher ({plain['shards']} shards) + 2-step cached run ran"
    if not capable:
        raise SectionSkipped(f"{fp8_reason}; {done}", figures)
    figures["reason"] = fp8_reason
    outcome = figures["fp8"]["outcome"]
    figures["summary"] = (
        f"fp8: {outcome}" + (f" ({figures['fp8']['line']})" if outcome == "refused" else "") + f"; {done}"
    )
    return figures


def memory(ctx) -> dict:
    from big_vocab import save_big_vocab_model

    tokens = 1024 if ctx.quick else 4096
    model_dir, data = save_big_vocab_model(ctx.work / "big", rows=160 if ctx.quick else 700)
    peaks = ctx.work / "cache-peak"
    argv = [sys.executable, *peak_cli(peaks), "cache-teacher", str(model_dir), f"data.path={data}", "progress=false"]
    argv += [f"data.seq_len={tokens}", "data.eval_sequences=1", f"teacher.cache_dir={ctx.work / 'cache'}"]
    argv += [f"data.cache_dir={ctx.work / 'packed'}", f"output_dir={ctx.work / 'run'}"]
    cached = checked(run(argv, ctx.remaining() * 0.6), "fcsd cache-teacher")
    cuda_peak = read_peaks(peaks)[0] if ctx.device == "cuda" else None
    batch_logits = 4 * tokens * VOCAB * 4  # cache-teacher's batch of 4 rows as fp32 full-vocabulary logits
    peak = cuda_peak if cuda_peak is not None else cached["maxrss_bytes"]
    figures = {
        "device": device_name(ctx.device),
        "vocab": VOCAB,
        "tokens_per_row": tokens,
        "cache_teacher_peak_gib": peak / GIB,
        "cache_teacher_peak_kind": "CUDA max_memory_allocated" if cuda_peak is not None else "peak RSS (wait4)",
        "cache_teacher_bound_gib": batch_logits / GIB,
        "cache_teacher_seconds": cached["seconds"],
    }
    out = ctx.work / "head.json"
    head = [sys.executable, str(Path(__file__).resolve()), "--head-memory", str(out), "--device", ctx.device]
    head += ["--tokens", str(tokens)]
    checked(run(head, ctx.remaining() - 5), "the head-in-forward loss")
    figures["head_in_forward"] = json.loads(out.read_text())
    h = figures["head_in_forward"]
    problems = []
    if peak >= batch_logits:
        problems.append(f"cache-teacher peaked at {peak / GIB:.2f} GiB, not under {batch_logits / GIB:.2f} GiB")
    if h["extra_peak_bytes"] >= h["chunk_bound_bytes"] or h["largest_tensor"] > h["chunk"] * VOCAB:
        problems.append(f"the head-in-forward loss is not bounded by chunks: {h}")
    if problems:
        raise RuntimeError("; ".join(problems))
    largest = h["largest_tensor"] / (h["tokens"] * VOCAB)
    figures["summary"] = (
        f"cache-teacher {tokens} tok x {VOCAB:,}: {figures['cache_teacher_peak_kind']} {peak / GIB:.2f} GiB "
        f"(< {batch_logits / GIB:.2f} GiB of one batch's logits); head-in-forward loss +{h['extra_peak_gib']:.2f} "
        f"GiB ({h['peak_kind']}; bound: 12 chunks of {h['chunk']} tok x vocab fp32, {h['chunk_bound_bytes'] / GIB:.2f} "
        f"GiB) vs {h['full_logits_gib']:.2f} GiB full logits, largest tensor {largest:.2f} x tokens x vocab"
    )
    return figures


def head_memory(out: str, device_kind: str, tokens: int) -> None:
    """The head-in-forward loss (student and online teacher laid out FSDP2 on a one-process gloo group, vocabulary
    151,936) on ``tokens`` tokens: its extra peak memory and the largest tensor any op returned; writes ``out``."""
    from types import SimpleNamespace

    import psutil
    import torch
    import torch.distributed as dist
    from tiny_models import CONFIGS
    from torch.utils._python_dispatch import TorchDispatchMode

    import fcsd
    from fcsd.distill.data import Packed
    from fcsd.distill.objectives import micro_batch_loss
    from fcsd.parallel.layout import ParallelDims, build_meshes, parallelize

    cuda = device_kind == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)

    class LargestTensor(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for tensor in torch.utils._pytree.tree_leaves(result):
                if isinstance(tensor, torch.Tensor):
                    self.largest = max(self.largest, tensor.numel())
            return result

    def model(student: bool):
        cls, config = CONFIGS["qwen3_moe"]()
        config.vocab_size, config.max_position_embeddings = VOCAB, tokens
        torch.manual_seed(0)
        built = cls(config).to(device)
        return fcsd.apply_farskip(built, "all").train() if student else built.eval().requires_grad_(False)

    meshes = build_meshes(ParallelDims(1, 1, True), device.type)
    student = parallelize(model(True), meshes, "student")
    teacher = parallelize(model(False), meshes, "teacher")
    seq = min(tokens, 1024)
    ids = torch.randint(3, VOCAB, (tokens // seq, seq), generator=torch.Generator().manual_seed(0)).to(device)
    batch = Packed(ids, torch.arange(seq, device=device).expand_as(ids))
    train = dict(objective="kl", divergence="forward_kl", temperature=1.0, jsd_beta=0.5, l2_coef=0.0)
    config = SimpleNamespace(
        train=SimpleNamespace(**train, loss_chunk_size=CHUNK, router_aux_coef=0.0),
        recovery=SimpleNamespace(hidden_l2=0.0),
    )
    process = psutil.Process()
    samples = [process.memory_info().rss]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            samples.append(process.memory_info().rss)
            time.sleep(0.002)

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with LargestTensor() as largest:
        parts = micro_batch_loss(student, student, batch, config, teacher, head_in_forward=True)
        parts.total.backward()
    if cuda:
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
    stop.set()
    sampler.join()
    if not cuda:
        extra = max(samples) - samples[0]
    full = tokens * VOCAB * 4
    result = {
        "tokens": tokens,
        "vocab": VOCAB,
        "extra_peak_bytes": extra,
        "extra_peak_gib": extra / GIB,
        "peak_kind": "CUDA max_memory_allocated" if cuda else "sampled RSS",
        "chunk": CHUNK,
        # a few chunk-sized fp32 tensors live at once (both models' logits, log-softmaxes, the gradient)
        "chunk_bound_bytes": 12 * CHUNK * VOCAB * 4,
        "full_logits_bytes": full,
        "full_logits_gib": full / GIB,
        "largest_tensor": largest.largest,
        "loss_finite": bool(torch.isfinite(parts.total.detach()).item()),
    }
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def bench(ctx) -> dict:
    cluster_file = ctx.work / "cluster.json"
    cluster = [*fcsd_cli(), "bench", "cluster", "--model", "demo", "--out", str(cluster_file), "--quick", "--json"]
    cluster += ["--device", ctx.device]
    checked(run(cluster, ctx.remaining() / 2), "fcsd bench cluster")
    measured = json.loads(cluster_file.read_text())
    overlap = [*fcsd_cli(), "bench", "overlap", "--ranks", "2", "--backend", "gloo", "--config", "tiny", "--json"]
    overlap += ["--device", ctx.device, "--iters", "2" if ctx.quick else "5"]
    result = checked(run(overlap, ctx.remaining() - 5), "fcsd bench overlap")
    timed = json_in(result["stdout"])
    figures = {
        "device": device_name(ctx.device),
        "cluster": {
            k: measured.get(k)
            for k in ("name", "tflops", "expert_tflops", "memory_gbps", "host_gbps", "intra_gbps", "op_us")
        },
        "overlap": {
            "ranks": timed["ranks"],
            "backend": timed["backend"],
            "device": timed["device"],
            "dtype": timed["dtype"],
            "step_speedup_over_regular": timed["step_speedup_over_regular"],
            "step_speedup_over_farskip_reference": timed["step_speedup_over_farskip_reference"],
            "forward_ms": {k: timed["forward"][k] for k in ("T_regular_ms", "T_ovl_ms")},
            "backward_ms": {k: timed["backward"][k] for k in ("T_regular_ms", "T_ovl_ms")},
        },
    }
    o = figures["overlap"]
    figures["summary"] = (
        f"cluster ({measured.get('name')}): {measured.get('tflops', 0):.3g} TFLOP/s GEMM, expert TFLOP/s at EP 1 "
        f"{(measured.get('expert_tflops') or {}).get('1', float('nan')):.3g}; overlap (2 gloo ranks, {o['dtype']}): "
        f"step {o['step_speedup_over_regular']:.2f}x regular, {o['step_speedup_over_farskip_reference']:.2f}x "
        "FarSkip reference"
    )
    return figures


def sglang_python() -> str | None:
    """An interpreter with SGLang: this one, else the checkout's ``.venv-sglang`` (``make sglang-env``)."""
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable
    venv = ROOT / ".venv-sglang" / "bin" / "python"
    return str(venv) if venv.exists() else None


def sglang(ctx) -> dict:
    """fcsd's SGLang plugin on this device: a tiny tied-embedding Qwen3-MoE export served at TP 1 with fcsd's greedy
    tokens (its stock copy differing), then ``benchmarks/sglang_prefill.py`` on its larger random export (stock,
    FarSkip blocking, FarSkip overlapped; at TP 1 the overlap has nothing to overlap: the figures are the FarSkip
    loop's own cost against SGLang's stock layers)."""
    python = sglang_python()
    if python is None:
        raise SectionSkipped("SGLang is not installed: build .venv-sglang with `make sglang-env` (GPU: SGLANG_CPU=0)")
    from serving_models import MAX_TOKENS, PROMPTS, TOP_N, build, mismatch, reference

    import fcsd
    from fcsd.embedded.tokenizer import train_tokenizer
    from fcsd.export.save import export
    from fcsd.serving.sglang.stock_copies import sglang_stock_copy

    tokenizer = train_tokenizer(["add 1 + 2", "sort 3 1 2", "count the apples"] * 10, vocab_size=280)
    model = fcsd.apply_farskip(build("qwen3_moe_tied", len(tokenizer)), "all")
    folder = export(model, tokenizer, ctx.work / "sglang-export")
    expected = reference(model)
    stock = sglang_stock_copy(folder, ctx.work / "sglang-stock")  # its head written out: SGLang serves it right
    # fp32 with the torch attention backend on every device, as fcsd's reference runs
    common = {"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "logprobs": TOP_N, "device": ctx.device}
    common["attention_backend"] = "torch_native"
    jobs = [{"name": "farskip", "model": str(folder), **common}, {"name": "stock", "model": str(stock), **common}]
    (ctx.work / "sglang-jobs.json").write_text(json.dumps(jobs))
    out = ctx.work / "sglang-out.json"
    worker = [python, str(TESTS / "workers" / "sglang_generate.py"), str(ctx.work / "sglang-jobs.json"), str(out)]
    env = {k: v for k, v in child_env().items() if k != "PYTHONPATH"}
    checked(run(worker, ctx.remaining() / 2, env=env), "SGLang worker")
    served = json.loads(out.read_text())
    for name in ("farskip", "stock"):
        if "error" in served[name]:
            raise RuntimeError(f"SGLang served {name} with an error: {served[name]['error']}")
    farskip = served["farskip"]["outputs"]
    problem = mismatch(expected, farskip)
    if problem is not None:
        raise RuntimeError(f"SGLang's FarSkip tokens differ from fcsd's: {problem}")
    control = mismatch(expected, served["stock"]["outputs"])
    if control is None:
        raise RuntimeError("the stock copy matched the FarSkip model: the comparison cannot fail")
    lens = "64,256" if ctx.quick else "512,2048"
    tiny = ctx.work / "sglang-prefill-export"  # the prefill benchmark's own export: 4,096 positions, head size 64
    checked(run([sys.executable, str(ROOT / "benchmarks" / "sglang_prefill.py"), "--tiny", str(tiny)], 120), "--tiny")
    bench = [python, str(ROOT / "benchmarks" / "sglang_prefill.py"), str(tiny), "--device", ctx.device, "--json"]
    bench += ["--prompt-lens", lens, "--repeats", "1" if ctx.quick else "3"]
    rows = json.loads(checked(run(bench, ctx.remaining() - 5, env=env), "sglang_prefill")["stdout"])
    figures = {"device": device_name(ctx.device), "tokens_match_fcsd": True, "stock_mismatch": control, "prefill": rows}
    figures["summary"] = "SGLang at TP 1: fcsd's greedy tokens; TTFT / stock " + ", ".join(
        f"{r['layers']}/{r['overlap']}@{r['prompt_len']}: {r.get('ttft_vs_none', 1):.2f}" for r in rows
    )
    return figures


FUNCTIONS = {
    "one_process": one_process,
    "fsdp_one_process": fsdp_one_process,
    "expert_parallel": expert_parallel,
    "fp8_teacher": fp8_teacher,
    "memory": memory,
    "bench": bench,
    "sglang": sglang,
}


class Context:
    def __init__(self, device: str, quick: bool, work: Path, deadline: float):
        self.device, self.quick, self.work, self.deadline = device, quick, work, deadline

    def remaining(self) -> float:
        return max(self.deadline - time.time(), 1.0)


def run_section(name: str, device: str, quick: bool, work: Path, deadline: float, out: Path) -> None:
    """Run one section in this process and write its result to ``out`` (the orchestrator's child)."""
    sys.path.insert(0, str(TESTS))
    context = Context(device, quick, work, deadline)
    try:
        figures = FUNCTIONS[name](context)
        result = {"status": "ok", "reason": figures.pop("reason", None), **figures}
    except SectionSkipped as skipped:
        reason, *rest = skipped.args
        result = {"status": "skipped", "reason": reason, **(rest[0] if rest else {})}
    except Exception as error:  # noqa: BLE001 - the section's failure is its report
        result = {"status": "failed", "reason": f"{type(error).__name__}: {error}"[:3000]}
        result["traceback"] = traceback.format_exc()[-4000:]
    out.write_text(json.dumps(result, indent=1, default=str))


# ---------------------------------------------------------------------------------------------------------------
# the orchestrator


def launch_section(name: str, args, work: Path) -> dict:
    budget = BUDGETS[name][1 if args.quick else 0] * args.budget_scale
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "result.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--run-section", name, "--device", args.device]
    argv += ["--workdir", str(folder), "--deadline", str(time.time() + budget - 10), "--result", str(out)]
    argv += ["--quick"] if args.quick else []
    done = run(argv, budget)
    if out.exists():
        result = json.loads(out.read_text())
    elif done["timed_out"]:
        result = {"status": "failed", "reason": f"timed out after its budget of {budget:.0f} s"}
    else:
        tail = (done["stderr"].strip() or done["stdout"].strip())[-2000:]
        result = {"status": "failed", "reason": f"the section's process exited {done['rc']}: {tail}"}
    result["seconds"] = round(done["seconds"], 1)
    result["budget_s"] = budget
    print(f"[gpu_check] {name}: {result['status']} in {done['seconds']:.0f} s", file=sys.stderr, flush=True)
    return result


def markdown(report: dict, run_info: dict) -> str:
    lines = [
        f"gpu_check on {run_info['device']} ({'quick' if run_info['quick'] else 'full'}), "
        f"{run_info['wall_s']:.0f} s, {run_info['date']}",
        "",
        "| section | status | seconds | figures / reason |",
        "|---|---|---|---|",
    ]
    for name in SECTIONS:
        if name not in report:
            continue
        r = report[name]
        text = r.get("summary") or r.get("reason") or ""
        if r["status"] == "ok" and r.get("reason"):
            text = f"{text} ({r['reason']})" if r.get("summary") else r["reason"]
        text = str(text).replace("|", "/").replace("\n", " ")
        lines.append(f"| {name} | {r['status']} | {r.get('seconds', '')} | {text} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--cli-peak"]:  # internal: fcsd.cli.main wrapped to read its CUDA peak
        return cli_peak(argv[1], argv[3:])
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer steps")
    parser.add_argument("--json", metavar="OUT", help="the report (the markdown summary is written as OUT.md)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of: {', '.join(SECTIONS)}")
    parser.add_argument("--jobs", type=int, help="sections at once (default: 1 on CUDA, 2 on a CPU)")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiply every section's time budget")
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (default: a temporary folder)")
    parser.add_argument("--run-section", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--head-memory", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.head_memory:
        sys.path.insert(0, str(TESTS))
        head_memory(args.head_memory, args.device, args.tokens)
        return 0
    if args.run_section:
        run_section(args.run_section, args.device, args.quick, Path(args.workdir), args.deadline, Path(args.result))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu)")
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)} (use {', '.join(SECTIONS)})")
    jobs = args.jobs or (1 if args.device == "cuda" else 2)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if args.keep:
            work = Path(args.keep)
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu_check-")))
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {name: pool.submit(launch_section, name, args, work) for name in names}
            report = {name: futures[name].result() for name in names}
    run_info = {
        "device": device_name(args.device),
        "quick": args.quick,
        "jobs": jobs,
        "sections": names,
        "wall_s": time.perf_counter() - start,
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
    }
    table = markdown(report, run_info)
    print(table)
    if args.json:
        out = Path(args.json)
        out.write_text(json.dumps({**report, "_run": run_info}, indent=1, default=str))
        out.with_suffix(".md").write_text(table)
    return 0 if all(r["status"] in ("ok", "skipped") for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
