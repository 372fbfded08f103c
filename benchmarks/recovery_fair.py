"""The fair recovery benchmark's parts, used by ``benchmarks/recovery.py --fair``: the declared teachers,
the prose corpus, the per-recipe LR sweep and its report.

* Teachers are a table fixed before any recipe runs: ``chosen`` ones (the recipes were chosen on them) and
  ``reported`` ones (held out: the recipes never saw them). Each is rebuilt deterministically from its seed.
* The prose corpus is the documentation installed packages ship (their long descriptions and ``*.md`` / ``*.rst``
  files), read in a fixed order; its size and SHA-256 digest go into every result so a rerun can tell whether it read
  the same text.
* Every recipe, plain included, gets an LR sweep at the short budget; each is compared at its own best LR.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Teacher:
    """One declared teacher: a tiny ``family`` model of the given sizes pretrained ``steps`` steps on ``corpus``
    (``code``: the standard library's source; ``prose``: installed packages' documentation)."""

    name: str
    family: str  # qwen3_moe or deepseek_v2
    corpus: str  # code or prose
    steps: int  # pretraining steps of 2,048 tokens
    role: str  # chosen (the recipes were chosen on it) or reported (held out)
    hidden: int = 64
    layers: int = 4
    experts: int = 8
    top_k: int = 2
    moe_intermediate: int = 64
    seed: int = 0

    def sizes(self) -> dict:
        """The size overrides of ``tiny_config`` for this teacher."""
        return {
            "hidden": self.hidden,
            "layers": self.layers,
            "experts": self.experts,
            "top_k": self.top_k,
            "moe_intermediate": self.moe_intermediate,
        }

    def spec(self) -> dict:
        """Everything that determines the teacher (a result recorded for another spec is not reused)."""
        return asdict(self)


# Fixed before any recipe of the fair benchmark ran. The chosen two are the teachers every earlier recovery figure used.
TEACHERS = {
    t.name: t
    for t in (
        Teacher("qwen3_moe", "qwen3_moe", "code", 1500, "chosen"),
        Teacher("deepseek_v2", "deepseek_v2", "code", 1500, "chosen"),
        Teacher("qwen3_moe-prose", "qwen3_moe", "prose", 1500, "reported", hidden=96, experts=16, top_k=4),
        Teacher(
            "deepseek_v2-prose", "deepseek_v2", "prose", 4500, "reported", hidden=96, layers=3, moe_intermediate=96
        ),
    )
}
ROLES = ("chosen", "reported")


def teachers_named(names: str) -> list[Teacher]:
    """The declared teachers of a comma-separated list (``all``: every one, reported first)."""
    if names == "all":
        return sorted(TEACHERS.values(), key=lambda t: ROLES.index(t.role), reverse=True)
    unknown = [n for n in names.split(",") if n not in TEACHERS]
    if unknown:
        raise SystemExit(f"unknown teacher {unknown[0]!r}: declared are {', '.join(TEACHERS)}")
    return [TEACHERS[n] for n in names.split(",")]


# ---------------------------------------------------------------------------------------------------------------
# The prose corpus

SKIP_NAMES = ("LICENSE", "LICENCE", "COPYING", "AUTHORS", "NOTICE", "CHANGELOG", "CHANGES", "HISTORY")
# fcsd's own long description is its README as installed: it changed the corpus with every commit that touched the
# README (and holds this benchmark's results)
SKIP_PACKAGES = ("fcsd",)


def metadata_body(text: str) -> str:
    """The long description of a ``METADATA`` file: what follows the header's first blank line."""
    head, _, body = text.partition("\n\n")
    return body.strip() if head else ""


def prose_files(root: Path) -> list[Path]:
    """Documentation files under ``root`` (a site-packages folder), sorted: ``*.dist-info/METADATA`` (their long
    descriptions), ``*.md`` and ``*.rst``, without licences and change logs and files over 200 kB."""
    found = set(root.glob("*.dist-info/METADATA")) | set(root.rglob("*.md")) | set(root.rglob("*.rst"))
    kept = []
    for path in sorted(found):
        if path.name.upper().startswith(SKIP_NAMES) or not path.is_file() or path.stat().st_size > 200_000:
            continue
        kept.append(path)
    return kept


def package_of(root: Path, path: Path) -> str:
    """The distribution a file under ``root`` belongs to (``awscli-1.0.dist-info`` and ``awscli/`` are both
    ``awscli``)."""
    return path.relative_to(root).parts[0].split("-")[0].removesuffix(".dist").lower()


def prose_documents(root: Path, max_chars: int, min_chars: int = 500, package_share: float = 0.15) -> list[str]:
    """Documents of at least ``min_chars`` characters from :func:`prose_files` (none of :data:`SKIP_PACKAGES`), in an
    order shuffled with a fixed seed, until ``max_chars`` characters, at most ``package_share`` of them from one
    package (one package's documentation, e.g. a command line tool's thousands of examples, would otherwise be most
    of the text); the same files give the same list."""
    files = prose_files(root)
    random.Random(0).shuffle(files)
    documents, total, per_package = [], 0, {}
    for path in files:
        text = path.read_text(errors="replace")
        text = metadata_body(text) if path.name == "METADATA" else text.strip()
        package = package_of(root, path)
        if (
            package in SKIP_PACKAGES
            or len(text) < min_chars
            or per_package.get(package, 0) + len(text) > package_share * max_chars
        ):
            continue
        per_package[package] = per_package.get(package, 0) + len(text)
        documents.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return documents


def site_packages() -> Path:
    """The folder the prose corpus is read from: this interpreter's site-packages."""
    return Path(sysconfig.get_paths()["purelib"])


def digest(path: Path) -> dict:
    """The size (bytes, documents) and SHA-256 of a ``jsonl`` text file, to tell whether a rerun read the same text."""
    data = path.read_bytes()
    return {"bytes": len(data), "documents": data.count(b"\n"), "sha256": hashlib.sha256(data).hexdigest()}


# ---------------------------------------------------------------------------------------------------------------
# The LR sweep


def lr_tag(lr: float) -> str:
    """A file-name form of an LR (``1e-3`` -> ``0.001``)."""
    return f"{lr:g}"


def best_lr(kls: dict[float, float]) -> tuple[float, str | None]:
    """The LR with the lowest final held-out KL and whether it sits at an edge of the LRs swept (``low`` /
    ``high``; None: inside, with a neighbour on either side)."""
    if len(kls) < 2:
        raise ValueError(f"an LR sweep needs at least two LRs, got {len(kls)}")
    lrs = sorted(kls)
    best = min(lrs, key=lambda lr: (kls[lr], lr))
    return best, "low" if best == lrs[0] else "high" if best == lrs[-1] else None


def extension(kls: dict[float, float], factor: float) -> float | None:
    """The next LR to try when the best one is at an edge of the sweep (one ``factor`` beyond it), else None."""
    best, edge = best_lr(kls)
    return None if edge is None else best / factor if edge == "low" else best * factor


def flatness(kls: dict[float, float]) -> dict[float, float]:
    """The final KL of the best LR's neighbours in the sweep, each relative to the best's (1.05: 5% higher)."""
    best, _ = best_lr(kls)
    lrs = sorted(kls)
    at = lrs.index(best)
    return {lr: kls[lr] / kls[best] for lr in lrs[max(0, at - 1) : at + 2] if lr != best}


def final_kl(result: dict) -> float:
    """The held-out KL at the end of a run."""
    return result["curve"][-1][1]


def sweep_table(results: list[dict], teacher: str, recipe: str, steps: int) -> dict[float, dict]:
    """The runs of ``recipe`` on ``teacher`` at ``steps`` steps, by their ``train.lr``."""
    return {r["lr"]: r for r in results if r["teacher"] == teacher and r["recipe"] == recipe and r["steps"] == steps}


def best_run(results: list[dict], teacher: str, recipe: str, steps: int) -> dict | None:
    """``recipe``'s run on ``teacher`` at ``steps`` steps with the lowest final KL: a long budget's only run (at the
    short sweep's best LR) or the best of the LRs run at it (None: no run)."""
    table = sweep_table(results, teacher, recipe, steps)
    return min(table.values(), key=lambda run: (final_kl(run), run["lr"])) if table else None  # a tie: the lower LR


def kl_at_step(result: dict, step: int) -> float | None:
    """The held-out KL at ``step`` (None: not evaluated there)."""
    return next((kl for s, kl, _ in result["curve"] if s == step), None)


def first_step_at(result: dict, target: float) -> int | None:
    """The first step ``result`` scored a held-out KL at or below ``target`` (None: never)."""
    return next((s for s, kl, _ in result["curve"] if kl <= target), None)


def tokens_ratio(result: dict, target: float, budget_steps: int) -> float | None:
    """Steps of ``result`` to its first held-out KL at or below ``target``, as a share of ``budget_steps`` (None:
    never reached)."""
    step = first_step_at(result, target)
    return None if step is None else step / budget_steps


def recipe_sweep(results: list[dict], teacher: str, recipe: str, steps: int, scale: float) -> dict | None:
    """One recipe's sweep on ``teacher`` at ``steps`` steps, as both reports print it: ``table`` (runs by LR),
    ``swept`` (effective LR: final KL, ascending), ``lr`` (the best, or the only one), ``edge`` and ``flat`` (the
    neighbours' KL relative to the best's; empty with one LR). None: no run yet."""
    table = sweep_table(results, teacher, recipe, steps)
    if not table:
        return None
    kls = {lr: final_kl(run) for lr, run in table.items()}
    swept = ", ".join(f"{lr * scale:g}: {kls[lr]:.4f}" for lr in sorted(kls))
    lr, edge = best_lr(kls) if len(kls) >= 2 else (next(iter(kls)), None)
    flat = flatness(kls) if len(kls) >= 2 else {}
    return {"table": table, "swept": swept, "lr": lr, "edge": edge, "flat": flat}


def _ratio(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.2f}x"


def _other_lr(run: dict, lr: float, scale: float) -> str:
    """`` (at LR)`` when ``run`` is not at ``lr`` (a long run at another LR than the short sweep's best)."""
    return "" if math.isclose(run["lr"], lr) else f" (at {run['lr'] * scale:g})"


def _agreement(result: dict) -> str:
    rows = result.get("agreement") or []
    if not rows:
        return ""
    _, acc, teacher_acc, agree = rows[-1]
    return f"  acc {acc:.3f} (teacher {teacher_acc:.3f}) top-1 agree {agree:.3f}"


def fair_report(
    results: list[dict],
    teachers: dict[str, Teacher],
    short: int,
    long: int,
    default: str = "guided",
    baseline: str = "plain",
    lr_scales: dict[str, float] | None = None,
) -> list[str]:
    """Per teacher: each recipe's sweep (final KL per LR, the best, an edge, the neighbours' KL relative to the
    best), then ``default`` at its best LR against ``baseline`` at its best: the share of the baseline's tokens the
    default needs to reach the baseline's ``short``-step KL (and, where ``long``-step runs exist, its ``long``-step
    KL), and both final KLs. A summary over the ``reported`` teachers only closes it."""
    lr_scales = lr_scales or {}
    lines, summary = [], []
    for name, spec in teachers.items():
        mine = [r for r in results if r["teacher"] == name]
        if not mine:
            continue
        lines.append(
            f"{name} ({spec.role}; {spec.family}, {spec.corpus}, hidden {spec.hidden}, {spec.layers} layers, "
            f"{spec.experts} experts top-{spec.top_k}, pretrained {spec.steps} steps)"
        )
        best = {}
        for recipe in dict.fromkeys(r["recipe"] for r in mine):
            scale = lr_scales.get(recipe, 1.0)
            sweep = recipe_sweep(mine, name, recipe, short, scale)
            if sweep is None:
                continue
            lr, edge = sweep["lr"], sweep["edge"]
            best[recipe] = sweep["table"][lr]
            if not sweep["flat"]:
                lines.append(f"  {recipe:10s} effective LR {sweep['swept']} (one LR: no sweep yet)")
                continue
            flat = ", ".join(f"{other * scale:g}: {ratio:.3f}" for other, ratio in sweep["flat"].items())
            lines.append(
                f"  {recipe:10s} effective LR (train.lr x {scale:g}) -> KL@{short}: {sweep['swept']}; best "
                f"{lr * scale:g}"
                + (f" AT THE {edge.upper()} EDGE" if edge else "")
                + f"; neighbours / best: {flat}{_agreement(best[recipe])}"
            )
        if default not in best or baseline not in best:
            lines.append(f"  no {baseline} / {default} pair yet to compare")
            continue
        base, mine_best = best[baseline], best[default]
        target = final_kl(base)
        ratio = tokens_ratio(mine_best, target, short)
        text = (
            f"  {default} at its best LR vs {baseline} at its best: tokens to {baseline}'s KL@{short} "
            f"({target:.4f}): {_ratio(ratio)}; final KL@{short} {final_kl(mine_best):.4f} vs {target:.4f}"
        )
        row = {"teacher": name, "short": ratio}
        longs = [best_run(mine, name, r, long) for r in (baseline, default)]
        if all(longs):
            long_target = final_kl(longs[0])
            row["long"] = tokens_ratio(longs[1], long_target, long)
            row["long_short"] = tokens_ratio(longs[1], target, short)
            text += (
                f"; {long}-step runs: tokens to {baseline}'s KL@{long}"
                f"{_other_lr(longs[0], best[baseline]['lr'], lr_scales.get(baseline, 1.0))} ({long_target:.4f}): "
                f"{_ratio(row['long'])}, final KL {final_kl(longs[1]):.4f}"
                f"{_other_lr(longs[1], best[default]['lr'], lr_scales.get(default, 1.0))} vs {long_target:.4f} "
                f"({final_kl(longs[1]) / long_target - 1:+.1%})"
            )
        lines.append(text)
        if spec.role == "reported":
            summary.append(row)
    if summary:
        lines.append(
            "reported teachers only (the recipe was not chosen on them): "
            + "; ".join(
                f"{row['teacher']} {_ratio(row['short'])} of {baseline}'s tokens to its KL@{short}"
                + (f", {_ratio(row['long'])} to its KL@{long}" if "long" in row else "")
                for row in summary
            )
        )
    return lines


def save_result(folder: Path, result: dict) -> Path:
    """Write a run's record to ``folder/<teacher>/<recipe>-lr<lr>-<steps>.json`` (a small JSON, committed so that a
    later run of the sweep continues instead of repeating it)."""
    path = folder / result["teacher"] / f"{result['recipe']}-lr{lr_tag(result['lr'])}-{result['steps']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def load_results(folder: Path) -> list[dict]:
    """Every run record under ``folder``, sorted by path."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*/*.json"))]


def same_text(results: list[dict], baseline: str = "plain") -> tuple[list[dict], list[str]]:
    """The records each teacher's comparison may use: those made of the same teacher and text as most of its
    ``baseline`` records (a sweep continued after the text changed leaves older records beside the new ones), and a
    note for each record left out."""

    def made_of(r: dict) -> str:
        return json.dumps([r.get("teacher_spec"), r.get("digests")], sort_keys=True)

    sources: dict[str, list[str]] = {}
    for r in results:
        if r["recipe"] == baseline:
            sources.setdefault(r["teacher"], []).append(made_of(r))
    usual = {teacher: max(made, key=made.count) for teacher, made in sources.items()}  # most baseline records'
    kept, notes = [], []
    for r in results:
        if usual.get(r["teacher"], made_of(r)) == made_of(r):
            kept.append(r)
        else:
            notes.append(f"left out {r['teacher']}/{r['recipe']} at lr {r['lr']:g}, {r['steps']} steps: made of "
                         f"another teacher or text than its {baseline} runs (rerun it)")  # fmt: skip
    return kept, notes


def fair_table(
    results: list[dict],
    teachers: dict[str, Teacher],
    short: int,
    long: int,
    baseline: str = "plain",
    lr_scales: dict[str, float] | None = None,
) -> list[str]:
    """The report as Markdown rows, one per teacher and recipe: the effective LRs swept with their KL at ``short``
    steps, the best and its neighbours' KL relative to it, the best run's KL at a third of ``short``, at ``short``
    and (long run) at ``long``, the tokens it needs to reach the baseline's KL at each budget (as a share of the
    baseline's), and its held-out accuracy, the teacher's and their top-1 agreement at ``short``."""
    lr_scales = lr_scales or {}
    lines = [
        f"| teacher | recipe | effective LR: KL@{short} | best (neighbours / best) | KL near step {short // 3} "
        f"| KL@{short} | KL@{long} | tokens to {baseline}'s KL@{short} | tokens to {baseline}'s KL@{long} "
        f"| acc / teacher / top-1 agree @{short} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, spec in teachers.items():
        recipes = list(dict.fromkeys(r["recipe"] for r in results if r["teacher"] == name))
        recipes.sort(key=lambda r: r != baseline)
        sweeps = {recipe: recipe_sweep(results, name, recipe, short, lr_scales.get(recipe, 1.0)) for recipe in recipes}
        sweeps = {recipe: sweep for recipe, sweep in sweeps.items() if sweep is not None}
        if baseline not in sweeps:
            continue
        target = final_kl(sweeps[baseline]["table"][sweeps[baseline]["lr"]])
        base_long = best_run(results, name, baseline, long)
        first = True
        for recipe, sweep in sweeps.items():
            lr, edge, scale = sweep["lr"], sweep["edge"], lr_scales.get(recipe, 1.0)
            swept = sweep["swept"]
            if sweep["flat"]:
                flat = ", ".join(f"{v:.3f}" for v in sweep["flat"].values())
                chosen = f"{lr * scale:g}" + (f" ({edge} edge)" if edge else "") + f" ({flat})"
            else:
                chosen = f"{lr * scale:g} (one LR)"
            run = sweep["table"][lr]
            near = min(run["curve"], key=lambda point: (abs(point[0] - short // 3), point[0]))
            long_run = best_run(results, name, recipe, long)
            cells = [
                f"{name} ({spec.role})" if first else "",
                recipe,
                swept,
                chosen,
                f"{near[1]:.4f} (step {near[0]})",
                f"{final_kl(run):.4f}",
                "-" if long_run is None else f"{final_kl(long_run):.4f}" + _other_lr(long_run, lr, scale),
                _ratio(tokens_ratio(run, target, short)),
                "-"
                if long_run is None or base_long is None
                else _ratio(tokens_ratio(long_run, final_kl(base_long), long)),
                "/".join(f"{v:.3f}" for v in run["agreement"][-1][1:]) if run.get("agreement") else "-",
            ]
            lines.append("| " + " | ".join(cells) + " |")
            first = False
    return lines
