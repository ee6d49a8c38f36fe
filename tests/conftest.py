"""Shared fixtures: tiny random releases (built once per session) and the reference oracle."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(autouse=True)
def _own_reference_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Each test its own folder of cached reference answers (quantize keeps them per release, and the tiny releases
    of two tests, or two workers, can share a digest): created only when a test writes one. Set here, not with
    ``monkeypatch``: a test's ``monkeypatch.undo()`` would send it to the user cache."""
    before = os.environ.get("CLEF_LOCAL_REFERENCES")
    os.environ["CLEF_LOCAL_REFERENCES"] = str(tmp_path_factory.getbasetemp() / f"references-{uuid.uuid4().hex}")
    yield
    if before is None:
        os.environ.pop("CLEF_LOCAL_REFERENCES", None)
    else:
        os.environ["CLEF_LOCAL_REFERENCES"] = before


@pytest.fixture(scope="session")
def oracle() -> ModuleType:
    """The reference ``joint_schema_model.py`` imported by path (a test oracle only)."""
    from clef_local.testing import load_reference_oracle

    try:
        return load_reference_oracle()
    except ModuleNotFoundError as exc:
        # CI sets CLEF_REQUIRE_ORACLE so that a missing install step fails instead of skipping parity.
        if os.environ.get("CLEF_REQUIRE_ORACLE"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))


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


@pytest.fixture(scope="session")
def demo_release() -> Path:
    """The embedded demo model (clef-demo-135m), built into the user cache on first use (~30 s, offline)."""
    from clef_local.demo.build import demo_available
    from clef_local.demo.default import default_model_path

    if not demo_available():
        pytest.fail("the demo head is not packaged (clef_local/demo/head/joint_head.safetensors)")
    return default_model_path()


@pytest.fixture(scope="session")
def tiny_vision(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3.5 release with the PIL image processor (images without torchvision)."""
    from clef_local.testing import build_tiny_release

    return build_tiny_release(tmp_path_factory.mktemp("tiny") / "vision", backbone="qwen3_5", seed=0, vision=True)


@pytest.fixture(scope="session")
def vision_model(tiny_vision: Path):
    import clef_local

    return clef_local.load(tiny_vision, dtype="float32")
