"""fcsd's user cache folder: the demo assets, packed-token caches, cleaned copies of data files."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$FCSD_CACHE``, else ``~/.cache/fcsd``."""
    return Path(os.environ.get("FCSD_CACHE", Path.home() / ".cache" / "fcsd"))
