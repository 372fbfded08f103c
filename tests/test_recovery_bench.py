"""The fair recovery benchmark (``benchmarks/recovery.py --fair``): the held-out accuracy and agreement
figures, the LR sweep's choice of the best LR and its edges, a report whose summary counts only the teachers the
recipe was not chosen on, a deterministic prose corpus whose held-out windows are not trained on, and kept run
records reused only when they were made of the same teacher and text. Tiny inputs, no pretraining."""

import copy
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_models import build

from fcsd.distill.data import Packed
from fcsd.distill.heldout import heldout_metrics

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    """``benchmarks/recovery.py`` as a module (it imports ``recovery_fair`` from its own folder)."""
    spec = importlib.util.spec_from_file_location("recovery_bench_fair", BENCHMARKS / "recovery.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fair(bench):
    return sys.modules["recovery_fair"]


def _held(vocab: int) -> Packed:
    """Two rows of 24 tokens; the second row holds two documents (a label-free token at the boundary)."""
    ids = torch.randint(3, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.stack([torch.arange(24), torch.cat([torch.arange(10), torch.arange(14)])])
    return Packed(ids, positions)


def _config(micro_batch: int = 1, chunk: int = 7):
    return SimpleNamespace(train=SimpleNamespace(micro_batch_size=micro_batch, loss_chunk_size=chunk, temperature=1.0))


def _argmax_figures(model, held: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """Independently of fcsd: the model's argmax per token (each document of a row run on its own) and the
    next-token labels (-100: none)."""
    rows = []
    for ids, positions in zip(held.input_ids, held.position_ids, strict=True):
        starts = [*torch.nonzero(positions == 0).flatten().tolist(), len(positions)]
        with torch.no_grad():
            rows.append(torch.cat([model(input_ids=ids[None, a:b]).logits[0] for a, b in zip(starts, starts[1:])]))
    logits = torch.stack(rows)
    labels = torch.full_like(held.input_ids, -100)
    same = held.position_ids[:, 1:] == held.position_ids[:, :-1] + 1
    labels[:, :-1] = torch.where(same, held.input_ids[:, 1:], -100)
    return logits.argmax(-1), labels


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_heldout_accuracy_and_agreement_with_the_teacher(family):
    """A student equal to its teacher agrees on every token and has its accuracy; a perturbed one agrees less, and
    every figure equals the one computed from the models' own logits (labels only inside a document)."""
    teacher = build(family)
    held = _held(teacher.config.vocab_size)
    same = heldout_metrics(copy.deepcopy(teacher), held, _config(), teacher)
    assert same["eval/top1_agree"] == 1.0
    assert same["eval/acc"] == same["eval/teacher_acc"]
    assert same["eval/kl"] == pytest.approx(0.0, abs=1e-6)

    student = copy.deepcopy(teacher)
    with torch.no_grad():
        student.get_output_embeddings().weight.add_(torch.randn_like(student.get_output_embeddings().weight))
    got = heldout_metrics(student, held, _config(micro_batch=2, chunk=5), teacher)
    student_top, labels = _argmax_figures(student, held)
    teacher_top, _ = _argmax_figures(teacher, held)
    labelled = labels != -100
    assert labelled.sum() == 2 * 24 - 3  # each row's last token and the document boundary have no label
    assert got["eval/top1_agree"] == pytest.approx((student_top == teacher_top).float().mean().item())
    assert got["eval/top1_agree"] < 1.0
    assert got["eval/acc"] == pytest.approx((student_top == labels)[labelled].float().mean().item())
    assert got["eval/teacher_acc"] == pytest.approx((teacher_top == labels)[labelled].float().mean().item())
    assert got["eval/teacher_acc"] == same["eval/teacher_acc"]


def test_the_sweep_picks_the_lowest_kl_and_flags_an_edge(fair):
    inside = {1e-3: 0.12, 4e-4: 0.13, 2.5e-3: 0.126}
    assert fair.best_lr(inside) == (1e-3, None)
    assert fair.extension(inside, 2.5) is None
    assert fair.flatness(inside) == pytest.approx({4e-4: 0.13 / 0.12, 2.5e-3: 0.126 / 0.12})
    high = {4e-4: 0.14, 1e-3: 0.13, 2.5e-3: 0.12}
    assert fair.best_lr(high) == (2.5e-3, "high")
    assert fair.extension(high, 2.5) == pytest.approx(6.25e-3)
    low = {4e-4: 0.11, 1e-3: 0.13, 2.5e-3: 0.15}
    assert fair.best_lr(low) == (4e-4, "low")
    assert fair.extension(low, 2.5) == pytest.approx(1.6e-4)
    assert fair.flatness(low) == pytest.approx({1e-3: 0.13 / 0.11})
    with pytest.raises(ValueError, match="at least two LRs"):
        fair.best_lr({1e-3: 0.1})


def _result(teacher: str, recipe: str, lr: float, steps: int, curve: list[tuple[int, float]]) -> dict:
    return {
        "teacher": teacher,
        "recipe": recipe,
        "lr": lr,
        "steps": steps,
        "lr_scale": 4.0 if recipe == "guided" else 1.0,
        "curve": [(s, kl, 3.0) for s, kl in curve],
        "agreement": [(steps, 0.4, 0.5, 0.8)],
    }


def test_the_report_compares_best_lrs_and_sums_up_only_the_reported_teachers(fair):
    teachers = {
        "seen": fair.Teacher("seen", "qwen3_moe", "code", 10, "chosen"),
        "held": fair.Teacher("held", "deepseek_v2", "prose", 30, "reported"),
    }
    results = []
    for name in teachers:
        results += [
            # plain is best at 1e-3 (final 0.10); guided best at 4e-4 reaches 0.10 at step 3 of 6
            _result(name, "plain", 4e-4, 6, [(0, 0.5), (6, 0.12)]),
            _result(name, "plain", 1e-3, 6, [(0, 0.5), (3, 0.2), (6, 0.10)]),
            _result(name, "plain", 2.5e-3, 6, [(0, 0.5), (6, 0.11)]),
            _result(name, "guided", 4e-4, 6, [(0, 0.5), (3, 0.10), (6, 0.08)]),
            _result(name, "guided", 1e-3, 6, [(0, 0.5), (6, 0.085)]),
        ]
    results += [  # long runs at the best LRs on the reported teacher only, and plain at one more LR, better there
        _result("held", "plain", 1e-3, 18, [(0, 0.5), (18, 0.07)]),
        _result("held", "plain", 2.5e-3, 18, [(0, 0.5), (18, 0.068)]),
        _result("held", "guided", 4e-4, 18, [(0, 0.5), (3, 0.09), (6, 0.07), (12, 0.066), (18, 0.06)]),
    ]
    lines = fair.fair_report(results, teachers, 6, 18, lr_scales={"guided": 4.0})
    text = "\n".join(lines)
    assert "best 0.001;" in text  # plain's best, inside its sweep
    assert "best 0.0016 AT THE LOW EDGE" in text  # guided's effective LR: 4e-4 x 4
    assert "neighbours / best: 0.0004: 1.200, 0.0025: 1.100" in text
    assert text.count("tokens to plain's KL@6 (0.1000): 0.50x") == 2
    assert "tokens to plain's KL@18 (at 0.0025) (0.0680): 0.67x" in text  # plain's best at 18 steps, not at 6
    summary = lines[-1]
    assert summary.startswith("reported teachers only") and "held" in summary and "seen" not in summary
    assert "0.50x of plain's tokens to its KL@6, 0.67x to its KL@18" in summary
    rows = fair.fair_table(results, teachers, 6, 18, lr_scales={"guided": 4.0})
    held_rows = rows[rows.index(next(r for r in rows if r.startswith("| held (reported)"))) :]
    assert held_rows[0].split(" | ")[1:4] == [
        "plain",
        "0.0004: 0.1200, 0.001: 0.1000, 0.0025: 0.1100",
        "0.001 (1.200, 1.100)",
    ]
    guided = held_rows[1].split(" | ")
    assert guided[1] == "guided" and guided[3] == "0.0016 (low edge) (1.062)"
    assert guided[4:] == ["0.1000 (step 3)", "0.0800", "0.0600", "0.50x", "0.67x", "0.400/0.500/0.800 |"]
    assert held_rows[0].split(" | ")[6] == "0.0680 (at 0.0025)"


def _words(seed: int, count: int) -> str:
    """``count`` random five-letter words: text no window of which repeats elsewhere."""
    import random

    letters = random.Random(seed)
    return " ".join("".join(letters.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5)) for _ in range(count))


def _site_packages(root: Path) -> Path:
    """A fake site-packages: two packages' docs, a licence, a short file, a long description with its header."""
    (root / "alpha").mkdir(parents=True)
    (root / "beta" / "docs").mkdir(parents=True)
    (root / "alpha-1.0.dist-info").mkdir()
    (root / "alpha-1.0.dist-info" / "METADATA").write_text(
        "Name: alpha\nVersion: 1.0\n\nalpha described. " + _words(0, 100)
    )
    (root / "alpha" / "README.md").write_text("alpha readme. " + _words(1, 120))
    (root / "fcsd-0.1.0.dist-info").mkdir()  # this project's own README, which changes with every commit
    (root / "fcsd-0.1.0.dist-info" / "METADATA").write_text("Name: fcsd\n\nfcsd described. " + _words(9, 100))
    (root / "alpha" / "LICENSE.md").write_text("licence text. " * 60)
    (root / "alpha" / "short.md").write_text("too short")
    for k in range(6):
        (root / "beta" / "docs" / f"page{k}.rst").write_text(f"beta page {k}. " + _words(2 + k, 120))
    return root


def test_the_prose_corpus_is_deterministic_and_its_held_out_windows_are_not_trained_on(fair, bench, tmp_path):
    root = _site_packages(tmp_path / "site")
    first = fair.prose_documents(root, max_chars=10_000, min_chars=100, package_share=0.5)
    assert first == fair.prose_documents(root, max_chars=10_000, min_chars=100, package_share=0.5)
    assert not any("licence" in d or "Version:" in d or d == "too short" or "fcsd" in d for d in first)
    assert any(d.startswith("alpha described.") for d in first) and any(d.startswith("beta page") for d in first)
    capped = fair.prose_documents(root, max_chars=4_000, min_chars=100, package_share=0.25)
    assert sum(len(d) for d in capped if d.startswith("beta")) <= 1_000  # one package's share of the text

    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in first))
    bench.HELD_FILES, bench.HELD_CHARS = 3, 50
    try:
        train, held = bench.split(tmp_path, data)
    finally:
        bench.HELD_FILES, bench.HELD_CHARS = 64, 1200
    windows = [json.loads(line)["text"] for line in held.read_text().splitlines()]
    rest = [json.loads(line)["text"] for line in train.read_text().splitlines()]
    assert len(windows) == 3 and not any(w in text for w in windows for text in rest)
    assert fair.digest(data) == fair.digest(data) and fair.digest(data)["documents"] == len(first)


def test_a_kept_run_record_is_reused_only_for_the_same_teacher_and_text(bench, fair, tmp_path, monkeypatch):
    calls = []

    def fake_run(out, family, model, texts, recipe, steps, args, lr=None, teacher_name=None):
        calls.append((teacher_name, recipe, lr, steps))
        return _result(teacher_name, recipe, lr, steps, [(0, 0.5), (steps, 0.1)])

    monkeypatch.setattr(bench, "run", fake_run)
    rows = {"now": "rows-a"}  # the held-out rows as fcsd packs them (a fake: there is no model here)
    monkeypatch.setattr(bench, "heldout_fingerprint", lambda *a: rows["now"])
    spec = fair.Teacher("t", "qwen3_moe", "prose", 10, "reported")
    args = SimpleNamespace(results=tmp_path / "results", out=tmp_path, stop_at=None, eval_sequences=64)
    digests = {"corpus": {"sha256": "a"}}
    first = bench.fair_run(spec, tmp_path, None, digests, "plain", 1e-3, 6, args)
    assert (tmp_path / "results" / "t" / "plain-lr0.001-6.json").exists()
    assert bench.fair_run(spec, tmp_path, None, digests, "plain", 1e-3, 6, args) == json.loads(json.dumps(first))
    assert len(calls) == 1
    bench.fair_run(spec, tmp_path, None, {"corpus": {"sha256": "b"}}, "plain", 1e-3, 6, args)  # other text
    other = fair.Teacher("t", "qwen3_moe", "prose", 20, "reported")  # another pretraining length
    bench.fair_run(other, tmp_path, None, digests, "plain", 1e-3, 6, args)
    assert len(calls) == 3
    args.stop_at = "00:00"  # past it: nothing new starts, a kept record is still read
    assert bench.fair_run(other, tmp_path, None, digests, "plain", 2e-3, 6, args) is None
    assert bench.fair_run(other, tmp_path, None, digests, "plain", 1e-3, 6, args)["teacher_spec"] == other.spec()
    assert len(calls) == 3
    args.stop_at = None  # a recipe whose settings changed (here its LR multiple) since the record: run again
    monkeypatch.setitem(bench.RECIPES, "plain", ["recovery=plain", "recovery.lr_scale=2"])
    assert (
        bench.fair_run(other, tmp_path, None, digests, "plain", 1e-3, 6, args)["recipe_settings"]["recovery"][
            "lr_scale"
        ]
        == 2
    )
    assert len(calls) == 4
    rows["now"] = "rows-b"  # fcsd packs the held-out file otherwise: the same file, other rows scored
    assert bench.fair_run(other, tmp_path, None, digests, "plain", 1e-3, 6, args)["heldout_rows"] == "rows-b"
    assert len(calls) == 5
    kept = bench.recipe_settings("guided")  # a key removed since the record was made is not compared
    assert bench.same_settings({**kept, "recovery": {**kept["recovery"], "gone": 0.0}}, kept)
    assert not bench.same_settings({**kept, "recovery": {**kept["recovery"], "lr_scale": 2.0}}, kept)
    # a key added since: the record's run had its default, so a preset that sets another value runs again
    older = {**kept, "recovery": {k: v for k, v in kept["recovery"].items() if k != "hidden_l2"}}
    assert not bench.same_settings(older, kept)  # guided sets hidden_l2 = 4, the default is 0
    older = {**kept, "train": {k: v for k, v in kept["train"].items() if k != "temperature"}}
    assert bench.same_settings(older, kept)  # guided leaves train.temperature at its default


def test_the_report_leaves_out_records_of_another_text_than_the_baselines(fair):
    plain = _result("t", "plain", 1e-3, 6, [(0, 0.5), (6, 0.1)])
    new, old = (
        {**r, "digests": {"corpus": d}}
        for r, d in (
            (_result("t", "guided", 1e-3, 6, [(6, 0.05)]), "a"),
            (_result("t", "guided", 4e-4, 6, [(6, 0.01)]), "b"),
        )
    )
    kept, notes = fair.same_text([{**plain, "digests": {"corpus": "a"}}, new, old])
    assert [r["lr"] for r in kept if r["recipe"] == "guided"] == [1e-3]
    assert len(notes) == 1 and notes[0].startswith("left out t/guided at lr 0.0004, 6 steps")
    # a stale plain record sorted first does not decide: most of the plain records do
    stale = {**plain, "lr": 4e-4, "digests": {"corpus": "b"}}
    fresh = [{**plain, "lr": lr, "digests": {"corpus": "a"}} for lr in (1e-3, 2.5e-3)]
    kept, notes = fair.same_text([stale, *fresh, new, old])
    assert sorted((r["recipe"], r["lr"]) for r in kept) == [("guided", 1e-3), ("plain", 1e-3), ("plain", 2.5e-3)]
    assert len(notes) == 2


def test_an_unknown_teacher_is_refused_in_one_line(fair):
    with pytest.raises(SystemExit, match=r"^unknown teacher 'nope': declared are qwen3_moe, deepseek_v2"):
        fair.teachers_named("qwen3_moe,nope")
    assert [t.role for t in fair.teachers_named("all")] == ["reported", "reported", "chosen", "chosen"]
