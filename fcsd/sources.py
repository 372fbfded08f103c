"""Where models and data come from: a hub id, a local folder, a run folder of ``fcsd convert``, or the embedded
``demo`` (built on first use by :mod:`fcsd.embedded.assets`). Every command resolves its inputs' names here."""

from __future__ import annotations

from pathlib import Path

DEMO_NAME = "demo"
DEMO_DATA = {"demo": "train.jsonl", "demo-heldout": "heldout.jsonl"}  # data names -> files of the demo's data/


def looks_local(name: str) -> bool:
    """A name that can only mean a local path, so that a mistyped folder is reported at once rather than looked up
    on the hub: it starts with ``.``, ``/`` or ``~``, has more than one ``/`` (a hub id is ``org/name``), or its
    first part is a local folder (``outputs/typo`` when ``outputs/`` exists)."""
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        return True
    first = name.split("/", 1)[0]
    return "/" in name and Path(first).is_dir()


def hub_id(name: str | None) -> str | None:
    """``name`` when it can be a hub repository id and is no local folder (``models/dsv2`` that exists is a local
    path, even though it looks like an id), else None; ``demo`` is never one."""
    if not name or name == DEMO_NAME or looks_local(name) or Path(name).exists():
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def display_name(name: str | None) -> str | None:
    """How a model appears in cards and tables: its hub id, else the local folder's name (never an absolute path)."""
    if not name:
        return name
    return hub_id(name) or (name if name == DEMO_NAME else Path(name).expanduser().name or name)


def resolve_model(name: str) -> str:
    """``demo`` -> the demo checkpoint folder (built on first use); a local-looking path that does not exist is a
    clear error (not a hub lookup); anything else (a folder, a hub id) unchanged."""
    if name == DEMO_NAME:
        from fcsd.embedded.assets import prepare_demo

        return str(prepare_demo() / "model")
    if looks_local(name) and not Path(name).expanduser().exists():
        raise ValueError(f"model {name}: no such folder (give a local checkpoint folder, a hub id, or 'demo')")
    return name


def resolve_data(name: str | None) -> str | None:
    """``demo`` / ``demo-heldout`` -> the demo's training / held-out file; anything else unchanged."""
    if name not in DEMO_DATA:
        return name
    from fcsd.embedded.assets import prepare_demo

    return str(prepare_demo() / "data" / DEMO_DATA[name])


def default_data(model: str) -> str | None:
    """The held-out data a model comes with: the demo's for ``demo``, None for any other model."""
    return resolve_data("demo-heldout") if model == DEMO_NAME else None


def resolve_checkpoint(ref: str) -> str:
    """The folder (or hub id) to load for ``ref``: ``demo``; a run folder (see :meth:`RunFolder.checkpoint`); an
    exported or converted folder; a stock checkpoint; or a hub id."""
    from fcsd.files.run_folder import RunFolder

    path = Path(ref).expanduser()
    if not path.exists():
        return resolve_model(ref)
    if (path / "config.json").exists():
        return str(path)
    checkpoint = RunFolder(path).checkpoint()
    if checkpoint is None:
        raise ValueError(f"{ref} holds no checkpoint: expected config.json, or a run folder with export/ or final/")
    return str(checkpoint)


class SourceError(ValueError):
    """A model or data source that cannot be used, already said in one line (:func:`explain_error`'s own)."""


def explain_error(error: BaseException, repo: str | None = None) -> str | None:
    """One line for the loading and hub errors whose own messages run over many lines or name no fix: a model
    the hub does not know, a hub that cannot be reached, a truncated weights file, an unreadable config.json.
    ``repo``: the hub id being fetched, named in the message when the error does not say it."""
    chain, seen = [], error
    while seen is not None and len(chain) < 8:  # what it was raised from (`from None`: nothing)
        chain.append(seen)
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
    names = {type(e).__name__ for e in chain}
    text = " ".join(str(e) for e in chain)
    local = "give a local checkpoint folder (e.g. ./models/my-model), a hub id, or 'demo'"
    from fcsd.files.staging import is_disk_full

    if type(error).__module__.startswith("fcsd."):  # fcsd's own errors are one line naming the problem already
        return None
    if is_disk_full(error):
        return f"no space left on the disk ({_first_line(error)}): free space and run the command again"
    access = _hub_access_error(chain)
    if access is not None:
        return access
    if names & {"RepositoryNotFoundError", "GatedRepoError"} or "is not a valid model identifier" in text:
        return f"not found on the hub or as a local folder ({_first_line(error)}); {local}"
    offline = (
        "OfflineModeIsEnabled" in names
        or "HF_HUB_OFFLINE" in text
        or ("LocalEntryNotFoundError" in names and _offline())
    )
    unreachable = names & {"ConnectError", "ConnectionError", "ConnectTimeout", "ReadTimeout", "TimeoutException"}
    if offline or unreachable or "couldn't connect to" in text or "Failed to resolve" in text:
        repo = repo or _repo_named(chain, text)
        model = repo is not None and not repo.startswith("dataset ")
        alternative = f", or {local}" if model else ""  # a local checkpoint replaces a model, not a dataset or upload
        if offline:
            needed = repo or "what this command needs from the hub"
            return (
                f"{needed} is not in the local hub cache and hub access is off (HF_HUB_OFFLINE=1): unset "
                f"HF_HUB_OFFLINE to download it{alternative}"
            )
        if repo is None:
            return "the Hugging Face hub cannot be reached: check the network or HF_ENDPOINT"
        return (
            f"{repo}: the Hugging Face hub cannot be reached and it is not in the local cache: check the network or "
            f"HF_ENDPOINT{alternative}"
        )
    if "SafetensorError" in names or "header too large" in text or "incomplete metadata" in text:
        return f"a .safetensors file is truncated or corrupt ({_first_line(error)}): download or copy it again"
    return None


def _repo_named(chain: list[BaseException], text: str) -> str | None:
    """The hub repository an error is about (its ``repo_id``, or the one in the URL it names; ``dataset NAME`` for a
    dataset), or None when it names none (an upload, a download of another library)."""
    import re

    for error in chain:
        if getattr(error, "repo_id", None):
            kind = getattr(error, "repo_type", None)
            return f"dataset {error.repo_id}" if kind == "dataset" else str(error.repo_id)
    found = re.search(
        r"https?://[^/\s]+/(api/models/|api/datasets/|datasets/)?([\w.-]+/[\w.-]+)(?:/resolve|/revision|[\s'\"]|$)",
        text,
    )
    if found is None or found.group(2).startswith("api/"):  # another endpoint of the hub's API (an upload)
        return None
    return f"dataset {found.group(2)}" if "datasets/" in (found.group(1) or "") else found.group(2)


def _offline() -> bool:
    """Whether hub access is switched off (``HF_HUB_OFFLINE=1``), as huggingface_hub sees it."""
    import huggingface_hub.constants

    return bool(huggingface_hub.constants.HF_HUB_OFFLINE)


def _hub_access_error(chain: list[BaseException]) -> str | None:
    """One line for a hub repo that needs a token (gated, or private / unknown without one) and for a revision
    the repo does not have."""
    for error in chain:
        name, repo = type(error).__name__, getattr(error, "repo_id", None) or "the repo"
        response = getattr(error, "response", None)
        status = getattr(response, "status_code", None)
        login = "log in with `hf auth login` or set HF_TOKEN (a token with access to it)"
        if name == "GatedRepoError":
            return f"{repo} is a gated repo: accept its conditions on its hub page, then {login}"
        if name == "RepositoryNotFoundError" and status == 401:
            return f"{repo}: no such repo on the hub, or a private one and no token was sent: {login}"
        if name == "RevisionNotFoundError":
            why = (getattr(error, "server_message", None) or "").strip() or _first_line(error)
            return f"{repo}: the hub has no such revision ({why}); give a branch, tag or commit sha of the repo"
    return None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:200] if lines else type(error).__name__
