"""Prefill in SGLang, stock wiring vs FarSkip (paper Sec. 4.2, 6.2: the DeepSeek-V3 TTFT result is SGLang's): time
to first token and prefill throughput of the same weights with stock wiring (``none``) and with every layer
converted, the routed all-reduce blocking (``off``) or overlapped with the next layer's attention (``on``).

Run it with SGLang's environment (``make sglang-env``); every variant is its own engine, in its own process:

    .venv-sglang/bin/python benchmarks/sglang_prefill.py EXPORT --tp 8 --prompt-lens 512,1024,2048 \\
        --requests-per-device 2 --overlap off,on

``--tiny DIR`` (run with fcsd's own environment) writes the small random Qwen3-MoE export of
``benchmarks/vllm_prefill.py`` to benchmark on a CPU (there SGLang runs ``torch_native`` attention in fp32 and gloo
all-reduces between processes on shared cores: the figures are noise, not a measurement of the overlap). A batch of
``requests-per-device x TP`` prompts of one length is generated with ``max_new_tokens=1``; its wall time is the
batch's time to first token and prompt tokens / time the prefill throughput; each figure is the median of
``--repeats`` runs after one warm-up; ratios are against ``none`` run the same way. The overlapped runs overlap in
every forward (``farskip_overlap_above_tokens`` 0); CUDA graphs are SGLang's default (decode only: prefill runs
outside them). Results: BENCHMARKS.md.
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
    from fcsd.serving.sglang.stock_copies import sglang_stock_copy
    from fcsd.serving.variants import num_layers, with_layers

    if layers == "none":
        return sglang_stock_copy(export, root / "none")
    if layers == "all":
        return with_layers(export, root / "all", list(range(num_layers(export))))
    return export  # "export": the layers the export was converted on


def measure(args) -> dict:
    """One engine (this process): median batch TTFT (ms) and prefill tokens/s per prompt length."""
    import random

    import sglang as sgl

    lengths = [int(n) for n in args.prompt_lens.split(",")]
    overrides = {}
    if args.overlap in ("on", "off"):
        overrides = {"farskip_overlap": args.overlap == "on", "farskip_overlap_above_tokens": 0}
    cpu = args.device == "cpu"
    engine = sgl.Engine(
        model_path=args.folder,
        tp_size=args.tp,
        dtype=args.dtype,
        device=args.device,
        json_model_override_args=json.dumps(overrides),
        disable_radix_cache=True,  # every prompt is prefilled whole
        context_length=max(lengths) + 8,
        random_seed=0,
        log_level="error",
        **({"attention_backend": "torch_native", "max_total_tokens": 4 * max(lengths) * args.tp} if cpu else {}),
    )
    try:
        vocab = engine.tokenizer_manager.model_config.vocab_size
        rng, params, results = random.Random(0), {"max_new_tokens": 1, "temperature": 0.0}, {}
        batch = args.requests_per_device * args.tp
        for length in lengths:
            engine.generate(input_ids=[[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)],
                            sampling_params=params)  # warm-up  # fmt: skip
            times = []
            for _ in range(args.repeats):
                prompts = [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]
                start = time.perf_counter()
                engine.generate(input_ids=prompts, sampling_params=params)
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            results[length] = {"ttft_ms": 1000 * seconds, "prefill_tok_s": batch * length / seconds}
    finally:
        engine.shutdown()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", nargs="?", help="a FarSkip export (fcsd export) of a family SGLang serves")
    parser.add_argument("--tiny", metavar="DIR", help="write a small random Qwen3-MoE export to DIR and exit")
    parser.add_argument("--layers", default="none,all", help="variants: none (stock), all, export")
    parser.add_argument("--overlap", default="off,on", help="routed all-reduce: off (blocking), on (overlapped)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (SGLANG_USE_CPU_ENGINE=1 is set for it)")
    parser.add_argument("--prompt-lens", default="512,1024,2048")
    parser.add_argument("--requests-per-device", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--folder", help=argparse.SUPPRESS)  # internal: one engine in this process
    args = parser.parse_args()
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).parent))
        from vllm_prefill import write_tiny_export

        write_tiny_export(Path(args.tiny))
        return 0
    if args.folder:
        print("RESULT " + json.dumps(measure(args)))
        return 0
    if not args.export:
        parser.error("give an EXPORT folder (or --tiny DIR to write one)")
    env = {**os.environ, **({"SGLANG_USE_CPU_ENGINE": "1"} if args.device == "cpu" else {})}
    if args.device == "cpu" and args.tp > 1:
        env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(str(i % os.cpu_count()) for i in range(args.tp)))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        layer_sets = args.layers.split(",")
        overlaps = args.overlap.split(",")
        variants = [
            (layers, overlap) for layers in layer_sets for overlap in (overlaps if layers != "none" else [None])
        ]
        folders = {layers: variant_folder(Path(args.export), layers, Path(tmp)) for layers in layer_sets}
        for layers, overlap in variants:
            command = [sys.executable, __file__, "--folder", str(folders[layers]), "--tp", str(args.tp)]
            command += ["--device", args.device, "--prompt-lens", args.prompt_lens, "--dtype", args.dtype]
            command += ["--requests-per-device", str(args.requests_per_device), "--repeats", str(args.repeats)]
            command += ["--overlap", overlap] if overlap else []
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            result = next((line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
            if result is None:
                print(done.stdout[-2000:] + done.stderr[-4000:], file=sys.stderr)
                return 1
            for length, figures in json.loads(result).items():
                rows.append({"layers": layers, "overlap": overlap or "-", "prompt_len": int(length), **figures})
    base = {row["prompt_len"]: row for row in rows if row["layers"] == "none"}
    for row in rows:
        if row["prompt_len"] in base:
            row["ttft_vs_none"] = row["ttft_ms"] / base[row["prompt_len"]]["ttft_ms"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"SGLang, TP {args.tp}, {args.device}, {args.requests_per_device} requests per device")
    print(f"{'layers':8} {'overlap':8} {'prompt':>7} {'TTFT ms':>10} {'prefill tok/s':>14} {'TTFT / none':>12}")
    for row in rows:
        ratio = f"{row['ttft_vs_none']:.3f}" if "ttft_vs_none" in row else "-"
        print(
            f"{row['layers']:8} {row['overlap']:8} {row['prompt_len']:>7} {row['ttft_ms']:>10.1f} "
            f"{row['prefill_tok_s']:>14.0f} {ratio:>12}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
