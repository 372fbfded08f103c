"""Expert coupling (second paper): placement on planted routes, statistics, the shuffle planner, apply_placement on
every family, routes capture and the routes/placement files."""

import json

import numpy as np
import pytest
import torch
from tiny_models import CONFIGS, build

from fcsd.connectivity.patch import apply_farskip, remove_farskip
from fcsd.placement import (
    Placement,
    PlacementError,
    RoutesError,
    apply_placement,
    contiguous_placement,
    correlated_placement,
    load_placement,
    load_routes,
    record_routes,
)
from fcsd.placement.coupling_table import coupling_report
from fcsd.placement.shuffle import ShufflePlanner, assign_owners, evaluate_shuffle
from fcsd.placement.solver import coselection, intra_weight
from fcsd.placement.stats import coselection_summary, dispatch_counts, transition_summary, within_layer
from fcsd.placement.synthetic_routes import cluster_placement, planted_routes


@pytest.fixture(scope="module")
def planted():
    routes, truth = planted_routes(num_experts=32, top_k=2, num_layers=4, tokens=16384, pair_rate=0.8, seed=1)
    return routes, truth


def balanced(placement):
    for ranks in placement.layers.values():
        assert (np.bincount(ranks, minlength=placement.ep) == placement.num_experts // placement.ep).all()


@pytest.mark.parametrize("nodes", [1, 2])
def test_correlated_placement_finds_planted_clusters(planted, nodes):
    routes, truth = planted
    fit, held = routes.split(0.25)
    found = correlated_placement(fit, ep=8, nodes=nodes)
    best = cluster_placement(truth, 8)
    balanced(found)
    for layer in routes.layers:
        w = coselection(fit.layer(layer), 32)
        assert intra_weight(w, found.ranks(layer)) == intra_weight(w, best.ranks(layer))
        # the same clusters (rank labels may differ): experts share a rank in one iff in the other
        same = found.ranks(layer)[:, None] == found.ranks(layer)[None, :]
        assert (same == (truth[layer][:, None] == truth[layer][None, :])).all()
        if nodes == 2:  # ranks 0-3 on node 0, 4-7 on node 1: each node holds whole clusters
            node = found.ranks(layer) // 4
            assert all(len(set(node[truth[layer] == c])) == 1 for c in range(8))


def test_stats_report_planted_pairs_and_chains(planted):
    routes, truth = planted
    _, held = routes.split(0.25)
    contiguous, best = contiguous_placement(held, 8), cluster_placement(truth, 8)
    ids = held.layer(2)
    planted_share = within_layer(ids, best.ranks(2))
    chance = within_layer(ids, contiguous.ranks(2))
    # 80% of tokens stay in their cluster; the rest land on one rank by chance (about 1/8 of them)
    assert planted_share["same_gpu"] == pytest.approx(0.8 + 0.2 / 8, abs=0.02)
    assert chance["same_gpu"] < 0.25
    assert planted_share["dedup_removed"] == pytest.approx(planted_share["same_gpu"] / 2)  # top-2: one row saved
    co = coselection_summary(ids, 32)
    assert co["top_pairs_share"] > 3 * co["independent_share"]
    # chained cluster at l+1 is a function of the cluster at l: each expert's top successor holds ~ 0.8*0.8/2
    assert transition_summary(held.layer(1), held.layer(2), 32)["median_top_successor"] > 0.2


def test_dispatch_counts_rows_and_bytes():
    ids = np.array([[0, 1], [0, 2], [3, 1], [2, 3]])  # 4 experts on 2 ranks: {0, 1} on rank 0, {2, 3} on rank 1
    ranks = np.array([0, 0, 1, 1])
    counts = dispatch_counts(ids, ranks, source_T=np.array([0, 1, 1, 0]), hidden_size=8, elem_bytes=2)
    assert (counts.rows_plain, counts.rows_dedup) == (8, 6)  # tokens 0 and 3 send one row to one rank
    assert (counts.remote_plain, counts.remote_dedup) == (4, 3)  # token 3's two remote rows become one
    # plain: 8 rows of 8 x 2 bytes, nothing else; dedup: 6 rows, plus an int32 id and an fp32 weight per pair
    assert (counts.bytes_plain, counts.bytes_dedup) == (8 * 16, 6 * 16 + 8 * 8)
    assert (counts.remote_bytes_plain, counts.remote_bytes_dedup) == (4 * 16, 3 * 16 + 4 * 8)
    assert counts.dedup_removed == pytest.approx(2 / 8)
    assert within_layer(ids, ranks) == pytest.approx({"same_gpu": 0.5, "gpus_per_token": 1.5, "dedup_removed": 0.25})


def _sequential_greedy(d):
    tokens, ranks = d.shape
    caps = np.full(ranks, tokens // ranks) + (np.arange(ranks) < tokens % ranks)
    top2 = np.sort(d, axis=1)[:, -2:]
    owner = np.full(tokens, -1)
    for t in np.argsort(-(top2[:, 1] - top2[:, 0]), kind="stable"):
        scores = np.where(caps > 0, d[t], -np.inf)
        owner[t] = int(np.argmax(scores))
        caps[owner[t]] -= 1
    return owner


@pytest.mark.parametrize("tokens,ranks", [(64, 4), (90, 8), (256, 16)])
def test_owner_assignment_is_the_sequential_greedy_and_balanced(tokens, ranks):
    rng = np.random.default_rng(tokens)
    d = rng.dirichlet(np.full(ranks, 0.3), size=tokens).astype(np.float32)
    d[: tokens // 2] = d[0]  # many tokens want the same rank: capacity binds
    owner = assign_owners(d)
    assert (owner == _sequential_greedy(d)).all()
    counts = np.bincount(owner, minlength=ranks)
    assert counts.max() - counts.min() <= 1 and counts.sum() == tokens


def test_planner_hit_rate_approaches_planted_rate(planted):
    routes, truth = planted
    fit, held = routes.split(0.25)
    best = cluster_placement(truth, 8)
    result = evaluate_shuffle(fit, held, best, step_tokens=1024, order=2)
    # predictable when the previous layer was planted (0.8) and the chain held (0.8): then its planted experts
    # (0.8) are all on the predicted rank; otherwise about 1/8 of a token's experts are local by chance
    hit = 0.8 * 0.8
    expected = hit * (0.8 + 0.2 / 8) + (1 - hit) / 8
    assert result["local_moved"] == pytest.approx(expected, abs=0.03)
    assert result["local_stay"] == pytest.approx(1 / 8, abs=0.02)
    planner = ShufflePlanner.fit(fit, best)
    owner = planner.plan(held, 2, slice(0, 1024))
    assert (np.bincount(owner, minlength=8) == 128).all()  # every rank exactly T/P tokens


def test_coupling_report_fields(planted):
    routes, _ = planted
    report = coupling_report(routes, [8, 16], holdout=0.25, step_tokens=1024, hidden_size=16)
    for ep in ("8", "16"):
        for name in ("contiguous", "correlated"):
            row = report["ep"][ep][name]
            for key in ("same_gpu", "gpus_per_token", "dedup_removed", "local_stay", "local_moved", "planner_local"):
                assert np.isfinite(row[key])
            assert row["rows_dedup"] <= row["rows_plain"]
    # EP 8: a planted cluster fits one rank; EP 16: two ranks, so 2 of a cluster's 6 pairs can share one
    gain = {ep: report["ep"][ep]["correlated"]["same_gpu"] - report["ep"][ep]["contiguous"]["same_gpu"] for ep in "8"}
    gain["16"] = report["ep"]["16"]["correlated"]["same_gpu"] - report["ep"]["16"]["contiguous"]["same_gpu"]
    assert gain["8"] > 0.6 and 0.8 / 3 - 0.05 < gain["16"] + report["ep"]["16"]["contiguous"]["same_gpu"] < 0.35
    assert report["ep"]["8"]["correlated"]["local_moved"] > 3 * report["ep"]["8"]["correlated"]["local_stay"]


def _random_placement(routes, ep, rng):
    e, groups = routes.num_experts, routes.header["routing_groups"]
    if groups > 1:  # group-limited routing: whole groups move (a random balanced map of groups to ranks)
        size = e // groups
        maps = [rng.permutation(np.arange(groups) // (groups // ep))[np.arange(e) // size] for _ in routes.layers]
        while all((m == np.arange(e) // (e // ep)).all() for m in maps):
            maps = [rng.permutation(np.arange(groups) // (groups // ep))[np.arange(e) // size] for _ in routes.layers]
        return Placement(e, ep, 1, dict(zip(routes.layers, maps)))
    return Placement(e, ep, 1, {layer: rng.permutation(np.arange(e) // (e // ep)) for layer in routes.layers})


def _logits(model, x):
    runner = getattr(model, "language_model", model)
    return runner(input_ids=x).logits


@pytest.mark.parametrize("name", list(CONFIGS))
def test_apply_placement_keeps_outputs_and_moves_routes(name):
    model = build(name)
    if name == "deepseek_v3":  # a non-zero correction bias must move with its experts
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randint(3, 97, (2, 12))
    before = record_routes(model, x)
    reference = _logits(model, x)
    placement = _random_placement(before, 2, np.random.default_rng(0))
    apply_placement(model, placement)
    torch.testing.assert_close(_logits(model, x), reference, atol=1e-5, rtol=1e-5)
    after = record_routes(model, x)
    for layer in before.layers:
        new_slot = np.argsort(placement.order(layer))  # old expert id -> its new slot
        assert (np.sort(new_slot[before.layer(layer)], 1) == np.sort(after.layer(layer), 1)).all()
    record = model.config.farskip["placement"]
    assert record["ep"] == 2 and set(record["expert_order"]) == {str(i) for i in before.layers}


def test_group_limited_routing_placement_is_kept_or_refused():
    model = build("deepseek_v3")
    x = torch.randint(3, 97, (2, 12))
    routes = record_routes(model, x)
    assert routes.header["routing_groups"] == 4  # tiny config: 8 experts in 4 groups, top-2 groups
    # EP 8 > 4 groups: experts may only move among the ranks of their own group
    found = correlated_placement(routes, 8)
    for ranks in found.layers.values():
        assert (ranks // 2 == np.arange(8) // 2).all()
    splitting = Placement(8, 2, 1, {1: [0, 1, 0, 1, 0, 1, 0, 1]})
    with pytest.raises(PlacementError, match="splits the expert groups"):
        apply_placement(model, splitting)
    with pytest.raises(PlacementError, match="neither divides nor is a multiple"):
        correlated_placement(routes, 8, groups=3)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "llama4_text"])
def test_record_captures_the_routers_own_topk(name):
    model = build(name)
    x = torch.randint(3, 97, (3, 10))
    routes = record_routes(model, x, batch_size=2)
    with torch.no_grad():
        logits = model(input_ids=x, output_router_logits=True).router_logits
    k = routes.top_k
    for layer, layer_logits in zip(routes.layers, logits):
        own = torch.topk(layer_logits.float(), k, dim=-1).indices.numpy()
        assert (np.sort(own, 1) == np.sort(routes.layer(layer), 1)).all()
    assert routes.weights.shape == routes.ids.shape


def test_record_on_a_farskip_model_and_placement_record_survives(tmp_path):
    model = build("qwen3_moe")
    x = torch.randint(3, 97, (2, 8))
    apply_farskip(model, "all")
    routes = record_routes(model, x)
    assert routes.layers == [0, 2, 3] and routes.ids.shape == (3, 16, 2)
    apply_placement(model, correlated_placement(routes, 4))
    first = model.config.farskip["placement"]["expert_order"]
    apply_placement(model, Placement(8, 2, 1, {0: [1, 1, 1, 1, 0, 0, 0, 0]}))  # composes with the first
    composed = model.config.farskip["placement"]["expert_order"]["0"]
    assert composed == [first["0"][i] for i in [4, 5, 6, 7, 0, 1, 2, 3]]
    remove_farskip(model)
    assert "placement" in model.config.farskip and "layers" not in model.config.farskip
    apply_farskip(model, "last:1")
    assert model.config.farskip["layers"] == [3] and "placement" in model.config.farskip


def test_routes_file_roundtrip_and_split(tmp_path, planted):
    routes, _ = planted
    path = routes.save(tmp_path / "r.safetensors")
    loaded = load_routes(path)
    assert (loaded.ids == routes.ids).all() and loaded.header["num_experts"] == 32
    fit, held = loaded.split(0.25)
    assert (fit.num_tokens, held.num_tokens) == (12288, 4096)  # whole 512-token sequences
    with pytest.raises(RoutesError, match="no MoE layer 7"):
        loaded.layer(7)
    (tmp_path / "bad.safetensors").write_bytes(b"not a routes file")
    with pytest.raises(RoutesError, match="not a routes file"):
        load_routes(tmp_path / "bad.safetensors")


def test_placement_file_errors(tmp_path, planted):
    routes, _ = planted
    placement = correlated_placement(routes, 4)
    path = placement.save(tmp_path / "p.json")
    data = json.loads(path.read_text())
    assert set(data) >= {"num_experts", "ep", "nodes", "layers"} and len(data["layers"]["0"]) == 32
    assert (load_placement(path).ranks(0) == placement.ranks(0)).all()
    with pytest.raises(PlacementError, match="does not divide the 32 experts"):
        correlated_placement(routes, 5)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(PlacementError, match="not valid JSON"):
        load_placement(tmp_path / "broken.json")
    with pytest.raises(PlacementError, match="unbalanced"):
        load_placement({"num_experts": 4, "ep": 2, "layers": {"0": [0, 0, 0, 1]}})
    with pytest.raises(PlacementError, match="missing ep"):
        load_placement({"num_experts": 4, "layers": {}})
    model = build("qwen3_moe")
    with pytest.raises(PlacementError, match="not MoE layers"):
        apply_placement(model, {"num_experts": 8, "ep": 2, "layers": {"1": [0, 0, 0, 0, 1, 1, 1, 1]}})
    foreign = Placement(8, 2, 1, {0: [0] * 4 + [1] * 4}, source={"model": "x", "model_fingerprint": "0" * 16})
    with pytest.raises(RoutesError, match="another model"):
        apply_placement(model, foreign)
