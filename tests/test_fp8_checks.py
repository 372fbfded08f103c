"""FP8 checkpoints checked for what they hold (issue "Nothing lost, round five"): block scales against the declared
block size before training (one process and EP 2), an FP8 export refused only when it stores a weight wrongly (its
FP8 rounding drift reported, not refused), and a model card that describes the schedule the run made."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from fp8_models import write_fp8_checkpoint
from launch import torchrun
from test_trainer import FAST, torch_threads
from tiny_models import build

import fcsd
from fcsd.cli import main
from fcsd.embedded.synthetic import make_dataset, write_jsonl
from fcsd.embedded.tokenizer import train_tokenizer


def _tiny_deepseek(root: Path, gain: float = 1.0) -> list[str]:
    """A tiny DeepSeek-V3 with random weights in the hub's block-FP8 layout under ``root`` (``fp8/``, its
    dequantized copy ``bf16/``), its data, and the convert arguments that train it; ``gain`` scales its linear
    weights (3: an init std of 0.06, logits large enough for FP8 rounding to move them by more than 10%)."""
    data = make_dataset(60, seed=5)
    tokenizer = train_tokenizer((m["content"] for r in data for m in r["messages"]), vocab_size=280)
    model = build("deepseek_v3")
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim >= 2:
                parameter.mul_(gain)
    write_fp8_checkpoint(root, "deepseek_v3", model=model, tokenizer=tokenizer)
    write_jsonl(data, root / "train.jsonl")
    return [f"data.path={root / 'train.jsonl'}", f"data.cache_dir={root / 'cache'}", *FAST, "data.eval_sequences=4"]


def _declare_block(folder: Path, block: list[int]) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"]["weight_block_size"] = block
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-checks")
    return root, _tiny_deepseek(root)


@pytest.mark.parametrize("block", [[32, 32], [8, 8]])
def test_scales_made_for_other_blocks_are_refused_in_one_line_before_training(tiny, tmp_path, capsys, block):
    """Scales made for 16 x 16 blocks under a declared weight_block_size of 32 x 32 (read before: 3% of the weights
    dequantized wrongly, silently) or 8 x 8 (a shape error deep in the loader): status 2, one line naming the
    tensor, the declared block, the scale's shape and the block the scales imply, before any training."""
    root, args = tiny
    source = tmp_path / "fp8"
    source.mkdir()
    for path in (root / "fp8").iterdir():
        (source / path.name).write_bytes(path.read_bytes())
    _declare_block(source, block)
    with torch_threads(1):
        status = main(["convert", str(source), *args, "train.max_steps=2", f"output_dir={tmp_path / 'run'}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fcsd convert: error: ")]
    assert status == 2 and len(err) == 1, err
    print(err[0])
    pattern = (
        r"model\.\S+\.weight_scale_inv has shape \[\d+, \d+\], but weight \[\d+, \d+\] in the declared "
        rf"weight_block_size \[{block[0]}, {block[1]}\] needs \[\d+, \d+\] \(\d+ such scales\): the scales are for "
        r"\[16, 16\] blocks: set quantization_config.weight_block_size to \[16, 16\] in config.json"
    )
    assert re.search(pattern, err[0]), err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _convert_copy(tiny, tmp_path, capsys, edit) -> list[str]:
    """``fcsd convert`` of a copy of the tiny FP8 checkpoint after ``edit(folder)``: its status and error lines."""
    root, args = tiny
    source = tmp_path / "fp8"
    source.mkdir()
    for path in (root / "fp8").iterdir():
        (source / path.name).write_bytes(path.read_bytes())
    edit(source)
    with torch_threads(1):
        status = main(["convert", str(source), *args, "train.max_steps=2", f"output_dir={tmp_path / 'run'}"])
    assert status == 2 and not (tmp_path / "run" / "metrics.jsonl").exists()
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("fcsd convert: error: ")]


@pytest.mark.parametrize("block", [[16.5, 16], [True, True], [0, 16], "x", [16]])
def test_a_weight_block_size_that_is_no_block_is_named_as_such(tiny, tmp_path, capsys, block):
    """[16.5, 16] was read as [16, 16] and trained; [0, 16], "x" and [16] were called per-tensor scales."""
    err = _convert_copy(tiny, tmp_path, capsys, lambda folder: _declare_block(folder, block))
    assert len(err) == 1 and f"weight_block_size {block!r} in config.json is no block" in err[0], err


def test_a_scale_of_a_weight_not_stored_in_fp8_is_refused(tiny, tmp_path, capsys):
    """A weight_scale_inv beside the bf16 LM head multiplied the head by it, silently."""

    def orphan_scale(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(folder / "model.safetensors"))
        tensors["lm_head.weight_scale_inv"] = torch.full((2, 2), 100.0)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

    err = _convert_copy(tiny, tmp_path, capsys, orphan_scale)
    assert len(err) == 1 and "lm_head.weight_scale_inv scales lm_head.weight, which is not stored in FP8" in err[0]


def test_scales_made_for_other_blocks_are_refused_under_expert_parallelism(tiny, tmp_path):
    """Under EP 2 (2 gloo processes, each reading its slices) the same refusal, before training."""
    root, args = tiny
    source = tmp_path / "fp8"
    source.mkdir()
    for path in (root / "fp8").iterdir():
        (source / path.name).write_bytes(path.read_bytes())
    _declare_block(source, [32, 32])
    command = ["-m", "fcsd.cli", "convert", str(source), *args, "train.max_steps=2", "parallel.ep_size=2"]
    done = torchrun(2, *command, f"output_dir={tmp_path / 'run'}", check=False, timeout=300)
    assert done.returncode != 0
    assert "in the declared weight_block_size [32, 32] needs" in done.stderr, done.stderr[-3000:]
    assert "set quantization_config.weight_block_size to [16, 16]" in done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_scales_that_fit_no_block_are_refused_as_a_damaged_checkpoint():
    from fcsd.block_fp8 import check_block_scales, implied_block

    assert implied_block([([32, 12], [2, 1]), ([48, 8], [3, 1]), ([8, 64, 32], [8, 4, 2])]) == [16, 16]
    shapes = {"a.weight": ([32, 32], [2, 2]), "b.weight": ([32, 32], [4, 4])}
    with pytest.raises(ValueError, match=r"b.weight_scale_inv has shape \[4, 4\].*no one block size fits") as caught:
        check_block_scales(shapes, [16, 16])
    assert "\n" not in str(caught.value)
    check_block_scales({"a.weight": ([8, 40, 24], [8, 3, 2])}, [16, 16])  # partial blocks and experts: fine


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The probe's case: a tiny random DeepSeek-V3 in block FP8, 4 training steps, exported by fcsd convert (refused
    before: "reload parity failed: max |logit difference| 0.32 (tolerance 0.14375)"); and a 2-step run of its
    dequantized copy with a batch ramp that holds both steps."""
    root = tmp_path_factory.mktemp("fp8-export")
    args = _tiny_deepseek(root, gain=3.0)
    with torch_threads(1):
        assert main(["convert", str(root / "fp8"), *args, "train.max_steps=4", f"output_dir={root / 'fp8-run'}"]) == 0
        ramp = ["recovery.batch_ramp=[4,2]", "recovery.batch_ramp_shares=[0.5,0.4]", "train.max_steps=2"]
        assert main(["convert", str(root / "bf16"), *args, *ramp, f"output_dir={root / 'ramp-run'}"]) == 0
    return root


def test_the_fp8_export_of_a_trained_tiny_deepseek_is_written_and_reports_its_drift(trained):
    """The export is written in FP8, reloads, and its record and card give the logit drift FP8 rounding causes
    (max |logit difference| and its share of the largest |logit|) beside the proof that every weight is stored as
    the block quantization of the trained weight."""
    export = trained / "fp8-run" / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [16, 16]
    record = json.loads((export / "fcsd_export.json").read_text())
    fp8 = record["fp8"]
    assert fp8["stored_exactly"] is True and fp8["quantized_weights"] > 60
    drift = fp8["logit_drift"]
    assert drift["max_abs"] == record["parity_max_abs_diff"] > 0 and 0.1 < drift["relative"] < 1  # over the old bound
    card = (export / "README.md").read_text()
    assert f"by at most {drift['max_abs']:.4g} ({drift['relative']:.1%} of the largest |logit|)" in card
    assert card.index("## FP8 weights") < card.index("## How to load")
    assert not (export / "fcsd_fp8_check.json").exists()
    model = fcsd.from_pretrained(str(export))
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(12)[None]).logits).all()
    # 4 steps: the guided recipe's ramp (3.3% and 5% of the steps) holds none of them, and the card says so
    assert "3.3%" not in card and "no batch ramp (recovery.batch_ramp's shares hold none of the 4 steps)" in card


def test_the_card_describes_the_batch_ramp_and_schedule_the_run_made(trained):
    """A 2-step run whose batch ramp splits step 1 into 4 updates and step 2 into 2: the card says so in steps (it
    described shares of max_steps, whichever steps ran), with the warm-up the run had (none: 0.5% of 2 steps)."""
    card = (trained / "ramp-run" / "export" / "README.md").read_text()
    assert "batch ramp: step 1 in 4 updates, step 2 in 2 updates, each at the LR / sqrt(updates)" in card
    assert "schedule-free AdamW, constant after no warm-up" in card and "% of the steps in" not in card
    assert "fp8" not in json.loads((trained / "ramp-run" / "export" / "fcsd_export.json").read_text())


def test_an_fp8_export_that_stores_a_weight_wrongly_is_refused(tmp_path, monkeypatch):
    """One e4m3 code of one weight written one step off (within FP8 rounding of the logits): refused, naming the
    weight, and nothing exported."""
    import safetensors.torch

    from fcsd.export.save import ExportError
    from fcsd.export.save import export as write_export

    write_fp8_checkpoint(tmp_path, "qwen3_moe")
    student = fcsd.from_pretrained(str(tmp_path / "fp8"), layers="all", dtype=torch.bfloat16)
    save_file = safetensors.torch.save_file

    def corrupting(tensors, path, metadata=None):
        key = "model.layers.1.self_attn.q_proj.weight"
        if key in tensors and tensors[key].dtype == torch.float8_e4m3fn:
            codes = tensors[key].view(torch.uint8).clone()
            codes[0, 0] ^= 1  # the next e4m3 value
            tensors = {**tensors, key: codes.view(torch.float8_e4m3fn)}
        return save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", corrupting)
    with pytest.raises(ExportError, match=r"reload parity failed: 1 tensors .*model.layers.1.self_attn.q_proj") as e:
        write_export(student, train_tokenizer(["a b c"], vocab_size=40), tmp_path / "export", source=tmp_path / "fp8")
    assert "\n" not in str(e.value) and not (tmp_path / "export").exists()
