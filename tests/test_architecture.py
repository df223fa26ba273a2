"""The project's import layering (.importlinter: tools -> megarl -> parallel -> model_specs, the
layers inside parallel/ and megarl/, no cycles) and its lint rules (ruff.toml) hold for the tree."""

import configparser
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_import_layers_and_no_cycles():
    result = run(str(BIN / "lint-imports"), "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def _layered(config: configparser.ConfigParser, contract: str) -> set[str]:
    layers = config[f"importlinter:contract:{contract}"]["layers"]
    return {name.strip() for line in layers.splitlines() for name in re.split(r"[|:]", line) if name.strip()}


def test_every_package_sits_on_a_layer():
    """A contract cannot be weakened by dropping a layer: the top-level layers are the four
    packages, every package inside parallel/ and every module or package of megarl/ is on one."""
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    assert _layered(config, "layers") == {"tools", "megarl", "parallel", "model_specs"}
    packages = {p.name for p in (ROOT / "parallel").iterdir() if (p / "__init__.py").is_file()}
    assert packages and packages <= _layered(config, "parallel"), packages - _layered(config, "parallel")
    megarl = {p.stem for p in (ROOT / "megarl").iterdir()
              if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert megarl == _layered(config, "megarl"), megarl ^ _layered(config, "megarl")


def test_ruff():
    result = run(str(BIN / "ruff"), "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr
