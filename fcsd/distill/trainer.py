"""The FCSD trainer (paper Sec. 3.1, 5.1; design §3): the frozen original checkpoint teaches the same checkpoint
rewired with FarSkip connectivity.

Scale-out rides on accelerate: the same code runs as one CPU process or under ``accelerate launch`` with DDP,
FSDP2 or DeepSpeed ZeRO-3 (configs in ``recipes/accelerate/``). One optimizer step consumes ``train.batch_tokens``
tokens across all processes; its loss is the sum over those tokens divided by their global count, so it does not
change with the micro-batch size, the accumulation steps or the number of processes.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fcsd.connectivity.patch import apply_farskip
from fcsd.distill import losses, run_io
from fcsd.distill.config import FCSDConfig
from fcsd.distill.data import Packed, load_packed, tokens_fingerprint
from fcsd.distill.objectives import head_inputs, micro_batch_loss, teacher_targets, teacher_token_loss

log = logging.getLogger(__name__)
TRAINER_STATE = "trainer_state.json"
CHECKPOINT_RECORD = "fcsd_checkpoint.json"


@dataclass
class StepPlan:
    """How ``train.batch_tokens`` becomes micro-batches: ``sequences`` rows per step, ``accumulation`` micro-batches
    of ``micro_batch_size`` rows per process, ``total_steps`` steps."""

    sequences: int
    micro_batch_size: int
    accumulation: int
    world_size: int
    total_steps: int

    def rows(self, step: int, num_rows: int, seed: int) -> list[int]:
        """The packed rows of ``step`` (all processes), in a seeded order reshuffled every epoch."""
        first = step * self.sequences
        out: list[int] = []
        while len(out) < self.sequences:
            epoch, offset = divmod(first + len(out), num_rows)
            order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
            out.extend(order[offset : offset + self.sequences - len(out)])
        return out

    def micro_rows(self, rows: list[int], micro: int, rank: int) -> list[int]:
        start = (micro * self.world_size + rank) * self.micro_batch_size
        return rows[start : start + self.micro_batch_size]


def plan_steps(config: FCSDConfig, world_size: int) -> StepPlan:
    train, seq_len = config.train, config.data.seq_len
    if train.batch_tokens % seq_len:
        raise ValueError(
            f"train.batch_tokens={train.batch_tokens} is not a multiple of data.seq_len={seq_len}; "
            "a step holds whole packed sequences"
        )
    sequences = train.batch_tokens // seq_len
    per_pass = train.micro_batch_size * world_size
    if sequences % per_pass:
        raise ValueError(
            f"a step of {sequences} sequences does not split into micro-batches of {train.micro_batch_size} x "
            f"{world_size} processes; choose train.micro_batch_size (or the process count) dividing {sequences}"
        )
    total = train.max_tokens // train.batch_tokens
    if train.max_steps is not None:
        total = min(total, train.max_steps)
    return StepPlan(sequences, train.micro_batch_size, sequences // per_pass, world_size, total)


@dataclass
class RunResult:
    output_dir: Path
    final_dir: Path
    steps: int
    eval_before: dict
    eval_after: dict
    data: dict = field(default_factory=dict)
    early_stop: dict | None = None  # MBPPPlusEarlyStop.summary() when early stopping ran


def _dtype(name: str, cuda: bool, cpu_default: str, gpu_default: str) -> torch.dtype:
    return getattr(torch, (gpu_default if cuda else cpu_default) if name == "auto" else name)


def load_tokenizer(config: FCSDConfig):
    """The checkpoint's tokenizer; a local-looking MODEL that does not exist is a clear error, not a hub lookup."""
    from transformers import AutoTokenizer

    from fcsd.demo import resolve_model

    path = resolve_model(config.model.name)
    if path.startswith((".", "/", "~")) and not Path(path).expanduser().exists():
        raise ValueError(f"model {path}: no such folder (give a local checkpoint folder, a hub id, or 'demo')")
    return AutoTokenizer.from_pretrained(path, trust_remote_code=config.model.trust_remote_code)


def load_models(config: FCSDConfig, tokenizer, device, need_teacher: bool = True, need_student: bool = True):
    """Frozen teacher and FarSkip student (each ``None`` when not needed) from the same checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fcsd.demo import resolve_model

    path = resolve_model(config.model.name)
    cuda = device.type == "cuda"
    common = {"trust_remote_code": config.model.trust_remote_code}
    if config.model.attn_implementation:
        common["attn_implementation"] = config.model.attn_implementation
    teacher = student = None
    if need_teacher:
        dtype = _dtype(config.teacher.dtype, cuda, "float32", "bfloat16")
        teacher = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **common)
        teacher.eval().requires_grad_(False).to(device)
    if need_student:
        source_dtype = AutoConfig.from_pretrained(path, **common).dtype
        dtype = _dtype(config.model.dtype, cuda, "float32", "float32")
        student = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **common)
        student = apply_farskip(student, config.farskip.layers)
        student.config.dtype = source_dtype  # what final/ is saved in
    model = student or teacher
    vocab = model.get_output_embeddings().out_features
    if len(tokenizer) > vocab:
        raise ValueError(
            f"vocabulary mismatch: the tokenizer has {len(tokenizer)} tokens but {path} predicts only {vocab}; "
            "use the tokenizer saved with the checkpoint"
        )
    if teacher is not None and student is not None:
        losses.check_vocabularies(vocab, teacher.get_output_embeddings().out_features)
    return teacher, student


def cache_teacher(config: FCSDConfig, batch_size: int = 4) -> Path:
    """``fcsd cache-teacher``: run the teacher once over the run's packed rows (training, then held-out) and store
    its top-k log-probabilities in ``teacher.cache_dir`` (see :mod:`fcsd.distill.teacher_cache`)."""
    from fcsd.distill.teacher_cache import build_cache

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(config)
    train_rows, held_rows, summary = load_data(config, tokenizer)
    teacher, _ = load_models(config, tokenizer, device, need_student=False)
    rows = all_rows(train_rows, held_rows)
    return build_cache(teacher, rows, cache_dir(config), cache_meta(teacher, rows, config), batch_size, config.progress)


def cache_meta(model, rows: Packed, config: FCSDConfig) -> dict:
    """What a teacher cache for this run must have been made from."""
    from fcsd.distill.teacher_cache import expected_meta

    fingerprint = tokens_fingerprint(rows.input_ids)
    train = config.train
    return expected_meta(model, fingerprint, len(rows), config.data.seq_len, config.teacher.top_k, train.temperature)


def load_data(config: FCSDConfig, tokenizer) -> tuple[Packed, Packed, dict]:
    """Training rows, held-out rows and a summary; held-out rows come from ``data.eval_path`` or the end of the
    shuffled training rows (then removed from training)."""
    from fcsd.demo import cache_root, resolve_data

    data = config.data
    cache_dir = data.cache_dir or cache_root() / "packed"
    options = {
        "text_field": data.text_field,
        "messages_field": data.messages_field,
        "seed": config.train.seed,
        "cache_dir": cache_dir,
    }
    packed, summary = load_packed(
        resolve_data(data.path), tokenizer, data.seq_len, split=data.split, max_rows=data.max_rows, **options
    )
    if data.eval_path:
        held, _ = load_packed(resolve_data(data.eval_path), tokenizer, data.seq_len, **options)
        held = held.rows(slice(0, data.eval_sequences))
        train = packed
    else:
        if len(packed) <= data.eval_sequences:
            raise ValueError(
                f"{data.path} packs into {len(packed)} sequences of {data.seq_len} tokens, too few to hold out "
                f"data.eval_sequences={data.eval_sequences}; add data, lower data.seq_len, or set data.eval_path"
            )
        train, held = packed.rows(slice(0, -data.eval_sequences)), packed.rows(slice(-data.eval_sequences, None))
    summary.update(train_sequences=len(train), eval_sequences=len(held))
    return train, held, summary


def all_rows(train: Packed, held: Packed) -> Packed:
    """Training rows then held-out rows: the row order of a teacher cache."""
    return Packed(torch.cat([train.input_ids, held.input_ids]), torch.cat([train.position_ids, held.position_ids]))


@torch.no_grad()
def heldout_metrics(
    student, held: Packed, config: FCSDConfig, teacher=None, cache=None, cache_offset: int = 0, head_in_forward=False
) -> dict:
    """Per-token held-out KL(teacher || student) and next-token NLL of ``student`` (unwrapped) on ``held``."""
    was_training = student.training
    student.eval()
    device = next(student.parameters()).device
    kl_sum, nll_sum, kl_tokens, nll_tokens = 0.0, 0.0, 0, 0
    chunk = config.train.loss_chunk_size
    for start in range(0, len(held), config.train.micro_batch_size):
        rows = held.rows(slice(start, start + config.train.micro_batch_size))
        batch = Packed(rows.input_ids.to(device), rows.position_ids.to(device))
        x, head, _ = head_inputs(student, student, batch, head_in_forward)
        labels = batch.sft_labels().reshape(-1)
        nll_sum += float(losses.chunked_head_loss(x, head, losses.cross_entropy, (labels,), chunk))
        nll_tokens += int((labels != -100).sum())
        if cache is not None:
            logp, ids = cache.rows(list(range(cache_offset + start, cache_offset + start + len(rows))))
            targets = (logp.reshape(x.shape[0], -1).to(device), ids.reshape(x.shape[0], -1).to(device))
            token_loss = losses.topk_forward_kl
        else:
            teacher_x, teacher_head, _ = teacher_targets(teacher, batch, head_in_forward=head_in_forward)
            targets = (teacher_x,)
            token_loss = teacher_token_loss(losses.divergence("forward_kl"), teacher_head)
        kl_sum += float(losses.chunked_head_loss(x, head, token_loss, targets, chunk))
        kl_tokens += x.shape[0]
    student.train(was_training)
    return {"eval/kl": kl_sum / kl_tokens, "eval/nll": nll_sum / nll_tokens}


def build_optimizer(student, config: FCSDConfig, total_steps: int):
    """AdamW and cosine annealing with linear warm-up to ``train.min_lr_ratio * lr`` (paper Sec. 5.1)."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    train = config.train
    if train.freeze_embeddings:  # paper Tab. 2 "KL embed."
        student.get_input_embeddings().requires_grad_(False)
        student.get_output_embeddings().requires_grad_(False)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=train.lr, betas=tuple(train.adam_betas), weight_decay=train.weight_decay)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, train.warmup_steps, max(total_steps, 1), min_lr_rate=train.min_lr_ratio
    )
    return optimizer, scheduler


class SpikeGuard:
    """Decides whether a step's update is applied: its loss and gradient norm must be finite and the loss below
    ``factor`` times the median of the last ``window`` applied steps. ``max_bad`` refusals in a row stop the run."""

    def __init__(self, factor: float, window: int, max_bad: int, history=None, bad_streak: int = 0):
        self.factor, self.window, self.max_bad = factor, window, max_bad
        self.history: list[float] = list(history or [])
        self.bad_streak = bad_streak

    def check(self, loss: float, grad_norm: float) -> str | None:
        """``None`` when the step is good, else the reason it is skipped."""
        reason = None
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            reason = f"non-finite loss {loss} or gradient norm {grad_norm}"
        elif len(self.history) >= self.window and loss > self.factor * statistics.median(self.history):
            reason = f"loss spike {loss:.4g} > {self.factor} x median {statistics.median(self.history):.4g}"
        if reason is None:
            self.history = (self.history + [loss])[-self.window :]
            self.bad_streak = 0
            return None
        self.bad_streak += 1
        if self.bad_streak >= self.max_bad:
            raise RuntimeError(
                f"training diverged: {self.bad_streak} steps in a row were skipped (last: {reason}); resume from the "
                "last checkpoint with a lower train.lr or a larger train.batch_tokens"
            )
        return reason

    def state(self) -> dict:
        return {"history": self.history, "bad_streak": self.bad_streak}


def convert(config: FCSDConfig) -> RunResult:
    """Run FCSD as configured and write ``output_dir/final/`` (loadable with :func:`fcsd.from_pretrained`)."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import set_seed
    from omegaconf import OmegaConf

    from fcsd.distill.teacher_cache import TeacherCache

    cpu_only = not torch.cuda.is_available()  # so that torchrun / accelerate launch on CPUs form a gloo group
    state = PartialState(cpu=cpu_only)
    train_cfg = config.train
    output_dir = Path(config.output_dir)
    plan = plan_steps(config, state.num_processes)
    if config.push_to_hub:  # fail now, not after the training run
        from huggingface_hub import get_token

        if not get_token():
            raise ValueError(f"push_to_hub={config.push_to_hub} needs a hub token: set HF_TOKEN or `hf auth login`")
    if state.is_main_process:
        run_io.check_output_dir(output_dir, train_cfg.resume, config.overwrite)
    state.wait_for_everyone()
    mixed = train_cfg.mixed_precision
    if mixed == "auto":
        mixed = "bf16" if state.device.type == "cuda" else "no"
    accelerator = Accelerator(
        cpu=cpu_only,
        mixed_precision=mixed,
        gradient_accumulation_steps=plan.accumulation,
        step_scheduler_with_optimizer=False,
    )
    set_seed(train_cfg.seed)
    online = config.teacher.mode == "online"
    tokenizer = load_tokenizer(config)
    with accelerator.main_process_first():
        train_rows, held_rows, data_summary = load_data(config, tokenizer)
    early = None
    if config.early_stop.enabled:  # loads MBPP+ now: a missing dataset must not surface hours into the run
        from fcsd.distill.early_stopping import MBPPPlusEarlyStop

        early = MBPPPlusEarlyStop(config.early_stop)
    teacher, student = load_models(config, tokenizer, accelerator.device, need_teacher=online)
    if accelerator.is_main_process:  # only now: a run that fails on its inputs leaves no folder behind
        output_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.structured(config), output_dir / "fcsd_config.yaml")
    cache = None
    if not online:
        rows = all_rows(train_rows, held_rows)
        cache = TeacherCache(cache_dir(config), cache_meta(student, rows, config))
    if train_cfg.gradient_checkpointing:
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer, scheduler = build_optimizer(student, config, plan.total_steps)
    _fill_deepspeed_config(accelerator, plan, train_cfg.grad_clip)
    model, optimizer = accelerator.prepare(student, optimizer)
    if teacher is not None and shards_parameters(accelerator):
        from fcsd.parallel.inference_shard import shard_for_inference

        shard_for_inference(teacher, accelerator)
    accelerator.register_for_checkpointing(scheduler)
    unwrapped = accelerator.unwrap_model(model)

    start_step, tokens_seen, guard, eval_before = (
        0,
        0,
        SpikeGuard(train_cfg.spike_factor, train_cfg.spike_window, train_cfg.max_bad_steps),
        None,
    )
    existing = run_io.checkpoints(output_dir) if train_cfg.resume else []
    if existing:
        accelerator.load_state(str(existing[-1]))
        saved = json.loads((existing[-1] / TRAINER_STATE).read_text())
        start_step, tokens_seen, eval_before = saved["step"], saved["tokens"], saved["eval_before"]
        guard = SpikeGuard(guard.factor, guard.window, guard.max_bad, **saved["guard"])
        if early is not None and saved.get("early_stop"):
            early.load(saved["early_stop"])
        accelerator.print(f"resuming from {existing[-1]} (step {start_step})")
    metrics = run_io.MetricsLog(output_dir, start_step if existing else None, accelerator.is_main_process)
    held_offset = len(train_rows)

    def evaluate(step: int) -> dict:
        result = heldout_metrics(
            unwrapped, held_rows, config, teacher, cache, held_offset, shards_parameters(accelerator)
        )
        metrics.log({"step": step, **result})
        return result

    if eval_before is None:
        with accelerator.autocast():
            eval_before = evaluate(0)
        accelerator.print(f"step 0 (converted, before training): held-out KL {eval_before['eval/kl']:.4f}")
    best_dir = output_dir / "best"

    def early_stop_check(step: int) -> bool:
        """MBPP+ at ``step``; saves ``best/`` on a new best; True when patience is exhausted."""
        with accelerator.autocast():  # bf16 generation on GPU
            decision = early.evaluate(accelerator, unwrapped, tokenizer, step, shards_parameters(accelerator))
        scores = early.scores[str(step)]
        metrics.log({"step": step, "early_stop/mbpp_plus": scores["plus"], "early_stop/mbpp_base": scores["base"]})
        accelerator.print(
            f"step {step}: MBPP+ pass@1 {scores['plus']:.1f} (base {scores['base']:.1f}); best "
            f"{early.rule.best_score:.1f} at step {early.rule.best_step}; "
            f"{early.rule.evals_without_improvement}/{early.config.patience} evaluations without a gain > "
            f"{early.config.min_delta} points"
        )
        if decision.new_best:
            best_state = accelerator.get_state_dict(model)
            if accelerator.is_main_process:
                record = {"step": step, "mbpp_plus": scores["plus"], "mbpp_base": scores["base"]}
                save_final(unwrapped, best_state, tokenizer, config, best_dir, record)
        return decision.stop

    if early is not None and not early.scores:  # the baseline: step 0, or where a run resumed without this state
        early_stop_check(start_step)

    model.train()
    bar = tqdm(
        total=plan.total_steps, initial=start_step, desc="FCSD", unit="step",
        disable=not (config.progress and accelerator.is_main_process),
    )  # fmt: skip
    rank, started = accelerator.process_index, time.perf_counter()
    done = start_step
    for step in range(start_step, plan.total_steps):
        step_rows = plan.rows(step, len(train_rows), train_cfg.seed)
        micro_batches = [plan.micro_rows(step_rows, i, rank) for i in range(plan.accumulation)]
        loss, grad_norm, terms = train_step(accelerator, model, micro_batches, train_rows, config, teacher, cache)
        skipped = guard.check(loss, grad_norm)
        if skipped is None:
            optimizer.step()
        else:
            log.warning("step %d skipped: %s", step + 1, skipped)
            accelerator.print(f"step {step + 1} skipped: {skipped}")
        optimizer.zero_grad(set_to_none=True)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        tokens_seen += train_cfg.batch_tokens
        done = step + 1
        throughput = train_cfg.batch_tokens * (done - start_step) / (time.perf_counter() - started)
        if done % train_cfg.log_every == 0 or skipped or done == plan.total_steps:
            record = {"step": done, "train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm}
            record.update(
                {"train/tokens": tokens_seen, "train/tokens_per_s": throughput, "train/skipped": bool(skipped)}
            )
            record.update({f"train/{name}": value for name, value in terms.items()})
            metrics.log(record)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{throughput:,.0f}")
        bar.update()
        if train_cfg.eval_every and done % train_cfg.eval_every == 0 and done != plan.total_steps:
            with accelerator.autocast():
                evaluate(done)
        if early is not None and done % early.config.every == 0 and early_stop_check(done):
            accelerator.print(f"early stop at step {done}: the best MBPP+ checkpoint is step {early.rule.best_step}")
            break
        if train_cfg.save_every and done % train_cfg.save_every == 0 and done != plan.total_steps:
            state = {"step": done, "tokens": tokens_seen, "guard": guard.state(), "eval_before": eval_before}
            state["early_stop"] = early.state() if early is not None else None
            save_checkpoint(accelerator, output_dir, done, state, train_cfg.keep_checkpoints)
    bar.close()
    if early is not None and not early.evaluated(done):
        early_stop_check(done)  # the final score (it may be the best)
    with accelerator.autocast():
        eval_after = evaluate(done)
    accelerator.print(
        f"final: held-out KL {eval_after['eval/kl']:.4f} (step 0: {eval_before['eval/kl']:.4f}), "
        f"NLL {eval_after['eval/nll']:.4f}"
    )
    final_dir = output_dir / "final"
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        summary = {"steps": done, "eval_before": eval_before, "eval_after": eval_after, "data": data_summary}
        if early is not None:
            summary["early_stop"] = early.summary()
        (output_dir / "run_summary.json").write_text(json.dumps(summary, indent=2))
        run_io.plot_curves(metrics.records(), output_dir / "curves.png", f"FCSD: {config.model.name}")
        save_final(unwrapped, state_dict, tokenizer, config, final_dir, {"step": done})
        if config.export:  # after the summary: the export's model card reads it
            from fcsd.export.save import export_checkpoint

            export_dir = Path(config.export_dir or output_dir / "export")
            source = best_dir if early is not None else final_dir  # early stopping exports its best checkpoint
            export_checkpoint(source, export_dir, overwrite=True)
            accelerator.print(f"exported {source.name}/ to {export_dir} (reload parity checked)")
            if config.push_to_hub:
                from fcsd.export.push import push

                accelerator.print(f"pushed to {config.push_to_hub}: {push(export_dir, config.push_to_hub)}")
    metrics.close()
    accelerator.wait_for_everyone()
    early_summary = early.summary() if early is not None else None
    return RunResult(output_dir, final_dir, done, eval_before, eval_after, data_summary, early_summary)


def train_step(accelerator, model, micro_batches: list[list[int]], train_rows: Packed, config, teacher, cache):
    """Forward/backward of one optimizer step's micro-batches on this process, the loss normalised by the step's
    token count over all processes, then gradient clipping. Returns (loss per token, gradient norm, loss terms)."""
    unwrapped = accelerator.unwrap_model(model)
    head_in_forward = shards_parameters(accelerator)
    device = accelerator.device
    local_tokens = sum(_loss_tokens(train_rows.rows(rows), config.train.objective) for rows in micro_batches)
    global_tokens = int(accelerator.reduce(torch.tensor(local_tokens, device=device), "sum"))
    # accelerate divides by the accumulation steps and DDP/FSDP average over processes: undo both, so the
    # gradient is exactly that of (sum of token losses) / global_tokens
    scale = accelerator.num_processes * len(micro_batches) / global_tokens
    sums: dict[str, torch.Tensor] = {"loss": torch.zeros((), device=device)}
    for rows in micro_batches:
        packed = train_rows.rows(rows)
        batch = Packed(packed.input_ids.to(device), packed.position_ids.to(device))
        cached = None if cache is None else tuple(t.to(device) for t in cache.rows(rows))
        with accelerator.accumulate(model), accelerator.autocast():
            parts = micro_batch_loss(model, unwrapped, batch, config, teacher, cached, head_in_forward)
            accelerator.backward(parts.total * scale)
        sums["loss"] += parts.total.detach()
        for name, value in parts.terms.items():
            sums[name] = sums.get(name, 0) + value
    reduced = {name: float(accelerator.reduce(value, "sum")) / global_tokens for name, value in sums.items()}
    grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), config.train.grad_clip or math.inf))
    loss = reduced.pop("loss")
    if len(reduced) == 1:
        reduced = {}  # the only term is the loss itself
    return loss, grad_norm, reduced


def shards_parameters(accelerator) -> bool:
    """FSDP2 and ZeRO-3 gather parameters only inside a module's forward: the LM head must stay there."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)


def _fill_deepspeed_config(accelerator, plan: StepPlan, grad_clip: float) -> None:
    """DeepSpeed needs batch sizes before ``prepare``; fcsd feeds no dataloader, so fill its "auto" values here."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    values = {
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.accumulation,
        "train_batch_size": plan.sequences,
        "gradient_clipping": grad_clip,
    }
    for key, value in values.items():
        if plugin.deepspeed_config.get(key, "auto") == "auto":
            plugin.deepspeed_config[key] = value


def _loss_tokens(rows: Packed, objective: str) -> int:
    """Tokens a micro-batch contributes to the normalisation: every position, or the SFT-labelled ones."""
    return int((rows.sft_labels() != -100).sum()) if objective == "sft" else rows.input_ids.numel()


def cache_dir(config: FCSDConfig) -> Path:
    return Path(config.teacher.cache_dir or Path(config.output_dir) / "teacher-cache")


def save_checkpoint(accelerator, output_dir: Path, step: int, trainer_state: dict, keep: int) -> Path:
    """Model, optimizer, scheduler and RNG states (accelerate ``save_state``) plus ``trainer_state`` (data position,
    spike-guard and early-stopping state), staged under a dotted name and renamed into place, so a killed run never
    leaves a half checkpoint."""
    import os
    import shutil

    target = output_dir / run_io.CHECKPOINTS / f"step-{step}"
    staging = target.with_name(f".step-{step}.partial")
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    if accelerator.is_main_process:
        (staging / TRAINER_STATE).write_text(json.dumps(trainer_state))
        os.replace(staging, target)
        run_io.prune_checkpoints(output_dir, keep)
    accelerator.wait_for_everyone()
    return target


def save_final(student, state_dict, tokenizer, config: FCSDConfig, final_dir: Path, record: dict | None = None):
    """``final/`` (or ``best/``): the converted checkpoint in the source dtype with its ``config.farskip`` record, the
    tokenizer, the resolved run config and ``record`` (``fcsd_checkpoint.json``: which step this is); atomic."""
    from omegaconf import OmegaConf

    dtype = student.config.dtype or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    with run_io.atomic_dir(final_dir) as staging:
        student.save_pretrained(staging, state_dict=state_dict)
        tokenizer.save_pretrained(staging)
        OmegaConf.save(OmegaConf.structured(config), staging / "fcsd_config.yaml")
        if record is not None:
            (staging / CHECKPOINT_RECORD).write_text(json.dumps(record, indent=2))
