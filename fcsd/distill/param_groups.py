"""Which parameters of the student train, and at which LR (design §3 recovery recipes, issue 27 item 3).

Every parameter belongs to one group of :data:`~fcsd.distill.config.PARAM_GROUPS`, found from the model's modules
through its family row (so it works for every supported family): ``embeddings`` (input embeddings, LM head),
``attention``, ``norms`` (every norm, the final one included), ``router``, ``experts`` (the routed experts),
``shared_experts`` (the rest of a MoE block) and ``dense_mlp`` (the MLP of a dense layer). A group outside
``recovery.trainable`` is frozen: ``requires_grad`` is False, so it gets no gradient and AdamW holds no state for
it (``fcsd plan`` counts only what requires a gradient).
"""

from __future__ import annotations

from torch import nn

from fcsd.connectivity.families import family_for_config, final_norm, find_decoder_layers
from fcsd.distill.config import FCSDConfig, peak_lr, trainable_groups


def parameter_groups(model: nn.Module) -> dict[str, str]:
    """Parameter name (as ``named_parameters`` gives it) -> group name."""
    family = family_for_config(model.config)
    owner: dict[int, str] = {}

    def mark(module: nn.Module | None, group: str) -> None:
        if module is not None:
            for param in module.parameters():
                owner.setdefault(id(param), group)

    for layer in find_decoder_layers(model, family):
        mark(layer.self_attn, "attention")
        mlp = getattr(layer, family.mlp_attr)
        if family.is_moe(mlp):
            mark(family.router(mlp), "router")
            mark(getattr(mlp, family.experts_attr), "experts")
            mark(mlp, "shared_experts")
        else:
            mark(mlp, "dense_mlp")
        mark(layer, "norms")  # what is left of a layer: its norms
    mark(model.get_input_embeddings(), "embeddings")
    mark(model.get_output_embeddings(), "embeddings")
    mark(final_norm(model), "norms")
    groups = {}
    for name, param in model.named_parameters():
        if id(param) not in owner:
            raise ValueError(f"parameter {name} belongs to no parameter group: fcsd.distill.param_groups misses it")
        groups[name] = owner[id(param)]
    return groups


def optimizer_groups(student: nn.Module, config: FCSDConfig) -> list[dict]:
    """Freeze what ``recovery.trainable`` (and ``train.freeze_embeddings``) leaves out, and return AdamW parameter
    groups, one per LR multiplier (``recovery.lr_mult``; ``lr`` = the run's peak LR x multiplier, the peak being
    ``train.lr`` x ``recovery.lr_scale``: :func:`fcsd.distill.config.peak_lr`; ``lr_mult`` keeps the multiplier, so
    the run logs the base LR whatever group comes first). Raises when nothing is left to train."""
    recovery = config.recovery
    trained = set(trainable_groups(recovery))
    if config.train.freeze_embeddings:  # paper Tab. 2 "KL embed."
        trained.discard("embeddings")
    by_mult: dict[float, list] = {}
    groups = parameter_groups(student)
    for name, param in student.named_parameters():
        group = groups[name]
        if group not in trained:
            param.requires_grad_(False)
        if param.requires_grad:
            by_mult.setdefault(float(recovery.lr_mult.get(group, 1.0)), []).append(param)
    if not by_mult:
        raise ValueError(
            f"recovery.trainable={recovery.trainable!r} leaves no parameter to train (train.freeze_embeddings="
            f"{config.train.freeze_embeddings}): add a group"
        )
    peak = peak_lr(config)
    return [{"params": params, "lr": peak * mult, "lr_mult": mult} for mult, params in sorted(by_mult.items())]
