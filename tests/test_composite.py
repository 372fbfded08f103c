"""Composite checkpoints (Llama-4 Scout as the hub ships it, ``Llama4ForConditionalGeneration``): fcsd convert trains
the text tower and exports the composite, its vision tower and projector copied byte for byte from the source, the
text tower the trained student's; it loads and generates from text and from an image with fcsd and through the
remote code; ``--text-only`` drops the vision tower and says so; a source that went away is refused in one line."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_recipes import compose, to_config
from test_trainer import FAST
from tiny_models import CONFIGS

import fcsd
from fcsd.cli import main
from fcsd.distill.convert import convert
from fcsd.embedded.synthetic import make_dataset, write_jsonl
from fcsd.embedded.tokenizer import train_tokenizer
from fcsd.export.composite import SOURCE_KEY, CompositeError
from fcsd.export.save import export_checkpoint
from fcsd.serving.served_families import BY_ARCHITECTURE


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            out.update((key, handle.get_tensor(key)) for key in handle.keys())
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture(scope="module")
def scout(tmp_path_factory):
    """A tiny Llama-4 composite in bf16 (vision tower, projector, text MoE) converted by fcsd convert: 2 steps."""
    root = tmp_path_factory.mktemp("scout")
    rows = make_dataset(80, seed=3)
    tokenizer = train_tokenizer((m["content"] for r in rows for m in r["messages"]), vocab_size=200)
    cls, config = CONFIGS["llama4_multimodal"]()
    config.text_config.vocab_size = len(tokenizer)
    config.image_token_index = len(tokenizer) - 1
    torch.manual_seed(0)
    cls(config).to(torch.bfloat16).save_pretrained(root / "source")
    tokenizer.save_pretrained(root / "source")
    (root / "source" / "preprocessor_config.json").write_text('{"image_processor_type": "Llama4ImageProcessorFast"}')
    write_jsonl(rows, root / "chat.jsonl")
    result = convert(run_config(root / "source", root / "run", root / "chat.jsonl", "train.max_steps=2"))
    return {"root": root, "source": root / "source", "run": root / "run", "final": result.final_dir, "config": config}


def run_config(source: Path, output_dir: Path, data: Path, *overrides: str):
    names = [f"model.name={source}", f"data.path={data}", f"output_dir={output_dir}"]
    return to_config(compose([*names, *FAST, *overrides]))


def image_inputs(config):
    """Text with one image token and a random image of the vision config's size (no processor needed)."""
    vision = config.vision_config
    generator = torch.Generator().manual_seed(1)
    pixel_values = torch.randn(1, 3, vision.image_size, vision.image_size, generator=generator).to(torch.bfloat16)
    image = torch.tensor([[1, 5, config.image_token_index, 7, 9]])
    return {"text": torch.tensor([[1, 5, 7, 9, 11, 13]]), "image": image, "pixel_values": pixel_values}


def test_the_export_is_the_composite_with_the_source_vision_tower_and_the_trained_text_tower(scout):
    export = scout["run"] / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["FarSkipLlama4ForConditionalGeneration"]
    assert BY_ARCHITECTURE["FarSkipLlama4ForConditionalGeneration"].architecture == "Llama4ForConditionalGeneration"
    assert config["model_type"] == "farskip_llama4" and config["text_config"]["model_type"] == "llama4_text"
    assert config["vision_config"] == json.loads((scout["source"] / "config.json").read_text())["vision_config"]
    final_config = json.loads((scout["final"] / "config.json").read_text())
    assert config["farskip"]["layers"] == final_config["farskip"]["layers"]
    assert final_config[SOURCE_KEY] == "Llama4ForConditionalGeneration"  # recorded by fcsd convert
    assert SOURCE_KEY not in config and SOURCE_KEY not in config["text_config"]
    assert config["auto_map"]["AutoModelForImageTextToText"] == "modeling_farskip.FarSkipForCausalLM"
    processor = "preprocessor_config.json"
    assert (export / processor).read_text() == (scout["source"] / processor).read_text()

    exported, source, final = tensors(export), tensors(scout["source"]), tensors(scout["final"])
    vision = [key for key in source if not key.startswith("language_model.")]
    assert any(k.startswith("vision_model.") for k in vision) and any(k.startswith("multi_modal_") for k in vision)
    assert all(same_bits(exported[key], source[key]) for key in vision)  # bit for bit, bf16 as the source
    assert sorted(exported) == sorted(vision + [f"language_model.{key}" for key in final])
    assert all(same_bits(exported[f"language_model.{key}"], final[key]) for key in final)
    trained = [key for key in final if not torch.equal(final[key], source[f"language_model.{key}"])]
    assert trained  # the text tower is the trained student, not the source's
    index = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(index) == sorted(exported)


@torch.no_grad()
def test_the_composite_export_generates_from_text_and_an_image_with_fcsd_and_remote_code(scout, tmp_path):
    export = scout["run"] / "export"
    model = fcsd.from_pretrained(str(export)).eval()
    assert type(model).__name__ == "Llama4ForConditionalGeneration"
    student = fcsd.from_pretrained(str(scout["final"])).eval()
    assert fcsd.farskip_layers(model) == fcsd.farskip_layers(student) != []
    inputs = image_inputs(scout["config"])
    text = model(input_ids=inputs["text"]).logits
    torch.testing.assert_close(text, student(input_ids=inputs["text"]).logits, rtol=0, atol=0)
    image = model(input_ids=inputs["image"], pixel_values=inputs["pixel_values"]).logits
    other = torch.zeros_like(inputs["pixel_values"])
    assert not torch.equal(image, model(input_ids=inputs["image"], pixel_values=other).logits)  # the image counts
    generated = model.generate(
        input_ids=inputs["image"], pixel_values=inputs["pixel_values"], max_new_tokens=4, do_sample=False
    )
    assert generated.shape == (1, inputs["image"].shape[1] + 4)
    assert model.generate(input_ids=inputs["text"], max_new_tokens=3, do_sample=False).shape[1] == 9

    torch.save(inputs, tmp_path / "inputs.pt")
    worker = Path(__file__).parent / "workers" / "composite_remote_code.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, str(worker), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt"), str(export)]
    subprocess.run(command, env=env, check=True, capture_output=True, stdin=subprocess.DEVNULL)
    remote = torch.load(tmp_path / "out.pt")
    assert remote["class"] == "Llama4ForConditionalGeneration"
    torch.testing.assert_close(remote["text"], text)
    torch.testing.assert_close(remote["image"], image)
    assert torch.equal(remote["generated"], generated)


def test_text_only_export_drops_the_vision_tower_and_says_so(scout, tmp_path, capsys):
    assert main(["export", str(scout["run"]), str(tmp_path / "text"), "--text-only"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "vision tower" in line]
    assert len(said) == 1 and "text-only export" in said[0] and "Llama4ForCausalLM" in said[0], said
    vision = [k for k in tensors(scout["source"]) if not k.startswith("language_model.")]
    assert f"({len(vision)} tensors)" in said[0]  # counted from the source's headers at hand
    config = json.loads((tmp_path / "text" / "config.json").read_text())
    assert config["architectures"] == ["FarSkipLlama4ForCausalLM"] and "vision_config" not in config
    assert not [key for key in tensors(tmp_path / "text") if "vision" in key or "multi_modal" in key]


def test_a_text_only_export_needs_no_source_and_downloads_nothing(scout, tmp_path, capsys, monkeypatch):
    """--text-only of a composite run whose source went away: the one-line note without the tensor count (which
    comes only from files at hand: nothing is downloaded), and the export is written."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("downloads the source"))
    moved = scout["root"] / "moved-away"
    shutil.move(scout["source"], moved)
    try:
        assert main(["export", str(scout["run"]), str(tmp_path / "text"), "--text-only"]) == 0
    finally:
        shutil.move(moved, scout["source"])
    said = [line for line in capsys.readouterr().out.splitlines() if "vision tower" in line]
    assert len(said) == 1 and "text-only export" in said[0] and "tensors" not in said[0], said
    assert json.loads((tmp_path / "text" / "config.json").read_text())["architectures"] == ["FarSkipLlama4ForCausalLM"]


def test_a_composite_export_whose_source_went_away_is_refused_in_one_line(scout, tmp_path):
    moved = scout["root"] / "moved"
    shutil.move(scout["source"], moved)
    try:
        with pytest.raises(CompositeError, match="--text-only") as caught:
            export_checkpoint(scout["run"], tmp_path / "out")
        assert "\n" not in str(caught.value)
        assert not (tmp_path / "out").exists()
    finally:
        shutil.move(moved, scout["source"])


def test_convert_with_export_text_only_says_so_and_a_composite_export_converts_again(scout, tmp_path, capsys):
    data = scout["root"] / "chat.jsonl"
    convert(run_config(scout["source"], tmp_path / "text", data, "train.max_steps=1", "export_text_only=true"))
    said = [line for line in capsys.readouterr().out.splitlines() if "vision tower" in line]
    assert len(said) == 1 and "text-only export" in said[0], said
    assert json.loads((tmp_path / "text" / "export" / "config.json").read_text())["model_type"] == "farskip_llama4_text"

    export = scout["run"] / "export"  # a composite FarSkip export as the source of another run
    convert(run_config(export, tmp_path / "again", data, "train.max_steps=1"))
    config = json.loads((tmp_path / "again" / "export" / "config.json").read_text())
    assert config["architectures"] == ["FarSkipLlama4ForConditionalGeneration"]
    assert config["farskip"]["base_architectures"] == ["Llama4ForConditionalGeneration"]
    again, first = tensors(tmp_path / "again" / "export"), tensors(export)
    assert all(same_bits(again[key], first[key]) for key in first if not key.startswith("language_model."))


def test_a_composite_trains_from_its_teacher_cache(scout, tmp_path):
    """Scout's preset trains from the teacher cache: the student's record of its composite source is no part of the
    model the cache was made of (it was, and the cache of the same model was refused as another model's)."""
    common = [str(scout["source"]), f"data.path={scout['root'] / 'chat.jsonl'}", *FAST, "teacher.top_k=16"]
    common += [f"teacher.cache_dir={tmp_path / 'cache'}"]
    assert main(["cache-teacher", *common]) == 0
    run = tmp_path / "run"
    assert main(["convert", *common, "teacher.mode=cache", "train.max_steps=1", f"output_dir={run}"]) == 0
    assert json.loads((run / "export" / "config.json").read_text())["architectures"] == [
        "FarSkipLlama4ForConditionalGeneration"
    ]


def test_the_export_reads_the_runs_own_source_from_any_folder(scout, tmp_path, monkeypatch):
    """A run started with a relative model.name records its source's absolute path: its export from another folder,
    where the same relative name is another Llama-4 checkpoint, puts back the run's own vision tower."""
    shutil.copytree(scout["source"], tmp_path / "started_here" / "scout")
    monkeypatch.chdir(tmp_path / "started_here")
    data = scout["root"] / "chat.jsonl"
    names = ["model.name=scout", f"data.path={data}", f"output_dir={tmp_path / 'run'}", "train.max_steps=1"]
    convert(to_config(compose([*names, *FAST])))
    other = tmp_path / "elsewhere" / "scout"
    torch.manual_seed(5)
    type(fcsd.from_pretrained(str(scout["source"])))(scout["config"]).to(torch.bfloat16).save_pretrained(other)
    monkeypatch.chdir(tmp_path / "elsewhere")
    export_checkpoint(tmp_path / "run", tmp_path / "out")
    exported, source, unrelated = tensors(tmp_path / "out"), tensors(scout["source"]), tensors(other)
    vision = [key for key in source if not key.startswith("language_model.")]
    assert vision and all(same_bits(exported[key], source[key]) for key in vision)
    assert not all(same_bits(exported[key], unrelated[key]) for key in vision)


def fp8_composite(source: Path, out: Path) -> Path:
    """``source`` (a bf16 Llama-4 composite) with its text tower's linear weights in block FP8 (e4m3, 16 x 16 block
    scales, as the hub's FP8 releases store them) and the vision tower and projector left in bf16."""
    from safetensors.torch import save_file

    from fcsd.block_fp8 import quantize_blocks

    state = tensors(source)
    text_linear = [
        key
        for key, tensor in state.items()
        if key.startswith("language_model.") and key.endswith("proj.weight") and tensor.ndim == 2
    ]
    for key in text_linear:
        state[key], state[key + "_scale_inv"] = quantize_blocks(state[key], [16, 16])
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [16, 16],
        "activation_scheme": "dynamic",
    }
    (out / "config.json").write_text(json.dumps(config))
    assert text_linear
    return out


def test_an_fp8_composite_converts_to_a_bf16_composite_export_and_its_source_format_is_refused_up_front(
    scout, tmp_path
):
    """A block-FP8 Llama-4 composite: the default export (the source's format, which fcsd does not write for
    composites) is refused before anything trains or is written; with export_format=bf16 the text tower trains from
    the dequantized weights (the teacher loads too: its composite config used to be handed to the text class) and the
    export is the bf16 composite, vision tower bit for bit the source's, no FP8 record, loading as the composite."""
    source = fp8_composite(scout["source"], tmp_path / "fp8")
    data = scout["root"] / "chat.jsonl"
    with pytest.raises(CompositeError, match=r"exported in bf16: pass --format bf16") as caught:
        convert(run_config(source, tmp_path / "refused", data, "train.max_steps=1"))
    assert "\n" not in str(caught.value) and not (tmp_path / "refused").exists()

    convert(run_config(source, tmp_path / "run", data, "train.max_steps=1", "export_format=bf16"))
    export = tmp_path / "run" / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["FarSkipLlama4ForConditionalGeneration"] and "quantization_config" not in config
    exported, original = tensors(export), tensors(source)
    vision = [key for key in original if not key.startswith("language_model.")]
    assert vision and all(same_bits(exported[key], original[key]) for key in vision)
    assert not any(key.endswith("_scale_inv") for key in exported)
    text = [key for key in exported if key.startswith("language_model.")]
    assert text and all(exported[key].dtype == torch.bfloat16 for key in text)
    model = fcsd.from_pretrained(str(export))
    assert type(model).__name__ == "Llama4ForConditionalGeneration" and model.config.farskip["layers"]


def test_an_fp8_composite_exports_its_text_model_in_fp8_and_caches_its_teacher(scout, tmp_path):
    """``--text-only`` of a run from a block-FP8 composite writes the text model in the source's FP8: the weights
    the source scaled (its file names them under ``language_model.``) quantized again with their scales, the rest as
    trained. And ``fcsd cache-teacher``, which exports nothing, takes the FP8 composite without an export format."""
    source = fp8_composite(scout["source"], tmp_path / "fp8")
    data = scout["root"] / "chat.jsonl"
    convert(run_config(source, tmp_path / "run", data, "train.max_steps=1", "export_text_only=true"))
    export = tmp_path / "run" / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "farskip_llama4_text" and config["quantization_config"]["quant_method"] == "fp8"
    exported, original = tensors(export), tensors(source)
    scaled = sorted(key.removeprefix("language_model.") for key in original if key.endswith("_scale_inv"))
    assert scaled and scaled == sorted(key for key in exported if key.endswith("_scale_inv"))
    assert all(exported[key.removesuffix("_scale_inv")].dtype == torch.float8_e4m3fn for key in scaled)
    assert exported["lm_head.weight"].dtype == torch.bfloat16  # kept unquantized, as the source kept it

    cache = ["teacher.top_k=16", f"teacher.cache_dir={tmp_path / 'cache'}", f"data.path={data}", *FAST]
    assert main(["cache-teacher", str(source), *cache]) == 0
