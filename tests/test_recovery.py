"""Recovery recipes: a recipe the run cannot follow is refused in one line; the recovery benchmark's held-out set is
not trained on. The helpers here serve the recipes' own tests (test_guided.py, test_schedule_free.py, ...)."""

import copy
import json
from pathlib import Path

import pytest
import torch
from test_trainer import FAST as TRAINER_FAST
from test_trainer import config_for as trainer_config_for
from test_trainer import pretrained_assets
from tiny_models import build

from fcsd.cli import main
from fcsd.connectivity import apply_farskip
from fcsd.distill import trainer
from fcsd.distill.data import Packed

FAST = [*TRAINER_FAST, "export=false"]  # the trainer tests' short runs, without the export


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: these tiny models run faster so on a shared machine, and the same on any."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny Qwen3-MoE teacher briefly pretrained on chat data (so the conversion visibly hurts it) and the data."""
    return pretrained_assets(tmp_path_factory.mktemp("assets"), rows=120, steps=40, batch_size=4)


def convert_args(assets, *extra) -> list[str]:
    """`fcsd convert` of the assets' teacher on their data, with the fast settings (no export), then ``extra``."""
    args = ["convert", str(assets / "model"), f"data.path={assets / 'train.jsonl'}", f"data.cache_dir={assets / 'c'}"]
    return [*args, *FAST, *extra]


def config_for(assets, out, *overrides):
    return trainer_config_for(assets, out, *overrides, fast=FAST)


def records(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _batch(vocab: int, seed: int = 0) -> Packed:
    ids = torch.randint(3, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))
    return Packed(ids, torch.arange(16).repeat(2, 1))


class Killed(Exception):
    """Raised by :func:`killed_at` after a logged step: the run stops there as a kill would, its checkpoints kept."""


def killed_at(monkeypatch, argv: list[str], step: int) -> None:
    """Run ``fcsd argv`` and stop it right after step ``step`` is logged."""
    original = trainer.TrainingSession.log_step

    def dying(self, done, *rest, **keywords):
        original(self, done, *rest, **keywords)
        if done == step:
            raise Killed

    monkeypatch.setattr(trainer.TrainingSession, "log_step", dying)
    try:
        with pytest.raises(Killed):
            main(argv)
    finally:
        monkeypatch.setattr(trainer.TrainingSession, "log_step", original)


def _models(name: str):
    teacher = build(name).requires_grad_(False)
    student = apply_farskip(copy.deepcopy(teacher).requires_grad_(True), "all")
    return teacher, student


def test_recovery_refusals_are_one_line(assets, tmp_path):
    cases = {
        ("recovery.optimizer=sgd",): "choose one of adamw, schedule_free",
        ("recovery.lr_scale=0",): "finite number > 0",
        ("recovery.warmup_share=1.5",): "[0, 1)",
        ("recovery.hidden_l2=-1",): "finite number >= 0",
        ("recovery=guided", "recovery.hidden_l2_share=0"): "(0, 1]",
        ("recovery=plain", "train.warmup_steps=10"): "longer than the run",
    }
    for overrides, fix in cases.items():
        with pytest.raises(ValueError, match=None) as error:
            config_for(assets, tmp_path / "x", "train.max_steps=4", *overrides)
        assert fix in str(error.value) and "\n" not in str(error.value), (overrides, error.value)


def test_the_recovery_benchmark_scores_windows_it_does_not_train_on(tmp_path, monkeypatch):
    """benchmarks/recovery.py's held-out set: a window of each chosen document, cut out of the training text (the
    text on either side stays), nothing lost and nothing in both."""
    import importlib.util
    import random

    script = Path(__file__).parents[1] / "benchmarks" / "recovery.py"
    spec = importlib.util.spec_from_file_location("recovery_bench", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "HELD_FILES", 3)
    monkeypatch.setattr(bench, "HELD_CHARS", 12)
    letters = random.Random(1)
    documents = ["".join(letters.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(40)) for _ in range(6)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    train, held = bench.split(tmp_path, corpus)
    windows = [json.loads(line)["text"] for line in held.read_text().splitlines()]
    rest = [json.loads(line)["text"] for line in train.read_text().splitlines()]
    assert len(windows) == 3 and all(len(w) == 12 and any(w in d for d in documents) for w in windows)
    assert not any(w in text for w in windows for text in rest)
    assert sum(map(len, rest)) + sum(map(len, windows)) == sum(map(len, documents))
    assert len(rest) > len(documents)  # a cut document trains as the text before and after its window
