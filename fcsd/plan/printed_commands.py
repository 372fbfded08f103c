"""The commands a plan prints: the teacher cache (when the plan uses one: on the run's processes, laid out as the
run, under a parallel layout), the training launch with the accelerate config for its strategy (a plain
multi-process launch for the layouts fcsd lays out itself: ``parallel.ep_size``, ``parallel.fsdp=true``), and
serving the export.

The accelerate configs are ``recipes/accelerate/`` of the source tree, shipped inside the package with the other
recipes as ``fcsd/recipes/`` (package data; in the source tree a link to ``recipes/``): the launch line names the
installed file (:func:`accelerate_config`), so it runs as printed after ``pip install`` too.

Serving is vLLM's or SGLang's (design §7: fcsd's plugins load the export): :func:`serve_line` and
:func:`sglang_serve_line` add the parallel sizes and the context the plan checked (:mod:`fcsd.plan.serving_fit`) to
the plugins' own commands (``fcsd.serving.served_families``; ``fcsd export`` prints vLLM's).
"""

from __future__ import annotations

import shlex

from fcsd.plan.cluster import Cluster
from fcsd.plan.run import LAID_OUT, Layout

PLAIN = ("ep8_1node.yaml", "ep8_1node.yaml")  # a plain multi-process launch
ACCELERATE_CONFIGS = {"ep": PLAIN, "ep_fsdp": PLAIN, "fsdp2": PLAIN}  # strategy -> (one node, several nodes)
CONFIG_PROCESSES = 8  # the shipped one-node configs launch 8 processes
CACHE_DIR = "teacher-cache"
REPLACED = {  # why the plan replaced a user's override, by key (None: any other)
    None: "the plan chooses it (the fastest way that fits)",
    "teacher.dtype": "fcsd keeps FP8 modules on one process or DDP only (its parallel layouts do not shard them)",
}


def convert_overrides(
    model: str, layout: Layout, spec: str, config, output_dir: str, defaults, gpus_per_node: int | None = None
) -> list[str]:
    """``fcsd convert`` arguments for ``layout``: the model, the layer spec, the candidate's settings, and every
    setting the plan changed from the resolved recipe (``defaults``)."""
    from fcsd.distill.config import hydra_override
    from fcsd.plan.teacher_dtype import runnable_teacher_dtype

    args = [model, f"farskip.layers={spec}" if "," not in spec else hydra_override("farskip.layers", spec)]
    args += parallel_overrides(layout, gpus_per_node)
    settings = {
        "train.micro_batch_size": layout.micro_batch,
        "train.gradient_checkpointing": str(layout.gradient_checkpointing).lower(),
        "train.checkpoint_offload": str(layout.offload).lower(),
        "train.batch_tokens": config.train.batch_tokens,
        "train.max_tokens": config.train.max_tokens,
        "train.warmup_steps": config.train.warmup_steps,
        "data.seq_len": config.data.seq_len,
        "teacher.dtype": runnable_teacher_dtype(config, layout),  # fp8 only where the run keeps FP8 modules
    }
    current = {
        "train.micro_batch_size": defaults.train.micro_batch_size,
        "train.gradient_checkpointing": str(defaults.train.gradient_checkpointing).lower(),
        "train.checkpoint_offload": str(defaults.train.checkpoint_offload).lower(),
        "train.batch_tokens": defaults.train.batch_tokens,
        "train.max_tokens": defaults.train.max_tokens,
        "train.warmup_steps": defaults.train.warmup_steps,
        "data.seq_len": defaults.data.seq_len,
        "teacher.dtype": defaults.teacher.dtype,
    }
    args += [f"{key}={value}" for key, value in settings.items() if current[key] != value]
    if layout.teacher == "cache":
        args += ["teacher.mode=cache", f"teacher.cache_dir={output_dir}/{CACHE_DIR}"]
    elif defaults.teacher.mode == "cache":
        args.append("teacher.mode=online")
    return args + [f"output_dir={output_dir}"]


def parallel_overrides(layout: Layout, gpus_per_node: int | None = None) -> list[str]:
    """The ``parallel.*`` keys of ``layout`` (what the trainer and ``fcsd cache-teacher`` lay the models out by): an
    EP group wider than the ``gpus_per_node`` of a node runs the node-aware dispatcher (the node size is the
    launcher's ``LOCAL_WORLD_SIZE``)."""
    args = [f"parallel.ep_size={layout.ep_size}"] if layout.ep_size > 1 else []
    if gpus_per_node and layout.ep_size > gpus_per_node:
        args.append("parallel.dispatcher=hierarchical")
    return args + (["parallel.fsdp=true"] if layout.fsdp else [])


def launch_prefix(layout: Layout, cluster: Cluster) -> list[str]:
    """How ``fcsd convert`` starts for ``layout``: plain, or ``accelerate launch`` with the strategy's config and
    the process counts that differ from it (several nodes: run it on every node with its rank)."""
    if layout.processes == 1:
        return ["fcsd"]
    args = ["fcsd", "launch", "accelerate", "launch"]  # fcsd launch: an error or a stop said once (fcsd.cli.launch)
    configs = ACCELERATE_CONFIGS.get(layout.strategy)
    if configs is not None:
        args += ["--config_file", accelerate_config(configs[cluster.nodes > 1])]
    else:  # DDP: said outright, so that a default accelerate config (FSDP, DeepSpeed) is not picked up instead
        args.append("--multi_gpu")
    if configs is None or layout.processes != CONFIG_PROCESSES or cluster.nodes > 1:
        args += ["--num_processes", str(layout.processes)]
    if cluster.nodes > 1:
        args += ["--num_machines", str(cluster.nodes), "--machine_rank", "$NODE_RANK"]
        args += ["--main_process_ip", "$MASTER_ADDR", "--main_process_port", "29500"]
    return args + ["-m", "fcsd.cli"]


def accelerate_config(name: str) -> str:
    """The path of the shipped accelerate config ``name`` (``recipes/accelerate/`` shipped in the package,
    :func:`fcsd.recipe_files.shipped_recipes`): relative to the working directory when it lies below it (a source
    checkout's root: ``recipes/accelerate/NAME``), else absolute."""
    from fcsd.recipe_files import display_path, shipped_recipes

    path = shipped_recipes() / "accelerate" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the accelerate config is missing from this fcsd install; reinstall fcsd")
    return display_path(path)


def serve_line(export_dir: str, model_type: str, fit=None, max_context: int | None = None) -> str | None:
    """vLLM serving of the export at ``fit``'s setting (:class:`fcsd.plan.serving_fit.ServingFit`: tensor parallelism
    with the experts split over the same GPUs, pipeline parallelism across nodes over a Ray cluster, and its context
    as ``--max-model-len`` when below the model's ``max_context``; None: one GPU, vLLM's defaults). The command
    fcsd's plugin prints (:func:`fcsd.serving.served_families.serve_command`) with those flags; None when vLLM has no
    FarSkip class for ``model_type``."""
    from fcsd.serving.served_families import serve_command

    base = serve_command(export_dir, model_type)
    if base is None or fit is None:
        return base
    flags = [f"--tensor-parallel-size {fit.tp} --enable-expert-parallel"] if fit.tp > 1 else []
    if fit.pp > 1:
        flags.append(f"--pipeline-parallel-size {fit.pp} --distributed-executor-backend ray")
    if max_context is None or fit.context < max_context:
        flags.append(f"--max-model-len {fit.context}")
    return " ".join([base, *flags])


def sglang_serve_line(export_dir: str, model_type: str, fit=None, max_context: int | None = None) -> str | None:
    """SGLang serving of the export at ``fit``'s setting: tensor parallelism over one node's GPUs (SGLang shards each
    expert over them, the same memory as vLLM's expert parallelism over the group), its context as
    ``--context-length`` when below the model's ``max_context``. None when fcsd's SGLang plugin lacks the family or
    the fit needs pipeline parallelism (which the plugin does not cover)."""
    from fcsd.serving.served_families import sglang_serve_command

    base = sglang_serve_command(export_dir, model_type)
    if base is None or fit is None:
        return base
    if fit.pp > 1:
        return None
    flags = [f"--tp-size {fit.tp}"] if fit.tp > 1 else []
    if max_context is None or fit.context < max_context:
        flags.append(f"--context-length {fit.context}")
    return " ".join([base, *flags])


def plan_commands(model: str, layout: Layout, spec: str, config, defaults, cluster: Cluster, extra: list[str], serving):
    """``({"cache_teacher", "train", "serve", "serve_sglang"}, notes)``: the shell lines (``cache_teacher`` only with
    a cached teacher, ``serve`` / ``serve_sglang`` only where the engine's plugin has the family and the export fits
    the cluster, SGLang's without pipeline parallelism; ``serving`` is
    ``(model_type, check)``, ``check`` a :class:`fcsd.plan.serving_fit.ServingCheck` or None) and a note for each of
    the user's overrides the plan replaced with its own choice. The user's ``output_dir`` is kept."""
    from fcsd.sources import display_name

    given = dict(a.split("=", 1) for a in extra)
    output_dir = given.get("output_dir") or f"runs/{(display_name(model) or 'model').split('/')[-1]}-farskip"
    train = convert_overrides(model, layout, spec, config, output_dir, defaults, cluster.gpus_per_node)
    ours = dict(a.split("=", 1) for a in train[1:])
    notes = [
        f"{key}={value} replaced by the plan's {key}={ours[key]}: {REPLACED.get(key, REPLACED[None])}"
        for key, value in given.items()
        if key in ours and key != "output_dir" and ours[key] != value
    ]
    train += [a for a in extra if a.split("=")[0] not in ours]  # the user's overrides, unless the plan sets them
    commands = {}
    if layout.teacher == "cache":
        keep = [
            a
            for a in train[1:]
            if a.split("=")[0] in ("data.seq_len", "train.batch_tokens", "train.max_tokens", "train.warmup_steps")
        ]
        others = [a for a in extra if a.split("=")[0] not in ("output_dir", "teacher.dtype")]
        others += [a for a in train[1:] if a.startswith("teacher.dtype=")]  # as the training run loads it
        cache = ["cache-teacher", model, *keep, *others, f"teacher.cache_dir={output_dir}/{CACHE_DIR}"]
        if layout.strategy in LAID_OUT:  # on the run's processes, the teacher laid out as the run's
            cache = [*launch_prefix(layout, cluster), *cache, *parallel_overrides(layout, cluster.gpus_per_node)]
        else:  # one process, the whole teacher on one GPU
            cache = ["fcsd", *cache]
        commands["cache_teacher"] = _line(cache)
    commands["train"] = _line(launch_prefix(layout, cluster) + ["convert", *train])
    model_type, check = serving
    fits = check is not None and check.fit is not None
    serve = serve_line(f"{output_dir}/export", model_type, check.fit, check.model.max_context) if fits else None
    if serve is not None:
        commands["serve"] = serve
    sglang = sglang_serve_line(f"{output_dir}/export", model_type, check.fit, check.model.max_context) if fits else None
    if sglang is not None:
        commands["serve_sglang"] = sglang
    return commands, notes


def _line(args: list[str]) -> str:
    """A shell line; ``$NODE_RANK`` and ``$MASTER_ADDR`` stay unquoted for the shell to fill in."""
    return " ".join(a if a.startswith("$") else shlex.quote(a) for a in args)
