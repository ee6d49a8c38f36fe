"""Shared fixtures: tiny random releases (built once per session) and the reference oracle."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

# Cloudflare's reference, shipped unmodified in the PyPI package clef-finetune (DESIGN §2).
ORACLE_SHA256 = "0e304cf7c6500e8bb59bef7e2afd2c6373f82596dfb3b57d1aa93c175e2dc3a3"


def _oracle_path() -> Path | None:
    spec = importlib.util.find_spec("clef_finetune")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "_vendor" / "joint_schema_model.py"
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def oracle() -> ModuleType:
    """The reference ``joint_schema_model.py`` imported by path (a test oracle only)."""
    path = _oracle_path()
    if path is None:
        message = "reference oracle missing: pip install --no-deps clef-finetune"
        if os.environ.get("CLEF_REQUIRE_ORACLE"):
            pytest.fail(message)
        pytest.skip(message)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ORACLE_SHA256, f"{path} is not the unmodified copy"
    spec = importlib.util.spec_from_file_location("clef_reference_oracle", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from clef_local.testing import build_tiny_release

    return build_tiny_release(tmp_path_factory.mktemp("tiny") / "qwen3_5", backbone="qwen3_5", seed=0)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from clef_local.testing import build_tiny_release

    return build_tiny_release(tmp_path_factory.mktemp("tiny") / "llama", backbone="llama", seed=1)


@pytest.fixture(scope="session")
def qwen_model(tiny_qwen: Path):
    import clef_local

    return clef_local.load(tiny_qwen, dtype="float32")
