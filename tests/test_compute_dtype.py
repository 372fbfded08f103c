"""The routed experts compute in the autocast dtype with fp32 master weights (fcsd.precision): in the model alone
(every family, FarSkip and stock layers), and in `fcsd convert` steps in one process, under DDP and under expert
parallelism (gloo processes). Every grouped matmul is recorded at the dispatcher, forward and backward."""

import json
import pickle
import sys
from pathlib import Path

import pytest
import torch
from launch import torchrun
from tiny_models import TEXT_FAMILIES, build, save_chat_model

from fcsd.connectivity.patch import apply_farskip
from fcsd.precision import experts_in_compute_dtype

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from expert_dtypes import GroupedMatmuls  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "expert_dtypes.py"
BF16 = ["torch.bfloat16", "torch.bfloat16"]


def _step(model, ids, autocast: bool) -> tuple[set, dict]:
    """The grouped matmuls' (input, weight) dtypes of one forward and backward, and the parameters' gradients."""
    model.zero_grad()
    with GroupedMatmuls() as seen:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids).logits
        logits.float().square().mean().backward()
    return seen.dtypes, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_expert_matmuls_run_in_bf16_and_gradients_reach_the_fp32_masters(family):
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    model = apply_farskip(build(family).train(), "last:2")  # stock and FarSkip layers
    _, reference = _step(model, ids, autocast=False)
    stock, stock_grads = _step(model, ids, autocast=True)
    if family != "llama4_text":  # the negative control: transformers' grouped_mm ran fp32 x fp32 under autocast
        assert ("torch.float32", "torch.float32") in stock, stock
    assert experts_in_compute_dtype(model) > 0 or family == "llama4_text"
    dtypes, grads = _step(model, ids, autocast=True)
    assert dtypes == {("torch.bfloat16", "torch.bfloat16")}, dtypes
    expert_grads = [name for name in grads if "experts." in name]
    assert expert_grads
    for name, grad in grads.items():
        assert grad.dtype == torch.float32, name
        # against the fp32 reference: within the error bf16 autocast already makes in the rest of the model
        error, autocast_error = (_error(g[name], reference[name]) for g in (grads, stock_grads))
        assert error <= max(1.5 * autocast_error, 0.02), (name, error, autocast_error)


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def test_outside_autocast_the_experts_are_the_stock_forward():
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    model = build("qwen3_moe")
    before = model(input_ids=ids).logits
    experts_in_compute_dtype(model)
    assert torch.equal(model(input_ids=ids).logits, before)  # bit for bit: nothing is cast in fp32
    assert experts_in_compute_dtype(model) == 0  # applied once
    again = pickle.loads(pickle.dumps(model))  # torch.save(model) pickles the class
    assert type(again.model.layers[0].mlp.experts) is type(model.model.layers[0].mlp.experts)
    assert torch.equal(again(input_ids=ids).logits, before)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtypes")
    talk = [[("user", f"add {i} and {i + 1}"), ("assistant", str(2 * i + 1))] for i in range(40)]
    rows = [{"messages": [{"role": role, "content": text} for role, text in turns]} for turns in talk]
    save_chat_model(root / "model", rows, vocab_size=120)
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.mark.parametrize(("nproc", "layout"), [(1, []), (2, []), (2, ["parallel.ep_size=2"])])
def test_a_bf16_convert_step_runs_every_expert_matmul_in_bf16(chat, tmp_path, nproc, layout):
    """One process, DDP and EP 2: ``train.mixed_precision=bf16`` with fp32 masters (``model.dtype=auto``)."""
    out = tmp_path / "dtypes"
    argv = ["convert", str(chat / "model"), f"data.path={chat / 'chat.jsonl'}", f"output_dir={tmp_path / 'run'}"]
    argv += ["data.seq_len=32", "data.eval_sequences=2", "train.batch_tokens=128", "train.micro_batch_size=2"]
    argv += ["train.max_steps=1", "train.warmup_steps=0", "train.mixed_precision=bf16", "progress=false"]
    argv += ["early_stop.enabled=false", "export=false", *layout]
    result = torchrun(nproc, str(WORKER), str(out), *argv, check=False, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in range(nproc):
        seen = json.loads(Path(f"{out}.{rank}.json").read_text())
        assert seen["code"] == 0
        assert seen["dtypes"] == [BF16], seen["dtypes"]
