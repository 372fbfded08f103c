"""A 2-layer Qwen3-MoE with Qwen3's vocabulary (151,936) and a tiny hidden size, with a locally trained tokenizer
and chat data: the model whose full-vocabulary logits dwarf everything else (memory tests, benchmarks)."""

import json
from pathlib import Path

import transformers

QWEN3_VOCAB = 151_936


def save_big_vocab_model(root: Path, rows: int = 400) -> tuple[Path, Path]:
    """``(model folder, chat.jsonl)`` under ``root``."""
    from fcsd.embedded.tokenizer import train_tokenizer

    chats = [
        {
            "messages": [
                {"role": "user", "content": f"add {i} and {i + 1}, then say why"},
                {"role": "assistant", "content": f"{2 * i + 1} since {i}+{i + 1}"},
            ]
        }
        for i in range(rows)
    ]
    tokenizer = train_tokenizer((m["content"] for r in chats for m in r["messages"]), vocab_size=200)
    config = transformers.Qwen3MoeConfig(
        vocab_size=QWEN3_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "chat.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    return root / "model", root / "chat.jsonl"
