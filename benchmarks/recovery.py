"""Recovery recipes side by side: held-out KL against tokens seen, for the plain FCSD recipe and each
recovery recipe of ``fcsd convert``, on two tiny teachers this script pretrains itself on real text.

* Text: the Python standard library's own source files (real code, on every machine, no network); files are
  documents. The held-out KL scores ``--eval-sequences`` rows of windows cut out of 64 files chosen at random; the
  runs train on the rest (the teachers saw it all).
* Teachers: a tiny Qwen3-MoE and a tiny DeepSeek-V2 (MLA, a shared expert, a dense first layer), pretrained here as
  plain language models on that text; every layer is converted to FarSkip.
* Runs: each recipe through :func:`fcsd.distill.convert.convert` (the product's own trainer), the same data order,
  2,048 tokens per step, ``train.max_steps`` steps. Held-out KL and NLL every
  ``--eval-every`` steps; each run's tokens, teacher forwards and wall time are recorded.
* Output: the tokens each recipe needs to reach the plain recipe's held-out KL at the "short" (600 / 200 with
  ``--quick``) and "long" (1,800 / 600 with ``--quick``) step marks, as ratios to plain's; ``recovery.json`` and
  ``recovery.png`` (the curves) in ``--out``.

    python benchmarks/recovery.py --quick        # 600 steps per run, marks at 200 and 600
    python benchmarks/recovery.py                # 1,800 steps per run, marks at 600 and 1,800
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import sysconfig
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recovery_fair as fair  # noqa: E402

STEP_TOKENS = 2048
SEQ_LEN = 256
RECIPES = {  # name -> overrides of `fcsd convert`
    "plain": ["recovery=plain"],
    "guided": ["recovery=guided"],  # the default: schedule-free at 4x, the hidden-state guide, the batch ramp
    "guided_t2": ["recovery=guided", "train.temperature=2"],
    "guided_ramp_long": ["recovery=guided", "recovery.batch_ramp_shares=[0.1,0.4]"],  # 4 updates to 10%, 2 to 50%
    "guided_ramp_8": ["recovery=guided", "recovery.batch_ramp=[8,4,2]", "recovery.batch_ramp_shares=[0.05,0.15,0.3]"],
    "guided_seed1": ["recovery=guided", "train.seed=1"],  # another data order: the noise between reruns
    "plain_seed1": ["recovery=plain", "train.seed=1"],
    "guided_frozen_embeddings": ["recovery=guided", "train.freeze_embeddings=true"],  # fewer noisy parameters
    # more levers: Adam's betas, the guide's weight and fade
    "guided_beta2_99": ["recovery=guided", "train.adam_betas=[0.9,0.99]"],
    "guided_beta1_95": ["recovery=guided", "train.adam_betas=[0.95,0.95]"],
    "guided_beta1_80": ["recovery=guided", "train.adam_betas=[0.8,0.95]"],
    "guided_beta2_90": ["recovery=guided", "train.adam_betas=[0.9,0.9]"],
    "guided_beta1_70": ["recovery=guided", "train.adam_betas=[0.7,0.95]"],
    "guided_beta1_50": ["recovery=guided", "train.adam_betas=[0.5,0.95]"],
    "guided_guide8": ["recovery=guided", "recovery.hidden_l2=8"],
    "guided_guide_quarter": ["recovery=guided", "recovery.hidden_l2_share=0.25"],
    "guided_no_ramp": ["recovery=guided", "recovery.batch_ramp=[]", "recovery.batch_ramp_shares=[]"],
    "schedule_free": ["recovery=schedule_free"],  # 2x the LR, 0.5% warm-up, its average scored and saved
    "schedule_free_lr4": ["recovery=schedule_free", "recovery.lr_scale=4"],
    "plain_anneal": ["recovery=plain", "train.min_lr_ratio=0.1"],  # control: the cosine to a tenth (the demo's)
}


def corpus(out: Path, max_chars: int) -> Path:
    """``corpus.jsonl``: standard-library source files (sorted, so the same on every run), one document each."""
    path = out / "corpus.jsonl"
    if path.exists():
        return path
    root = Path(sysconfig.get_paths()["stdlib"])
    rows, total = [], 0
    for file in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in file.parts[-2:][0] or file.stat().st_size > 200_000:
            continue
        text = file.read_text(errors="replace")
        rows.append(json.dumps({"text": text}))
        total += len(text)
        if total >= max_chars:
            break
    out.mkdir(parents=True, exist_ok=True)
    _write(path, "\n".join(rows) + "\n")
    return path


def _write(path: Path, text: str) -> None:
    """Write ``text`` whole or not at all: the two families' runs may start at once and read what the other writes."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def tiny_config(family: str, vocab: int, hidden=64, layers=4, experts=8, top_k=2, moe_intermediate=64):
    """The model class and config of a tiny ``family`` teacher (the defaults: the first recovery study's two)."""
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
    )
    if family == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
            **common,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=2 * moe_intermediate,
            moe_intermediate_size=moe_intermediate,
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=True,
        )
    return transformers.DeepseekV2ForCausalLM, transformers.DeepseekV2Config(
        **common,
        num_key_value_heads=4,
        intermediate_size=2 * moe_intermediate,
        moe_intermediate_size=moe_intermediate,
        n_routed_experts=experts,
        n_shared_experts=1,
        num_experts_per_tok=top_k,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        head_dim=8,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
    )


def teacher(out: Path, family: str, data: Path, steps: int, seed: int = 0, name: str | None = None, sizes=None) -> Path:
    """A tiny ``family`` language model (``sizes``: :func:`tiny_config`'s) pretrained on the corpus (next-token loss,
    AdamW, one cycle), saved with its tokenizer in ``teachers/<name>``; reused when already there."""
    folder = out / "teachers" / (name or family)
    if (folder / "config.json").exists():
        return folder
    from fcsd.embedded.tokenizer import train_tokenizer

    texts = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    tokenizer = train_tokenizer(texts, vocab_size=1024)
    ids = torch.tensor([t for text in texts for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]])
    rows = ids[: len(ids) // SEQ_LEN * SEQ_LEN].view(-1, SEQ_LEN)
    model_cls, config = tiny_config(family, len(tokenizer), **(sizes or {}))
    torch.manual_seed(seed)
    model = model_cls(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.05)
    generator = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    for step in range(steps):
        batch = rows[torch.randint(len(rows), (STEP_TOKENS // SEQ_LEN,), generator=generator)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            print(f"  {family} teacher step {step + 1}/{steps}: loss {loss.item():.3f}", flush=True)
    print(f"  {family} teacher pretrained in {time.perf_counter() - started:.0f}s", flush=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def data_overrides(out: Path, model: Path, texts, teacher_name: str, eval_sequences: int) -> list[str]:
    """The model and data keys of a run of ``fcsd convert``: what its held-out rows are packed from."""
    return [
        f"model.name={model}",
        f"data.path={texts[0]}",
        *([f"data.eval_path={texts[1]}"] if texts[1] else []),
        f"data.cache_dir={out / 'packed' / teacher_name}",
        f"data.seq_len={SEQ_LEN}",
        f"data.eval_sequences={eval_sequences}",
    ]


def run(
    out: Path,
    family: str,
    model: Path,
    texts: tuple[Path, Path | None],
    recipe: str,
    steps: int,
    args,
    lr: float | None = None,
    teacher_name: str | None = None,
) -> dict:
    """One recipe through ``fcsd convert``; its held-out curve (KL, NLL, and accuracy and agreement with the
    teacher), tokens, teacher forwards and wall time. ``lr`` (``train.lr``; default ``--lr``) and ``teacher_name``
    (a declared teacher of ``--fair``) give the run its own folder."""
    from fcsd.distill.config import compose, to_config
    from fcsd.distill.convert import convert

    lr = args.lr if lr is None else lr
    folder = out / "runs" / f"{args.heldout}-{args.eval_sequences}" / family / recipe  # a held-out set's own runs
    if teacher_name is not None:
        folder = out / "runs" / f"{args.heldout}-{args.eval_sequences}" / teacher_name / f"{recipe}-lr{lr:g}-{steps}"
    result_file = folder / "bench.json"
    overrides = [
        *data_overrides(out, model, texts, teacher_name or "", args.eval_sequences),
        f"output_dir={folder}",
        f"train.batch_tokens={STEP_TOKENS}",
        f"train.micro_batch_size={STEP_TOKENS // SEQ_LEN}",
        f"train.max_steps={steps}",
        f"train.lr={lr}",
        f"train.warmup_steps={max(1, steps // 20)}",
        f"train.eval_every={args.eval_every}",
        "train.save_every=0",
        "train.log_every=10",
        "early_stop.enabled=false",
        "export=false",
        "progress=false",
        "overwrite=true",
        *RECIPES[recipe],
    ]
    config = to_config(compose(overrides))
    if result_file.exists():
        return json.loads(result_file.read_text())
    started = time.perf_counter()
    convert(config)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["eval/kl"], r["eval/nll"]) for r in records if "eval/kl" in r]
    agreement = [
        (r["step"], r["eval/acc"], r["eval/teacher_acc"], r["eval/top1_agree"]) for r in records if "eval/acc" in r
    ]
    result = {
        "family": family,
        "teacher": teacher_name or family,
        "recipe": recipe,
        "lr": lr,
        "lr_scale": config.recovery.lr_scale,
        "steps": steps,
        "overrides": RECIPES[recipe],
        "curve": curve,
        "agreement": agreement,  # (step, student accuracy, teacher accuracy, top-1 agreement) on the held-out rows
        "tokens_per_step": STEP_TOKENS,
        "teacher_forwards_per_step": STEP_TOKENS // SEQ_LEN,  # one per sequence
        "wall_s": wall,
    }
    result_file.write_text(json.dumps(result))
    return result


def tokens_to_reach(result: dict, target: float) -> int | None:
    """Tokens at the first held-out evaluation whose KL is at or below ``target`` (None: never)."""
    return next((step * STEP_TOKENS for step, kl, _ in result["curve"] if kl <= target), None)


def kl_at(curve, step: int) -> float:
    return next(kl for s, kl, _ in curve if s == step)


def report(results: list[dict], marks: tuple[int, int]) -> list[str]:
    lines = []
    for family in dict.fromkeys(r["family"] for r in results):
        runs = {r["recipe"]: r for r in results if r["family"] == family}
        if "plain" not in runs:  # a run of some recipes alone (--recipes): kept, compared once plain has run
            lines.append(f"{family}: no plain run yet to compare with (run --recipes plain)")
            continue
        plain = runs["plain"]["curve"]
        targets = {mark: kl_at(plain, mark) for mark in marks}
        lines.append(
            f"{family}: plain held-out KL {plain[0][1]:.4f} at step 0, "
            + ", ".join(f"{targets[m]:.4f} at step {m}" for m in marks)
        )
        for recipe, result in runs.items():
            ratios = []
            for mark in marks:
                tokens = tokens_to_reach(result, targets[mark])
                ratios.append("not reached" if tokens is None else f"{tokens / (mark * STEP_TOKENS):.2f}x")
            final = result["curve"][-1]
            lines.append(
                f"  {recipe:18s} tokens to plain's KL@{marks[0]}: {ratios[0]:>11s}  @{marks[1]}: {ratios[1]:>11s}  "
                f"final KL {final[1]:.4f} NLL {final[2]:.4f}  wall {result['wall_s']:.0f}s"
            )
    return lines


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(dict.fromkeys(r["family"] for r in results))
    figure, axes = plt.subplots(1, len(families), figsize=(6 * len(families), 4), squeeze=False)
    for axis, family in zip(axes[0], families, strict=True):
        for result in (r for r in results if r["family"] == family):
            steps, kls = zip(*[(s, kl) for s, kl, _ in result["curve"] if s > 0], strict=True)
            axis.plot([s * STEP_TOKENS for s in steps], kls, label=result["recipe"])
        axis.set(xscale="log", yscale="log", xlabel="tokens seen", ylabel="held-out KL", title=family)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


HELD_FILES, HELD_CHARS = 64, 1200


def split(out: Path, data: Path) -> tuple[Path, Path]:
    """``heldout.jsonl``: a window of ``HELD_CHARS`` characters at a seeded place in each of ``HELD_FILES`` documents
    chosen with a fixed seed, and ``train.jsonl``: the documents without those windows (the text on either side of a
    window is two documents). A held-out set spread over many files, so that its KL does not follow one file's
    content (the last rows of the packed training data, the trainer's own held-out set, are one or two files)."""
    import random

    train, held = out / "train.jsonl", out / "heldout.jsonl"
    if train.exists() and held.exists():
        return train, held
    documents = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    chosen = set(random.Random(0).sample(range(len(documents)), HELD_FILES))
    rest, windows = [], []
    for index, text in enumerate(documents):
        if index not in chosen:
            rest.append(text)
            continue
        start = random.Random(index).randrange(max(1, len(text) - HELD_CHARS))
        windows.append(text[start : start + HELD_CHARS])
        rest += [part for part in (text[:start], text[start + HELD_CHARS :]) if part]
    _write(train, "".join(json.dumps({"text": text}) + "\n" for text in rest))
    _write(held, "".join(json.dumps({"text": text}) + "\n" for text in windows))
    return train, held


FAIR_MARKS = (600, 1800)  # the sweep's budget, and the long runs' at each recipe's best LR


def fair_corpus(out: Path, kind: str) -> tuple[Path, tuple[Path, Path], dict]:
    """The corpus of a declared teacher (``code`` or ``prose``), its training / held-out split (windows of
    ``HELD_FILES`` documents, fixed before any run) and the digests of all three."""
    if kind == "code":
        data = corpus(out, 3_000_000)
        texts = split(out, data)
    else:
        folder = out / "prose"
        data = folder / "corpus.jsonl"
        if not data.exists():
            documents = fair.prose_documents(fair.site_packages(), 3_000_000)
            folder.mkdir(parents=True, exist_ok=True)
            _write(data, "".join(json.dumps({"text": text}) + "\n" for text in documents))
        texts = split(folder, data)
    digests = {"corpus": fair.digest(data), "train": fair.digest(texts[0]), "heldout": fair.digest(texts[1])}
    return data, texts, digests


def recipe_settings(recipe: str) -> dict:
    """What ``recipe`` resolves to: its overrides, its ``recovery`` settings (the preset's, as the presets are now)
    and the training settings a recipe may change; a kept record of other settings is run again."""
    from omegaconf import OmegaConf

    from fcsd.distill.config import compose

    config = OmegaConf.to_container(compose(list(RECIPES[recipe])), resolve=True)
    train = {key: config["train"][key] for key in ("temperature", "divergence", "objective", "min_lr_ratio")}
    return json.loads(json.dumps({"overrides": RECIPES[recipe], "recovery": config["recovery"], "train": train}))


def same_settings(kept: dict, now: dict) -> bool:
    """Whether a record's recipe settings are today's: its overrides equal, and every setting today's config has
    equal, a key the record lacks (added since) taken at its default; a key since removed is not compared (a
    changed value of it was in the overrides); a record from before the field is taken as today's."""
    from dataclasses import asdict

    from fcsd.distill.config import RecoveryConfig, TrainConfig

    if kept.get("overrides") != now["overrides"]:
        return False
    defaults = {"recovery": json.loads(json.dumps(asdict(RecoveryConfig()))), "train": asdict(TrainConfig())}
    return all(kept.get(group, {}).get(key, defaults[group].get(key)) == value for group in ("recovery", "train")
               for key, value in now[group].items())  # fmt: skip


@functools.cache  # one packing per teacher and sweep, not one per record looked up
def heldout_fingerprint(out: Path, model: Path, texts, teacher_name: str, eval_sequences: int) -> str:
    """A fingerprint of the held-out rows a run of ``teacher_name`` is scored on, as fcsd packs them now (the held-out
    file's digest does not change when fcsd packs it otherwise)."""
    from fcsd.distill.config import compose, to_config
    from fcsd.distill.data import tokens_fingerprint
    from fcsd.distill.run_data import load_run_data
    from fcsd.distill.student_teacher import load_tokenizer

    config = to_config(compose(data_overrides(out, model, texts, teacher_name, eval_sequences)))
    _, held, _ = load_run_data(config, load_tokenizer(config))
    return tokens_fingerprint(held.input_ids)


def fair_run(spec, model: Path, texts, digests: dict, recipe: str, lr: float, steps: int, args) -> dict | None:
    """One run of the fair benchmark: the record kept under ``--results`` when it was made of the same teacher and
    text, else a new run through :func:`run` (None: past ``--stop-at``, not started)."""
    kept = args.results / spec.name / f"{recipe}-lr{fair.lr_tag(lr)}-{steps}.json"
    settings = recipe_settings(recipe)
    rows = heldout_fingerprint(args.out, model, texts, spec.name, args.eval_sequences)
    if kept.exists():
        record = json.loads(kept.read_text())
        same = record.get("teacher_spec") == spec.spec() and record.get("digests") == digests
        same = same and record.get("heldout_rows", rows) == rows  # records before the field: as today's
        if same and same_settings(record.get("recipe_settings", settings), settings):
            return record
        print(f"  {kept.name}: made of another teacher, text or recipe, run again", flush=True)
    if args.stop_at and datetime.now(timezone.utc).strftime("%H:%M") >= args.stop_at:
        print(f"  {spec.name} / {recipe} at lr {lr:g}, {steps} steps: not started (past --stop-at)", flush=True)
        return None
    print(f"{spec.name} / {recipe} at train.lr {lr:g}: {steps} steps", flush=True)
    result = run(args.out, spec.family, model, texts, recipe, steps, args, lr=lr, teacher_name=spec.name)
    record = {**result, "role": spec.role, "teacher_spec": spec.spec(), "digests": digests, "recipe_settings": settings}
    record["heldout_rows"] = rows
    fair.save_result(args.results, record)
    return record


def fair_sweep(args) -> list[dict]:
    """Every declared teacher of ``--teachers``: each recipe's LR sweep at the short budget (``--lrs``, extended by
    ``--lr-factor`` while the best is at an edge, at most ``--extend`` times), then with ``--long`` a long run at
    each recipe's best LR."""
    short, long = FAIR_MARKS
    for spec in fair.teachers_named(args.teachers):
        data, texts, digests = fair_corpus(args.out, spec.corpus)
        print(f"{spec.name}: {spec.corpus} corpus {digests['corpus']}", flush=True)
        model = teacher(args.out, spec.family, data, spec.steps, spec.seed, spec.name, spec.sizes())
        for recipe in args.recipes.split(","):
            lrs, kls = [float(x) for x in args.lrs.split(",")], {}
            for round_ in range(args.extend + 1):
                for lr in lrs:
                    record = fair_run(spec, model, texts, digests, recipe, lr, short, args)
                    if record is not None:
                        kls[lr] = fair.final_kl(record)
                following = fair.extension(kls, args.lr_factor) if len(kls) >= 2 else None
                if following is None or round_ == args.extend:
                    break
                lrs = [following]
            if args.long and len(kls) >= 2:
                fair_run(spec, model, texts, digests, recipe, fair.best_lr(kls)[0], long, args)
    return fair.load_results(args.results)


def runnable(results: list[dict]) -> list[dict]:
    """The records of recipes fcsd still runs: one whose overrides name a setting since removed
    (:data:`fcsd.removed_settings.REMOVED`) stays in ``--results``, its figures in BENCHMARKS.md, and is not
    reported."""
    from fcsd.removed_settings import check_removed

    kept = []
    for record in results:
        try:
            check_removed(record.get("overrides", []))
        except ValueError:
            continue
        kept.append(record)
    return kept


def fair_plot(results: list[dict], path: Path, recipes=("plain", "guided")) -> None:
    """Held-out KL against tokens per declared teacher: each recipe's best run at each budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in fair.TEACHERS if any(r["teacher"] == n for r in results)]
    figure, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for axis, name in zip(axes[0], names, strict=True):
        for recipe in recipes:
            for steps, style in zip(FAIR_MARKS, ("-", "--"), strict=True):
                result = fair.best_run(results, name, recipe, steps)
                if result is None:
                    continue
                points = [(s * STEP_TOKENS, kl) for s, kl, _ in result["curve"] if s > 0]
                effective = result["lr"] * result.get("lr_scale", 1.0)
                axis.plot(*zip(*points, strict=True), style, label=f"{recipe}, LR {effective:g}, {steps} steps")
        role = fair.TEACHERS[name].role
        axis.set(xscale="log", yscale="log", xlabel="tokens seen", ylabel="held-out KL", title=f"{name} ({role})")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="600 steps per run (marks at 200 and 600)")
    parser.add_argument("--out", type=Path, default=Path("recovery-bench"))
    parser.add_argument("--families", default="qwen3_moe,deepseek_v2")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=None, help="held-out KL every N steps (default: marks/10)")
    parser.add_argument("--eval-sequences", type=int, default=64, help="held-out rows of 256 tokens")
    parser.add_argument(
        "--heldout",
        choices=("files", "tail"),
        default="files",
        help="files: windows of 64 files, cut out of the training text; tail: the trainer's own held-out rows, the "
        "last of the packed data (one or two files: the earlier figures of BENCHMARKS.md, with --eval-sequences 16)",
    )
    parser.add_argument("--teacher-steps", type=int, default=None, help="pretraining steps (default 1500, quick 600)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: fastest for these sizes)")
    parser.add_argument(
        "--fair",
        action="store_true",
        help="the fair benchmark: its teachers (recovery_fair.TEACHERS), each recipe's LR sweep at 600 steps and a "
        "comparison at each one's best LR; --recipes defaults to plain,guided",
    )
    parser.add_argument("--teachers", default="all", help="--fair: declared teachers (comma-separated, or all)")
    parser.add_argument("--lrs", default="4e-4,1e-3,2.5e-3", help="--fair: train.lr values swept (x lr_scale)")
    parser.add_argument("--lr-factor", type=float, default=2.5, help="--fair: the step beyond an edge of the sweep")
    parser.add_argument("--extend", type=int, default=1, help="--fair: at most this many LRs added beyond an edge")
    parser.add_argument("--long", action="store_true", help="--fair: also 1,800 steps at each recipe's best LR")
    parser.add_argument("--budgets", default="600,1800", help="--fair: the sweep's steps and the long runs'")
    parser.add_argument("--markdown", action="store_true", help="--fair: the report as a Markdown table too")
    parser.add_argument("--report-only", action="store_true", help="--fair: report the kept runs, run nothing")
    parser.add_argument("--stop-at", default=None, help="--fair: start no run after this UTC time (HH:MM)")
    parser.add_argument(
        "--results",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "recovery",
        help="--fair: where each run's record is kept (and read back instead of rerunning it)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.fair:
        global FAIR_MARKS
        FAIR_MARKS = tuple(int(x) for x in args.budgets.split(","))
        if args.recipes == ",".join(RECIPES):
            args.recipes = "plain,guided"
        args.heldout, args.eval_every = "files", args.eval_every or 30
        results = fair.load_results(args.results) if args.report_only else fair_sweep(args)
        results, notes = fair.same_text(runnable(results))
        if notes:
            print("\n".join(notes))
        scales = {r["recipe"]: r.get("lr_scale", 1.0) for r in results}
        print("\n".join(fair.fair_report(results, fair.TEACHERS, *FAIR_MARKS, lr_scales=scales)))
        if args.markdown:
            print("\n".join(fair.fair_table(results, fair.TEACHERS, *FAIR_MARKS, lr_scales=scales)))
        if results:
            args.out.mkdir(parents=True, exist_ok=True)
            fair_plot(results, args.out / "recovery-fair.png")
            print(f"curves: {args.out / 'recovery-fair.png'}")
        return
    marks = (200, 600) if args.quick else (600, 1800)
    args.eval_every = args.eval_every or marks[0] // 10
    teacher_steps = args.teacher_steps or (600 if args.quick else 1500)
    data = corpus(args.out, 3_000_000)
    texts = split(args.out, data) if args.heldout == "files" else (data, None)
    results = []
    for family in args.families.split(","):
        model = teacher(args.out, family, data, teacher_steps)
        for recipe in args.recipes.split(","):
            print(f"{family} / {recipe}: {marks[1]} steps", flush=True)
            results.append(run(args.out, family, model, texts, recipe, marks[1], args))
    (args.out / "recovery.json").write_text(json.dumps({"marks": marks, "runs": results}, indent=1))
    plot(results, args.out / "recovery.png")
    print("\n".join(report(results, marks)))
    print(f"curves: {args.out / 'recovery.png'}")


if __name__ == "__main__":
    main()
