"""An import-only stand-in for SGLang's CUDA kernel package ``sgl_kernel``, for SGLang's CPU engine on a machine
without its CPU kernel build (``make sglang-env`` on CPU copies this file to ``<environment>/sgl_kernel/__init__.py``;
design §7).

SGLang imports ``sgl_kernel`` (and its submodules) at module level in many places it never calls on the CPU paths
fcsd serves (``torch_native`` attention, the native MoE and norms). Every name this package hands out is a
:class:`Missing` placeholder: importing it works, *calling* it raises, so nothing can run, and no test can pass,
through this stand-in. It is never importable beside fcsd's own environment: only ``.venv-sglang`` holds it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STANDIN = True  # what `fcsd.serving.sglang.install_check` looks for
__version__ = "0.0.0+fcsd.standin"


class StandInCalled(RuntimeError):
    """A kernel of the stand-in was called: this SGLang path needs the real ``sgl_kernel`` (a GPU install)."""


class Missing:
    """A name of ``sgl_kernel``: attributes give further placeholders, a call raises :class:`StandInCalled`."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return Missing(f"{self._name}.{attribute}")

    def __call__(self, *args, **kwargs):
        raise StandInCalled(
            f"{self._name} was called, but this environment's sgl_kernel is fcsd's import-only stand-in for SGLang's "
            "CPU engine: this path needs SGLang's kernels (on a GPU node: make sglang-env SGLANG_CPU=0)"
        )

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._name}>"


def _module_getattr(module_name: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{module_name}.{name}")

    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every ``sgl_kernel.<submodule>`` is a stand-in module too."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


__getattr__ = _module_getattr(__name__)
if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
    sys.meta_path.append(_Finder())
