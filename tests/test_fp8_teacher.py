"""An FP8 teacher (``teacher.dtype=fp8``): its kernel is resolved before any model loads, and the cache it makes
is the cache of the model the training run fingerprints (fcsd reads the same checkpoint dequantized)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import transformers
from fp8_models import write_fp8_checkpoint
from tiny_models import build

import fcsd.block_fp8
import fcsd.loading
from fcsd.block_fp8 import RECORD_KEY
from fcsd.cli import main
from fcsd.distill.teacher_cache import model_fingerprint
from fcsd.embedded.synthetic import make_dataset, write_jsonl
from fcsd.embedded.tokenizer import train_tokenizer


def _fp8_source(root: Path) -> Path:
    data = make_dataset(20, seed=3)
    tokenizer = train_tokenizer((m["content"] for r in data for m in r["messages"]), vocab_size=200)
    model = build("deepseek_v3")
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    write_fp8_checkpoint(root, "deepseek_v3", model=model, tokenizer=tokenizer)
    write_jsonl(data, root / "train.jsonl")
    return root / "fp8"


def test_an_offline_fp8_teacher_without_its_kernel_is_refused_in_one_line_before_any_model_loads(
    tmp_path, monkeypatch, capsys
):
    source = _fp8_source(tmp_path)
    capsys.readouterr()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(fcsd.block_fp8, "fp8_kernels_available", lambda capability=None: True)  # as on an H100
    loaded = []
    monkeypatch.setattr(fcsd.loading, "from_pretrained", lambda *a, **k: loaded.append(a))
    argv = [str(source), f"data.path={tmp_path / 'train.jsonl'}", "teacher.dtype=fp8", "data.seq_len=32"]
    for command in (["cache-teacher", *argv, f"teacher.cache_dir={tmp_path / 'tc'}"], ["convert", *argv]):
        assert main([*command, f"output_dir={tmp_path / 'run'}"]) == 2
        said = capsys.readouterr().err.strip().splitlines()
        assert len(said) == 1 and "finegrained-fp8" in said[0] and "teacher.dtype=auto" in said[0], said
    assert loaded == [] and not (tmp_path / "run").exists() and not (tmp_path / "tc").exists()


def test_an_fp8_teachers_cache_is_the_cache_of_the_dequantized_model(tmp_path):
    """The FP8 teacher keeps transformers' ``quantization_config`` (on a GPU), the run's student and a dequantized
    teacher carry fcsd's record of it: one model, one fingerprint; another block size is another model."""
    source = _fp8_source(tmp_path)
    dequantized = fcsd.loading.from_pretrained(str(source), dtype=torch.bfloat16, text_only=True)
    student = fcsd.loading.from_pretrained(str(source), dtype=torch.float32, text_only=True, layers="all")
    settings = getattr(dequantized.config, RECORD_KEY)["quantization_config"]
    kept = copy.deepcopy(dequantized)  # the config transformers gives a teacher that keeps its FP8 modules
    delattr(kept.config, RECORD_KEY)
    options = {k: v for k, v in settings.items() if k not in ("quant_method", "fmt")}
    kept.config.quantization_config = transformers.FineGrainedFP8Config(**options)
    assert model_fingerprint(kept) == model_fingerprint(dequantized) == model_fingerprint(student)
    kept.config.quantization_config = transformers.FineGrainedFP8Config(**{**options, "weight_block_size": [8, 8]})
    assert model_fingerprint(kept) != model_fingerprint(student)
