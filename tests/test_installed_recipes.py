"""After ``pip install`` (no checkout), fcsd finds its recipes in the package: the Hydra configs compose, the
accelerate configs the launch lines name exist, and the DeepSpeed JSON a shipped config names resolves to the
installed copy. A wheel built from the tree is installed into a folder and used from an unrelated directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# run by the installed package, from an empty working directory
PROBE = """
import json, os, sys
from pathlib import Path

import fcsd
from accelerate.commands.config.config_args import load_config_from_file
from fcsd.distill.config import compose, recipes_dir, to_config
from fcsd.distill.sweep import final_command
from fcsd.plan.printed_commands import accelerate_config
from fcsd.recipe_files import DEEPSPEED_ENV, resolve_deepspeed_config

config = to_config(compose(["model=qwen3_30b_a3b", "data=tulu3_sft_mixture"]))
launch = final_command(config, [], {"batch_tokens": 65536, "lr": 2e-5}).split()
zero3 = load_config_from_file(str(recipes_dir() / "accelerate" / "deepspeed_zero3_8gpu.yaml"))
os.environ[DEEPSPEED_ENV] = zero3.deepspeed_config["deepspeed_config_file"]  # as `accelerate launch` passes it
print(json.dumps({
    "package": str(Path(fcsd.__file__).parent),
    "recipes": str(recipes_dir()),
    "presets": sorted(p.stem for p in (recipes_dir() / "model").glob("*.yaml")),
    "sweep_config": launch[launch.index("--config_file") + 1],
    "plan_config": accelerate_config("ep8_1node.yaml"),
    "given_json": os.environ[DEEPSPEED_ENV],
    "deepspeed_json": resolve_deepspeed_config(),
}))
"""


def test_an_installed_fcsd_finds_its_recipes_without_a_checkout(tmp_path):
    wheels, target, elsewhere = tmp_path / "wheel", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)], check=True)
    (wheel,) = wheels.glob("fcsd-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    recipes = [p.relative_to(ROOT).as_posix() for p in (ROOT / "recipes").rglob("*") if p.suffix in (".yaml", ".json")]
    assert recipes and {f"fcsd/{name}" for name in recipes} <= names
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True)

    env = {**os.environ, "PYTHONPATH": str(target)}
    env.pop("FCSD_RECIPES", None)
    probe = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120
    )
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    package = target / "fcsd"
    assert Path(found["package"]) == package  # the installed copy, not this checkout
    assert Path(found["recipes"]) == package / "recipes"
    assert found["presets"] == sorted(p.stem for p in (ROOT / "recipes" / "model").glob("*.yaml"))
    for key, name in [("sweep_config", "fsdp2_8gpu.yaml"), ("plan_config", "ep8_1node.yaml")]:
        assert Path(found[key]) == package / "recipes" / "accelerate" / name, found[key]  # absolute, installed
    assert found["given_json"] == "recipes/accelerate/zero3.json" and not (elsewhere / found["given_json"]).exists()
    deepspeed = Path(found["deepspeed_json"])
    assert deepspeed == package / "recipes" / "accelerate" / "zero3.json"
    assert json.loads(deepspeed.read_text())["zero_optimization"]["stage"] == 3


def test_a_checkout_keeps_naming_its_recipes_folder(tmp_path, monkeypatch):
    """In a checkout the shipped recipes are the repository's recipes/ (the manual's commands type those paths), a
    path that exists is kept, and FCSD_RECIPES still points elsewhere."""
    from fcsd.recipe_files import DEEPSPEED_ENV, recipe_file, recipes_dir, resolve_deepspeed_config

    monkeypatch.delenv("FCSD_RECIPES", raising=False)
    assert recipes_dir() == ROOT / "recipes"
    monkeypatch.chdir(ROOT)
    assert recipe_file("recipes/accelerate/fsdp2_8gpu.yaml") == "recipes/accelerate/fsdp2_8gpu.yaml"
    monkeypatch.setenv(DEEPSPEED_ENV, "recipes/accelerate/zero3.json")
    assert resolve_deepspeed_config() == "recipes/accelerate/zero3.json"
    monkeypatch.chdir(tmp_path)
    assert recipe_file("recipes/accelerate/fsdp2_8gpu.yaml") == str(ROOT / "recipes" / "accelerate" / "fsdp2_8gpu.yaml")
    assert recipe_file("mine.yaml") == "mine.yaml"  # not a recipe: left for its user
    assert resolve_deepspeed_config() == str(ROOT / "recipes" / "accelerate" / "zero3.json")
    monkeypatch.setenv("FCSD_RECIPES", str(tmp_path))
    assert recipes_dir() == tmp_path
