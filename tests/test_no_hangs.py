"""Layouts that cannot hang (issue "Nothing lost, round five"): ranks that disagree on the node size are refused in
one line on every rank before any sub-group is made, and the groups made wait at most the run's timeout."""

import json
import os
import subprocess
import sys
import textwrap

from launch import free_port
from processes import started

WORKER = textwrap.dedent(
    """
    import json, os, sys
    from datetime import timedelta

    import torch.distributed as dist

    from fcsd.parallel.apply import resolve_node_size
    from fcsd.parallel.hierarchical import node_and_rail_groups
    from fcsd.parallel.training import expert_parallel_group

    rank, port, node_size, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    store = dist.TCPStore("127.0.0.1", port, 4, rank == 0, timeout=timedelta(seconds=90))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4, timeout=timedelta(seconds=77))
    try:
        node, rail = node_and_rail_groups(None, resolve_node_size(4, int(node_size) or None))
    except ValueError as error:
        print(error, file=sys.stderr)
        sys.exit(2)
    timeouts = [group._get_backend(__import__("torch").device("cpu")).options._timeout.total_seconds()
                for group in (node, rail, expert_parallel_group(2))]
    sizes = [dist.get_world_size(node), dist.get_world_size(rail)]
    open(f"{out}.{rank}.json", "w").write(json.dumps({"timeouts": timeouts, "sizes": sizes}))
    dist.destroy_process_group()
    """
)

# three nodes of 1, 1 and 2 processes (torchrun --nnodes 3 --nproc_per_node {1,1,2}): (node rank, its processes)
UNEVEN = [("0", 1), ("1", 1), ("2", 2), ("2", 2)]


def run_ranks(tmp_path, node_size: int = 0, timeout: float = 90) -> list[subprocess.CompletedProcess]:
    """The four ranks of UNEVEN, each its own process with its node's LOCAL_WORLD_SIZE and GROUP_RANK."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port, done = free_port(), []
    base = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    with (
        started(*_argv(script, 0, port, node_size, tmp_path), **_options(base, 0)) as p0,
        started(*_argv(script, 1, port, node_size, tmp_path), **_options(base, 1)) as p1,
        started(*_argv(script, 2, port, node_size, tmp_path), **_options(base, 2)) as p2,
        started(*_argv(script, 3, port, node_size, tmp_path), **_options(base, 3)) as p3,
    ):
        for process in (p0, p1, p2, p3):
            out, err = process.communicate(timeout=timeout)  # a hang fails here, not after torch's 30 minutes
            done.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return done


def _argv(script, rank, port, node_size, tmp_path):
    return ([sys.executable, str(script), str(rank), str(port), str(node_size), str(tmp_path / "groups")],)


def _options(base, rank):
    node, local = UNEVEN[rank]
    env = {**base, "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": node, "RANK": str(rank)}
    return dict(env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_nodes_of_different_sizes_are_refused_in_one_line_on_every_rank(tmp_path):
    done = run_ranks(tmp_path)
    expected = (
        "parallel.dispatcher=hierarchical: the nodes differ in processes per node (node 0 (rank 0): 1, node 1 "
        "(rank 1): 1, node 2 (ranks 2-3): 2), so the ranks disagree on the node size (1 vs 2): set "
        "parallel.node_size=2 for every node (the same on all; it must divide parallel.ep_size)"
    )
    for rank, result in enumerate(done):
        assert result.returncode == 2, f"rank {rank}: {result.stderr[-3000:]}"
        assert result.stderr.strip().splitlines() == [expected], f"rank {rank}: {result.stderr[-3000:]}"


def test_a_configured_node_size_runs_and_its_groups_wait_the_runs_timeout(tmp_path):
    done = run_ranks(tmp_path, node_size=2)
    for rank, result in enumerate(done):
        assert result.returncode == 0, f"rank {rank}: {result.stderr[-3000:]}"
        written = json.loads((tmp_path / f"groups.{rank}.json").read_text())
        assert written == {"timeouts": [77.0, 77.0, 77.0], "sizes": [2, 2]}
