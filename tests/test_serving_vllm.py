"""fcsd's vLLM plugin (fcsd/serving/vllm): FarSkip exports served by vLLM's CPU build give fcsd's own greedy tokens
and close top-k log-probabilities (vLLM's own model-test method), at tensor-parallel size 1 and 2, with the routed
all-reduce overlapped and blocking; the same weights with stock wiring fail that comparison; `vllm serve` answers an
OpenAI-compatible request; bad input fails in one line and serves nothing.

vLLM runs in its own environment (`make serve-env` -> .venv-vllm), driven from here in subprocesses; every engine
start costs ~20-40 s on 2 cores, so all engines but the server's run in ONE worker process (tests/workers/
vllm_generate.py) and the matrix covers each code path once:

- qwen3_moe all / last:50% / first:1, TP 1: every layer converted (a dense one too); stock -> converted and
  converted -> stock hand-overs;
- qwen2_moe, mixtral, olmoe, deepseek_v2, deepseek_v3 (all), TP 1: each family vLLM's CPU build runs (gated shared
  expert; MLA + shared experts + a dense first layer; DeepSeek-V3's biased sigmoid router);
- qwen3_moe all, TP 2, overlap auto (on) in every forward (prefill and decode: farskip_overlap_above_tokens 0) and
  off: the overlapped routed all-reduce (gloo async) and the reference;
- qwen3_moe all, TP 2, compiled (vLLM's CPU default: one Dynamo trace, Inductor), overlap auto (on) in every forward,
  and its stock copy compiled at TP 2: the overlap without eager mode, and its negative control;
- qwen2_moe all, TP 2, overlap on in every forward: shared experts and a converted dense layer under tensor
  parallelism;
- (a fixture of its own) qwen3_moe all, TP 2, eager and compiled, overlapped only in forwards of more than 4 tokens
  (prefill) and blocking in the others (decode), and the stock copy at TP 2: the per-forward choice;
- a stock copy of qwen3_moe all, TP 1: the negative control;
- `vllm serve` of qwen3_moe last:50%: the server, vLLM's default compiled (dynamo) mode, text in and out.
"""

import json
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from engine_workers import engine_env, engine_python
from engine_workers import run_worker as engine_worker
from processes import started, wait_for
from serving_models import MAX_TOKENS, PROMPTS, TOP_N, build, mismatch, reference

import fcsd
from fcsd.embedded.tokenizer import train_tokenizer
from fcsd.export.save import export
from fcsd.loading import tokenizer_from_pretrained
from fcsd.serving.routed_allreduce import resolve_overlap
from fcsd.serving.variants import stock_copy

WORKER = Path(__file__).parent / "workers" / "vllm_generate.py"
FAMILIES_TP1 = ["qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3"]


def vllm_python() -> Path:
    return engine_python(".venv-vllm", "serve-env")


def vllm_env(**extra) -> dict:
    return engine_env(VLLM_NO_USAGE_STATS="1", **extra)


def run_worker(jobs: list[dict], out: Path, **env) -> dict:
    results, log = engine_worker(vllm_python(), WORKER, jobs, out, vllm_env(**env))
    return {"results": results, "log": log}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["add 1 + 2", "sort 3 1 2", "count the apples"] * 10, vocab_size=280)


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer):
    """Every export of the matrix (module docstring), fcsd's reference outputs, and vLLM's, from one worker."""
    root = tmp_path_factory.mktemp("serving")
    vocab = len(tokenizer)
    exports, expected, exports_edited = {}, {}, {}
    for name, family, spec in [
        ("qwen3_moe-all", "qwen3_moe", "all"),
        ("qwen3_moe-last50", "qwen3_moe", "last:50%"),
        ("qwen3_moe-first1", "qwen3_moe", "first:1"),
    ] + [(f"{f}-all", f, "all") for f in FAMILIES_TP1]:
        model = fcsd.apply_farskip(build(family, vocab), spec)
        exports[name] = export(model, tokenizer, root / name)
        expected[name] = reference(model)
    stock = stock_copy(exports["qwen3_moe-all"], root / "qwen3_moe-stock")
    expected["stock"] = reference(fcsd.remove_farskip(fcsd.from_pretrained(str(exports["qwen3_moe-all"]))))
    unserved = shutil.copytree(exports["olmoe-all"], root / "unserved")
    config = json.loads((unserved / "config.json").read_text())
    (unserved / "config.json").write_text(json.dumps({**config, "architectures": ["FarSkipForCausalLM"]}))
    corrupt = shutil.copytree(exports["olmoe-all"], root / "corrupt")
    (corrupt / "config.json").write_text(json.dumps({**config, "farskip": {**config["farskip"], "layers": [0, 7]}}))

    for name, values in identity_edits(json.loads((exports["qwen3_moe-all"] / "config.json").read_text())).items():
        edited = shutil.copytree(exports["qwen3_moe-all"], root / name)
        (edited / "config.json").write_text(json.dumps(values))
        if name == "converted":  # a run's final/: no parity record (an export's is checked as "corrupt" is)
            (edited / "fcsd_export.json").unlink()
        exports_edited[name] = edited

    def job(name, model, **settings):
        return {
            "name": name,
            "model": str(model),
            "prompts": PROMPTS,
            "max_tokens": MAX_TOKENS,
            "logprobs": TOP_N,
            **settings,
        }

    jobs = [job(name, folder) for name, folder in exports.items()]
    jobs += [job("stock", stock), job("unserved", unserved), job("corrupt", corrupt)]
    jobs += [job(name, folder) for name, folder in exports_edited.items()]
    jobs += [
        job("qwen3_moe-all-tp2", exports["qwen3_moe-all"], tp=2, overlap_above=0),
        job("qwen3_moe-all-tp2-blocking", exports["qwen3_moe-all"], tp=2, overlap=False),
        job("qwen2_moe-all-tp2", exports["qwen2_moe-all"], tp=2, overlap=True, overlap_above=0),
        job("qwen3_moe-all-tp2-compiled", exports["qwen3_moe-all"], tp=2, eager=False, overlap_above=0),
        job("stock-tp2-compiled", stock, tp=2, eager=False),
    ]
    served = run_worker(jobs, root / "out.json")
    absent = run_worker(
        [job("absent", exports["olmoe-all"]), job("absent-remote-code", exports["olmoe-all"], trust_remote_code=True)],
        root / "absent.json",
        VLLM_PLUGINS="none",
    )
    return {
        "expected": expected,
        "results": {**served["results"], **absent["results"]},
        "log": served["log"],
        "absent_log": absent["log"],
        "exports": exports,
    }


ABOVE = 4  # farskip_overlap_above_tokens of the per-forward fixture: prefill (7 + 11 tokens) overlaps, decode not


@pytest.fixture(scope="module")
def by_tokens(tmp_path_factory, tokenizer):
    """qwen3_moe all at TP 2 overlapped above ABOVE tokens, eager and compiled, and its stock copy: vLLM's outputs,
    each worker's overlap counts, fcsd's reference."""
    root = tmp_path_factory.mktemp("by-tokens")
    model = fcsd.apply_farskip(build("qwen3_moe", len(tokenizer)), "all")
    folder = export(model, tokenizer, root / "qwen3_moe-all")
    stock = stock_copy(folder, root / "stock")
    expected = {"farskip": reference(model), "stock": reference(fcsd.remove_farskip(fcsd.from_pretrained(str(folder))))}
    common = {"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "logprobs": TOP_N, "tp": 2, "overlap_above": ABOVE}
    jobs = [
        {"name": "eager", "model": str(folder), **common},
        {"name": "compiled", "model": str(folder), "eager": False, **common},
        {"name": "stock", "model": str(stock), **common},
    ]
    return {"expected": expected, **run_worker(jobs, root / "out.json")}


@pytest.mark.parametrize("name", ["eager", "compiled"])
def test_prefill_overlaps_and_decode_reduces_at_once_and_both_match_fcsd(by_tokens, name):
    """farskip_overlap_above_tokens: forwards of more tokens (prefill) start the routed all-reduce and wait it after
    the next attention, smaller ones (decode: what vLLM captures in CUDA graphs on GPUs) reduce with vLLM's own
    all-reduce, on every worker; greedy tokens equal fcsd's, and the stock copy served alike differs."""
    got = outputs(by_tokens, name)
    assert mismatch(by_tokens["expected"]["farskip"], got) is None
    assert [o["tokens"] for o in got] == [e["tokens"] for e in by_tokens["expected"]["farskip"]]
    assert f"overlapped in forwards of more than {ABOVE} tokens" in by_tokens["log"]
    stats = by_tokens["results"][name]["overlap_stats"]
    assert len(stats) == 2, stats
    for worker in stats:
        assert worker["started"] and worker["waited"] == worker["started"] and worker["blocking"], worker
        assert worker["blocking_max_tokens"] <= ABOVE < worker["started_min_tokens"], worker
        if name == "compiled":  # the choice is made inside the compiled code's routed ops
            assert worker["compiled_calls"] >= worker["started"] + worker["blocking"] + worker["waited"], worker
    control = outputs(by_tokens, "stock")
    assert mismatch(by_tokens["expected"]["stock"], control) is None
    assert mismatch(by_tokens["expected"]["farskip"], control) is not None


def identity_edits(config: dict) -> dict:
    """An export's config.json edited so that its FarSkip fields disagree: what vLLM must never serve as stock."""
    farskip = config["farskip"]
    stock = {k: v for k, v in config.items() if k not in ("farskip", "auto_map")}
    return {
        "stock-architecture": {**config, "architectures": ["Qwen3MoeForCausalLM"]},  # type and block kept
        "no-block": stock,  # the farskip_ type kept, the layers gone
        "converted": {**stock, "farskip": farskip, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]},
    }


def outputs(served, name):
    result = served["results"][name]
    assert "error" not in result, f"{name}: {result['error']}"
    return result["outputs"]


@pytest.mark.parametrize("name", ["qwen3_moe-all", "qwen3_moe-last50", "qwen3_moe-first1"])
def test_layer_specs_match_fcsd_at_tp1(served, name):
    assert mismatch(served["expected"][name], outputs(served, name)) is None
    assert outputs(served, name)[0]["tokens"] == served["expected"][name][0]["tokens"]  # greedy tokens equal


@pytest.mark.parametrize("family", FAMILIES_TP1)
def test_every_cpu_family_matches_fcsd_at_tp1(served, family):
    name = f"{family}-all"
    assert mismatch(served["expected"][name], outputs(served, name)) is None


@pytest.mark.parametrize(
    "name, source, mode",
    [
        ("qwen3_moe-all-tp2", "qwen3_moe-all", "overlapped"),
        ("qwen3_moe-all-tp2-blocking", "qwen3_moe-all", "blocking"),
        ("qwen2_moe-all-tp2", "qwen2_moe-all", "overlapped"),
    ],
)
def test_tensor_parallel_2_overlapped_and_blocking_match_fcsd(served, name, source, mode):
    assert mismatch(served["expected"][source], outputs(served, name)) is None
    assert f"routed all-reduce {mode} (tensor-parallel size 2), eager" in served["log"]  # the path under test ran
    stats = served["results"][name]["overlap_stats"]
    waited = [worker["waited"] for worker in stats]
    assert len(waited) == 2 and (all(waited) if mode == "overlapped" else not any(waited)), waited
    assert not any(worker["compiled_calls"] for worker in stats)  # eager: the ops' compiled entry points unused


def test_compiled_tensor_parallel_2_overlaps_and_matches_fcsd(served):
    """The overlap without eager mode (issue: vLLM's compilation kept): the same greedy tokens as fcsd's model, the
    overlapped all-reduce waited on every worker, and the stock wiring compiled the same way fails the comparison."""
    got = outputs(served, "qwen3_moe-all-tp2-compiled")
    assert mismatch(served["expected"]["qwen3_moe-all"], got) is None
    assert got[0]["tokens"] == served["expected"]["qwen3_moe-all"][0]["tokens"]
    assert "routed all-reduce overlapped (tensor-parallel size 2), compiled (DYNAMO_TRACE_ONCE)" in served["log"]
    stats = served["results"]["qwen3_moe-all-tp2-compiled"]["overlap_stats"]
    assert len(stats) == 2 and all(w["waited"] and w["waited"] == w["started"] for w in stats), stats
    assert all(w["compiled_calls"] >= w["started"] + w["waited"] for w in stats), stats  # from the compiled code
    control = outputs(served, "stock-tp2-compiled")
    assert mismatch(served["expected"]["stock"], control) is None
    assert mismatch(served["expected"]["qwen3_moe-all"], control) is not None


def test_negative_control_stock_wiring_fails_the_comparison(served):
    got = outputs(served, "stock")
    assert mismatch(served["expected"]["stock"], got) is None  # vLLM's stock model = transformers' stock model
    assert mismatch(served["expected"]["qwen3_moe-all"], got) is not None  # ... but not fcsd's FarSkip model


def test_bad_input_fails_in_one_line(served):
    errors = {name: served["results"][name].get("error", "") for name in ("unserved", "corrupt")}
    assert all(errors.values()), f"a bad export was served: {errors}"
    assert "ValueError: vLLM has no FarSkip serving class for this export (model type 'olmoe'" in served["log"]
    # layers edited after the export: refused against the export's parity record before any class is built
    assert "`farskip.layers` is [0, 7], but fcsd_export.json beside it records" in errors["corrupt"], errors


def test_farskip_fields_that_disagree_are_refused_never_served_with_stock_wiring(served):
    """The plugin checks every config vLLM loads (fcsd.serving.vllm.guard): an export whose `architectures` names the
    stock class (served stock before), one without its `farskip` block (a 202-line worker traceback before) and a
    `farskip` block under the stock type and class (a run's final/: served stock before) are refused, by name."""
    messages = {
        "stock-architecture": "names the stock class, but model type 'farskip_qwen3_moe' and the `farskip` block",
        "no-block": "says FarSkip but the `farskip` block (which layers are converted) is missing",
        "converted": "so vLLM would serve it with stock wiring (an fcsd checkpoint such as a run's final/",
    }
    for name, message in messages.items():
        error = served["results"][name].get("error", "")
        assert error.startswith("FarSkipServingError: ") and message in error, (name, error)


def test_vllm_serve_of_an_export_without_its_farskip_block_is_one_line(tokenizer, tmp_path):
    vllm_python()
    folder = export(fcsd.apply_farskip(build("qwen3_moe", len(tokenizer)), "all"), tokenizer, tmp_path / "export")
    damaged = shutil.copytree(folder, tmp_path / "no-block")
    (damaged / "config.json").write_text(
        json.dumps(identity_edits(json.loads((folder / "config.json").read_text()))["no-block"])
    )
    command = [
        str(vllm_python().with_name("vllm")),
        "serve",
        str(damaged),
        "--dtype",
        "float32",
        "--max-model-len",
        "128",
    ]
    log = tmp_path / "serve.log"
    with log.open("w") as out, started(command, env=vllm_env(), stdout=out, stderr=subprocess.STDOUT) as server:
        assert server.wait(timeout=600) == 2, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert text.strip().splitlines()[-1].startswith("vllm serve: error: ") and "`farskip` block" in text, text[-2000:]


def test_an_export_naming_another_familys_class_is_refused_where_vllm_loads_its_config(tokenizer, tmp_path):
    """VLLM builds its model from `architectures`; an export of Qwen3-MoE naming FarSkip DeepSeek-V2's class
    passed the plugin's check. Now vLLM's own config loader (the plugin's seam) refuses it, naming the field and the
    family's class, and still loads the export as written. No engine starts (a refusal costs nothing to serve)."""
    folder = export(fcsd.apply_farskip(build("qwen3_moe", len(tokenizer)), "all"), tokenizer, tmp_path / "export")
    other = shutil.copytree(folder, tmp_path / "other")
    config = json.loads((folder / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["FarSkipDeepseekV2ForCausalLM"]}))
    script = (
        "import json, sys, fcsd.serving.vllm as plugin; plugin.register(); import vllm.config.model as m\n"
        "def load(folder):\n"
        "    try:\n"
        "        return m.get_config(folder, False).to_dict()['architectures']\n"
        "    except Exception as error:\n"
        "        return f'{type(error).__name__}: {error}'\n"
        "print(json.dumps([load(folder) for folder in sys.argv[1:]]))"
    )
    command = [vllm_python(), "-c", script, str(folder), str(other)]
    done = subprocess.run(command, capture_output=True, text=True, env=vllm_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    written, edited = json.loads(done.stdout.strip().splitlines()[-1])
    assert written == ["FarSkipQwen3MoeForCausalLM"]
    assert edited.startswith("FarSkipServingError: ") and len(edited.splitlines()) == 1, edited
    message = "names a FarSkip class of another family, not 'FarSkipQwen3MoeForCausalLM', the one of model type"
    assert message in edited and 'set "architectures": ["FarSkipQwen3MoeForCausalLM"]' in edited, edited


def test_without_the_plugin_vllm_refuses_the_export(served):
    # VLLM_PLUGINS=none: vLLM without fcsd's plugin; never the stock wiring
    assert "trust_remote_code" in served["results"]["absent"].get("error", ""), served["results"]["absent"]
    assert served["results"]["absent-remote-code"].get("error"), "served without the plugin"
    assert "FarSkipConfig'> for this kind of AutoModel" in served["absent_log"]  # transformers refuses the class


def test_the_plugin_imports_nothing_of_fcsd_but_itself():
    """The plugin runs under vLLM's own (older) transformers: registering it imports no other part of fcsd."""
    script = (
        "import sys, fcsd.serving.vllm as plugin; plugin.register(); "
        "print(sorted(m for m in sys.modules if m.startswith('fcsd') and not m.startswith('fcsd.serving')))"
    )
    done = subprocess.run([vllm_python(), "-c", script], capture_output=True, text=True, env=vllm_env(), timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "['fcsd']", done.stdout


def test_the_plugin_maps_the_composite_llama4_export_to_vllms_multimodal_class():
    """A composite export (``FarSkipLlama4ForConditionalGeneration``, fcsd.export.composite) names a class the plugin
    registers, built on the stock class vLLM itself registers for ``Llama4ForConditionalGeneration``. Not served on
    CPU here: vLLM's mllama4 imports transformers' Llama-4 image processor, which needs torchvision, and serve-env
    drops torchvision (PyPI's wheel is built for the CUDA torch; with the CPU torch its operators fail to register);
    behind that, vLLM's CPU fused MoE lacks Llama-4's router weight on the input (docs/serving.md)."""
    from fcsd.serving.served_families import BY_ARCHITECTURE

    family = BY_ARCHITECTURE["FarSkipLlama4ForConditionalGeneration"]
    script = (
        "import json, fcsd.serving.vllm as plugin; plugin.register(); from vllm import ModelRegistry; "
        "m = ModelRegistry.models; print(json.dumps({a: [m[a].module_name, m[a].class_name] for a in "
        "('FarSkipLlama4ForConditionalGeneration', 'Llama4ForConditionalGeneration')}))"
    )
    done = subprocess.run([vllm_python(), "-c", script], capture_output=True, text=True, env=vllm_env(), timeout=600)
    assert done.returncode == 0, done.stderr
    registered = json.loads(done.stdout.strip().splitlines()[-1])
    farskip = ["fcsd.serving.vllm.models", "FarSkipLlama4ForConditionalGeneration"]
    assert registered["FarSkipLlama4ForConditionalGeneration"] == farskip
    assert registered["Llama4ForConditionalGeneration"] == [family.module, family.architecture]


def overlap_order(mode: str) -> dict:
    worker = Path(__file__).parent / "workers" / "vllm_overlap_order.py"
    done = subprocess.run([vllm_python(), worker, mode], capture_output=True, text=True, env=vllm_env(), timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["overlapped", "blocking"])
def test_the_routed_all_reduce_is_waited_after_the_next_attention(mode):
    """The order the overlap promises (Sec. 4.2), on stub sub-blocks: layer k's routed all-reduce starts at the end
    of layer k and is waited in layer k+1 after its attention; the last layer (no converted successor) and the
    blocking reference reduce at once. A start followed by an immediate wait fails this."""
    order = overlap_order(mode)["order"]
    if mode == "overlapped":
        assert order == ["attention 0", "start 0", "attention 1", "wait 0", "start 1", "attention 2", "wait 1",
                         "blocking 2"]  # fmt: skip
    else:
        assert order == ["attention 0", "blocking 0", "attention 1", "blocking 1", "attention 2", "blocking 2"]


def test_the_compiled_overlap_keeps_the_attention_between_start_and_wait():
    """Under Inductor (vLLM's CPU compilation) the compiled code runs each start before the next layer's attention
    and its wait after it, and computes what the eager layers do. Without the wait's pin on the attention output,
    Inductor runs every wait right after its start (seen while building this), which fails here."""
    compiled, eager = overlap_order("compiled"), overlap_order("overlapped")
    order = compiled["order"]
    for k in (0, 1):
        assert order.index(f"start {k}") < order.index(f"attention {k + 1}") < order.index(f"wait {k}"), order
    assert sorted(order) == sorted(eager["order"])  # every start, wait and attention ran once
    assert compiled["output"] == eager["output"]


def test_the_routed_ops_split_vllms_piecewise_graph_around_the_next_attention():
    """vLLM's piecewise compilation (GPUs) runs its splitting ops eagerly between compiled pieces: with the plugin's
    routed ops among them, vLLM's own ``split_graph`` puts each start before the next attention and its wait after
    it, each in a piece of its own (run on CPU with Dynamo; the CUDA graphs of the pieces need a GPU)."""
    assert overlap_order("split")["splits"] == [
        "record 0", "farskip_routed_start 0", "record 1", "farskip_routed_wait 0", "farskip_routed_start 1",
        "record 2", "farskip_routed_wait 1", "record blocking",
    ]  # fmt: skip


def test_the_plugin_places_the_routed_ops_by_vllms_execution_settings():
    """With vLLM's own CompilationConfig (a CUDA device pretended): under piecewise compilation split at attention the
    routed ops join the splitting ops and full CUDA graphs (vLLM's GPU default, and decode-only) stay full: only
    forwards above vLLM's largest capture size (256 here; 512 without graphs) overlap, the captured ones reduce with
    vLLM's all-reduce; CUDA graphs with no split at attention (splitting ops without it, breakable graphs of an eager
    model) leave ``auto`` off and refuse ``true`` in one line; --enforce-eager overlaps."""
    worker = Path(__file__).parent / "workers" / "vllm_overlap_modes.py"
    done = subprocess.run([vllm_python(), worker], capture_output=True, text=True, env=vllm_env(), timeout=600)
    assert done.returncode == 0, done.stderr
    cases = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("gpu default (piecewise, full and piecewise graphs)", "gpu full decode only"):
        case = cases[name]
        assert case["auto"] and case["true"] == "on", case
        assert case["splitting_ops"][-2:] == ["fcsd::farskip_routed_start", "fcsd::farskip_routed_wait"], case
        assert case["above_tokens"] == 256, case
        assert case["overlaps"] == {"1": False, "256": False, "257": True, "8192": True}, case
    for name in ("gpu splitting ops without attention", "gpu breakable graphs (mode none)"):
        case = cases[name]
        assert not case["auto"] and case["true"].startswith("refused: farskip_overlap=true cannot run"), case
        assert "\n" not in case["true"] and not any("fcsd" in op for op in case["splitting_ops"] or []), case
    assert cases["gpu breakable graphs (mode none)"]["cudagraph_mode"] == "PIECEWISE"
    assert cases["gpu splitting ops without attention"]["cudagraph_mode"] == "FULL"  # not lowered: nothing to split
    assert cases["gpu default (piecewise, full and piecewise graphs)"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert cases["gpu full decode only"]["cudagraph_mode"] == "FULL_DECODE_ONLY"  # decode keeps its full graphs
    eager = cases["gpu enforce eager"]
    assert eager["auto"] and eager["true"] == "on" and eager["what"] == "eager"
    assert eager["above_tokens"] == 512 and eager["overlaps"]["513"] and not eager["overlaps"]["512"]


def test_overlap_token_threshold_setting():
    """farskip_overlap_above_tokens: auto is vLLM's largest CUDA-graph capture size (512 without graphs), a number
    is taken as is, anything else is refused in one line."""
    from fcsd.serving.routed_allreduce import resolve_above_tokens

    assert resolve_above_tokens(None, 256) == 256 and resolve_above_tokens("auto", None) == 512
    assert resolve_above_tokens(0, 256) == 0 and resolve_above_tokens("2048", 256) == 2048
    for bad in (-1, "many", 1.5, True):
        with pytest.raises(ValueError, match="farskip_overlap_above_tokens=.*expected a whole number"):
            resolve_above_tokens(bad, 256)


def test_overlap_switch():
    assert resolve_overlap(None, tp_size=2) and resolve_overlap("auto", tp_size=2)
    assert not resolve_overlap(None, tp_size=1) and not resolve_overlap(None, tp_size=2, unsplit_graphs=True)
    assert not resolve_overlap(False, tp_size=8) and resolve_overlap("on", tp_size=1)
    with pytest.raises(ValueError, match=r"cannot run inside CUDA graphs .*: a started all-reduce cannot cross"):
        resolve_overlap(True, tp_size=2, unsplit_graphs=True)
    with pytest.raises(ValueError, match="expected true, false or auto"):
        resolve_overlap("sometimes", tp_size=2)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_vllm_serve_answers_an_openai_completion(tokenizer, tmp_path):
    vllm_python()
    folder = export(fcsd.apply_farskip(build("qwen3_moe", len(tokenizer)), "last:50%"), tokenizer, tmp_path / "export")
    tokenizer = tokenizer_from_pretrained(str(folder))
    prompt = "add 1 + 2"
    model = fcsd.from_pretrained(str(folder))
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = tokenizer.decode(greedy[0, ids.shape[1] :])
    port = free_port()
    command = [
        str(vllm_python().with_name("vllm")),
        "serve",
        str(folder),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "128",
        "--gpu-memory-utilization",
        "0.2",
        "--kv-cache-memory-bytes",
        str(64 << 20),
    ]
    log = tmp_path / "serve.log"
    with log.open("w") as out, started(command, env=vllm_env(), stdout=out, stderr=subprocess.STDOUT) as server:
        wait_for(lambda: _healthy(port), 900, f"the server's health answer ({log})", server, poll=2)
        body = {"model": str(folder), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
    assert answer["choices"][0]["text"] == expected


def _healthy(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
        return True
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q"]))
