"""Early stopping on a validation score (paper Sec. 3.1, 5.1: MBPP+ every 1000 steps, patience 20, delta 2%).

The rule follows PyTorch Lightning's ``EarlyStopping`` + ``ModelCheckpoint`` pair:

- the *best checkpoint* is the one with the highest score seen so far (any strict increase replaces it);
- the *patience* counter resets only when a score beats the reference by more than ``min_delta`` **absolute**
  points (pass@1 in percent: 2.0 means 2 percentage points, not 2 % of the score); the reference is the score of the
  last such significant improvement (the first evaluation sets it). ``patience`` evaluations in a row without one
  stop the run.

The whole state is a small dict, saved in every training checkpoint so that ``--resume`` continues the count.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Decision:
    """What one evaluation means for the run."""

    step: int
    score: float
    new_best: bool  # save this state as the best checkpoint
    significant: bool  # beat the reference by more than min_delta: the patience counter was reset
    stop: bool  # patience exhausted: stop training now


@dataclass
class EarlyStopping:
    """The early-stopping state machine; ``update`` takes one evaluation, ``state``/``from_state`` round-trip it."""

    patience: int
    min_delta: float
    best_score: float | None = None
    best_step: int | None = None
    reference: float | None = None
    evals_without_improvement: int = 0
    history: list[list[float]] = field(default_factory=list)  # [step, score] of every evaluation
    stopped_at: int | None = None

    def __post_init__(self):
        if self.patience < 1:
            raise ValueError(f"early_stop.patience={self.patience}: it must be at least 1 evaluation")
        if self.min_delta < 0:
            raise ValueError(f"early_stop.min_delta={self.min_delta}: it must be >= 0 (absolute points)")

    def update(self, step: int, score: float) -> Decision:
        self.history.append([step, score])
        new_best = self.best_score is None or score > self.best_score
        if new_best:
            self.best_score, self.best_step = score, step
        significant = self.reference is None or score - self.reference > self.min_delta
        if significant:
            self.reference, self.evals_without_improvement = score, 0
        else:
            self.evals_without_improvement += 1
        stop = self.evals_without_improvement >= self.patience
        if stop:
            self.stopped_at = step
        return Decision(step, score, new_best, significant, stop)

    def state(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> EarlyStopping:
        return cls(**state)


class MBPPPlusEarlyStop:
    """The trainer's MBPP+ early stopping (``early_stop.*``): problems loaded up front (a missing dataset fails the
    run before training), generation spread over all processes, evalplus scoring on the main process, and one
    decision broadcast to every process."""

    def __init__(self, config, state: dict | None = None):
        from fcsd.evaluate.mbpp_plus import load_problems

        self.config = config
        self.problems = load_problems(config.data, config.limit)
        self.rule = EarlyStopping(config.patience, config.min_delta)
        self.scores: dict[str, dict] = {}  # step -> {"base": pass@1, "plus": pass@1}
        if state:
            self.load(state)

    def load(self, state: dict) -> None:
        rule = {**state["rule"], "patience": self.config.patience, "min_delta": self.config.min_delta}
        self.rule, self.scores = EarlyStopping.from_state(rule), dict(state["scores"])

    def state(self) -> dict:
        return {"rule": self.rule.state(), "scores": self.scores}

    def evaluated(self, step: int) -> bool:
        return str(step) in self.scores

    def evaluate(self, accelerator, model, tokenizer, step: int, synced_gpus: bool = False) -> Decision:
        """Score ``model`` (unwrapped) at ``step`` on every process; all processes get the same decision."""
        from accelerate.utils import broadcast_object_list, gather_object

        from fcsd.evaluate.mbpp_plus import generate_solutions, score_solutions

        items = list(self.problems.items())
        world, rank = accelerator.num_processes, accelerator.process_index
        per_rank = -(-len(items) // world)
        mine = items[rank * per_rank : (rank + 1) * per_rank]
        # every process makes the same number of generate calls (sharded parameters are gathered collectively)
        mine += [(f"pad-{i}", items[0][1]) for i in range(per_rank - len(mine))]
        config = self.config
        local = generate_solutions(
            model, tokenizer, dict(mine), config.max_new_tokens, config.batch_size, synced_gpus=synced_gpus
        )
        solutions = {}
        for part in gather_object([local]) if world > 1 else [local]:
            solutions.update({task: code for task, code in part.items() if task in self.problems})
        payload = [None]
        if accelerator.is_main_process:
            score = score_solutions(self.problems, solutions)
            self.scores[str(step)] = {"base": score.base, "plus": score.plus}
            payload = [(self.rule.update(step, score.metric(config.metric)), self.state())]
        if world > 1:
            broadcast_object_list(payload, from_process=0)
        decision, state = payload[0]
        self.load(state)
        return decision

    def summary(self) -> dict:
        """The run report's block: step-0, final and best scores, where it stopped, every evaluation."""
        steps = sorted(self.scores, key=int)
        return {
            "metric": f"mbpp_{self.config.metric}_pass@1",
            "problems": len(self.problems),
            "min_delta_absolute_points": self.config.min_delta,
            "patience": self.config.patience,
            "step_0": self.scores.get("0"),
            "final": self.scores[steps[-1]] if steps else None,
            "best_step": self.rule.best_step,
            "best_score": self.rule.best_score,
            "stopped_at": self.rule.stopped_at,
            "scores": {step: self.scores[step] for step in steps},
        }
