"""``fcsd convert``, ``fcsd sweep`` and ``fcsd cache-teacher``: a run's config from MODEL and Hydra overrides of
``recipes/fcsd.yaml`` (design §3), handed to the library."""

from __future__ import annotations

import os
from pathlib import Path


def add_parsers(sub) -> None:
    overrides_help = "Hydra overrides of recipes/fcsd.yaml, e.g. data.path=chat.jsonl train.lr=4e-5 farskip.layers=all"
    p = sub.add_parser(
        "convert",
        help="rewire a checkpoint with FarSkip connectivity and recover it with FCSD self-distillation",
        description="MODEL is a hub id, a local folder, or 'demo' (the embedded offline example: builds a tiny "
        "teacher, runs FCSD and an SFT baseline, prints exact-match accuracy and held-out KL).",
    )
    p.add_argument("model", nargs="?", help="hub id, local folder, or 'demo' (or model=PRESET, model.name=...)")
    p.add_argument("overrides", nargs="*", help=overrides_help)
    p.add_argument("--resume", action="store_true", help="continue the run in output_dir (same as train.resume=true)")
    p.add_argument("--cfg", choices=["job"], help="print the resolved config as YAML and exit")
    p.set_defaults(func=_convert)

    p = sub.add_parser(
        "sweep",
        help="the paper's two-stage batch-size / learning-rate sweep (Hydra multirun), then the chosen settings",
        description="Stage 1 runs sweep.batch_tokens at sweep.stage1_lr, stage 2 sweep.lrs at the chosen batch size, "
        "sweep.steps steps each, selected by the mean training loss of the last sweep.select_last steps. Finished "
        "or crashed runs are not run again on a restart. 'demo' runs a CPU-sized variant (recipes/sweep/demo.yaml).",
    )
    p.add_argument("model", nargs="?", help="hub id, local folder, or 'demo' (or model=PRESET)")
    p.add_argument("overrides", nargs="*", help=overrides_help + " sweep=slurm sweep.steps=500")
    p.set_defaults(func=_sweep)

    p = sub.add_parser(
        "cache-teacher",
        help="store the teacher's top-k log-probabilities for training with teacher.mode=cache",
    )
    p.add_argument("model", nargs="?", help="hub id, local folder, or 'demo'")
    p.add_argument("overrides", nargs="*", help=overrides_help + " teacher.top_k=64 teacher.cache_dir=...")
    p.set_defaults(func=_cache_teacher)


def run_overrides(args) -> list[str]:
    """The Hydra overrides of ``fcsd convert`` / ``cache-teacher`` / ``sweep``: MODEL (and the preset that names it,
    e.g. ``demo`` or ``Qwen/Qwen3-30B-A3B``), then the user's overrides."""
    from fcsd.distill.config import PATH_KEYS, hydra_override, preset_for

    overrides, model = list(args.overrides), args.model  # args stay as parsed: this may be called twice
    paths = {f"{section}.{key}" if section else key for section, key in PATH_KEYS}
    for index, override in enumerate(overrides):  # `output_dir=~/x` as the shell passes it when quoted: a path
        key, _, value = override.partition("=")
        if key in paths and value.startswith("~"):
            overrides[index] = hydra_override(key, value)
    if model is not None and "=" in model and not Path(model).exists():  # no MODEL: the first token is an override
        overrides.insert(0, model)
        model = None
    if model is None and not any(o.startswith(("model.name=", "model=")) for o in overrides):
        raise ValueError(
            f"MODEL is missing: `fcsd {args.command} MODEL [key=value ...]` takes a hub id, a local folder or 'demo' "
            f"(e.g. `fcsd {args.command} demo`)"
        )
    named = [o.split("=", 1)[1] for o in overrides if o.startswith("model.name=")]
    if model is not None and named:
        raise ValueError(
            f"MODEL {model} and model.name={named[-1]} name two models; give the model once (as MODEL, or as "
            "model.name without MODEL)"
        )
    if model is not None and "@" in model and not Path(model).exists():  # MODEL@REV: a hub revision
        model, revision = model.rsplit("@", 1)
        overrides.insert(0, hydra_override("model.revision", revision))
    if model is not None:
        overrides.insert(0, hydra_override("model.name", model))
        preset = preset_for(model)
        if preset and not any(o.startswith("model=") for o in overrides):
            overrides.insert(0, f"model={preset}")
    if getattr(args, "resume", False):
        overrides.append("train.resume=true")
    return overrides


def run_config(args):
    """The composed config of ``recipes/fcsd.yaml`` with :func:`run_overrides`."""
    from fcsd.distill.config import compose

    return compose(run_overrides(args))


def _convert(args) -> int:
    from omegaconf import OmegaConf

    cfg = run_config(args)
    if args.cfg:
        print(OmegaConf.to_yaml(cfg, resolve=True), end="")
        return 0
    from fcsd.distill.config import to_config

    config = to_config(cfg)
    from fcsd.parallel.processes import is_main_process, quiet_unless_main

    quiet_unless_main(is_main_process())  # under torchrun / accelerate launch, one process shows progress bars
    if config.model.name == "demo":
        from fcsd.cli.demo import run_demo

        run_demo(config)
        return 0
    from fcsd.distill.convert import convert

    result = convert(config)
    if os.environ.get("RANK", "0") == "0":
        print(f"wrote {result.final_dir} (load it with fcsd.from_pretrained); metrics in {result.output_dir}")
    return 0


def _sweep(args) -> int:
    from fcsd.distill.config import compose, to_config
    from fcsd.distill.sweep import run_sweep, sweep_dir

    overrides = run_overrides(args)
    if "model=demo" in overrides and not any(o.startswith("sweep=") for o in overrides):
        overrides.append("sweep=demo")  # the demo's minutes-long variant of the paper's sweep
    config = to_config(compose(overrides))
    selection = run_sweep(config, overrides)
    print((sweep_dir(config) / "sweep_table.md").read_text(), end="")
    print(f"wrote {sweep_dir(config)}: sweep_table.md, sweep.csv, sweep_losses.png, selection.json")
    print(f"full conversion: {selection['command']}")
    return 0


def _cache_teacher(args) -> int:
    from fcsd.distill.config import to_config
    from fcsd.distill.teacher_cache import cache_dir, cache_teacher
    from fcsd.files import ownership

    config = to_config(run_config(args))
    ownership.check_not_in_use(cache_dir(config).parent, "the folder that holds teacher.cache_dir,")  # a run's
    folder = cache_teacher(config)
    from fcsd.parallel.processes import is_main_process

    if is_main_process():  # under torchrun every process cached its share
        print(f"teacher cache ready at {folder}; train from it with teacher.mode=cache teacher.cache_dir={folder}")
    return 0
