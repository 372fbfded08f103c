"""Expert parallelism as a GPU run needs it, checked on 2 CPU gloo processes (tests/workers/ep_runtime.py, one
launch): one host synchronisation per MoE layer, bf16 precision and bitwise determinism, the collective order in
backward and its debug check, the order of the overlapped schedule, generate, loading only a rank's experts."""

from pathlib import Path

import pytest
from launch import worker_results

WORKER = Path(__file__).parent / "workers" / "ep_runtime.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return worker_results(2, WORKER, tmp_path_factory.mktemp("ep_runtime") / "out", timeout=600)


def test_one_host_sync_per_moe_layer_in_forward_and_none_in_backward(ranks):
    """Every family, every dispatcher (the node-aware one over two "nodes"), overlapped and regular: the
    expert-parallel forward adds exactly one
    device-to-host copy per MoE layer (the split sizes) to what the single-process model does; backward adds none."""
    for result in ranks:
        assert len(result["syncs"]) == 13
        for case, counts in result["syncs"].items():
            added = list(counts["forward"])
            for call in counts["stock"]:  # transformers' own (mask preparation), in both runs
                added.remove(call)
            assert added == ["tolist"] * counts["moe_layers"], case
            assert counts["backward"] == [], case


PRECISION_CASES = ["qwen3_moe/plain", "deepseek_v3/dedup", "llama4_text/plain", "qwen3_moe/hierarchical"]


@pytest.mark.parametrize("case", PRECISION_CASES)
def test_bf16_output_within_bf16_tolerance_and_bitwise_reproducible(ranks, case):
    for result in ranks:
        figures = result["precision"][case]
        assert figures["ep_bf16_vs_fp32"] < 1e-2  # bf16 keeps ~3 significant digits
        # the expert-parallel path adds no error of its own beyond autocast's (fp32 combine, fp32 weights)
        assert figures["ep_bf16_vs_fp32"] < 1.1 * figures["single_bf16_vs_fp32"]
        assert figures["bitwise"]  # outputs, input and parameter gradients identical across two runs
        if case.endswith("plain"):
            assert figures["wire_bytes"] == 2  # the hidden rows travel in bf16, not the fp32 of the master weights


def test_combine_sums_in_fp32_with_fp32_routing_weights(ranks):
    """Top-8 of 8 experts, identity experts, bf16 autocast: each token's weighted sum equals the exact sum of its
    bf16 rows with the fp32 weights to fp32 accuracy (a bf16 weight or accumulation would be ~1e-3 off). The
    deduplicating dispatcher sends each (token, rank) partial sum back in bf16: one bf16 rounding at most; the
    node-aware one rounds inside the node and again per (token, node): two at most."""
    for result in ranks:
        assert result["combine"]["plain"]["dtype"] == result["combine"]["dedup"]["dtype"] == "torch.float32"
        assert result["combine"]["plain"]["error"] < 1e-6
        assert result["combine"]["dedup"]["error"] < 2**-8
        assert result["combine"]["hierarchical"]["error"] < 2**-7
        # the sums are in fixed slots, not atomic scatter-adds (the CPU's bitwise checks cannot see GPU atomics)
        assert all(result["combine"][name]["atomic_float_sums"] == [] for name in ("plain", "dedup", "hierarchical"))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_two_forwards_summed_backward_in_exact_reverse_order_on_every_rank(ranks, family):
    """Rank 0 backpropagates lossA + lossB, rank 1 lossB + lossA: the reverse all-to-alls still come in exactly the
    reverse of the forward launches, identical on both ranks, and the gradients are the single-process ones."""
    first, second = (r["two_forwards"][family] for r in ranks)
    assert first["reverse"] == second["reverse"]
    assert first["reverse"] == first["forward"][::-1]
    assert len(first["forward"]) == 12  # 3 MoE layers x (dispatch, combine) x 2 forwards
    assert first["param_grad"] < 1e-5 and second["param_grad"] < 1e-5


def test_a_rank_receiving_no_rows_still_issues_every_reverse_exchange(ranks):
    """Rank 1's experts get no rows and transformers' eager experts return a tensor without autograd history there;
    the backward completes (no hang), with the same reverse exchanges as rank 0 and exact gradients."""
    assert ranks[1]["no_rows_eager"]["rows_received"] == 0
    assert ranks[0]["no_rows_eager"]["reverse"] == ranks[1]["no_rows_eager"]["reverse"]
    assert len(ranks[0]["no_rows_eager"]["reverse"]) == 6
    for result in ranks:
        assert result["no_rows_eager"]["param_grad"] < 1e-5


def test_order_check_passes_a_correct_run_and_names_a_mismatch(ranks):
    for result in ranks:
        check = result["order_check"]
        assert check["logits"] < 1e-5
        assert "out of order across ranks (rank 0: backward combine" in check["error"]
        assert "rank 1: forward counts" in check["error"]


def _check_schedule(events, layers_with_shared: bool):
    """The overlapped schedule of paper Sec. 4.1: Dispatch(k) is in flight during layer k's core attention;
    Combine(k) is launched before the shared experts run and waited in layer k+1, after its attention part a began
    and before Dispatch(k+1) is launched; only the last layer waits its own Combine."""
    position = {tuple(e): i for i, e in enumerate(map(tuple, events))}
    layer_at = [i for i, e in enumerate(events) if e[0] == "layer"]
    dispatches = [e[2] for e in events if e[:2] == ["launch", "dispatch"]]
    combines = [e[2] for e in events if e[:2] == ["launch", "combine"]]
    assert len(dispatches) == len(combines) == 3
    for index, (d, c) in enumerate(zip(dispatches, combines)):
        launch_d, done_d = position[("launch", "dispatch", d)], position[("done", "dispatch", d)]
        assert any(e[0] == "attention" for e in events[launch_d:done_d])  # overlaps core attention
        launch_c, done_c = position[("launch", "combine", c)], position[("done", "combine", c)]
        between = events[launch_c:done_c]
        if layers_with_shared:
            assert any(e[0] == "shared" for e in between)
        if index < 2:
            assert any(e[0] == "layer" for e in between)  # handed over to the next layer pending
            next_layer = max(i for i in layer_at if i < done_c)
            assert not any(e[0] == "attention" for e in events[next_layer:done_c])  # waited between parts a and b
            assert done_c < position[("launch", "dispatch", dispatches[index + 1])]


def test_overlapped_schedule_runs_in_the_promised_order(ranks):
    for result in ranks:
        _check_schedule(result["schedule"]["qwen3_moe"], layers_with_shared=False)
        _check_schedule(result["schedule"]["deepseek_v3"], layers_with_shared=True)


def test_mean_reduction_of_the_trainer_matches_the_mean_of_the_ranks_losses(ranks):
    for result in ranks:
        assert result["mean"] < 1e-5  # reduce_gradients(op="mean"), in several buckets


@pytest.mark.parametrize("case", ["qwen3_moe/all_to_all", "deepseek_v3/all_to_all"])
def test_generate_all_to_all_ranks_with_own_prompts_finishing_at_different_steps(ranks, case):
    steps = [r["generate"][case]["steps"] for r in ranks]
    assert steps[0] > steps[1]  # rank 1 stops first (4 new tokens at most) and keeps stepping with rank 0
    for result in ranks:
        assert result["generate"][case]["equal"]  # greedy tokens of the single-process model, per rank


@pytest.mark.parametrize("case", ["qwen3_moe/all_reduce", "deepseek_v3/all_reduce"])
def test_generate_all_reduce_takes_rank_zeros_prompt_and_tokens(ranks, case):
    for result in ranks:
        assert result["generate"][case]["equal"]  # rank 1's other prompt and perturbed logits are overruled
        assert result["generate"][case]["sampled_same"]


def test_sharded_loading_holds_only_the_ranks_experts_and_gathers_to_one_rank(ranks):
    for rank, result in enumerate(ranks):
        sharded = result["sharded"]
        assert sharded["halved"] and sharded["logits"] < 1e-5
        assert sharded["gathered_equal"]
        assert (sharded["gathered_keys"] > 0) == (rank == 0)
