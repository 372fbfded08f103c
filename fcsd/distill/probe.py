"""``fcsd probe``: the no-training damage sweep of paper Sec. 3.1 / Fig. 3.

For each N of a grid, the first N and the last N decoder layers get FarSkip connectivity (no training) and the
held-out next-token loss and the per-token KL(teacher || converted) are measured, the teacher being the same
checkpoint with its stock connectivity. The teacher's logits are computed once per batch and reused for every grid
point; switching the connectivity is a class swap, so one model serves as teacher and as every student.
"""

from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fcsd.connectivity.layer_spec import percent_count
from fcsd.connectivity.patch import apply_farskip, remove_farskip
from fcsd.distill.losses import forward_kl, next_token_nll


@dataclass
class ProbeRow:
    side: str  # "first" or "last"
    n_converted: int
    loss: float  # mean next-token cross-entropy per token
    kl: float  # mean KL(teacher || converted) per token
    perplexity: float


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def parse_grid(grid: str | list[int] | None, num_layers: int) -> list[int]:
    """Grid of converted-layer counts: ``"0,4,8,all"``, percentages (``"25%,50%"``) or ints; default 9 even steps."""
    if grid is None:
        return sorted({round(i * num_layers / 8) for i in range(9)})
    items = grid.split(",") if isinstance(grid, str) else list(grid)
    values = []
    for item in items:
        text = str(item).strip().lower()
        if text == "all":
            value = num_layers
        elif text.endswith("%") and _is_number(text[:-1]) and float(text[:-1]) >= 0:
            value = percent_count(float(text[:-1]), num_layers, f"--grid entry {item!r}", side="")
        elif text.isdigit():
            value = int(text)
        else:
            raise ValueError(f"bad grid entry {item!r}: use layer counts, percentages or 'all', e.g. '0,4,50%,all'")
        if not 0 <= value <= num_layers:
            raise ValueError(f"grid entry {item!r} is outside 0..{num_layers} (the model has {num_layers} layers)")
        values.append(value)
    return sorted(set(values))


@torch.no_grad()
def probe_specs(
    model, sequences: torch.Tensor, specs: list, batch_size: int = 4, progress: bool = True
) -> list[tuple[float, float]]:
    """``(loss, KL)`` per token of ``model`` with FarSkip on each layer spec of ``specs`` (no training), against the
    same model with its stock connectivity, on token ``sequences`` ``(n, seq_len)``. The teacher's logits are
    computed once per batch."""
    model.eval()
    device = next(model.parameters()).device
    sums = [[0.0, 0.0] for _ in specs]  # (nll, kl) sums
    tokens = 0
    batches = list(torch.split(sequences, batch_size))
    bar = tqdm(total=len(batches) * (len(specs) + 1), desc="probe", disable=not progress, unit="fwd")
    for batch in batches:
        batch = batch.to(device)
        remove_farskip(model)
        teacher = model(input_ids=batch).logits
        bar.update()
        labels = batch[:, 1:]
        tokens += labels.numel()
        for index, spec in enumerate(specs):
            apply_farskip(model, spec)
            student = model(input_ids=batch).logits
            nll, _ = next_token_nll(student[:, :-1], labels)
            kl, _ = forward_kl(student[:, :-1], teacher[:, :-1])
            sums[index][0] += float(nll)
            sums[index][1] += float(kl)
            bar.update()
    bar.close()
    remove_farskip(model)
    return [(nll / tokens, kl / tokens) for nll, kl in sums]


def run_probe(
    model, sequences: torch.Tensor, grid: list[int], batch_size: int = 4, progress: bool = True
) -> list[ProbeRow]:
    """Measure loss and KL for first-N and last-N conversion of ``model`` on token ``sequences`` ``(n, seq_len)``."""
    settings = [("first", n) for n in grid] + [("last", n) for n in grid if n != 0]
    specs = [f"{side}:{n}" if n else "none" for side, n in settings]
    measured = probe_specs(model, sequences, specs, batch_size, progress)
    rows = [ProbeRow(side, n, loss, kl, math.exp(min(loss, 50.0))) for (side, n), (loss, kl) in zip(settings, measured)]
    if 0 in grid:  # N=0 is the teacher itself, the starting point of both lines
        base = next(r for r in rows if r.n_converted == 0)
        rows.append(ProbeRow("last", 0, base.loss, base.kl, base.perplexity))
    return sorted(rows, key=lambda r: (r.side, r.n_converted))


def write_csv(rows: list[ProbeRow], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)


def plot(rows: list[ProbeRow], path: Path, title: str) -> None:
    """Two panels (loss, KL) against the number of converted layers, one line for first-N and one for last-N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, label in (
        (axes[0], "loss", "held-out next-token loss"),
        (axes[1], "kl", "KL(teacher || converted) per token"),
    ):
        for side in ("first", "last"):
            points = [(r.n_converted, getattr(r, metric)) for r in rows if r.side == side]
            ax.plot(*zip(*points), marker="o", label=f"{side} N layers converted")
        ax.set_xlabel("N layers converted (no training)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def probe_checkpoint(
    name: str,
    data: str | None = None,
    split: str = "validation",
    grid: str | None = None,
    seq_len: int = 256,
    num_sequences: int = 32,
    batch_size: int = 4,
    dtype: str = "float32",
    device: str = "cpu",
    output_dir: str | Path = "outputs/probe",
) -> list[ProbeRow]:
    """``fcsd probe``: load ``name`` (hub id, folder or ``demo``), score the grid on ``data`` (the model's own
    held-out data by default), write ``probe.csv`` and ``probe.png`` to ``output_dir`` and print the table."""
    for flag, value, least in (
        ("seq-len", seq_len, 2),
        ("num-sequences", num_sequences, 1),
        ("batch-size", batch_size, 1),
    ):
        if value < least:  # they were tracebacks (a division by zero, a negative shape) or a false message
            raise ValueError(f"--{flag} {value}: it must be at least {least}")
    from fcsd.connectivity.families import family_for_config, text_config
    from fcsd.distill.data import load_texts, pack_sequences
    from fcsd.loading import check_tokenizer_fits, from_pretrained, load_config, tokenizer_from_pretrained
    from fcsd.sources import default_data, resolve_model

    data = data or default_data(name)
    if data is None:
        raise ValueError("--data is required (a local .jsonl/.json/.txt/.parquet file or a dataset name)")
    path = resolve_model(name)
    config = load_config(path)  # an unreadable config.json is a one-line error before anything loads
    family_for_config(config)  # a supported family of a possible shape
    from fcsd.files import ownership

    out = ownership.check_output_folder(output_dir, "probe", "--output-dir", {"model": path, "data": data})
    num_layers = text_config(config).num_hidden_layers
    points = parse_grid(grid, num_layers)  # before anything loads
    tokenizer = tokenizer_from_pretrained(path)
    check_tokenizer_fits(tokenizer, config, path)
    model = from_pretrained(path, layers=[], text_only=True, dtype=getattr(torch, dtype)).to(device)
    rows = load_texts(data, tokenizer, split=split)
    sequences = pack_sequences(rows.texts, tokenizer, seq_len, num_sequences)
    print(f"probe: {name} ({num_layers} layers), {sequences.numel()} tokens from {data}, grid {points}")
    results = run_probe(model, sequences, points, batch_size=batch_size)
    ownership.mark(out, "probe")
    write_csv(results, out / "probe.csv")
    plot(results, out / "probe.png", f"FarSkip without training: {name}")
    for written in ("probe.csv", "probe.png"):
        ownership.record(out / written)
    print(f"{'side':<6}{'N':>4}{'loss':>10}{'KL':>10}")
    for r in results:
        print(f"{r.side:<6}{r.n_converted:>4}{r.loss:>10.4f}{r.kl:>10.4f}")
    print(f"wrote {out / 'probe.csv'} and {out / 'probe.png'}")
    return results
