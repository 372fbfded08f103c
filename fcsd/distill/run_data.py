"""A run's rows: the packed training rows and the held-out rows of ``data.*`` (paper Sec. 5.1: the step-0 / final
held-out KL), in the order a teacher cache stores them."""

from __future__ import annotations

import logging

import torch

from fcsd.distill.config import FCSDConfig
from fcsd.distill.data import Packed, load_packed
from fcsd.sources import resolve_data
from fcsd.user_cache import cache_root

log = logging.getLogger(__name__)


def load_run_data(config: FCSDConfig, tokenizer, sources: tuple | None = None) -> tuple[Packed, Packed, dict]:
    """Training rows, held-out rows and a summary; held-out rows come from ``data.eval_path`` (the same rows
    whatever ``train.seed``) or the end of the shuffled training rows (then removed from training). ``sources``:
    ``data.path`` and ``data.eval_path`` already resolved (:mod:`fcsd.distill.preflight`)."""
    data = config.data
    path, eval_path = sources or (resolve_data(data.path), resolve_data(data.eval_path))
    options = {
        "text_field": data.text_field,
        "messages_field": data.messages_field,
        "seed": config.train.seed,
        "cache_dir": data.cache_dir or cache_root() / "packed",
    }
    packed, summary = load_packed(path, tokenizer, data.seq_len, split=data.split, max_rows=data.max_rows, **options)
    if eval_path:
        # packed in one order whatever train.seed is: runs of several seeds are scored on the same rows
        held, _ = load_packed(eval_path, tokenizer, data.seq_len, **{**options, "seed": HELDOUT_SEED})
        held = held.rows(slice(0, data.eval_sequences))
        train = packed
    else:
        count = heldout_count(len(packed), data.eval_sequences, data.path, data.seq_len)
        train, held = packed.rows(slice(0, -count)), packed.rows(slice(-count, None))
    summary.update(train_sequences=len(train), eval_sequences=len(held))
    return train, held, summary


HELDOUT_SEED = 0  # the order data.eval_path's documents are packed in (the first data.eval_sequences rows score)
HELDOUT_SHARE = 5  # rows of the training data held out: at most one in this many, the rest trains


def heldout_count(sequences: int, asked: int, path: str, seq_len: int) -> int:
    """How many of ``sequences`` packed rows to hold out when the held-out set comes from the training data:
    ``data.eval_sequences``, but at most a fifth, so that a small file still trains on most of it (a note says so);
    data too small for even one held-out row beside four training rows is refused."""
    count = min(asked, sequences // HELDOUT_SHARE)
    if count < 1:
        raise ValueError(
            f"{path} packs into {sequences} sequences of {seq_len} tokens: too few to hold one out for the held-out KL "
            f"and train on the rest (at most one in {HELDOUT_SHARE} is held out); add data, lower data.seq_len, or set "
            "data.eval_path"
        )
    if count < asked:
        log.warning(
            "data.eval_sequences=%d: %s packs into %d sequences of %d tokens, so %d are held out (one in %d) and %d "
            "train; set data.eval_path for a held-out set of its own",
            asked, path, sequences, seq_len, count, HELDOUT_SHARE, sequences - count,
        )  # fmt: skip
    return count


def all_rows(train: Packed, held: Packed) -> Packed:
    """Training rows then held-out rows: the row order of a teacher cache."""
    return Packed(torch.cat([train.input_ids, held.input_ids]), torch.cat([train.position_ids, held.position_ids]))
