"""The layer-local warm start (design §3 recovery recipes, issue 27 item 1; after MOHAWK's hidden-state alignment
and Zebra-Llama's per-layer stage).

One teacher forward gives, for every decoder layer k, the teacher's input stream ``o_{k-1}``, its output ``o_k``
and its routed-expert output ``routed_k``. Every converted student layer k then runs once on FarSkip inputs built
from the *teacher's* streams (design §2)::

    attention input  n_{k-1} = o_{k-1} - routed_{k-1}   (o_{k-1} when layer k-1 is not a converted layer)
    MoE input        o_{k-1}

and is fitted to the teacher layer's update ``o_k - o_{k-1}``. The inputs are detached, so the layers train
independently, all at once, with no backward through the depth; errors do not compound as they do end to end.

The loss of a token is the squared error of the update relative to the update's own size,
``|d_s - d_t|^2 / |d_t|^2``, averaged over the converted layers: scale-free across layers (the residual updates
grow with depth) and a sum over tokens like every other FCSD loss, so it does not depend on micro-batching.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import torch

from fcsd.connectivity.families import family_for_config, find_decoder_layers
from fcsd.connectivity.patch import FarSkipLayerMixin
from fcsd.distill.data import Packed
from fcsd.distill.objectives import NO_LOGITS, LossParts


@dataclass
class TeacherStreams:
    """What one teacher forward recorded, per decoder layer: its input ``o_{k-1}``, its output ``o_k``, its
    routed-expert output (None for a dense layer) and the keyword arguments the model passed it."""

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    routed: list[torch.Tensor | None]
    kwargs: list[dict]


def teacher_streams(teacher, batch: Packed) -> TeacherStreams:
    """One forward of the (stock) teacher on ``batch``, without gradients and without its LM head."""
    family = family_for_config(teacher.config)
    layers = find_decoder_layers(teacher, family)
    count = len(layers)
    inputs, outputs, kwargs = [None] * count, [None] * count, [None] * count
    mlp_inputs: list[torch.Tensor | None] = [None] * count

    def hooks(k: int):
        def before(module, args, kw):
            inputs[k] = args[0] if args else kw["hidden_states"]
            kwargs[k] = {key: value for key, value in kw.items() if key != "hidden_states"}

        def after(module, args, output):
            outputs[k] = output[0] if isinstance(output, tuple) else output

        def mlp_before(module, args):
            mlp_inputs[k] = args[0]

        return before, after, mlp_before

    with ExitStack() as stack, torch.no_grad():
        for k, layer in enumerate(layers):
            before, after, mlp_before = hooks(k)
            stack.callback(layer.register_forward_pre_hook(before, with_kwargs=True).remove)
            stack.callback(layer.register_forward_hook(after).remove)
            stack.callback(getattr(layer, family.mlp_attr).register_forward_pre_hook(mlp_before).remove)
        teacher(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            logits_to_keep=NO_LOGITS.to(batch.input_ids.device),
            use_cache=False,
        )
        routed = []
        for k, layer in enumerate(layers):
            mlp = getattr(layer, family.mlp_attr)
            routed.append(family.routed(mlp, mlp_inputs[k]) if family.is_moe(mlp) else None)
    return TeacherStreams(inputs, outputs, routed, kwargs)


def farskip_inputs(streams: TeacherStreams, k: int, previous_converted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o_{k-1}, n_{k-1})`` of design §2 for layer ``k``, from the teacher's streams, detached."""
    full = streams.inputs[k].detach()
    routed = streams.routed[k - 1] if k > 0 and previous_converted else None
    partial = full if routed is None else full - routed.detach().view(full.shape)
    return full, partial


def layer_local_loss(student, teacher, batch: Packed) -> tuple[LossParts, dict[int, torch.Tensor]]:
    """The warm start's loss sum over ``batch``'s tokens (see the module docstring) and each converted layer's
    detached share of it. ``student`` is the unwrapped FarSkip student; ``teacher`` the online teacher."""
    streams = teacher_streams(teacher, batch)
    layers = find_decoder_layers(student, family_for_config(student.config))
    converted = [k for k, layer in enumerate(layers) if isinstance(layer, FarSkipLayerMixin)]
    total, per_layer = None, {}
    for k in converted:
        full, partial = farskip_inputs(streams, k, k - 1 in converted)
        out = layers[k].forward(full, partial, **streams.kwargs[k])[0]
        target = (streams.outputs[k] - streams.inputs[k]).float()
        error = (out.float() - full.float() - target).pow(2).sum(-1)
        token_loss = error / target.pow(2).sum(-1).clamp_min(1e-12)
        layer_sum = token_loss.sum() / len(converted)
        per_layer[k] = layer_sum.detach()
        total = layer_sum if total is None else total + layer_sum
    tokens = batch.input_ids.numel()
    return LossParts(total, tokens, {"local": total.detach()}), per_layer


def average_gradients(student) -> None:
    """Average the converted layers' gradients over the data-parallel processes. The warm start calls the layers
    directly, not through DDP's forward, so DDP does not reduce them; every process holds the same set of
    parameters with gradients (the converted layers'), a missing one counting as zero."""
    import torch.distributed as dist

    world = dist.get_world_size()
    layers = find_decoder_layers(student, family_for_config(student.config))
    for layer in layers:
        if not isinstance(layer, FarSkipLayerMixin):
            continue
        for param in layer.parameters():
            if not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad)
            param.grad.div_(world)
