"""Expert parallelism (fcsd.parallel) on CPU gloo processes: every family and mode against the single-process model.

One torchrun launch per world size runs every case (tests/workers/expert_parallel.py) and writes a JSON per rank;
the tests below only read them. fp32; errors are norm-relative (|a - b| / |b|).
"""

import json
from pathlib import Path

import pytest
from launch import torchrun
from tiny_models import TEXT_FAMILIES

TOL = 1e-5
WORKER = Path(__file__).parent / "workers" / "expert_parallel.py"
MODES = ("regular", "farskip_reference", "farskip_overlap")


def _launch(tmp_path_factory, nproc, which):
    out = tmp_path_factory.mktemp(f"ep{nproc}") / "out"
    result = torchrun(nproc, str(WORKER), str(out), which, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(nproc)]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _launch(tmp_path_factory, 2, "full")


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _launch(tmp_path_factory, 4, "lite")


def _assert_matches(result, farskip):
    assert result["logits"] < TOL
    assert result["input_grad"] < TOL
    assert result["param_grad"] < TOL
    if farskip:
        assert result["reference_logits"] < TOL


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_two_ranks_outputs_and_gradients_match_single_process(two, family, mode):
    for rank_result in two:
        result = rank_result["cases"][f"{family}/{mode}"]
        _assert_matches(result, mode != "regular")
        assert result["rows_sent"] > 0  # tokens really crossed ranks


@pytest.mark.parametrize("case", ["deepseek_v3/regular", "deepseek_v3/farskip_overlap", "llama4_text/farskip_overlap"])
def test_four_ranks_outputs_and_gradients_match_single_process(four, case):
    for rank_result in four:
        _assert_matches(rank_result["cases"][case], "farskip" in case)


def test_overlap_runs_the_between_step_inside_attention(two):
    counts = two[0]["split_counts"]
    assert counts["inside_attention"] > 0 and counts["after_attention"] == 0


@pytest.mark.parametrize("family", ["deepseek_v3", "llama4_text", "qwen2_moe"])
def test_sync_debug_switch_gives_the_same_results(two, family):
    for rank_result in two:
        _assert_matches(rank_result["sync_debug"][family], True)


@pytest.mark.parametrize("mode", ["regular", "farskip_overlap"])
def test_rank_and_experts_receiving_no_tokens(two, four, mode):
    for results in (two, four):
        for rank, rank_result in enumerate(results):
            result = rank_result["route_to_first"][mode]
            _assert_matches(result, mode != "regular")
            if rank > 0:  # experts 0 and 1 live on rank 0: the others receive nothing
                assert result["rows_received"] == 0


def test_greedy_generation_under_all_reduce_layout_matches(two, four):
    for results in (two, four):
        for rank_result in results:
            assert rank_result["generate"] and all(g["equal"] for g in rank_result["generate"].values())


def test_gathered_state_dict_equals_the_original(two, four):
    for results in (two, four):
        for rank_result in results:
            assert all(rank_result["state_dict_equal"].values())


@pytest.mark.parametrize(
    "case, words",
    [
        ("not_converted", "apply_farskip"),
        ("regular_on_converted", "farskip_reference"),
        ("bad_mode", "regular, farskip_reference, farskip_overlap"),
        ("indivisible", "cannot be split evenly"),
        ("bad_dispatcher", "use one of plain, dedup"),
        ("placement_ep", "computed for EP 4 but the expert-parallel group has 2 ranks"),
        ("checkpointing", "enable it with fcsd.parallel.recompute.enable(model)"),
    ],
)
def test_errors_are_clear(two, case, words):
    assert words in two[0]["errors"][case]


def test_dedup_dispatcher_matches_plain_in_the_model(two, four):
    for results in (two, four):
        for rank_result in results:
            for name, result in rank_result["dedup"].items():
                _assert_matches(result, "regular" not in name)
            family_mode = next(iter(rank_result["dedup"]))
            plain = rank_result["cases"].get(family_mode)
            if plain is not None:  # one row per (token, rank) never exceeds one per (token, expert)
                assert 0 < rank_result["dedup"][family_mode]["rows_sent"] <= plain["rows_sent"]
        for rank, rank_result in enumerate(results):
            if rank > 0:  # experts 0 and 1 live on rank 0: the others receive nothing
                assert rank_result["dedup"]["route_to_first"]["rows_received"] == 0


@pytest.mark.parametrize("blocking", ["True", "False"])
def test_dedup_dispatcher_equals_plain_and_counts_like_the_offline_definition(two, four, blocking):
    for results in (two, four):
        for rank_result in results:
            result = rank_result["direct_dispatch"][blocking]
            assert result["output"] < TOL and result["x_grad"] < TOL and result["weight_grad"] < TOL
            assert result["rows"][0] == result["rows"][1] and result["bytes"][0] == result["bytes"][1]
            assert result["plain_rows"][0] == result["plain_rows"][1]
            assert result["rows"][0] < result["plain_rows"][0]  # token 0's experts 0 and 1 share rank 0
        # the combine returns one partial sum per (token, remote rank): as many rows as the dispatch sent
        combine = sum(r["direct_dispatch"][blocking]["combine_rows"] for r in results)
        assert combine == sum(r["direct_dispatch"][blocking]["rows"][0] for r in results)


def test_hierarchical_dispatcher_matches_the_single_process_model(two, four):
    """Two "nodes" (of 1 rank on 2 processes, of 2 on 4): the node-aware dispatcher in the model equals one process
    (logits, gradients, the hand-written FarSkip reference), and sends fewer rows across nodes than plain."""
    for results in (two, four):
        assert results[0]["hierarchical"]
        for name in results[0]["hierarchical"]:
            for rank_result in results:
                _assert_matches(rank_result["hierarchical"][name], "regular" not in name)
            if name in results[0]["cases"]:  # all ranks together: a forwarder sends back what it forwarded
                crossed = [sum(r[kind][name]["inter_rows_sent"] for r in results) for kind in ("hierarchical", "cases")]
                assert 0 < crossed[0] <= crossed[1]


@pytest.mark.parametrize("blocking", ["True", "False"])
def test_hierarchical_dispatcher_equals_plain_and_counts_rows_crossing_nodes_by_hand(two, four, blocking):
    for results in (two, four):
        for rank_result in results:
            result = rank_result["direct_dispatch"][blocking]
            assert max(result["hier"]) < TOL  # output, token gradients, routing-weight gradients
            for key in ("inter_plain", "inter_hier", "inter_hier_bytes"):  # counted == hand count on the routes
                assert result[key][0] == result[key][1], key
            assert result["inter_hier"][0] < result["inter_plain"][0]  # one row per (token, node), not per expert
            assert result["hier_received"] == result["dedup_received"]  # inside the node: one row per (token, rank)
        # every row that crossed a node boundary comes back once, as one partial sum per (token, node)
        combine = sum(r["direct_dispatch"][blocking]["inter_combine"][0] for r in results)
        assert combine == sum(r["direct_dispatch"][blocking]["inter_combine"][1] for r in results)


def test_placement_in_expert_parallel_keeps_outputs_and_gradients(two):
    for rank_result in two:
        assert len(rank_result["placement"]) == 2
        for name, result in rank_result["placement"].items():
            _assert_matches(result, "regular" not in name)
            assert result["unplaced_logits"] < TOL


def test_placement_gathered_state_dict_is_the_permuted_stock_layout(two):
    for rank_result in two:
        assert rank_result["placement_state_dict"] == {
            "equal": True,
            "permuted": True,
            "fresh_logits": pytest.approx(0.0, abs=TOL),
            "recorded": True,
        }
