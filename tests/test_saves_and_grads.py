"""What a GPU run needs of the parallel runtime, checked on CPU gloo processes: the process groups' timeout, saves that
gather each tensor only on the writing process, compute-dtype tensors saved for the combine's backward, the gradient
norm as one foreach kernel (tests/workers/saves_and_grads.py)."""

import json
from pathlib import Path

import pytest
from launch import torchrun

from fcsd.distill.config import compose, to_config

WORKER = Path(__file__).parent / "workers" / "saves_and_grads.py"
PIECE = 256  # the worker's piece size (bytes)


def _launch(tmp_path, nproc: int, which: str, timeout: float = 300) -> list[dict]:
    out = tmp_path / which
    result = torchrun(nproc, str(WORKER), str(out), which, check=False, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(nproc)]


def test_process_group_waits_the_configured_minutes(tmp_path):
    for rank in _launch(tmp_path, 2, "timeout"):
        assert rank["processes"] == 2 and rank["sum"] == 2
        assert rank["at_start"] == 7  # the group the trainer starts
        assert rank["running"] == 11  # a group started before (by `fcsd convert`, or the caller)


def test_timeout_below_a_minute_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"parallel.timeout_minutes=0: .*at least 1 minute") as refused:
        to_config(compose(["model.name=m", "data.path=d", "parallel.timeout_minutes=0"]))
    assert "\n" not in str(refused.value)
    assert to_config(compose(["model.name=m", "data.path=d"])).parallel.timeout_minutes == 60


def test_saves_gather_each_tensor_on_the_writer_alone_in_pieces_cast_first(tmp_path):
    """The files equal the one-process model's ``save_pretrained`` in fp32 and bf16; the process that does not write
    never allocates more than one piece (the tiny model's largest tensor is hundreds of pieces), and in a bf16 save
    the writer allocates no fp32 tensor beyond a piece (cast before sending)."""
    writer, other = _launch(tmp_path, 2, "save")
    assert set(writer) == {"ep2/float32", "ep2/bfloat16", "ep1/float32", "ep1/bfloat16"}
    for name, case in writer.items():
        assert case["same_keys"] and case["equal"], name
        assert case["files"] > 1, name  # several output shards
        assert case["largest_param_fp32"] > 100 * PIECE
        floats = [size for dtype, size in other[name]["largest"].items() if "float" in dtype]  # the model's tensors
        assert max(floats) <= PIECE, (name, other[name]["largest"])
        if name.endswith("bfloat16"):
            assert case["largest"].get("torch.float32", 0) <= PIECE, (name, case["largest"])


def test_combine_keeps_its_rows_for_backward_in_the_compute_dtype(tmp_path):
    """Under bf16 autocast the weighted sums stay fp32, but what the combine keeps for backward is the rows in bf16
    (an fp32 ``(T, K, D)`` copy doubled it): plain, deduplicating and node-aware dispatchers."""
    for rank in _launch(tmp_path, 2, "combine"):
        hidden = rank["hidden"]
        for name in ("plain", "dedup", "hierarchical"):
            case = rank[name]
            assert case["grads"] == [True, True], name
            wide = [(dtype, shape) for dtype, shape in case["saved"] if len(shape) >= 2 and shape[-1] == hidden]
            assert wide, name  # the rows are kept ...
            assert all(dtype == "bfloat16" for dtype, _ in wide), (name, wide)  # ... in bf16


def test_gradient_norm_is_one_foreach_kernel_per_kind_and_equals_fp64(tmp_path):
    """The global gradient norm (EP, EP x FSDP) runs torch's foreach norm, not a loop of fp64 copies (one op per
    gradient), and stays equal to an fp64 sum of the same gradients."""
    for rank in _launch(tmp_path, 2, "norm"):
        for layout in ("ep", "fsdp"):
            case = rank[layout]
            assert abs(case["norm"] - case["fp64"]) <= 1e-6 * case["fp64"], layout
            assert case["ops"].get("_foreach_norm", 0) >= 1, case["ops"]
            assert case["ops"].get("sum", 0) <= 2 and "_to_copy" not in case["ops"], case["ops"]
