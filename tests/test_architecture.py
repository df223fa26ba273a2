"""The project's import layering (.importlinter: tools -> megarl -> parallel -> model_specs, the
layers inside parallel/ and megarl/, no cycles), the one room that imports SGLang, and its lint
rules (ruff.toml) hold for the tree."""

import ast
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


def sglang_imports(path: Path) -> list[int]:
    """Line numbers of the imports of ``sglang`` (top-level or inside a function) in a file."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        if any(name == "sglang" or name.startswith("sglang.") for name in names):
            lines.append(node.lineno)
    return lines


def test_only_the_sglang_room_imports_sglang():
    """Everything that knows SGLang lives in megarl/rollout/sglang/: no other module of the four
    packages imports it (import-linter leaves external packages out of its graph, so this reads
    the files)."""
    room = ROOT / "megarl" / "rollout" / "sglang"
    found = [f"{path.relative_to(ROOT)}:{line}" for package in ("megarl", "parallel", "model_specs", "tools")
             for path in sorted((ROOT / package).rglob("*.py")) if not path.is_relative_to(room)
             for line in sglang_imports(path)]
    assert not found, found
    assert sglang_imports(room / "engine_process.py"), "the check no longer sees the room's own imports"


def test_ruff():
    result = run(str(BIN / "ruff"), "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr
