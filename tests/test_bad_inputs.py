"""Bad inputs, as a new user or a hostile tester types them: each case is a command, its exit code, the one line it
answers, and the proof that nothing outside the run's own files was touched (the inputs, the current folder and the
home folder are snapshotted before and after). Most cases fail before any model loads; the module stays fast."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from processes import started, wait_for
from tiny_models import build, save_chat_model

from fcsd.cli import main
from fcsd.distill.config import compose, to_config
from fcsd.files.ownership import MARKER
from fcsd.files.run_folder import CONFIG, RunFolder

FAST = ["data.seq_len=32", "data.eval_sequences=2", "train.batch_tokens=64", "train.micro_batch_size=2"]
FAST += ["train.warmup_steps=0", "progress=false", "early_stop.enabled=false"]
# what `fcsd export` writes into config.json to say what the folder is (fcsd.serving.identity)
EXPORT_IDENTITY = {"model_type": "farskip_qwen3_moe", "farskip": {"layers": [1]}}
EXPORT_IDENTITY["architectures"] = ["FarSkipQwen3MoeForCausalLM"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny real checkpoint (random weights, its own tokenizer), data files, a fake home and a working folder."""
    root = tmp_path_factory.mktemp("world")
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"add {i} and {i + 1}"},
                {"role": "assistant", "content": str(2 * i + 1)},
            ]
        }
        for i in range(60)
    ]
    save_chat_model(root / "model", rows, vocab_size=120)
    data = root / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "empty.jsonl").write_text("")
    good = [json.dumps(r) for r in rows]
    (data / "one_bad_line.jsonl").write_text("\n".join([*good[:30], "{not json", *good[30:]]) + "\n")
    (root / "home").mkdir()
    (root / "work").mkdir()
    (root / "work" / "notes.txt").write_text("mine")
    # run folders as fcsd leaves them (fake weights: the guards answer before anything loads), with the resolved
    # config of `run_convert` into them, so that a --resume with the same overrides is the same run
    finished = fake_run(root, "runs/x", steps=[1], final=True)
    fake_run(root, "runs/y", steps=[1], final=True)
    (fake_run(root, "runs/notes", steps=[1], final=True) / "notes.txt").write_text("mine")
    inner = fake_run(root, "runs/inner_notes", steps=[1], final=True)
    listed = ["config.json", "fcsd_checkpoint.json"]  # what fcsd wrote into final/, as its record lists it
    (inner / "final" / "fcsd_checkpoint.json").write_text(json.dumps({"step": 1, "files": listed}))
    marker = json.loads((inner / MARKER).read_text())
    (inner / MARKER).write_text(json.dumps({**marker, "written": [*marker["written"], "tensorboard"]}))
    for folder in ("final", "tensorboard", "checkpoints", "checkpoints/step-1"):
        (inner / folder).mkdir(exist_ok=True)
        (inner / folder / "notes.txt").write_text("mine")
    (inner / "tensorboard" / "events.out.tfevents.1.host").write_text("")
    fake_run(root, "runs/unfinished", steps=[2, 4])
    (fake_run(root, "runs/no_rng", steps=[2, 4]) / "checkpoints/step-4/random_states_0.pkl").unlink()
    (fake_run(root, "runs/no_optimizer", steps=[4]) / "checkpoints/step-4/optimizer.bin").unlink()
    assert (finished / "final").is_dir()
    for kind, name, files in (("export", "an_export", ["config.json"]), ("teacher-cache", "a_cache", ["meta.json"])):
        (root / name).mkdir()
        (root / name / MARKER).write_text(json.dumps({"kind": kind, "written": files}))
        (root / name / files[0]).write_text("{}")
        (root / name / "notes.txt").write_text("mine")
    (root / "a_file.txt").write_text("a file")
    (root / "clean_export").mkdir()
    (root / "clean_export" / MARKER).write_text(json.dumps({"kind": "export", "written": ["config.json"]}))
    (root / "clean_export" / "config.json").write_text("{}")
    layers = {str(i): [0] * 8 + [1] * 8 for i in range(4)}  # made for a model with 16 experts per layer
    (root / "placement16.json").write_text(json.dumps({"num_experts": 16, "ep": 2, "nodes": 1, "layers": layers}))
    (root / "placements").mkdir()
    shutil.copyfile(root / "placement16.json", root / "placements" / "placement16.json")
    (root / "work" / "models").mkdir()  # makes `models/typo` a local path with a typo, not a hub id
    shutil.copytree(root / "model", root / "no_tokenizer", ignore=shutil.ignore_patterns("tokenizer*", "vocab*"))
    (root / "array").mkdir()
    (root / "array" / "config.json").write_text("[1, 2]")
    (data / "not_utf8.json").write_bytes(b'[{"text": "fine"},\n {"text": "caf\xe9"}]\n')
    (root / "not_an_export").mkdir()
    (root / "not_an_export" / "keep.txt").write_text("keep")
    (root / "mixed").mkdir()
    (root / "mixed" / "keep.txt").write_text("keep")
    (root / "suite.yaml").write_text("name: mine\ntasks:\n  - task: mbpp_plus\n")
    for name, text in (("garbage", "{not json"), ("typed", '{"model_type": "qwen3_moe", "num_hidden_layers": "four"}')):
        (root / name).mkdir()
        (root / name / "config.json").write_text(text)
    (root / "dense").mkdir()
    transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64).save_pretrained(root / "dense")
    broken = root / "broken_model"  # a truncated weights file, as an interrupted download leaves it
    broken.mkdir()
    for path in (root / "model").iterdir():
        (broken / path.name).write_bytes(
            path.read_bytes()[:1000] if path.suffix == ".safetensors" else path.read_bytes()
        )
    (root / "runs" / "broken" / "final").mkdir(parents=True)
    for path in broken.iterdir():
        (root / "runs" / "broken" / "final" / path.name).write_bytes(path.read_bytes())
    add_round_three(root)
    as_3769dc9_wrote_it(fake_run(root, "runs/echoed", steps=[2]) / CONFIG, echo=2, echo_share=0.5)
    return root


def add_round_three(root: Path) -> None:
    """Folders of the third hostile probe: markers that lie or cannot be read, a truncated checkpoint
    file, configs of impossible shapes, a tokenizer larger than its model."""
    (fake_run(root, "runs/marked_export", steps=[2]) / MARKER).write_text(
        json.dumps({"kind": "export", "written": ["checkpoints", CONFIG, "metrics.jsonl"]})
    )
    (fake_run(root, "runs/no_marker", steps=[2]) / MARKER).unlink()
    (fake_run(root, "runs/bad_marker", steps=[2]) / MARKER).write_text("{kind: ru")
    (fake_run(root, "runs/list_marker", steps=[2]) / MARKER).write_text("[1, 2]")
    truncated = fake_run(root, "runs/truncated", steps=[4]) / "checkpoints" / "step-4" / "optimizer.bin"
    truncated.write_bytes(b"x")  # its trainer state lists 4 bytes
    for name, change in (("topk16", {"num_experts_per_tok": 16}), ("no_layers", {"num_hidden_layers": 0})):
        (root / name).mkdir()
        values = json.loads((root / "model" / "config.json").read_text())
        (root / name / "config.json").write_text(json.dumps({**values, **change}))
    (root / "layer_types").mkdir()  # transformers' class validation, not a field's: one line too
    values = json.loads((root / "model" / "config.json").read_text())
    values["layer_types"] = ["full_attention"] * (values["num_hidden_layers"] + 1)
    (root / "layer_types" / "config.json").write_text(json.dumps(values))
    big = root / "big_tokenizer"
    shutil.copytree(root / "model", big)
    tokenizer = transformers.AutoTokenizer.from_pretrained(big)
    vocab = json.loads((big / "config.json").read_text())["vocab_size"]
    tokenizer.add_tokens([f"extra{i}" for i in range(vocab - len(tokenizer) + 5)])
    tokenizer.save_pretrained(big)
    assert len(tokenizer) > vocab
    damaged = root / "export_no_block"  # an export whose config.json lost its farskip block
    damaged.mkdir()
    (damaged / "config.json").write_text(json.dumps({k: v for k, v in EXPORT_IDENTITY.items() if k != "farskip"}))
    (damaged / "fcsd_export.json").write_text("{}")
    (damaged / MARKER).write_text(json.dumps({"kind": "export", "written": ["config.json", "fcsd_export.json"]}))


def fake_run(root: Path, name: str, steps: list[int], final: bool = False) -> Path:
    """A run folder as `fcsd convert` writes it (marker with its manifest, resolved config, checkpoints whose
    trainer state lists their files), with fake weights."""
    from omegaconf import OmegaConf

    run = root / name
    for step in steps:
        checkpoint = run / "checkpoints" / f"step-{step}"
        checkpoint.mkdir(parents=True)
        files = {}
        for file in ("model.safetensors", "optimizer.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl"):
            (checkpoint / file).write_bytes(b"x" * step)
            files[file] = step
        (checkpoint / "trainer_state.json").write_text(json.dumps({"step": step, "files": files}))
    written = ["checkpoints", CONFIG, "metrics.jsonl"]
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n" for s in steps))
    if final:
        (run / "final").mkdir()
        (run / "final" / "config.json").write_text("{}")
        (run / "run_summary.json").write_text(json.dumps({"steps": steps[-1]}))
        written += ["final", "run_summary.json"]
    (run / MARKER).write_text(json.dumps({"kind": "run", "written": written}))
    config = to_config(compose(run_convert(root, f"output_dir={run}")[2:] + [f"model.name={root / 'model'}"]))
    OmegaConf.save(OmegaConf.structured(config), run / CONFIG)
    return run


@pytest.fixture
def env(world, monkeypatch, tmp_path):
    monkeypatch.chdir(world / "work")
    monkeypatch.setenv("HOME", str(world / "home"))
    monkeypatch.setenv("FCSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "1")
    import datasets

    datasets.disable_progress_bars()  # progress output is not an error line
    return world


def snapshot(root: Path, skip: Path | None = None) -> dict:
    """File names with sizes and mtimes under ``root`` (``skip``: the run's own folder)."""
    found = {}
    for path in sorted(root.rglob("*")):
        if skip is not None and (path == skip or skip in path.parents):
            continue
        if path.is_file():
            stat = path.stat()
            found[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns)
    return found


def run_convert(w: Path, *overrides: str, model: str | None = None) -> list[str]:
    data = f"data.path={w / 'data' / 'train.jsonl'}"
    return ["convert", model or str(w / "model"), data, f"data.cache_dir={w / 'packed'}", *FAST, *overrides]


def own_cache(w: Path, *overrides: str) -> list[str]:
    """``run_convert`` with its own ``data.cache_dir`` among ``overrides``."""
    return [arg for arg in run_convert(w) if not arg.startswith("data.cache_dir=")] + list(overrides)


# (case name, argv builder from the world folder, expected message, the run's own folder relative to world or None)
CASES = [
    # 1. overwrite never removes what fcsd did not write
    (
        "output_dir_is_data_folder",
        lambda w: run_convert(w, f"output_dir={w / 'data'}", "overwrite=true"),
        "contains the data file",
        None,
    ),
    (
        "output_dir_is_model",
        lambda w: run_convert(w, f"output_dir={w / 'model'}", "overwrite=true"),
        "is the model",
        None,
    ),
    ("output_dir_is_cwd", lambda w: run_convert(w, "output_dir=.", "overwrite=true"), "is the current folder", None),
    ("output_dir_contains_home", lambda w: run_convert(w, f"output_dir={w}", "overwrite=true"), "contains the", None),
    (
        "output_dir_unmarked",
        lambda w: run_convert(w, f"output_dir={w / 'mixed'}", "overwrite=true"),
        "fcsd did not write",
        None,
    ),
    (
        "export_dir_unmarked",
        lambda w: run_convert(w, f"output_dir={w / 'new'}", f"export_dir={w / 'mixed'}"),
        "mixed holds files fcsd did not write",
        None,
    ),
    # 2. export never clears its source's folder, nor a folder it did not write
    (
        "export_into_run",
        lambda w: ["export", str(w / "runs/x"), str(w / "runs/x"), "--overwrite"],
        "contains the source",
        None,
    ),
    (
        "export_final_into_run",
        lambda w: ["export", str(w / "runs/x/final"), str(w / "runs/x"), "--overwrite"],
        "contains the source",
        None,
    ),
    (
        "export_over_user_folder",
        lambda w: ["export", str(w / "runs/x"), str(w / "not_an_export"), "--overwrite"],
        "holds files fcsd did not write",
        None,
    ),
    # 3. a resume with another model is refused before anything is written
    (
        "resume_other_model",
        lambda w: [*run_convert(w, f"output_dir={w / 'runs/x'}", model=str(w / "data")), "--resume"],
        "is a different run (model.name",
        None,
    ),
    # ... or with a parallel layout when its checkpoints are a one-process run's (sharded ones reshard, these cannot)
    (
        "resume_with_a_layout",
        lambda w: [
            *run_convert(w, f"output_dir={w / 'runs/unfinished'}", "train.max_steps=9", "parallel.fsdp=true"),
            "--resume",
        ],
        "was written by a run without parallel.ep_size / parallel.fsdp",
        None,
    ),
    # a parallel layout in one plain process: the torchrun line, not torch's "Default process group ..."
    (
        "expert_parallel_without_a_launcher",
        lambda w: run_convert(w, f"output_dir={w / 'runs/no_launcher'}", "parallel.ep_size=2"),
        "parallel.ep_size=2 lays the model out over several processes, which a launcher starts, and this is one plain "
        "process: launch it with `fcsd launch torchrun --nproc_per_node 2 -m fcsd.cli convert ",
        None,
    ),
    (
        "fsdp_without_a_launcher",
        lambda w: run_convert(w, f"output_dir={w / 'runs/no_launcher'}", "parallel.fsdp=true"),
        "parallel.fsdp=true lays the model out over several processes, which a launcher starts, and this is one plain "
        "process: launch it with `fcsd launch torchrun --nproc_per_node 2 -m fcsd.cli convert ",
        None,
    ),
    # 12. each command replaces only a folder of its own kind, and never what fcsd did not write
    (
        "output_dir_is_an_export",
        lambda w: run_convert(w, f"output_dir={w / 'an_export'}"),
        "an_export is an fcsd export, not a run folder",
        None,
    ),
    (
        "output_dir_is_an_export_overwrite",
        lambda w: run_convert(w, f"output_dir={w / 'an_export'}", "overwrite=true"),
        "an_export is an fcsd export, not a run folder",
        None,
    ),
    (
        "output_dir_is_a_teacher_cache",
        lambda w: run_convert(w, f"output_dir={w / 'a_cache'}"),
        "a_cache is an fcsd teacher cache, not a run folder",
        None,
    ),
    (
        "export_over_another_run",
        lambda w: ["export", str(w / "runs/x"), str(w / "runs/y"), "--overwrite"],
        "runs/y is an fcsd run folder, not an export",
        None,
    ),
    (
        "overwrite_keeps_the_users_files",
        lambda w: run_convert(w, f"output_dir={w / 'runs/notes'}", "overwrite=true"),
        "also holds files fcsd did not write (notes.txt)",
        None,
    ),
    (
        "overwrite_keeps_the_users_files_inside_the_runs_folders",  # they were deleted with final/, tensorboard/, ...
        lambda w: run_convert(w, f"output_dir={w / 'runs/inner_notes'}", "overwrite=true"),
        "holds files fcsd did not write (final/notes.txt, tensorboard/notes.txt, checkpoints/notes.txt and 1 more)",
        None,
    ),
    (
        "export_dir_holds_an_export",
        lambda w: run_convert(w, f"output_dir={w / 'new'}", f"export_dir={w / 'clean_export'}"),
        "clean_export holds an export; set overwrite=true to replace it",
        None,
    ),
    # 13. --resume checks what it resumes
    (
        "resume_a_finished_run",
        lambda w: [*run_convert(w, f"output_dir={w / 'runs/x'}", "train.max_steps=3"), "--resume"],
        "finished (step 1; final/ holds it), and resuming would write over it",
        None,
    ),
    (
        "resume_to_fewer_steps",
        lambda w: [*run_convert(w, f"output_dir={w / 'runs/unfinished'}", "train.max_steps=3"), "--resume"],
        "the run would end at step 3 (train.max_steps / max_tokens / stop_after), at or below step 4 of "
        "checkpoints/step-4: there is nothing left to train",
        None,
    ),
    (
        "resume_a_folder_that_does_not_exist",
        lambda w: [*run_convert(w, f"output_dir={w / 'runs/nothing'}"), "--resume"],
        "runs/nothing does not exist, so there is no run to resume",
        None,
    ),
    (
        "resume_missing_rng_state",
        lambda w: [*run_convert(w, f"output_dir={w / 'runs/no_rng'}"), "--resume"],
        "checkpoints/step-4 is incomplete (random_states_0.pkl missing); continue from step-2: `fcsd convert",
        None,
    ),
    (
        "resume_missing_optimizer_state",
        lambda w: [*run_convert(w, f"output_dir={w / 'runs/no_optimizer'}"), "--resume"],
        "(optimizer.bin missing); no complete older checkpoint is left",
        None,
    ),
    (
        "resume_step_without_resume",
        lambda w: run_convert(w, f"output_dir={w / 'new'}", "train.resume_step=2"),
        "chooses the checkpoint --resume continues from: add --resume",
        None,
    ),
    # 14. values that would train silently wrong
    ("lr_infinite", lambda w: run_convert(w, "train.lr=inf", f"output_dir={w / 'new'}"), "must be a finite", None),
    (
        "placement_without_expert_parallelism",
        lambda w: run_convert(w, f"parallel.placement={w / 'a_file.txt'}", f"output_dir={w / 'new'}"),
        "parallel.ep_size=1 has none, so it would be ignored",
        None,
    ),
    (
        "checkpoint_offload_without_expert_parallelism",
        lambda w: run_convert(w, "train.gradient_checkpointing=true", "train.checkpoint_offload=true", "output_dir=n"),
        "train.checkpoint_offload keeps the rows of checkpointed expert-parallel exchanges in host memory: it needs "
        "train.gradient_checkpointing=true and parallel.ep_size > 1",
        None,
    ),
    (
        "placement_for_another_model",
        lambda w: run_convert(w, "parallel.ep_size=2", f"parallel.placement={w / 'placement16.json'}", "output_dir=n"),
        "placement16.json is for 16 experts per layer, the model has 8",
        None,
    ),
    (
        "eval_limit_above_one",
        lambda w: ["eval", str(w / "model"), "--tasks", "arc_easy", "--limit", "1.5"],
        "--limit 1.5: give a whole number",
        None,
    ),
    ("eval_tasks_empty", lambda w: ["eval", str(w / "model"), "--tasks", ""], "--tasks: give lm-eval task names", None),
    (
        "eval_include_path_missing",
        lambda w: ["eval", str(w / "model"), "--include-path", str(w / "no-tasks")],
        "no-tasks: no such folder; give a folder of lm-eval task YAML files",
        None,
    ),
    ("eval_limit_zero", lambda w: ["eval", str(w / "model"), "--limit", "0"], "--limit 0: give", None),
    ("eval_limit_negative", lambda w: ["eval", str(w / "model"), "--limit", "-3"], "--limit -3: give", None),
    ("eval_batch_zero", lambda w: ["eval", str(w / "model"), "--batch-size", "0"], "--batch-size 0: give", None),
    ("eval_batch_negative", lambda w: ["eval", str(w / "model"), "--batch-size", "-2"], "--batch-size -2: give", None),
    (
        "eval_batch_word",
        lambda w: ["eval", str(w / "model"), "--batch-size", "eight"],
        "--batch-size eight: give a positive whole number, 'auto' or 'auto:N'",
        None,
    ),
    # 15. one line instead of a traceback, naming the file and the next step
    ("inspect_array_config", lambda w: ["inspect", str(w / "array")], "holds a JSON list, not an object", None),
    (
        "perfmodel_array_config",
        lambda w: ["perfmodel", "--model", str(w / "array")],
        "holds a JSON list, not an object",
        None,
    ),
    (
        "probe_array_config",
        lambda w: ["probe", str(w / "array"), "--data", str(w / "data/train.jsonl"), "--output-dir", str(w / "p")],
        "holds a JSON list, not an object",
        None,
    ),
    (
        "probe_output_is_a_file",
        lambda w: [
            "probe",
            str(w / "model"),
            "--data",
            str(w / "data/train.jsonl"),
            "--output-dir",
            str(w / "a_file.txt"),
        ],
        "a_file.txt is a file, not a folder",
        None,
    ),
    ("bench_no_iterations", lambda w: ["bench", "overlap", "--iters", "0"], "--iters 0: it must be at least 1", None),
    (
        "bench_trace_is_a_file",
        lambda w: ["bench", "overlap", "--trace", str(w / "a_file.txt")],
        "a_file.txt is a file, not a folder",
        None,
    ),
    ("convert_without_arguments", lambda w: ["convert"], "MODEL is missing: `fcsd convert MODEL [key=value", None),
    (
        "comma_value_is_not_a_sweep",
        lambda w: run_convert(w, "train.lr=1,2", f"output_dir={w / 'new'}"),
        "train.lr=1,2: a comma makes the value ambiguous; write a list as train.lr=[1,2]",
        None,
    ),
    (
        "unknown_key_without_plus",
        lambda w: run_convert(w, "train.lrr=1", f"output_dir={w / 'new'}"),
        "unknown config key train.lrr: check the spelling",
        None,
    ),
    (
        "unparsable_value",
        lambda w: run_convert(w, "output_dir=[x"),
        "output_dir=[x: this value cannot be read as it is written; quote it, e.g. 'output_dir=\"[x\"'",
        None,
    ),
    (
        "mistyped_local_model_folder",
        lambda w: run_convert(w, f"output_dir={w / 'new'}", model="models/typo"),
        "model models/typo: no such folder",
        None,
    ),
    (
        "json_data_not_utf8",
        lambda w: run_convert(w, f"data.path={w / 'data/not_utf8.json'}", f"output_dir={w / 'new'}"),
        "not_utf8.json, line 2: not UTF-8 text",
        "new",
    ),
    # 4. an empty layer selection is refused before loading
    (
        "empty_selection_last0",
        lambda w: run_convert(w, "farskip.layers=last:0", f"output_dir={w / 'new'}"),
        "selects no layer",
        None,
    ),
    (
        "empty_selection_blank",
        lambda w: run_convert(w, "farskip.layers=", f"output_dir={w / 'new'}"),
        "selects no layer",
        None,
    ),
    # 5. no path into model-written code without the opt-in
    (
        "eval_tasks_humaneval_plus",
        lambda w: ["eval", str(w / "model"), "--tasks", "humaneval_plus"],
        "--allow-code-execution",
        None,
    ),
    (
        "eval_tasks_mbpp_plus",
        lambda w: ["eval", str(w / "model"), "--tasks", "mbpp_plus"],
        "--allow-code-execution",
        None,
    ),
    (
        "eval_user_suite_mbpp_plus",
        lambda w: ["eval", str(w / "model"), "--suite", str(w / "suite.yaml")],
        "--allow-code-execution",
        None,
    ),
    # 10. config mistakes
    (
        "plus_unknown_key",
        lambda w: run_convert(w, "+train.lrr=1e-3", f"output_dir={w / 'new'}"),
        "unknown config key(s) train.lrr",
        None,
    ),
    (
        "lr_not_a_number",
        lambda w: run_convert(w, "train.lr=fast", f"output_dir={w / 'new'}"),
        "could not be converted to Float",
        None,
    ),
    (
        "lr_negative",
        lambda w: run_convert(w, "train.lr=-1", f"output_dir={w / 'new'}"),
        "train.lr=-1.0: it must be > 0",
        None,
    ),
    (
        "seq_len_above_model",
        lambda w: run_convert(w, "data.seq_len=4096", "train.batch_tokens=8192", f"output_dir={w / 'new'}"),
        "max_position_embeddings",
        "new",
    ),
    # 11. cache-teacher answers with a command that works
    (
        "cache_teacher_into_other_files",
        lambda w: ["cache-teacher", *run_convert(w, f"teacher.cache_dir={w / 'mixed'}")[1:]],
        "holds other files and no teacher cache",
        None,
    ),
    (
        "cache_teacher_into_a_file",
        lambda w: ["cache-teacher", *run_convert(w, f"teacher.cache_dir={w / 'work/notes.txt'}")[1:]],
        "notes.txt is a file, not a folder; point teacher.cache_dir at a new or empty folder",
        None,
    ),
    (
        "convert_model_without_tokenizer",
        lambda w: run_convert(w, f"output_dir={w / 'new'}", model=str(w / "no_tokenizer")),
        "no_tokenizer holds no tokenizer (tokenizer.json, tokenizer_config.json, ...): copy the tokenizer files",
        None,
    ),
    (
        "probe_model_without_tokenizer",
        lambda w: ["probe", str(w / "no_tokenizer"), "--data", str(w / "data/train.jsonl"), "--device", "cpu"],
        "no_tokenizer holds no tokenizer (tokenizer.json, tokenizer_config.json, ...): copy the tokenizer files",
        None,
    ),
    (
        "export_dir_inside_the_new_runs_final",
        lambda w: run_convert(w, f"output_dir={w / 'new'}", f"export_dir={w / 'new/final'}"),
        "new/final lies inside the run's output_dir",
        None,
    ),
    (
        "convert_a_run_folder",
        lambda w: run_convert(w, f"output_dir={w / 'new'}", model=str(w / "runs/x")),
        "runs/x has no config.json, so it is no checkpoint; it is an fcsd run folder; give ",
        None,
    ),
    (
        "convert_an_empty_folder",
        lambda w: run_convert(w, f"output_dir={w / 'new'}", model=str(w / "work/models")),
        "work/models has no config.json, so it is no checkpoint; give a checkpoint folder",
        None,
    ),
    (
        "save_every_negative",
        lambda w: run_convert(w, "train.save_every=-1"),
        "train.save_every=-1: give a number",
        None,
    ),
    (
        "keep_checkpoints_negative",
        lambda w: run_convert(w, "train.keep_checkpoints=-1"),
        "train.keep_checkpoints=-1: give how many to keep (0: keep them all)",
        None,
    ),
    (
        "routes_stats_of_a_model_folder",
        lambda w: ["routes", "stats", str(w / "model")],
        "model is a folder, not a routes file; record one with `fcsd routes record",
        None,
    ),
    (
        "output_dir_holds_the_placement",  # overwrite=true would remove it with the run's folder
        lambda w: run_convert(
            w,
            "parallel.ep_size=2",
            f"parallel.placement={w / 'placements/placement16.json'}",
            f"output_dir={w / 'placements'}",
        ),
        "placements contains the placement",
        None,
    ),
    ("launch_nothing", lambda w: ["launch"], "give fcsd launch a launch line to run: put fcsd launch in front", None),
    # 6. data
    (
        "data_empty_jsonl",
        lambda w: [*run_convert(w, f"output_dir={w / 'new'}"), f"data.path={w / 'data/empty.jsonl'}"],
        "the data is empty",
        "new",
    ),
    # 7. models
    (
        "export_truncated_safetensors",
        lambda w: ["export", str(w / "runs/broken"), str(w / "exported")],
        "final/model.safetensors is truncated or corrupt",
        "exported",
    ),
    ("inspect_garbage_config", lambda w: ["inspect", str(w / "garbage")], "config.json cannot be read", None),
    ("plan_unknown_gpu", lambda w: ["plan", str(w / "model"), "--gpu", "a100"], "--gpu 'a100' is not a preset", None),
    (
        "plan_no_gpus",
        lambda w: ["plan", str(w / "model"), "--gpus-per-node", "0"],
        "at least one node of one GPU",
        None,
    ),
    ("plan_dense_model", lambda w: ["plan", str(w / "dense")], "does not support model type 'llama'", None),
    (
        "plan_max_kl_without_probe",
        lambda w: ["plan", str(w / "model"), "--max-kl", "0.1"],
        "--max-kl bounds the KL that --probe DATA measures",
        None,
    ),
    ("plan_override_not_key_value", lambda w: ["plan", str(w / "model"), "seqlen"], "'seqlen' is not KEY=VALUE", None),
    (
        "plan_memory_below_reserve",
        lambda w: ["plan", str(w / "model"), "--gpu-memory", "1GB"],
        "0.93 GiB is not more than the 2 GiB a GPU keeps",
        None,
    ),
    (
        "plan_layers_convert_nothing",
        lambda w: ["plan", str(w / "model"), "--layers", "first:0"],
        "selects no layer of the model's 4 layers, so there is nothing to convert",
        None,
    ),
    (
        "plan_probe_missing",
        lambda w: ["plan", str(w / "model"), "--probe", str(w / "missing.jsonl")],
        "missing.jsonl: no such file",
        None,
    ),
    (
        "plan_cluster_too_small",
        lambda w: ["plan", "deepseek-v3", "--gpu", "h100", "--gpu-memory", "8GB"],
        "nothing fits on 8 GPUs of 7.45058 GiB, nor on 128 nodes",
        None,
    ),
    ("inspect_typed_config", lambda w: ["inspect", str(w / "typed")], "config.json cannot be read", None),
    (
        "probe_garbage_config",
        lambda w: ["probe", str(w / "garbage"), "--data", str(w / "data/train.jsonl"), "--output-dir", str(w / "p")],
        "config.json cannot be read",
        "p",
    ),
    (
        "perfmodel_garbage_config",
        lambda w: ["perfmodel", "--model", str(w / "garbage")],
        "config.json cannot be read",
        None,
    ),
    (
        "perfmodel_dense_model",
        lambda w: ["perfmodel", "--model", str(w / "dense")],
        "does not support model type",
        None,
    ),
    (
        "perfmodel_tp_zero",
        lambda w: ["perfmodel", "--preset", "deepseek-v3", "--tp", "0"],
        "--tp=0: it must be at least 1",
        None,
    ),
    (
        "bench_ranks_not_dividing_experts",
        lambda w: ["bench", "overlap", "--ranks", "3"],
        "--ranks 3: it must be at least 1 and divide the model's 8 experts",
        None,
    ),
]


# the third hostile probe: each case failed (exit 0, a traceback or a misleading line) before
CASES += [
    # 3. a folder's kind is read from its contents too: a run whose marker says export is still a run
    (
        "export_over_a_run_marked_export",
        lambda w: ["export", str(w / "runs/x"), str(w / "runs/marked_export"), "--overwrite"],
        "is marked as an export but holds a run folder's checkpoints, fcsd_config.yaml, metrics.jsonl",
        None,
    ),
    (
        "output_dir_run_without_marker",
        lambda w: run_convert(w, f"output_dir={w / 'runs/no_marker'}", "overwrite=true"),
        "holds a run folder's files (checkpoints, fcsd_config.yaml, metrics.jsonl) but no .fcsd-output marker",
        None,
    ),
    (
        "output_dir_marker_not_json",
        lambda w: run_convert(w, f"output_dir={w / 'runs/bad_marker'}", "overwrite=true"),
        "has a damaged .fcsd-output marker (not JSON), so fcsd cannot tell what it wrote there",
        None,
    ),
    (
        "output_dir_marker_json_list",
        lambda w: run_convert(w, f"output_dir={w / 'runs/list_marker'}", "overwrite=true"),
        "has a damaged .fcsd-output marker (a JSON list, not an object)",
        None,
    ),
    (
        "resume_marker_json_list",
        lambda w: [*run_convert(w, f"output_dir={w / 'runs/list_marker'}"), "--resume"],
        "holds a folder with a damaged .fcsd-output marker (a JSON list, not an object), not a run to resume",
        None,
    ),
    # 4. a layer spec that rounds to no layer, wherever a spec is read
    (
        "convert_layers_round_to_none",
        lambda w: run_convert(w, "farskip.layers=last:1%", f"output_dir={w / 'new'}"),
        "layer spec 'last:1%' rounds to no layer: 1% of the model's 4 layers is 0.04; the smallest that converts "
        "one layer is last:13% (or last:1)",
        None,
    ),
    ("inspect_layers_round_to_none", lambda w: ["inspect", str(w / "model"), "--layers", "last:1%"], "last:13%", None),
    ("plan_layers_round_to_none", lambda w: ["plan", str(w / "model"), "--layers", "first:2%"], "first:13%", None),
    (
        "probe_grid_rounds_to_none",
        lambda w: [
            "probe",
            str(w / "model"),
            "--data",
            str(w / "data/train.jsonl"),
            "--grid",
            "1%",
            "--output-dir",
            str(w / "p"),
        ],  # fmt: skip
        "rounds to no layer",
        "p",
    ),
    # 8. another schedule on --resume
    (
        "resume_with_a_longer_schedule",
        lambda w: [*run_convert(w, f"output_dir={w / 'runs/unfinished'}", "train.max_steps=12"), "--resume"],
        "train.max_steps=12 (the run's schedule spans 156250000 steps, this one 12) would change the LR schedule",
        None,
    ),
    (
        "resume_with_another_lr",
        lambda w: [*run_convert(w, f"output_dir={w / 'runs/unfinished'}", "train.lr=3e-4"), "--resume"],
        "train.lr=0.0003 (the run: 2e-05) would change the LR schedule",
        None,
    ),
    # 9. other optimizer parameter groups on --resume: torch refused to load the optimizer's state after the run's
    # fcsd_config.yaml had been rewritten (train.freeze_embeddings), or loading it put the run's settings back
    *[
        (
            f"resume_with_another_{key.split('.')[1]}",
            lambda w, setting=f"{key}={value}": [
                *run_convert(w, f"output_dir={w / 'runs/unfinished'}", setting),
                "--resume",
            ],
            f"is a different run ({key}: run",
            None,
        )
        for key, value in [
            ("train.freeze_embeddings", "true"),
            ("train.weight_decay", "0.1"),
            ("train.adam_betas", "[0.9,0.999]"),
            ("train.divergence", "reverse_kl"),  # the loss: a re-probe resumed under another one silently
            ("train.temperature", "2.0"),
            ("train.grad_clip", "0"),
        ]
    ],
    # 10. impossible shapes, refused by every command that reads a config
    ("inspect_top_k_above_experts", lambda w: ["inspect", str(w / "topk16")], "num_experts_per_tok=16 with 8", None),
    ("perfmodel_top_k_above_experts", lambda w: ["perfmodel", "--model", str(w / "topk16")], "top-k must lie", None),
    ("plan_top_k_above_experts", lambda w: ["plan", str(w / "topk16")], "num_experts_per_tok=16 with 8 routed", None),
    ("inspect_no_layers", lambda w: ["inspect", str(w / "no_layers")], "num_hidden_layers=0 (it must be", None),
    (
        "convert_top_k_above_experts",
        lambda w: run_convert(w, f"output_dir={w / 'new'}", model=str(w / "topk16")),
        "the Qwen3-MoE config is impossible: num_experts_per_tok=16 with 8 routed experts",
        None,
    ),
    # the teacher cache's top-k: 0 trained on one bucket (a KL of 0, nothing learnt), too many was a traceback
    (
        "convert_teacher_top_k_zero",
        lambda w: run_convert(w, "teacher.mode=cache", f"teacher.cache_dir={w / 'tc'}", "teacher.top_k=0"),
        "teacher.top_k=0: the cache keeps at least 1",
        None,
    ),
    (
        "cache_teacher_top_k_above_the_vocabulary",
        lambda w: ["cache-teacher", *run_convert(w, f"teacher.cache_dir={w / 'tc'}", "teacher.top_k=100000000")[1:]],
        "teacher.top_k=100000000: the cache keeps 1 to",
        None,
    ),
    # fcsd perfmodel: a throughput of 0 divided by zero, NaN printed NaN speedups; --plot replaced any file
    *[
        (
            f"perfmodel_{flag[2:].replace('-', '_')}_{value}",
            lambda w, flag=flag, value=value: ["perfmodel", "--preset", "deepseek-v3", flag, value],
            f"{flag} {float(value)}: a throughput must be a finite number > 0",
            None,
        )
        for flag, value in [("--attn-tflops", "0"), ("--gemm-tflops", "-5"), ("--allreduce-gbps", "nan")]
    ],
    (
        "perfmodel_plot_over_a_user_file",
        lambda w: ["perfmodel", "--preset", "deepseek-v3", "--plot", str(w / "data" / "train.jsonl")],
        "exists and is not a perfmodel plot fcsd wrote, so fcsd will not replace it",
        None,
    ),
    # devices: a device torch does not know, or a GPU this machine lacks, was a traceback from inside torch
    (
        "probe_unknown_device",
        lambda w: ["probe", str(w / "model"), "--data", str(w / "data" / "train.jsonl"), "--device", "banana"],
        "--device banana: give cpu, cuda or cuda:N",
        None,
    ),
    *[
        (
            f"{name}_without_a_gpu",
            argv,
            message,
            None,
        )
        for name, argv, message in [
            (
                "routes_record_on_cuda",
                lambda w: ["routes", "record", str(w / "model"), "--device", "cuda", "--out", str(w / "r.routes")],
                "--device cuda: no CUDA device is visible on this machine; use --device cpu",
            ),
            (
                "bench_overlap_on_nccl",
                lambda w: ["bench", "overlap", "--backend", "nccl"],
                "--backend nccl needs a CUDA",
            ),
        ]
        if not torch.cuda.is_available()  # what a machine without a GPU says
    ],
    # numbers that crashed or planned NaN: a NaN bandwidth chose a layout with a NaN step time
    (
        "plan_nan_bandwidth",
        lambda w: ["plan", str(w / "model"), "--inter-gbps", "nan"],
        "--inter-gbps nan: it must",
        None,
    ),
    (
        "plan_nan_kl_bound",
        lambda w: ["plan", str(w / "model"), "--probe", str(w / "data" / "train.jsonl"), "--max-kl", "nan"],
        "--max-kl nan: a held-out KL bound is a finite number > 0",
        None,
    ),
    (
        "probe_sequences_of_no_token",
        lambda w: ["probe", str(w / "model"), "--data", str(w / "data" / "train.jsonl"), "--seq-len", "0"],
        "--seq-len 0: it must be at least 2",
        None,
    ),
    # fcsd sweep: a bad stage-2 LR surfaced after stage 1 had run, a zero-step run as a traceback
    *[
        (
            f"sweep_{name}",
            lambda w, setting=setting: ["sweep", *run_convert(w, f"output_dir={w / 'sw'}")[1:], setting],
            message,
            None,
        )
        for name, setting, message in [
            ("negative_stage2_lr", "sweep.lrs=[-1]", "learning rates are finite numbers > 0"),
            ("no_step", "sweep.steps=0", "a run needs at least one step"),
            ("no_step_size", "sweep.batch_tokens=[]", "give one or more step sizes in tokens"),
        ]
    ],
    (
        "routes_step_of_no_token",
        lambda w: ["routes", "stats", str(w / "r"), "--step-tokens", "0"],
        "--step-tokens 0",
        None,
    ),
    (
        "probe_unknown_device_type",
        lambda w: ["probe", str(w / "model"), "--device", "meta"],
        "give cpu, cuda or cuda:N",
        None,
    ),
    ("eval_auto_device", lambda w: ["eval", str(w / "model"), "--device", "auto"], "--device auto: give cpu", None),
    # fcsd push: a missing folder or a file was "has no fcsd_export.json", an invalid repo id listed its upload
    ("push_missing_folder", lambda w: ["push", str(w / "nope"), "me/x", "--dry-run"], "does not exist: give", None),
    ("push_a_file", lambda w: ["push", str(w / "data" / "train.jsonl"), "me/x"], "is a file, not a folder", None),
    ("push_bad_repo_id", lambda w: ["push", str(w / "data"), "bad id!!", "--dry-run"], "not a hub repository id", None),
    # 11. two models named
    (
        "model_twice",
        lambda w: [*run_convert(w, f"output_dir={w / 'new'}"), f"model.name={w / 'big_tokenizer'}"],
        "name two models; give the model once",
        None,
    ),
    # tracebacks that are one line now
    ("seq_len_one", lambda w: run_convert(w, "data.seq_len=1", f"output_dir={w / 'new'}"), "needs at least 2", None),
    (
        "probe_tokenizer_larger_than_model",
        lambda w: [
            "probe",
            str(w / "big_tokenizer"),
            "--data",
            str(w / "data/train.jsonl"),
            "--output-dir",
            str(w / "p"),
        ],  # fmt: skip
        "vocabulary mismatch: the tokenizer has",
        "p",
    ),
    (
        "routes_tokenizer_larger_than_model",
        lambda w: [
            "routes",
            "record",
            str(w / "big_tokenizer"),
            "--data",
            str(w / "data/train.jsonl"),
            "--out",
            str(w / "r.routes"),
        ],  # fmt: skip
        "vocabulary mismatch: the tokenizer has",
        None,
    ),
    (
        "routes_garbage_config",
        lambda w: [
            "routes",
            "record",
            str(w / "garbage"),
            "--data",
            str(w / "data/train.jsonl"),
            "--out",
            str(w / "r.routes"),
        ],  # fmt: skip
        "garbage/config.json cannot be read",
        None,
    ),
    ("perfmodel_sparsity_zero", lambda w: ["perfmodel", "--preset", "deepseek-v3", "--sparsity", "0"], "least 1", None),
    # 12. a link the benchmark cannot model in reasonable time, and a negative one
    (
        "bench_link_one_byte_per_second",
        lambda w: ["bench", "overlap", "--config", "tiny", "--ranks", "2", "--link", "1B/s"],
        "--link 1B/s: the modelled transfers alone would take about",
        None,
    ),
    ("bench_link_negative", lambda w: ["bench", "overlap", "--link", "-1MB/s"], "the bandwidth must be positive", None),
    # misleading lines, now accurate
    (
        "resume_truncated_checkpoint_file",
        lambda w: [*run_convert(w, f"output_dir={w / 'runs/truncated'}"), "--resume"],
        "checkpoints/step-4 is incomplete (optimizer.bin truncated (1 of 4 bytes))",
        None,
    ),
    (
        "sweep_into_a_run_folder",
        lambda w: ["sweep", *run_convert(w, f"output_dir={w / 'runs/x'}")[1:]],
        "runs/x is an fcsd run folder; a sweep writes its runs to OUTPUT_DIR/sweep/",
        None,
    ),
    (
        "export_inside_the_sources_run",
        lambda w: ["export", str(w / "runs/x"), str(w / "runs/x/export2")],
        "lies inside the run folder",
        None,
    ),
    (
        "eval_tasks_mbpp_names_the_tasks",
        lambda w: ["eval", str(w / "model"), "--tasks", "mbpp"],
        "--tasks mbpp scores mbpp by running model-written code",
        None,
    ),
    (
        "unknown_hub_id_offline_named",
        lambda w: ["inspect", "no-such-org/no-such-model"],
        "no-such-org/no-such-model is not in the local hub cache and hub access is off (HF_HUB_OFFLINE=1): unset",
        None,
    ),
    ("plan_absurd_tokens", lambda w: ["plan", str(w / "model"), "--tokens", "1e30"], "--tokens 1e+30: give a", None),
    # leftovers of the second probe: an inconsistent config, folders inside what another fcsd folder manages
    (
        "config_layer_types_disagree_with_layers",
        lambda w: ["inspect", str(w / "layer_types")],
        "config.json cannot be read (`num_hidden_layers` (4) must be equal to the number of `layer_types` (5))",
        None,
    ),
    (
        "data_cache_dir_is_another_run",
        lambda w: own_cache(w, f"output_dir={w / 'runs/new'}", f"data.cache_dir={w / 'runs/x'}"),
        "runs/x is an fcsd run folder",
        None,
    ),
    (
        "cache_teacher_data_cache_dir_is_another_run",
        lambda w: ["cache-teacher", *own_cache(w, f"data.cache_dir={w / 'runs/x'}")[1:]],
        "runs/x is an fcsd run folder",
        None,
    ),
    (
        "data_cache_dir_inside_the_output_dir",
        lambda w: own_cache(w, f"output_dir={w / 'runs/new'}", f"data.cache_dir={w / 'runs/new/packed'}"),
        "lies inside the run's output_dir",
        None,
    ),
    (
        "run_inside_another_runs_checkpoints",
        lambda w: run_convert(w, f"output_dir={w / 'runs/x/checkpoints/mine'}"),
        "runs/x/checkpoints/mine lies inside checkpoints/ of an fcsd run folder",
        None,
    ),
    (
        "run_in_an_entry_another_run_will_write",
        lambda w: run_convert(w, f"output_dir={w / 'runs/y/best'}"),
        "runs/y/best is best/ of an fcsd run folder",
        None,
    ),
    (
        "export_inside_another_runs_final",
        lambda w: ["export", str(w / "runs/x"), str(w / "runs/y/final/e")],
        "runs/y/final/e lies inside final/ of an fcsd run folder",
        None,
    ),
    (
        "push_an_export_without_its_farskip_block",
        lambda w: ["push", str(w / "export_no_block"), "me/x", "--dry-run"],
        "says FarSkip but the `farskip` block (which layers are converted) is missing",
        None,
    ),
]


@pytest.mark.parametrize("argv, message, own", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_touches_nothing(env, capsys, argv, message, own):
    own_dir = env / own if own else None
    before_world, before_home = snapshot(env, own_dir), snapshot(env / "home")
    assert main(argv(env)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "--multirun" not in err and "hydra.cc" not in err and "To append" not in err, err  # no foreign advice
    assert snapshot(env, own_dir) == before_world
    assert snapshot(env / "home") == before_home


# the recovery keys fcsd 3769dc9 wrote into every run's config, at the values that turned their features off
OLD_RECOVERY = {"warm_share": 0.0, "warm_lr_mult": 10.0, "trainable": "all", "lr_mult": {}, "progressive": []}
OLD_RECOVERY.update(progressive_shares=[], echo=1, echo_share=0.0)
REMOVED_ECHO = (
    "recovery.echo was removed (data echoing never won on compute; its code is in commit 3769dc9, its figures in "
    "BENCHMARKS.md): "
)


def as_3769dc9_wrote_it(config: Path, **used) -> None:
    """Rewrite a run's saved ``config`` as fcsd 3769dc9 wrote it, with the removed recovery keys (``used``: those
    the run used, with their values)."""
    from omegaconf import OmegaConf

    saved = OmegaConf.load(config)
    saved.recovery = {**OmegaConf.to_container(saved.recovery), **OLD_RECOVERY, **used}
    OmegaConf.save(saved, config)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            lambda w: run_convert(w, f"output_dir={w / 'runs/new'}", "recovery.echo=2", "recovery.echo_share=0.5"),
            lambda w: REMOVED_ECHO + "drop it from the config",
        ),
        (
            lambda w: run_convert(w, f"output_dir={w / 'runs/new'}", "recovery=warm_start"),
            lambda w: (
                "recovery=warm_start was removed (the layer-local warm start needed more tokens than plain KL; "
                "its code is in commit 3769dc9, its figures in BENCHMARKS.md): drop it (recovery=guided is the default)"
            ),
        ),
        (
            lambda w: [*run_convert(w, f"output_dir={w / 'runs/echoed'}"), "--resume"],
            lambda w: (
                REMOVED_ECHO + f"the run in {w / 'runs/echoed'} used it: resume or export it with fcsd at that commit"
            ),
        ),
    ],
    ids=["override", "preset", "saved_run_config"],
)
def test_a_removed_setting_is_refused_in_one_line_naming_it(env, capsys, argv, message):
    """A setting fcsd removed (docs/recovery.md), named by an override, a preset or a run's saved config: one line
    naming it, why, the commit that had it and what to do; status 2 and nothing touched."""
    before = snapshot(env)
    assert main(argv(env)) == 2
    assert capsys.readouterr().err.strip() == f"fcsd convert: error: {message(env)}"
    assert snapshot(env) == before


def test_the_export_of_a_run_refuses_a_removed_setting_it_used_and_not_one_it_left_off(env, tmp_path, capsys):
    """A run's saved config as fcsd 3769dc9 wrote it names every removed key: at the value that turned its feature
    off it is no use of it (the export and its model card go on); at another it is refused in one line, and
    nothing of the export is left."""
    run = tmp_path / "run"
    assert main(run_convert(env, f"output_dir={run}", "train.max_steps=1", "export=false")) == 0
    for config in (run / CONFIG, run / "final" / CONFIG):
        as_3769dc9_wrote_it(config)
    assert main(["export", str(run), str(tmp_path / "old")]) == 0
    assert (tmp_path / "old" / "README.md").exists()
    assert main(["export", str(run), str(run / "export")]) == 0  # the run's own export: `fcsd eval RUN` renews its card
    for config in (run / CONFIG, run / "final" / CONFIG):
        as_3769dc9_wrote_it(config, echo=4, echo_share=0.25)
    capsys.readouterr()
    assert main(["export", str(run), str(tmp_path / "echoed")]) == 2
    err = capsys.readouterr().err.strip()  # said before the weights load, from the run's saved config
    said = f"{REMOVED_ECHO}the run in {run} used it: resume or export it with fcsd at that commit"
    assert err.splitlines()[-1] == f"fcsd export: error: {said}" and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old", "run"]  # nothing of the refused export is left
    assert main(["eval", str(run), "--suite", "demo", "--limit", "2"]) == 2  # refused before it scores
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"fcsd eval: error: {said}"
    assert not (run / "eval").exists()


def test_layer_list_syntax_and_quoted_commas_are_accepted(env):
    base = ["model.name=m", "data.path=d"]
    assert to_config(compose([*base, "farskip.layers=[0,3]"])).farskip.layers == "0,3"
    assert to_config(compose([*base, 'farskip.layers="0,3"'])).farskip.layers == "0,3"


def test_malformed_jsonl_line_is_skipped_and_counted(env):
    from fcsd.distill.data import load_texts

    rows = load_texts(str(env / "data" / "one_bad_line.jsonl"), text_field="messages")
    assert rows.skipped == 1  # exactly the one bad line: nothing around it is lost or counted twice
    assert len(rows.texts) == 60 and "add 30 and 31" in rows.texts[30]


def test_failed_start_restarts_and_resume_keeps_the_config(env, capsys):
    """A run folder that holds no checkpoint yet (a failed start) is restarted by the same command, without
    overwrite; a refused --resume leaves the run's config as it was."""
    failed = env / "failed"
    failed.mkdir()
    (failed / MARKER).write_text(json.dumps({"kind": "run", "written": [CONFIG]}))
    (failed / CONFIG).write_text("model:\n  name: x\n")
    argv = [*run_convert(env, f"output_dir={failed}"), f"data.path={env / 'data' / 'empty.jsonl'}"]
    assert main(argv) == 2
    assert "not empty" not in capsys.readouterr().err
    config = (env / "runs/x" / CONFIG).read_text()
    assert main([*run_convert(env, f"output_dir={env / 'runs/x'}", model=str(env / "data")), "--resume"]) == 2
    assert (env / "runs/x" / CONFIG).read_text() == config


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_stops_cleanly_with_the_resume_command(env, tmp_path, stop):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "fcsd.cli", *run_convert(env, f"output_dir={out}", "train.max_steps=100000")]
    argv += ["train.save_every=1", "export=false"]
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr, started(argv, stderr=stderr, stdout=subprocess.DEVNULL, env=_environ()) as process:
        wait_for(lambda: list((out / "checkpoints").glob("step-*")), 900, "the first checkpoint", process)
        process.send_signal(stop)
        process.wait(timeout=300)
    err = log.read_text()
    assert process.returncode == (130 if stop == signal.SIGINT else 143), err
    assert "Traceback" not in err, err
    assert "--resume`" in err and "the last checkpoint is step-" in err, err


def _holder(lock: Path) -> int | None:
    """The pid in a held lock file (None while there is none or it is being written)."""
    try:
        return json.loads(lock.read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def _environ() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def test_malformed_jsonl_line_on_the_command_line_is_skipped_and_counted(env, tmp_path, caplog):
    argv = run_convert(env, f"output_dir={tmp_path / 'run'}", "train.max_steps=1", "export=false")
    assert main([*argv, f"data.path={env / 'data' / 'one_bad_line.jsonl'}"]) == 0
    assert "skipped 1 malformed" in caplog.text


@pytest.fixture
def unreachable_hub(monkeypatch):
    """A hub endpoint that refuses every connection at once (nothing listens on port 9 of this machine)."""
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 1)
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 1)


def test_push_to_an_unreachable_hub_is_one_line_and_keeps_the_token(
    env, unreachable_hub, tmp_path, monkeypatch, capsys
):
    from fcsd.export.save import PARITY_RECORD

    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(EXPORT_IDENTITY))
    (folder / PARITY_RECORD).write_text("{}")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token")
    assert main(["push", str(folder), "me/x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot be reached" in err and len(err.splitlines()) == 1 and "hf_secret_token" not in err, err


def test_model_card_and_eval_table_name_local_bases_by_folder_and_ask_no_hub(tmp_path, monkeypatch):
    import huggingface_hub

    from fcsd.evaluate.report import format_table
    from fcsd.evaluate.suites import suite_from_tasks
    from fcsd.export.model_card import render_card

    asked = []
    monkeypatch.setattr(huggingface_hub.ModelCard, "load", lambda *args, **kwargs: asked.append(args))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "dsv2").mkdir(parents=True)
    for base in ("models/dsv2", str(tmp_path / "models" / "dsv2")):
        card = render_card({"layers": [1], "spec": "1"}, {"config": {"model": {"name": base}}}, 2)
        assert "base_model" not in card.split("---")[1] and str(tmp_path) not in card and "dsv2" in card
    assert asked == []
    table = format_table(
        {"original": {"Avg": 1.0}}, {"original": str(tmp_path / "models" / "dsv2")}, suite_from_tasks("x")
    )
    assert "original (dsv2)" in table and str(tmp_path) not in table


def test_eval_of_a_model_without_farskip_layers_says_so(env, monkeypatch, capsys):
    import fcsd.evaluate.harness as harness

    def stop(*args, **kwargs):
        raise ValueError("stopped before scoring")

    monkeypatch.setattr(harness, "evaluate_checkpoints", stop)
    assert main(["eval", str(env / "model"), "--tasks", "arc_easy"]) == 2
    assert "has no FarSkip layers" in capsys.readouterr().err


def test_apply_farskip_refuses_a_layer_with_its_own_forward():
    import types

    import fcsd
    from fcsd.connectivity.families import family_for_config, find_decoder_layers

    model = build("qwen3_moe")
    layer = find_decoder_layers(model, family_for_config(model.config))[2]
    layer.forward = types.MethodType(type(layer).forward, layer)  # what another patching tool leaves behind
    with pytest.raises(ValueError, match="own `forward` attribute"):
        fcsd.apply_farskip(model, "all")
    del layer.forward
    fcsd.apply_farskip(model, "all")
    layer.forward = types.MethodType(type(layer).forward, layer)
    assert 2 not in fcsd.farskip_layers(model)


def test_expected_library_messages_are_silenced_and_real_ones_kept(caplog, recwarn, tmp_path):
    import logging

    from fcsd.cli import build_parser, main
    from fcsd.distill.run_io import plot_curves

    assert "Thin:" not in build_parser().format_help()
    with pytest.raises(SystemExit):
        main(["--help"])
    other = logging.getLogger("accelerate.utils.other")
    with caplog.at_level(logging.WARNING):
        other.warning("Removed shared tensor {'lm_head.weight'} while saving. This should be OK")
        logging.getLogger("lm_eval.models.huggingface").warning("`pretrained` model kwarg is not of type `str`.")
        logging.getLogger("lm_eval.api.task").warning("demo: Custom kwargs can be passed to `--metadata` in console")
        other.warning("Removed shared tensor {'model.layers.0.mlp.weight'} while saving")
    assert [r.getMessage()[:21] for r in caplog.records] == ["Removed shared tensor"]
    records = [{"step": s, "train/loss": 0.0, "train/lr": 1e-3, **({"eval/kl": 0.0} if s == 2 else {})} for s in (1, 2)]
    plot_curves(records, tmp_path / "curves.png", "run")
    assert not [w for w in recwarn if "log-scaled" in str(w.message)]


def test_short_runs_evaluate_the_held_out_kl_along_the_way():
    base = ["model.name=m", "data.path=d", "train.warmup_steps=0"]
    assert to_config(compose([*base, "train.max_steps=50"])).train.eval_every == 5
    assert to_config(compose([*base, "train.max_steps=50", "train.eval_every=0"])).train.eval_every == 0
    assert to_config(compose([*base, "train.max_steps=100000"])).train.eval_every == 0


# -- one run per folder, resumes that check what they resume, nothing lost ---------------------------------


def test_one_command_per_folder(env, capsys):
    """A second command into a folder another one holds is refused, naming the holder; nothing is written."""
    from fcsd.files import ownership

    run = env / "runs" / "unfinished"
    before = snapshot(env)
    with ownership.folder_lock(run, "output_dir"), ownership.folder_lock(env / "runs" / "x", "output_dir"):
        assert main([*run_convert(env, f"output_dir={run}", "train.max_steps=9"), "--resume"]) == 2
        assert main(run_convert(env, f"output_dir={run}", "overwrite=true")) == 2
        assert main(["eval", str(env / "runs" / "x"), "--tasks", "arc_easy"]) == 2  # writes RUN/eval
        assert main(["export", str(env / "runs" / "y"), str(env / "runs" / "x" / "export2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(f"is in use by another fcsd command (pid {os.getpid()} on " in e for e in err), err
    assert snapshot(env) == before  # the lock file went with the lock


def test_the_next_holder_removes_staging_left_by_a_dead_run(env, tmp_path, capsys):
    """Staging folders of a dead run go; the only copy of final/ left between atomic_dir's two renames comes back;
    the user's own dotted files stay."""
    from fcsd.distill.preflight import output_dir_claimed

    run = tmp_path / "run"
    shutil.copytree(env / "runs" / "unfinished", run)
    (run / "checkpoints" / ".step-6.partial").mkdir()
    (run / "checkpoints" / ".step-6.partial" / "optimizer.bin").write_bytes(b"x" * 1000)
    (run / ".best.partial-k2j4ab_9").mkdir()
    (run / ".final.old-x7c0q2zz" / "final").mkdir(parents=True)
    (run / ".final.old-x7c0q2zz" / "final" / "config.json").write_text("{}")
    for mine in (".notes.old", ".plan.partial.md"):
        (run / mine).write_text("mine")
    overrides = [f"model.name={env / 'model'}", *run_convert(env, f"output_dir={run}")[2:]]
    config = to_config(compose([*overrides, "train.resume=true"]))
    with output_dir_claimed(config):
        assert (run / ".fcsd-lock").exists()
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2", "step-4"]
        assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == [
            ".fcsd-lock",
            ".fcsd-output",
            ".notes.old",
            ".plan.partial.md",
        ]
        assert (run / "final" / "config.json").read_text() == "{}"
    assert "moved back to final" in capsys.readouterr().out
    assert not (run / ".fcsd-lock").exists()


def _stop_after_checkpoint(monkeypatch, step: int):
    """Make the next run in this process stop (as Ctrl-C does) right after it saved checkpoint ``step``."""
    from fcsd.distill import trainer

    save = trainer.TrainingSession.save_checkpoint

    def save_then_stop(self, done):
        save(self, done)
        if done == step:
            raise KeyboardInterrupt

    monkeypatch.setattr(trainer.TrainingSession, "save_checkpoint", save_then_stop)


def test_resume_checks_its_inputs_and_the_checkpoint_files_and_says_how_to_go_on(env, tmp_path, monkeypatch, capsys):
    """A run stopped after step 3: --resume refuses, each by its own name, other weights of the same shapes, another
    tokenizer, another chat template (not "the training data changed", as once) and changed data (same
    paths, other content), and a checkpoint that lost a file, naming the newest complete one and the command; that
    command resumes, and the metrics hold each step once."""
    import shlex

    model, data = tmp_path / "model", tmp_path / "train.jsonl"
    shutil.copytree(env / "model", model)
    shutil.copyfile(env / "data" / "train.jsonl", data)
    out = tmp_path / "run"
    argv = run_convert(env, f"output_dir={out}", f"data.path={data}", "train.max_steps=4", "train.save_every=1")
    argv = [argv[0], str(model), *argv[2:], "train.keep_checkpoints=3", "export=false"]
    with monkeypatch.context() as patch:
        _stop_after_checkpoint(patch, 3)
        assert main(argv) == 130
    assert [p.name for p in (out / "checkpoints").iterdir()] and not (out / "final").exists()
    capsys.readouterr()
    before = snapshot(out)
    for name, edit in _input_edits(model, tmp_path):
        restore = edit()
        assert main([*argv, "--resume"]) == 2
        err = capsys.readouterr().err
        assert f"--resume: {name} changed since checkpoints/step-3 was saved" in err, err
        restore()
    assert snapshot(out) == before
    original = data.read_text()
    data.write_text(original.replace("add 7 and 8", "add 70 and 80"))
    before = snapshot(out)
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--resume: the training data changed since checkpoints/step-3 was saved" in err, err
    assert snapshot(out) == before
    data.write_text(original)
    (out / "checkpoints" / "step-3" / "random_states_0.pkl").unlink()
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "checkpoints/step-3 is incomplete (random_states_0.pkl missing); continue from step-2: `fcsd" in err, err
    command = shlex.split(err.split("`")[1])
    assert command[-2:] == ["--resume", "train.resume_step=2"]
    assert main(command[1:]) == 0
    printed = capsys.readouterr().out
    assert "resuming from" in printed and "set aside the later checkpoints step-3" in printed
    abandoned = out / "checkpoints" / "abandoned-step-3"  # kept, never resumed from or pruned into the new ones
    assert abandoned.is_dir() and not (abandoned / "random_states_0.pkl").exists()
    steps = [r["step"] for r in RunFolder(out).records() if "train/loss" in r]
    assert steps == [1, 2, 3, 4]
    assert json.loads((out / "final" / "fcsd_checkpoint.json").read_text())["step"] == 4


def test_a_restarted_run_logs_each_step_once(env, tmp_path):
    """A run folder whose run never saved a checkpoint, resumed: it starts at step 0 and its metrics say so once."""
    out = tmp_path / "run"
    shutil.copytree(env / "runs" / "unfinished", out)
    shutil.rmtree(out / "checkpoints")
    old = "".join(json.dumps({"step": s, "train/loss": 9.0}) + "\n" for s in range(1, 6))
    (out / "metrics.jsonl").write_text(old + '{"step": 6, "train/lo')  # the last line cut by a kill
    argv = run_convert(env, f"output_dir={out}", "train.max_steps=2", "export=false")
    assert main([*argv, "--resume"]) == 0
    steps = [r["step"] for r in RunFolder(out).records() if "train/loss" in r]
    assert steps == [1, 2] and all(r["train/loss"] != 9.0 for r in RunFolder(out).records() if "train/loss" in r)


def test_a_bf16_checkpoint_gives_a_bf16_final_and_export(env, tmp_path):
    from safetensors import safe_open

    import fcsd

    source = tmp_path / "bf16"
    fcsd.from_pretrained(str(env / "model"), dtype=torch.bfloat16).save_pretrained(source)
    for path in (env / "model").iterdir():
        if path.name.startswith(("tokenizer", "chat_template")):
            shutil.copyfile(path, source / path.name)
    out = tmp_path / "run"
    assert main(run_convert(env, f"output_dir={out}", "train.max_steps=1", model=str(source))) == 0
    for folder in (out / "final", out / "export"):
        assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16", folder
        with safe_open(str(folder / "model.safetensors"), "pt") as weights:
            assert {weights.get_slice(k).get_dtype() for k in weights.keys()} == {"BF16"}, folder
    assert "stored in `bfloat16`" in (out / "export" / "README.md").read_text()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stopped_sweep_leaves_no_process_writing_and_no_traceback(env, tmp_path, stop):
    """Ctrl-C or SIGTERM to `fcsd sweep` reaches the training run it launched: the run stops (its lock is gone, its
    process too) before the sweep exits; one line, no traceback."""
    out = tmp_path / "sweep"
    argv = [sys.executable, "-m", "fcsd.cli", "sweep", *run_convert(env, f"output_dir={out}")[1:]]
    argv += ["sweep.steps=100000", "sweep.batch_tokens=[64]", "sweep.lrs=[0.001]", "sweep.stage1_lr=0.001"]
    lock = out / "sweep" / "stage1" / "bt64-lr0.001" / ".fcsd-lock"
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr, started(argv, stderr=stderr, stdout=subprocess.DEVNULL, env=_environ()) as process:
        wait_for(lambda: lock.with_name(CONFIG).exists() and _holder(lock), 900, "the sweep's first run", process)
        holder = _holder(lock)
        process.send_signal(stop)
        process.wait(timeout=300)
    err = log.read_text()
    assert process.returncode == (130 if stop == signal.SIGINT else 143), err
    assert "Traceback" not in err and "fcsd sweep: " in err.strip().splitlines()[-1], err
    assert not lock.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(holder, 0)


def test_a_full_disk_is_one_line_naming_the_folder_and_the_last_export_stays(env, tmp_path, monkeypatch, capsys):
    import errno

    import fcsd

    converted = tmp_path / "converted"
    fcsd.from_pretrained(str(env / "model"), layers="all").save_pretrained(converted)
    for path in (env / "model").iterdir():
        if path.name.startswith(("tokenizer", "chat_template")):
            shutil.copyfile(path, converted / path.name)
    out = tmp_path / "export"
    assert main(["export", str(converted), str(out)]) == 0
    before = snapshot(tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full)
    capsys.readouterr()
    assert main(["export", str(converted), str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.splitlines()[-1].startswith("fcsd export: error: no space left"), err
    assert f"no space left on the disk of {tmp_path}: free space there" in err, err
    assert snapshot(tmp_path) == before  # no staging folder left, the export as it was


def test_lines_that_are_not_utf8_are_skipped_naming_file_and_line(tmp_path, caplog):
    from fcsd.distill.data import load_texts

    good = b'{"text": "hello there"}'
    (tmp_path / "mixed.jsonl").write_bytes(b"\n".join([good, b'{"text": "caf\xe9"}', good, good]) + b"\n")
    rows = load_texts(str(tmp_path / "mixed.jsonl"))
    assert rows.skipped == 1 and len(rows.texts) == 3
    assert "mixed.jsonl: skipped 1 line(s) that are not UTF-8 or not a JSON object: line 2" in caplog.text


def test_paths_survive_the_override_parser_and_tilde_is_expanded_once(env, tmp_path, capsys):
    from fcsd.distill.config import hydra_override

    odd = tmp_path / "modèle, v=2 it's"
    shutil.copytree(env / "model", odd)
    assert main(["convert", str(odd), f"data.path={env / 'data/train.jsonl'}", "--cfg", "job"]) == 0
    import yaml

    assert yaml.safe_load(capsys.readouterr().out)["model"]["name"] == str(odd)
    config = to_config(compose(["model.name=m", "data.path=d", hydra_override("output_dir", "~/runs/x")]))
    assert config.output_dir == str(env / "home" / "runs" / "x")  # HOME is the fake home of `env`


def test_run_child_passes_sigterm_on_and_waits(tmp_path):
    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    script = (
        "import sys\nfrom fcsd.stopping import run_child\n"
        f"try:\n    run_child([sys.executable, '-c', {child!r}])\nexcept KeyboardInterrupt:\n    sys.exit(130)\n"
    )
    with started([sys.executable, "-c", script], env=_environ()) as parent:
        wait_for(lambda: pid_file.exists() and pid_file.read_text(), 300, "the child's start", parent)
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=120) == 130
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_perfmodel_default_sparsities_fit_the_model(env, capsys):
    assert main(["perfmodel", "--model", str(env / "model"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert sorted({r["sparsity"] for r in rows}) == [4, 8, 16, 32]  # 8 experts top-2: its own 4x and 3 doublings


def test_a_teacher_cache_rebuild_refuses_a_cache_that_holds_other_files(env):
    from fcsd.distill.teacher_cache import build_cache

    before = snapshot(env / "a_cache")
    with pytest.raises(ValueError, match=r"a_cache also holds files fcsd did not write \(notes.txt\)"):
        build_cache(None, None, env / "a_cache", {"format": 1}, overwrite=True)
    assert snapshot(env / "a_cache") == before


# -- exports are folders of their own, conversions convert, resumes check their inputs, stops stop ------


def converted_checkpoint(env, folder: Path, seed: int) -> Path:
    """A converted checkpoint of the world's model whose weights are shifted by ``seed`` (two of them differ)."""
    import fcsd

    model = fcsd.from_pretrained(str(env / "model"), layers="all")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01 * seed)
    model.save_pretrained(folder)
    for path in (env / "model").iterdir():
        if path.name.startswith(("tokenizer", "chat_template")):
            shutil.copyfile(path, folder / path.name)
    return folder


def weights_of(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_two_exports_started_together_into_one_folder_one_wins_the_other_is_refused(env, tmp_path):
    """Case 1: `fcsd export A OUT` and `fcsd export B OUT` at once, no --overwrite: exactly one writes OUT (the other
    is refused, whichever order the lock and the rename come in) and OUT holds the winner's weights."""
    sources = [converted_checkpoint(env, tmp_path / name, seed) for seed, name in ((1, "a"), (2, "b"))]
    out = tmp_path / "out"
    argv = [[sys.executable, "-m", "fcsd.cli", "export", str(source), str(out)] for source in sources]
    logs = [tmp_path / f"err-{i}.txt" for i in range(2)]
    with logs[0].open("w") as first, logs[1].open("w") as second:
        with started(argv[0], stderr=first, stdout=subprocess.DEVNULL, env=_environ()) as a:
            with started(argv[1], stderr=second, stdout=subprocess.DEVNULL, env=_environ()) as b:
                codes = [a.wait(timeout=900), b.wait(timeout=900)]
    assert sorted(codes) == [0, 2], [log.read_text() for log in logs]
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    refusal = logs[loser].read_text().strip().splitlines()[-1]
    assert "in use by another fcsd command" in refusal or "holds an export; pass --overwrite" in refusal, refusal
    exported = weights_of(out)
    source = weights_of(sources[winner])
    assert all(torch.equal(exported[name].float(), source[name].float()) for name in source)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no staging left


def _during_staging(monkeypatch, action):
    """Run ``action`` while an export stages (at its reload-parity check, before the final rename)."""
    from fcsd.export import save

    check = save.check_parity

    def check_then_act(model, folder):
        difference = check(model, folder)
        action()
        return difference

    monkeypatch.setattr(save, "check_parity", check_then_act)


def test_a_folder_a_user_makes_while_the_export_stages_is_kept(env, tmp_path, monkeypatch, capsys):
    """Case 2: OUT/ created and given a file while the export is staging: the export is refused at its rename and
    the user's file stays; no staging folder is left."""
    source = converted_checkpoint(env, tmp_path / "a", 1)
    out = tmp_path / "out"

    def user_writes():
        out.mkdir()
        (out / "mine.txt").write_text("mine")

    _during_staging(monkeypatch, user_writes)
    assert main(["export", str(source), str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds files fcsd did not write" in err.strip().splitlines()[-1] and "Traceback" not in err, err
    assert (out / "mine.txt").read_text() == "mine" and sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "out"]


def test_an_export_another_command_finished_meanwhile_is_not_replaced_without_overwrite(
    env, tmp_path, monkeypatch, capsys
):
    """Case 1, the other order: B's export lands in OUT while A stages; A (no --overwrite) is refused at its rename
    and B's export stays as it was."""
    first, second = converted_checkpoint(env, tmp_path / "a", 1), converted_checkpoint(env, tmp_path / "b", 2)
    out, other = tmp_path / "out", tmp_path / "other"
    assert main(["export", str(second), str(other)]) == 0
    _during_staging(monkeypatch, lambda: shutil.copytree(other, out))
    before = snapshot(out) if out.exists() else None
    assert main(["export", str(first), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "now holds an export that another command wrote while this one was staging; nothing was replaced" in err
    assert before is None and snapshot(out) == snapshot(other)


def test_the_only_copy_a_killed_export_left_aside_comes_back_before_anything_is_decided(env, tmp_path, capsys):
    """An export killed between its two renames leaves the only copy of OUT in `.OUT.old-*/OUT`: the next export into
    OUT moves it back under the lock first, then refuses to replace it without --overwrite (it is an export)."""
    source = converted_checkpoint(env, tmp_path / "a", 1)
    out = tmp_path / "out"
    assert main(["export", str(source), str(out)]) == 0
    before = snapshot(out)
    aside = tmp_path / ".out.old-k2j4ab9z"
    aside.mkdir()
    out.rename(aside / "out")
    (tmp_path / ".out.partial-x7c0q2zz").mkdir()  # and a half-staged one
    capsys.readouterr()
    assert main(["export", str(source), str(out)]) == 2
    assert "holds an export; pass --overwrite to replace it" in capsys.readouterr().err
    assert snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["a", "out"]


def test_zero_layer_conversion_is_refused_before_loading(env, monkeypatch, capsys):
    """Case 4: nothing loads and nothing trains when the spec converts no layer of the model."""
    import fcsd.loading

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(fcsd.loading, "from_pretrained", no_loading)
    assert main(run_convert(env, "farskip.layers=last:1%", f"output_dir={env / 'new'}")) == 2
    assert "last:13%" in capsys.readouterr().err
    assert not (env / "new").exists()


def _input_edits(model: Path, tmp_path: Path):
    """(how a refusal names it, an edit of ``model`` that returns its undo) for each model input a resume checks."""

    def rewrite(path: Path, content: bytes):
        def edit():
            original = path.read_bytes()
            path.write_bytes(content)
            return lambda: path.write_bytes(original)

        return edit

    build("qwen3_moe", seed=7).save_pretrained(tmp_path / "other")  # same shapes, other values
    weights = fcsd_weights_resized(tmp_path / "other", model)
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]  # two tokens swap their ids: same size, another vocabulary
    first, second = list(vocab)[-2:]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    vocabulary = json.dumps(tokenizer).encode()
    template = (model / "chat_template.jinja").read_text().replace("<|end|>", "\n<|end|>", 1)  # renders otherwise
    return [
        ("the model's weights", rewrite(model / "model.safetensors", weights)),
        ("the tokenizer (its vocabulary or special tokens)", rewrite(model / "tokenizer.json", vocabulary)),
        ("the chat template (how chats are rendered into training text)",
         rewrite(model / "chat_template.jinja", template.encode())),
    ]  # fmt: skip


def fcsd_weights_resized(folder: Path, like: Path) -> bytes:
    """The weights of ``folder`` saved with the shapes of ``like``'s (the world's model has a resized vocabulary)."""
    from safetensors.torch import load_file, save_file

    mine, theirs = load_file(str(folder / "model.safetensors")), load_file(str(like / "model.safetensors"))
    resized = {}
    for name, tensor in theirs.items():
        source = mine.get(name)
        resized[name] = torch.randn_like(tensor) if source is None or source.shape != tensor.shape else source
    save_file(resized, str(folder / "resized.safetensors"), metadata={"format": "pt"})
    return (folder / "resized.safetensors").read_bytes()


def test_resume_accepts_the_same_data_file_by_another_spelling_of_its_path(env):
    """A run started with an absolute data path resumes with the relative one (cwd: the world's work folder)."""
    from fcsd.distill.resume import check_resume

    config = to_config(compose([*run_convert(env, f"output_dir={env / 'runs/unfinished'}")[2:],
                                f"model.name={env / 'model'}", "data.path=../data/train.jsonl",
                                "train.resume=true"]))  # fmt: skip
    check_resume(RunFolder(env / "runs/unfinished"), config)  # no "different run"


def test_small_data_holds_out_at_most_a_fifth_and_says_so(env, caplog):
    """Case 9: data.eval_sequences above a fifth of the packed sequences holds out a fifth, with a note."""
    from fcsd.distill.run_data import load_run_data
    from fcsd.distill.student_teacher import load_tokenizer

    config = to_config(compose([*run_convert(env, "data.eval_sequences=1000")[2:], f"model.name={env / 'model'}"]))
    train, held, _ = load_run_data(config, load_tokenizer(config))
    assert 1 <= len(held) <= (len(train) + len(held)) // 5 and len(train) >= 4 * len(held)
    assert f"data.eval_sequences=1000: {config.data.path} packs into {len(train) + len(held)} sequences" in caplog.text


def test_the_held_out_rows_of_an_eval_file_do_not_change_with_the_seed(env):
    """Runs of two seeds train in two orders and are scored on the same held-out rows of data.eval_path (the
    file's documents were packed in the seed's order, so another seed scored other windows)."""
    from fcsd.distill.run_data import load_run_data
    from fcsd.distill.student_teacher import load_tokenizer

    loaded = []
    for seed in (0, 1):
        overrides = [f"data.eval_path={env / 'data/train.jsonl'}", "data.eval_sequences=4", f"train.seed={seed}"]
        config = to_config(compose([*run_convert(env, *overrides)[2:], f"model.name={env / 'model'}"]))
        loaded.append(load_run_data(config, load_tokenizer(config)))
    (train0, held0, _), (train1, held1, _) = loaded
    assert torch.equal(held0.input_ids, held1.input_ids) and torch.equal(held0.position_ids, held1.position_ids)
    assert not torch.equal(train0.input_ids, train1.input_ids)  # the seed still orders the training documents


def test_skipped_rows_are_counted_once(tmp_path, caplog):
    from fcsd.distill.data import load_texts

    good = [json.dumps({"text": f"row {i}"}) for i in range(60)]
    empty = [json.dumps({"text": ""})] * 3
    (tmp_path / "d.jsonl").write_text("\n".join(good + empty) + "\n")
    rows = load_texts(str(tmp_path / "d.jsonl"))
    assert rows.skipped == 3 and len(rows.texts) == 60
    assert "skipped 3 malformed or empty rows of 63" in caplog.text


def test_a_literal_tilde_path_is_the_home_folder(env, capsys):
    """`output_dir=~/x` as the shell passes it when quoted: a path in the home folder, not a parse error."""
    assert main(["convert", str(env / "model"), f"data.path={env / 'data/train.jsonl'}", "output_dir=~/x", "--cfg",
                 "job"]) == 0  # fmt: skip
    from fcsd.cli import build_parser
    from fcsd.cli.runs import run_config

    args = build_parser().parse_args(["convert", str(env / "model"), "data.path=d", "output_dir=~/x"])
    args.resume = False
    assert to_config(run_config(args)).output_dir == str(env / "home" / "x")


def test_a_corrupt_routes_file_gets_advice_that_works(env, tmp_path, capsys):
    (tmp_path / "bad.routes").write_text("not routes")
    assert main(["routes", "stats", str(tmp_path / "bad.routes")]) == 2
    err = capsys.readouterr().err
    assert "record the routes again into a new file: `fcsd routes record MODEL --out NEW.routes`" in err, err
    argv = ["routes", "record", str(env / "model"), "--data", str(env / "data/train.jsonl")]
    assert main([*argv, "--out", str(tmp_path / "bad.routes")]) == 2  # fcsd never overwrites what it cannot read
    assert main([*argv, "--out", str(tmp_path / "new.routes"), "--tokens", "64", "--seq-len", "16"]) == 0


def _handles_sigterm(pid: int) -> bool:
    """Whether process ``pid`` catches SIGTERM: fcsd's command line installs its handlers first thing (Python itself
    does not catch SIGTERM), so from then on a stop is fcsd's to report."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught, 16) & (1 << (signal.SIGTERM - 1)))


@pytest.mark.parametrize("delay", [0.0, 1.0, 3.0], ids=["at-start", "importing", "loading"])
def test_ctrl_c_at_any_moment_of_startup_is_one_line_and_130(env, tmp_path, delay):
    """Ctrl-C while fcsd imports or loads (not only while it trains): one line, exit 130, never a traceback. (Before
    fcsd's first line runs, the interpreter's own start is Python's: the test starts once the handlers are in.)"""
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "fcsd.cli", *run_convert(env, f"output_dir={out}", "train.max_steps=100000")]
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr, started(argv, stderr=stderr, stdout=subprocess.DEVNULL, env=_environ()) as process:
        wait_for(lambda: _handles_sigterm(process.pid), 300, "fcsd's signal handlers", process, poll=0.01)
        time.sleep(delay)  # a moment, not a state to wait for: each must end the same way
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=300) == 130, log.read_text()
    lines = log.read_text().strip().splitlines()
    assert lines and lines[-1].startswith("fcsd convert: interrupted") and "Traceback" not in log.read_text(), lines
    assert not [line for line in lines if "Error" in line], lines


def test_a_stop_inside_a_deferred_import_is_raised_once_it_is_complete():
    """What keeps Ctrl-C while torch imports one line: an interrupted ``torch.distributed`` import cannot be imported
    again (it aborts the process), so fcsd imports it with stops deferred to the end of the import."""
    from fcsd import stopping

    previous = stopping.install()
    reached = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with stopping.deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler has run by now: it must not have raised here
                reached.append("end of the block")
        assert reached == ["end of the block"] and stopping.received() == signal.SIGINT
    finally:
        stopping.restore(previous)


def test_sigterm_to_bench_overlap_ends_every_rank(tmp_path):
    """Case 13: the benchmark's rank processes end with the command (they lived on before, re-parented to init)."""
    import psutil

    argv = [sys.executable, "-m", "fcsd.cli", "bench", "overlap", "--config", "tiny", "--ranks", "2"]
    argv += ["--iters", "100000"]
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr, started(argv, stderr=stderr, stdout=subprocess.DEVNULL, env=_environ()) as process:

        def ranks():
            try:
                children = psutil.Process(process.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                return []
            commands = {p: " ".join(p.cmdline()) for p in children}  # the ranks, not torchrun that names them
            return [p for p, c in commands.items() if "fcsd.bench.overlap" in c and "torch.distributed.run" not in c]

        wait_for(lambda: len(ranks()) == 2, 900, "the benchmark's two ranks", process)
        workers = ranks()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=300) == 143
        _, alive = psutil.wait_procs(workers, timeout=120)
        assert not alive, [p.pid for p in alive]
    assert log.read_text().strip().splitlines()[-1] == "fcsd bench: terminated (SIGTERM)"


def test_stop_tree_ends_a_grandchild_in_a_session_of_its_own(tmp_path):
    """The tests' own guard (tests/processes.py): what a started process started in another session goes too."""
    from processes import stop_tree

    pid_file = tmp_path / "grandchild.pid"
    grandchild = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    script = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {grandchild!r}], start_new_session=True); time.sleep(600)"  # noqa: E501
    process = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    wait_for(lambda: pid_file.exists() and pid_file.read_text(), 300, "the grandchild's start", process)
    stop_tree(process, grace=5)
    import psutil

    wait_for(lambda: not psutil.pid_exists(int(pid_file.read_text())), 60, "the grandchild's end")


# -- the second hostile probe: new variants of the same families --------------------------------------


def test_an_export_into_a_folder_a_run_has_claimed_is_refused_and_the_run_keeps_its_lock(env, tmp_path, capsys):
    """A run locks its folder from inside (`OUT/.fcsd-lock`) and marks it only once its inputs loaded; an export
    locks beside its target. An export into a folder a run had claimed but not yet marked used to replace it (the
    run's lock file went with it, and the run failed later at its marker); now it is refused naming the holder."""
    source = converted_checkpoint(env, tmp_path / "a", 1)
    out = tmp_path / "out"
    ready = tmp_path / "claimed"
    holder = (
        "import sys, pathlib; from fcsd.files import ownership\n"
        f"with ownership.folder_lock(pathlib.Path({str(out)!r}), 'output_dir'):\n"
        f"    pathlib.Path({str(ready)!r}).write_text('1'); sys.stdin.read()\n"
    )  # what `fcsd convert` holds while it loads the data and the models
    with started([sys.executable, "-c", holder], stdin=subprocess.PIPE, env=_environ()) as run:
        wait_for(ready.exists, 300, "the run's claim of its folder", run)
        lock = (out / ".fcsd-lock").read_text()
        assert main(["export", str(source), str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "is in use by another fcsd command (pid" in err and "Traceback" not in err, err
        assert sorted(p.name for p in out.iterdir()) == [".fcsd-lock"] and (out / ".fcsd-lock").read_text() == lock
        run.stdin.close()
        assert run.wait(timeout=300) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "claimed"]  # the run's empty claim went with it


def test_an_export_into_another_runs_export_folder_is_refused_even_with_overwrite(env, tmp_path, capsys):
    """`fcsd export RUN_A RUN_B/export --overwrite` replaced run B's export with run A's weights, which `fcsd eval
    RUN_B` and `fcsd push` then took for B's; now it is refused in one line and B's export is untouched."""
    from fcsd.files import ownership

    source = converted_checkpoint(env, tmp_path / "a", 1)
    other = tmp_path / "run-b"
    (other / "export").mkdir(parents=True)
    ownership.mark(other, "run")
    (other / "export" / "model.safetensors").write_text("run b's weights")
    assert main(["export", str(source), str(other / "export"), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"is the export of the run in {other}" in err and "Traceback" not in err, err
    assert (other / "export" / "model.safetensors").read_text() == "run b's weights"


def test_a_runs_checkpoint_named_relatively_still_exports_to_the_runs_own_export(env, tmp_path, monkeypatch):
    """The refusal of another run's ``export/`` resolves the source first: ``fcsd export . ../export`` from inside a
    run's ``final/`` is that run's own export."""
    from fcsd.files import ownership

    run = tmp_path / "run"
    converted_checkpoint(env, run / "final", 1)
    ownership.mark(run, "run")
    monkeypatch.chdir(run / "final")
    assert main(["export", ".", "../export"]) == 0
    assert (run / "export" / "config.json").exists()


def test_ranks_of_a_killed_torchrun_stop_and_name_the_torchrun_command_that_resumes(env, tmp_path):
    """`kill -9` of torchrun's agent during a `parallel.ep_size=2` run: its ranks stop (they trained on alone, holding
    the run's lock, re-parented to init) and the resume command they print starts as many processes."""
    import psutil
    from launch import free_port

    out = tmp_path / "run"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    argv += ["-m", "fcsd.cli", *run_convert(env, f"output_dir={out}", "train.max_steps=100000", "parallel.ep_size=2")]
    argv += ["train.save_every=1", "export=false"]
    log = tmp_path / "stderr.txt"
    environ = {**_environ(), "OMP_NUM_THREADS": "1"}
    with log.open("w") as stderr, started(argv, stderr=stderr, stdout=subprocess.DEVNULL, env=environ) as agent:
        wait_for(lambda: list((out / "checkpoints").glob("step-*")), 900, "the first checkpoint", agent)
        ranks = psutil.Process(agent.pid).children()
        assert len(ranks) == 2, ranks
        agent.kill()
        agent.wait(timeout=60)
        _, alive = psutil.wait_procs(ranks, timeout=300)
        assert not alive, [p.pid for p in alive]
    err = log.read_text()
    assert "fcsd convert: terminated (SIGTERM)" in err, err
    assert "continue with `fcsd launch torchrun --nproc_per_node 2 -m fcsd.cli convert" in err, err
    assert not (out / ".fcsd-lock").exists()  # released by the rank that held it


def test_an_export_edited_to_run_layers_with_stock_wiring_is_refused_wherever_it_loads(env, tmp_path, capsys):
    """Exports edited by hand, new variants: layers dropped from `farskip.layers`, the stock class put before the
    FarSkip one in `architectures` (vLLM builds the first class it knows), every FarSkip field set back to stock.
    Each loaded (or would serve) with stock wiring; now `fcsd.from_pretrained`, `fcsd push` and the vLLM plugin's
    check refuse each in one line naming the field, and the shipped remote code refuses dropped layers."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    import fcsd
    from fcsd.serving.identity import IdentityError
    from fcsd.serving.vllm.guard import FarSkipServingError, check_served_config

    out = tmp_path / "out"
    assert main(["export", str(converted_checkpoint(env, tmp_path / "a", 1)), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    stock = {k: v for k, v in config.items() if k not in ("farskip", "auto_map")}
    edits = {
        "layers_dropped": ({**config, "farskip": {**config["farskip"], "layers": [0]}}, "`farskip.layers` is [0]"),
        "stock_class_first": (
            {**config, "architectures": ["Qwen3MoeForCausalLM", *config["architectures"]]},
            "names ['Qwen3MoeForCausalLM'] beside the FarSkip class",
        ),
        "all_stock": (
            {**stock, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]},
            "say a stock model, but fcsd_export.json beside it records the export of FarSkip layers [0, 1, 2, 3]",
        ),
    }
    for name, (values, message) in edits.items():
        folder = tmp_path / name
        shutil.copytree(out, folder)
        (folder / "config.json").write_text(json.dumps(values))
        with pytest.raises(IdentityError, match=message.replace("[", r"\[").replace("]", r"\]")):
            fcsd.from_pretrained(str(folder))
        capsys.readouterr()
        assert main(["push", str(folder), "me/model", "--dry-run"]) == 2
        assert message in capsys.readouterr().err, name
        with pytest.raises(FarSkipServingError, match="export it again"):
            check_served_config(SimpleNamespace(to_dict=lambda values=values: values), str(folder))
    with pytest.raises(ValueError, match=r"lists FarSkip layers \[0\] but fcsd_export.json beside it records"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "layers_dropped", trust_remote_code=True)  # without fcsd
    check_served_config(SimpleNamespace(to_dict=lambda: config), str(out))  # the export as written is served
    assert sorted(fcsd.from_pretrained(str(out)).config.farskip["layers"]) == [0, 1, 2, 3]


def test_a_path_that_cannot_be_a_folder_is_one_line(env, tmp_path, capsys):
    """A symbolic link that leads back to itself (a traceback from `Path.resolve` in every command before) and a file
    where a folder, or a folder on the way to one, is needed (errno text without the fix before)."""
    loop, a_file, dangling = tmp_path / "loop", tmp_path / "file", tmp_path / "dangling"
    loop.symlink_to(loop)
    dangling.symlink_to(tmp_path / "nothing")
    a_file.write_text("mine")
    run = str(env / "runs" / "x")
    cases = [
        (["export", run, str(loop)], "a symbolic link on this path leads back to itself; remove it or choose"),
        (run_convert(env, f"output_dir={loop}/sub"), "a symbolic link on this path leads back to itself"),
        (run_convert(env, f"output_dir={a_file}/sub"), "a part of this path is a file, not a folder; choose"),
        (["export", run, f"{a_file}/sub"], f"{a_file} is a file where a folder is needed; choose another path"),
        (run_convert(env, f"output_dir={dangling}"), f"{dangling} is a symbolic link to nothing; remove it or choose"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert a_file.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "file", "loop"]


def test_what_fcsd_itself_leaves_in_a_runs_folders_is_no_users_file(tmp_path):
    """A checkpoint set aside by train.resume_step, a step checkpoint written before its trainer state listed its
    files and a record whose list is not a table are fcsd's own: overwrite=true was refused over them (and a null
    list was a traceback); a user's file beside them is still named."""
    run = RunFolder(tmp_path / "run")
    for name, state in (("abandoned-step-4", {"files": {"model.safetensors": 1}}), ("step-2", {"step": 2})):
        (run.checkpoints_dir / name).mkdir(parents=True)
        (run.checkpoints_dir / name / "model.safetensors").write_bytes(b"x")
        (run.checkpoints_dir / name / "trainer_state.json").write_text(json.dumps(state))
    (run.checkpoints_dir / "step-3").mkdir()
    (run.checkpoints_dir / "step-3" / "trainer_state.json").write_text(json.dumps({"files": None}))
    assert run.foreign_files() == []
    (run.checkpoints_dir / "abandoned-step-4" / "notes.txt").write_text("mine")
    assert run.foreign_files() == ["checkpoints/abandoned-step-4/notes.txt"]


def test_checkpoint_rotation_keeps_a_checkpoint_that_holds_a_users_file(tmp_path, capsys):
    """The rotation of step checkpoints removed an old one whole, a user's notes in it included: it is kept now."""
    run = RunFolder(tmp_path / "run")
    for step in (1, 2, 3):
        (run.checkpoints_dir / f"step-{step}").mkdir(parents=True)
        (run.checkpoints_dir / f"step-{step}" / "trainer_state.json").write_text(json.dumps({"files": {}}))
    (run.checkpoints_dir / "step-1" / "notes.txt").write_text("mine")
    run.prune_checkpoints(1)
    assert [p.name for p in run.checkpoints()] == ["step-1", "step-3"]
    assert f"kept {run.checkpoints_dir / 'step-1'}: it also holds files the run did not write (notes.txt)" in (
        capsys.readouterr().out
    )


def test_a_resume_of_a_moved_project_compares_the_models_content_not_its_old_path(tmp_path):
    """A run records its model and data as absolute paths: moved to another folder, they are gone, and the resume
    takes the new path (the content is fingerprinted and compared once read); a path that still exists elsewhere,
    or another setting, is still a different run."""
    from fcsd.distill.resume import _same_setting

    (tmp_path / "model").mkdir()
    gone, here = str(tmp_path / "old" / "model"), str(tmp_path / "model")
    assert _same_setting("model.name", gone, here) and _same_setting("data.path", gone, here)
    assert not _same_setting("data.eval_path", gone, here)  # not fingerprinted: a path that changed is refused
    (tmp_path / "other").mkdir()
    assert not _same_setting("model.name", str(tmp_path / "other"), here)


@pytest.mark.parametrize(
    "code, message",
    [
        ("EROFS", " is on a read-only file system; choose a folder you can write to"),
        ("EACCES", ": permission denied; fix its permissions or choose another path"),
        ("EPERM", ": permission denied (Operation not permitted); fix its permissions or choose another path"),
    ],
)
def test_a_folder_that_cannot_be_written_is_one_line_naming_it(env, tmp_path, monkeypatch, capsys, code, message):
    """A read-only file system or a folder without write permission (root passes permission checks, so the error is
    raised where fcsd makes its staging folder) is one line naming the folder and the fix, not errno text."""
    import errno
    import tempfile

    import fcsd

    converted = tmp_path / "converted"
    fcsd.from_pretrained(str(env / "model"), layers="all").save_pretrained(converted)
    for path in (env / "model").iterdir():
        if path.name.startswith(("tokenizer", "chat_template")):
            shutil.copyfile(path, converted / path.name)

    def refused(*args, dir=None, **kwargs):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)), str(dir))

    monkeypatch.setattr(tempfile, "mkdtemp", refused)
    assert main(["export", str(converted), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()  # after the progress bars of the model's loading
    assert "Traceback" not in err and f"{tmp_path}{message}" in err.splitlines()[-1], err


def test_a_run_stopped_while_it_writes_final_or_its_export_resumes_or_says_how_to_export(env, tmp_path, monkeypatch):
    """Stopped while `final/` was written, a run looked finished (its summary came first) and could neither resume
    nor be used (no final/, and the last steps in no checkpoint); now `--resume` redoes the end. Stopped while it
    exported, the refusal of `--resume` names the command that writes the missing export/."""
    import fcsd.distill.trainer as trainer
    from fcsd.export import save
    from fcsd.files.ownership import FolderError

    out = tmp_path / "run"
    argv = run_convert(env, f"output_dir={out}", "train.max_steps=3", "train.save_every=1")
    save_model = trainer.save_model

    def stopped_at_final(model, state_dict, tokenizer, config, folder, *args, **kwargs):
        if Path(folder).name == "final":
            raise KeyboardInterrupt
        return save_model(model, state_dict, tokenizer, config, folder, *args, **kwargs)

    monkeypatch.setattr(trainer, "save_model", stopped_at_final)
    assert main(argv) == 130 and not (out / "final").exists()
    monkeypatch.setattr(trainer, "save_model", save_model)

    def stopped_exporting(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(save, "export_checkpoint", stopped_exporting)
    assert main([*argv, "--resume"]) == 130
    assert (out / "final").is_dir() and json.loads((out / "run_summary.json").read_text())["steps"] == 3
    monkeypatch.undo()
    with pytest.raises(FolderError) as refused:
        check_resume_of(out, argv)
    assert f"its export/ is missing (stopped while exporting?): `fcsd export {out} {out / 'export'}`" in str(
        refused.value
    )
    assert main(["export", str(out), str(out / "export")]) == 0


def check_resume_of(out: Path, argv: list[str]) -> None:
    from fcsd.distill.resume import check_resume

    config = to_config(compose([*argv[2:], f"model.name={argv[1]}", "train.resume=true"]))
    check_resume(RunFolder(out), config)


def test_a_config_that_asks_for_weights_the_files_lack_is_refused(env, tmp_path, capsys):
    """A config.json edited so that some layers need weights the files do not hold (dense MLPs where the checkpoint
    has experts): transformers started them from random values with only a load report, and the teacher (or an
    export) silently was another model; now every fcsd load refuses it in one line naming the weights."""
    import fcsd

    message = "weights its config.json asks for are not in its weight files (model.layers.0.mlp.down_proj.weight"
    assert_edited_config_refused(env, tmp_path, capsys, {"mlp_only_layers": [0, 1, 2, 3]}, message)
    assert fcsd.from_pretrained(str(env / "model")) is not None  # the checkpoint as it was loads


def assert_edited_config_refused(env, tmp_path, capsys, changes: dict, message: str) -> None:
    """The checkpoint with ``changes`` in its config.json is refused by ``fcsd.from_pretrained`` and, in one last
    line, by ``fcsd convert`` (rc 2, no run folder), with ``message``."""
    import fcsd

    edited = shutil.copytree(env / "model", tmp_path / "edited")
    values = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**values, **changes}))
    with pytest.raises(ValueError, match=re.escape(message)):
        fcsd.from_pretrained(str(edited))
    capsys.readouterr()
    assert main(run_convert(env, f"output_dir={tmp_path / 'run'}", model=str(edited))) == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("method", ["gptq", "bitsandbytes", "awq", "compressed-tensors"])
def test_a_checkpoint_quantized_with_a_method_fcsd_cannot_train_from_is_refused_in_one_line(
    env, tmp_path, capsys, method
):
    """A GPTQ / bitsandbytes / AWQ / compressed-tensors checkpoint is refused before anything loads, naming the method
    and the fix; block FP8 (the hub's DeepSeek-V3 format) is not refused by the check."""
    from fcsd.loading import check_quantization, load_config

    message = f"is quantized with {method} (quantization_config.quant_method): fcsd loads unquantized"
    assert_edited_config_refused(env, tmp_path, capsys, {"quantization_config": {"quant_method": method}}, message)
    fp8 = load_config(str(env / "model"))
    fp8.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    assert check_quantization(fp8, "fp8 source") is fp8


@pytest.mark.parametrize(
    "url, expected",
    [
        ("https://huggingface.co/api/models/org/model/revision/main", "org/model: the Hugging Face hub cannot be"),
        ("https://huggingface.co/datasets/org/data/resolve/main/x.parquet", "dataset org/data: the Hugging Face hub"),
        ("https://huggingface.co/api/repos/create", "the Hugging Face hub cannot be reached: check the network"),
    ],
    ids=["model", "dataset", "upload"],
)
def test_an_unreachable_hub_names_what_was_fetched_and_a_fix_that_fits_it(url, expected):
    """A model download may be replaced by a local checkpoint; a benchmark's dataset (fcsd eval) or an upload
    (fcsd push) may not: neither is called "the model", nor answered with a local checkpoint folder."""
    from fcsd.sources import explain_error

    class ConnectError(Exception):
        pass

    message = explain_error(ConnectError(f"couldn't connect to {url}"))
    assert message.startswith(expected), message
    assert ("local checkpoint folder" in message) == expected.startswith("org/model"), message


def _overwrite_middle(path: Path, count: int = 4096) -> None:
    """Overwrite ``count`` bytes in the middle of ``path`` with 0xFF (a float NaN), keeping its size: a bit rot or a
    torn write that no size check sees."""
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.seek(size // 2)
        handle.write(b"\xff" * min(count, size - size // 2))
    assert path.stat().st_size == size


def test_a_checkpoint_whose_bytes_changed_is_refused_by_resume_and_export_naming_the_file(
    env, tmp_path, monkeypatch, capsys
):
    """Every file of a step checkpoint has its SHA-256 in the trainer state; 4 KiB of its weights overwritten with
    0xFF (size kept): --resume trained NaN from it; now it is refused in one line naming the file and the command
    that resumes from the previous sound checkpoint, which trains to the end; `fcsd export` of it is refused too,
    naming the export of the sound one."""
    import shlex

    out = tmp_path / "run"
    argv = run_convert(env, f"output_dir={out}", "train.max_steps=4", "train.save_every=1", "train.keep_checkpoints=3")
    argv += ["export=false"]
    with monkeypatch.context() as patch:
        _stop_after_checkpoint(patch, 3)
        assert main(argv) == 130
    _overwrite_middle(out / "checkpoints" / "step-3" / "model.safetensors")
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    state = json.loads((out / "checkpoints" / "step-3" / "trainer_state.json").read_text())
    assert set(state["sha256"]) == set(state["files"]) and "model.safetensors" in state["files"]
    assert len(err.splitlines()) == 1, err
    assert "checkpoints/step-3 is damaged (model.safetensors changed since it was written" in err, err
    assert "; continue from step-2: `fcsd" in err, err
    command = shlex.split(err.split("`")[1])
    assert command[-2:] == ["--resume", "train.resume_step=2"]
    assert main([*argv, "--resume", "train.resume_step=3"]) == 2  # the step asked for is replaced, not repeated
    again = shlex.split(capsys.readouterr().err.split("`")[1])
    assert [w for w in again if w.startswith("train.resume_step=")] == ["train.resume_step=2"], again
    step3 = out / "checkpoints" / "step-3"
    assert main(["export", str(step3), str(tmp_path / "exported")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.safetensors changed since it was written" in err, err
    sound = f"fcsd export {out / 'checkpoints' / 'step-2'} {tmp_path / 'exported'}"
    assert f"export the newest sound one instead: `{sound}`" in err, err
    assert not (tmp_path / "exported").exists()
    assert main(command[1:]) == 0
    losses = [r["train/loss"] for r in RunFolder(out).records() if "train/loss" in r]
    assert len(losses) == 4 and all(loss == loss for loss in losses)  # no NaN
    assert json.loads((out / "final" / "fcsd_checkpoint.json").read_text())["step"] == 4


def test_a_checkpoint_whose_digest_record_was_edited_is_refused_and_an_old_one_is_checked_by_size(
    env, tmp_path, monkeypatch, capsys
):
    """A checkpoint's SHA-256 record edited (a file's digest deleted, the whole record deleted or made a string) and
    its weights then damaged: `fcsd export` exported the damage (rc 0) and --resume trained from it, the record read as
    an old checkpoint's; now both refuse it as damaged in one line naming the file and the sound one. Uppercase
    digests are digests. A checkpoint written before digests (no format, no record) is checked by size with a note."""
    out = tmp_path / "run"
    argv = run_convert(env, f"output_dir={out}", "train.max_steps=3", "train.save_every=1", "export=false")
    with monkeypatch.context() as patch:
        _stop_after_checkpoint(patch, 2)
        assert main(argv) == 130
    step2 = out / "checkpoints" / "step-2"
    state_file = step2 / "trainer_state.json"
    written = json.loads(state_file.read_text())
    assert written["checkpoint_format"] == 2
    state_file.write_text(json.dumps({**written, "sha256": {k: v.upper() for k, v in written["sha256"].items()}}))
    assert RunFolder(out).checkpoint_problems(step2) == []
    # a user's file beside a sound checkpoint is named as such, with the fix (it read as an edited record before)
    (step2 / "extra.txt").write_text("mine")
    assert RunFolder(out).checkpoint_problems(step2) == [
        "extra.txt is no file the run wrote: move it out of the checkpoint"
    ]
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "step-2 also holds files the run did not write (extra.txt): move them out of it and run the same" in err
    (step2 / "extra.txt").unlink()
    # a file taken out of both records and replaced (step-1's optimizer state): the folder holds what no record lists
    unlisted = {
        **written,
        "files": {k: v for k, v in written["files"].items() if k != "optimizer.bin"},
        "sha256": {k: v for k, v in written["sha256"].items() if k != "optimizer.bin"},
    }
    state_file.write_text(json.dumps(unlisted))
    own = (step2 / "optimizer.bin").read_bytes()
    shutil.copy(out / "checkpoints" / "step-1" / "optimizer.bin", step2 / "optimizer.bin")
    assert RunFolder(out).checkpoint_problems(step2) == [
        "optimizer.bin has no SHA-256 in trainer_state.json, whose record was edited"
    ]
    (step2 / "optimizer.bin").write_bytes(own)
    _overwrite_middle(step2 / "model.safetensors")
    no_digest = {**written, "sha256": {k: v for k, v in written["sha256"].items() if k != "model.safetensors"}}
    no_record = {k: v for k, v in written.items() if k != "sha256"}
    edits = {"digest": no_digest, "record": no_record, "string": {**written, "sha256": "x"}}
    for what, state in edits.items():
        state_file.write_text(json.dumps(state))
        capsys.readouterr()
        assert main(["export", str(step2), str(tmp_path / "exported")]) == 2, what
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "cannot be exported" in err and "edited" in err, err
        assert f"`fcsd export {out / 'checkpoints' / 'step-1'} " in err, err
        assert not (tmp_path / "exported").exists()
        assert what != "digest" or "model.safetensors has no SHA-256" in err, err
    assert main([*argv, "--resume"]) == 2  # the last edit (a string) is refused by --resume too
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "checkpoints/step-2 is damaged (" in err and "step-1" in err, err
    old = {k: v for k, v in written.items() if k not in ("sha256", "checkpoint_format")}
    state_file.write_text(json.dumps(old))  # written before digests: its damage cannot be seen, and it says so
    assert RunFolder(out).checkpoint_problems(step2) == [] and RunFolder(out).checked_by_size_only(step2)
    assert not RunFolder(out).checked_by_size_only(out / "checkpoints" / "step-1")


def _nan_model(env, tmp_path: Path) -> Path:
    """The world's model with one attention weight set to NaN: every loss it gives is NaN."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "nan_model"
    shutil.copytree(env / "model", model)
    weights = load_file(str(model / "model.safetensors"))
    name = next(k for k in weights if k.endswith("self_attn.q_proj.weight"))
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    return model


@pytest.mark.parametrize("steps", [4, 2], ids=["three-skipped-in-a-row", "too-short-for-the-streak"])
def test_a_run_with_non_finite_weights_writes_no_final_export_or_summary(env, tmp_path, capsys, steps):
    """Weights that give a NaN loss: the run skipped every step and then wrote final/, its summary and its export
    from them (train.max_bad_steps=5 was never reached in 4 steps); now train.max_nonfinite_steps (3) skipped steps in
    a row stop it in one line, and a run too short for that is stopped by the check of the weights before final/."""
    out = tmp_path / "run"
    argv = run_convert(env, f"output_dir={out}", f"train.max_steps={steps}", model=str(_nan_model(env, tmp_path)))
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and [line for line in err.splitlines() if "error" in line] == [err.splitlines()[-1]]
    expected = "the loss was not finite in each of the last 3 steps" if steps == 4 else "hold non-finite values"
    assert expected in err and "nothing was written from them (no final/, export or summary)" in err, err
    assert not any((out / name).exists() for name in ("final", "export", "run_summary.json"))


def test_a_diverging_run_stops_in_one_line_with_advice_that_is_not_refused(env, tmp_path, monkeypatch, capsys):
    """train.lr=1e6: the spike guard's stop was a traceback (RuntimeError, status 1) advising a resume with a lower
    train.lr, which --resume refuses (the LR schedule is the run's). Now one line, status 2, nothing written from the
    weights, and the advice is a new run over the folder with a tenth of the LR (--resume dropped)."""
    import shlex

    out = tmp_path / "run"
    argv = run_convert(env, f"output_dir={out}", "train.lr=1e6", "train.max_steps=6", "train.save_every=1")
    with monkeypatch.context() as patch:
        _stop_after_checkpoint(patch, 1)
        assert main(argv) == 130
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and [line for line in err.splitlines() if "error" in line] == [err.splitlines()[-1]]
    assert "training diverged: 5 updates in a row were skipped" in err and "no final/, export or summary" in err, err
    command = shlex.split(err.split("`")[1])
    assert "--resume" not in command and command[-2:] == ["overwrite=true", "train.lr=100000"], command
    assert "train.lr=1e6" not in command and not (out / "final").exists()


def test_a_stop_while_the_run_exports_gives_the_export_command_not_a_refused_resume(env, tmp_path, monkeypatch, capsys):
    """Ctrl-C during the end-of-run export: the line named the last checkpoint and `--resume`, which is refused
    (final/ exists). Now it says the run finished and gives the `fcsd export` that writes the export, which works;
    a stop after the command returned (while the interpreter ends) is one line too, with status 130."""
    import shlex

    from fcsd.cli import runs, stops
    from fcsd.export import save

    out = tmp_path / "run"
    argv = run_convert(env, f"output_dir={out}", "train.max_steps=2")

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(save, "export_checkpoint", stopped)
        assert main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"the run in {out} finished (final/ is written) but not its export: write it with `" in err, err
    assert "--resume" not in err, err
    command = shlex.split(err.split("`")[1])
    assert command == ["fcsd", "export", str(out), str(out / "export")]
    assert main(command[1:]) == 0 and (out / "export" / "config.json").exists()
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["fcsd", *argv])
    monkeypatch.setattr(stops, "exit_stopped", lambda code: sys.exit(code))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with monkeypatch.context() as patch:  # the run is done: stand in for it, then stop as the process ends
            patch.setattr(runs, "_convert", lambda args: 0)
            assert main() == 0
        with pytest.raises(SystemExit) as stop:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert stop.value.code == 130
    err = capsys.readouterr().err.strip()
    assert err == f"fcsd convert: interrupted; the run in {out} had finished (final/ and {out / 'export'} written)"


def test_a_resume_records_the_recipe_it_trains_with(env, tmp_path, monkeypatch, capsys):
    """A run resumed under another recipe name (`recovery.name=mine`: its settings are the run's, so the resume
    check lets it through) trains the run's recipe, as it should; its fcsd_config.yaml said `recovery.name: mine`.
    Now the run keeps recording the recipe it trains with, with a note."""
    from omegaconf import OmegaConf

    out = tmp_path / "run"
    argv = run_convert(env, f"output_dir={out}", "train.max_steps=4", "train.save_every=1", "export=false")
    argv += ["recovery=plain"]
    with monkeypatch.context() as patch:
        _stop_after_checkpoint(patch, 1)
        assert main(argv) == 130
    capsys.readouterr()
    assert main([*argv, "--resume", "recovery.name=mine"]) == 0
    assert "note: --resume continues the run's recovery recipe 'plain'" in capsys.readouterr().out
    for config in (out / CONFIG, out / "final" / CONFIG):
        recorded = OmegaConf.load(config).recovery
        assert (recorded.name, recorded.optimizer) == ("plain", "adamw"), config


def test_the_resume_of_a_sharded_checkpoint_in_one_process_names_the_torchrun_line_that_resumes_it(
    env, tmp_path, capsys
):
    """A run whose checkpoint an EP 2 run wrote (DCP shards), resumed in one plain process: the refusal's advice was
    "resume it with parallel.ep_size > 1 (any process count)", which in one process died with torch's "Default
    process group has not been initialized"; now it names the torchrun line, and that line's settings are the
    layout."""
    import shlex

    run = tmp_path / "run"
    shutil.copytree(env / "runs" / "unfinished", run)
    state_file = run / "checkpoints" / "step-4" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["layout"] = {"format": "torch.distributed.checkpoint", "world": 2, "ep": 2, "fsdp": False}
    state_file.write_text(json.dumps(state))
    argv = [*run_convert(env, f"output_dir={run}", "train.max_steps=9"), "--resume"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds the sharded checkpoint of a" in err, err
    line = shlex.split(err.split("`")[1])
    assert line[:7] == ["fcsd", "launch", "torchrun", "--nproc_per_node", "2", "-m", "fcsd.cli"], line
    overrides = [word for word in line[9:] if word != "--resume"]
    assert "--resume" in line[9:]
    config = to_config(compose([*overrides, f"model.name={line[8]}", "train.resume=true"]))
    assert (config.parallel.ep_size, config.parallel.fsdp, config.output_dir) == (2, False, str(run))


def test_eval_of_a_chat_suite_on_a_model_without_a_chat_template_is_refused_before_it_loads(env, tmp_path, capsys):
    """`fcsd eval --suite demo` (its tasks use the chat template) on a model whose tokenizer has none ran ~40 s, the
    model loaded and lm-eval's requests built, before transformers' own "chat_template is not set"; now one line
    before any weights load, naming the suite's tasks and the fixes."""
    model = tmp_path / "no_template"
    shutil.copytree(env / "model", model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    assert transformers.AutoTokenizer.from_pretrained(model).chat_template is None
    capsys.readouterr()
    assert main(["eval", str(model), "--suite", "demo", "--output", str(tmp_path / "report")]) == 2
    err = capsys.readouterr().err.strip()
    assert "Loading weights" not in err and len(err.splitlines()) == 1, err
    expected = "suite 'demo' renders the prompts of fcsd_demo_gen, fcsd_demo_choice with the tokenizer's chat template"
    assert f"{expected}, and {model} has none" in err, err
    assert not (tmp_path / "report").exists()
