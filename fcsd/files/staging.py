"""How fcsd writes so that nothing is half-written or lost: folders and files are staged beside their target and
renamed into place, and a full disk is one line naming the folder.

A folder target (an export, a teacher cache, a run's ``final/``) has one writer: :func:`atomic_dir` holds the
target's lock (:func:`fcsd.files.ownership.folder_lock`) from before staging to the final rename, and that rename checks
the target again: what is there then must be empty, or a folder it may replace (of its kind, holding nothing but what
fcsd wrote, and only when the command was asked to replace it). Anything else that appeared while the new folder was
staged (another command's export, a user's file) stays where it is and the command is refused in one line.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from fcsd.files import ownership
from fcsd.files.ownership import FolderError


@contextmanager
def atomic_dir(target: Path, kind: str | None = None, replace: bool = True, what: str = "the folder"):
    """Yield a staging folder beside ``target``; on success it replaces ``target`` in one rename and is recorded in
    the manifest of the folder around it. With ``kind``, the staging folder is marked as that kind and its manifest
    is everything written into it; an existing ``target`` is then replaced only with ``replace`` and only when it is
    a ``kind`` folder holding nothing but what fcsd wrote. Without ``kind`` (a run's ``final/``), only a folder the
    manifest around it names is replaced. ``what`` names the target in messages (``OUT_DIR``)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with ownership.folder_lock(target, what, beside=True, reentrant=True):  # one writer, from staging to the rename
        restore_stale_siblings(target)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp's private 0700 would make the folder unreadable to others
        try:
            with disk_full_reported(target.parent):
                yield staging
                _share_like_the_umask(staging)
                if kind is not None:
                    ownership.mark(staging, kind, [p.name for p in staging.iterdir() if p.name != ownership.MARKER])
            _swap_into_place(staging, target, kind, replace, what)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    ownership.record(target)


def _swap_into_place(staging: Path, target: Path, kind: str | None, replace: bool, what: str) -> None:
    """Rename ``staging`` to ``target``. What is at ``target`` is checked now (not only before the work began), then
    moved aside and compared with what was checked: an entry that arrived in between is moved back untouched."""
    if not target.exists():
        os.replace(staging, target)
        return
    seen = _check_replaceable_now(target, kind, replace, what)
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.replace(target, aside / target.name)
    if sorted(p.name for p in (aside / target.name).iterdir()) != seen:
        os.replace(aside / target.name, target)
        aside.rmdir()
        raise FolderError(f"{what} {target} changed while it was being replaced; nothing was replaced: run again")
    try:
        os.replace(staging, target)
    except OSError:  # something took the name in between: the old folder stays aside, where the next writer finds it
        raise FolderError(
            f"{what} {target} was taken by another process while it was being replaced; the previous folder is kept "
            f"in {aside / target.name}"
        ) from None
    shutil.rmtree(aside, ignore_errors=True)


def _check_replaceable_now(target: Path, kind: str | None, replace: bool, what: str) -> list[str]:
    """Refuse a ``target`` this write may not replace (see :func:`atomic_dir`); its entries as they are now."""
    entries = sorted(p.name for p in target.iterdir()) if target.is_dir() else []
    if ownership.is_empty(target):
        return entries
    fix = f"choose another {what}"
    if kind is not None:
        ownership.check_replaceable(target, kind, what, fix)
        if not replace:
            raise FolderError(
                f"{what} {target} now holds {ownership.a_kind(kind)} that another command wrote while this one was "
                "staging; nothing was replaced: run again with --overwrite (overwrite=true) to replace it"
            )
        return entries
    marker = ownership.read_marker(target.parent)
    if marker is None or not marker.owns(target.name):
        raise FolderError(f"{what} {target} holds files fcsd did not write, so fcsd will not replace it; {fix}")
    return entries


def restore_stale_siblings(target: Path) -> bool:
    """Remove the staging leftovers of ``target`` (``.<name>.partial-*``, ``.<name>.old-*``) that a killed writer
    left beside it; call it holding the target's lock, so that no live writer uses them. An old copy is moved back
    where the target is missing (the writer died between its two renames) and dropped only where an fcsd folder
    replaced it. Returns whether anything was there."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(partial|old)-[A-Za-z0-9_]{{8}}")
    found = False
    if not target.parent.is_dir():
        return found
    for entry in sorted(target.parent.iterdir()):
        if not pattern.fullmatch(entry.name):
            continue
        old_copy = entry / target.name
        if old_copy.exists() and target.exists():
            if not ownership.is_marked(target):
                continue  # not a completed swap of fcsd's: keep the old copy for the user rather than guess
        elif old_copy.exists() and target.is_dir() and ownership.is_empty(target):
            shutil.rmtree(target)  # an empty folder where the only copy belongs
        ownership.restore_or_remove_leftover(target.parent, entry)
        found = True
    return found


def _share_like_the_umask(folder: Path) -> None:
    """Give the files written into a staging folder the mode a plain ``open`` gives them (``0o666`` less the umask):
    writers that stage through ``mkstemp`` (transformers' ``save_pretrained`` for its weights) leave them ``0o600``,
    readable by their owner alone, which a shared export, cache or run folder must not be."""
    mode = 0o666 & ~_umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 == 0o600 != mode:
            try:
                os.chmod(path, mode)
            except OSError:  # a file system without modes (some network mounts): the files stay as written
                pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
