"""The embedded default: a tiny Qwen3-MoE-style checkpoint, a locally trained tokenizer and synthetic chat data,
built offline in the user cache folder (``$FCSD_CACHE`` or ``~/.cache/fcsd``) and reused by later runs.

The model name ``demo`` resolves to this checkpoint in every ``fcsd`` command.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEMO_NAME = "demo"
PRETRAIN_STEPS = 700
DEMO_VERSION = 3  # bump when the demo assets change, so stale caches are rebuilt


def cache_root() -> Path:
    return Path(os.environ.get("FCSD_CACHE", Path.home() / ".cache" / "fcsd"))


def demo_dir() -> Path:
    return cache_root() / f"demo-v{DEMO_VERSION}"


def demo_config(vocab_size: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=96,
        intermediate_size=192,
        moe_intermediate_size=48,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        architectures=["Qwen3MoeForCausalLM"],
    )


def prepare_demo(seed: int = 0) -> Path:
    """Build (once) and return the demo folder: ``model/`` (checkpoint, tokenizer), ``data/{train,heldout}.jsonl``."""
    root = demo_dir()
    if (root / "model" / "config.json").exists():
        return root
    import torch
    from transformers import Qwen3MoeForCausalLM

    from fcsd.distill.synthetic import make_dataset, write_jsonl
    from fcsd.distill.tokenizer import train_tokenizer

    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=root.parent))
    train, heldout = make_dataset(20000, seed=seed), make_dataset(200, seed=seed + 1)
    write_jsonl(train, staging / "data" / "train.jsonl")
    write_jsonl(heldout, staging / "data" / "heldout.jsonl")
    tokenizer = train_tokenizer((m["content"] for row in train for m in row["messages"]), vocab_size=300)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(demo_config(len(tokenizer)))
    pretrain_teacher(model, tokenizer, train, steps=PRETRAIN_STEPS, seed=seed)
    model.save_pretrained(staging / "model")
    tokenizer.save_pretrained(staging / "model")
    try:
        staging.rename(root)  # atomic: a half-built demo is never picked up
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another process finished first
    return root


def pretrain_teacher(
    model,
    tokenizer,
    rows: list[dict],
    steps: int,
    seed: int = 0,
    seq_len: int = 128,
    batch_size: int = 16,
    lr: float = 1e-3,
) -> list[float]:
    """Instruction-tune the demo teacher from scratch on the synthetic chat rows (loss on the assistant turns only,
    AdamW, one-cycle schedule); returns the loss curve."""
    import torch
    from tqdm.auto import tqdm

    ids, labels = [], []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(row["messages"][-1]["content"], add_special_tokens=False)["input_ids"]
        answer_ids.append(tokenizer.eos_token_id)
        ids += prompt_ids + answer_ids
        labels += [-100] * len(prompt_ids) + answer_ids
    n = len(ids) // seq_len
    inputs = torch.tensor(ids[: n * seq_len]).view(n, seq_len)
    targets = torch.tensor(labels[: n * seq_len]).view(n, seq_len)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.05)
    model.train()
    losses = []
    with tqdm(range(steps), desc="pretraining the demo teacher", unit="step") as bar:
        for _ in bar:
            pick = torch.randint(n, (batch_size,), generator=generator)
            loss = model(input_ids=inputs[pick], labels=targets[pick]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


def resolve_model(name: str) -> str:
    """``demo`` -> the demo checkpoint folder (built on first use); anything else unchanged."""
    return str(prepare_demo() / "model") if name == DEMO_NAME else name


def default_data(name: str) -> str | None:
    """The held-out file of ``demo`` (what `fcsd probe demo` scores), None for any other model."""
    return resolve_data("demo-heldout") if name == DEMO_NAME else None


DEMO_DATA = {"demo": "train.jsonl", "demo-heldout": "heldout.jsonl"}


def resolve_data(name: str | None) -> str | None:
    """``demo`` / ``demo-heldout`` -> the demo's training / held-out file; anything else unchanged."""
    return str(prepare_demo() / "data" / DEMO_DATA[name]) if name in DEMO_DATA else name


def run_demo(config) -> dict:
    """``fcsd convert demo``: FCSD and, with the same budget, the SFT baseline (paper Tab. 2), then a table of
    exact-match accuracy and held-out KL for the teacher, the converted model before training, and both runs; last,
    lm-eval's score of the teacher vs the FCSD model on the demo suite (``eval/suites/demo.yaml``)."""
    import dataclasses
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fcsd.connectivity.patch import apply_farskip
    from fcsd.distill.trainer import convert
    from fcsd.evaluate.exact_match import exact_match
    from fcsd.loading import from_pretrained

    root = prepare_demo()
    out = Path(config.output_dir)
    runs = {}
    for objective in ("kl", "sft"):
        train = dataclasses.replace(config.train, objective=objective)
        run_config = dataclasses.replace(config, train=train, output_dir=str(out / f"fcsd-{objective}"))
        print(f"demo: training the converted model with train.objective={objective}")
        runs[objective] = convert(run_config)
    rows = [json.loads(line) for line in (root / "data" / "heldout.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    teacher = AutoModelForCausalLM.from_pretrained(root / "model")
    report = {"teacher": {"kl": 0.0, **exact_match(teacher, tokenizer, rows)}}
    converted = apply_farskip(teacher, config.farskip.layers)
    report["converted, before training"] = {
        "kl": runs["kl"].eval_before["eval/kl"],
        **exact_match(converted, tokenizer, rows),
    }
    for objective, label in (("kl", "after FCSD (KL)"), ("sft", "after SFT, same budget")):
        model = from_pretrained(str(runs[objective].final_dir))
        report[label] = {"kl": runs[objective].eval_after["eval/kl"], **exact_match(model, tokenizer, rows)}
    text = format_report(report, config)
    print(text)
    (out / "demo_report.md").write_text(text + "\n")
    print(f"wrote {out / 'demo_report.md'}")
    from fcsd.evaluate.report import evaluate_and_report
    from fcsd.evaluate.suites import load_suite

    print("demo: lm-eval, teacher (original) vs FCSD (converted), suite `demo`")
    fcsd_run, suite = runs["kl"].output_dir, load_suite("demo")
    folder, table = evaluate_and_report(str(fcsd_run), suite, str(root / "model"), fcsd_run / "eval", batch_size=64)
    print((folder / "eval_table.md").read_text())
    report["lm-eval"] = table
    (out / "demo_report.json").write_text(json.dumps(report, indent=2))
    return report


def format_report(report: dict, config) -> str:
    """The demo's markdown table: one row per model, held-out KL then exact match per task and overall."""
    tasks = [key for key in next(iter(report.values())) if key not in ("kl", "all")]
    header = ["model", "held-out KL", *tasks, "all"]
    lines = [
        f"FarSkip layers `{config.farskip.layers}`, {config.train.max_steps} steps of {config.train.batch_tokens} "
        "tokens; exact match on the held-out synthetic tasks",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
    ]
    for name, scores in report.items():
        cells = [f"{scores['kl']:.4f}"] + [f"{100 * scores[t]:.1f}%" for t in [*tasks, "all"]]
        lines.append("| " + " | ".join([name, *cells]) + " |")
    return "\n".join(lines)
