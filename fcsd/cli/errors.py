"""Bad input in one line: the exceptions that mean it, and their messages in fcsd's words (Hydra's advice about
``+key`` and ``--multirun``, OS errors on paths, an unreachable hub)."""

from __future__ import annotations

import sys
from pathlib import Path


def input_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input: reported as one line, no traceback."""
    errors: list[type[BaseException]] = [ValueError, FileNotFoundError, OSError]  # OSError: unreadable or not found
    if "hydra" in sys.modules:
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        errors += [HydraException, OmegaConfBaseException]
    if "safetensors" in sys.modules:
        from safetensors import SafetensorError

        errors.append(SafetensorError)
    for module, name in (("httpx", "HTTPError"), ("httpx2", "HTTPError"), ("requests", "RequestException")):
        if module in sys.modules:
            errors.append(getattr(sys.modules[module], name))
    return tuple(errors)


def one_line(error: BaseException) -> str:
    """The error as one line: a hub or loading problem in words (:func:`fcsd.sources.explain_error`), else its
    message with the cause Hydra wraps (which names the key and the expected type)."""
    from fcsd.sources import explain_error

    message = explain_error(error) or _hydra_message(error) or _path_message(error)
    if message is None:
        message = str(error).strip() or type(error).__name__
        cause = error.__cause__
        if cause is not None and "hydra" in sys.modules:
            from hydra.errors import HydraException

            if isinstance(error, HydraException) and str(cause).strip():
                message += f": {str(cause).strip().splitlines()[0]}"
    return " ".join(message.split("\n")).replace("  ", " ")


def _path_message(error: BaseException) -> str | None:
    """A path that cannot be a folder, in words: a symbolic link that leads back to itself, a file where a folder
    (or a folder on the way to one) is needed."""
    import errno
    import re

    loop = re.fullmatch(r"Symlink loop from '(.+)'", str(error))
    if isinstance(error, RuntimeError) and loop:
        return f"{loop.group(1)}: a symbolic link on this path leads back to itself; remove it or choose another path"
    name = getattr(error, "filename", None)
    if not isinstance(error, OSError) or not name:
        return None
    if error.errno == errno.ENOTDIR:
        return f"{name}: a part of this path is a file, not a folder; choose another path"
    if error.errno == errno.EEXIST and Path(name).exists() and not Path(name).is_dir():
        return f"{name} is a file where a folder is needed; choose another path"
    if error.errno == errno.EEXIST and Path(name).is_symlink() and not Path(name).exists():
        return f"{name} is a symbolic link to nothing; remove it or choose another path"
    if error.errno == errno.EROFS:
        return f"{name} is on a read-only file system; choose a folder you can write to"
    if error.errno in (errno.EACCES, errno.EPERM):
        why = "permission denied" if error.errno == errno.EACCES else f"permission denied ({error.strerror})"
        return f"{name}: {why}; fix its permissions or choose another path"
    return None


def is_symlink_loop(error: BaseException) -> bool:
    """``Path.resolve`` on a link that leads back to itself (Python raises a RuntimeError, not an OSError)."""
    return isinstance(error, RuntimeError) and str(error).startswith("Symlink loop from ")


def _hydra_message(error: BaseException) -> str | None:
    """Hydra's parse errors in fcsd's words: its advice (``+key``, ``--multirun``, a link) does not apply to fcsd,
    which refuses new keys and runs sweeps with ``fcsd sweep``."""
    import re

    text = " ".join(str(error).split())
    found = re.match(r"Ambiguous value for argument '([^=']+)=([^']*)'", text)
    if found:
        key, value = found.groups()
        return (
            f"{key}={value}: a comma makes the value ambiguous; write a list as {key}=[{value}] or quote a string "
            f"as '{key}=\"{value}\"' (fcsd convert runs one setting; `fcsd sweep` sweeps batch size and LR)"
        )
    found = re.match(r"Could not override '([^']+)'", text)
    if found:
        return (
            f"unknown config key {found.group(1)}: check the spelling; `fcsd convert MODEL --cfg job` prints every key"
        )
    found = re.match(r"(?:LexerNoViableAltException|mismatched input.*?): (\S+=?.*?) \^", text)
    if found or "override_grammar" in text:
        override = found.group(1).strip() if found else "an override"
        key, _, value = override.partition("=")
        return f"{override}: this value cannot be read as it is written; quote it, e.g. '{key}=\"{value}\"'"
    found = re.match(
        r"In '[^']+': Could not find '([^/']+)/([^']+)' Available options in '[^']+': (.*?) Config search", text
    )
    if found:
        group, name, options = found.groups()
        return f"{group}={name}: no such preset; choose one of {', '.join(options.split())} (recipes/{group}/)"
    return None


def quiet_hub_retries() -> None:
    """huggingface_hub retries an unreachable hub with backoff and logs each try over two lines; fcsd reports the
    outcome in one line (:func:`fcsd.sources.explain_error`) instead."""
    import logging

    class DropRetries(logging.Filter):
        def filter(self, record):
            message = record.getMessage()
            return not (message.startswith("Retrying in") or "thrown while requesting" in message)

    logger = logging.getLogger("huggingface_hub.utils._http")
    if not any(isinstance(f, DropRetries) for f in logger.filters):
        logger.addFilter(DropRetries())
