"""fcsd's SGLang plugin (fcsd/serving/sglang): FarSkip exports served by SGLang's CPU engine (torch_native attention,
fp32) give fcsd's own greedy tokens and close top-k log-probabilities at tensor-parallel size 1 and 2, with the
routed all-reduce overlapped and blocking; the same weights with stock wiring fail that comparison; without the
plugin SGLang never serves an export with stock wiring; what the plugin cannot serve is refused in one line.

SGLang runs in its own environment (`make sglang-env` -> .venv-sglang), driven from here in subprocesses; every
engine start costs ~20 s on 2 cores, so the engines run in one worker process (tests/workers/sglang_generate.py):

- a Qwen3-MoE with tied embeddings (no lm_head.weight in the files), all layers and last:50% (a stock -> converted
  hand-over), TP 1; all layers at TP 2 overlapped in every forward and blocking;
- a DeepSeek-V2 with MLA, YaRN, shared experts and a dense first layer (converted too), TP 1 and TP 2 overlapped;
  a DeepSeek-V3 (q LoRA, biased sigmoid router) at TP 1;
- stock copies of both at TP 1 (the negative control);
- a Qwen3-MoE with a dense layer (SGLang's class makes every layer MoE), a block-FP8 export (no CPU FP8 kernels
  without AMX) and a Mixtral export (a family the plugin leaves to vLLM): refused in one line;
- with FCSD_SGLANG_PLUGIN=0, the Qwen3-MoE export, with and without trust_remote_code.
"""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_workers import engine_env, engine_python
from engine_workers import run_worker as engine_worker
from safetensors.torch import load_file, save_file
from serving_models import MAX_TOKENS, PROMPTS, TOP_N, build, mismatch, reference

import fcsd
from fcsd.block_fp8 import quantize_blocks
from fcsd.embedded.tokenizer import train_tokenizer
from fcsd.export.save import export
from fcsd.serving.sglang.exported_configs import sglang_config_class
from fcsd.serving.sglang.stock_copies import sglang_stock_copy

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).parent / "workers" / "sglang_generate.py"


def run_worker(jobs: list[dict], out: Path, **env) -> dict:
    python = engine_python(".venv-sglang", "sglang-env")
    results, text = engine_worker(python, WORKER, jobs, out, engine_env(SGLANG_USE_CPU_ENGINE="1", **env))
    logs = {block.split("\n", 1)[0]: block for block in text.split("=== job ")[1:]}
    return {"results": results, "logs": logs}


def fp8_copy(folder: Path, out: Path) -> Path:
    """``folder`` as a block-FP8 export: its linears' weights in e4m3 with a scale per 16x16 block, the hub's
    ``quantization_config`` (router, norms, embeddings unquantized)."""
    shutil.copytree(folder, out)
    state = load_file(str(out / "model.safetensors"))
    quantized = {}
    for key, tensor in state.items():
        keep = tensor.ndim < 2 or "norm" in key or key.endswith(("embed_tokens.weight", "mlp.gate.weight"))
        if keep:
            quantized[key] = tensor
            continue
        quantized[key], quantized[key + "_scale_inv"] = quantize_blocks(tensor, [16, 16], False)
    save_file(quantized, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16], "activation_scheme": "dynamic"
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Every export of the matrix (module docstring), fcsd's reference outputs, and SGLang's, from two workers."""
    root = tmp_path_factory.mktemp("sglang")
    tokenizer = train_tokenizer(["add 1 + 2", "sort 3 1 2", "count the apples"] * 10, vocab_size=280)
    exports, expected = {}, {}
    for name, family, spec in [
        ("qwen3-all", "qwen3_moe_tied", "all"),
        ("qwen3-last50", "qwen3_moe_tied", "last:50%"),
        ("deepseek-all", "deepseek_v2_yarn", "all"),
        ("deepseek-v3-all", "deepseek_v3_yarn", "all"),
        ("qwen3-dense-layer", "qwen3_moe", "all"),
        ("mixtral", "mixtral", "all"),
    ]:
        model = fcsd.apply_farskip(build(family, len(tokenizer)), spec)
        exports[name] = export(model, tokenizer, root / name)
        expected[name] = reference(model)
    for name in ("qwen3-all", "deepseek-all"):
        exports[f"{name}-stock"] = sglang_stock_copy(exports[name], root / f"{name}-stock")
        expected[f"{name}-stock"] = reference(fcsd.remove_farskip(fcsd.from_pretrained(str(exports[name]))))
    exports["fp8"] = fp8_copy(exports["qwen3-all"], root / "fp8")

    def job(name, folder=None, **settings):
        model = str(folder or exports[name])
        return {
            "name": name,
            "model": model,
            "prompts": PROMPTS,
            "max_tokens": MAX_TOKENS,
            "logprobs": TOP_N,
            **settings,
        }

    jobs = [
        job(name)
        for name in (
            "qwen3-all",
            "qwen3-last50",
            "deepseek-all",
            "deepseek-v3-all",
            "qwen3-all-stock",
            "deepseek-all-stock",
        )
    ]
    jobs += [
        job("qwen3-all-tp2", exports["qwen3-all"], tp=2, overlap_above=0),
        job("qwen3-all-tp2-blocking", exports["qwen3-all"], tp=2, overlap=False),
        job("deepseek-all-tp2", exports["deepseek-all"], tp=2, overlap_above=0),
        job("qwen3-dense-layer"),
        job("mixtral"),
        job("fp8", dtype="bfloat16"),  # SGLang refuses FP8 in float32 itself
    ]
    on = run_worker(jobs, root / "on.json")
    off_jobs = [job("off", exports["qwen3-all"]), job("off-remote-code", exports["qwen3-all"], trust_remote_code=True)]
    off = run_worker(off_jobs, root / "off.json", FCSD_SGLANG_PLUGIN="0")
    return {
        "expected": expected,
        "results": {**on["results"], **off["results"]},
        "logs": {**on["logs"], **off["logs"]},
    }


def outputs(served, name):
    result = served["results"][name]
    assert "error" not in result, f"{name}: {result['error']}\n{served['logs'][name][-3000:]}"
    return result["outputs"]


def tokens(outs):
    return [o["tokens"] for o in outs]


@pytest.mark.parametrize(
    "name, source",
    [
        ("qwen3-all", "qwen3-all"),
        ("qwen3-last50", "qwen3-last50"),
        ("deepseek-all", "deepseek-all"),
        ("deepseek-v3-all", "deepseek-v3-all"),
        ("qwen3-all-tp2", "qwen3-all"),
        ("qwen3-all-tp2-blocking", "qwen3-all"),
        ("deepseek-all-tp2", "deepseek-all"),
    ],
)
def test_farskip_exports_match_fcsd_at_tp1_and_tp2(served, name, source):
    """Greedy tokens equal fcsd's transformers model, top-k log-probabilities close (the tied Qwen3-MoE head, MLA
    with YaRN, a converted dense layer, a stock -> converted hand-over, tensor parallelism)."""
    got = outputs(served, name)
    assert mismatch(served["expected"][source], got) is None
    assert tokens(got) == tokens(served["expected"][source])
    assert "FarSkip connectivity on layers" in served["logs"][name]


@pytest.mark.parametrize("name", ["qwen3-all-tp2", "deepseek-all-tp2"])
def test_the_overlap_ran_in_every_forward_of_both_ranks_and_blocking_started_none(served, name):
    """farskip_overlap_above_tokens 0: each rank started routed all-reduces and waited every one (after the next
    attention); with the overlap off none was started. Both give the same tokens."""
    stats = served["results"][name]["overlap_stats"]
    assert len(stats) == 2, stats
    for rank in stats:
        assert rank["started"] > 0 and rank["waited"] == rank["started"] and rank["blocking"] == 0, rank
    blocking = served["results"]["qwen3-all-tp2-blocking"]["overlap_stats"]
    assert len(blocking) == 2 and all(rank["started"] == 0 for rank in blocking), blocking
    assert "routed all-reduce blocking" in served["logs"]["qwen3-all-tp2-blocking"]
    assert tokens(outputs(served, "qwen3-all-tp2")) == tokens(outputs(served, "qwen3-all-tp2-blocking"))


@pytest.mark.parametrize("name", ["qwen3-all", "deepseek-all"])
def test_negative_control_stock_wiring_fails_the_comparison(served, name):
    """The same weights with stock wiring, served alike, match the stock model and not the FarSkip one."""
    control = outputs(served, f"{name}-stock")
    assert mismatch(served["expected"][f"{name}-stock"], control) is None
    assert mismatch(served["expected"][name], control) is not None


def test_without_the_plugin_sglang_never_serves_the_export_with_stock_wiring(served):
    """FCSD_SGLANG_PLUGIN=0: SGLang refuses the export's model type; with trust_remote_code it either refuses too or
    serves the export's own FarSkip code with FarSkip's tokens."""
    assert "trust_remote_code=True" in served["results"]["off"]["error"]
    remote = served["results"]["off-remote-code"]
    if "error" in remote:  # SGLang 0.5.23: its transformers backend finds no class for the export's architecture
        assert "'FarSkipQwen3MoeForCausalLM' is not a registered model" in served["logs"]["off-remote-code"]
    else:
        assert tokens(remote["outputs"]) == tokens(served["expected"]["qwen3-all"])
    for name in ("off", "off-remote-code"):
        assert "FarSkip connectivity" not in served["logs"][name]


@pytest.mark.parametrize(
    "name, message",
    [
        ("qwen3-dense-layer", "SGLang's Qwen3-MoE makes every layer a MoE layer, but this export has dense layers"),
        ("fp8", "FP8 linears need SGLang's AMX CPU kernels or a GPU"),
        ("mixtral", "fcsd's SGLang plugin has no FarSkip class for this export (model type 'mixtral'"),
    ],
)
def test_what_the_plugin_cannot_serve_is_refused_in_one_line(served, name, message):
    assert "error" in served["results"][name]
    lines = [line for line in served["logs"][name].splitlines() if message in line]
    assert lines and lines[0].startswith("ValueError: "), served["logs"][name][-3000:]


def test_the_sglang_config_lists_the_stock_class_after_the_farskip_one_and_fills_deepseeks_fields():
    """SGLang picks MLA by the stock DeepSeek class name and reads moe_layer_freq / scoring_func, which transformers 5
    configs leave out; it builds the first class its registry knows (the FarSkip one)."""
    config = sglang_config_class("deepseek_v2")(architectures=["FarSkipDeepseekV2ForCausalLM"], n_routed_experts=8)
    assert config.architectures == ["FarSkipDeepseekV2ForCausalLM", "DeepseekV2ForCausalLM"]
    assert (config.moe_layer_freq, config.scoring_func, config.model_type) == (1, "softmax", "deepseek_v2")
    v3 = sglang_config_class("deepseek_v3")(architectures=["FarSkipDeepseekV3ForCausalLM"], moe_layer_freq=2)
    assert (v3.moe_layer_freq, v3.scoring_func, v3.topk_method) == (2, "sigmoid", "noaux_tc")


def test_the_kernel_stand_in_imports_but_never_runs():
    """The import-only sgl_kernel of .venv-sglang on CPU: any name imports, any call raises."""
    path = ROOT / "fcsd" / "serving" / "sglang" / "kernel_standin.py"
    spec = importlib.util.spec_from_file_location("sgl_kernel_standin_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = module.fused_qk_norm_rope.default
    with pytest.raises(module.StandInCalled, match="fused_qk_norm_rope.default was called"):
        kernel(torch.ones(1))
    assert module.STANDIN


def test_the_cpu_environment_fixes_touch_only_their_files_and_run_twice_the_same(tmp_path):
    from fcsd.serving.sglang import cpu_environment

    package = tmp_path / "torchvision"
    package.mkdir()
    (package / "_meta_registrations.py").write_text("REGISTERED = True\n")
    (package / "io.py").write_text("untouched = 1\n")
    for _ in range(2):
        assert cpu_environment.guard_torchvision(tmp_path) == ["_meta_registrations"]
        cpu_environment.install_standin(tmp_path)
    assert (package / "_meta_registrations_with_ops.py").read_text() == "REGISTERED = True\n"
    assert "if _has_ops():" in (package / "_meta_registrations.py").read_text()
    assert (package / "io.py").read_text() == "untouched = 1\n"
    assert "STANDIN = True" in (tmp_path / "sgl_kernel" / "__init__.py").read_text()
    real = tmp_path / "real"
    (real / "sgl_kernel").mkdir(parents=True)
    (real / "sgl_kernel" / "__init__.py").write_text("from .ops import *\n")
    with pytest.raises(SystemExit, match="is a real sgl_kernel"):
        cpu_environment.install_standin(real)
