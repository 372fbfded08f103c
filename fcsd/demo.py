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
PRETRAIN_STEPS = 600
DEMO_VERSION = 2  # bump when the demo assets change, so stale caches are rebuilt


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
    train, heldout = make_dataset(4000, seed=seed), make_dataset(200, seed=seed + 1)
    write_jsonl(train, staging / "data" / "train.jsonl")
    write_jsonl(heldout, staging / "data" / "heldout.jsonl")
    tokenizer = train_tokenizer((m["content"] for row in train for m in row["messages"]), vocab_size=384)
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
    lr: float = 3e-3,
) -> list[float]:
    """Train the demo teacher from scratch on the synthetic chat data (AdamW, cosine); returns the loss curve."""
    import torch
    from tqdm.auto import tqdm

    from fcsd.distill.data import pack_sequences

    texts = [tokenizer.apply_chat_template(row["messages"], tokenize=False) for row in rows]
    sequences = pack_sequences(texts, tokenizer, seq_len)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.05)
    model.train()
    losses = []
    with tqdm(range(steps), desc="pretraining the demo teacher", unit="step") as bar:
        for _ in bar:
            batch = sequences[torch.randint(len(sequences), (batch_size,), generator=generator)]
            loss = model(input_ids=batch, labels=batch).loss
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
    return str(prepare_demo() / "data" / "heldout.jsonl") if name == DEMO_NAME else None
