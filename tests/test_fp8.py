"""Block-FP8 checkpoints in and out (design §8): tiny DeepSeek-V3 and Qwen3-MoE checkpoints in the hub's
FP8 layout (tests/fp8_models.py) read by fcsd's own dequantization, converted in one process and under EP 2 x FSDP 2
(4 gloo processes, shard-on-read of weights and their block scales), exported back in FP8."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fp8_models import BLOCK, NOT_CONVERTED, write_fp8_checkpoint
from launch import torchrun
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_trainer import FAST, assert_same_training, records_of, torch_threads
from tiny_models import build

import fcsd
from fcsd.block_fp8 import RECORD_KEY, DequantizedSlice, e4m3_step
from fcsd.embedded.synthetic import make_dataset, write_jsonl
from fcsd.embedded.tokenizer import train_tokenizer

STEPS = ["train.max_steps=2", "data.eval_sequences=4"]


def reference_dequantized(folder: Path) -> dict:
    """Every tensor of an FP8 checkpoint with its weights dequantized element by element (``fp8[i, j] *
    scale[i // B0, j // B1]`` in fp32), written independently of fcsd's reader."""
    state = load_file(str(folder / "model.safetensors"))
    out = {}
    for key, tensor in state.items():
        if key.endswith("_scale_inv"):
            continue
        scale = state.get(key + "_scale_inv")
        if scale is None:
            out[key] = tensor.float()
            continue
        rows, cols = (torch.arange(n) // b for n, b in zip(tensor.shape, BLOCK, strict=True))
        out[key] = tensor.float() * scale[rows][:, cols]
    return out


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_fcsd_reads_block_fp8_exactly_and_records_the_source_format(tmp_path, family):
    """fcsd.from_pretrained of an FP8 checkpoint (the hub's scales: amax / 448, partial blocks at MLA's 12-wide
    edges) holds exactly the element-by-element dequantized weights in fp32, and records which weights had no
    scale (router, embeddings, head, modules_to_not_convert) for the export."""
    write_fp8_checkpoint(tmp_path, family)
    reference = tmp_path / "reference"
    reference.mkdir()
    save_file(reference_dequantized(tmp_path / "fp8"), str(reference / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    settings = config.pop("quantization_config")
    (reference / "config.json").write_text(json.dumps(config))
    got, expected = (
        fcsd.from_pretrained(str(tmp_path / "fp8"), dtype=torch.float32),
        fcsd.from_pretrained(str(reference), dtype=torch.float32),
    )
    assert type(got) is type(expected) and not hasattr(got.config, "quantization_config")
    for (name, x), (_, y) in zip(got.state_dict().items(), expected.state_dict().items(), strict=True):
        assert x.dtype == torch.float32 and torch.equal(x, y), name
    record, state = getattr(got.config, RECORD_KEY), load_file(str(tmp_path / "fp8" / "model.safetensors"))
    assert record["quantization_config"] == settings
    unscaled = {k for k, t in state.items() if k.endswith(".weight") and t.ndim == 2 and k + "_scale_inv" not in state}
    assert set(record["kept"]) == unscaled and f"{NOT_CONVERTED[family][0]}.weight" in unscaled
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.3.mlp.gate.weight"} <= unscaled
    assert record["quantized"] == sum(k.endswith("_scale_inv") for k in state) > 0


def test_any_slice_reads_the_matching_scales(tmp_path):
    """A rank's slice (rows and columns off the block boundaries, experts stacked on a leading dim) is the slice of
    the dequantized tensor: the reader takes the scales of exactly the blocks it touches."""
    from fcsd.block_fp8 import quantize_blocks

    generator = torch.Generator().manual_seed(0)
    weight, scale = quantize_blocks(torch.randn(3, 40, 24, generator=generator), BLOCK)
    save_file({"w": weight, "s": scale}, str(tmp_path / "t.safetensors"))
    rows, cols = torch.arange(40) // BLOCK[0], torch.arange(24) // BLOCK[1]
    whole = weight.float() * scale[:, rows][:, :, cols]
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as handle:
        lazy = DequantizedSlice(handle.get_slice("w"), handle.get_slice("s"), BLOCK)
        assert lazy.get_shape() == [3, 40, 24] and torch.equal(lazy[...], whole)
        for index in [(slice(1, 3), slice(5, 37), slice(3, 20)), (2, slice(17, 18), slice(0, 24)), (slice(0, 1),)]:
            assert torch.equal(lazy[index], whole[index]), index


@pytest.fixture(scope="module")
def fp8_runs(tmp_path_factory):
    """A tiny DeepSeek-V3 (MLA's partial blocks, shared experts, a dense first layer) in block FP8 with power-of-two
    scales (so that its bf16 copy holds the dequantized weights exactly), converted 2 steps: from FP8 in one process,
    from the dequantized bf16 copy in one process, and from FP8 under EP 2 x FSDP 2 (4 gloo processes), with their
    exports."""
    root = tmp_path_factory.mktemp("fp8")
    data = make_dataset(60, seed=5)
    tokenizer = train_tokenizer((m["content"] for r in data for m in r["messages"]), vocab_size=280)
    model = build("deepseek_v3")
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    # with a layer the model does not load (as DeepSeek-V3's multi-token prediction layer): the exports leave it out
    write_fp8_checkpoint(root, "deepseek_v3", model=model, power_of_two=True, tokenizer=tokenizer, ignored_layer=True)
    write_jsonl(data, root / "train.jsonl")
    args = [f"data.path={root / 'train.jsonl'}", f"data.cache_dir={root / 'cache'}", *FAST, *STEPS]
    from fcsd.cli import main

    with torch_threads(1):
        for source in ("fp8", "bf16"):
            assert main(["convert", str(root / source), *args, f"output_dir={root / ('one-' + source)}"]) == 0
    layout = ["parallel.ep_size=2", "parallel.fsdp=true", f"output_dir={root / 'ep-fsdp'}"]
    torchrun(4, "-m", "fcsd.cli", "convert", str(root / "fp8"), *args, *layout, timeout=300)
    return root


def test_fp8_source_converts_as_its_dequantized_copy_in_one_process_and_under_ep_x_fsdp(fp8_runs):
    """Same losses, gradient norms and final/ from the FP8 source and from its dequantized bf16 copy (one
    process), and from the FP8 source read shard by shard under EP 2 x FSDP 2 (each rank dequantizing the blocks
    around its slices) as in one process; final/ is bf16, as the source's dtype says, and records the source."""
    assert_same_training(fp8_runs / "one-fp8", fp8_runs / "one-bf16")
    # final/ is bf16 (the source's dtype): another summation order may round a weight to the neighbouring bf16 value
    assert_same_training(fp8_runs / "ep-fsdp", fp8_runs / "one-fp8")
    assert records_of(fp8_runs / "one-fp8", "train/loss")[0] > 0
    final = json.loads((fp8_runs / "one-fp8" / "final" / "config.json").read_text())
    assert final["dtype"] == "bfloat16" and final[RECORD_KEY]["quantization_config"]["scale_fmt"] == "ue8m0"
    assert "quantization_config" not in final


def _tensors(folder: Path) -> dict:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


@pytest.mark.parametrize("run", ["one-fp8", "ep-fsdp"])
def test_fp8_export_is_the_source_format_within_one_e4m3_step(fp8_runs, run):
    """The export of an FP8 run (one process, or streamed and checked laid out) holds the source's tensors in the
    e4m3 with block scales exactly where the source had them, the rest as final/ holds it, the source's
    quantization_config,
    and dequantizes to final/ within half an e4m3 step of each block (round to nearest), not exactly."""
    export, final = fp8_runs / run / "export", fp8_runs / run / "final"
    source, written, trained = _tensors(fp8_runs / "fp8"), _tensors(export), load_file(str(final / "model.safetensors"))
    source = {k: v for k, v in source.items() if not k.startswith("model.layers.4.")}  # the layer not loaded
    assert written.keys() == source.keys()
    fp8 = {k for k, v in source.items() if v.dtype == torch.float8_e4m3fn}
    assert {k for k, v in written.items() if v.dtype == torch.float8_e4m3fn} == fp8 and len(fp8) > 60
    config = json.loads((export / "config.json").read_text())
    assert (
        config["quantization_config"]
        == json.loads((fp8_runs / "fp8" / "config.json").read_text())["quantization_config"]
    )
    assert RECORD_KEY not in config
    moved = 0.0
    for key, weight in written.items():
        if key.endswith("_scale_inv"):
            continue
        if weight.dtype != torch.float8_e4m3fn:
            assert torch.equal(weight, trained[key]), key  # left as final/ holds it
            continue
        scale = written[key + "_scale_inv"]
        assert scale.dtype == torch.float32 and torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # ue8m0
        rows, cols = (torch.arange(n) // b for n, b in zip(weight.shape, BLOCK, strict=True))
        error = (weight.float() * scale[rows][:, cols] - trained[key].float()).abs()
        assert (error <= e4m3_step(scale, BLOCK, weight.shape) / 2).all(), key
        moved = max(moved, float(error.max()))
    assert moved > 0
    parity = json.loads((export / "fcsd_export.json").read_text())["parity_max_abs_diff"]
    assert 0 < parity  # FP8 rounding shows in the logits the reload-parity check compared


def test_fp8_export_loads_with_fcsd_transformers_and_remote_code(fp8_runs, tmp_path):
    """The FP8 export loads with fcsd.from_pretrained (dequantized by fcsd) and, through its remote code, in
    transformers (which dequantizes on a CPU by itself; it refuses DeepSeek-V3's real 576-row MLA projection with
    5 row blocks, so this is checked on Qwen3-MoE): the same logits; `fcsd export --format bf16` writes the bf16
    weights without quantization_config."""
    from transformers import AutoModelForCausalLM

    from fcsd.cli import main

    export = fp8_runs / "one-fp8" / "export"
    model = fcsd.from_pretrained(str(export))
    assert fcsd.farskip_layers(model) == [0, 1, 2, 3] and model.dtype == torch.bfloat16
    assert main(["export", str(fp8_runs / "one-fp8"), str(tmp_path / "bf16"), "--format", "bf16"]) == 0
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in config and RECORD_KEY not in config
    plain = _tensors(tmp_path / "bf16")
    assert torch.float8_e4m3fn not in {v.dtype for v in plain.values()} and not any("scale" in k for k in plain)

    qwen = tmp_path / "qwen"
    write_fp8_checkpoint(qwen, "qwen3_moe")
    student = fcsd.from_pretrained(str(qwen / "fp8"), layers="all", dtype=torch.bfloat16)
    tokenizer = train_tokenizer(["a b c"], vocab_size=40)
    from fcsd.export.save import export as write_export

    write_export(student, tokenizer, qwen / "export", source=qwen / "fp8")
    ids = torch.randint(97, (2, 12), generator=torch.Generator().manual_seed(0))
    remote = AutoModelForCausalLM.from_pretrained(str(qwen / "export"), trust_remote_code=True)
    ours = fcsd.from_pretrained(str(qwen / "export"))
    torch.testing.assert_close(remote(ids).logits, ours(ids).logits, rtol=0.02, atol=0.02)


def test_a_wrong_fp8_export_fails_its_reload_parity_check(tmp_path, monkeypatch):
    """The reload-parity check of an FP8 export compares logits: scales written twice too large are caught and
    nothing is exported."""
    import fcsd.export.fp8 as out
    from fcsd.block_fp8 import quantize_blocks
    from fcsd.export.save import ExportError
    from fcsd.export.save import export as write_export

    write_fp8_checkpoint(tmp_path, "qwen3_moe")
    student = fcsd.from_pretrained(str(tmp_path / "fp8"), layers="all", dtype=torch.bfloat16)
    tokenizer = train_tokenizer(["a b c"], vocab_size=40)
    monkeypatch.setattr(out, "quantize_blocks", lambda *a: (lambda q, s: (q, 2 * s))(*quantize_blocks(*a)))
    with pytest.raises(ExportError, match="reload parity failed"):
        write_export(student, tokenizer, tmp_path / "export", source=tmp_path / "fp8")
    assert not (tmp_path / "export").exists()


def test_scaled_weights_the_model_does_not_load_leave_the_fp8_export_as_the_source(tmp_path):
    """A DeepSeek-V3 FP8 checkpoint with scaled weights of a layer the model does not load (the release's
    multi-token prediction layer, model.layers.61, which transformers drops): the source record counts only the
    scaled weights the model took, and the FP8 export writes exactly those in e4m3 (refused before: 'would quantize
    N weights where its FP8 source quantized N + k')."""
    from fcsd.export.save import export as write_export

    write_fp8_checkpoint(tmp_path, "deepseek_v3", ignored_layer=True)
    source = _tensors(tmp_path / "fp8")
    loaded = {k for k in source if not k.startswith("model.layers.4.")}
    assert len(loaded) < len(source) and any(k.startswith("model.layers.4.") and "_scale_inv" in k for k in source)
    student = fcsd.from_pretrained(str(tmp_path / "fp8"), layers="all", dtype=torch.bfloat16)
    assert getattr(student.config, RECORD_KEY)["quantized"] == sum(k.endswith("_scale_inv") for k in loaded)
    write_export(student, train_tokenizer(["a b c"], vocab_size=40), tmp_path / "export", source=tmp_path / "fp8")
    written = _tensors(tmp_path / "export")
    assert written.keys() == loaded
    assert {k for k, v in written.items() if v.dtype == torch.float8_e4m3fn} == {
        k for k in loaded if source[k].dtype == torch.float8_e4m3fn
    }
    # the card and the parity record say what was written (both said bfloat16 before)
    said = "float8_e4m3fn with 16x16 block scales (bfloat16 where unquantized)"
    assert json.loads((tmp_path / "export" / "fcsd_export.json").read_text())["dtype"] == said
    assert f"stored in `{said}`" in (tmp_path / "export" / "README.md").read_text()


def test_an_fp8_composite_export_is_refused_up_front_unless_bf16(tmp_path, monkeypatch):
    """A composite export of a block-FP8 source in the source's format is refused in one line naming --format bf16
    before anything is saved (it was refused after save_pretrained, and whatever the format: the staged config
    still held the FP8 record); --format bf16 passes the check."""
    from fcsd.export.composite import CompositeError
    from fcsd.export.composite import check_format as check_composite_format
    from fcsd.export.save import export as write_export

    write_fp8_checkpoint(tmp_path, "qwen3_moe")
    student = fcsd.from_pretrained(str(tmp_path / "fp8"), layers="all", dtype=torch.bfloat16)
    monkeypatch.setattr(type(student), "save_pretrained", lambda *a, **k: pytest.fail("saved before the refusal"))
    tokenizer = train_tokenizer(["a b c"], vocab_size=40)
    with pytest.raises(CompositeError, match=r"exported in bf16: pass --format bf16") as caught:
        write_export(student, tokenizer, tmp_path / "out", source=tmp_path / "fp8", composite=("scout", None))
    assert "\n" not in str(caught.value) and not (tmp_path / "out").exists()
    check_composite_format(("scout", None), None)  # --format bf16: no FP8 record to write back


def test_an_fp8_export_whose_names_differ_is_refused_before_any_file_is_rewritten(tmp_path):
    """The export's weights to quantize are compared with the source's by name (count and digest), from the files'
    headers, before any file is rewritten: one line naming --format bf16, the staged files untouched."""
    from fcsd.block_fp8 import scaled_record
    from fcsd.export.fp8 import quantize_folder

    write_fp8_checkpoint(tmp_path, "qwen3_moe")
    student = fcsd.from_pretrained(str(tmp_path / "fp8"), layers="all", dtype=torch.bfloat16)
    student.save_pretrained(tmp_path / "staged")
    record = getattr(student.config, RECORD_KEY)
    before = (tmp_path / "staged" / "model.safetensors").read_bytes()
    names = sorted(k for k, v in _tensors(tmp_path / "fp8").items() if v.dtype == torch.float8_e4m3fn)
    renamed = {**record, **scaled_record([*names[:-1], names[-1] + ".renamed"])}  # as many, one name differs
    with pytest.raises(ValueError, match="names differ from the source's.*--format bf16") as caught:
        quantize_folder(tmp_path / "staged", renamed)
    assert "\n" not in str(caught.value)
    assert (tmp_path / "staged" / "model.safetensors").read_bytes() == before
    assert quantize_folder(tmp_path / "staged", record) == len(names)


def test_the_fp8_export_writes_block_scales_in_the_sources_dtype(tmp_path):
    """A source whose ``weight_scale_inv`` are bf16 gets bf16 scales back (they were written fp32), the weights the
    same e4m3 blocks."""
    from fcsd.export.fp8 import quantize_folder

    write_fp8_checkpoint(tmp_path, "qwen3_moe")
    path = tmp_path / "fp8" / "model.safetensors"
    state = load_file(str(path))
    save_file({k: v.to(torch.bfloat16) if k.endswith("_scale_inv") else v for k, v in state.items()}, str(path))
    student = fcsd.from_pretrained(str(tmp_path / "fp8"), layers="all", dtype=torch.bfloat16)
    student.save_pretrained(tmp_path / "staged")
    assert quantize_folder(tmp_path / "staged", getattr(student.config, RECORD_KEY)) > 0
    written = _tensors(tmp_path / "staged")
    scales = [v.dtype for k, v in written.items() if k.endswith("_scale_inv")]
    assert scales and set(scales) == {torch.bfloat16}
    # the record's scale dtype is how the export stores scales, not the model: a teacher cache made before it stays
    from fcsd.distill.teacher_cache import model_fingerprint

    before = model_fingerprint(student)
    getattr(student.config, RECORD_KEY).pop("scale_dtype")
    assert model_fingerprint(student) == before


def test_an_export_holds_no_multi_token_prediction_layer_and_says_so(tmp_path):
    """transformers loads no multi-token-prediction layer (DeepSeek-V3's ``num_nextn_predict_layers``): the export
    holds none, and its config says 0 rather than promising one to a speculative decoder."""
    from fcsd.export.save import export as write_export

    model = build("deepseek_v3")
    model.config.num_nextn_predict_layers = 1
    tokenizer = train_tokenizer(["a b c"], vocab_size=40)
    write_export(fcsd.apply_farskip(model, "last:1"), tokenizer, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 0
    assert not any(key.startswith(f"model.layers.{config['num_hidden_layers']}.") for key in _tensors(tmp_path / "out"))


def test_an_fp8_weight_without_its_scale_is_refused_in_one_line(tmp_path):
    """An e4m3 weight whose ``weight_scale_inv`` a partial copy lost would load as its raw codes (weights up to 448
    times too large, silently): refused, naming the tensor and its missing scale."""
    write_fp8_checkpoint(tmp_path, "qwen3_moe")
    state = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    del state[key + "_scale_inv"]
    save_file(state, str(tmp_path / "fp8" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{key} is stored in FP8 without its scale {key}_scale_inv") as caught:
        fcsd.from_pretrained(str(tmp_path / "fp8"))
    assert "\n" not in str(caught.value)


def test_fp8_teacher_modules_are_refused_without_fp8_kernels(tmp_path, monkeypatch):
    """teacher.dtype=fp8 keeps transformers' FP8 modules only where FP8 kernels run (CUDA, compute capability >=
    8.9): without them (no CUDA, as on this CPU) it is refused in one line saying why, as it is for a source that
    is not FP8."""
    from fcsd.block_fp8 import check_fp8_modules

    write_fp8_checkpoint(tmp_path, "qwen3_moe")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"teacher.dtype=fp8 needs FP8 kernels \(a CUDA GPU of compute capability"):
        fcsd.from_pretrained(str(tmp_path / "fp8"), keep_fp8=True)
    with pytest.raises(ValueError, match="is not FP8: use auto"):
        check_fp8_modules(None, "a bf16 checkpoint")
