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
import transformers
from tiny_models import build, save_chat_model

from fcsd.cli import main
from fcsd.distill.config import compose, to_config
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
    return root


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
    # ... or with another expert-parallel size (its checkpoints hold one optimizer state per process)
    (
        "resume_other_ep_size",
        lambda w: [*run_convert(w, f"output_dir={w / 'runs/x'}", "parallel.ep_size=2"), "--resume"],
        "parallel.ep_size: run None vs now 2",
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
        "export_truncated_safetensors",
        lambda w: ["export", str(w / "runs/broken"), str(w / "exported")],
        "a .safetensors file is truncated or corrupt",
        "exported",
    ),
    ("inspect_garbage_config", lambda w: ["inspect", str(w / "garbage")], "config.json cannot be read", None),
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
    assert rows.skipped == 1  # exactly the one bad line: nothing around it is lost or counted twice
    assert len(rows.texts) == 60 and "add 30 and 31" in rows.texts[30]


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
    (folder / "config.json").write_text("{}")
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
