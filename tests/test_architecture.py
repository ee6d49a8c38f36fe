"""The architecture contract (docs/architecture.md), checked on every run: package layers and no import cycles
(import-linter), no module importing another's ``_private`` names, and the type check (mypy). Each check also runs
once on a seeded violation, in a copy of the package, to show that it can fail."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _copy(target: Path) -> Path:
    """The package's ``.py`` files copied under ``target`` (for a seeded violation that must not touch the tree)."""
    for file in (ROOT / "clef_local").rglob("*.py"):
        out = target / file.relative_to(ROOT)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(file, out)
    return target


def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", command, str(ROOT / "pyproject.toml"), "--no-cache"],
                          capture_output=True, text=True, cwd=tree, env=env, timeout=300)


def test_the_layers_hold_and_no_package_has_a_cycle() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in result.stdout


def test_a_seeded_cycle_breaks_the_contract(tmp_path: Path) -> None:
    """The check can fail: one upward import (runtime → model, a cycle through model → runtime) is caught."""
    tree = _copy(tmp_path)
    encoding = tree / "clef_local" / "runtime" / "encoding.py"
    seeded = "\n\ndef _seeded() -> None:\n    from clef_local.model import load  # noqa\n"
    encoding.write_text(encoding.read_text() + seeded)
    result = _lint_imports(tree)
    assert result.returncode != 0
    assert "clef_local.runtime is not allowed to import clef_local.model" in result.stdout


def _private_imports(file: Path, module: str) -> list[str]:
    """``from X import _name`` and ``alias._name`` of another clef_local module, with line numbers."""
    tree = ast.parse(file.read_text(encoding="utf-8"))
    found, aliases = [], {}
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:  # relative: from the package, or from its parent for each extra dot
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = f"{base}.{source}".rstrip(".")
            if not source.startswith("clef_local"):
                continue
            for alias in node.names:
                # a private module of the importer's own package (quant._rowwise) is the package's to share
                sibling_module = source == package
                if alias.name.startswith("_") and not alias.name.startswith("__") and source != module \
                        and not sibling_module:
                    found.append(f"{file}:{node.lineno}: from {source} import {alias.name}")
                aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("clef_local") and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{file}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_imports_another_modules_private_names() -> None:
    problems = []
    for file in sorted((ROOT / "clef_local").rglob("*.py")):
        module = ".".join(file.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        problems += _private_imports(file, module)
    assert not problems, "\n".join(problems)


def test_the_private_name_check_can_fail(tmp_path: Path) -> None:
    seeded = tmp_path / "m.py"
    seeded.write_text("from clef_local.cli import _hidden\nimport clef_local.errors as e\ne._x\n"
                      "from . import int4\nint4._check\n")
    assert len(_private_imports(seeded, "clef_local.quant.other")) == 3  # named-paths: ignore


def _mypy(tree: Path, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           "--cache-dir", str(cache), "clef_local"],
                          capture_output=True, text=True, cwd=tree, timeout=900)


def test_types_check(tmp_path_factory: pytest.TempPathFactory) -> None:
    cache = tmp_path_factory.mktemp("mypy-cache")
    result = _mypy(ROOT, cache)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    # and it can fail: a seeded type error in a leaf module of a copy (checked from the warm cache)
    tree = _copy(tmp_path_factory.mktemp("seeded"))
    leaf = tree / "clef_local" / "decide.py"
    leaf.write_text(leaf.read_text() + "\n\ndef _seeded() -> int:\n    return 'not an int'\n")
    seeded = _mypy(tree, cache)
    assert seeded.returncode != 0 and "decide.py" in seeded.stdout and "return-value" in seeded.stdout
