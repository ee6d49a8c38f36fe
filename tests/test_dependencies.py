"""Dependencies that hold still: the dev extra is built from the user extras, and constraints.txt pins all of it."""

from __future__ import annotations

import importlib.util
import tomllib
from importlib.metadata import distribution
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# What dev leaves out of the user extras, and why (pyproject.toml says the same beside dev).
NOT_IN_DEV = {
    "torchvision": "PyPI's torchvision does not import beside the CPU torch wheel",
    "onnxruntime-gpu": "it clashes with the onnx extra's onnxruntime",
    "flash-linear-attention": "Triton kernels for a GPU",
}


@pytest.fixture(scope="module")
def constraints_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("constraints_script", ROOT / "scripts" / "constraints.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pins() -> dict[str, str]:
    """constraints.txt as canonical name -> version; every line is ``name==version`` (pip's constraint grammar)."""
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==" and not req.extras and req.marker is None, line
            out[canonicalize_name(req.name)] = spec.version
    return out


def test_dev_holds_every_user_extra_with_the_same_specifiers(constraints_script: ModuleType):
    """Each user extra's requirement is in dev's expansion with the same version range (the self-reference makes it
    so; a hand copy such as bitsandbytes must agree), but for NOT_IN_DEV."""
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dev = {(canonicalize_name(r.name), str(r.specifier), str(r.marker))
           for r in constraints_script.root_requirements(extras=("dev",))}
    assert "onnx-gpu" in optional
    for extra, lines in optional.items():
        if extra == "dev":
            continue
        for line in lines:
            req = Requirement(line)
            name = canonicalize_name(req.name)
            if name in NOT_IN_DEV:
                continue
            assert (name, str(req.specifier), str(req.marker)) in dev, f"[{extra}] {line} is not in dev as written"


def test_an_unknown_extra_is_named(constraints_script: ModuleType, tmp_path: Path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\ndependencies = []\n[project.optional-dependencies]\n'
                         'dev = ["x[serve]"]\n')
    with pytest.raises(KeyError, match="no extra 'serve'"):
        constraints_script.root_requirements(pyproject)


def test_constraints_pin_everything_dev_installs_at_the_installed_version(constraints_script: ModuleType):
    """Every distribution the core install plus dev resolves to here is pinned, at the version this venv has (CI's
    venv is installed with the file, so a mismatch means the file was not regenerated), and each pin satisfies
    pyproject's own ranges (a pin outside a ceiling would make the install unresolvable)."""
    pinned = pins()
    needed = constraints_script.closure(constraints_script.root_requirements())
    missing = sorted(set(needed) - set(pinned))
    assert not missing, f"constraints.txt lacks {missing}: regenerate it (scripts/constraints.py)"
    drifted = {n: (pinned[n], v) for n, v in needed.items() if pinned[n] != v}
    assert not drifted, f"constraints.txt vs installed: {drifted}"
    assert pinned["torch"] == str(Version(distribution("torch").version).public)  # no +cpu: the pin fits any build
    for req in constraints_script.root_requirements():
        name = canonicalize_name(req.name)
        if req.marker is None or req.marker.evaluate():
            assert req.specifier.contains(pinned[name], prereleases=True), f"{name}=={pinned[name]} outside {req}"
    for name in constraints_script.ORACLE:
        assert canonicalize_name(name) in pinned


def test_ceilings_where_private_apis_are_used():
    """torch (private aten ops), uvicorn (H11Protocol's internals) and bitsandbytes (its torch op) have ceilings;
    torch's floor is the CPU int4 kernel's first release."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    every = [Requirement(r) for r in project["dependencies"]]
    every += [Requirement(r) for lines in project["optional-dependencies"].values() for r in lines]
    for name in ("torch", "uvicorn", "bitsandbytes"):
        for req in (r for r in every if canonicalize_name(r.name) == name):
            assert any(s.operator == "<" for s in req.specifier), f"{req} has no ceiling"
    (torch,) = (r for r in every if r.name == "torch")
    assert not torch.specifier.contains("2.5.1") and torch.specifier.contains("2.6.0")
