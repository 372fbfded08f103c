"""``python -m fcsd.serving.sglang.install_check``: is the plugin installed where SGLang finds it? (``make sglang-env``
ends with it.) Prints SGLang's version and the FarSkip architectures its registry resolves; exits 1 with the fix
otherwise."""

from __future__ import annotations

import sys
from importlib.metadata import entry_points, version


def main() -> int:
    plugins = [e for e in entry_points(group="sglang.srt.plugins") if e.value.startswith("fcsd.serving.sglang")]
    if not plugins:
        print("fcsd's SGLang plugin is not installed in this environment: run `make sglang-env`", file=sys.stderr)
        return 1
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.plugins import load_plugins

    from fcsd.serving.served_families import SGLANG_FAMILIES

    load_plugins()
    missing = [f.farskip_architecture for f in SGLANG_FAMILIES if f.farskip_architecture not in ModelRegistry.models]
    if missing:
        print(f"SGLang did not register {', '.join(missing)}: reinstall with `make sglang-env`", file=sys.stderr)
        return 1
    try:
        import sgl_kernel

        kernels = "import-only sgl_kernel stand-in (CPU)" if getattr(sgl_kernel, "STANDIN", False) else "sgl_kernel"
    except ImportError:
        kernels = "no sgl_kernel"
    classes = ", ".join(f.farskip_architecture for f in SGLANG_FAMILIES)
    print(
        f"sglang {version('sglang')}, transformers {version('transformers')}, torch {version('torch')}, {kernels}: "
        f"FarSkip {classes}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
