"""Who owns a folder fcsd writes, and how it is written so that nothing is lost or half-written.

One ownership model for every folder fcsd writes (run folders, exports, teacher caches, sweeps, evaluation reports,
probe, route-plot and profiler-trace outputs):

- The first thing fcsd writes in such a folder is the marker ``.fcsd-output``: JSON naming the folder's **kind** and
  the **manifest** of the entries fcsd wrote there (each writer records its entry).
- A command replaces or clears only a folder of **its own kind** (a run never replaces an export, an export never a
  run) and removes only **manifest entries** (plus its own staging leftovers). A folder that holds anything else is
  refused, in one line that names the foreign entries; nothing is removed. A folder without the marker is never
  replaced or cleared. Fcsd folders of another kind nested inside (a run's ``teacher-cache/``) are kept.
- One process at a time writes a folder: :func:`folder_lock` holds an exclusive lock for the whole command; a
  second command is refused naming the holder. Stale staging folders of a dead process are removed by the next
  holder of the lock.
- Folders are staged beside their target and renamed into place (:func:`atomic_dir`).
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

MARKER = ".fcsd-output"
LOCK = ".fcsd-lock"
KINDS = {
    "run": "run folder",
    "export": "export",
    "teacher-cache": "teacher cache",
    "sweep": "sweep folder",
    "eval": "evaluation report",
    "probe": "probe output",
    "plots": "plot folder",
    "trace": "profiler-trace folder",
}
KEPT_KINDS = ("teacher-cache",)  # an input of later runs: clearing the folder around it keeps it
# Markers written before the manifest existed hold only the kind: these names are what fcsd wrote in such folders.
LEGACY_NAMES = {
    "run": [
        "fcsd_config.yaml",
        "metrics.jsonl",
        "tensorboard",
        "curves.png",
        "run_summary.json",
        "checkpoints",
        "final",
        "best",
        "export",
        "eval",
        "eval_table.md",
        "sweep_status.json",
    ],  # fmt: skip
    "export": [
        "config.json",
        "generation_config.json",
        "*.safetensors",
        "*.safetensors.index.json",
        "tokenizer*",
        "special_tokens_map.json",
        "chat_template.jinja",
        "README.md",
        "*.py",
        "fcsd_export.json",
    ],  # fmt: skip
    "teacher-cache": ["meta.json", "shard-*.safetensors"],
}


_COMMAND: list[str] | None = None  # the fcsd command line being run (set by the CLI), for messages and the lock


def set_command(argv: list[str]) -> None:
    global _COMMAND
    _COMMAND = list(argv)


def command_line(*extra: str) -> str:
    """The fcsd command being run, as a shell line (``extra`` arguments appended): what a message tells the user to
    run again."""
    import shlex

    argv = _COMMAND if _COMMAND is not None else sys.argv[1:]
    return shlex.join(["fcsd", *argv, *extra])


def kind_name(kind: str) -> str:
    return KINDS.get(kind, kind)


def _a(name: str) -> str:
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, ``kill``), handled as Ctrl-C is: writes end cleanly, locks are released."""


def raise_terminated(signum, frame):
    """A SIGTERM handler: raise :class:`Terminated` where the process is."""
    raise Terminated


class FolderError(ValueError):
    """A folder fcsd must not write, replace or clear; the message names the folder, why, and the fix."""


@dataclass
class Marker:
    kind: str
    written: list[str] | None  # None: a marker from before manifests (see LEGACY_NAMES)

    def owns(self, name: str) -> bool:
        names = self.written if self.written is not None else LEGACY_NAMES.get(self.kind, [])
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in names)


def read_marker(folder: Path) -> Marker | None:
    """The marker of ``folder`` (None when fcsd did not write it)."""
    path = Path(folder) / MARKER
    if not path.is_file():
        return None
    text = path.read_text().strip()
    try:
        data = json.loads(text)
    except ValueError:
        return Marker(text or "run", None)
    return Marker(data.get("kind", "run"), list(data.get("written", [])))


def _write_marker(folder: Path, marker: Marker) -> None:
    staging = folder / f"{MARKER}.tmp{os.getpid()}"
    staging.write_text(json.dumps({"kind": marker.kind, "written": marker.written or []}) + "\n")
    os.replace(staging, folder / MARKER)


def mark(folder: Path, kind: str, written: list[str] | None = None) -> None:
    """Claim ``folder`` for ``kind`` (created if needed); an existing marker of the same kind is kept."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    marker = read_marker(folder)
    if marker is not None and marker.kind != kind:
        raise FolderError(f"{folder} is an fcsd {kind_name(marker.kind)}, not {_a(KINDS[kind])}")
    if marker is None or written is not None:
        _write_marker(folder, Marker(kind, sorted(set(written or []))))


def record(path: Path) -> None:
    """Add ``path``'s name to the manifest of the fcsd folder holding it (nothing when that folder is not fcsd's)."""
    path = Path(path)
    marker = read_marker(path.parent)
    if marker is None or marker.owns(path.name):
        return
    _write_marker(path.parent, Marker(marker.kind, sorted({*(marker.written or []), path.name})))


def is_marked(folder: Path) -> bool:
    return read_marker(folder) is not None


def is_empty(folder: Path) -> bool:
    folder = Path(folder)
    return not folder.exists() or (folder.is_dir() and not any(folder.iterdir()))


# The staging names fcsd itself uses, and only those (a user's `.notes.old` is not one): atomic_dir's
# `.<name>.partial-XXXXXXXX` / `.<name>.old-XXXXXXXX` (mkdtemp's suffix), atomic_file's `.<name>.partial-<pid>`,
# a checkpoint's `.step-N.partial`, the marker's `.fcsd-output.tmp<pid>`.
STAGING = re.compile(r"\.step-\d+\.partial|\..+\.(partial|old)-[A-Za-z0-9_]{8}|\..+\.partial-\d+|\.fcsd-output\.tmp\d+")


def is_staging_leftover(name: str) -> bool:
    return STAGING.fullmatch(name) is not None


def foreign_entries(folder: Path, marker: Marker) -> list[str]:
    """Entries of ``folder`` that fcsd did not write: not in the manifest, not its own files or staging leftovers,
    not a nested fcsd folder of a kept kind; a manifest entry that is an fcsd folder itself is checked inside."""
    found = []
    for entry in sorted(Path(folder).iterdir()):
        name = entry.name
        if name in (MARKER, LOCK) or is_staging_leftover(name):
            continue
        nested = read_marker(entry) if entry.is_dir() and not entry.is_symlink() else None
        if nested is not None and nested.kind in KEPT_KINDS:
            continue
        if not marker.owns(name):
            found.append(name)
        elif nested is not None:
            found += [f"{name}/{inner}" for inner in foreign_entries(entry, nested)]
    return found


def check_replaceable(folder: Path, kind: str, what: str, fix: str) -> Marker | None:
    """Refuse, in one line, to replace or clear ``folder`` unless it is empty, or an fcsd folder of ``kind`` that
    holds nothing but what fcsd wrote. ``what`` names the setting (``output_dir``), ``fix`` the way out."""
    folder = Path(folder)
    if is_empty(folder):
        return None
    if not folder.is_dir():
        raise FolderError(f"{what} {folder} is a file, not a folder; choose another {what}")
    marker = read_marker(folder)
    if marker is None:
        raise FolderError(
            f"{what} {folder} holds files fcsd did not write (no {MARKER} marker), so fcsd will not replace it; {fix}"
        )
    if marker.kind != kind:
        raise FolderError(f"{what} {folder} is an fcsd {kind_name(marker.kind)}, not {_a(KINDS[kind])}; {fix}")
    foreign = foreign_entries(folder, marker)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise FolderError(
            f"{what} {folder} also holds files fcsd did not write ({shown}); move them out first, or {fix}"
        )
    return marker


def clear(folder: Path, kind: str, what: str, fix: str) -> None:
    """Remove what fcsd wrote in ``folder`` (after :func:`check_replaceable`); nested folders of a kept kind, the
    marker and the lock stay."""
    folder = Path(folder)
    marker = check_replaceable(folder, kind, what, fix)
    if marker is None:
        return
    for entry in folder.iterdir():
        if entry.name in (MARKER, LOCK):
            continue
        nested = read_marker(entry) if entry.is_dir() and not entry.is_symlink() else None
        if nested is not None and nested.kind in KEPT_KINDS:
            continue
        _remove(entry)
    _write_marker(folder, Marker(kind, []))


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink()


def remove_stale_staging(folder: Path) -> list[str]:
    """Staging leftovers of a dead process in ``folder`` and its ``checkpoints/`` (call while holding its lock). A
    process killed between the two renames of :func:`atomic_dir` leaves the only copy of ``X`` in ``.X.old-*/X``:
    that one is moved back, not removed."""
    removed = []
    for parent in (Path(folder), Path(folder) / "checkpoints"):
        if not parent.is_dir():
            continue
        for entry in sorted(parent.iterdir()):
            if not is_staging_leftover(entry.name):
                continue
            old = re.fullmatch(r"\.(.+)\.old-[A-Za-z0-9_]{8}", entry.name)
            if old and (entry / old.group(1)).exists() and not (parent / old.group(1)).exists():
                os.replace(entry / old.group(1), parent / old.group(1))
                removed.append(f"{entry.relative_to(folder)} (moved back to {old.group(1)})")
            _remove(entry)
            removed.append(str(entry.relative_to(folder)))
    return removed


@contextmanager
def atomic_dir(target: Path, kind: str | None = None):
    """Yield a staging folder beside ``target``; on success it replaces ``target`` in one rename and is recorded in
    the manifest of the folder around it. With ``kind``, the staging folder is marked as that kind and its manifest
    is everything written into it."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    os.chmod(staging, 0o777 & ~_umask())  # mkdtemp's private 0700 would make the folder unreadable to others
    try:
        with disk_full_reported(target.parent):
            yield staging
            if kind is not None:
                mark(staging, kind, [p.name for p in staging.iterdir() if p.name != MARKER])
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, old / target.name)
    os.replace(staging, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    record(target)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a full disk, whichever library raised it."""
    seen = error
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(seen)
        if "No space left on device" in text or "os error 28" in text or "StorageFull" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@contextmanager
def disk_full_reported(folder: Path):
    """Turn a full disk while writing under ``folder`` into one line naming the folder and the fix."""
    try:
        yield
    except Exception as error:
        if is_disk_full(error):
            raise FolderError(
                f"no space left on the disk of {Path(folder).resolve()}: free space there (or choose another folder) "
                "and run the command again; what was complete before is kept"
            ) from None
        raise


@contextmanager
def folder_lock(folder: Path, what: str):
    """Hold an exclusive lock on ``folder`` (created if needed) for the ``with`` block; refuse, in one line naming
    the holder, when another fcsd command holds it. A folder this call created and that is still empty at the end
    is removed again."""
    import fcntl

    folder = Path(folder)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK
    while True:
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            check_not_in_use(folder, what)  # names the holder
            raise FolderError(f"{what} {folder} is in use by another fcsd command; wait for it to end") from None
        try:  # the file may have been removed by the previous holder between our open and our lock: lock again
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        handle.close()
    handle.seek(0)
    handle.truncate()
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "command": command_line()}
    handle.write(json.dumps(holder))
    handle.flush()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        handle.close()
        if created and is_empty(folder):
            folder.rmdir()


def check_not_in_use(folder: Path, what: str) -> None:
    """Refuse, naming the holder, a ``folder`` whose lock another fcsd command holds (checked first, so that a busy
    folder is reported as busy rather than by what it holds)."""
    import fcntl

    path = Path(folder) / LOCK
    try:
        handle = open(path)
    except OSError:
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderError(
                f"{what} {folder} is in use by another fcsd command ({_describe_holder(handle.read().strip())}); "
                f"wait for it to end, or choose another {what}"
            ) from None
        fcntl.flock(handle, fcntl.LOCK_UN)


def _describe_holder(text: str) -> str:
    try:
        holder = json.loads(text)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
        return f"pid {holder['pid']} on {holder['host']} since {since}: `{holder['command'][:120]}`"
    except (ValueError, KeyError, TypeError):
        return "a process that is starting"


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_not_around(target: Path, what: str, name: str, folder: Path) -> None:
    """Refuse a ``target`` that is or contains ``folder`` (it may lie inside it: a run's ``export/``)."""
    target, folder = Path(target).expanduser().resolve(), Path(folder).expanduser().resolve()
    if _inside(folder, target):
        relation = "is" if target == folder else "contains"
        raise FolderError(f"{what} {target} {relation} the {name} {folder}; choose another {what}")


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
            raise FolderError(f"{what} {target} {relation} the {name} {path}; choose a separate, new {what}")
    for name, path in (("current folder", Path.cwd().resolve()), ("home folder", Path.home().resolve())):
        if _inside(path, target):
            relation = "is" if target == path else "contains"
            raise FolderError(f"{what} {target} {relation} the {name}; choose a new folder, e.g. outputs/my-run")


def check_output_folder(folder: Path, kind: str, what: str, inputs: dict | None = None) -> Path:
    """Check, before any work, that a command may write its report of ``kind`` (``fcsd eval --output``, probe,
    plots, traces) to ``folder``: not an input, the current or the home folder; empty, or a ``kind`` folder of
    fcsd's holding nothing else. The writer then calls :func:`mark` and :func:`record`."""
    folder = Path(folder).expanduser()
    check_not_an_input(folder, what, inputs or {})
    check_replaceable(folder, kind, what, f"choose another {what}")
    return folder


def check_output_file(path: Path, what: str, kind: str, is_own, inputs: dict | None = None) -> Path:
    """An output file (routes, a placement) may be replaced only when it is a file of its ``kind`` that fcsd wrote
    (``is_own(path)`` reads it); anything else at ``path`` is refused before any work."""
    path = Path(path).expanduser()
    check_not_an_input(path, what, inputs or {})
    if path.is_dir():
        raise FolderError(f"{what} {path} is a folder; give a file name, e.g. {path / 'out'}")
    if path.exists() and not is_own(path):
        raise FolderError(f"{what} {path} exists and is not {_a(kind)} fcsd wrote, so fcsd will not replace it; choose "
                          f"another {what}")  # fmt: skip
    return path


@contextmanager
def atomic_file(path: Path):
    """Yield a temporary name beside ``path``; on success it replaces ``path`` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        with disk_full_reported(path.parent):
            yield staging
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    os.replace(staging, path)
