"""`fcsd.export`: exported folders of every family reload with remote code (fcsd not importable), with fcsd, fail
loudly with stock transformers, and are written atomically after a reload-parity check."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hub_server import no_hub_login
from tiny_models import CONFIGS, build

import fcsd
from fcsd.embedded.tokenizer import train_tokenizer
from fcsd.export import save as export_module
from fcsd.export.save import ExportError, export, text_logits
from fcsd.serving.served_families import farskip_architecture


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["add 1 + 2", "sort 3 1 2"] * 10, vocab_size=280)


def test_every_family_reloads_with_remote_code_without_fcsd_and_with_fcsd(tmp_path, tokenizer):
    batch = torch.randint(3, 90, (2, 11))
    expected, folders = {}, []
    for name in CONFIGS:
        model = fcsd.apply_farskip(build(name), "last:50%")
        folder = export(model, tokenizer, tmp_path / name)
        with torch.no_grad():
            expected[str(folder)] = text_logits(model, batch)
            reloaded = fcsd.from_pretrained(str(folder))
            assert type(reloaded) is type(model)
            torch.testing.assert_close(text_logits(reloaded, batch), expected[str(folder)])
        assert fcsd.farskip_layers(reloaded) == fcsd.farskip_layers(model)
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"].startswith("farskip_")
        assert config["architectures"] == [farskip_architecture(config["model_type"])]  # the vLLM plugin's class
        assert config["farskip"]["layers"] == fcsd.farskip_layers(model)
        assert json.loads((folder / "fcsd_export.json").read_text())["parity_max_abs_diff"] < 1e-4
        assert "farskip-collective" in (folder / "README.md").read_text()
        assert "vllm serve THIS_FOLDER_OR_REPO" in (folder / "README.md").read_text()  # every family has a vLLM class
        folders.append(str(folder))
    torch.save(batch, tmp_path / "batch.pt")
    worker = Path(__file__).parent / "workers" / "load_remote_code.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, str(worker), str(tmp_path / "batch.pt"), str(tmp_path / "out.pt"), *folders]
    subprocess.run(command, env=env, check=True, capture_output=True, stdin=subprocess.DEVNULL)
    remote = torch.load(tmp_path / "out.pt")
    for folder in folders:
        torch.testing.assert_close(remote[folder].float(), expected[folder])


def test_stock_transformers_refuses_the_folder_without_remote_code(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    folder = export(fcsd.apply_farskip(build("qwen3_moe"), "all"), tokenizer, tmp_path / "out")
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)
    # the tokenizer is a stock one: it loads without running the shipped code, and without a prompt when the caller
    # says either way (a bare call in an interactive session asks; see docs/export-and-hub.md)
    from fcsd.loading import tokenizer_from_pretrained

    expected = tokenizer_from_pretrained(str(folder))("add 1 + 2")["input_ids"]
    script = (
        "import sys; from transformers import AutoTokenizer; "
        "print([AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=t)('add 1 + 2')['input_ids'] "
        "for t in (False, True)])"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script, str(folder)], env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    assert done.stdout.strip() == str([expected, expected])
    assert "Do you wish to run the custom code" not in done.stdout + done.stderr


def test_a_corrupted_shard_aborts_the_export_and_leaves_nothing(tmp_path, tokenizer, monkeypatch):
    from safetensors.torch import load_file, save_file

    real = export_module.write_remote_code

    def corrupting(folder, config, model_class):
        shard = folder / "model.safetensors"
        tensors = load_file(shard)
        name = next(k for k in tensors if k.endswith("q_proj.weight"))
        tensors[name] = tensors[name] + 1.0
        save_file(tensors, shard, metadata={"format": "pt"})
        return real(folder, config, model_class)

    monkeypatch.setattr(export_module, "write_remote_code", corrupting)
    with pytest.raises(ExportError, match=r"reload parity failed: max \|logit difference\|"):
        export(fcsd.apply_farskip(build("qwen3_moe"), "all"), tokenizer, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out*"))


def test_export_refusals(tmp_path, tokenizer):
    model = fcsd.apply_farskip(build("qwen3_moe"), "all")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    for overwrite in (False, True):  # overwrite replaces only an fcsd export
        with pytest.raises(ExportError, match="full holds files fcsd did not write"):
            export(model, tokenizer, tmp_path / "full", overwrite=overwrite)
    assert (tmp_path / "full" / "keep.txt").exists()
    export(model, tokenizer, tmp_path / "out")
    with pytest.raises(ExportError, match="holds an export; pass --overwrite"):
        export(model, tokenizer, tmp_path / "out")
    export(model, tokenizer, tmp_path / "out", overwrite=True)
    (tmp_path / "out" / "notes.txt").write_text("mine")  # an export that also holds a file of the user's
    with pytest.raises(ExportError, match=r"also holds files fcsd did not write \(notes.txt\)"):
        export(model, tokenizer, tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    (tmp_path / "src").mkdir()  # a source that exists (a hub id is not a folder to protect)
    with pytest.raises(ExportError, match="lies inside the source"):
        export(model, tokenizer, tmp_path / "src" / "export", source=tmp_path / "src")
    with pytest.raises(ExportError, match="no FarSkip layers"):
        export(build("qwen3_moe"), tokenizer, tmp_path / "plain")


def _refused_everywhere(folder, edited, values, message, capsys, remote_message=None, fix=""):
    """A copy of the export ``folder`` at ``edited`` with ``values`` as its config.json is refused naming ``message``
    (and ``fix``) by fcsd's loader and by `fcsd push` in one line, and by the shipped remote code with
    ``remote_message``."""
    from transformers import AutoModelForCausalLM

    from fcsd.cli import main

    shutil.copytree(folder, edited)
    (edited / "config.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match=re.escape(message) + ".*" + re.escape(fix)):
        fcsd.from_pretrained(str(edited))
    assert main(["push", str(edited), "me/model", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and fix in err[0], err
    if remote_message is not None:
        with pytest.raises(ValueError, match=re.escape(remote_message)):
            AutoModelForCausalLM.from_pretrained(edited, trust_remote_code=True)


def test_an_export_whose_identity_was_edited_is_refused_wherever_it_loads(tmp_path, tokenizer, capsys):
    """Cases 5-6 of the third hostile probe: `architectures` set back to the stock class, or the `farskip` block
    removed. fcsd's loader and `fcsd push` refuse both in one line naming the field; the shipped remote code refuses
    the second (it had no layers to convert: an AttributeError); nothing loads with stock wiring."""
    from transformers import AutoModelForCausalLM

    folder = export(fcsd.apply_farskip(build("qwen3_moe"), "all"), tokenizer, tmp_path / "out")
    config = json.loads((folder / "config.json").read_text())
    edits = {
        "stock_architecture": ({**config, "architectures": ["Qwen3MoeForCausalLM"]}, "names the stock class"),
        "no_block": ({k: v for k, v in config.items() if k != "farskip"}, "the `farskip` block (which layers"),
    }
    capsys.readouterr()  # the export's own progress output
    for name, (values, message) in edits.items():
        _refused_everywhere(folder, tmp_path / name, values, message, capsys)
    with pytest.raises(ValueError, match=r"has no `farskip.layers` \(the converted layers\)"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "no_block", trust_remote_code=True)


def test_an_export_that_names_another_family_or_declares_itself_stock_is_refused(tmp_path, tokenizer, capsys):
    """`architectures` naming another family's FarSkip class (vLLM builds its model from it) loaded with fcsd
    and the remote code; a folder whose model type and class were both set back to stock (the `farskip` block and
    `auto_map` kept) loaded as FarSkip with the remote code. Each is refused naming the field; the composite and the
    family-less class of fcsd 0.1 still pass."""
    from transformers import AutoModelForCausalLM

    from fcsd.serving.identity import identify

    folder = export(fcsd.apply_farskip(build("qwen3_moe"), "all"), tokenizer, tmp_path / "out")
    config = json.loads((folder / "config.json").read_text())
    other = "names a FarSkip class of another family, not 'FarSkipQwen3MoeForCausalLM', the one of model type"
    edits = {  # name: config.json, what fcsd (loader, push) says, what the shipped remote code says
        "other_family": (
            {**config, "architectures": ["FarSkipDeepseekV2ForCausalLM"]},
            other,
            "names ['FarSkipDeepseekV2ForCausalLM'], not 'FarSkipQwen3MoeForCausalLM', the FarSkip class of model type",
        ),
        "all_stock": (
            {**config, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]},
            "say an fcsd checkpoint that is not an export, but fcsd_export.json beside it records",
            "\"model_type\" is 'qwen3_moe', not 'farskip_qwen3_moe', so it declares a stock model",
        ),
    }
    set_arch = 'set "architectures": ["FarSkipQwen3MoeForCausalLM"]'
    set_type = 'set "model_type": "farskip_qwen3_moe"'
    no_arch = "but this is a FarSkip export of model type 'farskip_qwen3_moe'"
    edits |= {  # the fourth probe: no class named, no model type, a garbled one; the fix names the field's value
        "empty": ({**config, "architectures": []}, '"architectures" is empty, but model type', f"is empty, {no_arch}"),
        "null": (
            {**config, "architectures": None},
            '"architectures" is null',
            f'"architectures" is missing or null, {no_arch}',
        ),
        "missing": (
            {k: v for k, v in config.items() if k != "architectures"},
            "\"architectures\" is missing, but model type 'farskip_qwen3_moe'",
            f'"architectures" is missing or null, {no_arch}',
        ),
        "string": (
            {**config, "architectures": "FarSkipQwen3MoeForCausalLM"},
            "holds the str 'FarSkipQwen3MoeForCausalLM', not a list of class names",
            "holds the str 'FarSkipQwen3MoeForCausalLM', not a list of class names",
        ),
        "no_type": (
            {k: v for k, v in config.items() if k != "model_type"},
            '"model_type" is missing, not a FarSkip model type',
            "\"model_type\" is missing, not 'farskip_qwen3_moe'",
        ),
        "upper_type": (
            {**config, "model_type": "FARSKIP_QWEN3_MOE"},
            "\"model_type\" holds 'FARSKIP_QWEN3_MOE', not a FarSkip model type",
            "\"model_type\" is 'FARSKIP_QWEN3_MOE', not 'farskip_qwen3_moe'",
        ),
    }
    fixes = {"empty": set_arch, "null": set_arch, "missing": set_arch, "string": set_arch}
    capsys.readouterr()
    for name, (values, message, remote_message) in edits.items():
        edited = tmp_path / name
        fix = fixes.get(name, set_type if name.endswith("type") else "")
        _refused_everywhere(folder, edited, values, message, capsys, remote_message, fix)
    (edited / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3MoeForCausalLM"]}))
    with pytest.raises(ValueError, match=re.escape("names ['Qwen3MoeForCausalLM'], not 'FarSkipQwen3MoeForCausalLM'")):
        AutoModelForCausalLM.from_pretrained(edited, trust_remote_code=True)  # the class alone, from the config
    composite = {"model_type": "farskip_llama4", "farskip": {"layers": [1]}}
    assert identify({**composite, "architectures": ["FarSkipLlama4ForConditionalGeneration"]}) == "export"
    composite_other = "of another family, not 'FarSkipLlama4ForConditionalGeneration', the one of model type"
    with pytest.raises(ValueError, match=re.escape(composite_other)):  # the text model's class on the composite
        identify({**composite, "architectures": ["FarSkipLlama4ForCausalLM"]})
    assert identify({**config, "architectures": ["FarSkipForCausalLM"]}) == "export"  # vLLM refuses it by name


def test_serve_command_quotes_the_folder():
    from fcsd.serving.served_families import serve_command

    assert serve_command("runs/my model", "qwen3_moe") == "vllm serve 'runs/my model'"  # one argument to a shell
    assert serve_command("out/export", "farskip_qwen3_moe") == "vllm serve out/export"
    assert serve_command("out", "no_such_family") is None


def test_fcsd_export_command(tmp_path, tokenizer, capsys):
    from fcsd.cli import main

    model = fcsd.apply_farskip(build("olmoe"), "last:1")
    model.save_pretrained(tmp_path / "run" / "final")
    tokenizer.save_pretrained(tmp_path / "run" / "final")
    # --format bf16 declines an FP8 source's format, it casts nothing; --text-only of a text model: each said in a line
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--format", "bf16", "--text-only"]) == 0
    printed = capsys.readouterr().out
    assert "reload parity checked" in printed
    assert "--format bf16 writes the weights unquantized as they are: float32, this checkpoint's dtype" in printed
    assert f"--text-only changes nothing: {tmp_path / 'run' / 'final'} is a text model, exported as it is" in printed
    assert f"vllm serve {tmp_path / 'out'}" in printed  # the plugin's serve command
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o666 & ~umask  # save_pretrained's 0600 opened up
    assert fcsd.farskip_layers(fcsd.from_pretrained(str(tmp_path / "out"))) == fcsd.farskip_layers(model)
    assert (tmp_path / "out" / "modeling_farskip.py").exists()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    assert "holds an export; pass --overwrite" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
    assert "nothing: no such folder; give a run folder, a converted checkpoint or a step checkpoint" in (
        capsys.readouterr().err
    )
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), str(tmp_path / "x")]) == 2
    assert "neither a converted checkpoint, a run folder with final/, nor a step checkpoint" in capsys.readouterr().err


def test_export_under_a_multi_process_launch_is_refused_up_front(tmp_path, monkeypatch, capsys):
    """`fcsd launch torchrun --nproc_per_node 2 -m fcsd.cli export` refused itself: its ranks fought over OUT_DIR's
    lock ("in use by another fcsd command"). Export runs in one process: refused in one line saying so."""
    from fcsd.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fcsd export runs in one process, but this launch started 2" in err[0], err
    assert "run `fcsd export SOURCE OUT_DIR` alone, without a launcher" in err[0]
    assert not list(tmp_path.iterdir())


def test_model_card_of_a_converted_run(tmp_path):
    """The card `fcsd convert` exports: metadata, conversion settings and results, loading, citation."""
    from fcsd.export.model_card import render_card

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "fcsd_config.yaml").write_text(
        "model: {name: Qwen/Qwen3-30B-A3B}\ndata: {path: chat.jsonl}\n"
        "train: {objective: kl, divergence: forward_kl, batch_tokens: 65536, lr: 2.0e-05, warmup_steps: 1000}\n"
    )
    summary = {"steps": 3000, "eval_before": {"eval/kl": 0.91}, "eval_after": {"eval/kl": 0.05}}
    (run / "run_summary.json").write_text(json.dumps(summary))
    (run / "eval_table.md").write_text("| task | original | converted |\n|---|---|---|\n| piqa | 80.1 | 79.8 |")
    from fcsd.export.model_card import read_run_facts

    card = render_card({"layers": [2, 3], "spec": "2-3", "fcsd_version": "0.1.0"}, read_run_facts(run / "final"), 4)
    assert card.startswith("---\nbase_model: Qwen/Qwen3-30B-A3B\nlibrary_name: transformers\n")
    for text in ("- farskip-collective", "rewires 2 of its 4 decoder layers", "| tokens | 196,608,000 |",
                 "| learning rate | 2e-05", "0.9100 before, 0.0500 after", "| piqa | 80.1 | 79.8 |",
                 "trust_remote_code=True", "arXiv:2511.11505"):  # fmt: skip
        assert text in card, text


@pytest.fixture
def hub(monkeypatch, tmp_path):
    from hub_server import HubServer

    server = HubServer()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    no_hub_login(monkeypatch, tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield server
    server.close()


def test_push_uploads_the_folder_in_one_commit_and_never_prints_the_token(
    tmp_path, tokenizer, hub, monkeypatch, capsys
):
    from fcsd.cli import main

    folder = export(fcsd.apply_farskip(build("qwen3_moe"), "all"), tokenizer, tmp_path / "out")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token")
    assert main(["push", str(folder), "me/qwen3-farskip", "--private"]) == 0
    printed = capsys.readouterr()
    assert "hf_secret_token" not in printed.out + printed.err
    assert f"{hub.url}/me/qwen3-farskip/commit/" in printed.out
    create = next(r for r in hub.requests if r["path"] == "/api/repos/create")
    payload = json.loads(create["body"])
    assert (payload["organization"], payload["name"], payload["visibility"]) == ("me", "qwen3-farskip", "private")
    assert sum("/commit/" in r["path"] for r in hub.requests) == 1
    assert all(r["auth"] == "Bearer hf_secret_token" for r in hub.requests if r["path"].startswith("/api/models/"))
    expected = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert hub.committed_files() == expected


def test_push_dry_run_missing_token_and_unverified_folder(tmp_path, tokenizer, hub, monkeypatch, capsys):
    from fcsd.cli import main

    folder = export(fcsd.apply_farskip(build("olmoe"), "all"), tokenizer, tmp_path / "out")
    assert main(["push", str(folder), "me/x", "--dry-run"]) == 0
    listing = capsys.readouterr().out
    assert "modeling_farskip.py" in listing and "fcsd_export.json" in listing and not hub.requests
    assert main(["push", str(folder), "me/x"]) == 2
    assert "no hub token: set HF_TOKEN" in capsys.readouterr().err
    (folder / "fcsd_export.json").unlink()
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    assert main(["push", str(folder), "me/x"]) == 2
    assert "only folders written by `fcsd export`" in capsys.readouterr().err
    assert not hub.requests


def test_model_card_of_a_local_or_demo_base_asks_no_hub(tmp_path, monkeypatch):
    import huggingface_hub

    from fcsd.export.model_card import render_card

    asked = []
    monkeypatch.setattr(huggingface_hub.ModelCard, "load", lambda *args, **kwargs: asked.append(args))
    for base in ("demo", str(tmp_path / "missing-local-model")):
        card = render_card({"layers": [1], "spec": "1"}, {"config": {"model": {"name": base}}}, 2)
        assert "license" not in card.split("---")[1] and "base_model" not in card.split("---")[1]
    assert asked == []  # no hub request (offline machines would wait for retries)


def test_a_step_checkpoint_of_a_bf16_source_exports(tmp_path, capsys):
    """`fcsd export RUN/checkpoints/step-N` of a bf16 checkpoint: the step model is rebuilt in bf16 the way a fresh
    load builds it (RoPE's inv_freq kept in fp32, as transformers keeps it), so the export's reload parity compares
    like with like and passes, and the export holds the checkpoint's bf16 weights."""
    from fcsd.cli import main
    from fcsd.embedded.synthetic import make_dataset, write_jsonl
    from fcsd.export.step_checkpoint import load_step_checkpoint

    data = make_dataset(40, seed=3)
    chat = train_tokenizer((m["content"] for r in data for m in r["messages"]), vocab_size=280)
    model = build("qwen3_moe")
    model.resize_token_embeddings(len(chat), mean_resizing=False)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    chat.save_pretrained(tmp_path / "bf16")
    write_jsonl(data, tmp_path / "train.jsonl")
    run = tmp_path / "run"
    args = ["convert", str(tmp_path / "bf16"), f"data.path={tmp_path / 'train.jsonl'}", f"output_dir={run}"]
    args += ["data.seq_len=32", "data.eval_sequences=2", "train.batch_tokens=128", "train.max_steps=2"]
    args += ["train.save_every=1", "train.warmup_steps=1", "progress=false", "early_stop.enabled=false"]
    args += ["export=false", "recovery=plain"]
    args += [f"data.cache_dir={tmp_path / 'cache'}"]
    assert main(args) == 0
    assert main(["export", str(run / "checkpoints" / "step-1"), str(tmp_path / "export")]) == 0, capsys.readouterr()
    exported = fcsd.from_pretrained(str(tmp_path / "export"), dtype="auto").eval()
    assert exported.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    step_model, _ = load_step_checkpoint(run / "checkpoints" / "step-1")
    assert step_model.model.rotary_emb.inv_freq.dtype == exported.model.rotary_emb.inv_freq.dtype == torch.float32
    batch = torch.randint(3, 200, (2, 64))
    assert torch.equal(text_logits(step_model, batch), text_logits(exported, batch))  # the same model, bit for bit


def test_a_tied_model_writes_one_set_of_files_in_one_process_and_laid_out(tmp_path):
    """A bf16 checkpoint with `tie_word_embeddings=true` trained one step in one process wrote
    `lm_head.weight` (a cast copy of the embeddings, no longer sharing their storage) into final/, while the same run
    under FSDP2 on 2 processes (streamed) left it out, as `save_pretrained` does: two sets of files for one run. Now
    final/ and the export hold the same keys either way (no `lm_head.weight`), and load equal and tied."""
    from launch import torchrun
    from safetensors import safe_open
    from tiny_models import CONFIGS

    from fcsd.cli import main
    from fcsd.embedded.synthetic import make_dataset, write_jsonl

    data = make_dataset(40, seed=3)
    chat = train_tokenizer((m["content"] for r in data for m in r["messages"]), vocab_size=280)
    model_class, config = CONFIGS["qwen3_moe"]()
    config.update({"tie_word_embeddings": True, "vocab_size": len(chat)})
    torch.manual_seed(0)
    model_class(config).to(torch.bfloat16).save_pretrained(tmp_path / "tied")
    chat.save_pretrained(tmp_path / "tied")
    write_jsonl(data, tmp_path / "train.jsonl")
    args = ["convert", str(tmp_path / "tied"), f"data.path={tmp_path / 'train.jsonl'}"]
    args += ["data.seq_len=32", "data.eval_sequences=2", "train.batch_tokens=128", "train.micro_batch_size=2"]
    args += ["train.max_steps=1", "train.warmup_steps=0", "progress=false", "early_stop.enabled=false"]
    args += [f"data.cache_dir={tmp_path / 'cache'}"]
    assert main([*args, f"output_dir={tmp_path / 'one'}"]) == 0
    torchrun(2, "-m", "fcsd.cli", *args, "parallel.fsdp=true", f"output_dir={tmp_path / 'two'}", timeout=600)

    def keys(folder: Path) -> list[str]:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
            return sorted(handle.keys())

    for part in ("final", "export"):
        one, two = tmp_path / "one" / part, tmp_path / "two" / part
        assert keys(one) == keys(two) == keys(tmp_path / "tied"), part  # the keys save_pretrained wrote the source with
        assert "model.embed_tokens.weight" in keys(one) and "lm_head.weight" not in keys(one), part
        first, second = fcsd.from_pretrained(str(one)), fcsd.from_pretrained(str(two))
        assert first.lm_head.weight is first.model.embed_tokens.weight  # tied again on load
        assert second.lm_head.weight is second.model.embed_tokens.weight
        for (name, x), (_, y) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
            torch.testing.assert_close(x, y, msg=name, atol=1e-6, rtol=2**-7)  # bf16: one rounding apart at most


def test_a_text_model_run_exports_after_its_source_went_away(tmp_path, capsys):
    """A Qwen3-MoE run's final/ exports without its source (moved away after the run, as a relative path seen from
    another folder or a hub id offline would be): only a run trained from a composite reads its source at export
    (to put its vision tower back); fcsd convert records which (none here)."""
    from fcsd.cli import main
    from fcsd.embedded.synthetic import make_dataset, write_jsonl
    from fcsd.export.composite import SOURCE_KEY

    data = make_dataset(40, seed=3)
    chat = train_tokenizer((m["content"] for r in data for m in r["messages"]), vocab_size=280)
    model = build("qwen3_moe")
    model.resize_token_embeddings(len(chat), mean_resizing=False)
    model.save_pretrained(tmp_path / "source")
    chat.save_pretrained(tmp_path / "source")
    write_jsonl(data, tmp_path / "train.jsonl")
    run = tmp_path / "run"
    args = ["convert", str(tmp_path / "source"), f"data.path={tmp_path / 'train.jsonl'}", f"output_dir={run}"]
    args += ["data.seq_len=32", "data.eval_sequences=2", "train.batch_tokens=128", "train.max_steps=1"]
    args += ["train.warmup_steps=0", "progress=false", "early_stop.enabled=false", "export=false", "recovery=plain"]
    args += [f"data.cache_dir={tmp_path / 'cache'}"]
    assert main(args) == 0
    assert SOURCE_KEY not in json.loads((run / "final" / "config.json").read_text())
    shutil.move(tmp_path / "source", tmp_path / "moved")
    assert main(["export", str(run), str(tmp_path / "export")]) == 0, capsys.readouterr().err
    assert fcsd.farskip_layers(fcsd.from_pretrained(str(tmp_path / "export"))) != []
