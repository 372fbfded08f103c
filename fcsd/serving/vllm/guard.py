"""Every config vLLM loads, checked by fcsd's plugin before anything is built: FarSkip wiring is never served as the
stock one (paper Sec. 4.2; design §7).

:func:`install` wraps the function vLLM's ``ModelConfig`` reads a checkpoint's config with, in every process the
plugin is loaded in (the ``vllm serve`` front end first, before any engine process starts). A config whose FarSkip
fields disagree (:func:`fcsd.serving.identity.identify`: an export whose ``architectures`` was set back to the stock
class, or whose ``farskip`` block is gone) and an fcsd checkpoint that is not an export (a run's ``final/``: a
``farskip`` block under the stock model type and class, which vLLM would build as the stock model) are refused with
:class:`FarSkipServingError`, whose message is one line; ``vllm serve`` through fcsd's launcher prints it alone and
exits 2 (:mod:`fcsd.serving.vllm.launcher`).
"""

from __future__ import annotations


class FarSkipServingError(RuntimeError):
    """A checkpoint fcsd's plugin will not let vLLM serve (a RuntimeError: vLLM's config validation passes it on as
    it is, instead of wrapping it as it wraps a ValueError)."""


def check_served_config(config, model: str) -> None:
    """Refuse (:class:`FarSkipServingError`) a transformers ``config`` of ``model`` that vLLM would serve with the
    wrong wiring; a stock config or a consistent export passes."""
    from pathlib import Path

    from fcsd.serving.identity import IdentityError, identify_folder

    values = config.to_dict()
    try:  # a local folder fcsd exported is also checked against its parity record
        kind = identify_folder(Path(model), values, f"{model}/config.json")
    except IdentityError as error:
        raise FarSkipServingError(str(error)) from None
    if kind == "converted":
        raise FarSkipServingError(
            f"{model} holds FarSkip layers under the stock model type {values.get('model_type')!r} and class "
            f"{values.get('architectures')}, so vLLM would serve it with stock wiring (an fcsd checkpoint such as a "
            "run's final/, not an export): export it with `fcsd export RUN_OR_CHECKPOINT OUT_DIR` and serve OUT_DIR"
        )


def install() -> None:
    """Wrap vLLM's config loader (idempotent); a vLLM without that seam is left as it is (the model classes still
    refuse a damaged export when they are built)."""
    try:
        import vllm.config.model as model_module
    except ImportError:
        return
    loader = getattr(model_module, "get_config", None)
    if loader is None or getattr(loader, "fcsd_guard", False):
        return

    def get_config(model, *args, **kwargs):
        config = loader(model, *args, **kwargs)
        check_served_config(config, str(model))
        return config

    get_config.fcsd_guard = True
    model_module.get_config = get_config


def stop_message(error: BaseException) -> str | None:
    """The one line of a :class:`FarSkipServingError` in ``error``'s chain, if there is one."""
    seen = error
    for _ in range(10):
        if seen is None:
            return None
        if isinstance(seen, FarSkipServingError):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    return None
