"""The FCSD run configuration: dataclass schemas registered in Hydra's ConfigStore, composed with ``recipes/fcsd.yaml``
and command-line ``key=value`` overrides (paper Sec. 3.1, 5.1; design §3).

A wrong key or a value of the wrong type fails at composition with Hydra's message naming the key.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from fcsd.removed_settings import check_removed
from fcsd.run_facts import end_step, ramp_stages, schedule_steps, warmup_steps

OBJECTIVES = ("kl", "sft", "kl_l2")
TEACHER_MODES = ("online", "cache")
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")  # model.dtype
TEACHER_DTYPES = (*MODEL_DTYPES, "fp8")  # teacher.dtype: fp8 keeps a block-FP8 source's FP8 modules
SWEEP_SCHEDULES = ("full", "truncated")
EP_MODES = ("farskip_overlap", "farskip_reference")
EP_DISPATCHERS = ("plain", "dedup", "hierarchical")
EARLY_STOP_METRICS = ("plus", "base")
OPTIMIZERS = ("adamw", "schedule_free")  # recovery.optimizer
DEFAULT_TIMEOUT_MINUTES = 60  # parallel.timeout_minutes: process groups of training and of fcsd's own tools
EXPORT_FORMATS = ("source", "bf16")
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")  # train.divergence (fcsd.distill.losses)
MIXED_PRECISIONS = ("auto", "bf16", "fp16", "no")
SWEEP_LAUNCHERS = ("basic", "submitit_slurm", "submitit_local")


def one_of(default: str, choices: tuple[str, ...]):
    """A setting that takes one of ``choices``: checked where every config is read, by :func:`check_choices`."""
    return field(default=default, metadata={"choices": choices})


@dataclass
class ModelConfig:
    name: str = MISSING  # hub id, local folder, or 'demo'; the MODEL argument of `fcsd convert` sets it
    revision: str | None = None  # hub branch, tag or commit sha of `name` (None: main); MODEL@REV sets it
    # weights of the student (master copy): auto = float32 (bf16 compute comes from autocast)
    dtype: str = one_of("auto", MODEL_DTYPES)
    attn_implementation: str | None = None  # e.g. sdpa, flash_attention_2; None = the transformers default
    experts_implementation: str | None = None  # transformers' expert kernels: grouped_mm (default), batched_mm, eager
    trust_remote_code: bool = False
    accelerate_config: str | None = None  # recommended `accelerate launch --config_file` (presets set it)


@dataclass
class ConnectivityConfig:
    # layer spec: all, last:N, first:N, last:50%, 0,3,5-7 (paper Tab. 2 converts the last); on the command line a
    # list needs brackets or quotes (farskip.layers=[0,3] or 'farskip.layers="0,3"'); a list becomes "0,3"
    layers: Any = "all"


@dataclass
class ParallelConfig:
    ep_size: int = 1  # expert parallelism: routed experts sharded over groups of this many processes (1: off)
    # farskip_overlap (the Sec. 4.1 overlapped schedule) | farskip_reference (blocking)
    mode: str = one_of("farskip_overlap", EP_MODES)
    placement: str | None = None  # PLACEMENT.json of `fcsd routes place`: experts permuted before sharding
    # FSDP2 under torchrun: everything but the routed experts sharded over all processes, each expert shard over its
    # world/ep_size replicas; the teacher laid out the same way (fcsd.parallel.layout)
    fsdp: bool = False
    # expert-parallel all-to-all: plain (a row per token and expert) | dedup (per rank) | hierarchical (node-aware: a
    # row per token and destination node across nodes, fanned out inside the node)
    dispatcher: str = one_of("plain", EP_DISPATCHERS)
    node_size: int | None = None  # processes per node (the launcher's LOCAL_WORLD_SIZE if unset): an EP group larger
    # than a node holds whole nodes (ep_size a multiple of it); the node-aware dispatcher's two hops
    # minutes a collective may wait before the job fails: longer than the longest phase the main process runs alone
    # while the others wait in one (MBPP+ scoring, writing best/ or final/ of a model not laid out, pruning old
    # checkpoints); NCCL's own default, 10, is shorter than these on large models
    timeout_minutes: int = DEFAULT_TIMEOUT_MINUTES


@dataclass
class DataConfig:
    path: str | None = None  # local .json/.jsonl/.parquet/.txt file or folder, or a datasets hub name
    split: str = "train"  # split of a hub dataset
    text_field: str = "text"  # plain-text column
    messages_field: str = "messages"  # chat column, rendered with the model's chat template
    max_rows: int | None = None  # read at most this many rows (None: all)
    seq_len: int = 4096  # packed sequence length
    eval_path: str | None = None  # held-out data for the step-0 / final KL; None: hold out rows of `path`
    eval_sequences: int = 16  # held-out sequences scored at step 0, every `train.eval_every` steps and at the end
    cache_dir: str | None = None  # tokenisation cache; None: <user cache>/packed


@dataclass
class TrainConfig:
    # kl (Eq. 4) | sft (Eq. 3) | kl_l2 (Eq. 4 + l2_coef * Eq. 5)
    objective: str = one_of("kl", OBJECTIVES)
    divergence: str = one_of("forward_kl", DIVERGENCES)  # for kl / kl_l2: forward_kl (paper) | reverse_kl | jsd
    temperature: float = 1.0  # softmax temperature of the divergence (loss scaled by T^2)
    jsd_beta: float = 0.5  # mixture weight of the teacher in jsd
    l2_coef: float = 1e-4  # weight of the summed squared hidden-state distance (kl_l2)
    router_aux_coef: float = 0.0  # weight of the model's router load-balancing loss (0: off)
    freeze_embeddings: bool = False  # freeze input embeddings and LM head (paper Tab. 2 'KL embed.')
    lr: float = 2e-5  # peak learning rate (paper: 2e-5 .. 8e-5)
    min_lr_ratio: float = 0.5  # cosine floor as a fraction of lr (paper Tab. 2 anneals 2e-5 to 1e-5)
    warmup_steps: int = 1000  # linear warm-up steps
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0  # max global gradient norm (0: off)
    batch_tokens: int = 65536  # tokens per step, all processes together (paper: 2^16 .. 2^18); one optimizer
    # update each, several in the batch ramp of the guided recipe (recovery.batch_ramp)
    micro_batch_size: int = 1  # at most this many sequences per forward pass and process (the largest size up to
    # it that divides the process's share of the step is used); the rest is gradient accumulation
    max_steps: int | None = None  # stop after this many steps of batch_tokens (None: from max_tokens)
    stop_after: int | None = None  # stop early after N steps, keeping the LR schedule of the whole run (sweep runs)
    max_tokens: int = 10_000_000_000  # token budget (paper: up to 10B); the smaller of the two limits wins
    seed: int = 0  # data order, initialisation of anything random
    mixed_precision: str = one_of("auto", MIXED_PRECISIONS)  # bf16 | fp16 | no; auto = bf16 on GPU, no on CPU
    gradient_checkpointing: bool = False
    # with gradient_checkpointing under parallel.ep_size > 1: the rows each exchange received wait for the backward in
    # pinned host memory instead of on the GPU (what lets Qwen3-30B-A3B's EP layouts fit one node; fcsd plan says)
    checkpoint_offload: bool = False
    loss_chunk_size: int = 256  # tokens per chunk of the fused LM-head + loss (peak memory ~ chunk x vocab)
    save_every: int = 1000  # checkpoint every N steps (0: only at the end)
    keep_checkpoints: int = 2  # how many step checkpoints to keep (0: keep them all)
    resume: bool = False  # continue from the newest checkpoint in output_dir
    resume_step: int | None = None  # with resume: continue from checkpoints/step-N instead of the newest
    # start from the weights of another run's step checkpoint (PATH/checkpoints/step-N, the same model), with this run's
    # own fresh optimizer and LR schedule; recorded in fcsd_config.yaml and final/. --resume continues this run's own.
    init_from: str | None = None
    # held-out KL every N steps besides step 0 and the end (0: only those two); None: automatic, about a tenth of
    # the run for runs of at most SHORT_RUN_STEPS steps (so curves.png has points along them), else 0
    eval_every: int | None = None
    log_every: int = 1  # metrics every N steps
    spike_factor: float = 4.0  # skip an update whose loss exceeds this multiple of the recent median
    spike_window: int = 20  # updates in that median (spike detection starts once it is full); a step is one
    # update, or several in a batch ramp (recovery.batch_ramp)
    max_bad_steps: int = 5  # consecutive skipped updates before the run stops with an error
    # steps in a row whose loss is not finite (all skipped) that stop the run in one line, before it writes final/,
    # an export or a summary: weights that give a NaN loss on that many batches are broken themselves (a damaged
    # checkpoint, a diverged update), and nothing is written from them; 0: only train.max_bad_steps
    max_nonfinite_steps: int = 3


@dataclass
class TeacherConfig:
    # online: teacher forward each step | cache: top-k logits from `fcsd cache-teacher`
    mode: str = one_of("online", TEACHER_MODES)
    # auto = bfloat16 on GPU, float32 on CPU | float32 | bfloat16 | fp8: a block-FP8 source (DeepSeek-V3, Qwen3 -FP8)
    # keeps transformers' FP8 modules (a CUDA GPU of compute capability >= 8.9, the teacher loaded whole, no parallel
    # layout; refused elsewhere); other values dequantize an FP8 source (fcsd.block_fp8)
    dtype: str = one_of("auto", TEACHER_DTYPES)
    cache_dir: str | None = None  # where the teacher cache lives; None: <output_dir>/teacher-cache
    top_k: int = 64  # cached logits per token (the rest of the mass is one bucket)


@dataclass
class EarlyStopConfig:
    enabled: bool = False  # MBPP+ early stopping (paper Sec. 3.1, 5.1); recipes/fcsd.yaml turns it on
    every: int = 1000  # evaluate every N optimizer steps, plus at step 0 and at the end
    patience: int = 20  # stop after this many evaluations in a row without a significant improvement
    min_delta: float = 2.0  # significant = more than this many ABSOLUTE pass@1 points above the last significant one
    # plus: pass@1 on base + extra tests (MBPP+) | base: base tests only
    metric: str = one_of("plus", EARLY_STOP_METRICS)
    limit: int | None = None  # score only the first N problems (by task number) for speed; None: all
    data: str | None = None  # MbppPlus .jsonl file; None: $MBPP_OVERRIDE_PATH, else evalplus downloads it
    max_new_tokens: int = 512  # generation budget per solution (greedy)
    batch_size: int = 16  # prompts per generate call on each process


@dataclass
class SweepConfig:
    batch_tokens: list[int] = field(default_factory=lambda: [65536, 131072, 262144])  # stage 1 (paper Sec. 5.1)
    stage1_lr: float = 2e-5  # the learning rate of stage 1
    lrs: list[float] = field(default_factory=lambda: [2e-5, 4e-5, 8e-5])  # stage 2, at the chosen batch size
    steps: int = 2000  # optimizer steps of every sweep run
    select_last: int = 100  # selection: lowest mean training loss (per token) over the last N steps of a run
    # Hydra launcher: basic (one run after another here) | submitit_slurm | submitit_local
    launcher: str = one_of("basic", SWEEP_LAUNCHERS)
    launcher_overrides: list[str] = field(default_factory=list)  # e.g. [hydra.launcher.partition=gpu]
    # full: sweep runs follow the full run's LR schedule and stop after `steps` | truncated: warm-up and cosine squeezed
    # into `steps` (each sweep run is a complete short run)
    schedule: str = one_of("full", SWEEP_SCHEDULES)
    launch_final: bool = False  # after the sweep, run the full conversion with the chosen settings
    dir: str | None = None  # sweep folder; None: <output_dir>/sweep


@dataclass
class RecoveryConfig:
    """Recovery recipes beyond the paper (design §3): the optimizer, its LR, the hidden-state guide, the batch ramp."""

    name: str = "plain"  # the recipe's name, recorded in the run (recipes/recovery/ presets set it)
    # adamw: AdamW, warm-up, cosine to train.min_lr_ratio (the paper) | schedule_free: schedule-free AdamW (Defazio et
    # al. 2024, the `schedulefree` package), constant LR after the warm-up; the weights scored, saved (final/, best/)
    # and exported are the average its iterates follow, good at every step
    optimizer: str = one_of("adamw", OPTIMIZERS)
    lr_scale: float = 1.0  # the run's peak LR as a multiple of train.lr (the schedule_free preset: 2; guided: 4)
    warmup_share: float | None = None  # warm-up as a share of the run's steps, replacing train.warmup_steps
    hidden_l2: float = 0.0  # weight of the teacher's hidden states as a guide, added to the KL: per token, the mean
    # over layers of ||o_i - t_i||^2 / ||t_i||^2, the student fed its own inputs (paper Eq. 5 made scale-free; the
    # guided preset: 4; 0: off). Turned off, with a note, under teacher.mode=cache and train.objective=sft / kl_l2
    hidden_l2_share: float = 1.0  # the guide's weight falls linearly from hidden_l2 to 0 over this share of the run's
    # steps, then the run is KL alone (the guided preset: 0.5; early the guide speeds recovery, late it holds the
    # student to states the KL would leave)
    batch_ramp: list[int] = field(default_factory=list)  # batch-size ramp: in the run's first steps, each step's
    # train.batch_tokens are split into this many optimizer updates, stage by stage (the guided preset: [4, 2]), each
    # at the step's LR x 1/sqrt(split) (Adam's square-root rule); a split is lowered to one the step's rows per
    # process divide, with a note
    batch_ramp_shares: list[float] = field(default_factory=list)  # share of the run's steps for each ramp stage


@dataclass
class FCSDConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    farskip: ConnectivityConfig = field(default_factory=ConnectivityConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    output_dir: str = "outputs/fcsd"
    export_dir: str | None = None  # `fcsd export` of final/ at the end of the run; None: <output_dir>/export
    export: bool = True  # run that export (remote code, reload-parity check)
    # source: a block-FP8 source's own FP8 format (else its dtype) | bf16
    export_format: str = one_of("source", EXPORT_FORMATS)
    # a multimodal source (Llama-4 Scout): true exports the trained text model alone, without its vision tower
    export_text_only: bool = False
    push_to_hub: str | None = None  # hub repository to push the export to at the end (needs a token)
    overwrite: bool = False  # allow a non-empty output_dir that is not a run to resume
    progress: bool = True  # progress bars


def check_choices(config, prefix: str = "") -> None:
    """Every setting declared with :func:`one_of` holds one of its choices, else one line naming them."""
    for item in fields(config):
        value = getattr(config, item.name)
        if is_dataclass(value):
            check_choices(value, f"{prefix}{item.name}.")
        elif "choices" in item.metadata and value not in item.metadata["choices"]:
            raise ValueError(f"{prefix}{item.name}={value!r}: choose one of {', '.join(item.metadata['choices'])}")


def unknown_keys(cfg, schema, prefix: str = "") -> list[str]:
    """Keys of ``cfg`` that ``schema`` (a dataclass) does not declare, dotted; Hydra's ``+key=value`` adds them to
    a structured config without complaint, and ``to_object`` would then drop them silently."""
    from omegaconf import DictConfig

    if not isinstance(cfg, DictConfig):
        return []
    defaults = schema()
    found = []
    for key in cfg.keys():
        if not hasattr(defaults, str(key)):
            found.append(f"{prefix}{key}")
        elif is_dataclass(getattr(defaults, key)):
            found += unknown_keys(cfg[key], type(getattr(defaults, key)), f"{prefix}{key}.")
    return found


def _layer_spec(spec):
    """``farskip.layers`` as one spec string (a list becomes ``"0,3"``); an empty selection is refused now, before
    any model loads (it would train a whole run whose export then fails)."""
    from fcsd.connectivity.layer_spec import GRAMMAR, EmptySelectionError, parse_layer_spec

    if isinstance(spec, list | tuple):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in spec):
            raise ValueError(f"farskip.layers={spec!r}: a list must hold layer numbers; {GRAMMAR}")
        spec = ",".join(str(i) for i in spec)
    if not isinstance(spec, str):
        spec = str(spec)
    try:
        selected = parse_layer_spec(spec, 10_000)  # the syntax and emptiness; the model's layer count comes later
    except EmptySelectionError:
        return spec  # a percentage too small even for 10,000 layers: refused against the model's own count
    except ValueError as error:
        if "names layer" in str(error) or "asks for" in str(error):
            return spec
        raise ValueError(f"farskip.layers={spec!r}: {error}") from None
    if not selected:
        raise ValueError(
            f"farskip.layers={spec!r} selects no layer, so there is nothing to convert; choose e.g. farskip.layers=all "
            "or farskip.layers=last:50%"
        )
    return spec


SHORT_RUN_STEPS = 2000  # runs up to this long evaluate the held-out KL about ten times by default


def auto_eval_every(train: TrainConfig) -> int:
    """``train.eval_every`` when set, else about a tenth of a short run (at most :data:`SHORT_RUN_STEPS` steps,
    ``train.stop_after`` included) and 0 (step 0 and the end only) for longer ones."""
    if train.eval_every is not None:
        return train.eval_every
    steps = end_step(train)
    return max(1, steps // 10) if 1 < steps <= SHORT_RUN_STEPS else 0


# path settings: ``~`` is expanded in each, once, so that the checks and the writes see the same folder
PATH_KEYS = (
    ("model", "name"),
    ("model", "accelerate_config"),
    ("parallel", "placement"),
    ("data", "path"),
    ("data", "eval_path"),
    ("data", "cache_dir"),
    ("teacher", "cache_dir"),
    ("early_stop", "data"),
    ("train", "init_from"),
    ("sweep", "dir"),
    (None, "output_dir"),
    (None, "export_dir"),
)


def _expand_paths(config: FCSDConfig) -> None:
    for section, key in PATH_KEYS:
        holder = getattr(config, section) if section else config
        value = getattr(holder, key)
        if isinstance(value, str) and value.startswith("~"):
            setattr(holder, key, os.path.expanduser(value))


def hydra_override(key: str, value) -> str:
    """``key=value`` for Hydra's override parser, the value quoted when it needs it, so that any path survives the
    parser (spaces, non-ASCII letters, ``=``, ``~``, commas, quotes)."""
    import re

    if re.fullmatch(r"[A-Za-z0-9_./:@+-]+", str(value)) and not str(value)[0].isdigit():
        return f"{key}={value}"  # plain: as a person would type it
    # in a quoted Hydra value a backslash escapes only a quote or the backslashes before one (or before the end)
    text = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", str(value))
    text = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text)
    return f"{key}='{text}'"


def register_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="fcsd_schema", node=FCSDConfig)


def recipes_dir() -> Path:
    """``$FCSD_RECIPES``, else the recipes shipped in the package (:mod:`fcsd.recipe_files`: a checkout's
    ``recipes/`` folder, or ``fcsd/recipes/`` of an installed fcsd)."""
    from fcsd.recipe_files import recipes_dir as found

    return found()


def presets() -> dict[str, str]:
    """Model preset name -> the ``model.name`` it sets (``recipes/model/*.yaml``)."""
    from omegaconf import OmegaConf

    found = {}
    for path in sorted((recipes_dir() / "model").glob("*.yaml")):
        found[path.stem] = OmegaConf.select(OmegaConf.load(path), "model.name")
    return found


def preset_for(model_name: str | None) -> str | None:
    """The preset whose ``model.name`` is ``model_name`` (so a hub id picks its preset by itself), else None."""
    return next((preset for preset, name in presets().items() if name == model_name), None)


def check_overrides(overrides: list[str]) -> None:
    """Refuse, naming it and how to quote it, the first override Hydra's grammar cannot read (Hydra's own message
    names neither the override nor the fix)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except OverrideParseException:
            key, _, value = override.partition("=")
            raise ValueError(
                f"{override}: this value cannot be read as it is written; quote it, e.g. '{key}=\"{value}\"'"
            ) from None


def compose(overrides: list[str], recipe: str = "fcsd"):
    """The resolved ``DictConfig`` of ``recipes/<recipe>.yaml`` with ``overrides`` applied; a setting fcsd removed,
    named by an override or a recipe file, is refused in one line (:func:`fcsd.removed_settings.check_removed`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    register_schemas()
    check_overrides(overrides)
    check_removed(overrides)
    folder = recipes_dir()
    if not (folder / f"{recipe}.yaml").exists():
        raise FileNotFoundError(f"recipe {recipe}.yaml not found in {folder}; set FCSD_RECIPES to the recipes folder")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(folder), version_base="1.3"):
        try:
            return hydra_compose(config_name=recipe, overrides=list(overrides))
        except HydraException as error:  # a recipe file naming a removed key: refused as an override naming it
            check_removed([getattr(error.__cause__ or error.__context__, "full_key", "")])
            raise


def cache_refusal(train: TrainConfig) -> str | None:
    """Why the teacher cache (top-k log-probabilities of the forward KL) cannot serve ``train``'s loss, or None
    (design §3); ``fcsd convert`` refuses such a run and ``fcsd plan`` does not offer it."""
    if train.objective != "kl":
        return (
            f"teacher.mode=cache holds logits only: it works with train.objective=kl, not "
            f"train.objective={train.objective} (use teacher.mode=online)"
        )
    if train.divergence != "forward_kl":
        return (
            f"teacher.mode=cache trains the top-k forward KL only; train.divergence={train.divergence} needs the "
            "full teacher distribution: use teacher.mode=online, or train.divergence=forward_kl"
        )
    return None


def check_recovery(config: FCSDConfig) -> None:
    """Refuse, in one line naming the fix, a recovery recipe the run cannot follow (design §3)."""
    _check_optimizer(config)
    _check_guide(config)
    _check_batch_ramp(config)
    horizon = schedule_steps(config.train)
    if warmup_steps(config) > horizon:  # only train.warmup_steps can be: a valid share of the run always fits it
        raise ValueError(
            f"train.warmup_steps={config.train.warmup_steps} is longer than the run ({horizon} steps): the LR would "
            f"never reach train.lr; set train.warmup_steps below {horizon}"
        )


def _check_optimizer(config: FCSDConfig) -> None:
    recovery = config.recovery
    if not (math.isfinite(recovery.lr_scale) and recovery.lr_scale > 0):
        raise ValueError(f"recovery.lr_scale={recovery.lr_scale}: it must be a finite number > 0")
    share = recovery.warmup_share
    if share is not None and not 0 <= share < 1:
        raise ValueError(f"recovery.warmup_share={share}: it must lie in [0, 1) (null: train.warmup_steps)")


def _check_guide(config: FCSDConfig) -> None:
    weight = config.recovery.hidden_l2
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"recovery.hidden_l2={weight}: it must be a finite number >= 0 (0: off)")
    share = config.recovery.hidden_l2_share
    if not 0 < share <= 1:
        raise ValueError(f"recovery.hidden_l2_share={share}: it must lie in (0, 1] (1: the guide fades over the run)")


def _check_batch_ramp(config: FCSDConfig) -> None:
    recovery = config.recovery
    splits, shares = list(recovery.batch_ramp), list(recovery.batch_ramp_shares)
    if not splits and not shares:
        return
    fit = len(shares) == len(splits) and all(0 < x < 1 for x in shares) and sum(shares) < 1
    if not fit or not all(isinstance(k, int) and k >= 2 for k in splits):
        raise ValueError(
            f"recovery.batch_ramp={splits} needs whole splits >= 2, each with a share in (0, 1) in "
            f"recovery.batch_ramp_shares (now {shares}) summing below 1; to turn the ramp off set both: "
            "recovery.batch_ramp=[] recovery.batch_ramp_shares=[]"
        )


def update_split(config: FCSDConfig, step: int) -> int:
    """How many optimizer updates share step ``step`` (0-based): the split of the ramp stage it falls in, else 1."""
    return next((split for start, end, split in ramp_stages(config) if start <= step < end), 1)


def resolve_guide(config: FCSDConfig) -> str | None:
    """Turn the guided recipe's hidden-state term off where it cannot apply, and say why (None: it applies or is
    off already): the teacher cache holds no hidden states, and the guide belongs to the KL objective. The run then
    trains its recipe's optimizer without the guide, and its config records ``recovery.hidden_l2=0``."""
    if config.recovery.hidden_l2 <= 0:
        return None
    if config.teacher.mode == "cache":
        why = "teacher.mode=cache holds no hidden states"
    elif config.train.objective != "kl":
        why = f"the guide adds to the KL objective, not to train.objective={config.train.objective}"
    else:
        return None
    config.recovery.hidden_l2 = 0.0
    return f"recovery.hidden_l2 set to 0 (the {config.recovery.name} recipe without its hidden-state guide): {why}"


def guide_weight(config: FCSDConfig, step: int) -> float:
    """The guided recipe's hidden-state weight at optimizer step ``step`` (0-based): ``recovery.hidden_l2`` falling
    linearly to 0 at ``recovery.hidden_l2_share`` of the run's steps, 0 after."""
    fade = config.recovery.hidden_l2_share * schedule_steps(config.train)
    return config.recovery.hidden_l2 * max(0.0, 1.0 - step / fade)


def peak_lr(config: FCSDConfig) -> float:
    """The run's peak LR (the LR rule of docs/recovery.md): ``train.lr``, the plain recipe's AdamW LR for the
    model (the paper's 2e-5 for its models, a model preset's, or the user's), times the recipe's
    ``recovery.lr_scale`` (the guided default: 4; on the fair recovery benchmark's four teachers guided did best at
    4x plain's best LR, or within 1% of its best there)."""
    return config.train.lr * config.recovery.lr_scale


def process_group_timeout(minutes: int = DEFAULT_TIMEOUT_MINUTES):
    """``parallel.timeout_minutes`` as the ``timeout`` of ``init_process_group`` (a ``timedelta``)."""
    from datetime import timedelta

    return timedelta(minutes=minutes)


def to_config(cfg, resolve: bool = True) -> FCSDConfig:
    """The typed config object, after checking the values the schema cannot express; with ``resolve``, the guide
    turned off (with a note) where the config's teacher mode or objective cannot serve it (:func:`resolve_guide`;
    ``fcsd plan`` resolves it per candidate layout instead, whose teacher mode it chooses)."""
    from omegaconf import OmegaConf

    unknown = unknown_keys(cfg, FCSDConfig)
    if unknown:
        raise ValueError(
            f"unknown config key(s) {', '.join(unknown)} (a '+' does not add keys to the schema): check the spelling; "
            "`fcsd convert MODEL --cfg job` prints every key"
        )
    config: FCSDConfig = OmegaConf.to_object(cfg)
    check_choices(config)
    config.farskip.layers = _layer_spec(config.farskip.layers)
    _expand_paths(config)
    train = config.train
    for name in ("lr", "temperature", "l2_coef", "weight_decay", "grad_clip", "router_aux_coef", "spike_factor"):
        value = getattr(train, name)
        if not math.isfinite(value):
            raise ValueError(f"train.{name}={value}: it must be a finite number")
    checks = [
        (config.teacher.top_k >= 1, f"teacher.top_k={config.teacher.top_k}: the cache keeps at least 1 (e.g. 64)"),
        (config.teacher.mode == "online" or cache_refusal(train) is None, cache_refusal(train)),
        (train.lr > 0, f"train.lr={train.lr}: it must be > 0 (e.g. train.lr=2e-5)"),
        (0 <= train.min_lr_ratio <= 1, f"train.min_lr_ratio={train.min_lr_ratio}: it must lie in [0, 1]"),
        (train.batch_tokens > 0, f"train.batch_tokens={train.batch_tokens}: it must be > 0"),
        (train.micro_batch_size > 0, f"train.micro_batch_size={train.micro_batch_size}: it must be > 0"),
        (
            train.max_nonfinite_steps >= 0,
            f"train.max_nonfinite_steps={train.max_nonfinite_steps}: it must be >= 0 (0: only train.max_bad_steps)",
        ),
        (
            config.data.seq_len > 1,
            f"data.seq_len={config.data.seq_len}: a sequence needs at least 2 tokens (a token and the next one it "
            "predicts); e.g. data.seq_len=2048",
        ),
        (train.max_steps is None or train.max_steps > 0, f"train.max_steps={train.max_steps}: it must be > 0"),
        (train.temperature > 0, f"train.temperature={train.temperature}: it must be > 0"),
        (0 < train.jsd_beta < 1, f"train.jsd_beta={train.jsd_beta}: it must lie strictly between 0 and 1"),
        (config.parallel.ep_size >= 1, f"parallel.ep_size={config.parallel.ep_size}: it must be at least 1"),
        (
            not train.checkpoint_offload or (train.gradient_checkpointing and config.parallel.ep_size > 1),
            "train.checkpoint_offload keeps the rows of checkpointed expert-parallel exchanges in host memory: it "
            "needs train.gradient_checkpointing=true and parallel.ep_size > 1",
        ),
        (
            config.parallel.node_size is None or config.parallel.node_size >= 1,
            f"parallel.node_size={config.parallel.node_size}: it must be at least 1 (processes per node), or unset "
            "to take the launcher's LOCAL_WORLD_SIZE",
        ),
        (
            config.parallel.placement is None or config.parallel.ep_size > 1,
            f"parallel.placement={config.parallel.placement} places experts on expert-parallel processes, but "
            "parallel.ep_size=1 has none, so it would be ignored: set parallel.ep_size (dividing the expert count), "
            "or drop parallel.placement",
        ),
        (
            train.resume_step is None or train.resume,
            f"train.resume_step={train.resume_step} chooses the checkpoint --resume continues from: add --resume",
        ),
        (
            config.parallel.timeout_minutes >= 1,
            f"parallel.timeout_minutes={config.parallel.timeout_minutes}: a collective needs at least 1 minute to "
            f"wait (default {DEFAULT_TIMEOUT_MINUTES})",
        ),
        (
            train.mixed_precision != "fp16" or (config.parallel.ep_size == 1 and not config.parallel.fsdp),
            "train.mixed_precision=fp16 needs a loss scaler, which parallel.ep_size / parallel.fsdp runs do not use: "
            "use bf16",
        ),
        (config.data.path is not None, "data.path is required: a local data file or folder, or a datasets name"),
        (config.train.batch_tokens >= config.data.seq_len, "train.batch_tokens must be at least data.seq_len"),
        (config.early_stop.every > 0, "early_stop.every must be a positive number of steps"),
        (train.save_every >= 0, f"train.save_every={train.save_every}: give a number of steps (0: only at the end)"),
        (
            train.keep_checkpoints >= 0,
            f"train.keep_checkpoints={train.keep_checkpoints}: give how many to keep (0: keep them all)",
        ),
        (config.early_stop.patience > 0, "early_stop.patience must be at least 1 evaluation"),
        (config.export or not config.push_to_hub, "push_to_hub pushes the export: it needs export=true"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    check_recovery(config)
    note = resolve_guide(config) if resolve else None
    if note and os.environ.get("RANK", "0") == "0":  # once per launch, not once per process
        print(f"note: {note}", file=sys.stderr)
    if train.eval_every is not None and train.eval_every < 0:
        raise ValueError(f"train.eval_every={train.eval_every}: it must be >= 0 (0: held-out KL at step 0 and the end)")
    train.eval_every = auto_eval_every(train)
    return config
