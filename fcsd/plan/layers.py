"""Which layers to convert: predicted speedups per layer spec on the cluster, measured damage with ``--probe``,
and a recommendation with its reason (paper Sec. 3.1, Fig. 3, Tab. 1-2; Appendix B).

The speedups are :mod:`fcsd.plan.timing`'s: the training step of the student under expert parallelism over one
node (Eq. 9 per converted MoE layer) and Appendix B's prefill on one node (TP = EP = GPUs per node, 32 x 2048
tokens). The damage is ``fcsd probe``'s: the held-out KL(original || converted) per token with no training.

The recommendation (a decision of this project, stated with every plan):
- with ``--probe``: the spec converting the most layers whose KL stays within ``max_kl`` (default: a quarter of the
  KL of the largest spec probed: converting the last layers costs far less than the first, Fig. 3);
- without: the paper's evidence by token budget. At 300M tokens (Tab. 2, DeepSeek-V2-Lite) "Far 50%" recovers to
  within 0.6 points of the original while 75% and 100% stay 8 and 16 points below; within 10B tokens (Tab. 1) every
  layer converted ends 1-3 points below. So a budget of at least :data:`ALL_LAYERS_TOKENS` converts every layer
  (the whole speedup), a smaller one the last 50%.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fcsd.connectivity.layer_spec import converted_layers
from fcsd.plan.cluster import Cluster
from fcsd.plan.timing import hardware, prefill_speedup, training_speedup

DEFAULT_SPECS = ("last:25%", "last:50%", "last:75%", "all")
ALL_LAYERS_TOKENS = 5e9  # half of the paper's 10B-token budget (Tab. 1)
PREFILL_BATCH, PREFILL_CONTEXT = 32, 2048  # Appendix B's prefill setting


@dataclass
class LayerOption:
    spec: str
    layers: list[int]
    training_speedup: float
    prefill_speedup: float
    kl: float | None = None  # held-out KL per token without training (--probe)
    loss: float | None = None  # held-out next-token loss per token (--probe)

    def to_dict(self) -> dict:
        return asdict(self)


def node_ep(cluster: Cluster, num_experts: int) -> int:
    """The expert-parallel size of one node: the largest divisor of the expert count up to its GPUs."""
    return max(p for p in range(1, cluster.gpus_per_node + 1) if num_experts % p == 0)


def layer_options(shape, specs, cluster: Cluster, batch_tokens: int, seq_len: int) -> list[LayerOption]:
    """Each spec's layers and predicted speedups (see the module docstring); an unparseable spec is an error."""
    ep = node_ep(cluster, shape.num_experts)
    hw = hardware(cluster, ep)
    tokens = max(seq_len, batch_tokens // cluster.gpus)
    options = []
    for spec in dict.fromkeys(specs):
        layers = converted_layers(spec, len(shape.layers))
        chosen = set(layers)
        options.append(
            LayerOption(
                spec,
                layers,
                training_speedup(shape, chosen, tokens, seq_len, ep, hw),
                prefill_speedup(shape, chosen, cluster, PREFILL_BATCH, PREFILL_CONTEXT),
            )
        )
    return options


def probe(name: str, data: str, options: list[LayerOption], seq_len: int = 256, num_sequences: int = 32) -> None:
    """Fill in each option's held-out KL and loss with ``fcsd probe``'s measurement (loads the weights)."""
    import torch

    from fcsd.distill.data import load_texts, pack_sequences
    from fcsd.distill.probe import probe_specs
    from fcsd.loading import from_pretrained, tokenizer_from_pretrained
    from fcsd.sources import resolve_data, resolve_model

    path = resolve_model(name)
    tokenizer = tokenizer_from_pretrained(path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = from_pretrained(path, layers=[], text_only=True, dtype=dtype).to(device)
    rows = load_texts(resolve_data(data), tokenizer, split="validation")
    sequences = pack_sequences(rows.texts, tokenizer, seq_len, num_sequences)
    measured = probe_specs(model, sequences, [o.layers for o in options], progress=False)
    for option, (loss, kl) in zip(options, measured, strict=True):
        option.loss, option.kl = loss, kl


def recommend(options: list[LayerOption], tokens: float, max_kl: float | None = None) -> tuple[LayerOption, str]:
    """The recommended option and why (see the module docstring)."""
    by_size = sorted(options, key=lambda o: len(o.layers))
    if all(o.kl is not None for o in options):
        limit = max_kl if max_kl is not None else by_size[-1].kl / 4
        within = [o for o in by_size if o.kl <= limit]
        chosen = within[-1] if within else by_size[0]
        source = (
            f"--max-kl {max_kl:g}" if max_kl is not None else f"a quarter of {by_size[-1].spec}'s {by_size[-1].kl:.3f}"
        )
        if not within:
            return chosen, f"no spec keeps the held-out KL within {limit:.3f} ({source}): the smallest one"
        return chosen, (
            f"the most layers whose held-out KL without training ({chosen.kl:.3f}) stays within {limit:.3f} "
            f"({source}); {chosen.training_speedup:.3f}x training step, {chosen.prefill_speedup:.3f}x prefill"
        )
    largest = by_size[-1]
    if tokens >= ALL_LAYERS_TOKENS:
        return largest, (
            f"a budget of {tokens:.3g} tokens (>= {ALL_LAYERS_TOKENS:.0e}) recovers every converted layer to within "
            f"1-3 points (paper Tab. 1, < 10B tokens) and gives the whole speedup "
            f"({largest.training_speedup:.3f}x training step, {largest.prefill_speedup:.3f}x prefill)"
        )
    half = next((o for o in by_size if o.spec == "last:50%"), by_size[len(by_size) // 2])
    return half, (
        f"a budget of {tokens:.3g} tokens (< {ALL_LAYERS_TOKENS:.0e}) is closer to paper Tab. 2's 300M, where Far 50% "
        f"recovers to within 0.6 points and 75%/100% stay 8/16 points below; measure with --probe DATA to decide "
        f"on your model ({half.training_speedup:.3f}x training step, {half.prefill_speedup:.3f}x prefill)"
    )
