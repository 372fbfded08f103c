"""Content hashes of the files a step checkpoint publishes, so that a checkpoint proves its contents.

SHA-256, streamed from disk: with the CPU's SHA instructions (which OpenSSL, behind :mod:`hashlib`, uses) it runs
at about 1.8 GB/s per core, as fast as most storage reads, and ``sha256sum`` checks the same digests by hand. A
faster non-cryptographic hash would not make a checkpoint load sooner (the read is the cost), and a digest anyone can
recompute is worth more. The files are hashed on several threads (:mod:`hashlib` releases the interpreter lock
while it hashes) and, when a checkpoint is written, split between the processes that wrote it
(:func:`share`). A digest already computed in this process is not computed again while the file keeps its size and
modification time (a resume checks its checkpoint twice: before and under the run's lock).

A launch's checks before training are the main process's, but a checkpoint of several TB takes one process far
longer to read than a collective may wait (NCCL's 10 minutes): :func:`hashed_together` lends the main process's
:func:`digests` to every process of the launch, each hashing its :func:`share` as when the checkpoint was written.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

ALGORITHM = "sha256"
CHUNK = 8 * 2**20  # bytes read at a time
_KNOWN: dict[tuple, str] = {}  # (path, inode, size, mtime_ns) -> digest, this process's
_TOGETHER = False  # in the main process's hashed_together block: digests() asks every process to hash its share


def _key(path: Path, stat: os.stat_result) -> tuple:
    return (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)


def file_digest(path: str | Path) -> str:
    """The SHA-256 of ``path``'s bytes, hex, streamed (never the whole file in memory)."""
    path = Path(path)
    key = _key(path, path.stat())
    if key not in _KNOWN:
        digest = hashlib.new(ALGORITHM)
        with open(path, "rb") as handle:  # hashlib.file_digest needs Python 3.11; fcsd runs on 3.10
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
        _KNOWN[key] = digest.hexdigest()
    return _KNOWN[key]


def digests(paths: list[Path], workers: int | None = None) -> dict[str, str]:
    """``{file name: SHA-256}`` of ``paths``, hashed on up to ``workers`` threads (default: up to 8, the CPU count);
    in the main process's :func:`hashed_together` block, by every process of the launch."""
    paths = list(paths)
    if _TOGETHER and paths:
        return _digests_together(paths)
    return dict(zip((p.name for p in paths), _hashed_here(paths, workers)))


def _hashed_here(paths: list[Path], workers: int | None = None) -> list[str]:
    if not paths:
        return []
    workers = workers or min(8, os.cpu_count() or 1, len(paths))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(file_digest, paths))


def share(paths: list[Path], index: int, count: int) -> list[Path]:
    """Process ``index``'s part of ``paths`` when ``count`` processes hash them together: the largest file goes to
    the process with the fewest bytes so far. Every process computes the same split from the same listing."""
    loads = [0] * count
    mine = []
    for path in sorted(paths, key=lambda p: (-p.stat().st_size, p.name)):
        least = loads.index(min(loads))
        loads[least] += path.stat().st_size
        if least == index:
            mine.append(path)
    return mine


def gathered_digests(paths: list[Path], index: int, count: int) -> dict[str, str]:
    """``{file name: SHA-256}`` of ``paths`` when ``count`` processes hash them together, process ``index`` its
    :func:`share` (a collective: every process calls it with the same listing and gets every digest). A digest
    another process computed is remembered here for the file as this process sees it, when its size and
    modification time are the ones that process saw."""
    try:  # a file this process cannot read (or see) is left to the main process, which says what is wrong with it
        ours = share(paths, index, count)
        mine = {str(p): (p.stat().st_size, p.stat().st_mtime_ns, d) for p, d in zip(ours, _hashed_here(ours))}
    except OSError:
        mine = {}
    if count > 1:
        import torch.distributed as dist

        parts = [None] * count
        dist.all_gather_object(parts, mine)
        mine = {name: found for part in parts for name, found in part.items()}
    found = {}
    for name, (size, mtime_ns, digest) in mine.items():
        path = Path(name)
        try:
            stat = path.stat()
        except OSError:
            continue
        if (stat.st_size, stat.st_mtime_ns) == (size, mtime_ns):
            _KNOWN[_key(path, stat)] = digest
            found[path.name] = digest
    return found


@contextmanager
def hashed_together(is_main: bool):
    """In a launch of several processes, the main process's :func:`digests` in the block are computed by every
    process, each its share, while the others wait here for its requests (so that no process waits in a collective
    for one process to read a whole checkpoint); the others' block runs after the main one's, and a refusal the main
    process raises there (a :class:`ValueError`) is raised by every process, so that none is left waiting for the
    others in a collective. Outside a launch (or before its process group exists) the block just runs."""
    global _TOGETHER
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        yield
        return
    index, count = dist.get_rank(), dist.get_world_size()
    if not is_main:
        while isinstance(request := _broadcast(None), list):
            gathered_digests([Path(p) for p in request], index, count)
        if request is not None:
            raise request
        yield
        return
    _TOGETHER, refusal = True, None
    try:
        yield
    except ValueError as error:
        refusal = error
        raise
    finally:
        _TOGETHER = False
        _broadcast(refusal)  # done (with the main process's refusal, if any): the others go on


def _broadcast(message):
    """The main process's ``message`` on every process: the files to hash (a list), or done (None, or the refusal
    every process raises)."""
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _digests_together(paths: list[Path]) -> dict[str, str]:
    """:func:`digests` in the main process's :func:`hashed_together` block; what the others could not hash (a file
    they do not see) is hashed here."""
    import torch.distributed as dist

    _broadcast([str(p) for p in paths])
    found = gathered_digests(paths, dist.get_rank(), dist.get_world_size())
    return {p.name: found.get(p.name) or file_digest(p) for p in paths}
