"""Runs inside .venv-sglang (SGLang's CPU engine): serves each job's folder with ``sglang.Engine`` and writes greedy
tokens with their top-k log-probabilities. Each job runs in a process of its own (``--one``), stopped with all it
started: an engine that fails to start leaves processes and sockets behind that hang the next one.

argv: JOBS.json OUT.json. A job: {"name", "model", "prompts": [[ids]], "max_tokens", "logprobs", "tp",
"overlap" (null = the plugin's default), "overlap_above" (farskip_overlap_above_tokens; null = default),
"trust_remote_code", "dtype" (float32), "device" (cpu: SGLang's CPU engine; or cuda), "attention_backend" (on CPU
torch_native; else SGLang's default)}.
A result holds the outputs and each process's overlap counts (started, waited, blocking); a
job that fails records {"error": <the exception's message, or the engine's last log lines>}.
"""

import gc
import glob
import json
import os
import sys


def keep_running(*_):
    """SGLang's SIGQUIT handler: a failing engine process must not kill this worker (and the jobs after it)."""


def run(job):
    import sglang as sgl

    overrides = {}
    if job.get("overlap") is not None:
        overrides["farskip_overlap"] = job["overlap"]
    if job.get("overlap_above") is not None:
        overrides["farskip_overlap_above_tokens"] = job["overlap_above"]
    tp, cpu = job.get("tp", 1), job.get("device", "cpu") == "cpu"
    if cpu:
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % os.cpu_count()) for i in range(tp))
    stats = job["stats_dir"]
    os.environ["FCSD_OVERLAP_STATS_DIR"] = stats
    engine = sgl.Engine(
        model_path=job["model"],
        device=job.get("device", "cpu"),
        dtype=job.get("dtype", "float32"),
        tp_size=tp,
        disable_radix_cache=True,
        skip_server_warmup=True,
        random_seed=0,
        trust_remote_code=job.get("trust_remote_code", False),
        json_model_override_args=json.dumps(overrides) if overrides else "{}",
        log_level="info",
        custom_sigquit_handler=keep_running,
        attention_backend=job.get("attention_backend", "torch_native" if cpu else None),
        **({"max_total_tokens": 2048} if cpu else {}),
    )
    try:
        params = {"max_new_tokens": job["max_tokens"], "temperature": 0.0, "ignore_eos": True}
        outputs = engine.generate(
            input_ids=job["prompts"], sampling_params=params, return_logprob=True, top_logprobs_num=job["logprobs"]
        )
        results = []
        for output in outputs:
            steps = [
                {str(token): logprob for logprob, token, _ in step}
                for step in output["meta_info"]["output_top_logprobs"]
            ]
            results.append({"tokens": list(output["output_ids"]), "logprobs": steps})
        counts = [json.load(open(path)) for path in sorted(glob.glob(os.path.join(stats, "*.json")))]
        return {"outputs": results, "overlap_stats": counts}
    finally:
        engine.shutdown()
        del engine
        gc.collect()


def one(job_file: str, out_file: str) -> None:
    job = json.load(open(job_file))
    try:
        result = run(job)
    except BaseException as error:  # the test asserts on the message; SGLang exits its children with SystemExit
        result = {"error": f"{type(error).__name__}: {str(error)[-2000:]}"}
    json.dump(result, open(out_file, "w"))
    sys.stdout.flush()
    os._exit(0)  # leave no engine teardown (sockets, atexit hooks) to hang this process


def main():
    import signal
    import subprocess

    if sys.argv[1] == "--one":
        if json.load(open(sys.argv[2])).get("device", "cpu") == "cpu":
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        return one(sys.argv[2], sys.argv[3])
    jobs = json.load(open(sys.argv[1]))
    results = {}
    for job in jobs:
        print(f"=== job {job['name']}", flush=True)  # the test reads each job's log lines from this marker on
        job_file, out_file = sys.argv[2] + f".{job['name']}.job", sys.argv[2] + f".{job['name']}.out"
        job = {**job, "stats_dir": sys.argv[2] + f".{job['name']}.stats"}  # each process's overlap counts
        os.makedirs(job["stats_dir"], exist_ok=True)
        json.dump(job, open(job_file, "w"))
        child = subprocess.Popen([sys.executable, __file__, "--one", job_file, out_file], start_new_session=True)
        try:
            child.wait(timeout=600)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(child.pid, signal.SIGKILL)  # the engine's processes go with it
        except ProcessLookupError:
            pass  # none is left
        if os.path.exists(out_file):
            results[job["name"]] = json.load(open(out_file))
        else:
            results[job["name"]] = {"error": f"the job's process ended without a result (exit code {child.returncode})"}
        json.dump(results, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
