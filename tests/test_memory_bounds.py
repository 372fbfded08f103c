"""Memory bounded by chunks, not by vocabulary x rows: ``fcsd cache-teacher`` of a model with Qwen3's vocabulary
(151,936) at 1,024-token rows, in its own process, peaks far below the 2.5 GB that one batch of full-vocabulary fp32
logits takes (the unchunked cache peaked at 7.6 GiB here)."""

import os
import subprocess
import sys
import tempfile

from big_vocab import save_big_vocab_model

GIB = 2**30


def peak_rss(argv: list[str]) -> tuple[int, int]:
    """``(exit status, peak resident memory in bytes)`` of ``argv`` run to its end in a child process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: a child that says much never blocks on it
        child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        assert child.returncode == 0, err.read().decode()[-3000:]
    return child.returncode, usage.ru_maxrss * 1024  # kilobytes on Linux


def test_cache_teacher_at_qwen3_vocabulary_peaks_under_2_5_gib(tmp_path):
    model, data = save_big_vocab_model(tmp_path)
    command = [sys.executable, "-m", "fcsd.cli", "cache-teacher", str(model), f"data.path={data}", "progress=false"]
    command += ["data.seq_len=1024", "data.eval_sequences=2", f"teacher.cache_dir={tmp_path / 'cache'}"]
    _, peak = peak_rss([*command, f"data.cache_dir={tmp_path / 'packed'}"])
    assert peak < 2.5 * GIB, f"{peak / GIB:.2f} GiB"
    assert (tmp_path / "cache" / "shard-00000.safetensors").exists()


def test_the_chunked_top_k_equals_the_whole_one():
    import torch

    from fcsd.distill.losses import chunked_topk_teacher, topk_teacher

    hidden, head = torch.randn(37, 16), torch.nn.Linear(16, 50, bias=False)
    whole = topk_teacher(head(hidden), 5, temperature=2.0)
    chunked = chunked_topk_teacher(hidden, head, 5, temperature=2.0, max_elements=7 * 50)  # 6 chunks of 7 rows
    torch.testing.assert_close(chunked[0], whole[0])
    assert torch.equal(chunked[1], whole[1])
    logits = head(hidden).detach()
    assert torch.equal(chunked_topk_teacher(logits, torch.nn.Identity(), 5, 2.0, 100)[1], whole[1])
