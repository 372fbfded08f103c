"""Bad inputs, as a new user or a hostile tester types them: each case is a command, its exit code, the one line it
answers, and the proof that nothing outside the run's own files was touched (the inputs, the current folder and the
home folder are snapshotted before and after). Most cases fail before any model loads; the module stays fast."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_models import build

from fcsd.cli import main
from fcsd.distill.config import compose, to_config
from fcsd.distill.tokenizer import train_tokenizer
from fcsd.run_folder import CONFIG
from fcsd.safe_io import MARKER

FAST = ["data.seq_len=32", "data.eval_sequences=2", "train.batch_tokens=64", "train.micro_batch_size=2"]
FAST += ["train.warmup_steps=0", "progress=false", "early_stop.enabled=false"]


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
    tokenizer = train_tokenizer((m["content"] for r in rows for m in r["messages"]), vocab_size=120)
    model = build("qwen3_moe")
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    data = root / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "empty.jsonl").write_text("")
    good = [json.dumps(r) for r in rows]
    (data / "one_bad_line.jsonl").write_text("\n".join([*good[:30], "{not json", *good[30:]]) + "\n")
    (root / "home").mkdir()
    (root / "work").mkdir()
    (root / "work" / "notes.txt").write_text("mine")
    # a finished-looking run folder (fake weights: the guards answer before anything loads)
    run = root / "runs" / "x"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    (run / "checkpoints" / "step-1").mkdir(parents=True)
    (run / MARKER).write_text("run\n")
    (run / CONFIG).write_text(f"model:\n  name: {root / 'model'}\n")
    (root / "not_an_export").mkdir()
    (root / "not_an_export" / "keep.txt").write_text("keep")
    (root / "mixed").mkdir()
    (root / "mixed" / "keep.txt").write_text("keep")
    (root / "suite.yaml").write_text("name: mine\ntasks:\n  - task: mbpp_plus\n")
    return root


@pytest.fixture
def env(world, monkeypatch, tmp_path):
    monkeypatch.chdir(world / "work")
    monkeypatch.setenv("HOME", str(world / "home"))
    monkeypatch.setenv("FCSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "1")
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
        "not an export fcsd wrote",
        None,
    ),
    # 2. export never clears its source's folder, nor a folder it did not write
    (
        "export_into_run",
        lambda w: ["export", str(w / "runs/x"), str(w / "runs/x"), "--overwrite"],
        "it is, contains or lies inside the source",
        None,
    ),
    (
        "export_final_into_run",
        lambda w: ["export", str(w / "runs/x/final"), str(w / "runs/x"), "--overwrite"],
        "it is, contains or lies inside the source",
        None,
    ),
    (
        "export_over_user_folder",
        lambda w: ["export", str(w / "runs/x"), str(w / "not_an_export"), "--overwrite"],
        "not an export fcsd wrote",
        None,
    ),
    # 3. a resume with another model is refused before anything is written
    (
        "resume_other_model",
        lambda w: [*run_convert(w, f"output_dir={w / 'runs/x'}", model=str(w / "data")), "--resume"],
        "is a different run (model.name",
        None,
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
    # 6. data
    (
        "data_empty_jsonl",
        lambda w: [*run_convert(w, f"output_dir={w / 'new'}"), f"data.path={w / 'data/empty.jsonl'}"],
        "the data is empty",
        "new",
    ),
    # 7. models
    ("unknown_hub_id_offline", lambda w: ["inspect", "no-such-org/no-such-model"], "hub access is off", None),
    (
        "perfmodel_tp_zero",
        lambda w: ["perfmodel", "--preset", "deepseek-v3", "--tp", "0"],
        "--tp=0: it must be at least 1",
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
    assert snapshot(env, own_dir) == before_world
    assert snapshot(env / "home") == before_home


def test_layer_list_syntax_and_quoted_commas_are_accepted(env):
    base = ["model.name=m", "data.path=d"]
    assert to_config(compose([*base, "farskip.layers=[0,3]"])).farskip.layers == "0,3"
    assert to_config(compose([*base, 'farskip.layers="0,3"'])).farskip.layers == "0,3"


def test_malformed_jsonl_line_is_skipped_and_counted(env):
    from fcsd.distill.data import load_texts

    rows = load_texts(str(env / "data" / "one_bad_line.jsonl"), text_field="messages")
    assert rows.skipped >= 1


def test_failed_start_restarts_and_resume_keeps_the_config(env, capsys):
    """A run folder that holds no checkpoint yet (a failed start) is restarted by the same command, without
    overwrite; a refused --resume leaves the run's config as it was."""
    failed = env / "failed"
    failed.mkdir()
    (failed / MARKER).write_text("run\n")
    (failed / CONFIG).write_text("model:\n  name: x\n")
    argv = [*run_convert(env, f"output_dir={failed}"), f"data.path={env / 'data' / 'empty.jsonl'}"]
    assert main(argv) == 2
    assert "not empty" not in capsys.readouterr().err
    config = (env / "runs/x" / CONFIG).read_text()
    assert main([*run_convert(env, f"output_dir={env / 'runs/x'}", model=str(env / "data")), "--resume"]) == 2
    assert (env / "runs/x" / CONFIG).read_text() == config


def test_ctrl_c_stops_cleanly_with_the_resume_command(env, tmp_path):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "fcsd.cli", *run_convert(env, f"output_dir={out}", "train.max_steps=100000")]
    argv += ["train.save_every=1", "export=false"]
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=environ)
    deadline = time.time() + 60
    while time.time() < deadline and not list((out / "checkpoints").glob("step-*")):
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "Traceback" not in err, err
    assert "--resume`" in err and "the last checkpoint is step-" in err, err
