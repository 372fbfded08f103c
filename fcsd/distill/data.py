"""Text data for probing and distillation: local json/jsonl/parquet/text files or a hub dataset, plain text or
chat-formatted rows, tokenised and packed into fixed-length sequences."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}


class DataError(ValueError):
    """A dataset that cannot be used, with the file and the fields expected."""


@dataclass
class TextRows:
    texts: list[str]
    skipped: int


def load_texts(
    source: str, tokenizer=None, split: str = "train", text_field: str = "text", messages_field: str = "messages"
) -> TextRows:
    """Rows of ``source`` as strings: ``messages`` rendered with the tokenizer's chat template, else ``text``.

    ``source`` is a local .json/.jsonl/.parquet/.txt/.csv file (or a folder of them) or a ``datasets`` hub name.
    Malformed rows are skipped and counted; a dataset with no usable row raises :class:`DataError`.
    """
    import datasets

    path = Path(source)
    if path.exists():
        files = sorted(p for p in path.iterdir() if p.suffix in _LOCAL_BUILDERS) if path.is_dir() else [path]
        if not files or files[0].suffix not in _LOCAL_BUILDERS:
            raise DataError(f"{source}: expected a .json, .jsonl, .parquet, .txt or .csv file (or a folder of them)")
        dataset = datasets.load_dataset(
            _LOCAL_BUILDERS[files[0].suffix], data_files=[str(f) for f in files], split="train"
        )
    else:
        dataset = datasets.load_dataset(source, split=split)

    texts, skipped = [], 0
    for row in dataset:
        text = _row_text(row, tokenizer, text_field, messages_field)
        if text:
            texts.append(text)
        else:
            skipped += 1
    if skipped:
        log.warning("%s: skipped %d malformed or empty rows of %d", source, skipped, len(dataset))
    if not texts:
        raise DataError(
            f"{source}: no usable rows among {len(dataset)} (columns: {dataset.column_names}); each row needs a "
            f"non-empty {text_field!r} string or a {messages_field!r} list of {{'role', 'content'}} messages"
        )
    return TextRows(texts, skipped)


def _row_text(row: dict, tokenizer, text_field: str, messages_field: str) -> str | None:
    messages = row.get(messages_field)
    if messages is not None:
        if (
            not isinstance(messages, list)
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
            or not messages
        ):
            return None
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            return "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        return tokenizer.apply_chat_template(messages, tokenize=False)
    text = row.get(text_field)
    return text if isinstance(text, str) and text.strip() else None


def pack_sequences(texts: list[str], tokenizer, seq_len: int, max_sequences: int | None = None) -> torch.Tensor:
    """Concatenate tokenised texts (each ended by EOS) and cut them into ``(n, seq_len)`` token blocks."""
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    budget = None if max_sequences is None else max_sequences * seq_len
    for text in texts:
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            stream.append(eos)
        if budget is not None and len(stream) >= budget:
            break
    n = len(stream) // seq_len
    if max_sequences is not None:
        n = min(n, max_sequences)
    if n == 0:
        raise DataError(
            f"the data holds {len(stream)} tokens, fewer than one sequence of {seq_len}; "
            "lower the sequence length or add data"
        )
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)
