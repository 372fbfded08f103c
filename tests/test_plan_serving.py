"""`fcsd plan`'s output runs as printed: the serving line is checked against the GPUs it names (weights at the
export's format, bf16 or block-FP8 with its scales, a KV cache for the stated context, vLLM's memory share) and
names the smallest setting that fits, or says what would; the launch line's accelerate config exists in an
installed package (its recipes, tests/test_installed_recipes.py); small models' times print in a unit that shows
them."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny_models import CONFIGS

from fcsd.plan.cluster import GIB, GPU, Cluster, make_cluster
from fcsd.plan.model_configs import load_model_config
from fcsd.plan.printed_commands import accelerate_config, launch_prefix, serve_line, sglang_serve_line
from fcsd.plan.run import Layout
from fcsd.plan.serving_bytes import serving_model
from fcsd.plan.serving_fit import (
    GPU_MEMORY_UTILIZATION,
    SERVE_CONTEXT,
    check_serving,
    plan_serving,
    serving_line,
    stage_layers,
    tp_sizes,
)
from fcsd.units import duration, time_unit

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def deepseek_v3():
    return load_model_config("deepseek-v3").config


def _matrices(text) -> list[tuple[int, int, int]]:
    """DeepSeek-V3's quantized matrices as ``(count, rows, cols)``, from its config's sizes (a hand count)."""
    h, heads = text.hidden_size, text.num_attention_heads
    qk = text.qk_nope_head_dim + text.qk_rope_head_dim
    attention = [
        (1, text.q_lora_rank, h),
        (1, heads * qk, text.q_lora_rank),
        (1, text.kv_lora_rank + text.qk_rope_head_dim, h),
        (1, heads * (text.qk_nope_head_dim + text.v_head_dim), text.kv_lora_rank),
        (1, h, heads * text.v_head_dim),
    ]
    dense = [(2, text.intermediate_size, h), (1, h, text.intermediate_size)]
    i, experts = text.moe_intermediate_size, text.n_routed_experts
    moe = [(experts, 2 * i, h), (experts, h, i), (2 * text.n_shared_experts, i, h), (1, h, i * text.n_shared_experts)]
    first = text.first_k_dense_replace
    return attention * text.num_hidden_layers + dense * first + moe * (text.num_hidden_layers - first)


def test_deepseek_v3_fp8_export_counts_e4m3_weights_and_block_scales(deepseek_v3):
    """The embedded DeepSeek-V3 config is the release's block-FP8: its export is counted as one byte per quantized
    weight plus an fp32 scale per 128 x 128 block, the embeddings, head, norms and routers in bf16; the sum equals a
    hand count from the config's sizes, and the bf16 export is twice the parameters."""
    from fcsd.plan.candidates import parameter_counts

    assert deepseek_v3.quantization_config["weight_block_size"] == [128, 128]
    total = parameter_counts(deepseek_v3).total
    bf16 = serving_model(deepseek_v3, bf16=True)
    assert bf16.weights == 2 * total and bf16.weights_format == "bfloat16"
    fp8 = serving_model(deepseek_v3)
    quantized = sum(n * r * c for n, r, c in _matrices(deepseek_v3))
    scales = sum(n * math.ceil(r / 128) * math.ceil(c / 128) for n, r, c in _matrices(deepseek_v3))
    assert fp8.weights == quantized + 4 * scales + 2 * (total - quantized)
    assert fp8.weights_format.startswith("fp8 e4m3")
    assert 0.49 < fp8.weights / bf16.weights < 0.52  # the hub's ~690 GB against ~1.34 TB


def test_bf16_deepseek_v3_on_one_node_of_h200_is_refused_with_what_fits(deepseek_v3):
    """1.34 TB of bf16 weights do not fit 8 x 141 GB: the check refuses one node in one line naming the setting that
    fits (TP 8 x PP 2 on 2 nodes) and prints no serve line; on 2 nodes the serve line names that setting."""
    one = make_cluster("h200", 8, 1)
    check = check_serving(deepseek_v3, one, export="bf16")
    assert check.fit is None and (check.largest.tp, check.largest.pp) == (8, 1)
    assert check.largest.needed > check.largest.usable
    assert check.largest.usable == int(GPU_MEMORY_UTILIZATION * one.gpu.memory_gib * GIB - one.reserve_gib * GIB)
    assert (check.beyond.tp, check.beyond.pp, check.beyond.nodes) == (8, 2, 2) and check.beyond.fits
    line = serving_line(check)
    assert "\n" not in line and "does not fit 1 x 8 H200" in line and "TP 8 x PP 2 on 2 nodes would" in line
    two = check_serving(deepseek_v3, make_cluster("h200", 8, 2), export="bf16")
    assert two.fit == check.beyond
    line = serve_line("runs/v3/export", "deepseek_v3", two.fit, two.model.max_context)
    assert "--tensor-parallel-size 8 --enable-expert-parallel --pipeline-parallel-size 2" in line
    assert f"--max-model-len {SERVE_CONTEXT}" in line
    # the run's config asking for a bf16 export is checked in bf16
    assert plan_serving(deepseek_v3, one, None, 1, SimpleNamespace(export_format="bf16")).fit is None


def test_fp8_deepseek_v3_fits_one_node_with_its_mla_cache(deepseek_v3):
    """The FP8 export fits one node of 8 H200 at TP 8 (not fewer GPUs); its KV cache is MLA's latent
    (kv_lora_rank + qk_rope_head_dim per token and layer, bf16, whole on every TP rank) for the default context."""
    cluster = make_cluster("h200", 8, 1)
    check = check_serving(deepseek_v3, cluster)
    assert check.fit is not None and (check.fit.tp, check.fit.pp, check.fit.nodes) == (8, 1, 1)
    latent = deepseek_v3.kv_lora_rank + deepseek_v3.qk_rope_head_dim
    assert check.fit.kv_cache == SERVE_CONTEXT * deepseek_v3.num_hidden_layers * latent * 2
    assert check.fit.room >= 1 and "TP 8 on 1 node" in serving_line(check)
    # a longer context and more sequences need more cache: the figure follows them
    longer = check_serving(deepseek_v3, cluster, context=2 * SERVE_CONTEXT, sequences=3)
    assert longer.fit.kv_cache == 6 * check.fit.kv_cache


def _tiny_qwen3():
    _, config = CONFIGS["qwen3_moe"]()
    return config


def test_a_small_model_gets_the_smallest_tensor_parallel_size_that_fits():
    """One GPU when it holds the model (no parallel flags); on GPUs too small for it, the smallest TP that fits; the
    KV cache of attention with KV heads splits over them."""
    config = _tiny_qwen3()
    check = check_serving(config, make_cluster("h100", 8, 1))
    assert check.fit.tp == 1 and check.fit.pp == 1
    line = serve_line("out/export", "qwen3_moe", check.fit, check.model.max_context)
    assert line == "vllm serve out/export"  # the default context is the model's whole (64 tokens) here
    one = check.fit
    kv = 2 * config.num_key_value_heads * config.head_dim * 2  # K and V, bf16
    assert one.kv_cache == config.max_position_embeddings * config.num_hidden_layers * kv
    # GPUs holding a little more than half of the model and its cache: TP 1 misses, TP 2 fits
    memory = (0.6 * one.needed) / GPU_MEMORY_UTILIZATION / GIB
    small = Cluster(GPU("small", memory, 100.0, 100.0, 10.0), gpus_per_node=8, reserve_gib=0)
    check = check_serving(config, small)
    assert check.fit.tp == 2 and check.fit.kv_cache == one.kv_cache // 2
    assert "--tensor-parallel-size 2 --enable-expert-parallel" in serve_line("o", "qwen3_moe", check.fit)


def test_the_sglang_serve_line_names_the_setting_checked_and_none_where_it_needs_pipeline_stages(deepseek_v3):
    """SGLang's line beside vLLM's, at the same checked fit: the FP8 DeepSeek-V3 export at TP 8 on one node of H200
    with the checked context; the bf16 one needs PP 2 across nodes, which fcsd's SGLang plugin does not cover (no
    line); a family SGLang's plugin lacks gets none."""
    one = check_serving(deepseek_v3, make_cluster("h200", 8, 1))
    line = sglang_serve_line("runs/v3/export", "deepseek_v3", one.fit, one.model.max_context)
    assert (
        line
        == f"python -m sglang.launch_server --model-path runs/v3/export --tp-size 8 --context-length {SERVE_CONTEXT}"
    )
    two = check_serving(deepseek_v3, make_cluster("h200", 8, 2), export="bf16")
    assert two.fit.pp == 2 and sglang_serve_line("runs/v3/export", "deepseek_v3", two.fit) is None
    assert serve_line("runs/v3/export", "deepseek_v3", two.fit) is not None
    assert sglang_serve_line("o", "mixtral") is None and sglang_serve_line("my dir", "farskip_qwen3_moe") == (
        "python -m sglang.launch_server --model-path 'my dir'"
    )


def test_vllm_sizes_and_pipeline_stages():
    """TP sizes divide the node, the heads and the experts (and the KV heads either way); pipeline stages split the
    layers as vLLM does (the remainder to the stages before the last)."""
    assert tp_sizes(8, heads=32, kv_heads=4, experts=128) == [1, 2, 4, 8]  # Qwen3-30B-A3B
    assert tp_sizes(8, heads=4, kv_heads=2, experts=4) == [1, 2, 4]
    assert tp_sizes(8, heads=12, kv_heads=12, experts=64) == [1, 2, 4]
    assert tp_sizes(3, heads=32, kv_heads=4, experts=128) == [1]
    assert tp_sizes(8, heads=128, kv_heads=None, experts=256)[-1] == 8  # MLA
    assert stage_layers(61, 2) == [31, 30] and stage_layers(10, 4) == [2, 3, 3, 2] and stage_layers(8, 1) == [8]


def test_a_serving_context_beyond_the_model_or_empty_is_one_line():
    config = _tiny_qwen3()
    cluster = make_cluster("h100", 8, 1)
    with pytest.raises(ValueError, match=r"--serve-context 65: .*at most 64 .*max_position_embeddings") as caught:
        check_serving(config, cluster, context=65)
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="--serve-sequences 0: give at least one"):
        check_serving(config, cluster, sequences=0)


def test_launch_lines_name_an_accelerate_config_the_package_ships(tmp_path, monkeypatch):
    """The launch's --config_file is inside the fcsd package's recipes (relative to a checkout's root, where it is
    the repository's recipes/accelerate/, absolute elsewhere); tests/test_installed_recipes.py builds and installs a
    wheel and finds it there."""
    from fcsd.recipe_files import shipped_recipes

    monkeypatch.chdir(tmp_path)
    args = launch_prefix(Layout("ep", 8, 8), make_cluster("h100", 8, 1))
    path = Path(args[args.index("--config_file") + 1])
    assert path.is_absolute() and path.is_file() and path.parent == shipped_recipes() / "accelerate"
    monkeypatch.chdir(ROOT)
    assert accelerate_config("ep8_1node.yaml") == "recipes/accelerate/ep8_1node.yaml"


def test_times_print_in_a_unit_that_shows_them():
    assert duration(8.034) == "8.03 s" and duration(0.0042) == "4.20 ms" and duration(3.1e-5) == "31.00 us"
    assert duration(0) == "0 s" and time_unit(0.0008, 0.0012) == ("ms", 1e-3)


def test_a_small_models_plan_prints_no_zero_seconds_and_a_checked_serve_line(tmp_path, capsys):
    """The text report of a tiny model's plan: every time readable (no '0.00 s' where a step takes milliseconds),
    the serving line with its memory figure, and the serve command at the setting it names."""
    from tiny_models import save_chat_model

    from fcsd.cli import main

    chat = [{"messages": [{"role": "user", "content": "add 1 and 1"}, {"role": "assistant", "content": "2"}]}]
    save_chat_model(tmp_path / "model", chat * 8, vocab_size=120)
    argv = ["plan", str(tmp_path / "model"), "--gpus-per-node", "4", "--tokens", "1e6", "data.seq_len=32"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "0.00 s" not in text and re.search(r"step [0-9.]+ (ms|us) \(compute", text), text
    if "as fast as" in text:
        assert re.search(r"as fast as .*\([0-9.]+ (ms|us)\)", text), text
    assert re.search(r"^serving    .* TP 1 on 1 node: per GPU .* of weights \+ .* KV cache", text, re.M), text
    assert re.search(r"^  vllm serve \S+/export$", text, re.M), text
    assert re.search(r"^  python -m sglang.launch_server --model-path \S+/export$", text, re.M), text


def test_the_serve_line_is_checked_on_the_cluster_the_commands_target(tmp_path):
    """When nothing fits the cluster asked for, the commands target the larger one the plan falls back to, and so
    does the serving check: here 1 x 1 GPU trains nothing and serves nothing (its KV cache needs PP 2), 2 x 1 trains
    FSDP2 / DDP and serves the export with PP 2 across the 2 nodes (before, the check on 1 x 1 dropped the line)."""
    from tiny_models import save_chat_model

    from fcsd.plan.planner import make_plan

    chat = [{"messages": [{"role": "user", "content": "add 1 and 1"}, {"role": "assistant", "content": "2"}]}]
    save_chat_model(tmp_path / "model", chat * 8, vocab_size=120)
    per_sequence = check_serving(load_model_config(str(tmp_path / "model")).config, make_cluster("h100"), 32).fit
    memory = 1.1e6  # bytes a GPU holds: 1 GPU's static bytes are ~1.4 MB, 2 GPUs' lightest step peaks at ~0.9 MB
    sequences = math.ceil(1.5 * memory / per_sequence.kv_cache)  # a KV cache that needs two pipeline stages
    gpu = GPU("small", memory / GPU_MEMORY_UTILIZATION / GIB, 100.0, 100.0, 10.0)
    cluster = Cluster(gpu, gpus_per_node=1, nodes=1, reserve_gib=0)
    overrides = ["data.seq_len=32", "train.batch_tokens=128"]
    plan = make_plan(
        str(tmp_path / "model"), cluster, 1e4, overrides=overrides, serve_context=32, serve_sequences=sequences
    )
    assert not plan.fits and plan.fallback.cluster.nodes == 2 and plan.chosen is not None
    assert plan.serving.cluster == plan.fallback.cluster and (plan.serving.fit.tp, plan.serving.fit.pp) == (1, 2)
    assert "--pipeline-parallel-size 2 --distributed-executor-backend ray" in plan.commands["serve"]
    assert "--num_machines 2" in plan.commands["train"], plan.commands["train"]
