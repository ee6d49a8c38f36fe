"""The reference runs once per release: validation keeps its answers in the user cache, the next variant reuses them
(and only the probes they do not cover run live), a damaged or foreign cache file is named and not used."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from clef_local.export.reference_cache import ENV, ReferenceCache
from clef_local.export.validate import ValidationRefused, validate_export, validation_requests
from clef_local.formats.manifest import release_digest
from clef_local.testing import build_tiny_release


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_release(tmp_path_factory.mktemp("src") / "llama", "llama", seed=5)


def variant(source: Path, tmp_path: Path, name: str) -> Path:
    """A copy of the source as the "variant": validation runs its real passes over it."""
    return shutil.copytree(source, tmp_path / name, ignore=shutil.ignore_patterns("validation.json"))


def validated(reference: Path, candidate: Path, n: int) -> dict:
    """validation.json's record, whatever the verdict (the tiny release's few probes often leave it undecided)."""
    try:
        return validate_export(reference, candidate, "int4", n=n, dtype="float32")
    except ValidationRefused as exc:
        assert exc.result is not None
        return exc.result


def cache_files() -> list[Path]:
    return sorted(Path(os.environ[ENV]).glob("*.json"))


def test_the_second_variant_reuses_the_reference_answers(source: Path, tmp_path: Path) -> None:
    first = validated(source, variant(source, tmp_path, "a"), 32)
    assert first["reference_answers"]["source"] == "live" and first["reference_answers"]["live"] == first["requests"]
    assert first["runs"]["reference"]["requests"] == first["requests"]
    [kept] = cache_files()
    assert json.loads(kept.read_text())["requests"]["count"] == first["requests"]

    second = validated(source, variant(source, tmp_path, "b"), 32)
    assert "reference" not in second["runs"]  # the reference was not loaded at all
    assert second["reference_answers"] == {"source": "user cache", "live": 0, "cached": second["requests"],
                                           "cache": str(kept)}
    assert second["metrics"] == first["metrics"] and second["verdict"] == first["verdict"]
    assert second["runs"]["variant"]["loads"] == 1  # kept loaded across its looks: nothing else needed loading


def test_a_longer_validation_runs_only_the_probes_the_cache_lacks(source: Path, tmp_path: Path) -> None:
    short = validated(source, variant(source, tmp_path, "a"), 32)
    entry = ReferenceCache.open(source, release_digest(source), [], dtype="float32", context=0)
    assert entry.covered() == 0  # another context: another entry
    # 64 probes: the first `short["requests"]` are the 32-probe set's first ones (the set is built as prefixes)
    longer = validated(source, variant(source, tmp_path, "b"), 64)
    answers = longer["reference_answers"]
    assert answers["cached"] == min(short["requests"], longer["requests"])
    assert answers["live"] == longer["requests"] - answers["cached"]
    [kept] = cache_files()  # one file: the 32-probe set is the 64-probe set's prefix
    assert json.loads(kept.read_text())["requests"]["count"] == max(short["requests"], longer["requests"])
    again = validated(source, variant(source, tmp_path, "c"), 32)  # a shorter set is served by the longer file
    assert again["reference_answers"]["live"] == 0 and "reference" not in again["runs"]


def test_a_damaged_cache_file_is_named_and_recomputed(source: Path, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    first = validated(source, variant(source, tmp_path, "a"), 32)
    [kept] = cache_files()
    original = json.loads(kept.read_text())
    data = json.loads(kept.read_text())
    data["records"][0]["questions"][0]["p"][0] += 0.25  # a hand edit: its content digest no longer matches
    kept.write_text(json.dumps(data))
    with caplog.at_level("WARNING", logger="clef_local.export.reference_cache"):
        again = validated(source, variant(source, tmp_path, "b"), 32)
    assert any(str(kept) in r.getMessage() and "content does not match" in r.getMessage() for r in caplog.records)
    assert again["reference_answers"]["source"] == "live" and again["metrics"] == first["metrics"]
    assert json.loads(kept.read_text())["records"] == original["records"]  # written again, whole


def test_a_cache_made_with_another_head_is_not_used(source: Path, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Keyed by the manifest's digest, which a hand-edited head does not change: the head's own hashes are checked."""
    first = validated(source, variant(source, tmp_path, "a"), 16)
    assert first["reference_answers"]["live"] == 16
    requests = validation_requests(16)
    digest = release_digest(source)
    changed = shutil.copytree(source, tmp_path / "changed")
    head = changed / "joint_head.safetensors"
    blob = bytearray(head.read_bytes())
    blob[-1] ^= 1  # one bit of the head's last weight
    head.write_bytes(bytes(blob))
    [kept] = cache_files()
    context = int(kept.stem.split("-")[2])
    assert ReferenceCache.open(source, digest, requests, dtype="float32", context=context).covered() == 16
    with caplog.at_level("WARNING", logger="clef_local.export.reference_cache"):
        entry = ReferenceCache.open(changed, digest, requests, dtype="float32", context=context)
    assert entry.covered() == 0 and any("another head" in r.getMessage() for r in caplog.records)
