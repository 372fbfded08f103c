"""``fcsd routes record | stats | place``: the command-line side of :mod:`fcsd.placement` (parsed args in, files and
text out). Every step is a library function; these only load, call and print."""

from __future__ import annotations

import json
import math
import sys

from fcsd.files import ownership
from fcsd.placement.format import PlacementError, load_placement
from fcsd.placement.traces import RoutesError, check_same_model, load_routes


def _readable_by(loader):
    """Whether a file is one ``loader`` reads (so that ``--out`` replaces only a routes file or a placement)."""

    def check(path) -> bool:
        try:
            loader(path)
        except (RoutesError, PlacementError, ValueError, OSError):
            return False
        return True

    return check


def parse_eps(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise PlacementError(f"--ep takes comma-separated integers such as 8,16,32, got {text!r}") from None


def record(args) -> int:
    """Load MODEL like ``fcsd probe`` (``demo`` included), read ``--tokens`` tokens of ``--data`` and save routes."""
    import torch

    from fcsd.connectivity.families import family_for_config
    from fcsd.distill.data import load_texts, pack_sequences, tokens_fingerprint
    from fcsd.loading import check_tokenizer_fits, from_pretrained, load_config, tokenizer_from_pretrained
    from fcsd.placement.record import record_routes
    from fcsd.sources import DEMO_NAME, resolve_data, resolve_model

    data = resolve_data(args.data or (DEMO_NAME if args.model == DEMO_NAME else None))  # demo: its training chats
    if data is None:
        raise ValueError("--data is required (a local .jsonl/.json/.txt/.parquet file or a datasets name)")
    if args.tokens < 1 or args.seq_len < 1:
        raise ValueError("--tokens and --seq-len must be positive")
    path = resolve_model(args.model)
    inputs = {"model": path, "data file": data}
    ownership.check_output_file(args.out, "--out", "routes file", _readable_by(load_routes), inputs)
    config = load_config(path)  # an unreadable config.json is named before anything loads
    family_for_config(config)  # a supported family of a possible shape
    tokenizer = tokenizer_from_pretrained(path)
    check_tokenizer_fits(tokenizer, config, path)
    model = from_pretrained(path, dtype=getattr(torch, args.dtype)).to(args.device)
    rows = load_texts(data, tokenizer, split=args.split)
    sequences = pack_sequences(rows.texts, tokenizer, args.seq_len, math.ceil(args.tokens / args.seq_len))
    if sequences.numel() == 0:
        raise ValueError(f"{data} holds fewer than --seq-len {args.seq_len} tokens; lower --seq-len")
    if sequences.numel() < args.tokens:
        print(f"routes: {data} yields {sequences.numel()} tokens of the {args.tokens} asked for", file=sys.stderr)
    routes = record_routes(model, sequences, batch_size=args.batch_size, progress=not args.quiet, name=args.model)
    routes.header.update(data=str(data), split=args.split, data_fingerprint=tokens_fingerprint(sequences))
    routes.save(args.out)
    h = routes.header
    print(
        f"wrote {args.out}: {h['tokens']} tokens x {len(h['layers'])} MoE layers (decoder layers {h['layers']}), "
        f"{h['num_experts']} experts, top-{h['top_k']}"
    )
    return 0


def stats(args) -> int:
    """Co-selection, cross-layer and Table I figures of ROUTES (fit on one part, reported on the held-out part)."""
    from fcsd.placement.coupling_table import coupling_report, format_report

    if args.step_tokens < 1:
        raise ValueError(f"--step-tokens {args.step_tokens}: a training step holds at least 1 token (e.g. 4096)")
    routes = load_routes(args.routes)
    if args.plot:
        ownership.check_output_folder(args.plot, "plots", "--plot", {"routes": args.routes})
    placement = None
    if args.placement:
        placement = load_placement(args.placement)
        if placement.source:
            check_same_model(routes.header, placement.source, f"the placement {args.placement}'s routes")
    report = coupling_report(
        routes,
        parse_eps(args.ep),
        nodes=args.nodes,
        holdout=args.holdout,
        placement=placement,
        step_tokens=args.step_tokens,
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    if args.plot:
        from fcsd.placement.plots import plot_heatmaps

        written = plot_heatmaps(routes, args.plot, args.layer)
        print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr if args.json else sys.stdout)
    return 0


def place(args) -> int:
    """Algorithm 1 on every MoE layer of ROUTES; writes PLACEMENT.json and prints what it gains on the routes."""
    import time

    import numpy as np

    from fcsd.placement.solver import contiguous_placement, correlated_placement
    from fcsd.placement.stats import within_layer

    routes = load_routes(args.routes)
    inputs = {"routes": args.routes}
    ownership.check_output_file(args.out, "--out", "placement file", _readable_by(load_placement), inputs)
    begin = time.perf_counter()
    placement = correlated_placement(routes, args.ep, args.nodes)
    seconds = time.perf_counter() - begin
    placement.save(args.out)
    contiguous = contiguous_placement(routes, args.ep)

    def same_gpu(p):
        return float(np.mean([within_layer(routes.layer(layer), p.ranks(layer))["same_gpu"] for layer in p.layers]))

    print(
        f"wrote {args.out}: EP {args.ep} on {args.nodes} node(s), {len(placement.layers)} MoE layers, "
        f"{routes.num_experts // args.ep} experts per rank, solved in {seconds:.1f} s; tokens whose experts share a "
        f"rank (on these routes): {100 * same_gpu(contiguous):.1f}% contiguous -> {100 * same_gpu(placement):.1f}%"
    )
    return 0


def add_parser(sub) -> None:
    """The ``routes`` command group of ``fcsd``."""
    p = sub.add_parser("routes", help="record routes, expert-coupling statistics (Table I), correlated placement")
    group = p.add_subparsers(dest="routes_command", required=True)

    r = group.add_parser("record", help="capture every token's top-k experts at every MoE layer")
    r.add_argument("model", help="hub id, local folder, or 'demo'")
    r.add_argument("--data", help="local .jsonl/.json/.txt/.parquet file or datasets name (default for demo: its data)")
    r.add_argument("--split", default="train", help="split of a hub dataset (default: train)")
    r.add_argument("--tokens", type=int, default=131072, help="tokens to record (default: 131072)")
    r.add_argument("--seq-len", type=int, default=512, help="tokens per packed sequence (default: 512)")
    r.add_argument("--batch-size", type=int, default=8)
    r.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    r.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda when available)")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument("--out", required=True, help="routes file to write (safetensors)")
    r.set_defaults(func=_run(record))

    s = group.add_parser("stats", help="co-selection, cross-layer predictability and Table I on held-out routes")
    s.add_argument("routes", help="a routes file of `fcsd routes record`")
    s.add_argument(
        "--ep",
        help="EP degrees, e.g. 8,16,32 (default: those of 8,16,32 that divide the experts and leave >= 2 a rank)",
    )
    s.add_argument("--nodes", type=int, default=1, help="nodes the EP group spans (hierarchical placement)")
    s.add_argument("--placement", help="also report this PLACEMENT.json (row 'given')")
    s.add_argument("--holdout", type=float, default=0.2, help="share of sequences held out for reporting")
    s.add_argument("--step-tokens", type=int, default=4096, help="tokens per training step for the planner")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--plot", metavar="DIR", help="write the Fig. 2 heatmaps (within and across layers) as PNG")
    s.add_argument("--layer", type=int, help="decoder layer of the heatmaps (default: a middle MoE layer)")
    s.set_defaults(func=_run(stats))

    pl = group.add_parser("place", help="balanced correlated placement (Algorithm 1) as PLACEMENT.json")
    pl.add_argument("routes", help="a routes file of `fcsd routes record`")
    pl.add_argument("--ep", type=int, required=True, help="expert-parallel ranks")
    pl.add_argument("--nodes", type=int, default=1, help="nodes the EP ranks span (nodes first, then GPUs)")
    pl.add_argument("--out", required=True, help="PLACEMENT.json to write")
    pl.set_defaults(func=_run(place))


def _run(command):
    def run(args) -> int:
        if getattr(args, "device", "") is None:
            import torch

            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        return command(args)

    run.__name__ = command.__name__
    return run
