"""Simulations in parallel (what keeps ``fcsd plan`` of a paper model within minutes on a few CPU cores).

A candidate's estimate is a few independent simulations of a few layers each (:mod:`fcsd.plan.depth`). Inside
:func:`simulation_workers` they run in worker processes (spawned: each builds its own fake process group), and the
search may start the simulations of a candidate it will probably need next (:func:`submit_ahead`: the next one in a
strategy's order while the current one runs); a result is computed once and kept for the plan, so a candidate
simulated ahead, or again by another part of the plan, costs nothing more. Outside the context everything runs in
this process, as before. The results are the same either way: each simulation is a pure function of its inputs.
Spawned workers import the main module again, as Python's ``spawn`` does: a script that plans guards its entry
point with ``if __name__ == "__main__":`` (``fcsd plan`` does).
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import Future, ProcessPoolExecutor

MAX_WORKERS = 4  # a search keeps at most two candidates (a few simulations each) in flight


class Pool:
    """Worker processes and the simulations submitted to them, by ``(configs, layout, target, subset)``."""

    def __init__(self, workers: int):
        import multiprocessing

        self.executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        self.futures: dict[tuple, tuple[object, object, Future]] = {}

    def submit(self, function, model_config, fcsd_config, layout, target: str, subset: tuple[int, ...]) -> Future:
        key = (function.__name__, id(model_config), id(fcsd_config), layout, target, subset)
        found = self.futures.get(key)
        if found is None or found[0] is not model_config or found[1] is not fcsd_config:
            future = self.executor.submit(function, model_config, fcsd_config, layout, target, subset)
            self.futures[key] = (model_config, fcsd_config, future)  # the configs kept: their ids stay theirs
        return self.futures[key][2]

    def close(self, abort: bool = False) -> None:
        """Stop the workers; ``abort`` (the plan failed or was interrupted): at once, their simulations discarded,
        instead of waiting for the ones running to finish."""
        if abort:
            for process in list(getattr(self.executor, "_processes", {}).values()):
                process.terminate()
        self.executor.shutdown(wait=True, cancel_futures=True)


_ACTIVE: list[Pool] = []


@contextlib.contextmanager
def simulation_workers(workers: int | None = None):
    """Run simulations in ``workers`` processes (default: the CPU cores, at most :data:`MAX_WORKERS`; 1: here)."""
    workers = min(os.cpu_count() or 1, MAX_WORKERS) if workers is None else workers
    if workers <= 1 or _ACTIVE:
        yield
        return
    pool = Pool(workers)
    _ACTIVE.append(pool)
    finished = False
    try:
        yield
        finished = True
    finally:
        _ACTIVE.remove(pool)
        pool.close(abort=not finished)  # Ctrl-C or an error: nothing left running, no minute-long wait


def pooled() -> bool:
    """Whether simulations run in worker processes now (inside :func:`simulation_workers`)."""
    return bool(_ACTIVE)


def results(function, model_config, fcsd_config, layout, target: str, subsets) -> list[dict]:
    """``function`` (a simulation: :func:`fcsd.plan.simulate.simulate`) of ``layout`` through each of ``subsets``,
    from the workers when there are some."""
    if not _ACTIVE:
        return [function(model_config, fcsd_config, layout, target, subset) for subset in subsets]
    futures = [_ACTIVE[0].submit(function, model_config, fcsd_config, layout, target, subset) for subset in subsets]
    return [future.result() for future in futures]


def submit_ahead(function, model_config, fcsd_config, layout, target: str, subsets) -> None:
    """Start ``function`` through each of ``subsets`` in the workers (nothing without them); :func:`results`
    collects it."""
    for subset in subsets if pooled() else ():
        _ACTIVE[0].submit(function, model_config, fcsd_config, layout, target, subset)
