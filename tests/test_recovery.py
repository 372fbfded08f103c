"""Recovery recipes (issue 27): the layer-local warm start is fed the teacher's streams (a planted student-fed
input is caught), frozen parameter groups get no gradient or optimizer state, a recipe runs through `fcsd convert`
end to end and a run killed in either stage resumes exactly; refusals are one line."""

import copy
import json
from pathlib import Path

import pytest
import torch
from test_trainer import FAST as TRAINER_FAST
from test_trainer import config_for as trainer_config_for
from test_trainer import pretrained_assets
from tiny_models import build

import fcsd
from fcsd.cli import main
from fcsd.connectivity import apply_farskip
from fcsd.connectivity.families import family_for_config, find_decoder_layers
from fcsd.distill import trainer, warm_start
from fcsd.distill.data import Packed
from fcsd.distill.objectives import micro_batch_loss
from fcsd.distill.optim import build_optimizer, plan_steps
from fcsd.distill.param_groups import parameter_groups

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


def _inputs_seen(student, teacher, batch) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The ``(o, n)`` each student layer receives during the warm start's loss."""
    seen = {}
    layers = find_decoder_layers(student, family_for_config(student.config))
    originals = {k: layer.forward for k, layer in enumerate(layers)}
    for k, layer in enumerate(layers):
        layer.forward = lambda full, partial, _k=k, **kw: (
            seen.setdefault(_k, (full, partial)) and originals[_k](full, partial, **kw)
        )
    try:
        warm_start.layer_local_loss(student, teacher, batch)
    finally:
        for layer in layers:
            del layer.forward
    return seen


def _expected_streams(teacher, batch):
    """Independently of fcsd: the teacher's layer inputs (``output_hidden_states``) and each MoE block's output
    (in Qwen3-MoE, which has no shared expert, the routed-expert output)."""
    family = family_for_config(teacher.config)
    layers = find_decoder_layers(teacher, family)
    routed, handles = {}, []
    for k, layer in enumerate(layers):
        if family.is_moe(layer.mlp):
            handles.append(layer.mlp.register_forward_hook(lambda m, a, out, _k=k: routed.__setitem__(_k, out)))
    with torch.no_grad():
        states = teacher(input_ids=batch.input_ids, position_ids=batch.position_ids, output_hidden_states=True)
    for handle in handles:
        handle.remove()
    return states.hidden_states, routed


def check_teacher_fed(student, teacher, batch) -> None:
    hidden, routed = _expected_streams(teacher, batch)
    seen = _inputs_seen(student, teacher, batch)
    assert sorted(seen) == list(range(len(seen))) and len(seen) == 4
    for k, (full, partial) in seen.items():
        torch.testing.assert_close(full, hidden[k], msg=f"layer {k}: MoE input is not the teacher's o_k-1")
        expected = hidden[k] - routed[k - 1] if k - 1 in routed else hidden[k]
        torch.testing.assert_close(partial, expected, msg=f"layer {k}: attention input is not teacher o - routed")
        assert not full.requires_grad and not partial.requires_grad


def test_warm_start_is_fed_the_teachers_streams_and_a_student_fed_input_is_caught(monkeypatch):
    teacher, student = _models("qwen3_moe")
    batch = _batch(teacher.config.vocab_size)
    with torch.no_grad():  # the student drifts from the teacher, so student-fed streams differ from the teacher's
        for param in find_decoder_layers(student, family_for_config(student.config))[0].parameters():
            param.add_(0.3 * torch.randn_like(param))
    check_teacher_fed(student, teacher, batch)
    # the loss of layer k does not depend on the student's earlier layers, only on layer k's own weights
    _, before = warm_start.layer_local_loss(student, teacher, batch)
    with torch.no_grad():
        find_decoder_layers(student, family_for_config(student.config))[1].self_attn.o_proj.weight.mul_(-1)
    _, after = warm_start.layer_local_loss(student, teacher, batch)
    assert after[1] != before[1] and all(after[k] == before[k] for k in (0, 2, 3))
    # planted bug: the layers fed the student's own stream o_k-1 instead of the teacher's
    streams = warm_start.teacher_streams

    def student_fed(_teacher, b):
        planted = streams(teacher, b)
        with torch.no_grad():
            own = student(input_ids=b.input_ids, position_ids=b.position_ids, output_hidden_states=True)
        planted.inputs = list(own.hidden_states[: len(planted.inputs)])
        return planted

    monkeypatch.setattr(warm_start, "teacher_streams", student_fed)
    with pytest.raises(AssertionError, match="teacher's"):
        check_teacher_fed(student, teacher, batch)


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen3_moe"])
def test_warm_start_gradients_stay_inside_each_layer_and_fit_the_teachers_update(family):
    teacher, student = _models(family)
    batch = _batch(teacher.config.vocab_size)
    parts, per_layer = warm_start.layer_local_loss(student, teacher, batch)
    assert set(per_layer) == {0, 1, 2, 3} and all(v > 0 for v in per_layer.values())
    layers = find_decoder_layers(student, family_for_config(student.config))
    parts.total.backward()
    assert all(p.grad is None for p in student.get_input_embeddings().parameters())  # inputs are detached
    assert all(any(p.grad is not None for p in layer.parameters()) for layer in layers)
    # a converted layer fed its own teacher streams with the teacher's own weights misses only by FarSkip's rewiring;
    # a few steps at a high LR shrink that miss
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-4)
    first = float(parts.total.detach())
    for _ in range(10):
        optimizer.zero_grad()
        loss = warm_start.layer_local_loss(student, teacher, batch)[0].total
        loss.backward()
        optimizer.step()
    assert float(warm_start.layer_local_loss(student, teacher, batch)[0].total.detach()) < 0.5 * first


def test_frozen_groups_get_no_gradient_and_no_optimizer_state(assets, tmp_path):
    config = config_for(
        assets, tmp_path / "r", "train.max_steps=4", "recovery.trainable=non_expert", "+recovery.lr_mult.attention=3"
    )
    _, student = _models("qwen3_moe")
    groups = parameter_groups(student)
    assert {"embeddings", "attention", "norms", "router", "experts", "dense_mlp"} <= set(groups.values())
    assert groups["model.layers.0.mlp.experts.gate_up_proj"] == "experts"
    assert groups["model.layers.0.mlp.gate.weight"] == "router"
    assert groups["model.layers.1.mlp.gate_proj.weight"] == "dense_mlp"
    optimizer, _ = build_optimizer(student, config, plan_steps(config, 1))
    params = dict(student.named_parameters())
    frozen = {name for name, group in groups.items() if group == "experts"}
    assert all(not params[name].requires_grad for name in frozen)
    assert all(params[name].requires_grad for name in set(params) - frozen)
    in_optimizer = {id(p): group["initial_lr"] for group in optimizer.param_groups for p in group["params"]}
    assert all(id(params[name]) not in in_optimizer for name in frozen)
    # the default recipe (guided) peaks at recovery.lr_scale=4 x train.lr=1e-3; a group's multiplier scales that peak
    assert {round(in_optimizer[id(params[n])], 9) for n, g in groups.items() if g == "attention"} == {1.2e-2}
    assert {round(in_optimizer[id(params[n])], 9) for n, g in groups.items() if g == "norms"} == {4e-3}
    teacher = build("qwen3_moe")
    before = {name: params[name].detach().clone() for name in frozen}
    micro_batch_loss(student, student, _batch(97), config, teacher).total.backward()
    optimizer.step()
    assert all(params[name].grad is None and torch.equal(params[name], before[name]) for name in frozen)
    assert all(params[name] not in optimizer.state for name in frozen)
    assert any(params[name] in optimizer.state for name in set(params) - frozen)


def test_a_run_with_group_multipliers_logs_the_base_lr(assets, tmp_path):
    """The optimizer's first group is the smallest multiplier (attention at 0.5 here); the logged LR is the base
    group's, as in the same run without multipliers."""
    args = convert_args(assets, "train.max_steps=3", "farskip.layers=all")
    logged = {}
    for name, extra in (("base", []), ("mult", ["+recovery.lr_mult.attention=0.5"])):
        assert main([*args, *extra, f"output_dir={tmp_path / name}"]) in (0, None)
        logged[name] = [r["train/lr"] for r in records(tmp_path / name) if "train/lr" in r]
    assert len(logged["base"]) == 3 and logged["base"][-1] > 0
    assert logged["mult"] == pytest.approx(logged["base"], rel=1e-12)


WARM = ["recovery=warm_start", "recovery.warm_share=0.5"]
# on the schedule-free recipe (no guide), so that the partial stage's KL says what converting the rest costs
PROGRESSIVE = ["recovery=schedule_free", "recovery.progressive=[last:50%]", "recovery.progressive_shares=[0.5]"]


@pytest.mark.parametrize(
    "recipe, stages, kill_steps",
    [
        (WARM, ["warm_start"] * 4 + ["kl"] * 4, (3, 7)),  # killed in the warm start (resumes from 2), in the KL stage
        (PROGRESSIVE, ["layers last:50%"] * 4 + ["layers all"] * 4, (3,)),
    ],
    ids=["warm_start", "progressive"],
)
def test_recipes_through_fcsd_convert_and_a_run_killed_in_each_stage_resumes_exactly(
    assets, tmp_path, monkeypatch, recipe, stages, kill_steps
):
    args = convert_args(assets, "train.max_steps=8", *recipe, "train.save_every=2", "farskip.layers=all")
    args += ["train.spike_window=2"]
    assert main([*args, f"output_dir={tmp_path / 'u'}"]) in (0, None)
    whole = records(tmp_path / "u")
    # the spike guard starts afresh with each stage: the loss jump at the boundary (step 5) is no spike
    assert [r["train/skipped"] for r in whole if r["step"] == 5 and "train/loss" in r] == [False]
    assert [r["train/stage"] for r in whole if "train/loss" in r] == stages
    kl = [r["eval/kl"] for r in whole if "eval/kl" in r]
    if recipe is WARM:
        assert kl[-1] < 0.8 * kl[0]
        assert min(kl[1:5]) < kl[0]  # the warm start alone (steps 1-4) already lowers the end-to-end KL
    else:  # the last half converts almost for free; converting the rest at step 4 costs, then KL recovers it
        assert kl[5] > 10 * kl[4] and kl[-1] < kl[5]
    assert fcsd.farskip_layers(fcsd.from_pretrained(str(tmp_path / "u" / "final"))) == [0, 1, 2, 3]

    for kill_at in kill_steps:
        run = tmp_path / f"k{kill_at}"
        killed_at(monkeypatch, [*args, f"output_dir={run}"], kill_at)
        assert main([*args, f"output_dir={run}", "--resume"]) in (0, None)
        resumed = records(run)
        for key in ("train/loss", "train/grad_norm", "train/lr"):
            assert [r[key] for r in resumed if key in r] == [r[key] for r in whole if key in r], key


def test_recovery_refusals_are_one_line(assets, tmp_path):
    cases = {
        (*WARM, "teacher.mode=cache"): "teacher.mode=online",
        (*WARM, "parallel.ep_size=2"): "parallel.ep_size > 1",
        ("recovery.trainable=non_expert", "parallel.fsdp=true"): "recovery=plain",
        ("recovery.trainable=[attention,bogus]",): "choose all, non_expert",
        ("+recovery.lr_mult.experts=0",): "multiplier > 0",
        ("recovery.warm_share=1.0",): "[0, 1)",
        ("recovery.progressive=[last:50%]",): "one share",
        ("recovery.progressive=[last:50%]", "recovery.progressive_shares=[0.5]", *WARM): "choose one",
        ("recovery=warm_start", "recovery.warm_share=0.9", "train.max_steps=2", "train.warmup_steps=1"): "no step",
        ("recovery=schedule_free", "recovery.warm_share=0.5"): "cannot be combined with recovery.warm_share",
        ("recovery.optimizer=sgd",): "choose one of adamw, schedule_free",
        ("recovery.lr_scale=0",): "finite number > 0",
        ("recovery.warmup_share=1.5",): "[0, 1)",
        ("recovery.hidden_l2=-1",): "finite number >= 0",
        ("recovery=guided", "recovery.hidden_l2_share=0"): "(0, 1]",
        ("recovery=warm_start", "recovery.warm_share=0.5", "recovery.hidden_l2=4"): "cannot be combined with",
    }
    for overrides, fix in cases.items():
        with pytest.raises(ValueError, match=None) as error:
            config_for(assets, tmp_path / "x", "train.max_steps=4", *overrides)
        assert fix in str(error.value) and "\n" not in str(error.value), (overrides, error.value)


def test_warm_start_under_ddp_matches_one_process(assets, tmp_path):
    """Two gloo processes (DDP) train the warm start and the KL stage as one process does: the warm start calls the
    layers outside DDP's forward, so fcsd averages their gradients itself."""
    from launch import torchrun

    args = ["convert", str(assets / "model"), f"data.path={assets / 'train.jsonl'}", f"data.cache_dir={assets / 'c'}"]
    args += [*FAST, "train.max_steps=4", *WARM, "train.grad_clip=0", "train.save_every=0"]
    assert main([*args, f"output_dir={tmp_path / 'one'}"]) in (0, None)
    torchrun(2, "-m", "fcsd.cli", *args, f"output_dir={tmp_path / 'ddp'}", timeout=600)
    one, ddp = records(tmp_path / "one"), records(tmp_path / "ddp")
    for key in ("train/loss", "train/grad_norm", "eval/kl"):
        torch.testing.assert_close(
            torch.tensor([r[key] for r in ddp if key in r]), torch.tensor([r[key] for r in one if key in r]), msg=key
        )
    assert [r["train/stage"] for r in ddp if "train/loss" in r] == ["warm_start"] * 2 + ["kl"] * 2


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
