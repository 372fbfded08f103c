"""The commands a plan prints: the teacher cache (when the plan uses one), the training launch with the accelerate
config shipped in ``recipes/accelerate/`` for its strategy, and serving the export.

Serving is vLLM's (design §7: fcsd's vLLM plugin loads the export); the serving command is written in one place,
:func:`serve_command`, so that it follows the plugin's options as they settle.
"""

from __future__ import annotations

import shlex

from fcsd.plan.cluster import Cluster
from fcsd.plan.simulate import Layout

ACCELERATE_CONFIGS = {  # strategy -> (one node, several nodes)
    "ep": ("recipes/accelerate/ep8_1node.yaml", "recipes/accelerate/ep8_1node.yaml"),
    "fsdp2": ("recipes/accelerate/fsdp2_8gpu.yaml", "recipes/accelerate/fsdp2_multinode.yaml"),
}
CONFIG_PROCESSES = 8  # the shipped one-node configs launch 8 processes
CACHE_DIR = "teacher-cache"


def convert_overrides(model: str, layout: Layout, spec: str, config, output_dir: str, defaults) -> list[str]:
    """``fcsd convert`` arguments for ``layout``: the model, the layer spec, the candidate's settings, and every
    setting the plan changed from the resolved recipe (``defaults``)."""
    from fcsd.distill.config import hydra_override

    args = [model, f"farskip.layers={spec}" if "," not in spec else hydra_override("farskip.layers", spec)]
    if layout.strategy == "ep":
        args += [f"parallel.ep_size={layout.ep_size}", "early_stop.enabled=false"]
    settings = {
        "train.micro_batch_size": layout.micro_batch,
        "train.gradient_checkpointing": str(layout.gradient_checkpointing).lower(),
        "train.batch_tokens": config.train.batch_tokens,
        "train.max_tokens": config.train.max_tokens,
        "train.warmup_steps": config.train.warmup_steps,
        "data.seq_len": config.data.seq_len,
    }
    current = {
        "train.micro_batch_size": defaults.train.micro_batch_size,
        "train.gradient_checkpointing": str(defaults.train.gradient_checkpointing).lower(),
        "train.batch_tokens": defaults.train.batch_tokens,
        "train.max_tokens": defaults.train.max_tokens,
        "train.warmup_steps": defaults.train.warmup_steps,
        "data.seq_len": defaults.data.seq_len,
    }
    args += [f"{key}={value}" for key, value in settings.items() if current[key] != value]
    if layout.teacher == "cache":
        args += ["teacher.mode=cache", f"teacher.cache_dir={output_dir}/{CACHE_DIR}"]
    elif defaults.teacher.mode == "cache":
        args.append("teacher.mode=online")
    return args + [f"output_dir={output_dir}"]


def launch_prefix(layout: Layout, cluster: Cluster) -> list[str]:
    """How ``fcsd convert`` starts for ``layout``: plain, or ``accelerate launch`` with the strategy's config and
    the process counts that differ from it (several nodes: run it on every node with its rank)."""
    if layout.processes == 1:
        return ["fcsd"]
    args = ["accelerate", "launch"]
    configs = ACCELERATE_CONFIGS.get(layout.strategy)
    if configs is not None:
        args += ["--config_file", configs[cluster.nodes > 1]]
    else:  # DDP: said outright, so that a default accelerate config (FSDP, DeepSpeed) is not picked up instead
        args.append("--multi_gpu")
    if configs is None or layout.processes != CONFIG_PROCESSES or cluster.nodes > 1:
        args += ["--num_processes", str(layout.processes)]
    if cluster.nodes > 1:
        args += ["--num_machines", str(cluster.nodes), "--machine_rank", "$NODE_RANK"]
        args += ["--main_process_ip", "$MASTER_ADDR", "--main_process_port", "29500"]
    return args + ["-m", "fcsd.cli"]


def serve_command(export_dir: str, gpus: int, expert_parallel: bool) -> list[str]:
    """vLLM serving of the export on one node (the FarSkip plugin registers the export's architecture)."""
    args = ["vllm", "serve", export_dir, "--tensor-parallel-size", str(gpus)]
    return args + (["--enable-expert-parallel"] if expert_parallel else [])


def plan_commands(model: str, layout: Layout, spec: str, config, defaults, cluster: Cluster, extra: list[str]):
    """``{"cache_teacher", "train", "serve"}`` shell lines (``cache_teacher`` only with a cached teacher)."""
    from fcsd.sources import display_name

    output_dir = f"runs/{(display_name(model) or 'model').split('/')[-1]}-farskip"
    train = convert_overrides(model, layout, spec, config, output_dir, defaults)
    ours = {a.split("=")[0] for a in train[1:]}
    train += [a for a in extra if a.split("=")[0] not in ours]  # the user's overrides, unless the plan sets them
    commands = {}
    if layout.teacher == "cache":
        keep = [
            a
            for a in train[1:]
            if a.split("=")[0] in ("data.seq_len", "train.batch_tokens", "train.max_tokens", "train.warmup_steps")
        ]
        cache = ["fcsd", "cache-teacher", model, *keep, *extra, f"teacher.cache_dir={output_dir}/{CACHE_DIR}"]
        commands["cache_teacher"] = _line(cache)
    commands["train"] = _line(launch_prefix(layout, cluster) + ["convert", *train])
    experts_split = layout.strategy == "ep" or cluster.gpus_per_node > 1
    commands["serve"] = _line(serve_command(f"{output_dir}/export", cluster.gpus_per_node, experts_split))
    return commands


def _line(args: list[str]) -> str:
    """A shell line; ``$NODE_RANK`` and ``$MASTER_ADDR`` stay unquoted for the shell to fill in."""
    return " ".join(a if a.startswith("$") else shlex.quote(a) for a in args)
