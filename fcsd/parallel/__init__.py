"""The expert-parallel runtime (design §4), applied from outside: model code stays single-device (design §1).

- :func:`expert_parallel` (``apply_ep.py``): shard routed experts, install the schedules of paper Sec. 4.1 / 4.2;
- ``layout.py``: the whole layout of a run, EP x FSDP2 on one set of device meshes (:func:`~fcsd.parallel.layout
  .parallelize`), ``recompute.py``: activation checkpointing that replays the exchanges, ``step_state.py``: sharded
  step checkpoints (DCP) that reshard, ``stream_save.py``: ``final/``, ``best/`` streamed in the stock layout;
- ``load.py``: load a checkpoint with only this rank's experts (:func:`~fcsd.parallel.load.from_pretrained_sharded`),
  or laid out, reading only this rank's slices (:func:`~fcsd.parallel.load.from_pretrained_parallel`);
- ``shards.py``: expert shards, their stock-layout state dicts, placements applied by exchanging experts;
- ``dispatchers.py``: the dispatcher interface (local, all-to-all blocking / split-phase async, the deduplicating
  all-to-all of the expert-coupling paper, all-reduce);
- ``collectives.py``: async-safe autograd all-to-all (Appendix C);
- ``schedule.py``: the overlapped FarSkip layer schedule and the attention split;
- ``grads.py``: :func:`reduce_gradients`, :func:`full_state_dict` for trainers;
- ``training.py``: what the FCSD trainer needs under ``parallel.ep_size`` / ``parallel.fsdp`` (meshes, loading,
  gradient reduction, the global gradient norm over both meshes, optimizer groups);
- ``generate.py``: ``generate`` under expert parallelism, correct by construction;
- ``segments.py``: the markers the schedule sets for the timeline picture of ``fcsd bench overlap --link``;
- ``processes.py``: multi-process runs where the main process alone speaks, evaluates and reports;
- ``events.py``: the events of a step (launches, completions, replays, the schedule's markers) for tests;
- ``inference_shard.py``: the FCSD teacher sharded for inference.
"""

from fcsd.parallel.apply_ep import LAYOUTS, MODES, expert_parallel
from fcsd.parallel.grads import full_state_dict, reduce_gradients

__all__ = ["LAYOUTS", "MODES", "expert_parallel", "full_state_dict", "reduce_gradients"]
