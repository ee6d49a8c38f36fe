"""A refused export keeps what it measured (``OUT.validation.json``, ``--report``, ``--quarantine DIR``) and nothing
at ``--out``; a quarantined variant is refused by the loaders; a disk too small is refused before any shard is read;
the exit codes. docs/quantization.md#validation."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import clef_local
from clef_local.errors import ReleaseError
from clef_local.export import refusal, validate
from clef_local.export.quantize import main as quantize_main
from clef_local.export.quantize import quantize_release
from clef_local.export.staging import ExportError
from clef_local.export.validate import VALIDATION, ValidationFailed, ValidationRefused, ValidationUndecided
from clef_local.formats.release import read_release
from clef_local.formats.variant import QUARANTINED
from clef_local.quant import registry
from clef_local.testing import build_tiny_release

# enough probes that int8's 1% flip limit could pass (fewer are refused before quantizing); a broken variant is
# refused at the first look (16) all the same
FAST = ["--validation-requests", "256"]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_release(tmp_path_factory.mktemp("src") / "llama", "llama", seed=3)


@pytest.fixture
def strict(monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded broken int8: its codes replaced by seeded random ones, so decisions move; the real validation runs,
    measures, and refuses it at its first look."""
    row = registry.SCHEMES["int8"]
    generator = torch.Generator().manual_seed(0)

    def broken(weight, *args, **kwargs):
        out = row.quantize(weight, *args, **kwargs)
        codes = torch.randint(-127, 128, out["weight"].shape, generator=generator, dtype=torch.int8)
        return {**out, "weight": codes}

    monkeypatch.setitem(registry.SCHEMES, "int8", dataclasses.replace(row, quantize=broken))


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    code = quantize_main(list(args))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return code, err


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_the_validation_error_family() -> None:
    result = {"passed": False}
    for cls in (ValidationFailed, ValidationUndecided):
        exc = cls("no", result)
        assert isinstance(exc, ValidationRefused) and exc.result is result and str(exc) == "no"
    assert ValidationFailed("no").result is None


def test_a_refused_export_keeps_its_report_beside_out_and_nothing_at_out(source: Path, tmp_path: Path,
                                                                        strict: None) -> None:
    out, html = tmp_path / "v", tmp_path / "r.html"
    with pytest.raises(ValidationFailed) as info:
        quantize_release(source, out, "int8", validation_requests=256, report=html)
    kept = tmp_path / "v.validation.json"
    message = str(info.value)
    bounds = r"[0-9.e-]+ \[[0-9.e-]+, [0-9.e-]+\]"
    assert re.match(rf"int8 variant fails validation: mean_kl {bounds} > 0\.002, flip_rate {bounds} > 0\.01; ", message)
    assert f"nothing was written to {out}; report: {kept}; HTML report: {html}" in message
    assert not out.exists() and leftovers(tmp_path) == []
    stored = json.loads(kept.read_text())
    assert stored == info.value.result and stored["passed"] is False
    assert stored["requests"] == 16 and stored["probe_set"] == 256  # refused at the first look
    assert stored["variant"] == str(out) and stored["thresholds"] == validate.THRESHOLDS["int8"]
    page = html.read_text()
    assert page.startswith("<!doctype html>") and "int8 variant fails validation" in page and "✗" in page


def test_quarantine_keeps_the_variant_and_every_loader_refuses_it(source: Path, tmp_path: Path, strict: None,
                                                                  capsys) -> None:
    out, kept = tmp_path / "v", tmp_path / "kept"
    code, err = cli(capsys, "--model", str(source), "--format", "int8", "--out", str(out), "--quarantine",
                    str(kept), *FAST)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("error: int8 variant fails validation: ")
    assert err[0].endswith(f"report: {tmp_path / 'v.validation.json'}; the variant is kept, quarantined (clef-local "
                           f"will not run it), in {kept}"), err
    assert not out.exists() and leftovers(tmp_path) == []
    assert (kept / QUARANTINED).read_text().startswith("int8 variant fails validation")
    member = json.loads((kept / "config.json").read_text())["quantization_config"]["clef_local"]
    assert member["validated"] is False and member["quarantined"].startswith("int8 variant fails validation")
    assert json.loads((kept / VALIDATION).read_text())["passed"] is False
    assert read_release(kept).path == kept  # its files can still be read (inspect)
    with pytest.raises(ReleaseError, match=rf"{kept} is a quarantined variant: export validation refused it "
                                           rf"\(int8 variant fails validation.*; its report is {kept / VALIDATION}"):
        clef_local.load(kept)
    # the marker alone is enough (a config edited by hand still does not run)
    config = json.loads((kept / "config.json").read_text())
    del config["quantization_config"]["clef_local"]["quarantined"]
    (kept / "config.json").write_text(json.dumps(config))
    with pytest.raises(ReleaseError, match="quarantined variant"):
        clef_local.load(kept)


def test_quarantine_on_a_full_disk_keeps_the_report_and_says_so(source: Path, tmp_path: Path, strict: None,
                                                               monkeypatch) -> None:
    def full(src, dst, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    monkeypatch.setattr(refusal.shutil, "move", full)
    out, kept = tmp_path / "v", tmp_path / "kept"
    with pytest.raises(ValidationFailed) as info:
        quantize_release(source, out, "int8", validation_requests=256, quarantine=kept)
    assert f"report: {tmp_path / 'v.validation.json'}; --quarantine {kept}: the variant could not be kept there " \
           f"(cannot write " in str(info.value)
    assert str(info.value).endswith("its report is kept (above)")
    assert (tmp_path / "v.validation.json").is_file() and not kept.exists() and not out.exists()
    assert leftovers(tmp_path) == []


def test_undecided_exits_3_and_keeps_its_report(source: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """ValidationUndecided (the probe set used up without a verdict), as validate_export will raise it."""
    def undecided(reference, variant, scheme, *args, **kwargs):
        result = {"validated": False, "passed": False, "decided": False, "requests": 2}
        (Path(variant) / VALIDATION).write_text(json.dumps(result))
        raise ValidationUndecided(f"{scheme} variant: no verdict after 2 probe requests", result)

    monkeypatch.setattr(validate, "validate_export", undecided)
    out = tmp_path / "v"
    code, err = cli(capsys, "--model", str(source), "--format", "int8", "--out", str(out), *FAST)
    assert code == 3 and len(err) == 1
    assert err[0] == (f"error: int8 variant: no verdict after 2 probe requests; nothing was written to {out}; "
                      f"report: {tmp_path / 'v.validation.json'}")
    assert json.loads((tmp_path / "v.validation.json").read_text())["decided"] is False and not out.exists()


def test_a_passing_export_writes_the_html_report_and_drops_a_stale_refusal(source: Path, tmp_path: Path,
                                                                          capsys) -> None:
    out, html = tmp_path / "v", tmp_path / "r.html"
    stale = tmp_path / "v.validation.json"
    stale.write_text('{"passed": false}')
    # int4: its 5% flip limit can be shown on the tiny release's probes (int8's 1% needs ~500 questions)
    code, _ = cli(capsys, "--model", str(source), "--format", "int4", "--out", str(out), "--report", str(html))
    assert code == 0 and (out / VALIDATION).is_file() and not stale.exists()
    page = html.read_text()
    assert "passed" in page and "✓" in page and "✗" not in page
    clef_local.load(out)  # a validated variant is not mistaken for a quarantined one


def test_report_and_quarantine_are_checked_before_any_work(source: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "v"
    for extra, message in (
            (["--quarantine", str(out / "q")], "overlap"),
            (["--report", str(tmp_path / "missing" / "r.html")], "does not exist"),
            (["--report", str(tmp_path / "r.html"), "--no-validate"], "drop them or --no-validate")):
        code, err = cli(capsys, "--model", str(source), "--format", "int8", "--out", str(out), *extra)
        assert code == 2 and len(err) == 1 and message in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.fixture
def no_shard_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every safetensors open (the shard reader of quantize, mixed and the loaders) recorded and refused."""
    opened: list[str] = []

    def spy(path, *args, **kwargs):
        opened.append(str(path))
        raise AssertionError(f"a shard was opened: {path}")

    monkeypatch.setattr("safetensors.safe_open", spy)
    return opened


def tiny_disk(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(refusal.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 40, 0, free))


@pytest.mark.parametrize("fmt", ["int8", "mixed"])
def test_a_disk_too_small_is_refused_before_any_shard_is_read(source: Path, tmp_path: Path, monkeypatch, capsys,
                                                              no_shard_reads: list[str], fmt: str) -> None:
    tiny_disk(monkeypatch, 1000)
    out = tmp_path / "v"
    extra = ["--max-kl", "0.01"] if fmt == "mixed" else []
    code, err = cli(capsys, "--model", str(source), "--format", fmt, "--out", str(out), *extra)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: not enough disk space for {out}: the {fmt} variant needs about ")
    assert f" and {tmp_path} has 1000 B free; free " in err[0]
    assert "choose an --out on another disk (nothing was written)" in err[0]
    assert no_shard_reads == [] and list(tmp_path.iterdir()) == []


def test_the_estimate_covers_the_variant_written(source: Path, tmp_path: Path) -> None:
    """The census estimate of an int8 variant is at least its real size, and not far above it."""
    out = tmp_path / "v"
    quantize_release(source, out, "int8", validate=False)
    written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    estimate = refusal.check_disk(read_release(source), out, "int8", None, what="int8")
    assert written <= estimate <= written + refusal.SLACK_BYTES + written // 10


def test_check_disk_passes_with_room(source: Path, tmp_path: Path, monkeypatch) -> None:
    tiny_disk(monkeypatch, 1 << 40)
    assert refusal.check_disk(read_release(source), tmp_path / "v", "int4", 32, what="int4") > 0
    tiny_disk(monkeypatch, 0)
    with pytest.raises(ExportError, match=r"the int4 variant needs about .* has 0 B free"):
        refusal.check_disk(read_release(source), tmp_path / "v", "int4", 32, what="int4")
