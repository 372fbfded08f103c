"""Extra peak memory of the KD loss (forward + backward): naive full-vocabulary KL vs fcsd's chunked LM head + KL.

* ``naive``: the logits of student and teacher are the inputs; ``F.kl_div`` on fp32 log-softmaxes of the whole
  batch, then backward. Reported: peak memory beyond those inputs.
* ``fcsd``: the final hidden states and the LM heads are the inputs; :func:`fcsd.distill.losses.chunked_head_loss`
  applies the heads and the KL to ``--chunk`` tokens at a time and computes each chunk's gradients (closed-form
  KL gradient) right in the forward, so nothing is recomputed in backward. Reported: peak memory beyond its inputs
  (it never holds full logits).

With ``--cache``, the same for the teacher cache's top-k (``fcsd cache-teacher``, no backward): ``whole`` applies
the head, log-softmax and top-k to the whole batch (the cache before it was chunked), ``chunked`` is
:func:`fcsd.distill.losses.chunked_topk_teacher` (at most 2^25 logits at once).

Each method runs in its own subprocess so that the peaks do not mix. On CUDA the peak is
``torch.cuda.max_memory_allocated``; on CPU it is the process's peak resident set size.

    python benchmarks/kl_loss_memory.py --tokens 8192 --vocab 151936        # the design's reference size (GPU)
    python benchmarks/kl_loss_memory.py --tokens 2048                        # CPU-sized
    python benchmarks/kl_loss_memory.py --cache --tokens 4096 --hidden 64    # cache-teacher: 4 rows of 1,024
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch
import torch.nn.functional as F

from fcsd.distill import losses
from fcsd.distill.config import TrainConfig
from fcsd.distill.objectives import teacher_token_loss


def current_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.memory_allocated()
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize()


def peak_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(method: str, tokens: int, vocab: int, hidden: int, chunk: int, device: str, dtype_name: str) -> float:
    """GiB of peak memory beyond the inputs of ``method``'s loss forward + backward."""
    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    head = torch.nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype)
    teacher_head = torch.nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype).requires_grad_(False)
    if method in ("whole", "chunked"):  # the teacher cache's top-k of one batch (no gradients)
        teacher_hidden = torch.randn(tokens, hidden, device=device, dtype=dtype)
        baseline = current_bytes(device)
        with torch.no_grad():
            if method == "whole":
                losses.topk_teacher(teacher_head(teacher_hidden), 64)
            else:
                losses.chunked_topk_teacher(teacher_hidden, teacher_head, 64)
        return (peak_bytes(device) - baseline) / 2**30
    if method == "naive":
        with torch.no_grad():
            student_logits = head(torch.randn(tokens, hidden, device=device, dtype=dtype)).requires_grad_(True)
            teacher_logits = teacher_head(torch.randn(tokens, hidden, device=device, dtype=dtype))
        head = None
    else:
        student_hidden = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
        teacher_hidden = torch.randn(tokens, hidden, device=device, dtype=dtype)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    baseline = current_bytes(device)
    if method == "naive":
        s = F.log_softmax(student_logits.float(), dim=-1)
        t = F.log_softmax(teacher_logits.float(), dim=-1)
        loss = F.kl_div(s, t, log_target=True, reduction="sum") / tokens
    else:
        token_loss = teacher_token_loss(losses.divergence("forward_kl"), teacher_head)
        loss = losses.chunked_head_loss(student_hidden, head, token_loss, (teacher_hidden,), chunk) / tokens
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return (peak_bytes(device) - baseline) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=TrainConfig().loss_chunk_size)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", help="logits / hidden dtype (default: bfloat16 on CUDA, float32 on CPU, where bf16 "
                        "matmuls are emulated and slow)")  # fmt: skip
    parser.add_argument("--cache", action="store_true", help="the teacher cache's top-k (whole vs chunked) instead")
    parser.add_argument("--only", choices=["naive", "fcsd", "whole", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.only:
        sizes = (args.tokens, args.vocab, args.hidden, args.chunk, args.device, args.dtype)
        print(json.dumps(measure(args.only, *sizes)))
        return
    results, methods = {}, ("whole", "chunked") if args.cache else ("naive", "fcsd")
    for method in methods:
        command = [sys.executable, __file__, "--only", method] + [a for a in sys.argv[1:] if a != "--cache"]
        results[method] = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    what = "teacher-cache top-k" if args.cache else "KL loss"
    print(f"{what} memory, {args.tokens} tokens x {args.vocab} vocabulary, {args.dtype} inputs, {args.device}")
    print(f"{'method':<8}{'extra peak GiB':>16}")
    for method, gib in results.items():
        print(f"{method:<8}{gib:>16.2f}")
    print(f"{methods[0]} / {methods[1]}: {results[methods[0]] / max(results[methods[1]], 1e-9):.1f}x")


if __name__ == "__main__":
    main()
