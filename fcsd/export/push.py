"""``fcsd push``: upload an exported folder to the Hugging Face hub in one commit, through ``huggingface_hub``."""

from __future__ import annotations

from pathlib import Path

from fcsd.export import ExportError
from fcsd.export.save import PARITY_RECORD


def check_is_export(folder: Path) -> None:
    """The folder's ``config.json`` must still say what ``fcsd export`` wrote (:func:`fcsd.serving.identity.identify`):
    an export whose model type, ``farskip`` block or ``architectures`` was edited would reach the hub as a model that
    loads or serves with stock wiring."""
    import json

    from fcsd.serving.identity import REEXPORT, identify_folder

    path = folder / "config.json"
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ExportError(f"{path} cannot be read ({type(error).__name__}); {REEXPORT}") from None
    if not isinstance(values, dict) or identify_folder(folder, values, str(path)) != "export":
        raise ExportError(f"{path} is not the config of an fcsd export (no farskip_* model type); {REEXPORT}")


def files_to_push(folder: Path) -> list[Path]:
    return sorted(p.relative_to(folder) for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))


def push(
    folder: str | Path, repo_id: str, private: bool = False, revision: str | None = None, dry_run: bool = False
) -> list[Path] | str:
    """Upload ``folder`` to ``repo_id`` (created if needed) in one commit; returns the commit URL, or with
    ``dry_run`` the files that would be uploaded. The token comes from ``HF_TOKEN`` or the cached login and is
    never printed; ``HF_ENDPOINT`` selects the hub. Only folders whose reload-parity check passed are pushed."""
    folder = Path(folder)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise ExportError(f"{folder} {what}: give the folder `fcsd export RUN OUT_DIR` wrote (OUT_DIR)")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ExportError(f"{repo_id!r} is not a hub repository id: give NAMESPACE/NAME, e.g. me/my-model") from None
    if not (folder / PARITY_RECORD).exists():
        raise ExportError(
            f"{folder} has no {PARITY_RECORD}: only folders written by `fcsd export` (reload parity passed) are "
            "pushed; run `fcsd export RUN OUT_DIR` first"
        )
    check_is_export(folder)
    files = files_to_push(folder)
    if dry_run:
        return files
    from huggingface_hub import HfApi, get_token

    token = get_token()
    if not token:
        raise ExportError("no hub token: set HF_TOKEN or log in with `hf auth login`, then push again")
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if revision:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    commit = api.upload_folder(
        folder_path=str(folder),
        repo_id=repo_id,
        revision=revision,
        commit_message=f"FarSkip-Collective checkpoint ({len(files)} files, exported by fcsd)",
    )
    return commit.commit_url
