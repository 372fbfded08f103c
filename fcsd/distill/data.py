"""Text data for probing and distillation: local json/jsonl/parquet/text files or a hub dataset, plain text or
chat-formatted rows, tokenised and packed into fixed-length sequences."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import tempfile
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
    fingerprint: str = ""  # the datasets fingerprint of the source rows (content-based for local files)


def load_texts(
    source: str,
    tokenizer=None,
    split: str = "train",
    text_field: str = "text",
    messages_field: str = "messages",
    max_rows: int | None = None,
) -> TextRows:
    """Rows of ``source`` as strings: ``messages`` rendered with the tokenizer's chat template, else ``text``.

    ``source`` is a local .json/.jsonl/.parquet/.txt/.csv file (or a folder of them) or a ``datasets`` hub name.
    Malformed rows are skipped and counted; a dataset with no usable row raises :class:`DataError`.
    """
    dataset, unparsable, files = _load_rows(source, split)
    raw = _raw_json_rows(files, len(dataset))
    if max_rows is not None:
        dataset = dataset.select(range(min(max_rows, len(dataset))))
    texts = []
    for row in dataset if raw is None else raw[: len(dataset)]:
        text = _row_text(row, tokenizer, text_field, messages_field)
        if text:
            texts.append(text)
    skipped = unparsable + len(dataset) - len(texts)  # lines that are no row, and rows without usable text
    if skipped:
        log.warning("%s: skipped %d malformed or empty rows of %d", source, skipped, len(dataset) + unparsable)
    if not texts:
        raise DataError(
            f"{source}: no usable rows among {len(dataset)} (columns: {dataset.column_names}); each row needs a "
            f"non-empty {text_field!r} string or a {messages_field!r} list of {{'role', 'content'}} messages"
        )
    return TextRows(texts, skipped, dataset._fingerprint)


def load_rows(source: str, split: str = "train", count_unparsable: bool = False):
    """A ``datasets.Dataset`` from a local .json/.jsonl/.parquet/.txt/.csv file (or a folder of them) or a hub name.
    Unparsable lines of a .jsonl file are skipped (``count_unparsable``: returns ``(dataset, skipped lines)``)."""
    dataset, bad, _ = _load_rows(source, split)
    return (dataset, bad) if count_unparsable else dataset


def _load_rows(source: str, split: str):
    """The dataset, how many lines were unparsable, and the local files it was read from (empty for a hub name)."""
    import datasets

    from fcsd.sources import looks_local

    path = Path(source)
    bad, files = 0, []
    if path.exists():
        files = sorted(p for p in path.iterdir() if p.suffix in _LOCAL_BUILDERS) if path.is_dir() else [path]
        if not files or files[0].suffix not in _LOCAL_BUILDERS:
            raise DataError(f"{source}: expected a .json, .jsonl, .parquet, .txt or .csv file (or a folder of them)")
        if all(f.stat().st_size == 0 for f in files):
            raise DataError(f"{source}: the data is empty; give a file with one JSON object (or text line) per row")
        if files[0].suffix in (".jsonl", ".json", ".txt", ".csv"):
            files, bad = _clean_lines(files)
        dataset = datasets.load_dataset(
            _LOCAL_BUILDERS[files[0].suffix], data_files=[str(f) for f in files], split="train"
        )
    elif path.suffix in _LOCAL_BUILDERS or looks_local(source):
        raise DataError(f"{source}: no such file or folder (a local data file, or a datasets hub name like org/name)")
    else:
        dataset = datasets.load_dataset(source, split=split)
    return dataset, bad, files


def _raw_json_rows(files: list[Path], count: int) -> list[dict] | None:
    """The ``count`` rows of local .jsonl/.json ``files`` as the stdlib ``json`` reads them, or None.

    ``datasets`` types a column holding both strings and numbers as ``Json``, which hands the string ``"6"`` back as
    the int 6 (and ``"Infinity"`` as a float): the row reader would then drop good rows for one bad one. The stdlib
    keeps each value's own type. None (use the dataset's rows) for other files or a layout read differently.
    """
    if not files or any(f.suffix not in (".jsonl", ".json") for f in files):
        return None
    rows: list = []
    for file in files:
        text = file.read_text(encoding="utf-8")
        try:
            whole = json.loads(text) if file.suffix == ".json" else None
        except ValueError:
            whole = None  # a .json file of JSON lines
        if isinstance(whole, list):
            rows.extend(whole)
            continue
        try:
            rows.extend(json.loads(line) for line in text.splitlines() if line.strip())
        except ValueError:
            return None
    if len(rows) != count or not all(isinstance(row, dict) for row in rows):
        return None
    return rows


def _clean_lines(files: list[Path]) -> tuple[list[Path], int]:
    """``files`` unchanged when every line is UTF-8 (and, in a ``.jsonl`` file, a JSON object); else copies without
    the other lines (in fcsd's cache, named by their content), how many lines were dropped, and a warning naming
    the file and the lines. A ``.json`` file is one document: a line that is not UTF-8 there is an error."""
    from fcsd.user_cache import cache_root

    cleaned, bad = [], 0
    for file in files:
        good, dropped = [], []
        for number, raw in enumerate(file.read_bytes().splitlines(), start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                if file.suffix == ".json":
                    raise DataError(
                        f"{file}, line {number}: not UTF-8 text ({error.reason} at byte {error.start}); save the file "
                        "as UTF-8"
                    ) from None
                dropped.append(number)
                continue
            if file.suffix == ".jsonl" and line.strip() and not _is_json_object(line):
                dropped.append(number)
            elif line.strip() or file.suffix != ".jsonl":
                good.append(line)
        if not dropped:
            cleaned.append(file)
            continue
        bad += len(dropped)
        shown = ", ".join(map(str, dropped[:10])) + (" ..." if len(dropped) > 10 else "")
        why = "not UTF-8 or not a JSON object" if file.suffix == ".jsonl" else "not UTF-8"
        log.warning("%s: skipped %d line(s) that are %s: line %s", file, len(dropped), why, shown)
        text = "".join(line + "\n" for line in good)
        copy = cache_root() / "clean" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}{file.suffix}"
        if not copy.exists():
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(text, encoding="utf-8")
        cleaned.append(copy)
    if not any(f.stat().st_size for f in cleaned):
        raise DataError(f"{files[0]}: no line is usable (UTF-8 text; in .jsonl one JSON object per line)")
    return cleaned, bad


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


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


def tokenize_texts(texts: list[str], tokenizer) -> list[list[int]]:
    """Token ids of each text followed by EOS (the document boundary the packer and the SFT labels rely on)."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return [ids + eos for ids in encoded]


@dataclass
class Packed:
    """Token rows ``(n, seq_len)`` with per-document ``position_ids``.

    Positions restart at 0 where a document starts; transformers turns such position ids into a block-diagonal
    causal mask (sdpa, eager, flex) or varlen attention (flash-attention), so packed documents never attend to each
    other. A document cut at a row end continues its positions in the next row.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def sft_labels(self) -> torch.Tensor:
        """Next-token labels aligned with the inputs: ``labels[t] = input_ids[t + 1]`` inside a document, -100 at
        document ends and at the end of each row."""
        labels = torch.full_like(self.input_ids, -100)
        same_doc = self.position_ids[:, 1:] == self.position_ids[:, :-1] + 1
        labels[:, :-1] = torch.where(same_doc, self.input_ids[:, 1:], -100)
        return labels

    def rows(self, index) -> Packed:
        return Packed(self.input_ids[index], self.position_ids[index])


def pack_documents(documents: list[list[int]], seq_len: int, max_sequences: int | None = None) -> Packed:
    """Concatenate tokenised documents and cut them into ``seq_len`` rows (the tail shorter than a row is dropped)."""
    stream: list[int] = []
    positions: list[int] = []
    budget = None if max_sequences is None else max_sequences * seq_len
    for doc in documents:
        stream.extend(doc)
        positions.extend(range(len(doc)))
        if budget is not None and len(stream) >= budget:
            break
    n = len(stream) // seq_len
    if max_sequences is not None:
        n = min(n, max_sequences)
    if n == 0:
        raise DataError(
            f"the data holds {len(stream)} tokens, fewer than one sequence of {seq_len}; "
            "lower the sequence length (data.seq_len) or add data"
        )
    shape = (n, seq_len)
    return Packed(
        torch.tensor(stream[: n * seq_len], dtype=torch.long).view(shape),
        torch.tensor(positions[: n * seq_len], dtype=torch.long).view(shape),
    )


def pack_sequences(texts: list[str], tokenizer, seq_len: int, max_sequences: int | None = None) -> torch.Tensor:
    """Token rows ``(n, seq_len)`` of the concatenated texts (each ended by EOS)."""
    return pack_documents(tokenize_texts(texts, tokenizer), seq_len, max_sequences).input_ids


def load_packed(
    source: str,
    tokenizer,
    seq_len: int,
    *,
    split: str = "train",
    text_field: str = "text",
    messages_field: str = "messages",
    max_rows: int | None = None,
    seed: int = 0,
    cache_dir: str | Path | None = None,
) -> tuple[Packed, dict]:
    """Load, render, tokenise and pack ``source`` into :class:`Packed` rows, documents shuffled by ``seed``.

    The packed tensors are cached in ``cache_dir`` under a key made of the rows' fingerprint, the tokenizer, the
    sequence length and the seed, so a second run (or every run of a sweep) skips tokenisation. Returns the rows and
    a summary (documents, skipped rows, tokens, ``fingerprint`` of the packed tokens).
    """
    from safetensors.torch import load_file, save_file

    rows = load_texts(source, tokenizer, split, text_field, messages_field, max_rows)
    # "rows-2": rows are read with the stdlib json since; packs cached from the rows datasets mistyped are stale
    key = _digest([rows.fingerprint, "rows-2", _tokenizer_digest(tokenizer), seq_len, seed, text_field, messages_field])
    cached = Path(cache_dir) / f"packed-{key}.safetensors" if cache_dir else None
    if cached is not None and cached.exists():
        tensors = load_file(cached)
        packed = Packed(tensors["input_ids"], tensors["position_ids"])
    else:
        documents = tokenize_texts(rows.texts, tokenizer)
        random.Random(seed).shuffle(documents)
        packed = pack_documents(documents, seq_len)
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            handle, tmp = tempfile.mkstemp(dir=cached.parent, suffix=".tmp")
            os.close(handle)
            save_file({"input_ids": packed.input_ids, "position_ids": packed.position_ids}, tmp)
            os.replace(tmp, cached)
    summary = {
        "source": source,
        "documents": len(rows.texts),
        "skipped_rows": rows.skipped,
        "sequences": len(packed),
        "tokens": packed.input_ids.numel(),
        "fingerprint": tokens_fingerprint(packed.input_ids),
    }
    return packed, summary


def tokens_fingerprint(input_ids: torch.Tensor) -> str:
    """A short content hash of token rows (the teacher cache is validated against it)."""
    return hashlib.sha256(input_ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]


def _tokenizer_digest(tokenizer) -> str:
    return _digest([sorted(tokenizer.get_vocab().items()), tokenizer.eos_token_id, tokenizer.chat_template])


def _digest(parts) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]
