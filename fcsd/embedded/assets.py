"""The demo's assets, built beside the demo job (:mod:`fcsd.cli.demo`): a tiny Qwen3-MoE-style checkpoint, a locally
trained tokenizer and synthetic chat data, built offline in the user cache folder (``$FCSD_CACHE`` or
``~/.cache/fcsd``) and reused by later runs.

The teacher is instruction-tuned on both families of :mod:`fcsd.embedded.synthetic` with the gold answers;
``data/train.jsonl`` (the conversion data) mixes both families on other prompts, answered by another "writer"
(:func:`fcsd.embedded.synthetic.writer_answer`), and ``data/heldout.jsonl`` holds the scored tasks' held-out prompts
with the teacher's gold answers: the paper's setting, where general instruction data written by other models covers
the skills the benchmarks score.

:mod:`fcsd.sources` resolves the model name ``demo`` (and the data names ``demo`` / ``demo-heldout``) to these
files in every ``fcsd`` command (it imports this module, never the other way round); the demo *job* (``fcsd convert
demo``) is :mod:`fcsd.cli.demo`.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from fcsd.user_cache import cache_root

PRETRAIN_STEPS = 900


def builder_sources() -> tuple[str, ...]:
    """The files whose code builds the demo: this module (its :data:`PRETRAIN_STEPS` included), the synthetic tasks
    and the tokenizer trainer."""
    from fcsd.embedded import synthetic, tokenizer

    return (__file__, synthetic.__file__, tokenizer.__file__)


def demo_dir() -> Path:
    """The demo's folder in the user cache, named by a digest of its builder's source (:func:`builder_sources`): a
    changed builder never reuses a stale teacher. Only the source counts, not values patched at run time, so every
    process of a command (a sweep's jobs, torchrun's ranks) finds the demo its parent prepared in ``FCSD_CACHE``."""
    digest = hashlib.sha256()
    for source in builder_sources():
        digest.update(Path(source).read_bytes())
    return cache_root() / f"demo-{digest.hexdigest()[:12]}"


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
        head_dim=32,  # vLLM's CPU attention serves head sizes of 32 and up (`vllm serve` of the demo export)
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        architectures=["Qwen3MoeForCausalLM"],
    )


def prepare_demo(seed: int = 0) -> Path:
    """Build (once) and return the demo folder: ``model/`` (checkpoint, tokenizer; generation ends at EOS),
    ``data/train.jsonl`` (the conversion data), ``data/heldout.jsonl`` (the scored tasks' held-out prompts) and
    ``data/heldout-general.jsonl`` (held-out prompts of the other tasks)."""
    root = demo_dir()
    if (root / "model" / "config.json").exists():
        return root
    import torch
    from transformers import Qwen3MoeForCausalLM

    from fcsd.embedded.synthetic import GENERAL_TASKS, TASKS, conversion_data, make_dataset, write_jsonl
    from fcsd.embedded.tokenizer import train_tokenizer

    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=root.parent))
    try:
        abilities = make_dataset(20000, seed=seed, tasks=TASKS + GENERAL_TASKS)  # what the teacher learns
        heldout = make_dataset(200, seed=seed + 1)  # scored: held-out prompts of the scored tasks, gold answers
        general = make_dataset(120, seed=seed + 3, tasks=GENERAL_TASKS)  # held-out prompts of the other tasks
        conversion = conversion_data(8000, seed + 2, heldout + general)  # what FCSD and SFT train on
        write_jsonl(conversion, staging / "data" / "train.jsonl")
        write_jsonl(heldout, staging / "data" / "heldout.jsonl")
        write_jsonl(general, staging / "data" / "heldout-general.jsonl")
        tokenizer = train_tokenizer((m["content"] for row in abilities for m in row["messages"]), vocab_size=300)
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(demo_config(len(tokenizer)))
        pretrain_teacher(model, tokenizer, abilities, steps=PRETRAIN_STEPS, seed=seed)
        ends = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
        ends["pad_token_id"] = tokenizer.pad_token_id
        for config in (model.config, model.generation_config):  # generation stops at <|end|> in every harness
            for key, value in ends.items():
                setattr(config, key, value)
        model.save_pretrained(staging / "model")
        tokenizer.save_pretrained(staging / "model")
    except BaseException:  # Ctrl-C or a failure during the build: no half-built folder stays in the cache
        shutil.rmtree(staging, ignore_errors=True)
        raise
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
