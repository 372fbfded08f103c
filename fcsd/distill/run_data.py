"""A run's rows: the packed training rows and the held-out rows of ``data.*`` (paper Sec. 5.1: the step-0 / final
held-out KL), in the order a teacher cache stores them."""

from __future__ import annotations

import torch

from fcsd.distill.config import FCSDConfig
from fcsd.distill.data import Packed, load_packed
from fcsd.sources import cache_root, resolve_data


def load_run_data(config: FCSDConfig, tokenizer) -> tuple[Packed, Packed, dict]:
    """Training rows, held-out rows and a summary; held-out rows come from ``data.eval_path`` or the end of the
    shuffled training rows (then removed from training)."""
    data = config.data
    options = {
        "text_field": data.text_field,
        "messages_field": data.messages_field,
        "seed": config.train.seed,
        "cache_dir": data.cache_dir or cache_root() / "packed",
    }
    packed, summary = load_packed(
        resolve_data(data.path), tokenizer, data.seq_len, split=data.split, max_rows=data.max_rows, **options
    )
    if data.eval_path:
        held, _ = load_packed(resolve_data(data.eval_path), tokenizer, data.seq_len, **options)
        held = held.rows(slice(0, data.eval_sequences))
        train = packed
    else:
        if len(packed) <= data.eval_sequences:
            raise ValueError(
                f"{data.path} packs into {len(packed)} sequences of {data.seq_len} tokens, too few to hold out "
                f"data.eval_sequences={data.eval_sequences}; add data, lower data.seq_len, or set data.eval_path"
            )
        train, held = packed.rows(slice(0, -data.eval_sequences)), packed.rows(slice(-data.eval_sequences, None))
    summary.update(train_sequences=len(train), eval_sequences=len(held))
    return train, held, summary


def all_rows(train: Packed, held: Packed) -> Packed:
    """Training rows then held-out rows: the row order of a teacher cache."""
    return Packed(torch.cat([train.input_ids, held.input_ids]), torch.cat([train.position_ids, held.position_ids]))
