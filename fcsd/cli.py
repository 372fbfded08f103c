"""The ``fcsd`` command line. Thin: it parses arguments and calls library functions."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _inspect(args) -> int:
    from fcsd.connectivity.inspect import summarize
    from fcsd.demo import resolve_model

    summary = summarize(resolve_model(args.model), layers=args.layers)
    summary.name = args.model
    print(json.dumps(summary.to_dict(), indent=2) if args.json else summary.to_text())
    return 0


def _probe(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fcsd.connectivity.families import family_for_config, find_decoder_layers
    from fcsd.demo import default_data, resolve_model
    from fcsd.distill.data import load_texts, pack_sequences
    from fcsd.evaluate.probe import parse_grid, plot, run_probe, write_csv

    data = args.data or default_data(args.model)
    if data is None:
        raise SystemExit("fcsd probe: --data is required (a local .jsonl/.json/.txt/.parquet file or a dataset name)")
    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device)
    num_layers = len(find_decoder_layers(model, family_for_config(model.config)))
    grid = parse_grid(args.grid, num_layers)
    rows = load_texts(data, tokenizer, split=args.split)
    sequences = pack_sequences(rows.texts, tokenizer, args.seq_len, args.num_sequences)
    print(f"probe: {args.model} ({num_layers} layers), {sequences.numel()} tokens from {data}, grid {grid}")
    results = run_probe(model, sequences, grid, batch_size=args.batch_size)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(results, out / "probe.csv")
    plot(results, out / "probe.png", f"FarSkip without training: {args.model}")
    print(f"{'side':<6}{'N':>4}{'loss':>10}{'KL':>10}")
    for r in results:
        print(f"{r.side:<6}{r.n_converted:>4}{r.loss:>10.4f}{r.kl:>10.4f}")
    print(f"wrote {out / 'probe.csv'} and {out / 'probe.png'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fcsd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="family, layers, experts and parameter counts of a checkpoint (config only)")
    p.add_argument("model", help="hub id, local folder, or 'demo'")
    p.add_argument("--layers", help="a layer spec to resolve, e.g. all, last:50%%, first:4, 0,3,5-7")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("probe", help="loss and KL of first-N / last-N FarSkip conversion without training (Fig. 3)")
    p.add_argument("model", help="hub id, local folder, or 'demo'")
    p.add_argument("--data", help="held-out data: a local .jsonl/.json/.txt/.parquet file or a datasets name")
    p.add_argument("--split", default="validation", help="split of a hub dataset (default: validation)")
    p.add_argument("--grid", help="numbers of converted layers, e.g. 0,4,8,all or 25%%,50%% (default: 9 steps)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: 256)")
    p.add_argument("--num-sequences", type=int, default=32, help="held-out sequences to score (default: 32)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument("--output-dir", default="outputs/probe", help="where probe.csv and probe.png go")
    p.set_defaults(func=_probe)
    return parser


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as error:  # bad input: one clear line, no traceback
        print(f"fcsd {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
