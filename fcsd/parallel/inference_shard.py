"""Sharding the frozen FCSD teacher for inference only (design §3): under FSDP2 each decoder layer of the teacher
becomes its own FSDP unit, so a process holds 1/world of the teacher between forwards; no optimizer state, no
gradients. Under DeepSpeed ZeRO-3 the teacher is replicated (a frozen second engine is not worth its cost there:
use ``teacher.mode=cache`` when it does not fit)."""

from __future__ import annotations


def shard_for_inference(teacher, accelerator):
    """Shard ``teacher`` in place with FSDP2 over all processes when ``accelerator`` runs FSDP; else leave it."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP:
        return teacher
    from torch.distributed.fsdp import fully_shard

    from fcsd.connectivity.families import family_for_config, find_decoder_layers

    for layer in find_decoder_layers(teacher, family_for_config(teacher.config)):
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(teacher, reshard_after_forward=True)
    return teacher
