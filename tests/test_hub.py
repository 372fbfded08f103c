"""The hub round trip against a local hub (tests/hub_server.py through ``HF_ENDPOINT``): ``fcsd convert <hub id>``
downloads the model and a hub dataset, converts, writes the card and pushes; the pushed repo loads back with and
without fcsd; ``fcsd eval`` / ``inspect`` on hub ids; pinned revisions, cache reuse and offline use; and every
hub-facing error as one line. One server and one set of repos serve the whole module."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hub_server import HubServer
from tiny_models import save_chat_model

import fcsd
from fcsd.cli import main

ROOT = Path(__file__).resolve().parents[1]
MODEL, DATA, PUSHED = "org/tiny-qwen3-moe", "org/tiny-chat", "org/tiny-qwen3-moe-farskip"
FAST = [
    "data.split=train",
    "data.seq_len=32",
    "data.eval_sequences=2",
    "train.batch_tokens=128",
    "train.micro_batch_size=4",
    "train.warmup_steps=1",
    "train.max_steps=1",
    "progress=false",
    "early_stop.enabled=false",
]
CARD = "---\nlicense: apache-2.0\nlanguage: en\n---\n\n# tiny-qwen3-moe\n\nA tiny random Qwen3-MoE for tests.\n"


def point_at_hub(mp: pytest.MonkeyPatch, url: str, home: Path, offline: bool = False) -> None:
    """Every library that talks to the hub (huggingface_hub, transformers, datasets) reads its endpoint, cache and
    offline switch when imported: set them in the environment (for subprocesses) and in the loaded modules."""
    import datasets.config
    import huggingface_hub.constants as hub

    values = {
        "HF_ENDPOINT": url,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_DATASETS_CACHE": str(home / "datasets"),
        "HF_HUB_OFFLINE": "1" if offline else "0",
        "FCSD_CACHE": str(home / "fcsd"),
    }
    for key, value in values.items():
        mp.setenv(key, value)
    mp.delenv("HF_TOKEN", raising=False)
    mp.delenv("TRANSFORMERS_OFFLINE", raising=False)
    mp.setattr(hub, "ENDPOINT", url)
    mp.setattr(hub, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    mp.setattr(hub, "HF_HOME", str(home))
    mp.setattr(hub, "HF_HUB_CACHE", str(home / "hub"))
    mp.setattr(hub, "HF_TOKEN_PATH", str(home / "token"))
    mp.setattr(hub, "HF_HUB_OFFLINE", offline)
    mp.setattr(datasets.config, "HF_ENDPOINT", url)
    mp.setattr(datasets.config, "HF_HUB_OFFLINE", offline)
    mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", offline)
    mp.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    mp.setattr(datasets.config, "HF_CACHE_HOME", str(home))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The local hub serving the tiny model (tagged ``v1``, then one more commit on main), its chat dataset, an
    MbppPlus-format file, and a gated and a private copy of the model; the hub libraries pointed at it."""
    from fcsd.embedded.synthetic import make_dataset

    root = tmp_path_factory.mktemp("hub")
    rows = make_dataset(48, seed=3)
    save_chat_model(root / "model", rows)
    (root / "model" / "README.md").write_text(CARD)
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(root / "train.parquet")
    server = HubServer()
    server.v1 = server.add_repo(MODEL, root / "model", tag="v1")
    server.main = server.add_repo(MODEL, {"NOTES.md": b"a later commit on main\n"})
    server.add_repo(DATA, {"data/train-00000-of-00001.parquet": (root / "train.parquet").read_bytes()}, "dataset")
    mbpp = (ROOT / "eval" / "fixtures" / "mbpp_plus_mini.jsonl").read_bytes()
    server.add_repo("org/mbpp-plus-mini", {"MbppPlus.jsonl": mbpp}, "dataset")
    server.add_repo("Qwen/Qwen3-30B-A3B", root / "model")  # what the qwen3_30b_a3b preset names
    server.add_repo("org/gated-moe", root / "model", gated=True)
    server.add_repo("org/private-moe", root / "model", private=True)
    with pytest.MonkeyPatch.context() as mp:
        point_at_hub(mp, server.url, root / "hf")
        server.root = root
        yield server
    server.close()


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")


@pytest.fixture(scope="module")
def pushed(hub, tmp_path_factory):
    """``fcsd convert`` of the hub model on the hub dataset, pushed: the run folder and the requests it made."""
    out = tmp_path_factory.mktemp("runs") / "run"
    first = len(hub.requests)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_TOKEN", "hf_test_token")
        code = main(["convert", MODEL, f"data.path={DATA}", f"output_dir={out}", f"push_to_hub={PUSHED}", *FAST])
    assert code == 0
    return out, hub.requests[first:]


def test_convert_downloads_model_and_data_converts_and_pushes_one_commit(hub, pushed):
    out, requests = pushed
    paths = [r["path"] for r in requests if r["method"] == "GET"]
    assert any(p.startswith(f"/{MODEL}/resolve/") and p.endswith("model.safetensors") for p in paths)
    assert any(p.startswith(f"/datasets/{DATA}/resolve/") and p.endswith(".parquet") for p in paths)
    assert sum("/commit/" in r["path"] for r in requests) == 1
    card = (out / "export" / "README.md").read_text()
    metadata = card.split("---")[1]
    assert f"base_model: {MODEL}" in metadata and "license: apache-2.0" in metadata
    assert "README.md" in hub.committed_files() and "config.json" in hub.committed_files()


def test_push_to_an_existing_repo_adds_one_commit(hub, pushed, token, tmp_path, capsys):
    """The hub answers 409 to creating a repo that exists (as the real hub does); fcsd push goes on and adds one
    commit on top of the existing history, with the new files."""
    out, _ = pushed
    repo = hub.repos[("model", PUSHED)]
    head, commits = repo.refs["main"], len(repo.commits)
    export = tmp_path / "export"
    shutil.copytree(out / "export", export)
    (export / "README.md").write_text((export / "README.md").read_text() + "\nSecond push.\n")
    first = len(hub.requests)
    assert main(["push", str(export), PUSHED]) == 0
    requests = hub.requests[first:]
    assert [r["status"] for r in requests if r["path"] == "/api/repos/create"] == [409]
    assert sum("/commit/" in r["path"] for r in requests) == 1 and len(repo.commits) == commits + 1
    assert repo.refs["main"] != head and repo.commits[repo.refs["main"]]["README.md"].endswith(b"Second push.\n")
    assert PUSHED in capsys.readouterr().out


def test_the_pushed_repo_loads_back_with_remote_code_without_fcsd_and_with_fcsd(hub, pushed, tmp_path):
    out, _ = pushed
    batch = torch.randint(0, 200, (2, 12))
    torch.save(batch, tmp_path / "batch.pt")
    worker = ROOT / "tests" / "workers" / "load_remote_code.py"
    subprocess.run(
        [sys.executable, str(worker), str(tmp_path / "batch.pt"), str(tmp_path / "logits.pt"), PUSHED],
        check=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ""},
    )
    remote = torch.load(tmp_path / "logits.pt")[PUSHED]
    with torch.no_grad():
        ours = fcsd.from_pretrained(PUSHED).eval()(input_ids=batch).logits
        local = fcsd.from_pretrained(str(out / "export")).eval()(input_ids=batch).logits
    assert fcsd.farskip_layers(fcsd.from_pretrained(PUSHED)) == fcsd.farskip_layers(
        fcsd.from_pretrained(str(out / "export"))
    )
    torch.testing.assert_close(ours, local)
    torch.testing.assert_close(remote, local)


def test_eval_of_the_pushed_repo_against_its_base(hub, pushed, tmp_path, capsys):
    include = str(ROOT / "eval" / "tasks" / "fcsd_demo")
    args = ["eval", PUSHED, "--compare", MODEL, "--tasks", "fcsd_demo_choice", "--include-path", include]
    assert main([*args, "--limit", "2", "--device", "cpu", "--output", str(tmp_path / "eval")]) == 0
    table = capsys.readouterr().out
    assert PUSHED in table and MODEL in table


def test_inspect_reads_only_config_json(hub, capsys, tmp_path, monkeypatch):
    point_at_hub(monkeypatch, hub.url, tmp_path / "cold")  # an empty cache
    first = len(hub.requests)
    assert main(["inspect", MODEL]) == 0
    assert "Qwen3-MoE" in capsys.readouterr().out
    files = {r["path"].split("/resolve/")[1].split("/", 1)[1] for r in hub.requests[first:] if "/resolve/" in r["path"]}
    assert files == {"config.json"}


@pytest.mark.parametrize(
    ("repo", "expected"),
    [
        ("org/gated-moe", "hf auth login"),
        ("org/private-moe", "HF_TOKEN"),
        ("org/no-such-model", "not found"),
        (f"{MODEL}@no-such-revision", "no such revision"),
    ],
)
def test_hub_errors_are_one_line_and_write_nothing(hub, tmp_path, capsys, repo, expected):
    for command in (["inspect", repo], ["convert", repo, f"data.path={DATA}", f"output_dir={tmp_path / 'run'}", *FAST]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and expected in err, err
    assert not (tmp_path / "run").exists()


def test_an_unreachable_hub_is_one_line(hub, tmp_path, capsys, monkeypatch):
    import huggingface_hub.utils._http as http

    point_at_hub(monkeypatch, "http://127.0.0.1:9", tmp_path / "cold")
    monkeypatch.setattr(http.time, "sleep", lambda seconds: None)  # huggingface_hub's retries, without the waits
    for command in (
        ["inspect", MODEL],
        ["convert", MODEL, f"data.path={DATA}", f"output_dir={tmp_path / 'run'}", *FAST],
    ):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "HF_ENDPOINT" in err, err
    assert not (tmp_path / "run").exists()


def test_model_preset_resolves_to_its_hub_id(hub, capsys):
    assert main(["convert", "model=qwen3_30b_a3b", "--cfg", "job"]) == 0
    assert "name: Qwen/Qwen3-30B-A3B" in capsys.readouterr().out
    assert main(["convert", "Qwen/Qwen3-30B-A3B", "--cfg", "job"]) == 0  # and the hub id picks its preset
    assert "accelerate_config: recipes/accelerate/fsdp2_8gpu.yaml" in capsys.readouterr().out
    assert main(["inspect", "Qwen/Qwen3-30B-A3B"]) == 0
    assert "Qwen3-MoE" in capsys.readouterr().out


def test_a_pinned_revision_is_recorded_then_served_from_the_cache_and_offline(hub, pushed, tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    first = len(hub.requests)
    assert main(["convert", f"{MODEL}@v1", f"data.path={DATA}", f"output_dir={tmp_path / 'v1'}", *FAST]) == 0
    requests = [r["path"] for r in hub.requests[first:] if r["path"].startswith(f"/{MODEL}/resolve/")]
    pinned = (f"/{MODEL}/resolve/v1/", f"/{MODEL}/resolve/{hub.v1}/")  # transformers goes on with the commit sha
    assert requests and all(p.startswith(pinned) for p in requests), [p for p in requests if not p.startswith(pinned)]
    assert hub.downloads(first) == []  # the files of v1 are the blobs the first run downloaded: nothing fetched
    assert OmegaConf.load(tmp_path / "v1" / "fcsd_config.yaml").model.revision == "v1"
    export = tmp_path / "v1" / "export"
    assert json.loads((export / "config.json").read_text())["farskip"]["recipe"]["base_revision"] == "v1"
    assert "(revision `v1`)" in (export / "README.md").read_text()

    point_at_hub(monkeypatch, hub.url, hub.root / "hf", offline=True)
    first = len(hub.requests)
    assert main(["convert", f"{MODEL}@v1", f"data.path={DATA}", f"output_dir={tmp_path / 'offline'}", *FAST]) == 0
    assert hub.requests[first:] == []
    assert (tmp_path / "offline" / "export" / "config.json").exists()


def test_a_missing_hub_dataset_is_one_line_and_writes_nothing(hub, tmp_path, capsys):
    assert main(["convert", MODEL, "data.path=org/no-such-data", f"output_dir={tmp_path / 'run'}", *FAST]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "org/no-such-data" in err, err
    assert not (tmp_path / "run").exists()


def test_the_mbpp_plus_file_is_served_as_a_dataset(hub):
    import datasets

    rows = datasets.load_dataset("org/mbpp-plus-mini", split="train")
    fixture = (ROOT / "eval" / "fixtures" / "mbpp_plus_mini.jsonl").read_text().splitlines()
    assert len(rows) == len([line for line in fixture if line.strip()]) and "task_id" in rows.column_names
