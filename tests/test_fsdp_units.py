"""FSDP2 on gloo processes (fcsd.parallel.layout): a layer's small modules share one unit (counted collectives per
layer, benchmarks/fsdp_collectives.py), and the head-in-forward loss (fcsd.distill.objectives) never builds a
tokens x vocabulary tensor, with the loss and gradients of one process."""

import json
from pathlib import Path

from launch import torchrun, worker_results

ROOT = Path(__file__).parent.parent


def test_fsdp_collectives_per_layer_are_one_unit_of_small_modules(tmp_path):
    """One training step, FSDP 2: per MoE layer 3 units (the routed experts; post-attention norm, router and shared
    experts together; the layer), each gathered in forward and backward and reduce-scattered once: 9 collectives
    (the unit per router, shared expert, gate and norm made 12 to 18)."""
    out = tmp_path / "counts"
    torchrun(2, str(ROOT / "benchmarks" / "fsdp_collectives.py"), "--out", str(out), timeout=600)
    ranks = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(2)]
    assert ranks[0] == ranks[1]
    assert set(ranks[0]) == {"qwen2_moe", "qwen3_moe", "deepseek_v3"}
    for family, result in ranks[0].items():
        assert 0 < result["per_layer"] <= 9, (family, result)


def test_head_in_forward_loss_builds_no_full_vocabulary_logits(tmp_path):
    """Student and online teacher FSDP2-sharded, vocabulary 151,936: no op of the loss's forward and backward returns
    a tensor of tokens x vocabulary elements (the largest is the gathered head unit), the teacher is resharded
    afterwards, and loss and gradients equal one process's."""
    worker = Path(__file__).parent / "workers" / "fsdp_head.py"
    for result in worker_results(2, worker, tmp_path / "out", timeout=600):
        assert result["largest"] < result["tokens_x_vocab"], result
        assert result["largest"] <= 1.01 * result["head"], result  # its unit: the final norm and the head
        assert result["loss"] < 1e-5 and result["grad"] < 1e-4, result
        assert result["teacher_resharded"], result
