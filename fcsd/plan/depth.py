"""Simulating a deep model through a few of its layers, exactly (what makes ``fcsd plan`` take seconds).

A decoder stack is a sequence of runs of identical layers (same kind: MoE or dense, FarSkip or regular). Every
quantity of a training step the planner reads (the bytes alive at each phase's peak, the largest activations, the
static bytes, the FLOPs) grows by the same amount with each extra interior layer of a run: it is linear in the run
lengths. So the step is simulated on a *skeleton* that keeps the first ``KEEP`` layers of every run (every kind,
every boundary between runs, the first layer, neighbours for FSDP2's prefetch), and once more with one extra
layer in each long run (runs of the same length grow together, since they weigh the same); the full model's value
is ``Q(skeleton) + sum_j (len_j - KEEP) (Q(skeleton + 1 in the runs of length len_j) - Q(skeleton))``. Attention
variants that do not change a layer's memory (Llama-4's NoPE / chunked layers at sequence lengths below the chunk)
do not start a new run.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

KEEP = 3  # layers kept per run: its first, an interior one with neighbours of its kind, and its last


@dataclass(frozen=True)
class Run:
    kind: tuple[bool, bool]  # (MoE layer, converted to FarSkip)
    start: int
    length: int


@dataclass(frozen=True)
class Reduction:
    """``subsets[i]`` are the full-model layer indices a simulation keeps; the full model's value of any linear
    quantity is ``sum(weights[i] * value[i])``."""

    num_layers: int
    subsets: tuple[tuple[int, ...], ...]
    weights: tuple[float, ...]

    def combine(self, values: list):
        """The full model's value from one value (a number or a dict of numbers) per subset."""
        if isinstance(values[0], dict):
            keys = {k for v in values for k in v}
            return {k: self.combine([v.get(k, 0) for v in values]) for k in keys}
        return sum(w * v for w, v in zip(self.weights, values, strict=True))


def layer_runs(kinds: list[tuple[bool, bool]]) -> list[Run]:
    runs: list[Run] = []
    for index, kind in enumerate(kinds):
        if runs and runs[-1].kind == kind:
            last = runs[-1]
            runs[-1] = Run(kind, last.start, last.length + 1)
        else:
            runs.append(Run(kind, index, 1))
    return runs


def reduction(kinds: list[tuple[bool, bool]], keep: int = KEEP) -> Reduction:
    """The simulations that give the full stack's values (see the module docstring); a stack without long runs is
    simulated whole."""
    runs = layer_runs(kinds)
    skeleton = [i for run in runs for i in range(run.start, run.start + min(run.length, keep))]
    subsets, weights = [tuple(skeleton)], [1.0]
    by_extra: dict[int, list[Run]] = {}  # runs with as many layers beyond the skeleton grow in one simulation
    for run in runs:
        if run.length > keep:
            by_extra.setdefault(run.length - keep, []).append(run)
    for extra, group in by_extra.items():
        grown = sorted(skeleton + [run.start + keep for run in group])  # one more interior layer in each run
        subsets.append(tuple(grown))
        weights.append(float(extra))
        weights[0] -= extra
    return Reduction(len(kinds), tuple(subsets), tuple(weights))


def layer_kinds(model: nn.Module, converted: list[int]) -> list[tuple[bool, bool]]:
    """``(MoE, FarSkip)`` of every decoder layer of ``model`` (a meta-device build is enough)."""
    from fcsd.connectivity.families import family_for_config, find_decoder_layers

    family = family_for_config(model.config)
    chosen = set(converted)
    return [
        (family.is_moe(getattr(layer, family.mlp_attr)), index in chosen)
        for index, layer in enumerate(find_decoder_layers(model, family))
    ]


def keep_layers(model: nn.Module, subset: tuple[int, ...]) -> None:
    """Keep only the decoder layers ``subset`` (full-model indices, in order) of ``model``, in place: the module
    list, the layer count and the per-layer types of the config follow."""
    from fcsd.connectivity.families import family_for_config, find_decoder_layers, text_config

    family = family_for_config(model.config)
    layers = find_decoder_layers(model, family)
    kept = [layers[i] for i in subset]
    for owner in model.modules():
        for name, child in owner.named_children():
            if child is layers:
                setattr(owner, name, nn.ModuleList(kept))
    config = text_config(model.config)
    types = getattr(config, "layer_types", None)
    if types is not None and len(types) > max(subset, default=0):
        config.layer_types = [types[i] for i in subset]
    config.num_hidden_layers = len(subset)
