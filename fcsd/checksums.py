"""Content hashes of the files a step checkpoint publishes, so that a checkpoint proves its contents.

SHA-256, streamed from disk: with the CPU's SHA instructions (which OpenSSL, behind :mod:`hashlib`, uses) it runs
at about 1.8 GB/s per core, as fast as most storage reads, and ``sha256sum`` checks the same digests by hand. A
faster non-cryptographic hash would not make a checkpoint load sooner (the read is the cost), and a digest anyone can
recompute is worth more. The files are hashed on several threads (:mod:`hashlib` releases the interpreter lock
while it hashes) and, when a checkpoint is written, split between the processes that wrote it
(:func:`share`). A digest already computed in this process is not computed again while the file keeps its size and
modification time (a resume checks its checkpoint twice: before and under the run's lock).
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ALGORITHM = "sha256"
CHUNK = 8 * 2**20  # bytes read at a time
_KNOWN: dict[tuple, str] = {}  # (path, inode, size, mtime_ns) -> digest, this process's


def file_digest(path: str | Path) -> str:
    """The SHA-256 of ``path``'s bytes, hex, streamed (never the whole file in memory)."""
    path = Path(path)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key not in _KNOWN:
        digest = hashlib.new(ALGORITHM)
        with open(path, "rb") as handle:  # hashlib.file_digest needs Python 3.11; fcsd runs on 3.10
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
        _KNOWN[key] = digest.hexdigest()
    return _KNOWN[key]


def digests(paths: list[Path], workers: int | None = None) -> dict[str, str]:
    """``{file name: SHA-256}`` of ``paths``, hashed on up to ``workers`` threads (default: up to 8, the CPU count)."""
    paths = list(paths)
    if not paths:
        return {}
    workers = workers or min(8, os.cpu_count() or 1, len(paths))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip((p.name for p in paths), pool.map(file_digest, paths)))


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
