"""`fcsd inspect` and `fcsd probe` end to end on a tiny saved checkpoint with a locally trained tokenizer."""

import csv
import json

import numpy as np
import pytest
from tiny_models import save_chat_model

from fcsd.cli import main
from fcsd.embedded.synthetic import make_dataset, write_jsonl
from fcsd.model_summary import summarize


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    rows = make_dataset(200, seed=3)
    save_chat_model(root / "model", rows, "deepseek_v3")
    write_jsonl(rows, root / "heldout.jsonl")
    return root


def test_inspect_reports_layers_experts_and_params(checkpoint, capsys):
    assert main(["inspect", str(checkpoint / "model"), "--layers", "last:50%", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["family"] == "DeepSeek-V3"
    assert report["num_layers"] == 4
    assert report["dense_layers"] == [0] and report["moe_layers"] == [1, 2, 3]
    assert (report["num_experts"], report["top_k"], report["shared_experts"]) == (8, 2, 1)
    assert report["converted_layers"] == [2, 3]


def test_inspect_reads_a_run_folder_at_its_checkpoint(checkpoint, tmp_path, capsys):
    import shutil

    import fcsd

    run = tmp_path / "run"
    fcsd.apply_farskip(fcsd.from_pretrained(str(checkpoint / "model")), "last:1").save_pretrained(run / "final")
    assert main(["inspect", str(run), "--json"]) == 0  # a run folder: its final/, as fcsd eval reads it
    assert json.loads(capsys.readouterr().out)["farskip_layers"] == [3]
    assert main(["inspect", str(run)]) == 0
    assert "FarSkip already  1 layers: 3" in capsys.readouterr().out
    shutil.rmtree(run / "final")
    assert main(["inspect", str(run)]) == 2
    assert (
        "holds no checkpoint: expected config.json, or a run folder with export/ or final/" in capsys.readouterr().err
    )


def test_param_counts_are_exact(checkpoint):
    """Counted from the checkpoint's tensors on disk (not from a model of the config, as `inspect` does)."""
    from safetensors import safe_open

    sizes = {}
    for shard in (checkpoint / "model").glob("*.safetensors"):
        with safe_open(str(shard), "pt") as handle:
            sizes.update({key: handle.get_slice(key).get_shape() for key in handle.keys()})
    sizes = {k: v for k, v in sizes.items() if not k.endswith("e_score_correction_bias")}  # a buffer, not a weight
    total = sum(int(np.prod(shape)) for shape in sizes.values())
    routed = sum(int(np.prod(shape)) for key, shape in sizes.items() if ".mlp.experts." in key)
    summary = summarize(str(checkpoint / "model"))
    assert routed > 0 and summary.total_params == total
    assert summary.active_params == total - routed + routed * 2 // 8  # top-2 of 8 routed experts


def test_inspect_text_output_and_errors(checkpoint, capsys):
    assert main(["inspect", str(checkpoint / "model"), "--layers", "0,2"]) == 0
    out = capsys.readouterr().out
    assert "DeepSeek-V3" in out and "2 converted: 0,2" in out
    assert main(["inspect", str(checkpoint / "model"), "--layers", "9"]) == 2
    assert "has 4 layers" in capsys.readouterr().err


def probe(checkpoint, out, grid: str) -> int:
    model, data = str(checkpoint / "model"), str(checkpoint / "heldout.jsonl")
    return main(
        [
            "probe",
            model,
            "--data",
            data,
            "--grid",
            grid,
            "--seq-len",
            "32",
            "--num-sequences",
            "4",
            "--output-dir",
            str(out),
            "--device",
            "cpu",
        ]
    )


def test_probe_writes_csv_and_plot(checkpoint, tmp_path, capsys):
    out = tmp_path / "probe"
    code = probe(checkpoint, out, "0,2,all")
    assert code == 0
    rows = list(csv.DictReader(open(out / "probe.csv")))
    assert {(r["side"], int(r["n_converted"])) for r in rows} == {
        ("first", 0),
        ("first", 2),
        ("first", 4),
        ("last", 0),
        ("last", 2),
        ("last", 4),
    }
    by_key = {(r["side"], int(r["n_converted"])): r for r in rows}
    assert float(by_key[("first", 0)]["kl"]) == 0.0
    assert float(by_key[("first", 4)]["kl"]) > 0.0
    assert by_key[("first", 4)]["loss"] == by_key[("last", 4)]["loss"]  # both convert every layer
    assert (out / "probe.png").read_bytes()[:4] == b"\x89PNG"


def test_probe_bad_grid_and_missing_data(checkpoint, tmp_path, capsys):
    code = probe(checkpoint, tmp_path, "0,9")
    assert code == 2 and "outside 0..4" in capsys.readouterr().err
    assert main(["probe", str(checkpoint / "model")]) == 2
    assert "fcsd probe: error: --data is required" in capsys.readouterr().err
