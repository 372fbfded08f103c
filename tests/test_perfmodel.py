"""The Appendix B performance model: FLOP and byte counts by hand, Table 5's exposed-time rules, scenarios."""

import json

import pytest
import transformers

from fcsd.cli import main
from fcsd.plan import perfmodel as pm

H, E, K, I_MOE, I_DENSE, HEADS, HEAD_DIM, KV_HEADS, V = 64, 8, 2, 32, 96, 4, 16, 2, 100


def small_qwen3():
    return transformers.Qwen3MoeConfig(
        vocab_size=V,
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=I_DENSE,
        moe_intermediate_size=I_MOE,
        num_experts=E,
        num_experts_per_tok=K,
        mlp_only_layers=[0],
    )


def test_flop_counts_by_hand():
    shape = pm.model_shape(small_qwen3())
    dense, moe = shape.layers
    attn_weights = H * HEADS * HEAD_DIM + 2 * H * KV_HEADS * HEAD_DIM + HEADS * HEAD_DIM * H  # q, k, v, o
    assert dense.attn_proj_flops == moe.attn_proj_flops == 2 * attn_weights
    assert (dense.moe, moe.moe) == (False, True)
    assert dense.shared_flops == 2 * 3 * H * I_DENSE
    assert moe.gate_flops == 2 * H * E
    assert moe.routed_flops == 2 * K * 3 * H * I_MOE
    assert moe.shared_flops == 0
    assert (moe.heads, moe.d_qk, moe.d_v) == (HEADS, HEAD_DIM, HEAD_DIM)


def test_layer_times_and_bytes_by_hand():
    shape = pm.model_shape(small_qwen3())
    hw = pm.Hardware(attn_tflops=1.0, gemm_tflops=2.0, allreduce_gbps=4.0, alltoall_gbps=3.0)
    batch, context, tp, ep = 2, 16, 4, 2
    t = pm.prefill_layer_times(shape, shape.layers[1], batch, context, tp, ep, hw)
    tokens = batch * context
    core = batch * (context * context / 2) * 2 * HEADS * (2 * HEAD_DIM)
    assert t.attn == pytest.approx(tokens * shape.layers[1].attn_proj_flops / tp / 2e12 + core / tp / 1e12)
    assert t.routed == pytest.approx(tokens * 2 * K * 3 * H * I_MOE / ep / 2e12)
    assert t.gate == pytest.approx(tokens * 2 * H * E / 2e12)
    message = tokens * H * 2  # bf16 activations
    assert t.attn_comm == t.mlp_comm == pytest.approx(message * 2 * (tp - 1) / tp / 4e9)
    assert pm.alltoall_s(1e9, 8, hw) == pytest.approx(1e9 * 7 / 8 / 3e9)
    assert pm.allreduce_s(1e9, 1, hw) == 0.0


@pytest.mark.parametrize(
    "attn, routed, comm, exposed_as, exposed_routed",
    [
        (5.0, 5.0, 2.0, 0.0, 0.0),  # fully hidden
        (1.0, 3.0, 4.0, 1.0, 3.0),  # partly hidden
        (0.5, 0.5, 10.0, 9.5, 9.5),  # communication-bound
    ],
)
def test_table5_exposed_time(attn, routed, comm, exposed_as, exposed_routed):
    t = pm.LayerTimes(attn=attn, gate=0.1, routed=routed, shared=0.2, attn_comm=comm, mlp_comm=comm, moe=True)
    assert t.exposed_attn_shared == pytest.approx(exposed_as)
    assert t.exposed_routed == pytest.approx(exposed_routed)
    assert t.regular == pytest.approx(attn + 0.1 + routed + 0.2 + 2 * comm)
    assert t.farskip == pytest.approx(attn + 0.1 + routed + 0.2 + exposed_as + exposed_routed)
    dense = pm.LayerTimes(attn=attn, gate=0, routed=0, shared=1, attn_comm=comm, mlp_comm=comm, moe=False)
    assert dense.farskip == dense.regular


def test_deepseek_v3_preset_sweep_and_scenarios():
    config = pm.load_config(preset="deepseek-v3")
    shape = pm.model_shape(config)
    assert len(shape.layers) == 61 and sum(not layer.moe for layer in shape.layers) == 3
    assert (shape.num_experts, shape.top_k) == (256, 8)
    rows = pm.sweep(config, [32, 64], list(pm.SCENARIOS))
    by = {(r.sparsity, r.scenario): r for r in rows}
    for s in (32, 64):
        assert by[(s, "2x_compute_2x_comm")].speedup == pytest.approx(by[(s, "baseline")].speedup)
        assert by[(s, "2x_compute_2x_comm")].regular_ms == pytest.approx(by[(s, "baseline")].regular_ms / 2)
        assert by[(s, "baseline")].speedup > 1.0
        assert by[(s, "2x_comm")].speedup < by[(s, "baseline")].speedup  # less communication to hide
    # sparser: same active experts, half the expert width -> fewer routed FLOPs
    assert by[(64, "baseline")].regular_ms < by[(32, "baseline")].regular_ms


def test_with_sparsity_scales_experts_and_width():
    config = pm.with_sparsity(pm.load_config(preset="deepseek-v3"), 128)
    assert (config.n_routed_experts, config.moe_intermediate_size) == (1024, 512)
    with pytest.raises(ValueError, match="non-integer expert width"):
        pm.with_sparsity(small_qwen3(), 3)


def test_training_window_eq9():
    shape = pm.model_shape(small_qwen3())
    hw = pm.Hardware(attn_tflops=1e-3, gemm_tflops=1e-3, allreduce_gbps=1.0, alltoall_gbps=1.0)
    result = pm.training_moe_layer(shape, batch=1, context=64, ep=4, hw=hw)
    t = pm.prefill_layer_times(shape, shape.layers[1], 1, 64, 1, 1, hw)
    assert result.overlap_window_ms == pytest.approx((t.compute - t.routed - t.gate) * 1e3)
    a2a = 2 * 64 * K * H * 2 * 3 / 4 / 1e9
    assert result.dispatch_combine_ms == pytest.approx(a2a * 1e3)
    assert result.regular_ms == pytest.approx((3 * t.compute + 2 * a2a) * 1e3)
    assert result.speedup >= 1.0


def test_cli_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "fig9.png"
    assert main(["perfmodel", "--preset", "deepseek-v3", "--sparsity", "32", "--json", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["scenario"] for r in out["rows"]] == list(pm.SCENARIOS)
    assert {"sparsity", "scenario", "regular_ms", "farskip_ms", "speedup"} <= out["rows"][0].keys()
    assert plot.read_bytes()[:4] == b"\x89PNG" and pm.is_own_plot(plot)
    written = plot.read_bytes()
    other = written.replace(pm.PLOT_WRITER.encode(), b"other tool")  # a PNG another tool wrote: kept
    plot.write_bytes(other)
    assert main(["perfmodel", "--preset", "deepseek-v3", "--sparsity", "32", "--plot", str(plot)]) == 2
    assert "is not a perfmodel plot fcsd wrote" in capsys.readouterr().err and plot.read_bytes() == other
    plot.write_bytes(written[:-16])  # its own plot, cut short: replaced whole
    assert main(["perfmodel", "--preset", "deepseek-v3", "--sparsity", "32", "--plot", str(plot)]) == 0
    assert plot.read_bytes() == written
    bare = plot.with_suffix("")  # written at the name given, no suffix added
    assert main(["perfmodel", "--preset", "deepseek-v3", "--sparsity", "32", "--plot", str(bare)]) == 0
    assert pm.is_own_plot(bare)
    assert main(["perfmodel", "--preset", "deepseek-v3", "--scenario", "3x_magic"]) == 2
    assert "unknown scenario" in capsys.readouterr().err


def test_cli_reads_a_local_config(tmp_path, capsys):
    small_qwen3().save_pretrained(tmp_path)
    assert main(["perfmodel", "--model", str(tmp_path), "--sparsity", "4,8", "--scenario", "baseline"]) == 0
    out = capsys.readouterr().out
    assert "4x baseline" in out and "8x baseline" in out and "Eq. 9 window" in out
    assert main(["perfmodel"]) == 2
