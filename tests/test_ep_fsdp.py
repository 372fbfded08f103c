"""EP x FSDP2 on one set of device meshes (fcsd.parallel.layout), 4 gloo processes against one process, in one launch
(tests/workers/ep_fsdp.py): losses, global gradient norms and weights after two AdamW steps with and without activation
checkpointing, EP 4 x FSDP 1, FSDP 4 alone with checkpointing, a placement with the deduplicating dispatcher; the
planted factor-of-ep expert gradient and the planted recomputed collective caught; each process's student and teacher
bytes equal to its share, the teacher resharded after its forward, generation (MBPP+'s included) and streamed saving of
a model loaded laid out; fcsd cache-teacher on the 4 processes, each writing its shards of the one-process cache. And
the same layout on fake tensors over a fake process group (what `fcsd plan` models): rank 0 holds what it holds in the
real launch."""

from pathlib import Path

import pytest
from launch import worker_results

WORKER = Path(__file__).parent / "workers" / "ep_fsdp.py"
CASES = [
    "deepseek_v3/ep2xfsdp2",
    "deepseek_v3/ep2xfsdp2/checkpointing",
    "llama4_text/ep2xfsdp2/checkpointing",
    "qwen3_moe/ep2xfsdp2/checkpointing+offload",  # the replayed rows kept in host memory (train.checkpoint_offload)
    "qwen3_moe/ep4xfsdp1",
    "qwen3_moe/fsdp4/checkpointing",  # FSDP2 alone: a layer recomputed before its own unit's pre-backward gather
    "qwen3_moe/ep2xfsdp2/placement+dedup",
    "qwen3_moe/ep2xfsdp2/checkpointing+offload+hierarchical",  # the node-aware dispatcher over two "nodes"
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return worker_results(4, WORKER, tmp_path_factory.mktemp("ep_fsdp") / "out", timeout=900)


def _same_training(result):
    assert result["loss"] < 1e-5  # per step, norm-relative to one process
    assert result["grad_norm"] < 1e-5  # the global norm over both meshes, before clipping
    assert all(ratio == pytest.approx(1.0, abs=1e-5) for ratio in result["expert_norm_ratio"])
    assert result["same_keys"] and result["weights"] < 1e-4  # every weight after 2 steps, in the stock layout


@pytest.mark.parametrize("case", CASES)
def test_layout_trains_as_one_process(ranks, case):
    for result in ranks:
        _same_training(result["cases"][case])
        assert result["cases"][case]["param_groups"] == 2  # fused AdamW, one group per mesh


CHECKPOINTED = [c for c in CASES if "/ep" in c and "checkpointing" in c]


@pytest.mark.parametrize("case", CHECKPOINTED)
def test_checkpointed_backward_replays_and_never_launches_an_exchange(ranks, case):
    for result in ranks:
        events = result["cases"][case]["backward_events"]
        assert "replay" in events and "reverse" in events  # recomputed layers, the reverse exchanges as always
        assert "launch" not in events and "done" not in events  # no forward exchange issued in the backward


@pytest.mark.parametrize("case", CHECKPOINTED)
def test_only_checkpoint_offload_moves_the_replayed_rows_to_host_memory(ranks, case):
    """Every Dispatch and Combine of every MoE layer and step (2 steps) copied out once waited, and nothing copied
    without the option; the training still equals one process's."""
    from tiny_models import CONFIGS

    from fcsd.connectivity.families import family_for_config, meta_model, moe_blocks

    _, config = CONFIGS[case.split("/")[0]]()
    layers = len(moe_blocks(meta_model(config), family_for_config(config)))
    # per MoE layer and step: plain's Dispatch and Combine; the node-aware dispatcher's pairs of both hops, the rows
    # its experts received and the rows that came home (the forwarded rows and sums are kept as shapes alone)
    per_layer = 4 if case.endswith("+hierarchical") else 2
    expected = 2 * layers * per_layer if "+offload" in case else 0
    for result in ranks:
        assert f"host copies: {expected}" in result["cases"][case]["backward_events"]


@pytest.mark.parametrize("case", CHECKPOINTED)
def test_offloaded_rows_of_the_next_layer_come_back_while_a_layer_is_recomputed(ranks, case):
    """train.checkpoint_offload: when the backward starts recomputing layer k, layer k-1's rows are copied back
    (prefetched: a side stream on GPUs), before its own recomputation; without offload nothing is prefetched, nor is
    a layer without exchanges (DeepSeek-V3's first, dense)."""
    from tiny_models import CONFIGS

    from fcsd.connectivity.families import family_for_config, find_decoder_layers, meta_model

    _, config = CONFIGS[case.split("/")[0]]()
    family = family_for_config(config)
    moe = [family.is_moe(getattr(layer, family.mlp_attr)) for layer in find_decoder_layers(meta_model(config), family)]
    expected = []
    for layer in range(len(moe) - 1, -1, -1):
        prefetched = layer and moe[layer - 1] and "+offload" in case
        expected += [f"recompute {layer}"] + ([f"prefetch {layer - 1}"] if prefetched else [])
    for result in ranks:
        assert result["cases"][case]["recomputation"] == expected * 2  # both steps


def test_planted_factor_of_ep_expert_gradient_is_caught(ranks):
    """Experts divided by their own group's size (FSDP2's default) instead of the process count: the expert
    gradients come out ep = 2 times too large, and the comparison with one process fails."""
    for result in ranks:
        planted = result["planted_ep_factor"]
        assert planted["expert_norm_ratio"][0] == pytest.approx(2.0, rel=1e-5)
        with pytest.raises(AssertionError):
            _same_training(planted)


def test_step_checkpoint_reads_back_exactly_into_a_fresh_layout(ranks):
    for result in ranks:
        assert result["dcp"]["tensors"] > 0 and result["dcp"]["equal"]


def test_planted_recomputed_collective_is_caught(ranks):
    for result in ranks:
        assert "exchange was issued during the backward pass" in result["planted_recompute"]


def test_each_process_holds_its_share_of_student_and_teacher(ranks):
    """Each process holds exactly its slice of every tensor (elements), in storages of that size plus FSDP2's
    padding only (no view keeping a whole checkpoint tensor alive): about a quarter of the model."""
    for result in ranks:
        loaded = result["loaded"]
        assert loaded["student_local"] == loaded["teacher_local"] == loaded["share"]
        assert loaded["share"][1] < loaded["total"] / 3  # no process holds a whole model
        assert loaded["teacher_resharded"]  # after its no-grad forward, nothing left gathered
        assert loaded["teacher_logits"] < 1e-5
    assert sum(r["loaded"]["share"][0] for r in ranks) == ranks[0]["loaded"]["total"]


def test_generation_and_streamed_saving_of_a_laid_out_model(ranks):
    for result in ranks:
        assert result["loaded"]["generate_equal"]  # greedy tokens of one process, each rank its own prompt
    assert ranks[0]["loaded"]["shards"] > 1  # several safetensors shards and an index
    assert ranks[0]["loaded"]["saved_equal"]  # the keys and values save_pretrained writes


def test_mbpp_plus_generation_under_the_layout_is_one_process_s(ranks):
    """What MBPP+ early stopping generates with the student laid out (each process its problems)."""
    for result in ranks:
        assert result["mbpp"]["problems"] > 0 and result["mbpp"]["equal"]


def test_cache_teacher_on_four_processes_each_writing_its_share(ranks):
    written = [result["cache"]["written"] for result in ranks]
    assert all(written) and len({name for names in written for name in names}) == sum(map(len, written))
    assert ranks[0]["cache"]["equal"]  # shard for shard the one-process cache


def test_layout_runs_on_fake_tensors_over_a_fake_process_group(ranks):
    """What `fcsd plan` needs to model the layout: parallelize on fake tensors over a fake 4-process group (this
    process as rank 0), then a checkpointed training forward and backward with the planner's balanced routing."""
    import contextlib

    import torch
    from tiny_models import CONFIGS
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor

    from fcsd.distill.config import FCSDConfig
    from fcsd.parallel.layout import ParallelDims, build_meshes, parallelize
    from fcsd.plan.run import _text_model
    from fcsd.plan.simulate import balanced_routing, fake_process_group, meshes_outside_fake_mode
    from fcsd.plan.tracker import MemoryTracker

    _, config = CONFIGS["deepseek_v3"]()
    config._attn_implementation = "eager"
    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_process_group(4))
        meshes = build_meshes(ParallelDims(4, 2, True), "cpu")
        stack.enter_context(balanced_routing(16, config.num_experts_per_tok))
        stack.enter_context(meshes_outside_fake_mode())
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        tracker = stack.enter_context(MemoryTracker("cpu"))
        model = _text_model(config, torch.float32, FCSDConfig(), "all", subset=tuple(range(config.num_hidden_layers)))
        parallelize(model, meshes, "student", checkpointing=True)
        logits = model(input_ids=torch.randint(0, 90, (1, 16)), use_cache=False).logits
        logits.sum().backward()
        local = sum(p._local_tensor.numel() for p in model.parameters() if isinstance(p, DTensor))
        grads = all(p.grad is not None for p in model.parameters())
    assert tuple(logits.shape) == (1, 16, config.vocab_size) and grads
    assert local == ranks[0]["loaded"]["student_local"][0]  # rank 0's share, as the real 4-process layout holds
    assert tracker.peak > 0


def test_a_replayed_exchange_that_received_no_rows_comes_back_from_host_memory():
    """train.checkpoint_offload: an exchange that received nothing (a rank whose experts got no rows, the node-aware
    dispatcher's fan-out to a rank with none) is kept in host memory and comes back with its shape and dtype."""
    import torch

    from fcsd.parallel.recompute import HostCopy

    for shape in ((0, 5), (3, 0)):
        back = HostCopy(torch.empty(shape, dtype=torch.bfloat16, requires_grad=True)).back()
        assert back.shape == shape and back.dtype == torch.bfloat16 and back.requires_grad
    rows = torch.randn(4, 3)
    assert torch.equal(HostCopy(rows).back(), rows)


def test_an_fsdp2_step_emits_no_view_warning(tmp_path):
    """FSDP2 warned on every step of a run that asks for hidden states (the default guided recipe): "FSDP2-wrapped
    module (...ForCausalLM) returned a view tensor ... can produce wrong gradients". The view is the first decoder
    layer's input as FSDP2's own pre-forward hook hands it on, recorded as ``hidden_states[0]``; fcsd changes no
    output in place, so it was noise, and the root's outputs are now copies where they were views. Under FSDP 2 and
    EP 2 x FSDP 1, one training step warns nothing; without the copy (planted) the warning is caught."""
    worker = Path(__file__).parent / "workers" / "fsdp_views.py"
    for result in worker_results(2, worker, tmp_path / "out", timeout=600):
        assert result["fsdp2"] == [] and result["ep2xfsdp1"] == [], result
        assert any("ForCausalLM) returned a view tensor" in message for message in result["planted"]), result
