"""The embedded default model, ``clef-demo-135m``, built into the user cache on first use (docs/demo-model.md).

The converted backbone (:mod:`clef_local.demo.backbone`, plus a shipped adapter, :mod:`clef_local.demo.adapter`),
the packaged head checked against its hashes and a manifest, renamed into place when complete. An older head is
replaced on upgrade; a file that does not match its manifest is corruption, named and never repaired silently.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from clef_local.demo.adapter import ADAPTER_FILE, merge_adapter
from clef_local.errors import ReleaseError
from clef_local.formats.manifest import MANIFEST, sha256, verify, write_manifest

log = logging.getLogger(__name__)

DEMO_NAME = "clef-demo-135m"
HEAD_FILES = ("joint_head.safetensors", "joint_head_config.json")


def _packaged() -> Path:
    return Path(str(resources.files("clef_local.demo.head")))


def demo_available() -> bool:
    """Whether the trained demo head ships with this installation."""
    return (_packaged() / "joint_head.safetensors").is_file()


def _expected_hashes() -> dict[str, str]:
    return json.loads((_packaged() / "hashes.json").read_text())


def _packaged_adapter() -> Path | None:
    """The packaged backbone adapter, or None when this version ships none."""
    path = _packaged() / ADAPTER_FILE
    return path if path.is_file() else None


def _check_head(directory: Path) -> None:
    for name, expected in _expected_hashes().items():
        found = sha256(directory / name)
        if found != expected:
            raise ReleaseError(f"{directory / name}: SHA-256 {found} differs from the recorded {expected}; "
                               f"delete {directory} to rebuild the demo model")


def build_demo(target: Path) -> Path:
    """Convert the GGUF backbone and add the packaged head: a complete release at ``target``."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from clef_local.demo.backbone import convert_backbone, find_gguf

    gguf = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        release = staging / "release"
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True) as bar:
            bar.add_task(f"building {DEMO_NAME} from {gguf.name} (once)", total=None)
            convert_backbone(gguf, release)
        for name in (*HEAD_FILES, "MODEL_CARD.md"):
            shutil.copyfile(_packaged() / name, release / name)
        if (adapter := _packaged_adapter()) is not None:
            # the adapter travels with the release (its hash is checked like the head's), merged into the weights
            shutil.copyfile(adapter, release / ADAPTER_FILE)
            merge_adapter(release / "model.safetensors", release / ADAPTER_FILE)
        _check_head(release)
        write_manifest(release, name=DEMO_NAME)
        if not target.exists():  # another process may have finished first; theirs is as good
            release.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("built %s at %s", DEMO_NAME, target)
    return target


def verify_demo(directory: Path) -> None:
    """Check every file of a built demo release against its manifest (sizes and SHA-256)."""
    problems = verify(directory)
    if problems:
        raise ReleaseError("; ".join(problems) + f"; delete {directory} to rebuild the demo model")
    _check_head(directory)


def _outdated_head(directory: Path) -> bool:
    """The build is intact (every file matches its manifest) but its head is not the one this version ships."""
    return not verify(directory) and (_adapter_changed(directory) or any(
        not (directory / name).is_file() or sha256(directory / name) != expected
        for name, expected in _expected_hashes().items()))


def refresh_head(directory: Path) -> None:
    """Replace an intact build's head files and model card with the packaged ones (each rename is atomic), then
    rewrite its manifest; the backbone is kept."""
    for name in (*HEAD_FILES, "MODEL_CARD.md"):
        tmp = directory / f".{name}.tmp-{os.getpid()}"
        shutil.copyfile(_packaged() / name, tmp)
        tmp.replace(directory / name)
    write_manifest(directory, name=DEMO_NAME)
    log.info("updated the %s head in %s (this clef-local ships a newer one)", DEMO_NAME, directory)


def _adapter_changed(directory: Path) -> bool:
    """The build's merged adapter is not the one this version ships (or one was added or removed): its backbone
    weights must be rebuilt, not only its head files replaced."""
    expected = _expected_hashes().get(ADAPTER_FILE)
    found = directory / ADAPTER_FILE
    return (sha256(found) if found.is_file() else None) != expected


def rebuild(target: Path) -> None:
    """Build a new release beside ``target`` and swap it in (the old one is moved aside first, then removed)."""
    aside = target.with_name(f".{target.name}.old-{os.getpid()}")
    target.rename(aside)
    try:
        build_demo(target)
    except BaseException:
        if not target.exists():
            aside.rename(target)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    log.info("rebuilt %s at %s (this clef-local ships another backbone adapter)", DEMO_NAME, target)


def demo_path(cache: Path) -> Path:
    """The demo release in ``cache``, built on first use and verified by hash every time."""
    target = cache / DEMO_NAME
    if not (target / MANIFEST).is_file():
        build_demo(target)
    elif _outdated_head(target):
        if _adapter_changed(target):
            rebuild(target)
        else:
            refresh_head(target)
    verify_demo(target)
    return target
