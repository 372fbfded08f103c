"""The FCSD training loop (paper Sec. 3.1, 5.1; design §3): the frozen original checkpoint teaches the same
checkpoint rewired with FarSkip connectivity.

Scale-out rides on accelerate: the same code runs as one CPU process or under ``accelerate launch`` with DDP,
FSDP2 or DeepSpeed ZeRO-3 (configs in ``recipes/accelerate/``). One step consumes ``train.batch_tokens`` tokens
across all processes in one optimizer update (several in a batch ramp, ``recovery.batch_ramp``); an update's loss is
the sum over its tokens divided by their global count, so it does not change with the micro-batch size, the
accumulation steps or the number of processes. Loading, data, held-out metrics, optimisation and checkpoints live in
their own modules; :func:`fcsd.distill.convert.convert` runs this loop and then exports and pushes.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fcsd.distill import run_io
from fcsd.distill.checkpointing import load_init_weights, restore_checkpoint, save_checkpoint, save_model
from fcsd.distill.config import FCSDConfig, guide_weight, process_group_timeout, update_split
from fcsd.distill.data import Packed, tokens_fingerprint
from fcsd.distill.finite import NonFiniteStop, check_weights_finite, diverged
from fcsd.distill.heldout import heldout_metrics, kl_name
from fcsd.distill.objectives import micro_batch_loss
from fcsd.distill.optim import (
    Diverged,
    SpikeGuard,
    apply_update,
    build_optimizer,
    evaluation_weights,
    fuse_on_gpu,
    plan_steps,
    scaled_lr,
)
from fcsd.distill.preflight import Checked
from fcsd.distill.resume import check_resume_inputs, input_fingerprints, weights_fingerprint
from fcsd.distill.run_data import all_rows, load_run_data
from fcsd.distill.student_teacher import load_models, load_tokenizer
from fcsd.parallel.processes import print_once
from fcsd.run_facts import kl_of, ramp_stages

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    output_dir: Path
    final_dir: Path
    steps: int
    eval_before: dict
    eval_after: dict
    data: dict = field(default_factory=dict)
    early_stop: dict | None = None  # MBPPPlusEarlyStop.summary() when early stopping ran
    best_dir: Path | None = None  # best/ when early stopping kept one


def train(checked: Checked) -> RunResult:
    """Run FCSD on the inputs :func:`fcsd.distill.preflight.preflight` checked and write ``output_dir/final/``
    (loadable with :func:`fcsd.from_pretrained`)."""
    session = TrainingSession(checked)
    s, plan, train_cfg = session, session.plan, checked.config.train
    done = s.start_step
    bar = tqdm(total=plan.total_steps, initial=done, desc="FCSD", unit="step", disable=not s.show_progress)
    for step in range(s.start_step, plan.total_steps):
        try:
            loss, grad_norm, terms, applied = s.optimizer_steps(step)
        except Diverged as error:
            raise diverged(error, step + 1, s.run) from None
        lr = s.scheduler.get_last_lr()[0]
        s.scheduler.step()
        done = step + 1
        s.tokens_seen += train_cfg.batch_tokens
        s.log_step(done, loss, lr, grad_norm, terms, skipped=not applied)
        s.nonfinite.step_done(done, loss, applied, s.run)  # before anything is saved from broken weights
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{s.throughput(done):,.0f}")
        bar.update()
        last = done == plan.total_steps
        if train_cfg.eval_every and done % train_cfg.eval_every == 0 and not last:
            s.evaluate(done)
        if s.early is not None and done % s.early.config.every == 0 and s.early_stop_check(done):
            print_once(f"early stop at step {done}: the best MBPP+ checkpoint is step {s.early.rule.best_step}")
            break
        if train_cfg.save_every and done % train_cfg.save_every == 0 and not last:
            s.save_checkpoint(done)
    bar.close()
    return s.finish(done)


def process_state(config: FCSDConfig):
    """accelerate's ``PartialState``, its default process group waiting up to ``parallel.timeout_minutes`` in a
    collective (a group started before gets it too): the main process's lone phases (MBPP+ scoring, saves,
    checkpoint pruning) keep the others waiting in its barriers and broadcasts."""
    import torch.distributed as dist
    from accelerate import PartialState

    timeout = process_group_timeout(config.parallel.timeout_minutes)
    state = PartialState(cpu=not torch.cuda.is_available(), timeout=timeout)
    if dist.is_available() and dist.is_initialized():
        dist.distributed_c10d._set_pg_timeout(timeout)
    return state


class TrainingSession:
    """Everything one run holds: the accelerator, both models, the rows, optimizer, schedule, spike guard, early
    stopping and metrics, restored from the newest checkpoint when the run resumes."""

    def __init__(self, checked: Checked):
        from accelerate import Accelerator
        from accelerate.utils import DistributedType, GradientAccumulationPlugin, InitProcessGroupKwargs, set_seed
        from accelerate.utils.environment import parse_flag_from_env

        from fcsd.distill.teacher_cache import TeacherCache, cache_dir, run_meta
        from fcsd.recipe_files import resolve_deepspeed_config

        resolve_deepspeed_config()  # a shipped DeepSpeed config names recipes/...: outside a checkout, the shipped copy
        config = checked.config
        self.config, train_cfg = config, config.train
        self.run = checked.run
        cpu_only = not torch.cuda.is_available()  # so that torchrun / accelerate launch on CPUs form a gloo group
        if not cpu_only:  # TF32 for the fp32 matmuls that remain under bf16 autocast (its reductions stay fp32)
            torch.set_float32_matmul_precision("high")
        mixed = train_cfg.mixed_precision
        if mixed == "auto":
            mixed = "no" if cpu_only else "bf16"
        self.plan = plan_steps(config, process_state(config).num_processes)
        # under FSDP, skipping the reduce-scatter before a step's last micro-batch would keep unsharded gradients of
        # the whole model on every GPU (what `fcsd plan` found): reduce-scatter every micro-batch instead
        accumulation = GradientAccumulationPlugin(
            num_steps=self.plan.accumulation, sync_each_batch=parse_flag_from_env("ACCELERATE_USE_FSDP")
        )
        self.accelerator = accelerator = Accelerator(
            cpu=cpu_only,
            mixed_precision=mixed,
            gradient_accumulation_plugin=accumulation,
            step_scheduler_with_optimizer=False,
            kwargs_handlers=[InitProcessGroupKwargs(timeout=process_group_timeout(config.parallel.timeout_minutes))],
        )
        deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
        if deepspeed and config.recovery.optimizer == "schedule_free":
            raise ValueError(
                "recovery.optimizer=schedule_free does not run under DeepSpeed (its engine owns the optimizer and "
                "would save the training iterate, not the average): use FSDP2 (recipes/accelerate/fsdp2_8gpu.yaml) or "
                "recovery=plain"
            )
        if deepspeed and train_cfg.spike_factor:
            raise ValueError(
                "train.spike_factor cannot skip steps under DeepSpeed (its optimizer steps inside backward, before "
                "the loss is known): set train.spike_factor=0 (non-finite steps then stop the run), or use FSDP2"
            )
        if deepspeed and config.recovery.batch_ramp:
            raise ValueError(
                "recovery.batch_ramp does not run under DeepSpeed (its engine fixes the micro-batches of an update): "
                "set recovery.batch_ramp=[] recovery.batch_ramp_shares=[], or use FSDP2"
            )
        self.announce_ramp()
        if self.plan.micro_batch_size != train_cfg.micro_batch_size:
            print_once(
                f"train.micro_batch_size={train_cfg.micro_batch_size} does not divide this process's "
                f"{self.plan.per_process} sequences of a step: micro-batches of "
                f"{self.plan.micro_batch_size}"
            )
        set_seed(train_cfg.seed)
        self.tokenizer = load_tokenizer(config, checked.model, checked.model_config)
        with accelerator.main_process_first():
            rows = load_run_data(config, self.tokenizer, (checked.data, checked.eval_data))
            self.train_rows, self.held_rows, self.data_summary = rows
        self.data_fingerprint = tokens_fingerprint(all_rows(self.train_rows, self.held_rows).input_ids)
        self.inputs = input_fingerprints(config, self.tokenizer, self.data_fingerprint, checked.model)
        if train_cfg.resume:  # the content (weights, tokenizer, chat template, data), before anything is written
            check_resume_inputs(self.run, config, self.inputs)
        self.early = None
        if config.early_stop.enabled:  # loads MBPP+ now: a missing dataset must not surface hours into the run
            from fcsd.distill.early_stopping import MBPPPlusEarlyStop

            self.early = MBPPPlusEarlyStop(config.early_stop)
        online = config.teacher.mode == "online"
        from fcsd.parallel.training import run_meshes, teacher_meshes

        meshes = run_meshes(config, accelerator)  # parallel.ep_size / parallel.fsdp: fcsd lays the models out
        self.parallel = meshes is not None
        self.teacher, student = load_models(
            config,
            self.tokenizer,
            accelerator.device,
            need_teacher=online,
            meshes=meshes,
            teacher_meshes=teacher_meshes(accelerator) if online else None,
            source=checked.model,
        )
        self.inputs["model"] = self.inputs["model"] or weights_fingerprint(checked.model, config.model.revision)
        load_init_weights(student, config, self.run)  # train.init_from: another run's weights, before prepare
        self.cache = None
        if not online:
            rows = all_rows(self.train_rows, self.held_rows)
            self.cache = TeacherCache(cache_dir(config), run_meta(student, rows, config))
        if accelerator.is_main_process:  # only now: a run that fails on its inputs leaves no folder behind
            run_io.write_run_config(self.run, config)
        if train_cfg.gradient_checkpointing and not self.parallel:  # a layout checkpoints its own way
            student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.optimizer, self.scheduler = build_optimizer(student, config, self.plan)
        _fill_deepspeed_config(accelerator, self.plan, train_cfg.grad_clip)
        if self.parallel:  # no DDP wrapper: the layout reduces each gradient over the right processes
            self.model = student
        else:
            self.model, self.optimizer = accelerator.prepare(student, self.optimizer)
        if not deepspeed:
            fuse_on_gpu(self.optimizer)
        if accelerator.distributed_type == DistributedType.FSDP:  # accelerate's FSDP2: as fcsd's own layout does
            from fcsd.parallel.layout import without_views

            self.model.register_forward_hook(without_views, prepend=True)
        sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        self.head_in_forward = sharded or config.parallel.fsdp
        accelerator.register_for_checkpointing(self.scheduler)
        self.unwrapped = accelerator.unwrap_model(self.model)

        guard = (train_cfg.spike_factor, train_cfg.spike_window, train_cfg.max_bad_steps)
        ep_state = (self.model, self.optimizer) if self.parallel else None
        saved = restore_checkpoint(accelerator, self.run, ep_state, train_cfg.resume_step) if train_cfg.resume else None
        if saved and not deepspeed:
            fuse_on_gpu(self.optimizer)  # a restored state dict brings back the saved group settings
        saved = saved or {"step": 0, "tokens": 0, "guard": {}, "eval_before": None, "early_stop": None}
        self.start_step, self.tokens_seen = saved["step"], saved["tokens"]
        self.guard = SpikeGuard(*guard, **saved["guard"], can_skip=not deepspeed)
        self.nonfinite = NonFiniteStop(train_cfg.max_nonfinite_steps, saved.get("nonfinite_streak", 0))
        if self.early is not None and saved.get("early_stop"):
            self.early.load(saved["early_stop"])
        self.metrics = run_io.MetricsLog(self.run.root, self.start_step, accelerator.is_main_process)
        self.started = time.perf_counter()
        self.show_progress = config.progress and accelerator.is_main_process
        self.eval_before = saved["eval_before"] or self.evaluate(0)
        if saved["eval_before"] is None:
            print_once(
                f"step 0 (converted, before training): {kl_name(self.eval_before)} {kl_of(self.eval_before):.4f}"
            )
        if self.early is not None and not self.early.scores:  # the baseline: step 0, or a resume without this state
            self.early_stop_check(self.start_step)
        self.model.train()

    def announce_ramp(self) -> None:
        """One line saying which steps the batch ramp splits, and any split lowered to fit this process's rows."""
        parts = []
        for start, end, split in ramp_stages(self.config):
            fitted, held = self.plan.fit_split(split), self.plan.per_process
            lowered = f" (not {split}: this process holds {held} sequences of a step)" if fitted != split else ""
            parts.append(f"steps {start + 1}-{end} in {fitted} updates{lowered}")
        if parts:
            print_once(f"batch ramp: {', '.join(parts)}, each at the step's LR / sqrt(updates)")

    def optimizer_steps(self, step: int) -> tuple[float, float, dict, bool]:
        """Train on step ``step``'s rows: one optimizer update, or several sharing the rows in a batch ramp
        (``recovery.batch_ramp``, each at the step's LR / sqrt(split)), each kept or skipped by the spike guard.
        Returns the step's loss per token, mean gradient norm, loss terms, and whether every update was applied."""
        plan, accelerator = self.plan, self.accelerator
        split = plan.fit_split(update_split(self.config, step))
        step_rows = plan.rows(step, len(self.train_rows), self.config.train.seed)
        totals, tokens, norms, applied_all, refused = {}, 0, [], True, {}
        for update, micro_batches in enumerate(plan.update_rows(step_rows, split, accelerator.process_index)):
            loss, grad_norm, terms, count = self.forward_backward(step, micro_batches)
            with scaled_lr(self.optimizer, split**-0.5):
                applied, reason = apply_update(self.optimizer, accelerator.scaler, self.guard, loss, grad_norm)
            if reason:
                refused[update + 1] = reason
            self.optimizer.zero_grad(set_to_none=True)
            for name, value in {"loss": loss, **terms}.items():
                totals[name] = totals.get(name, 0.0) + value * count
            tokens, applied_all = tokens + count, applied_all and applied
            norms.append(grad_norm)
        if refused:  # one line a step, on the main process: not one per update of a batch ramp, nor per process
            numbers = ", ".join(map(str, refused))
            where = f"step {step + 1}" + (
                f" (update{'s' * (len(refused) > 1)} {numbers} of {split})" if split > 1 else ""
            )
            print_once(f"{where} not applied: {'; '.join(dict.fromkeys(refused.values()))}")
        means = {name: value / tokens for name, value in totals.items()}
        return means.pop("loss"), sum(norms) / len(norms), means, applied_all

    def forward_backward(self, step: int, micro_batches: list[list[int]]) -> tuple[float, float, dict, int]:
        """Forward/backward of one optimizer update's micro-batches (row indices) on this process, the loss
        normalised by the update's token count over all processes, then gradient clipping. Returns (loss per token,
        gradient norm, loss terms, that token count)."""
        accelerator, config, rows = self.accelerator, self.config, self.train_rows
        # accelerate syncs gradients (DDP) on the update's last micro-batch and divides the loss by their count
        accelerator.gradient_accumulation_steps, accelerator.step = len(micro_batches), 0
        device = accelerator.device
        local_tokens = sum(_loss_tokens(rows.rows(micro), config.train.objective) for micro in micro_batches)
        global_tokens = int(accelerator.reduce(torch.tensor(local_tokens, device=device), "sum"))
        # accelerate divides by the accumulation steps and DDP/FSDP average over processes: undo both, so the
        # gradient is exactly that of (sum of token losses) / global_tokens
        scale = accelerator.num_processes * len(micro_batches) / global_tokens
        sums: dict[str, torch.Tensor] = {"loss": torch.zeros((), device=device)}
        for micro in micro_batches:
            packed = rows.rows(micro)
            batch = Packed(packed.input_ids.to(device), packed.position_ids.to(device))
            cached = None if self.cache is None else tuple(t.to(device) for t in self.cache.rows(micro))
            with accelerator.accumulate(self.model), accelerator.autocast():
                guide = guide_weight(config, step)
                parts = micro_batch_loss(
                    self.model, self.unwrapped, batch, config, self.teacher, cached, self.head_in_forward, guide
                )
                accelerator.backward(parts.total * scale)
            sums["loss"] += parts.total.detach()
            for name, value in parts.terms.items():
                sums[name] = sums.get(name, 0) + value
        reduced = {name: float(accelerator.reduce(value, "sum")) / global_tokens for name, value in sums.items()}
        grad_norm = self.clip_gradients(config.train.grad_clip or math.inf)
        loss = reduced.pop("loss")
        return loss, grad_norm, reduced if len(reduced) > 1 else {}, global_tokens  # one term: the loss itself

    def clip_gradients(self, max_norm: float) -> float:
        """Global gradient norm before clipping; under expert parallelism the gradients are first reduced over the
        processes holding each parameter (as DDP would for a replicated one)."""
        if not self.parallel:
            return float(self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm))
        from fcsd.parallel.training import reduce_and_clip

        return reduce_and_clip(self.model, max_norm)

    def throughput(self, done: int) -> float:
        return self.config.train.batch_tokens * (done - self.start_step) / (time.perf_counter() - self.started)

    def log_step(self, done: int, loss: float, lr: float, grad_norm: float, terms: dict, skipped: bool) -> None:
        if done % self.config.train.log_every and not skipped and done != self.plan.total_steps:
            return
        record = {"step": done, "train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm}
        record.update({"train/tokens": self.tokens_seen, "train/tokens_per_s": self.throughput(done)})
        record["train/skipped"] = skipped
        record.update({f"train/{name}": value for name, value in terms.items()})
        if self.parallel:
            from fcsd.parallel.training import take_traffic

            record.update(take_traffic(self.unwrapped))  # this process's rows since the last logged step
        self.metrics.log(record)

    def evaluate(self, step: int) -> dict:
        """Held-out KL and NLL at ``step``, logged."""
        held_offset = len(self.train_rows)  # held-out rows follow the training rows in a teacher cache
        with evaluation_weights(self.optimizer), self.accelerator.autocast():
            result = heldout_metrics(
                self.unwrapped, self.held_rows, self.config, self.teacher, self.cache, held_offset, self.head_in_forward
            )
        self.metrics.log({"step": step, **result})
        return result

    def early_stop_check(self, step: int) -> bool:
        """MBPP+ at ``step``; saves ``best/`` on a new best; True when patience is exhausted."""
        with evaluation_weights(self.optimizer):  # the weights scored are the ones best/ keeps
            return self._early_stop_check(step)

    def _early_stop_check(self, step: int) -> bool:
        accelerator, early = self.accelerator, self.early
        with accelerator.autocast():  # bf16 generation on GPU
            synced = self.head_in_forward or self.parallel  # sharded weights or collectives: ranks step together
            decision = early.evaluate(accelerator, self.unwrapped, self.tokenizer, step, synced)
        scores = early.scores[str(step)]
        self.metrics.log({"step": step, "early_stop/mbpp_plus": scores["plus"], "early_stop/mbpp_base": scores["base"]})
        print_once(
            f"step {step}: MBPP+ pass@1 {scores['plus']:.1f} (base {scores['base']:.1f}); best "
            f"{early.rule.best_score:.1f} at step {early.rule.best_step}; "
            f"{early.rule.evals_without_improvement}/{early.config.patience} evaluations without a gain > "
            f"{early.config.min_delta} points"
        )
        if decision.new_best:
            self.save_model(self.run.best, {"step": step, "mbpp_plus": scores["plus"], "mbpp_base": scores["base"]})
        return decision.stop

    def save_model(self, folder: Path, record: dict) -> None:
        """``final/`` or ``best/`` in the stock layout (a collective: under a parallel layout the weights are
        streamed, one tensor gathered at a time, :mod:`fcsd.parallel.stream_save`)."""
        main = self.accelerator.is_main_process
        state_dict = None if self.parallel else self.accelerator.get_state_dict(self.model)
        if self.parallel or main:
            save_model(self.unwrapped, state_dict, self.tokenizer, self.config, folder, record, is_main=main)

    def save_checkpoint(self, done: int) -> None:
        state = {"step": done, "tokens": self.tokens_seen, "guard": self.guard.state(), "eval_before": self.eval_before}
        state["data"], state["inputs"] = self.data_fingerprint, self.inputs
        state["early_stop"] = self.early.state() if self.early is not None else None
        state["nonfinite_streak"] = self.nonfinite.streak
        ep_state = (self.model, self.optimizer) if self.parallel else None
        if self.parallel:
            from fcsd.parallel.step_state import layout_record

            state["layout"] = layout_record(self.model)
        save_checkpoint(self.accelerator, self.run, done, state, self.config.train.keep_checkpoints, ep_state)

    def finish(self, done: int) -> RunResult:
        """The last MBPP+ score, the final held-out figures, ``run_summary.json``, ``curves.png`` and ``final/``."""
        with evaluation_weights(self.optimizer):  # a schedule-free run scores and saves its average
            return self._finish(done)

    def _finish(self, done: int) -> RunResult:
        accelerator, run = self.accelerator, self.run
        check_weights_finite(self.unwrapped, accelerator, done, run)  # nothing is scored or saved from NaN weights
        if self.early is not None and not self.early.evaluated(done):
            self.early_stop_check(done)  # the final score (it may be the best)
        eval_after = self.evaluate(done)
        print_once(
            f"final: {kl_name(eval_after)} {kl_of(eval_after):.4f} (step 0: {kl_of(self.eval_before):.4f}), "
            f"NLL {eval_after['eval/nll']:.4f}"
        )
        early_summary = self.early.summary() if self.early is not None else None
        self.save_model(run.final, {"step": done})  # before the summary: a run with a summary is a finished run
        if accelerator.is_main_process:
            summary = {"steps": done, "eval_before": self.eval_before, "eval_after": eval_after}
            summary["data"] = self.data_summary
            if early_summary is not None:
                summary["early_stop"] = early_summary
            run_io.write_summary(run, summary)
            run_io.plot_curves(self.metrics.records(), run.curves, f"FCSD: {self.config.model.name}")
        self.metrics.close()
        accelerator.wait_for_everyone()
        best = run.best if self.early is not None else None
        return RunResult(
            run.root, run.final, done, self.eval_before, eval_after, self.data_summary, early_summary, best
        )


def _fill_deepspeed_config(accelerator, plan, grad_clip: float) -> None:
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
