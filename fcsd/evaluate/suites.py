"""Evaluation suites: which lm-eval tasks make a report, with which metric, few-shot and chat-template settings.

A suite is a YAML file under ``eval/suites/`` (``paper`` = the 11 tasks of the paper's Table 1, ``quick`` = a smoke
subset, ``demo`` = the offline demo tasks), validated against :class:`SuiteConfig`; ``--tasks a,b`` builds an ad-hoc
suite with each task's own defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import MISSING


@dataclass
class TaskSpec:
    task: str = MISSING  # lm-eval task (or group) name
    column: str | None = None  # column title in the report; None: the task name
    metric: str | None = None  # lm-eval result key "metric,filter"; None: the first metric lm-eval reports
    num_fewshot: int | None = None  # None: the task's own default
    apply_chat_template: bool = False  # render prompts with the tokenizer's chat template
    code_execution: bool = False  # scores by running model-written code (needs --allow-code-execution)


@dataclass
class SuiteConfig:
    name: str = MISSING
    description: str = ""
    include_path: str | None = None  # folder of local task YAML, relative to the suite file
    tasks: list[TaskSpec] = field(default_factory=list)


def eval_dir() -> Path:
    """``$FCSD_EVAL``, else the ``eval/`` folder of the source tree."""
    return Path(os.environ.get("FCSD_EVAL", Path(__file__).resolve().parents[2] / "eval"))


def suite_names() -> list[str]:
    return sorted(path.stem for path in (eval_dir() / "suites").glob("*.yaml"))


def load_suite(name_or_path: str) -> SuiteConfig:
    """A suite by name (``eval/suites/<name>.yaml``) or by YAML path; unknown keys and wrong types are errors."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(name_or_path)
    if not path.suffix:
        path = eval_dir() / "suites" / f"{name_or_path}.yaml"
    if not path.exists():
        raise ValueError(f"unknown suite {name_or_path!r}: choose from {suite_names()} or give a suite YAML file")
    try:
        suite = OmegaConf.merge(OmegaConf.structured(SuiteConfig), OmegaConf.load(path))
        suite = OmegaConf.to_object(suite)
    except OmegaConfBaseException as error:
        raise ValueError(f"suite {path}: {error}".splitlines()[0]) from error
    if suite.include_path:
        suite.include_path = str((path.parent / suite.include_path).resolve())
    if not suite.tasks:
        raise ValueError(f"suite {path} lists no tasks")
    return suite


CUSTOM_SUITE = "custom"  # the name of the suite `--tasks` makes


def suite_from_tasks(names: str) -> SuiteConfig:
    """The ad-hoc suite of ``--tasks a,b,c``."""
    tasks = [TaskSpec(task=name.strip()) for name in names.split(",") if name.strip()]
    if not tasks:
        raise ValueError("--tasks: give lm-eval task names separated by commas, e.g. --tasks arc_easy,piqa")
    return SuiteConfig(name=CUSTOM_SUITE, tasks=tasks)
