"""``python -m fcsd.serving.sglang.cpu_environment``: the two fixes SGLang's CPU engine needs in ``.venv-sglang`` on a
machine without SGLang's CPU kernels (``make sglang-env`` runs it on CPU; never on a GPU node; design §7).

- ``sgl_kernel``: SGLang's kernel wheels hold CUDA libraries only; :mod:`fcsd.serving.sglang.kernel_standin` is copied
  in as ``sgl_kernel`` (import-only: any call of it raises).
- torchvision: the index's torchvision is a CUDA build whose compiled ops do not load beside a CPU torch, and its
  fake-kernel and autograd registrations then fail to import (``operator torchvision::nms does not exist``): they are
  made to run only when the compiled ops loaded.

Both touch this environment's ``site-packages`` alone, and running it again changes nothing.
"""

from __future__ import annotations

import shutil
import sys
import sysconfig
from pathlib import Path

REGISTRATIONS = ("_meta_registrations", "_autograd_registrations")
GUARD = '''"""fcsd (make sglang-env): torchvision's {name}, only once its compiled ops loaded (not on CPU torch)."""

from torchvision.extension import _has_ops

if _has_ops():
    from torchvision.{name}_with_ops import *  # noqa: F401,F403
'''


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def install_standin(site: Path) -> Path:
    target = site / "sgl_kernel"
    init = target / "__init__.py"
    if init.exists() and "STANDIN = True" not in init.read_text():
        raise SystemExit(f"{target} is a real sgl_kernel: this environment has SGLang's kernels, leave it as it is")
    target.mkdir(exist_ok=True)
    shutil.copyfile(Path(__file__).with_name("kernel_standin.py"), target / "__init__.py")
    return target


def guard_torchvision(site: Path) -> list[str]:
    package = site / "torchvision"
    done = []
    for name in REGISTRATIONS:
        original, kept = package / f"{name}.py", package / f"{name}_with_ops.py"
        if not package.is_dir() or not original.exists():
            continue
        if not kept.exists():
            original.rename(kept)
        original.write_text(GUARD.format(name=name))
        done.append(name)
    return done


def main() -> int:
    site = site_packages()
    standin = install_standin(site)
    guarded = guard_torchvision(site)
    print(f"sgl_kernel stand-in at {standin}; torchvision registrations guarded: {', '.join(guarded) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
