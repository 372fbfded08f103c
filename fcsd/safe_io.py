"""Writing folders so that nothing half-written is ever visible: stage beside the target, then rename."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_dir(target: Path):
    """Yield a staging folder beside ``target``; on success it replaces ``target`` in one rename."""
    staging = target.with_name(f".{target.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = target.with_name(f".{target.name}.old")
    if target.exists():
        os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)


# Overwrite guards: fcsd only ever removes a folder it wrote. Every run folder, export folder and teacher cache gets
# this small marker first; a folder without it is never cleared, whatever `overwrite` says.
MARKER = ".fcsd-output"


def mark(folder: Path, kind: str) -> None:
    """Write the marker that says ``folder`` (a ``run``, ``export`` or ``teacher-cache``) was written by fcsd."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / MARKER
    if not marker.exists():
        marker.write_text(f"{kind}\n")


def is_marked(folder: Path) -> bool:
    return (Path(folder) / MARKER).is_file()


def is_empty(folder: Path) -> bool:
    folder = Path(folder)
    return not folder.exists() or (folder.is_dir() and not any(folder.iterdir()))


def clear_written(folder: Path, what: str, how_to_keep: str) -> None:
    """Remove ``folder`` only if fcsd wrote it (it holds the marker); else a one-line error naming the fix."""
    folder = Path(folder)
    if is_empty(folder):
        return
    if not folder.is_dir():
        raise ValueError(f"{what} {folder} is a file, not a folder; choose another {what}")
    if not is_marked(folder):
        raise ValueError(
            f"{what} {folder} holds files fcsd did not write (no {MARKER} marker), so overwrite will not remove "
            f"them; {how_to_keep}"
        )
    shutil.rmtree(folder)


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_not_an_input(target: Path, what: str, inputs: dict[str, str | Path | None]) -> None:
    """Refuse a ``target`` folder (to be written, maybe cleared) that is, contains or lies inside one of ``inputs``
    (name -> local path; hub ids and None are skipped), the current folder or the home folder."""
    target = Path(target).expanduser().resolve()
    named = {name: Path(str(p)).expanduser() for name, p in inputs.items() if p}
    for name, path in named.items():
        if not path.exists():
            continue
        path = path.resolve()
        if _inside(target, path) or _inside(path, target):
            relation = "is" if target == path else ("lies inside" if _inside(target, path) else "contains")
            raise ValueError(f"{what} {target} {relation} the {name} {path}; choose a separate, new {what}")
    for name, path in (("current folder", Path.cwd().resolve()), ("home folder", Path.home().resolve())):
        if _inside(path, target):
            relation = "is" if target == path else "contains"
            raise ValueError(f"{what} {target} {relation} the {name}; choose a new folder, e.g. outputs/my-run")
