"""``fcsd inspect``: what a checkpoint is and what a layer spec would convert, from its config alone.

Parameters are counted on a model built on the ``meta`` device (no weights are read or downloaded), so the counts
are exact for every family. Active parameters count ``top_k`` of the routed experts in each MoE layer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fcsd.connectivity.families import expert_count, family_for_config, find_decoder_layers, meta_model, text_config
from fcsd.connectivity.layer_spec import format_layers, parse_layer_spec
from fcsd.connectivity.patch import CONFIG_KEY


@dataclass
class ModelSummary:
    name: str
    family: str
    architecture: str
    num_layers: int
    moe_layers: list[int]
    dense_layers: list[int]
    num_experts: int
    top_k: int
    shared_experts: int
    total_params: int
    active_params: int
    spec: str | None
    converted_layers: list[int]
    farskip_layers: list[int]  # the layers the checkpoint already has FarSkip (a run's or an export's config)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_text(self) -> str:
        rows = [
            ("model", self.name),
            ("family", f"{self.family} ({self.architecture})"),
            ("decoder layers", str(self.num_layers)),
            ("MoE layers", f"{len(self.moe_layers)}: {format_layers(self.moe_layers)}"),
            ("dense layers", f"{len(self.dense_layers)}: {format_layers(self.dense_layers)}"),
            ("routed experts", f"{self.num_experts}, top-{self.top_k}"),
            ("shared experts", str(self.shared_experts)),
            ("parameters", f"{_human(self.total_params)} total, {_human(self.active_params)} active per token"),
        ]
        if self.farskip_layers:
            rows.append(("FarSkip already", f"{len(self.farskip_layers)} layers: {format_layers(self.farskip_layers)}"))
        if self.spec is not None:
            rows.append(
                (
                    f"layers {self.spec!r}",
                    f"{len(self.converted_layers)} converted: {format_layers(self.converted_layers)}",
                )
            )
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _human(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def summarize(name_or_path: str, layers=None, config=None) -> ModelSummary:
    """Summarise a hub id or local folder (reads ``config.json`` only) and resolve the layer spec ``layers``."""
    if config is None:
        from fcsd.loading import load_config

        config = load_config(name_or_path)  # an unreadable config.json is a one-line error
    family = family_for_config(config)
    model = meta_model(config)
    decoder_layers = find_decoder_layers(model, family)
    decoder_config = text_config(config)

    moe_layers, dense_layers, num_experts, routed_params = [], [], 0, 0
    for index, layer in enumerate(decoder_layers):
        mlp = getattr(layer, family.mlp_attr)
        if family.is_moe(mlp):
            moe_layers.append(index)
            experts = getattr(mlp, family.experts_attr)
            num_experts = expert_count(experts)
            routed_params += sum(p.numel() for p in experts.parameters())
        else:
            dense_layers.append(index)
    top_k = int(getattr(decoder_config, family.top_k_attr))
    total = sum(p.numel() for p in model.parameters())  # parameters() yields tied weights once
    active = total - (routed_params - routed_params * top_k // max(num_experts, 1))
    shared = 0 if family.shared is None else int(getattr(decoder_config, "n_shared_experts", None) or 1)
    converted = parse_layer_spec(layers, len(decoder_layers)) if layers is not None else []
    record = getattr(config, CONFIG_KEY, None)
    already = sorted(record.get("layers") or []) if isinstance(record, dict) else []
    return ModelSummary(
        name=name_or_path,
        family=family.name,
        architecture=(getattr(config, "architectures", None) or [type(model).__name__])[0],
        num_layers=len(decoder_layers),
        moe_layers=moe_layers,
        dense_layers=dense_layers,
        num_experts=num_experts,
        top_k=top_k,
        shared_experts=shared,
        total_params=total,
        active_params=active,
        spec=None if layers is None else str(layers),
        converted_layers=converted,
        farskip_layers=already,
    )
