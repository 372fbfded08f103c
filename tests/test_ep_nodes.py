"""Expert parallelism across nodes, end to end through `fcsd convert` (design §4 "EP across nodes").

Two ``torchrun --nnodes 2 --nproc_per_node 4`` agents on this machine (a static rendezvous on localhost) stand in for
two nodes of four processes: the launcher's ``LOCAL_WORLD_SIZE`` (4) is the node size. With the node-aware dispatcher
(``parallel.dispatcher=hierarchical``), gradient checkpointing and the replayed rows in host memory:

- EP 8 x FSDP 1 (one expert per process, every expert-parallel group spans both nodes, no FSDP over the experts);
- EP 4 x FSDP 2 (a group per node: nothing of the dispatch crosses nodes; the experts' FSDP2 does), SIGKILLed after
  its first step checkpoint and resumed as EP 8 x FSDP 1 (DCP reshards between the layouts);

both train exactly as one process does (losses, gradient norms, final weights), and the run logs the rows its
dispatchers sent across nodes (none inside one node, some across two).
"""

import os
import shutil
import subprocess
import sys

import pytest
from launch import free_port
from processes import started, wait_for
from test_trainer import FAST, assert_same_training, pretrained_assets, records_of

NODES, PER_NODE = 2, 4
EP_ACROSS = ["parallel.ep_size=8", "parallel.fsdp=true", "parallel.dispatcher=hierarchical"]
EP_PER_NODE = ["parallel.ep_size=4", "parallel.fsdp=true", "parallel.dispatcher=hierarchical"]


def _agents(argv: list[str], env: dict) -> list[list[str]]:
    """The command lines of the two agents (node ranks 0 and 1) of one job."""
    port = free_port()
    common = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--nproc_per_node={PER_NODE}"]
    common += ["--master_addr=127.0.0.1", f"--master_port={port}"]
    return [[*common, f"--node_rank={rank}", *argv] for rank in range(NODES)]


def _run_job(argv: list[str], env: dict, logs, timeout: float = 900) -> None:
    """Both agents, to the end (their output in files: one agent blocked on a full pipe would stall the other's
    collectives); each must succeed."""
    commands = _agents(argv, env)
    files = [open(logs / f"agent-{rank}.log", "w") for rank in range(NODES)]  # noqa: SIM115 (closed below)
    try:
        with started(commands[0], env=env, stdout=files[0], stderr=subprocess.STDOUT) as first:
            with started(commands[1], env=env, stdout=files[1], stderr=subprocess.STDOUT) as second:
                codes = [job.wait(timeout=timeout) for job in (first, second)]
    finally:
        for handle in files:
            handle.close()
    for rank, code in enumerate(codes):
        assert code == 0, (logs / f"agent-{rank}.log").read_text()[-4000:]


def _kill_job_at_checkpoint(argv: list[str], env: dict, run) -> None:
    """Both agents, SIGKILLed with every worker once the run's first step checkpoint is published."""
    import psutil

    quiet = {"env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    commands = _agents(argv, env)
    with started(commands[0], **quiet) as first, started(commands[1], **quiet) as second:
        wait_for(lambda: list(run.glob("checkpoints/step-*")), 900, "the first step checkpoint", first)
        for job in (first, second):
            for process in [*psutil.Process(job.pid).children(recursive=True), psutil.Process(job.pid)]:
                process.kill()
    assert not (run / "final").exists()


@pytest.fixture(scope="module")
def node_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("nodes")
    assets = pretrained_assets(root / "assets", rows=120, steps=40, batch_size=8)
    args = ["-m", "fcsd.cli", "convert", str(assets / "model"), f"data.path={assets / 'train.jsonl'}"]
    args += [f"data.cache_dir={assets / 'cache'}", *FAST, "train.max_steps=3", "train.micro_batch_size=4"]
    args += ["train.save_every=1", "train.grad_clip=0.05", "export=false", "recovery=plain"]
    replay = ["train.gradient_checkpointing=true", "train.checkpoint_offload=true"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, *args, f"output_dir={root / 'one'}"], env=env, check=True, capture_output=True)
    _run_job([*args, *EP_ACROSS, *replay, f"output_dir={root / 'across'}"], env, tmp_path_factory.mktemp("across"))
    killed = root / "per-node"
    _kill_job_at_checkpoint([*args, *EP_PER_NODE, *replay, f"output_dir={killed}"], env, killed)
    shutil.copytree(killed, root / "resumed")
    resume = [*args, *EP_ACROSS, *replay, f"output_dir={root / 'resumed'}", "--resume"]
    _run_job(resume, env, tmp_path_factory.mktemp("resume"))
    return root


def test_ep8_across_two_nodes_trains_as_one_process(node_runs):
    assert_same_training(node_runs / "across", node_runs / "one", rtol=1e-4, atol=1e-4)
    crossing = records_of(node_runs / "across", "ep/rows_crossing_nodes")
    sent = records_of(node_runs / "across", "ep/rows_sent")
    assert len(crossing) == 3 and all(0 < c < s for c, s in zip(crossing, sent, strict=True))


def test_ep4_per_node_killed_resumes_exactly_as_ep8_across_nodes(node_runs):
    """Killed after step 1 on EP 4 x FSDP 2 (whose dispatch stays inside each node), resumed as EP 8 x FSDP 1."""
    killed = node_runs / "per-node"
    assert records_of(killed, "ep/rows_crossing_nodes")[0] == 0 < records_of(killed, "ep/rows_sent")[0]
    resumed = node_runs / "resumed"
    assert (resumed / "checkpoints" / "step-1" / "__7_0.distcp").exists()  # step 1 came from the 8-process EP 4 run
    assert_same_training(resumed, node_runs / "one", rtol=1e-4, atol=1e-4)
    assert records_of(resumed, "ep/rows_crossing_nodes")[-1] > 0
