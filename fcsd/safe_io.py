"""The module :mod:`fcsd.ownership` (who owns a folder: markers, kinds, locks) and :mod:`fcsd.staging` (atomic
writes) were split from, kept for code written against it; fcsd's own code imports those two (and
:mod:`fcsd.stopping` for signals)."""

from fcsd.ownership import (  # noqa: F401
    KINDS,
    LOCK,
    MARKER,
    FolderError,
    Marker,
    check_not_an_input,
    check_not_around,
    check_not_in_use,
    check_output_file,
    check_output_folder,
    check_replaceable,
    clear,
    command_line,
    folder_lock,
    is_empty,
    is_marked,
    is_staging_leftover,
    kind_name,
    mark,
    read_marker,
    record,
    remove_stale_staging,
    set_command,
)
from fcsd.staging import atomic_dir, atomic_file, disk_full_reported, is_disk_full  # noqa: F401
from fcsd.stopping import Terminated, raise_terminated  # noqa: F401
