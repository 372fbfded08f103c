"""The model card (``README.md``) of an exported checkpoint: hub metadata, what was converted and how, the
evaluation table when one exists, how to load it, and the paper to cite."""

from __future__ import annotations

import json
from pathlib import Path

from fcsd.serving.served_families import serve_command
from fcsd.sources import display_name, hub_id

CITATION = """@article{farskip2025,
  title   = {FarSkip-Collective: Unhobbling Blocking Communication in Mixture of Experts Models},
  journal = {arXiv preprint arXiv:2511.11505},
  year    = {2025}
}"""
LOAD_HEADING = "## How to load"


def run_config(checkpoint: Path) -> dict | None:
    """The saved config of the run that produced ``checkpoint`` (the checkpoint's own copy first), None when there is
    none; a run that used a setting fcsd removed is refused in one line (:func:`fcsd.removed_settings.check_removed`).
    Every reader of a run's config for its card goes through here, so the refusal comes before any weights load."""
    from omegaconf import OmegaConf

    from fcsd.files.run_folder import CONFIG, RunFolder
    from fcsd.removed_settings import check_removed

    run = RunFolder.of_checkpoint(checkpoint)
    path = next((p for p in (Path(checkpoint) / CONFIG, run.config) if p.exists()), None)
    if path is None:
        return None
    config = OmegaConf.to_container(OmegaConf.load(path))
    check_removed(config, saved_in=run.root)
    return config


def read_run_facts(checkpoint: Path) -> dict:
    """What the run that produced ``checkpoint`` (a run's ``final/``, ``best/`` or step checkpoint) recorded: its
    config (:func:`run_config`), summary (a step checkpoint's: its step), last training loss and evaluation table."""
    from fcsd.files.run_folder import RunFolder, is_step_checkpoint

    facts: dict = {}
    run = RunFolder.of_checkpoint(checkpoint)
    config = run_config(checkpoint)
    if config is not None:
        facts["config"] = config
    step = run.trainer_state(Path(checkpoint)).get("step") if is_step_checkpoint(checkpoint) else None
    if step is not None:
        facts["summary"] = {"steps": step}
    elif run.summary.exists():
        facts["summary"] = json.loads(run.summary.read_text())
    losses = [r["train/loss"] for r in run.records() if "train/loss" in r and (step is None or r["step"] <= step)]
    if losses:
        facts["final_train_loss"] = losses[-1]
    if run.eval_table.exists():
        facts["eval_table"] = run.eval_table.read_text().strip()
    return facts


def refresh_card(run) -> None:
    """Re-render the model card of ``run.export`` (a :class:`~fcsd.files.run_folder.RunFolder`) from the run's current
    facts (``fcsd eval`` of a run adds its table)."""

    config = json.loads((run.export / "config.json").read_text())
    text_config = config.get("text_config") or {}
    num_layers = config.get("num_hidden_layers") or text_config.get("num_hidden_layers")
    record = run.export / "fcsd_export.json"  # fcsd.export.save.PARITY_RECORD
    fp8 = json.loads(record.read_text()).get("fp8") if record.exists() else None
    card = render_card(config["farskip"], read_run_facts(run.final), num_layers, config.get("dtype"), fp8)
    from fcsd.files.staging import atomic_file

    with atomic_file(run.export / "README.md") as staging:
        staging.write_text(card)


def recipe_summary(facts: dict) -> dict | None:
    """The few facts of the FCSD run that go into ``config.json``'s ``farskip`` block (None when unknown)."""
    config, summary = facts.get("config") or {}, facts.get("summary") or {}
    train = config.get("train")
    if not train:
        return None
    steps = summary.get("steps")
    return {
        "base_model": display_name((config.get("model") or {}).get("name")),
        "base_revision": (config.get("model") or {}).get("revision"),
        "objective": train["objective"],
        "lr": train["lr"],
        "batch_tokens": train["batch_tokens"],
        "steps": steps,
        "tokens": steps * train["batch_tokens"] if steps else None,
        "data": display_name((config.get("data") or {}).get("path")),
    }


def base_license(base_model: str | None, revision: str | None = None) -> str | None:
    """The base checkpoint's license from its own model card (a local folder, or the hub at ``revision``), when it
    can be read."""
    if not base_model:
        return None
    try:
        from huggingface_hub import ModelCard

        local = Path(base_model).expanduser() / "README.md"
        if not local.exists() and hub_id(base_model) is None:
            return None  # a local folder without a card: never asked on the hub
        if revision and not local.exists():  # the card of the pinned revision, through the hub cache
            from huggingface_hub import hf_hub_download

            local = Path(hf_hub_download(base_model, "README.md", revision=revision))
        card = ModelCard.load(str(local) if local.exists() else base_model)
        return card.data.to_dict().get("license")
    except Exception:  # offline, gated or missing card: the license stays unknown rather than guessed
        return None


def render_card(farskip: dict, facts: dict, num_layers: int, dtype: str | None = None, fp8: dict | None = None) -> str:
    """The card's markdown with YAML metadata (huggingface_hub's ``ModelCardData``); ``dtype``: the weights';
    ``fp8``: an FP8 export's check and logit drift (``fcsd_export.json``'s, :func:`fp8_lines`)."""
    from huggingface_hub import ModelCard, ModelCardData

    config = facts.get("config", {})
    source = (config.get("model") or {}).get("name")
    revision = (config.get("model") or {}).get("revision")
    on_hub = hub_id(source) is not None  # a local folder (relative or not) is never looked up on the hub
    local = bool(source) and not on_hub and (Path(source).expanduser() / "README.md").is_file()
    base = display_name(source)  # the hub id or the folder's name, never an absolute path
    data = ModelCardData(
        base_model=source if on_hub else None,
        license=base_license(source, revision) if on_hub or local else None,  # the demo asks no hub
        library_name="transformers",
        tags=["moe", "farskip-collective", "fcsd"],
    )
    lines = [
        "---",
        data.to_yaml(),
        "---",
        "",
        f"# {base or 'model'} with FarSkip-Collective connectivity",
        "",
        f"This checkpoint keeps the weights of `{base or 'its base model'}`"
        + (f" (revision `{revision}`)" if revision else "")
        + " and rewires "
        f"{len(farskip['layers'])} of its {num_layers} decoder layers (`{farskip['spec']}`) with FarSkip-Collective "
        "connectivity: attention reads the residual stream without the previous layer's routed experts and the MoE "
        "block reads it without this layer's attention, so expert-parallel communication can overlap computation. "
        f"Converted with fcsd {farskip.get('fcsd_version', '')}."
        + (
            f" Its weights are stored in `{dtype}`, the dtype of the checkpoint it was converted from." if dtype else ""
        ),
        "",
    ]
    train, summary = config.get("train") or {}, facts.get("summary") or {}
    if train:
        steps = summary.get("steps")
        tokens = steps * train["batch_tokens"] if steps else None
        lines += [
            "## How it was converted",
            "",
            "| setting | value |",
            "|---|---|",
            f"| objective | {objective(train, config.get('recovery') or {})} |",
            f"| converted layers | `{farskip['spec']}` |",
            f"| steps | {steps if steps is not None else 'unknown'} |",
            f"| tokens | {tokens:,} |" if tokens else "| tokens | unknown |",
            f"| batch size | {train['batch_tokens']:,} tokens |",
            f"| learning rate | {learning_rate(train, config.get('recovery') or {}, schedule_ran(config, steps))} |",
            f"| data | `{display_name((config.get('data') or {}).get('path'))}` |",
        ]
        before, after = summary.get("eval_before", {}), summary.get("eval_after", {})
        if before and after:
            from fcsd.run_facts import kl_of

            kind = "" if "eval/kl" in before else " (teacher top-k + rest, from the teacher cache)"
            lines.append(f"| held-out KL(original \\|\\| converted){kind} | {kl_of(before):.4f} before, "
                         f"{kl_of(after):.4f} after |")  # fmt: skip
        early = summary.get("early_stop")
        if early and early.get("step_0"):
            lines.append(
                f"| MBPP+ early stopping | pass@1 {early['step_0']['plus']:.1f} at step 0, best "
                f"{early['best_score']:.1f} at step {early['best_step']} (this checkpoint), "
                + (f"stopped at step {early['stopped_at']} |" if early.get("stopped_at") else "ran to the end |")
            )
        if facts.get("final_train_loss") is not None:
            lines.append(f"| final training loss | {facts['final_train_loss']:.4f} |")
        lines.append("")
    if facts.get("eval_table"):
        lines += ["## Evaluation", "", facts["eval_table"], ""]
    lines += fp8_lines(fp8)
    lines += [
        LOAD_HEADING,
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        'model = AutoModelForCausalLM.from_pretrained("THIS_FOLDER_OR_REPO", trust_remote_code=True)',
        "# or, with fcsd installed and no remote code:",
        "import fcsd",
        'model = fcsd.from_pretrained("THIS_FOLDER_OR_REPO")',
        "```",
        "",
        "Without `trust_remote_code` stock transformers refuses this folder (its model type is "
        "`farskip_<base type>`) instead of silently running the regular connectivity. The `farskip` block of "
        "`config.json` lists the converted layers for serving engines.",
        "",
    ]
    command = serve_command("THIS_FOLDER_OR_REPO", farskip.get("base_model_type") or "")
    if command:
        lines += [
            "## How to serve",
            "",
            "With vLLM and fcsd's vLLM plugin installed in vLLM's environment (fcsd's `make serve-env`):",
            "",
            "```bash",
            command,
            "```",
            "",
            "The plugin serves it on vLLM's own model class with FarSkip connectivity on the converted layers; with "
            "`--tensor-parallel-size N` it overlaps the routed experts' all-reduce with the next layer's attention "
            "(eagerly, or compiled with piecewise CUDA graphs; see fcsd's serving guide for what was verified).",
            "",
        ]
    lines += [
        "## Citation",
        "",
        "```bibtex",
        CITATION,
        "```",
        "",
    ]
    return ModelCard("\n".join(lines)).content


def objective(train: dict, recovery: dict) -> str:
    """The run's loss in words: the objective and divergence, plus the guided recipe's hidden-state term."""
    words = f"`{train['objective']}` ({train.get('divergence', '')})"
    weight = recovery.get("hidden_l2") or 0
    if not weight:
        return words
    fade = f"fading to 0 over {recovery.get('hidden_l2_share', 1.0):.0%} of the steps"
    return words + f" + {weight:g} x relative hidden-state error (the teacher's states), {fade}"


def fp8_lines(fp8: dict | None) -> list[str]:
    """The card's section on an FP8 export: what its check proved and the logit drift FP8 rounding causes."""
    if not fp8:
        return []
    drift = fp8["logit_drift"]
    relative = f" ({drift['relative']:.1%} of the largest |logit|)" if drift.get("relative") is not None else ""
    return [
        "## FP8 weights",
        "",
        f"{fp8['quantized_weights']} weights are stored in block FP8 (e4m3 with block scales, as the checkpoint it "
        "was converted from); the export's check read each back from the written files and found it equal, bit for "
        "bit, to the block quantization of the trained weight, and every other tensor stored exactly. FP8 rounding "
        f"moves the logits of a fixed 2 x 32-token batch by at most {drift['max_abs']:.4g}{relative} from the "
        "trained model's.",
        "",
    ]


def with_fp8_check(card: str, fp8: dict) -> str:
    """``card`` (a rendered model card) with the FP8 section of ``fp8`` before its loading instructions."""
    section = "\n".join(fp8_lines(fp8)) + "\n"
    at = card.find(LOAD_HEADING)
    return card[:at] + section + card[at:] if at >= 0 else card.rstrip("\n") + "\n\n" + section


def schedule_ran(config: dict, steps: int | None) -> dict | None:
    """What the run's schedule was over the ``steps`` it ran, as the trainer derives it from its config
    (:mod:`fcsd.distill.config`): the LR schedule's horizon, its warm-up steps and the batch-ramp stages reached
    (``(first, last, updates)``, 1-based steps); None when unknown (no step count, a config from an older fcsd)."""
    if steps is None:
        return None
    from omegaconf import OmegaConf

    from fcsd.run_facts import ramp_stages, schedule_steps, warmup_steps

    try:
        run = OmegaConf.create(config)
        stages = [(start + 1, min(end, steps), split) for start, end, split in ramp_stages(run) if start < steps]
        return {"steps": steps, "horizon": schedule_steps(run.train), "warmup": warmup_steps(run), "stages": stages}
    except Exception:  # keys an older fcsd did not write: the card describes the config instead
        return None


def learning_rate(train: dict, recovery: dict, ran: dict | None = None) -> str:
    """The run's optimizer and LR in words (the recovery recipe may scale the LR and replace AdamW's schedule);
    ``ran`` (:func:`schedule_ran`): the schedule and batch-ramp stages of the steps the run made, else the config's
    shares."""
    peak = train["lr"] * recovery.get("lr_scale", 1.0)
    if ran is not None:
        return _schedule_words(peak, train, recovery, ran)
    share = recovery.get("warmup_share")
    warmup = f"{share:.1%} of the steps" if share is not None else f"{train['warmup_steps']} steps"
    if recovery.get("optimizer") == "schedule_free":
        words = f"{peak:g} (schedule-free AdamW, constant after a warm-up of {warmup}; the average is saved)"
    else:
        words = f"{peak:g} (AdamW, cosine, warm-up {warmup})"
    ramp = zip(recovery.get("batch_ramp") or [], recovery.get("batch_ramp_shares") or [], strict=False)
    stages = [
        f"the {'next' if i else 'first'} {share:.1%} of the steps in {split}" for i, (split, share) in enumerate(ramp)
    ]
    if stages:
        words += f"; batch ramp: {', '.join(stages)} updates each, at the LR / sqrt(updates)"
    return words


def _schedule_words(peak: float, train: dict, recovery: dict, ran: dict) -> str:
    warmup = f"a warm-up of {ran['warmup']} steps" if ran["warmup"] else "no warm-up"
    if recovery.get("optimizer") == "schedule_free":
        words = f"{peak:g} (schedule-free AdamW, constant after {warmup}; the average is saved)"
    else:
        floor = train.get("min_lr_ratio")
        to = f" to {floor:g} x" if floor is not None else ""
        words = f"{peak:g} (AdamW, {warmup}, cosine{to} over {ran['horizon']} steps)"
    if ran["steps"] < ran["horizon"]:
        words += f", stopped after {ran['steps']} of its {ran['horizon']} steps"
    stages = [
        f"step {first} in {split} updates" if first == last else f"steps {first}-{last} in {split} updates"
        for first, last, split in ran["stages"]
    ]
    if stages:
        words += f"; batch ramp: {', '.join(stages)}, each at the LR / sqrt(updates)"
    elif recovery.get("batch_ramp"):
        words += f"; no batch ramp (recovery.batch_ramp's shares hold none of the {ran['steps']} steps)"
    return words
