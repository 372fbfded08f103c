"""Distributed pieces on CPU with gloo processes: the FCSD teacher sharded for inference with FSDP2."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_fsdp2_sharded_teacher_gives_the_unsharded_logits_and_holds_half(tmp_path):
    worker = Path(__file__).parent / "workers" / "shard_teacher.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29547"]
    subprocess.run([*launch, str(worker), str(tmp_path / "out")], env=env, check=True, capture_output=True)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"out.{rank}.json").read_text())
        assert result["max_abs_diff"] < 1e-5
        assert result["local_params"] <= 0.55 * result["total_params"]
