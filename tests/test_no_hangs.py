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

    from fcsd.parallel.apply_ep import resolve_node_size
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
    from fcsd.parallel.apply_ep import _replica_group
    from fcsd.parallel.layout import ParallelDims, build_meshes

    meshes = build_meshes(ParallelDims(world=4, ep=2, fsdp=True), "cpu")
    made = [node, rail, expert_parallel_group(2), _replica_group(expert_parallel_group(2), 2)]
    made += [meshes.dense.get_group("fsdp"), meshes.sparse.get_group("ep"), meshes.sparse.get_group("efsdp")]
    timeouts = [group._get_backend(__import__("torch").device("cpu")).options._timeout.total_seconds()
                for group in made]
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
        assert written == {"timeouts": [77.0] * 7, "sizes": [2, 2]}  # node, rail, ep, replicas, the three meshes


# -- a sweep chosen at the edge of its grid says so ------------------------------------------------------------------


def _sweep_rows(chosen_batch: int, chosen_lr: float) -> list[dict]:
    rows = []
    for stage, batch, lr in [(1, 32768, 4e-5), (1, 65536, 4e-5), (1, 131072, 4e-5)] + [
        (2, chosen_batch, lr) for lr in (2e-5, 4e-5, 8e-5)
    ]:
        loss = 0.5 if (batch, lr) == (chosen_batch, chosen_lr) or (stage == 1 and batch == chosen_batch) else 1.0
        row = {"stage": stage, "batch_tokens": batch, "lr": lr, "status": "finished", "steps": 4, "loss": loss}
        rows.append({**row, "run": f"b{batch}-lr{lr:g}", "curve": [(1, 1.0), (4, loss)]})
    return rows


def test_a_sweep_chosen_at_the_top_of_both_grids_says_so_and_gives_the_next_grid(tmp_path):
    from types import SimpleNamespace

    from fcsd.distill.sweep import grid_edges, write_outputs

    sweep = SimpleNamespace(batch_tokens=[32768, 65536, 131072], lrs=[2e-5, 4e-5, 8e-5])
    selection = {"batch_tokens": 131072, "lr": 8e-5, "loss": 0.5, "lr_scale": 1.0, "peak_lr": 8e-5, "command": "x"}
    selection["notes"] = grid_edges(sweep, selection, 4096)
    assert selection["notes"] == [
        "the chosen batch size 131072 is the largest of sweep.batch_tokens: the best may lie above it; sweep again "
        "with sweep.batch_tokens=[131072,262144,524288]",
        "the chosen LR 8e-05 is the largest of sweep.lrs: the best may lie above it; sweep again with "
        "sweep.lrs=[8e-05,0.00016,0.00032]",
    ]
    write_outputs(tmp_path, _sweep_rows(131072, 8e-5), selection, 4)
    table = (tmp_path / "sweep_table.md").read_text()
    assert "Note: the chosen LR 8e-05 is the largest of sweep.lrs" in table
    assert "Note: the chosen batch size 131072 is the largest" in table


def test_a_sweep_at_the_bottom_says_so_and_one_inside_its_grids_says_nothing():
    from types import SimpleNamespace

    from fcsd.distill.sweep import grid_edges

    sweep = SimpleNamespace(batch_tokens=[32768, 65536, 131072], lrs=[2e-5, 4e-5, 8e-5])
    assert grid_edges(sweep, {"batch_tokens": 65536, "lr": 4e-5}, 4096) == []
    assert grid_edges(sweep, {"batch_tokens": 32768, "lr": 2e-5}, 4096) == [
        "the chosen batch size 32768 is the smallest of sweep.batch_tokens: the best may lie below it; sweep again "
        "with sweep.batch_tokens=[8192,16384,32768]",
        "the chosen LR 2e-05 is the smallest of sweep.lrs: the best may lie below it; sweep again with "
        "sweep.lrs=[5e-06,1e-05,2e-05]",
    ]


# -- a successful multi-node run ends without the store's C++ warnings ------------------------------------------------

SLOW_SHUTDOWN = """import os
if os.environ.get("FCSD_TEST_SLOW_SHUTDOWN") and os.environ.get("LOCAL_RANK") is None:  # the agent, not its rank
    import time
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    original = dynamic_rendezvous.DynamicRendezvousHandler.shutdown

    def shutdown(self):
        import socket

        port, deadline = int(os.environ["FCSD_TEST_STORE_PORT"]), time.monotonic() + 120
        while time.monotonic() < deadline:  # until the node that hosts the rendezvous store has ended
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) != 0:
                    break
            time.sleep(0.2)
        return original(self)

    dynamic_rendezvous.DynamicRendezvousHandler.shutdown = shutdown
"""


def test_a_successful_two_node_launch_shows_no_store_warnings(tmp_path):
    """Two agents of `fcsd launch torchrun --nnodes 2` (c10d rendezvous on this machine); the second closes the
    rendezvous after the first, whose agent hosts the store, has ended (what happens by chance at the end of every
    multi-node run, here made certain): that printed torch's C++ "recvVector failed" warning and stack frames."""
    import socket

    from processes import wait_for

    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "sitecustomize.py").write_text(SLOW_SHUTDOWN)
    port = free_port()
    launcher = ["torchrun", "--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d"]
    launcher += ["--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "fcsd.cli", "perfmodel", "--preset", "deepseek-v3"]
    argv = [sys.executable, "-m", "fcsd.cli", "launch", *launcher]
    base = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    slow = {**base, "PYTHONPATH": os.pathsep.join([str(tmp_path / "slow"), *sys.path]), "FCSD_TEST_SLOW_SHUTDOWN": "1"}
    slow["FCSD_TEST_STORE_PORT"] = str(port)
    options = dict(stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def listening() -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    with started(argv, env=base, **options) as first:
        wait_for(listening, 120, "the first agent's rendezvous store", first)
        with started(argv, env=slow, **options) as second:
            _, second_err = second.communicate(timeout=300)
        _, first_err = first.communicate(timeout=300)
    assert (first.returncode, second.returncode) == (0, 0), first_err[-2000:] + second_err[-2000:]
    for err in (first_err, second_err):
        assert "recvVector" not in err and "frame #" not in err and "[c10d]" not in err, err[-3000:]


# -- the agent that survives the loss of the store's node says so in one line -----------------------------------------

HELD_AT_EXIT = """import atexit, os, time
if os.environ.get("FCSD_TEST_MARK") and os.environ.get("LOCAL_RANK") is not None:  # a rank, not its agent
    def hold():
        open(os.environ["FCSD_TEST_MARK"] + os.environ["RANK"], "w").close()
        time.sleep(120)  # the run goes on while the test takes the first node away
    atexit.register(hold)
"""


def test_the_agent_that_survives_the_store_node_says_so_in_one_line(tmp_path):
    """`fcsd launch torchrun --nnodes 2`: the first node (its agent hosts the c10d store, and its rank) killed; the
    other agent printed torch's C++ frames and a RendezvousConnectionError traceback. Now: its ranks stopped, one
    line naming the lost store and how to go on, status 1."""
    import signal
    import socket

    import psutil
    from processes import wait_for

    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "sitecustomize.py").write_text(HELD_AT_EXIT)
    port, mark = free_port(), str(tmp_path / "rank")
    launcher = ["torchrun", "--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d"]
    launcher += ["--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "fcsd.cli", "perfmodel", "--preset", "deepseek-v3"]
    argv = [sys.executable, "-m", "fcsd.cli", "launch", *launcher]
    path = os.pathsep.join([str(tmp_path / "held"), *sys.path])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "FCSD_TEST_MARK": mark}
    options = dict(env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def listening() -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    with started(argv, **options) as first:
        wait_for(listening, 120, "the first agent's rendezvous store", first)
        with started(argv, **options) as second:
            wait_for(lambda: all(os.path.exists(f"{mark}{r}") for r in (0, 1)), 300, "both ranks ran", second)
            lost = [psutil.Process(first.pid), *psutil.Process(first.pid).children(recursive=True)]
            for process in lost:  # the node goes: its agent and its rank at once
                process.send_signal(signal.SIGKILL)
            _, err = second.communicate(timeout=300)
    assert second.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"fcsd perfmodel: lost the rendezvous store at 127.0.0.1:{port} (the node hosting it"), (
        err
    )
    assert "this node's processes were stopped; once every node is up, run the same launch line again" in lines[0]


def test_a_node_size_that_does_not_divide_the_job_is_refused(tmp_path):
    """The probe: parallel.node_size=3 on 2 processes was accepted silently (the group was taken as one node)."""
    code = textwrap.dedent(
        f"""
        import torch.distributed as dist
        from fcsd.parallel.apply_ep import resolve_node_size
        dist.init_process_group("gloo", init_method="file://{tmp_path / "store"}", rank=0, world_size=1)
        assert resolve_node_size(1, 1) == 1
        try:
            resolve_node_size(1, 3)
        except ValueError as error:
            print(error)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith("parallel.node_size=3 does not divide the job's 1 processes"), done.stdout
