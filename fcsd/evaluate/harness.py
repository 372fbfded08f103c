"""lm-evaluation-harness on a loaded model, FarSkip connectivity included (paper Table 1).

The model is loaded by fcsd (:func:`fcsd.from_pretrained` applies the checkpoint's FarSkip layers) and handed to
lm-eval's ``HFLM`` as an object, so lm-eval never reloads it with stock connectivity. lm-eval takes one few-shot
count and one chat-template setting per call: the suite's tasks are grouped by those settings and the calls' results
merged back into one dict with lm-eval's layout.
"""

from __future__ import annotations

import os

from fcsd.evaluate.suites import CUSTOM_SUITE, SuiteConfig

MERGED_KEYS = ("results", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples")


def load_for_eval(ref: str, device: str | None = None, dtype: str = "auto"):
    """(model, tokenizer) of ``ref`` with its FarSkip connectivity applied, in eval mode (on CUDA placed by
    ``device_map="auto"``)."""
    import torch

    from fcsd.connectivity.families import text_model
    from fcsd.loading import from_pretrained, tokenizer_from_pretrained
    from fcsd.sources import resolve_checkpoint

    path = resolve_checkpoint(ref)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    options = {"dtype": dtype if dtype == "auto" else getattr(torch, dtype)}
    if device == "cuda":  # load straight onto the GPUs, spread over all visible ones when one is too small
        options["device_map"] = "auto"
    model = from_pretrained(path, **options)
    model = text_model(model)  # a multimodal checkpoint (Llama-4) is scored through its text model
    if device != "cuda":
        model = model.to(device)
    return model.eval(), tokenizer_from_pretrained(path)


# Task-name prefixes of code benchmarks scored by running model-written code, whatever a suite says about them.
CODE_TASK_PREFIXES = ("humaneval", "mbpp", "ds1000", "apps", "bigcodebench", "livecodebench", "instructhumaneval")


def runs_code(task: str, marked: bool = False, manager=None) -> bool:
    """Whether scoring ``task`` runs model-written code: the suite's own ``code_execution`` mark, a known code
    benchmark, or lm-eval's ``unsafe_code: true`` in the task's YAML (when its task index is at hand)."""
    if marked or task.lower().startswith(CODE_TASK_PREFIXES):
        return True
    info = getattr(manager, "task_index", {}).get(task) if manager is not None else None
    yaml_path = info.get("yaml_path") if isinstance(info, dict) else None
    if isinstance(yaml_path, str) and os.path.exists(yaml_path):
        with open(yaml_path) as handle:
            return any(line.replace(" ", "").startswith("unsafe_code:true") for line in handle)
    return False


def check_code_execution(suite: SuiteConfig, allowed: bool, manager=None) -> None:
    """Refuse, before any model is loaded, a suite that runs model-written code without the opt-in (decided from
    the tasks themselves, not only from the suite's marks, so that ``--tasks`` cannot bypass it)."""
    risky = [t.task for t in suite.tasks if runs_code(t.task, t.code_execution, manager)]
    if risky and not allowed:
        what = f"--tasks {','.join(risky)}" if suite.name == CUSTOM_SUITE else f"suite {suite.name!r}"
        other = "other --tasks" if suite.name == CUSTOM_SUITE else "tasks with --tasks"
        raise ValueError(
            f"{what} scores {', '.join(risky)} by running model-written code: add --allow-code-execution (lm-eval "
            f"then runs it in the `code_eval` metric's sandboxed subprocesses with timeouts, never in this process), "
            f"or choose {other}"
        )


def check_chat_template(refs: dict[str, str], suite: SuiteConfig) -> None:
    """Refuse, before any model is loaded, a suite whose tasks render their prompts with the chat template
    (``apply_chat_template``) for a model whose tokenizer has none: lm-eval would load the model and build its
    requests before transformers' own "chat_template is not set" (about 40 s for the demo). ``refs``: what is
    evaluated, ``{role: checkpoint}``; only tokenizers are read."""
    chat = [spec.task for spec in suite.tasks if spec.apply_chat_template]
    if not chat:
        return
    from fcsd.loading import tokenizer_from_pretrained
    from fcsd.sources import resolve_checkpoint

    for ref in dict.fromkeys(refs.values()):
        if getattr(tokenizer_from_pretrained(resolve_checkpoint(ref)), "chat_template", None):
            continue
        what = f"--tasks {','.join(chat)}" if suite.name == CUSTOM_SUITE else f"suite {suite.name!r}"
        raise ValueError(
            f"{what} renders the prompts of {', '.join(chat)} with the tokenizer's chat template, and {ref} has none "
            "(no chat_template in its tokenizer_config.json, no chat_template.jinja): evaluate a chat model, give its "
            "tokenizer a chat template, or choose tasks without one (--tasks NAME, without --chat-template)"
        )


def task_manager(suite: SuiteConfig, include_paths: list[str] = ()):
    """lm-eval's task index with the suite's and the user's include paths; unknown task names are an error."""
    from lm_eval.tasks import TaskManager

    paths = [*([suite.include_path] if suite.include_path else []), *include_paths]
    manager = TaskManager(include_path=paths or None)
    unknown = [t.task for t in suite.tasks if t.task not in manager.all_tasks]
    if unknown:
        raise ValueError(
            f"unknown lm-eval task(s) {unknown}; add --include-path DIR for local task YAML (`lm-eval ls tasks` "
            "lists the built-in ones)"
        )
    return manager


def run_suite(
    model,
    tokenizer,
    suite: SuiteConfig,
    include_paths: list[str] = (),
    limit: float | None = None,
    batch_size: int | str = 8,
    allow_code_execution: bool = False,
    log_samples: bool = False,
    manager=None,
) -> dict:
    """lm-eval results of ``model`` on the suite (lm-eval's result layout; one ``config`` block per call under
    ``config``). ``manager``: a :func:`task_manager` already built for the suite."""
    import lm_eval.evaluator
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from fcsd import quiet

    quiet.install()
    lm_eval.evaluator.get_git_commit_hash = quiet.git_commit_hash  # no "fatal: not a git repository" outside git
    check_code_execution(suite, allow_code_execution)
    manager = manager or task_manager(suite, include_paths)
    check_code_execution(suite, allow_code_execution, manager)
    if allow_code_execution:
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"  # the opt-in HF `evaluate`'s code_eval asks for
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(model.device))
    groups: dict[tuple, list[str]] = {}
    for spec in suite.tasks:
        groups.setdefault((spec.num_fewshot, spec.apply_chat_template), []).append(spec.task)
    merged: dict = {key: {} for key in MERGED_KEYS}
    merged["config"] = []
    for (num_fewshot, use_chat), tasks in groups.items():
        out = simple_evaluate(
            model=lm,
            tasks=tasks,
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            apply_chat_template=use_chat,
            fewshot_as_multiturn=use_chat,
            confirm_run_unsafe_code=allow_code_execution,
            log_samples=log_samples,
        )
        if out is None:  # lm-eval keeps results on local rank 0: evaluation belongs to the main process
            raise RuntimeError(
                "lm-eval returned no results on this process: in a multi-process job evaluate from the main process "
                "only (fcsd.evaluate.report.evaluate_and_report does)"
            )
        for key in MERGED_KEYS:
            merged[key].update(out.get(key) or {})
        merged["config"].append({**out["config"], "tasks": tasks, "apply_chat_template": use_chat})
        if log_samples:
            merged.setdefault("samples", {}).update(out.get("samples") or {})
        for key in ("lm_eval_version", "transformers_version", "date"):
            merged[key] = out.get(key)
    return merged


def task_score(results: dict, spec) -> float:
    """The suite column's score in percent: ``spec.metric`` (``metric,filter``; a bare metric name takes its first
    filter) or the task's first metric."""
    row = results["results"].get(spec.task)
    if row is None:
        raise KeyError(f"lm-eval returned no result for {spec.task}")
    metrics = [k for k in row if "," in k and "_stderr" not in k and isinstance(row[k], (int, float))]
    if spec.metric:
        wanted = spec.metric if "," in spec.metric else f"{spec.metric},"
        metrics = [k for k in metrics if k == wanted or (wanted.endswith(",") and k.startswith(wanted))]
    if not metrics:
        raise KeyError(f"{spec.task}: no metric {spec.metric!r} among {sorted(row)}")
    return 100.0 * float(row[metrics[0]])


def evaluate_checkpoints(refs: dict[str, str], suite: SuiteConfig, device: str | None = None, dtype="auto", **options):
    """lm-eval results per label (e.g. ``{"original": base, "converted": model}``), one model in memory at a time,
    all under identical settings."""
    import gc

    import torch

    from fcsd.sources import resolve_checkpoint

    check_code_execution(suite, options.get("allow_code_execution", False))
    options["manager"] = task_manager(suite, options.get("include_paths", ()))  # before any model is loaded
    check_code_execution(suite, options.get("allow_code_execution", False), options["manager"])
    results = {}
    for label, ref in refs.items():
        model, tokenizer = load_for_eval(ref, device, dtype)
        print(f"fcsd eval: {label} = {ref} ({resolve_checkpoint(ref)})")
        results[label] = run_suite(model, tokenizer, suite, **options)
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results
