"""The messages fcsd causes on purpose, silenced (they read like problems but are expected); every other warning of
the libraries stays."""

from __future__ import annotations

import logging

# logger name -> fragments of the expected messages it drops
EXPECTED = {
    # a tied LM head is saved once and tied again on load: nothing is lost
    "accelerate.utils.other": ("Removed shared tensor {'lm_head.weight'}",),
    # fcsd hands lm-eval a loaded model object on purpose (FarSkip connectivity applied), never a name, and runs the
    # scoring in one process
    "lm_eval.models.huggingface": (
        "`pretrained` model kwarg is not of type `str`",
        "Passed an already-initialized model through `pretrained`",
    ),
    # fcsd's local demo tasks read their rows through a custom_dataset function: there is no metadata to pass
    "lm_eval.api.task": ("Custom kwargs can be passed to `--metadata`",),
}


class _DropExpected(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(fragment in text for fragment in self.fragments)


def install() -> None:
    """Add the filters (once) to the libraries' loggers."""
    for name, fragments in EXPECTED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropExpected) for f in logger.filters):
            logger.addFilter(_DropExpected(fragments))


def git_commit_hash() -> str | None:
    """lm-eval's ``get_git_commit_hash`` without git's "fatal: not a git repository" on stderr."""
    import subprocess

    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None
