"""The names of fcsd's own files in a folder it writes: its marker, its lock, and the staging leftovers of an atomic
write (design §1). Everything else in such a folder is either in the marker's manifest or someone else's."""

import re

MARKER = ".fcsd-output"
LOCK = ".fcsd-lock"
# The staging names fcsd itself uses, and only those (a user's `.notes.old` is not one): fcsd.files.staging.atomic_dir's
# `.<name>.partial-XXXXXXXX` / `.<name>.old-XXXXXXXX` (mkdtemp's suffix), `atomic_file`'s `.<name>.partial-<pid>`,
# a checkpoint's `.step-N.partial`, the marker's `.fcsd-output.tmp<pid>`.
STAGING = re.compile(r"\.step-\d+\.partial|\..+\.(partial|old)-[A-Za-z0-9_]{8}|\..+\.partial-\d+|\.fcsd-output\.tmp\d+")


def is_lock_file(name: str) -> bool:
    return name == LOCK or (name.startswith(".") and name.endswith(LOCK))


def is_staging_leftover(name: str) -> bool:
    return STAGING.fullmatch(name) is not None
