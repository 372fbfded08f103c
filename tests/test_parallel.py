"""Distributed pieces on CPU with gloo processes: the FCSD teacher sharded for inference with FSDP2."""

import json
from pathlib import Path

from launch import torchrun


def test_fsdp2_sharded_teacher_gives_the_unsharded_logits_and_holds_half(tmp_path):
    worker = Path(__file__).parent / "workers" / "shard_teacher.py"
    torchrun(2, str(worker), str(tmp_path / "out"))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"out.{rank}.json").read_text())
        assert result["max_abs_diff"] < 1e-5
        assert result["local_params"] <= 0.55 * result["total_params"]
