"""The house's layers (docs/design.md, section 1): the import-linter contract in pyproject.toml places every part of
fcsd, so that a new module cannot escape the one direction of imports that `make lint` checks."""

from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own TOML reader
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_the_layers_contract_places_every_part_of_fcsd():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(contract["layers"] for contract in contracts if contract["type"] == "layers")
    placed = [name.strip() for layer in layers for name in layer.replace(":", "|").split("|")]
    parts = {
        f"fcsd.{path.stem}"
        for path in (ROOT / "fcsd").iterdir()
        if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").exists()
    }
    assert sorted(parts - set(placed)) == [], "add each to a layer of [tool.importlinter] in pyproject.toml"
    assert sorted(set(placed) - parts) == [], "the contract names a part fcsd no longer has"
    assert len(placed) == len(set(placed)), "a part is placed twice"
    assert {contract["type"] for contract in contracts} == {"layers", "acyclic_siblings"}
