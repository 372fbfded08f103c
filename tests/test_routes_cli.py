"""`fcsd routes record | stats | place` end to end on a tiny saved Qwen3-MoE with a locally trained tokenizer."""

import json

import numpy as np
import pytest
import torch
from tiny_models import save_chat_model

from fcsd.cli import main
from fcsd.embedded.synthetic import make_dataset, write_jsonl
from fcsd.loading import from_pretrained
from fcsd.placement import apply_placement, load_placement, load_routes
from fcsd.placement.stats import distinct_per_row
from fcsd.placement.synthetic_routes import planted_routes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_routes")
    rows = make_dataset(120, seed=5)
    save_chat_model(root / "model", rows)
    write_jsonl(rows, root / "chat.jsonl")
    return root


def test_record_stats_place_apply(checkpoint, tmp_path, capsys):
    model_dir, routes = str(checkpoint / "model"), tmp_path / "routes.safetensors"
    args = ["routes", "record", model_dir, "--data", str(checkpoint / "chat.jsonl"), "--tokens", "384"]
    assert main([*args, "--seq-len", "32", "--batch-size", "4", "--quiet", "--out", str(routes)]) == 0
    assert "384 tokens x 3 MoE layers" in capsys.readouterr().out
    recorded = load_routes(routes)
    assert recorded.ids.shape == (3, 384, 2) and recorded.header["layers"] == [0, 2, 3]
    assert recorded.header["data_fingerprint"] and recorded.header["model_type"] == "qwen3_moe"

    assert (
        main(["routes", "stats", str(routes), "--ep", "2,4", "--holdout", "0.2", "--step-tokens", "32", "--json"]) == 0
    )
    report = json.loads(capsys.readouterr().out)
    _, held = recorded.split(0.2)
    for ep in ("2", "4"):
        ranks = np.arange(8) // (8 // int(ep))  # contiguous: recomputed here from the held-out routes
        distinct = np.mean([distinct_per_row(ranks[held.layer(layer)]).mean() for layer in held.layers])
        assert report["ep"][ep]["contiguous"]["gpus_per_token"] == pytest.approx(distinct)
        for name in ("contiguous", "correlated"):
            row = report["ep"][ep][name]
            assert {"same_gpu", "gpus_per_token", "dedup_removed", "local_stay", "local_moved"} <= set(row)
            assert row["dedup_removed"] == pytest.approx(1 - row["gpus_per_token"] / 2)  # top-2

    placement_path = tmp_path / "placement.json"
    assert main(["routes", "place", str(routes), "--ep", "4", "--out", str(placement_path)]) == 0
    assert "contiguous ->" in capsys.readouterr().out
    placement = load_placement(placement_path)
    assert placement.ep == 4 and sorted(placement.layers) == [0, 2, 3]

    plots = tmp_path / "plots"
    assert (
        main(["routes", "stats", str(routes), "--ep", "4", "--placement", str(placement_path), "--plot", str(plots)])
        == 0
    )
    out = capsys.readouterr().out
    assert "given" in out and "within layer" in out
    assert sorted(p.name for p in plots.glob("*.png")) == ["across_layers_2_3.png", "within_layer_2.png"]

    model = from_pretrained(model_dir)
    x = torch.randint(3, 200, (2, 16))
    reference = model(input_ids=x).logits
    apply_placement(model, placement_path)
    torch.testing.assert_close(model(input_ids=x).logits, reference, atol=1e-5, rtol=1e-5)
    saved = tmp_path / "placed"
    model.save_pretrained(saved)
    reloaded = from_pretrained(str(saved))
    assert reloaded.config.farskip["placement"]["ep"] == 4
    torch.testing.assert_close(reloaded(input_ids=x).logits, reference, atol=1e-5, rtol=1e-5)


def test_bad_input_gets_one_clear_line(checkpoint, tmp_path, capsys):
    synthetic, _ = planted_routes(num_experts=8, top_k=2, num_layers=3, tokens=1024, cluster_size=2, seq_len=64)
    synthetic.header.update(model="other", model_fingerprint="f" * 16)
    routes = synthetic.save(tmp_path / "other.safetensors")

    def error(argv):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("fcsd routes: error:") and "\n" not in err
        return err

    assert "does not divide the 8 experts" in error(["routes", "place", str(routes), "--ep", "3", "--out", "x.json"])
    assert "--nodes 3 does not divide --ep 4" in error(["routes", "stats", str(routes), "--ep", "4", "--nodes", "3"])
    assert "no routes file" in error(["routes", "stats", str(tmp_path / "missing.safetensors")])
    (tmp_path / "bad.json").write_text('{"num_experts": 8, "ep": 2, "layers": {"0": [0, 1]}}')
    assert "lists 2 ranks for 8 experts" in error(
        ["routes", "stats", str(routes), "--placement", str(tmp_path / "bad.json")]
    )
    foreign = tmp_path / "foreign.json"
    assert main(["routes", "place", str(routes), "--ep", "2", "--out", str(foreign)]) == 0
    capsys.readouterr()
    model = from_pretrained(str(checkpoint / "model"))
    with pytest.raises(ValueError, match="another model"):
        apply_placement(model, foreign)
    mine = tmp_path / "mine.safetensors"
    assert main(["routes", "record", str(checkpoint / "model"), "--data", str(checkpoint / "chat.jsonl"),
                 "--tokens", "128", "--seq-len", "64", "--quiet", "--out", str(mine)]) == 0  # fmt: skip
    capsys.readouterr()
    assert "another model" in error(["routes", "stats", str(mine), "--placement", str(foreign)])
    ids = load_routes(mine).ids  # (layers, tokens, top-2) expert ids: in range, two distinct experts per token
    assert ids.shape == (3, 128, 2) and ids.min() >= 0 and ids.max() < 8 and (ids[..., 0] != ids[..., 1]).all()
