"""Runs inside .venv-vllm (vLLM's own torch and transformers): serves each job's folder with vllm.LLM and writes
greedy tokens with their top-k log-probabilities. One process for many engines saves vLLM's import time.

argv: JOBS.json OUT.json. A job: {"name", "model", "prompts": [[ids]], "max_tokens", "logprobs", "tp", "eager",
"overlap" (null = the plugin's default), "overlap_above" (farskip_overlap_above_tokens; null = default)}.
A result holds the outputs and each worker's overlap counts (started, waited, blocking); a job that fails records
{"error": <last line of the exception>}.
"""

import gc
import json
import sys


def bind_threads(tp: int) -> None:
    """vLLM's CPU workers bind their OpenMP threads per NUMA node by default and refuse more workers than nodes:
    give each tensor-parallel worker its own share of the allowed cores instead."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    shares = [cpus[i::tp] or cpus[:1] for i in range(tp)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, share)) for share in shares)


def run(job):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    bind_threads(job.get("tp", 1))
    additional = {} if job.get("overlap") is None else {"farskip_overlap": job["overlap"]}
    if job.get("overlap_above") is not None:
        additional["farskip_overlap_above_tokens"] = job["overlap_above"]
    llm = LLM(
        job["model"],
        dtype="float32",
        tensor_parallel_size=job.get("tp", 1),
        enforce_eager=job.get("eager", True),
        max_model_len=128,
        max_num_seqs=4,
        seed=0,
        gpu_memory_utilization=0.2,  # on CPU: the share of memory vLLM checks is free (the machine is shared)
        kv_cache_memory_bytes=64 << 20,
        additional_config=additional,
        trust_remote_code=job.get("trust_remote_code", False),
        # the reference MLA kernels: on a CPU with AMX vLLM prefers its AMX MLA backend, whose packed weights must be
        # bf16 (these runs are fp32, to compare with fcsd's fp32 model); other attention ignores the choice
        attention_backend="CPU_MLA",
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], logprobs=job["logprobs"])
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], params)
        results = []
        for output in outputs:
            sample = output.outputs[0]
            steps = [{str(token): entry.logprob for token, entry in step.items()} for step in sample.logprobs]
            results.append({"tokens": list(sample.token_ids), "logprobs": steps})
        from fcsd.serving.routed_allreduce import overlap_stats

        return {"outputs": results, "overlap_stats": llm.collective_rpc(overlap_stats)}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main():
    import os

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function (overlap counts)
    jobs = json.load(open(sys.argv[1]))
    results = {}
    for job in jobs:
        try:
            results[job["name"]] = run(job)
        except Exception as error:  # the test asserts on the message
            results[job["name"]] = {"error": f"{type(error).__name__}: {str(error)[-2000:]}"}
        json.dump(results, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
