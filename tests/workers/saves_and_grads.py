"""Worker of tests/test_saves_and_grads.py: one gloo launch per case, every rank writes ``{out}.{rank}.json``."""

import json
import sys

import torch
import torch.distributed as dist


def timeout_case() -> dict:
    """The trainer's process group waits ``parallel.timeout_minutes``: set when it starts, and on one running."""
    from fcsd.distill.config import FCSDConfig
    from fcsd.distill.trainer import process_state

    def default_group_minutes() -> float:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds() / 60

    config = FCSDConfig()
    config.parallel.timeout_minutes = 7
    started = process_state(config).num_processes
    at_start = default_group_minutes()
    config.parallel.timeout_minutes = 11
    process_state(config)
    ones = torch.ones(1)
    dist.all_reduce(ones)  # the group still works
    return {"processes": started, "at_start": at_start, "running": default_group_minutes(), "sum": ones.item()}


CASES = {"timeout": timeout_case}

if __name__ == "__main__":
    out, which = sys.argv[1], sys.argv[2]
    result = CASES[which]()
    with open(f"{out}.{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
