"""The paper's two-stage batch-size / learning-rate sweep (Sec. 5.1) on Hydra multirun.

Stage 1 trains ``sweep.batch_tokens`` at ``sweep.stage1_lr``, stage 2 ``sweep.lrs`` at the chosen batch size (the
stage-1 run stands in for the stage-1 LR), each run ``sweep.steps`` steps; the selection is the lowest mean training
loss over the last ``sweep.select_last`` steps (the loss is per token, so it compares across batch sizes). Each stage
is one ``--multirun`` of :mod:`fcsd.distill.sweep_app` with the configured Hydra launcher (basic: one run after
another here; submitit: one cluster job per run). A run that finished (``run_summary.json``) or crashed
(``sweep_status.json``) is not run again on a restart; a run that was killed resumes from its last checkpoint. With
``teacher.mode=cache`` all runs read one teacher cache, built once before stage 1.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import shlex
import sys
from pathlib import Path

from fcsd.distill.config import FCSDConfig, hydra_override
from fcsd.distill.preflight import run_inputs
from fcsd.files import ownership
from fcsd.files.run_folder import RunFolder
from fcsd.recipe_files import recipe_file
from fcsd.stopping import run_child


def sweep_dir(config: FCSDConfig) -> Path:
    return Path(config.sweep.dir or Path(config.output_dir) / "sweep")


def run_name(batch_tokens: int, lr: float) -> str:
    return f"bt{batch_tokens}-lr{lr:g}"


def job_overrides(run_dir: Path, steps: int, schedule: str = "full") -> list[str]:
    """What makes a run a sweep run: ``steps`` steps into ``run_dir``, resumed when ``run_dir`` holds a started run
    (a sweep that was stopped), no early stopping, export or push.

    ``schedule="full"`` (the default) keeps the LR schedule of the full run (its warm-up and cosine over the whole
    token budget) and stops after ``steps``, so batch size and LR are chosen under the schedule they will train
    with; ``"truncated"`` squeezes warm-up and cosine into ``steps`` (each sweep run a complete short run)."""
    settings = ["export=false", "early_stop.enabled=false", "push_to_hub=null"]
    if RunFolder(run_dir).config.exists():
        settings.insert(0, "train.resume=true")
    length = f"train.stop_after={steps}" if schedule == "full" else f"train.max_steps={steps}"
    return [hydra_override("output_dir", run_dir), length, *settings]


def run_job(config: FCSDConfig, run_dir: Path, overrides: list[str]) -> str:
    """One sweep run (the Hydra task function's body): ``config`` and ``overrides`` both already hold
    :func:`job_overrides`. Returns its status; exceptions are recorded, not raised, so the other runs go on."""
    import torch

    run = RunFolder(run_dir)
    if run.summary.exists():
        print(f"sweep: {run_dir.name} finished earlier, not run again")
        return "finished"
    if run.sweep_status.exists():
        print(f"sweep: {run_dir.name} crashed earlier, not run again (delete {run.sweep_status} to retry)")
        return "crashed"
    try:
        if config.model.accelerate_config and torch.cuda.device_count() > 1:
            launch = recipe_file(config.model.accelerate_config)
            command = ["accelerate", "launch", "--config_file", launch, "-m", "fcsd.cli"]
            run_child([*command, "convert", *overrides])
        else:
            from fcsd.distill.convert import convert

            convert(config)
        return "finished"
    except Exception as error:  # noqa: BLE001 - any failure of one run is that run's result
        ownership.mark(run_dir, "run")
        run.sweep_status.write_text(json.dumps({"status": "crashed", "error": f"{type(error).__name__}: {error}"}))
        ownership.record(run.sweep_status)
        print(f"sweep: {run_dir.name} crashed: {error}", file=sys.stderr)
        return "crashed"


def launch_stage(overrides: list[str], stage_dir: Path, batch_tokens: list[int], lrs: list[float], sweep) -> None:
    """One Hydra multirun over ``batch_tokens`` x ``lrs`` into ``stage_dir/bt<B>-lr<LR>/``."""
    grid = [f"train.batch_tokens={','.join(map(str, batch_tokens))}", f"train.lr={','.join(map(repr, lrs))}"]
    command = [sys.executable, "-m", "fcsd.distill.sweep_app", "--multirun", *overrides, *grid]
    command += [f"hydra.sweep.dir={stage_dir}", "hydra.sweep.subdir=.hydra-jobs/${hydra.job.num}"]
    command += [f"hydra/launcher={sweep.launcher}", *sweep.launcher_overrides]
    run_child(command)


def read_run(run_dir: Path, select_last: int) -> dict:
    """Status, loss curve and selection loss of one run folder. The loss is the divergence (``train/kl`` where the
    guided recipe logs it beside its hidden-state guide, whose weight fades at each run's own pace), so runs of
    other batch sizes compare on the same quantity."""
    run = RunFolder(run_dir)
    records = [r for r in run.records() if "train/loss" in r and not r.get("train/skipped")]
    curve = [(r["step"], r.get("train/kl", r["train/loss"])) for r in records]
    status = "finished" if run.summary.exists() else "crashed" if run.sweep_status.exists() else "missing"
    tail = [loss for _, loss in curve[-select_last:]]
    loss = sum(tail) / len(tail) if status == "finished" and tail else None
    error = json.loads(run.sweep_status.read_text())["error"] if status == "crashed" else None
    return {"status": status, "loss": loss, "steps": len(curve), "curve": curve, "error": error}


def stage_results(stage_dir: Path, stage: int, pairs: list[tuple[int, float]], select_last: int) -> list[dict]:
    rows = []
    for batch_tokens, lr in pairs:
        folder = stage_dir / run_name(batch_tokens, lr)
        run = read_run(folder, select_last)
        rows.append(
            {"stage": stage, "batch_tokens": batch_tokens, "lr": lr, **run, "run": f"{stage_dir.name}/{folder.name}"}
        )
    return rows


def choose(rows: list[dict], stage: int) -> dict:
    finished = [row for row in rows if row["loss"] is not None]
    if not finished:
        errors = "; ".join(f"{run_name(r['batch_tokens'], r['lr'])}: {r['error'] or r['status']}" for r in rows)
        raise RuntimeError(f"sweep stage {stage}: no run finished ({errors})")
    return min(finished, key=lambda row: row["loss"])


def run_sweep(config: FCSDConfig, overrides: list[str]) -> dict:
    """``fcsd sweep``: both stages, then the table (markdown + CSV), the loss-curve PNG and ``selection.json`` in the
    sweep folder; returns the selection."""
    sweep, root = config.sweep, sweep_dir(config)
    check_sweep_values(config)
    overrides = [o for o in overrides if not o.startswith(("output_dir=", "train.resume="))]
    if sweep.launcher != "basic":
        _check_launcher(sweep.launcher)
    ownership.check_not_an_input(root, "sweep.dir", run_inputs(config), "sweep")
    ownership.check_not_in_use(root, "sweep.dir")
    check_sweep_home(config)
    marker = ownership.read_marker(root)
    if not ownership.is_empty(root) and (marker is None or not marker.is_kind("sweep")):
        ownership.check_replaceable(root, "sweep", "sweep.dir", "choose another output_dir (or sweep.dir)")
    with ownership.folder_lock(root, "sweep.dir"):  # one sweep per folder; its runs lock their own folders
        ownership.mark(root, "sweep")
        ownership.remove_stale_staging(root)
        return _run_stages(config, overrides, root)


def check_sweep_values(config: FCSDConfig) -> None:
    """The grid and the selection window, checked before the first run (a bad stage-2 LR surfaced after stage 1)."""
    sweep, seq_len = config.sweep, config.data.seq_len
    sizes = list(sweep.batch_tokens)  # a size the run refuses (not whole sequences) is a crashed run of the table
    if not sizes or any(b < 1 for b in sizes):
        raise ValueError(
            f"sweep.batch_tokens={sizes}: give one or more step sizes in tokens, e.g. sweep.batch_tokens="
            f"[{seq_len * 16},{seq_len * 32}]"
        )
    lrs = [sweep.stage1_lr, *sweep.lrs]
    if not sweep.lrs or not all(math.isfinite(lr) and lr > 0 for lr in lrs):
        raise ValueError(
            f"sweep.stage1_lr={sweep.stage1_lr} sweep.lrs={list(sweep.lrs)}: learning rates are finite numbers > 0, "
            "and stage 2 needs at least one, e.g. sweep.lrs=[2e-5,4e-5,8e-5]"
        )
    if not 1 <= sweep.select_last <= sweep.steps:
        raise ValueError(
            f"sweep.steps={sweep.steps} sweep.select_last={sweep.select_last}: a run needs at least one step and the "
            "selection averages the last select_last of them (1 <= select_last <= steps)"
        )


def check_sweep_home(config: FCSDConfig) -> None:
    """The folder around the sweep (``output_dir``, which holds ``sweep/`` and the final run's ``fcsd/``) must not
    be an fcsd folder of any kind: a sweep nested in a run folder would be files the run did not write."""
    home = Path(config.output_dir)
    marker = ownership.read_marker(home)
    if config.sweep.dir is None and marker is not None:
        raise ownership.FolderError(
            f"output_dir {home} is {marker.description()}; a sweep writes its runs to OUTPUT_DIR/sweep/ and the "
            "final conversion to OUTPUT_DIR/fcsd/, so it needs a folder of its own: choose another output_dir (or "
            "set sweep.dir)"
        )


def _run_stages(config: FCSDConfig, overrides: list[str], root: Path) -> dict:
    sweep = config.sweep
    if config.teacher.mode == "cache":
        from fcsd.distill.teacher_cache import cache_teacher

        cache = config.teacher.cache_dir or str(root / "teacher-cache")
        overrides.append(hydra_override("teacher.cache_dir", cache))
        teacher = dataclasses.replace(config.teacher, cache_dir=cache)
        if not (Path(cache) / "meta.json").exists():
            cache_teacher(dataclasses.replace(config, teacher=teacher))
    first = [(b, sweep.stage1_lr) for b in sweep.batch_tokens]
    launch_stage(overrides, root / "stage1", sweep.batch_tokens, [sweep.stage1_lr], sweep)
    rows = stage_results(root / "stage1", 1, first, sweep.select_last)
    winner = choose(rows, 1)
    batch_tokens = winner["batch_tokens"]
    new_lrs = [lr for lr in sweep.lrs if lr != sweep.stage1_lr]  # the stage-1 LR at this batch size already ran
    if new_lrs:
        launch_stage(overrides, root / "stage2", [batch_tokens], new_lrs, sweep)
    second = stage_results(root / "stage2", 2, [(batch_tokens, lr) for lr in new_lrs], sweep.select_last)
    if sweep.stage1_lr in sweep.lrs:
        second.insert(sweep.lrs.index(sweep.stage1_lr), {**winner, "stage": 2})
    rows += second
    best = choose(second, 2)
    selection = {"batch_tokens": best["batch_tokens"], "lr": best["lr"], "loss": best["loss"]}
    selection["lr_scale"] = config.recovery.lr_scale  # the LR rule: the run's peak is train.lr x the recipe's multiple
    selection["peak_lr"] = best["lr"] * config.recovery.lr_scale
    selection["command"] = final_command(config, overrides, selection)
    selection["notes"] = grid_edges(sweep, selection, config.data.seq_len)
    write_outputs(root, rows, selection, sweep.select_last)
    if sweep.launch_final:
        launch_final(config, overrides, selection)
    return selection


def grid_edges(sweep, selection: dict, seq_len: int) -> list[str]:
    """One line per swept value chosen at the top or bottom of its grid (of two values or more): the best may lie
    beyond it, and the grid of the next sweep, stepped as the grid's own neighbours there (batch sizes whole
    sequences)."""
    notes = []
    grids = (
        ("batch size", "sweep.batch_tokens", sorted(set(sweep.batch_tokens)), selection["batch_tokens"]),
        ("LR", "sweep.lrs", sorted(set(sweep.lrs)), selection["lr"]),
    )
    for what, key, grid, chosen in grids:
        if len(grid) < 2 or chosen not in (grid[0], grid[-1]):
            continue
        top = chosen == grid[-1]
        step = grid[-1] / grid[-2] if top else grid[1] / grid[0]
        step = step if step >= 1.5 else 2.0
        beyond = [chosen * step, chosen * step * step] if top else [chosen / step / step, chosen / step]
        if key == "sweep.batch_tokens":
            beyond = [max(seq_len, round(value / seq_len) * seq_len) for value in beyond]
        values = sorted({*beyond, chosen})
        if len(values) < 2:
            notes.append(f"the chosen {what} {chosen:g} is the smallest of {key}, one sequence: none is smaller")
            continue
        shown = ",".join(f"{value:g}" for value in values)
        notes.append(
            f"the chosen {what} {chosen:g} is the {'largest' if top else 'smallest'} of {key}: the best may lie "
            f"{'above' if top else 'below'} it; sweep again with {key}=[{shown}]"
        )
    return notes


def final_command(config: FCSDConfig, overrides: list[str], selection: dict) -> str:
    """The full conversion with the chosen settings (accelerate launch when the preset names a config)."""
    chosen = [f"train.batch_tokens={selection['batch_tokens']}", f"train.lr={selection['lr']:g}"]
    kept = [o for o in overrides if not o.startswith(("sweep", "train.batch_tokens=", "train.lr="))]
    kept.append(hydra_override("output_dir", Path(config.output_dir) / "fcsd"))  # beside the sweep/ folder
    launcher = "fcsd"
    if config.model.accelerate_config:
        launch = shlex.quote(recipe_file(config.model.accelerate_config))  # the shipped one outside a checkout
        launcher = f"fcsd launch accelerate launch --config_file {launch} -m fcsd.cli"  # one voice (fcsd.cli.launch)
    return " ".join([launcher, "convert", *(shlex.quote(arg) for arg in [*kept, *chosen])])


def launch_final(config: FCSDConfig, overrides: list[str], selection: dict) -> None:
    command = shlex.split(final_command(config, overrides, selection))
    if command[0] == "fcsd":
        command = [sys.executable, "-m", "fcsd.cli", *command[1:]]
    print("sweep: launching the full conversion:", " ".join(command))
    run_child(command)


def write_outputs(root: Path, rows: list[dict], selection: dict, select_last: int) -> None:
    columns = ["stage", "batch_tokens", "lr", "status", "steps", "loss", "run"]
    with open(root / "sweep.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"Training loss per token, mean of the last {select_last} steps; lowest per stage is chosen (**bold**).",
        "",
        "| stage | batch tokens | LR | status | steps | loss | run |",
        "|---:|---:|---:|---|---:|---:|---|",
    ]
    for row in rows:
        chosen = (row["batch_tokens"], row["lr"]) == (selection["batch_tokens"], selection["lr"]) or (
            row["stage"] == 1 and row["batch_tokens"] == selection["batch_tokens"]
        )
        loss = "" if row["loss"] is None else f"{row['loss']:.5g}"
        if chosen and loss:
            loss = f"**{loss}**"
        lines.append(f"| {row['stage']} | {row['batch_tokens']:,} | {row['lr']:g} | {row['status']} | {row['steps']} "
                     f"| {loss} | `{row['run']}` |")  # fmt: skip
    lines += ["", f"Chosen: batch {selection['batch_tokens']:,} tokens, LR {selection['lr']:g} (train.lr; the run's "
              f"peak LR {selection['peak_lr']:g}, the recipe's recovery.lr_scale {selection['lr_scale']:g} times it).",
              *(f"Note: {note}." for note in selection.get("notes", ())),
              "",
              f"Full conversion: `{selection['command']}`"]  # fmt: skip
    (root / "sweep_table.md").write_text("\n".join(lines) + "\n")
    (root / "selection.json").write_text(json.dumps(selection, indent=2))
    plot_sweep(rows, root / "sweep_losses.png")
    for name in ("sweep.csv", "sweep_table.md", "selection.json", "sweep_losses.png", "stage1", "stage2"):
        ownership.record(root / name)


def plot_sweep(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for stage, axis in zip((1, 2), axes, strict=True):
        for row in (r for r in rows if r["stage"] == stage and r["curve"]):
            steps, loss = zip(*row["curve"], strict=True)
            axis.plot(steps, loss, label=f"batch {row['batch_tokens']:,}, LR {row['lr']:g}")
        axis.set_title(f"stage {stage}: " + ("batch size" if stage == 1 else "learning rate"))
        axis.set_xlabel("step")
        axis.set_yscale("log")
        axis.legend()
    axes[0].set_ylabel("training loss per token")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _check_launcher(name: str) -> None:
    try:
        import hydra_plugins.hydra_submitit_launcher  # noqa: F401
    except ImportError:
        raise ValueError(
            f"sweep.launcher={name} needs Hydra's submitit launcher: pip install 'fcsd[slurm]' "
            "(hydra-submitit-launcher), or sweep.launcher=basic"
        ) from None
