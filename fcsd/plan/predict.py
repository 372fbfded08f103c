"""The calibrated prediction of a training step, beside the measured one (``fcsd plan --cluster FILE --measure``).

The planner's time model (:func:`fcsd.plan.timing.step_time`) prices a step's FLOPs at the GEMM rate and the
communication it cannot hide at the bus bandwidths; with a cluster file (:mod:`fcsd.plan.calibrate`) those are the
measured figures. What the model leaves out, and what dominates a reduced step on a CPU, is priced from the file's
microbenchmarks and the step's own counts (:func:`step_counts`, made on fake tensors as the planner simulates the
step): every dispatched tensor op at the measured per-op time, the bytes of the elementwise ops at the measured
elementwise bandwidth, and every collective at the measured latency of its kind and group size. Nothing is fitted
to the measured steps: the figures come from microbenchmarks, the counts from the simulation.

``fcsd plan --measure`` with a calibrated cluster measures, besides the chosen layout, every layout the plan timed
(each strategy's fastest), reduced as the chosen one is (:func:`fcsd.plan.self_check.reduced`), in one set of processes.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from dataclasses import replace

from fcsd.plan.calibrate import OpCounter
from fcsd.plan.cluster import Cluster

DDP_BUCKET = 25 * 2**20  # bytes of fp32 gradients per all-reduce of DDP's reducer (its bucket_cap_mb, 25), and a
# first bucket of 1 MiB


def step_counts(model_config, fcsd_config, layout, target: str = "cpu") -> dict:
    """What one optimizer step of ``layout`` dispatches, counted on fake tensors over a fake process group (as the
    planner simulates it, :mod:`fcsd.plan.simulate`, the whole model): tensor ops, their non-view bytes, GEMMs, and
    collectives by ``(kind, group size)``; a micro-batch's counts times the step's micro-batches, the optimizer's
    once; DDP's bucketed gradient all-reduces (its reducer does not run on fake tensors) from the gradients' bytes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fcsd.connectivity.families import family_for_config, text_config
    from fcsd.plan import simulate
    from fcsd.plan.run import LAID_OUT, accumulation_steps, build_run, run_meshes, step_config
    from fcsd.plan.tracker import MemoryTracker

    config = step_config(fcsd_config, layout, layout.processes)
    tokens = layout.micro_batch * config.data.seq_len
    top_k = int(getattr(text_config(model_config), family_for_config(model_config).top_k_attr))
    layers = tuple(range(text_config(model_config).num_hidden_layers))
    accumulation = accumulation_steps(config, layout)
    counters = {"micro": OpCounter(), "optimizer": OpCounter()}
    with contextlib.ExitStack() as stack:
        meshes = None
        if layout.processes > 1 and layout.strategy in LAID_OUT:
            stack.enter_context(simulate.fake_process_group(layout.processes))
            meshes = run_meshes(layout)
        stack.enter_context(simulate.balanced_routing(tokens, top_k))
        stack.enter_context(simulate.meshes_outside_fake_mode())
        stack.enter_context(simulate._quiet_fake_warnings())
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        run = build_run(model_config, fcsd_config, layout, target, meshes, layers)
        simulate.prime_optimizer(run, keep_gradients=accumulation > 1)
        current = [counters["micro"]]

        @contextlib.contextmanager
        def phase(name):
            if name == "optimizer":
                current[0].__exit__(None, None, None)
                with counters["optimizer"]:
                    yield
                current[0].__enter__()
            else:
                yield

        with MemoryTracker(target), counters["micro"]:
            run.step(phase)
    micro, optimizer = counters["micro"], counters["optimizer"]
    collectives = Counter({key: value * accumulation for key, value in micro.collectives.items()})
    collectives.update(optimizer.collectives)
    if layout.strategy == "ddp" and layout.processes > 1:  # DDP's reducer, which fake tensors cannot run
        gradients = sum(p.numel() * 4 for p in run.unwrapped.parameters() if p.requires_grad)
        collectives[("all_reduce", layout.processes)] += 1 + math.ceil(gradients / DDP_BUCKET)
    return {
        "ops": micro.ops * accumulation + optimizer.ops,
        "gemms": micro.gemms * accumulation + optimizer.gemms,
        "bytes": micro.bytes * accumulation + optimizer.bytes,
        "collectives": collectives,
        "accumulation": accumulation,
    }


def calibrated_for(cluster: Cluster, tokens: int) -> Cluster:
    """``cluster`` with its GEMM rate and its grouped expert GEMMs' rates taken at the reduced shapes of ``tokens``
    tokens, where the file measured them (the rates at the model's own shapes otherwise; a file with a reduced GEMM
    rate but no reduced expert rates measured the experts among its GEMMs)."""
    calibration = cluster.calibration
    rate = calibration.reduced_rate(tokens) if calibration is not None else None
    if rate is None:
        return cluster
    calibration = replace(calibration, expert_tflops=calibration.reduced_experts(tokens))
    return replace(cluster, gpu=replace(cluster.gpu, tflops=rate / 1e12 / cluster.mfu), calibration=calibration)


def predict_step(model_config, fcsd_config, layout, cluster: Cluster, estimate=None, target: str | None = None) -> dict:
    """Seconds one optimizer step of ``layout`` takes on ``cluster`` (a calibrated one: :func:`load_cluster_file`):
    the planner's own time model (:func:`fcsd.plan.timing.step_time`: FLOPs at the measured GEMM rate, the
    communication it exposes at the measured bandwidths) plus what that model leaves out, from the file's
    microbenchmarks and the step's own counts (:func:`step_counts`): each dispatched op's time, the elementwise
    bytes at the measured memory bandwidth, each collective's latency. ``estimate``: the step's
    :class:`~fcsd.plan.simulate.StepEstimate` when already made."""
    from fcsd.connectivity.families import text_config
    from fcsd.connectivity.layer_spec import parse_layer_spec
    from fcsd.plan import perfmodel as pm
    from fcsd.plan.candidates import parameter_counts
    from fcsd.plan.run import step_config
    from fcsd.plan.simulate import estimate_step
    from fcsd.plan.timing import step_time

    calibration = cluster.calibration
    target = target or ("cuda" if calibration is not None and calibration.device == "cuda" else "cpu")
    estimate = estimate or estimate_step(model_config, fcsd_config, layout, target)
    config = step_config(fcsd_config, layout, layout.processes)
    tokens = layout.micro_batch * config.data.seq_len
    priced = calibrated_for(cluster, tokens)
    shape = pm.model_shape(model_config)
    converted = set(parse_layer_spec(config.farskip.layers, text_config(model_config).num_hidden_layers))
    timed = step_time(
        estimate,
        shape,
        converted,
        priced,
        config.train.batch_tokens,
        config.data.seq_len,
        parameter_counts(model_config),
    )
    out = {
        "estimated_step_seconds": timed.seconds,
        "time_model": {"compute_s": timed.compute_s, "exposed_comm_s": timed.exposed_comm_s},
        "gemm_tflops": priced.gpu.tflops * priced.mfu,
    }
    if calibration is None:
        return out
    counts = step_counts(model_config, fcsd_config, layout, target)
    dispatch = counts["ops"] * calibration.op_us * 1e-6
    memory = counts["bytes"] / (calibration.memory_gbps * 1e9) if calibration.memory_gbps else 0.0
    latency = sum(n * calibration.latency(kind, ranks) for (kind, ranks), n in counts["collectives"].items())
    out["estimated_step_seconds"] = timed.seconds + dispatch + memory + latency
    out["beyond_time_model"] = {
        "dispatch_s": dispatch,
        "elementwise_s": memory,
        "collective_latency_s": latency,
        "ops": counts["ops"],
        "elementwise_bytes": counts["bytes"],
        "collectives": {f"{kind} x{ranks}": n for (kind, ranks), n in sorted(counts["collectives"].items())},
    }
    return out


def measure_layouts(plan, checked: dict) -> dict:
    """What ``fcsd plan --measure`` adds to :func:`fcsd.plan.self_check.check_plan`'s figures (``checked``, the chosen
    layout's reduced run): ``measured`` (its measured step seconds beside the estimated ones) and ``layouts`` (one
    entry per measured reduced layout). With a calibrated cluster the estimate is :func:`predict_step`'s and every
    other layout the plan timed is measured too; without one it is the FLOPs at this device's matrix product (a
    check of the FLOP count, not of a cluster)."""
    from fcsd.plan.self_check import reduced, reduced_run

    cluster = plan.cluster
    calibrated = cluster.calibration is not None
    model_config, config, layout = reduced_run(plan)
    device = checked["device"]
    target = "cuda" if device.startswith("cuda") else "cpu"
    if not calibrated:
        entry = _entry(layout, checked["measured_step_s"], {"estimated_step_seconds": checked["estimated_step_s"]})
        entry["measured"]["calibrated"] = False
        return {"measured": entry["measured"], "layouts": [entry]}
    jobs, seen = [(model_config, config, layout)], {layout}
    searched = plan.fallback if plan.fallback is not None and plan.search.chosen is None else plan.search
    for candidate in searched.timed:
        job = reduced(plan.source.config, plan.config, candidate.layout)
        if job[2] not in seen and job[2].processes == layout.processes:
            seen.add(job[2])
            jobs.append(job)
    seconds = [checked["measured_step_s"]]
    if len(jobs) > 1:
        from fcsd.plan.measure import measure_jobs

        seconds += [max(m.step_seconds for m in ranks) for ranks in measure_jobs(jobs[1:], device)]
    entries = []
    for job, measured in zip(jobs, seconds, strict=True):
        predicted = predict_step(*job, cluster, target=target)
        entries.append(_entry(job[2], measured, predicted))
    notes = _comparability(cluster, layout.processes, target)
    for entry in entries:
        entry["measured"]["calibrated"] = True
        entry["measured"]["notes"] = notes
    return {"measured": entries[0]["measured"], "layouts": entries}


def _entry(layout, measured: float, predicted: dict) -> dict:
    estimated = predicted["estimated_step_seconds"]
    figures = {"step_seconds": measured, "estimated_step_seconds": estimated}
    figures["ratio"] = estimated / measured if measured else None  # predicted over measured
    figures["prediction"] = {k: v for k, v in predicted.items() if k != "estimated_step_seconds"}
    return {"layout": layout.name, "short": layout.short, "processes": layout.processes, "measured": figures}


def _comparability(cluster: Cluster, processes: int, target: str) -> list[str]:
    """Why the calibrated prediction may not describe the measured steps: another device, more processes than the
    file measured, another thread count."""
    import torch

    calibration, notes = cluster.calibration, []
    if calibration.device and calibration.device != target:
        notes.append(f"the cluster file was measured on {calibration.device}, the reduced steps ran on {target}")
    if processes > cluster.gpus:
        notes.append(
            f"the reduced steps ran {processes} processes, the file measured {cluster.gpus}: its latencies and "
            "bandwidths are extrapolated"
        )
    if target == "cpu" and calibration.threads and calibration.threads != torch.get_num_threads():
        notes.append(
            f"the file was measured with {calibration.threads} thread(s) per process, this plan runs "
            f"{torch.get_num_threads()} (set OMP_NUM_THREADS alike)"
        )
    return notes


def format_measured(checked: dict) -> str:
    """Each measured reduced layout's step: measured beside estimated, their ratio (the text of ``--measure``)."""
    lines = []
    for entry in checked.get("layouts", []):
        m = entry["measured"]
        how = "calibrated prediction" if m.get("calibrated") else "FLOPs at this device's matrix product"
        ratio = f"x{m['ratio']:.2f}" if m.get("ratio") else "-"
        lines.append(
            f"           {entry['short']} ({entry['processes']} processes): measured {m['step_seconds'] * 1e3:.0f} ms, "
            f"estimated {m['estimated_step_seconds'] * 1e3:.0f} ms ({how}; {ratio})"
        )
    for note in (checked.get("layouts") or [{}])[0].get("measured", {}).get("notes", []):
        lines.append(f"           note: {note}")
    return "\n".join(lines)
