"""Who owns a folder fcsd writes (design §1; docs/files-and-safety.md). Six rules, for every folder fcsd writes (run
folders, exports, teacher caches, sweeps, the demo, evaluation reports, probe, plot and trace outputs):

1. **Whole or nothing.** Folders and files are staged beside their target and renamed into place
   (:mod:`fcsd.files.staging`); a killed writer leaves staging leftovers, which the next holder of the lock removes.
2. **Marked.** The first thing fcsd writes in a folder is its marker ``.fcsd-output``: the folder's **kind** and the
   **manifest** of the entries fcsd wrote there (:func:`mark`, :func:`record`). A marker fcsd cannot read is damaged,
   never a kind.
3. **Own kind only.** A command replaces or clears only a folder of its own kind, by its marker *and* its contents
   (:data:`SIGNATURES`: a folder holding a run's ``checkpoints/`` is a run whatever its marker says).
4. **Only what it wrote.** It removes manifest entries and its own staging leftovers, nothing else: a folder that
   also holds anything else is refused in one line naming those entries (:func:`check_replaceable`); fcsd folders of
   a kept kind nested inside (a run's ``teacher-cache/``) stay.
5. **Never into an input.** No output is, contains or lies inside an input, the current or the home folder, or what
   another fcsd folder replaces or deletes with itself (:func:`check_not_an_input`).
6. **One writer.** :func:`folder_lock` holds an OS lock for the whole command (inside a folder written in place,
   beside one replaced by a rename; each way checks the other); a second writer is refused naming the holder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fcsd.command_line import command_line
from fcsd.files.names import LOCK, MARKER, is_lock_file, is_staging_leftover

KINDS = {
    "run": "run folder",
    "export": "export",
    "teacher-cache": "teacher cache",
    "sweep": "sweep folder",
    "eval": "evaluation report",
    "probe": "probe output",
    "plots": "plot folder",
    "trace": "profiler-trace folder",
    "demo": "demo folder",
}
KEPT_KINDS = ("teacher-cache",)  # an input of later runs: clearing the folder around it keeps it
# What a folder of a kind holds at its top level: names no other kind (nor a user's folder, likely) has, which say
# the kind, and the kind's other usual names, which messages list beside them. The contents say the kind too.
SIGNATURES = {
    "run": (("fcsd_config.yaml", "run_summary.json"), ("checkpoints", "metrics.jsonl", "final")),
    "export": (("fcsd_export.json",), ("config.json",)),
    "teacher-cache": (("shard-00000.safetensors",), ("meta.json",)),
    "sweep": (("selection.json", "sweep_table.md"), ("stage1", "stage2")),
}
# Where an fcsd folder holds other fcsd folders by design: (its kind, the entry) -> the kinds that may live there,
# and the kinds that may live anywhere inside it (a sweep's stage runs and their teacher caches).
NESTED = {("run", "export"): ("export",), ("run", "teacher-cache"): ("teacher-cache",), ("run", "eval"): ("eval",)}
NESTED_ANYWHERE = {"sweep": ("run", "teacher-cache", "export", "eval"), "demo": ("run", "eval")}
# The entries a folder of a kind will write even when it does not hold them yet: nothing else may claim them.
RESERVED = {"run": ["checkpoints", "final", "best", "export", "eval", "tensorboard", "teacher-cache"]}


def kind_name(kind: str) -> str:
    return KINDS.get(kind, kind)


def with_article(name: str) -> str:
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def a_kind(kind: str) -> str:
    """``kind``'s name with its article: ``a run folder``, ``an export``."""
    return with_article(kind_name(kind))


class FolderError(ValueError):
    """A folder fcsd must not write, replace or clear; the message names the folder, why, and the fix."""


@dataclass
class Marker:
    kind: str
    written: list[str]  # the manifest: the entries fcsd wrote in the folder
    damage: str | None = None  # what is wrong with a marker fcsd cannot read (then ``kind`` means nothing)
    run_id: str | None = None  # a run's identity, made when the folder is claimed (or cleared) for a new run

    def owns(self, name: str) -> bool:
        if self.damage is not None:
            return False
        return name in self.written

    def is_kind(self, kind: str) -> bool:
        return self.damage is None and self.kind == kind

    def description(self) -> str:
        """What the marker says the folder is, for messages: ``an fcsd export``, or that it cannot be read."""
        if self.damage is not None:
            return f"a folder with a damaged {MARKER} marker ({self.damage})"
        return f"an fcsd {kind_name(self.kind)}"


def read_marker(folder: Path) -> Marker | None:
    """The marker of ``folder`` (None when there is none); a marker that is not what fcsd writes comes back with its
    ``damage`` said, never as a kind of folder."""
    path = Path(folder) / MARKER
    if not path.exists() and not path.is_symlink():
        return None
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        return Marker("", [], f"unreadable: {type(error).__name__}")
    try:
        data = json.loads(text)
    except ValueError:
        return Marker("", [], "not JSON")
    if not isinstance(data, dict):
        return Marker("", [], f"a JSON {type(data).__name__}, not an object")
    kind, written = data.get("kind", "run"), data.get("written", [])
    if kind not in KINDS:
        return Marker("", [], f"unknown kind {str(kind)[:40]!r}")
    if not isinstance(written, list) or not all(isinstance(name, str) for name in written):
        return Marker("", [], "its manifest is not a list of names")
    run_id = data.get("run_id")
    return Marker(kind, list(written), run_id=run_id if isinstance(run_id, str) and run_id else None)


def kind_from_contents(folder: Path) -> tuple[str, list[str]] | None:
    """The kind ``folder``'s top-level entries say it is (:data:`SIGNATURES`) and those entries, or None."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    names = {p.name for p in folder.iterdir()}
    for kind, (distinctive, usual) in SIGNATURES.items():
        if any(name in names for name in distinctive):
            return kind, sorted(name for name in (*distinctive, *usual) if name in names)
    return None


def _write_marker(folder: Path, marker: Marker) -> None:
    staging = folder / f"{MARKER}.tmp{os.getpid()}"
    data = {"kind": marker.kind, "written": marker.written}
    if marker.run_id:
        data["run_id"] = marker.run_id
    staging.write_text(json.dumps(data) + "\n")
    os.replace(staging, folder / MARKER)


def new_run_id() -> str:
    """A run's identity: random, recorded in its marker, every step checkpoint and ``final/``."""
    import secrets

    return secrets.token_hex(8)


def mark(folder: Path, kind: str, written: list[str] | None = None) -> None:
    """Claim ``folder`` for ``kind`` (created if needed); an existing marker of the same kind is kept (a run's
    marker from before run identities gets one)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    marker = read_marker(folder)
    if marker is not None and not marker.is_kind(kind):
        raise FolderError(f"{folder} is {marker.description()}, not {a_kind(kind)}")
    run_id = (marker.run_id if marker is not None else None) or (new_run_id() if kind == "run" else None)
    if marker is None or written is not None:
        _write_marker(folder, Marker(kind, sorted(set(written or [])), run_id=run_id))
    elif run_id != marker.run_id:
        _write_marker(folder, Marker(kind, marker.written, run_id=run_id))


def record(path: Path) -> None:
    """Add ``path``'s name to the manifest of the fcsd folder holding it (nothing when that folder is not fcsd's)."""
    path = Path(path)
    marker = read_marker(path.parent)
    if marker is None or marker.damage is not None or marker.owns(path.name):
        return
    written = sorted({*marker.written, path.name})
    _write_marker(path.parent, Marker(marker.kind, written, run_id=marker.run_id))


def is_marked(folder: Path) -> bool:
    return read_marker(folder) is not None


def is_empty(folder: Path) -> bool:
    """Whether ``folder`` is absent or holds nothing (lock files alone count as nothing)."""
    folder = Path(folder)
    return not folder.exists() or (folder.is_dir() and not any(not is_lock_file(p.name) for p in folder.iterdir()))


def foreign_entries(folder: Path, marker: Marker) -> list[str]:
    """Entries of ``folder`` that fcsd did not write: not in the manifest, not its own files or staging leftovers,
    not a nested fcsd folder of a kept kind; a manifest entry that is an fcsd folder itself is checked inside. A
    nested fcsd folder of another kind is named as such (``sweep/ (an fcsd sweep folder)``)."""
    found = []
    for entry in sorted(Path(folder).iterdir()):
        name = entry.name
        if name == MARKER or is_lock_file(name) or is_staging_leftover(name):
            continue
        nested = read_marker(entry) if entry.is_dir() and not entry.is_symlink() else None
        if nested is not None and nested.damage is None and nested.kind in KEPT_KINDS:
            continue
        if not marker.owns(name):
            found.append(f"{name}/ ({nested.description()} of its own)" if nested is not None else name)
        elif nested is not None:
            found += [f"{name}/{inner}" for inner in foreign_entries(entry, nested)]
    if marker.kind == "run":  # inside the folders a run writes and clears whole
        from fcsd.files.run_folder import RunFolder

        found += RunFolder(folder).foreign_files()
    return found


def check_replaceable(folder: Path, kind: str, what: str, fix: str) -> Marker | None:
    """Refuse, in one line, to replace or clear ``folder`` unless it is empty, or an fcsd folder of ``kind`` (by its
    marker and by its contents) that holds nothing but what fcsd wrote. ``what`` names the setting
    (``output_dir``), ``fix`` the way out."""
    folder = Path(folder)
    if is_empty(folder):
        return None
    if not folder.is_dir():
        raise FolderError(f"{what} {folder} is a file, not a folder; choose another {what}")
    marker = read_marker(folder)
    contents = kind_from_contents(folder)
    if marker is None:
        if contents is not None:
            raise FolderError(
                f"{what} {folder} holds {a_kind(contents[0])}'s files ({', '.join(contents[1])}) but no {MARKER} "
                f"marker (deleted?), so fcsd cannot tell what it wrote there and will not replace it; {fix}"
            )
        raise FolderError(
            f"{what} {folder} holds files fcsd did not write (no {MARKER} marker), so fcsd will not replace it; {fix}"
        )
    if marker.damage is not None:
        raise FolderError(
            f"{what} {folder} has a damaged {MARKER} marker ({marker.damage}), so fcsd cannot tell what it wrote "
            f"there and will not replace it; {fix}"
        )
    if not marker.is_kind(kind):
        raise FolderError(f"{what} {folder} is {marker.description()}, not {a_kind(kind)}; {fix}")
    if contents is not None and contents[0] != kind:
        raise FolderError(
            f"{what} {folder} is marked as {a_kind(kind)} but holds {a_kind(contents[0])}'s "
            f"{', '.join(contents[1])} (an edited or damaged {MARKER} marker), so fcsd will not replace it; {fix}"
        )
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
        if entry.name == MARKER or is_lock_file(entry.name):
            continue
        nested = read_marker(entry) if entry.is_dir() and not entry.is_symlink() else None
        if nested is not None and nested.damage is None and nested.kind in KEPT_KINDS:
            continue
        remove(entry)
    _write_marker(folder, Marker(kind, [], run_id=new_run_id() if kind == "run" else None))  # a new run


def remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink()


def restore_or_remove_leftover(parent: Path, entry: Path) -> str | None:
    """Remove the staging leftover ``entry`` of ``parent`` (call while holding the lock of what it stages). A process
    killed between the two renames of :func:`fcsd.files.staging.atomic_dir` leaves the only copy of ``X`` in
    ``.X.old-*/X``: that one is moved back first. Returns what was moved back, if anything."""
    old = re.fullmatch(r"\.(.+)\.old-[A-Za-z0-9_]{8}", entry.name)
    moved = None
    if old and (entry / old.group(1)).exists() and not (parent / old.group(1)).exists():
        os.replace(entry / old.group(1), parent / old.group(1))
        moved = old.group(1)
    remove(entry)
    return moved


def remove_stale_staging(folder: Path) -> list[str]:
    """Staging leftovers of a dead process in ``folder`` and its ``checkpoints/`` (call while holding its lock)."""
    removed = []
    for parent in (Path(folder), Path(folder) / "checkpoints"):
        if not parent.is_dir():
            continue
        for entry in sorted(parent.iterdir()):
            if not is_staging_leftover(entry.name):
                continue
            moved = restore_or_remove_leftover(parent, entry)
            if moved:
                removed.append(f"{entry.relative_to(folder)} (moved back to {moved})")
            removed.append(str(entry.relative_to(folder)))
    return removed


_HELD: dict[str, int] = {}  # lock files this process holds -> how many nested holds (the lock is re-entrant)


def lock_path(folder: Path, beside: bool = False) -> Path:
    """The lock file of ``folder``: inside it (a run or sweep folder, written in place), or ``beside`` it,
    ``.<name>.fcsd-lock`` in its parent (an export or a teacher cache, replaced by renaming a staged folder over it:
    a lock inside would be renamed away with it)."""
    folder = Path(folder)
    return folder.parent / f".{folder.name}{LOCK}" if beside else folder / LOCK


@contextmanager
def folder_lock(folder: Path, what: str, beside: bool = False, reentrant: bool = False):
    """Hold an exclusive lock on ``folder`` for the ``with`` block (:func:`lock_path`; without ``beside`` the folder
    is created if needed); refuse, in one line naming the holder, when another fcsd command (or another holder in
    this process) holds it. ``reentrant``: a hold this process already has is joined instead (``fcsd export`` takes
    its target's lock before loading, the staging around the writes joins it). A folder this call created and that
    is still empty at the end is removed again; a lock file that is no longer ours (the next holder's) is left
    alone."""
    import fcntl

    folder = Path(folder)
    path = lock_path(folder, beside)
    key = os.path.realpath(path)
    if reentrant and key in _HELD:
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    created = not folder.exists() and not beside
    path.parent.mkdir(parents=True, exist_ok=True)
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
    other = lock_path(folder, not beside)  # a run locks inside its folder, an export beside it: both are checked
    if os.path.realpath(other) not in _HELD and _held(other):
        handle.close()
        path.unlink(missing_ok=True)
        if created and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        check_not_in_use(folder, what)  # names the holder
        raise FolderError(f"{what} {folder} is in use by another fcsd command; wait for it to end")
    handle.seek(0)
    handle.truncate()
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "command": command_line()}
    handle.write(json.dumps(holder))
    handle.flush()
    inode = os.fstat(handle.fileno()).st_ino
    _HELD[key] = 1
    try:
        yield
    finally:
        del _HELD[key]
        try:
            if os.stat(path).st_ino == inode:
                path.unlink()
        except FileNotFoundError:
            pass
        handle.close()
        if created and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def _held(path: Path) -> bool:
    """Whether another open lock holds the lock file ``path`` (a missing file is held by no one)."""
    import fcntl

    try:
        handle = open(path)
    except OSError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
    return False


def check_not_in_use(folder: Path, what: str) -> None:
    """Refuse, naming the holder, a ``folder`` whose lock (inside it or beside it) another fcsd command holds
    (checked first, so that a busy folder is reported as busy rather than by what it holds)."""
    import fcntl

    for path in (lock_path(folder), lock_path(folder, beside=True)):
        try:
            handle = open(path)
        except OSError:
            continue
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


def check_not_around(
    target: Path, what: str, name: str, folder: Path, allowed: Path | None = None, refuse_inside: bool = True
) -> None:
    """Refuse a ``target`` that is or contains ``folder`` (the run folder of a source) or, with ``refuse_inside``,
    lies inside it; ``allowed`` is the one place inside it that may be written (the run's own ``export/``)."""
    target, folder = Path(target).expanduser().resolve(), Path(folder).expanduser().resolve()
    if allowed is not None and target == Path(allowed).expanduser().resolve():
        return
    if _inside(folder, target) or (refuse_inside and _inside(target, folder)):
        relation = "is" if target == folder else ("contains" if _inside(folder, target) else "lies inside")
        inside = f" (only its own {Path(allowed).name}/ may be written there)" if allowed is not None else ""
        raise FolderError(f"{what} {target} {relation} the {name} {folder}{inside}; choose another {what}")


def check_not_an_input(target: Path, what: str, inputs: dict[str, str | Path | None], kind: str | None = None) -> None:
    """Refuse a ``target`` (to be written, maybe cleared) that is, contains or lies inside one of ``inputs`` (name ->
    local path; hub ids and None are skipped), the current folder or the home folder, or that lies inside what an
    fcsd folder manages (:func:`check_not_in_managed`; ``kind``: what ``target`` will be, None for a file)."""
    target = Path(target).expanduser().resolve()
    check_not_in_managed(target, what, kind)
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


def check_not_in_managed(target: Path, what: str, kind: str | None = None) -> None:
    """Refuse a ``target`` inside an entry that an fcsd folder around it replaces or deletes with itself: anything
    inside an export or a teacher cache (replaced whole), inside a run's ``checkpoints/``, ``final/``, ... (written,
    pruned, cleared by ``overwrite=true``; reserved before the run writes them) or inside a folder whose marker is
    damaged. Only the nestings fcsd makes itself pass (:data:`NESTED`: a run's own ``export/``, ``eval/`` and
    ``teacher-cache/``; a sweep's stage runs). A new top-level entry beside a run's is not refused: nothing of it is
    ever removed (the run then refuses ``overwrite=true`` over it)."""
    target = Path(target).expanduser().resolve()
    found = nearest_marked(target.parent)
    if found is None:
        return
    owner, marker = found
    entry = target.relative_to(owner).parts[0]
    if kind in NESTED_ANYWHERE.get(marker.kind, ()) or kind in NESTED.get((marker.kind, entry), ()):
        return
    managed = (
        marker.damage is not None
        or marker.kind in ("export", "teacher-cache")
        or marker.owns(entry)
        or entry in RESERVED.get(marker.kind, [])
    )
    if managed:
        relation = "is" if target.parent == owner else "lies inside"
        where = f"{entry}/ of {marker.description()}" if marker.damage is None else marker.description()
        raise FolderError(
            f"{what} {target} {relation} {where} {owner}, which fcsd replaces or deletes with it; choose a folder "
            f"outside {owner}"
        )


def nearest_marked(folder: Path) -> tuple[Path, Marker] | None:
    """``folder`` itself or its nearest parent that holds an fcsd marker, with the marker; None when none does."""
    folder = Path(folder).expanduser().resolve()
    for candidate in (folder, *folder.parents):
        marker = read_marker(candidate)
        if marker is not None:
            return candidate, marker
    return None


def check_output_folder(folder: Path, kind: str, what: str, inputs: dict | None = None) -> Path:
    """Check, before any work, that a command may write its report of ``kind`` (``fcsd eval --output``, probe,
    plots, traces) to ``folder``: not an input, the current or the home folder; empty, or a ``kind`` folder of
    fcsd's holding nothing else. The writer then calls :func:`mark` and :func:`record`."""
    folder = Path(folder).expanduser()
    check_not_an_input(folder, what, inputs or {}, kind)
    check_replaceable(folder, kind, what, f"choose another {what}")
    return folder


def is_png_by(path: Path, writer: str) -> bool:
    """A PNG whose ``Software`` text chunk (in its first 64 KiB) names ``writer``: a picture an fcsd command wrote."""
    with open(path, "rb") as handle:
        head = handle.read(65536)
    return head.startswith(b"\x89PNG") and writer.encode() in head


def check_output_file(path: Path, what: str, kind: str, is_own, inputs: dict | None = None) -> Path:
    """An output file (routes, a placement) may be replaced only when it is a file of its ``kind`` that fcsd wrote
    (``is_own(path)`` reads it); anything else at ``path`` is refused before any work."""
    path = Path(path).expanduser()
    check_not_an_input(path, what, inputs or {})
    if path.is_dir():
        raise FolderError(f"{what} {path} is a folder; give a file name, e.g. {path / 'out'}")
    if path.exists() and not is_own(path):
        raise FolderError(
            f"{what} {path} exists and is not {with_article(kind)} fcsd wrote, so fcsd will not replace it; choose "
            f"another {what}"
        )
    return path
