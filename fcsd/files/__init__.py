"""File safety (design §1; docs/files-and-safety.md): what fcsd writes, it writes whole or not at all, and it deletes
only what it wrote. The six rules are listed in ``ownership.py``.

- ``staging.py``: atomic writes (a staging sibling renamed into place) and atomic folders;
- ``ownership.py``: a folder fcsd writes carries a marker naming its kind and the manifest of what fcsd wrote there;
  one writer at a time (a lock); fcsd refuses a folder it does not own and clears only entries its marker lists;
- ``names.py``: the names of fcsd's own files in such a folder (its marker, its lock, staging leftovers);
- ``run_folder.py``: a run folder's parts (step checkpoints, ``final/``, ``best/``, logs) and which checkpoint
  proves its contents;
- ``checksums.py``: the digests a checkpoint's record carries, checked before it is loaded."""
