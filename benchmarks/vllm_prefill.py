"""Prefill in vLLM, stock wiring vs FarSkip (paper Sec. 4.2, 6.2, Fig. 5): time to first token and prefill throughput
of the same weights with no layer and with every layer converted, the routed all-reduce blocking or overlapped.

Run it with vLLM's environment (``make serve-env``); every variant is its own engine, in its own process:

    .venv-vllm/bin/python benchmarks/vllm_prefill.py EXPORT --tp 8 --ep --prompt-lens 512,1024,2048 \\
        --requests-per-device 2 --layers none,all --overlap off,on

``--tiny DIR`` (run with fcsd's own environment) first writes a small random Qwen3-MoE export to benchmark on a CPU.
A request batch of ``requests-per-device x TP`` prompts of one length is generated with ``max_tokens=1``; its wall
time is the batch's time to first token (all prompts are prefilled in one scheduler step when
``--max-num-batched-tokens`` allows) and prompt tokens / time the prefill throughput. Each figure is the median of
``--repeats`` runs after one warm-up; ratios are against ``none`` (stock vLLM) run the same way. ``--execution``:
``eager`` (``enforce_eager``) and/or ``compiled`` (vLLM's default compilation: one Dynamo trace + Inductor on CPU,
piecewise graphs and CUDA graphs on GPUs; the overlap runs there as custom ops). Results: BENCHMARKS.md.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def variant_folder(export: Path, layers: str, root: Path) -> Path:
    from fcsd.serving.variants import num_layers, stock_copy, with_layers

    if layers == "none":
        return stock_copy(export, root / "none")
    if layers == "all":
        return with_layers(export, root / "all", list(range(num_layers(export))))
    return export  # "export": the layers the export was converted on


def measure(args) -> dict:
    """One engine (this process): median batch TTFT (ms) and prefill tokens/s per prompt length."""
    import random

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    lengths = [int(n) for n in args.prompt_lens.split(",")]
    llm = LLM(
        args.folder,
        tensor_parallel_size=args.tp,
        enable_expert_parallel=args.ep,
        enforce_eager=args.execution == "eager",
        dtype=args.dtype,
        max_model_len=max(lengths) + 8,
        max_num_batched_tokens=args.max_num_batched_tokens,
        additional_config={"farskip_overlap": args.overlap == "on"} if args.overlap in ("on", "off") else {},
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=0,
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng, params, results = random.Random(0), SamplingParams(max_tokens=1, temperature=0.0), {}
    batch = args.requests_per_device * args.tp
    for length in lengths:
        prompts = [
            TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(length)]) for _ in range(batch)
        ]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up (and prefix caching is off: new prompts below)
        times = []
        for _ in range(args.repeats):
            prompts = [
                TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(length)]) for _ in range(batch)
            ]
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        results[length] = {"ttft_ms": 1000 * seconds, "prefill_tok_s": batch * length / seconds}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", nargs="?", help="a FarSkip export (fcsd export)")
    parser.add_argument("--tiny", metavar="DIR", help="write a small random Qwen3-MoE export to DIR and exit")
    parser.add_argument("--layers", default="none,all", help="variants: none (stock), all, export")
    parser.add_argument("--overlap", default="off,on", help="routed all-reduce: off (blocking), on (overlapped)")
    parser.add_argument(
        "--execution",
        default="eager,compiled",
        help="eager (enforce_eager) and/or compiled, comma-separated (on GPUs the overlapped compiled runs use "
        "piecewise CUDA graphs where the others keep vLLM's full ones: the overlap and the graph mode change together)",
    )
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", action="store_true", help="vLLM's enable_expert_parallel (EP size = TP x DP)")
    parser.add_argument("--prompt-lens", default="512,1024,2048")
    parser.add_argument("--requests-per-device", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-num-batched-tokens", type=int, default=65536)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--folder", help=argparse.SUPPRESS)  # internal: one engine in this process
    args = parser.parse_args()
    if args.tiny:
        write_tiny_export(Path(args.tiny))
        return 0
    if args.folder:
        print("RESULT " + json.dumps(measure(args)))
        return 0
    if not args.export:
        parser.error("give an EXPORT folder (or --tiny DIR to write one)")
    unknown = set(args.execution.split(",")) - {"eager", "compiled"}
    if unknown:
        parser.error(f"--execution {args.execution}: expected eager and/or compiled, not {', '.join(sorted(unknown))}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        variants = [
            (execution, layers, overlap)
            for execution in args.execution.split(",")
            for layers in args.layers.split(",")
            for overlap in (args.overlap.split(",") if layers != "none" else [None])
        ]
        folders = {layers: variant_folder(Path(args.export), layers, Path(tmp)) for layers in args.layers.split(",")}
        for execution, layers, overlap in variants:
            folder = folders[layers]
            command = [
                sys.executable,
                __file__,
                "--folder",
                str(folder),
                "--execution",
                execution,
                "--tp",
                str(args.tp),
                "--prompt-lens",
                args.prompt_lens,
                "--requests-per-device",
                str(args.requests_per_device),
                "--repeats",
                str(args.repeats),
                "--dtype",
                args.dtype,
                "--max-num-batched-tokens",
                str(args.max_num_batched_tokens),
                "--gpu-memory-utilization",
                str(args.gpu_memory_utilization),
            ]
            command += ["--ep"] if args.ep else []
            command += ["--overlap", overlap] if overlap else []
            done = subprocess.run(command, capture_output=True, text=True, env=os.environ)
            result = next((line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
            if result is None:
                print(done.stdout[-2000:] + done.stderr[-4000:], file=sys.stderr)
                return 1
            for length, figures in json.loads(result).items():
                rows.append(
                    {
                        "execution": execution,
                        "layers": layers,
                        "overlap": overlap or "-",
                        "prompt_len": int(length),
                        **figures,
                    }
                )
    base = {(row["execution"], row["prompt_len"]): row for row in rows if row["layers"] == "none"}
    for row in rows:
        key = (row["execution"], row["prompt_len"])
        if key in base:
            row["ttft_vs_none"] = row["ttft_ms"] / base[key]["ttft_ms"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"TP {args.tp}, EP {'on' if args.ep else 'off'}, {args.requests_per_device} requests per device")
    print(
        f"{'run':9} {'layers':8} {'overlap':8} {'prompt':>7} {'TTFT ms':>10} {'prefill tok/s':>14} {'TTFT / none':>12}"
    )
    for row in rows:
        ratio = f"{row['ttft_vs_none']:.3f}" if "ttft_vs_none" in row else "-"
        print(
            f"{row['execution']:9} {row['layers']:8} {row['overlap']:8} {row['prompt_len']:>7} {row['ttft_ms']:>10.1f} "
            f"{row['prefill_tok_s']:>14.0f} {ratio:>12}"
        )
    return 0


def write_tiny_export(folder: Path) -> None:
    """A random Qwen3-MoE (8 layers, hidden 512, 32 experts top-4, head size 64) converted on all layers, exported
    with a locally trained tokenizer: big enough for the MoE kernels to dominate on a CPU, small enough to build."""
    import torch
    import transformers

    import fcsd
    from fcsd.embedded.tokenizer import train_tokenizer
    from fcsd.export.save import export

    tokenizer = train_tokenizer(["add 1 + 2", "sort 3 1 2", "count the apples"] * 50, vocab_size=2000)
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_experts=32,
        num_experts_per_tok=4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = fcsd.apply_farskip(transformers.Qwen3MoeForCausalLM(config).eval(), "all")
    export(model, tokenizer, folder)
    print(f"wrote {folder}")


if __name__ == "__main__":
    sys.exit(main())
