"""Export validation: the probe set, metrics against an identical and a broken copy, skips, and export failure."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from clef_local.data.probes import probe_requests, validation_probes
from clef_local.export import validate
from clef_local.export.quantize import main as quantize_main
from clef_local.export.quantize import quantize_release
from clef_local.export.validate import (
    METRICS,
    THRESHOLDS,
    ValidationFailed,
    ValidationUnavailable,
    compare,
    validate_export,
    validate_variant,
    validation_requests,
    validation_table,
)
from clef_local.formats.manifest import read_manifest, verify
from clef_local.planning.hardware import Hardware
from clef_local.runtime.schema import validate_request


@pytest.fixture(scope="module")
def probes() -> list[dict]:
    return probe_requests()


@pytest.fixture(scope="module")
def requests(probes: list[dict]) -> list[dict]:
    """Every 4th probe (8 choice, 4 noul, 4 score requests): the tiny model runs 64 in ~6 s, 16 in ~1.5 s."""
    return probes[::4]


@pytest.fixture(scope="module")
def copies(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An identical copy of the tiny llama release and a broken one (its head's residual scorer scaled by -50)."""
    root = tmp_path_factory.mktemp("copies")
    same = shutil.copytree(tiny_llama, root / "same")
    broken = shutil.copytree(tiny_llama, root / "broken")
    head = load_file(broken / "joint_head.safetensors")
    head["residual_scorer.3.weight"] = head["residual_scorer.3.weight"] * -50
    save_file(head, broken / "joint_head.safetensors", metadata={"format": "pt"})
    return {"same": same, "broken": broken}


def test_probe_requests_are_fixed_mixed_and_valid(probes: list[dict]) -> None:
    requests = probes
    assert len(requests) >= 64 and requests == probe_requests(64, seed=0)
    assert probe_requests(64, seed=1) != requests and len(probe_requests(100)) == 100
    kinds = [{q["type"] for q in r["questions"].values()} for r in requests]
    choice = [r for r, k in zip(requests, kinds, strict=True) if k == {"choice"}]
    assert len(choice) == 32 and all(8 <= len(r["questions"]["intent"]["criteria"]) <= 16 for r in choice)
    assert sum(k == {"noul"} for k in kinds) == 16 and sum(k == {"score", "noul"} for k in kinds) == 16
    for request in requests:
        validate_request(request)


def test_compare_metrics_by_hand() -> None:
    import numpy as np

    ref = [[np.array([0.7, 0.3]), np.array([0.2, 0.5, 0.3])]]
    var = [[np.array([0.4, 0.6]), np.array([0.2, 0.5, 0.3])]]
    m = compare(ref, var)
    kl = 0.7 * np.log(0.7 / 0.4) + 0.3 * np.log(0.3 / 0.6)
    assert m["questions"] == 2 and m["flips"] == 1 and m["flip_rate"] == 0.5
    assert m["mean_kl"] == pytest.approx(kl / 2) and m["max_kl"] == pytest.approx(kl)
    assert m["max_abs_dp"] == pytest.approx(0.3)


def test_identical_copy_passes_with_zero_divergence(tiny_llama: Path, copies, requests) -> None:
    result = validate_variant(tiny_llama, copies["same"], requests, THRESHOLDS["int8"], dtype="float32")
    assert result["passed"] and result["failed"] == []
    assert result["metrics"] == dict.fromkeys(METRICS, 0.0)
    assert result["requests"] == 16 and result["questions"] == 8 + 4 * 4 + 4 * 2
    assert all(c["ok"] for c in result["checks"].values())
    assert "✓" in _render(result) and "✗" not in _render(result)


def _render(result: dict) -> str:
    from rich.console import Console

    console = Console(record=True, width=100)
    console.print(validation_table(result))
    return console.export_text()


def test_broken_head_fails_naming_the_metrics(tiny_llama: Path, copies, requests) -> None:
    result = validate_variant(tiny_llama, copies["broken"], requests, THRESHOLDS["int4"], dtype="float32")
    assert not result["passed"]
    failed = {line.split()[0] for line in result["failed"]}
    assert failed == {"mean_kl", "flip_rate"}
    assert result["metrics"]["flip_rate"] > 0.2 and result["metrics"]["mean_kl"] > 0.03
    assert result["checks"]["max_kl"]["ok"] and result["checks"]["max_kl"]["threshold"] is None  # reported only
    assert "✗" in _render(result)


def test_validate_export_records_and_raises(tiny_llama: Path, copies, requests, tmp_path: Path) -> None:
    broken = shutil.copytree(copies["broken"], tmp_path / "broken")
    bounds = r"[0-9.e-]+ \[[0-9.e-]+, [0-9.e-]+\]"
    with pytest.raises(ValidationFailed, match=rf"mean_kl {bounds} > 0\.002.*flip_rate {bounds} > 0\.01"):
        validate_export(tiny_llama, broken, "int8", n=64, dtype="float32")
    stored = json.loads((broken / "validation.json").read_text())
    assert stored["passed"] is False and stored["thresholds"] == THRESHOLDS["int8"]
    # refused at the first look: a broken variant does not need the whole probe set
    assert stored["verdict"] == "fail" and len(stored["sequential"]["looks"]) == 1 and stored["requests"] == 16
    assert stored["sequential"]["schedule"] == [16, 32, 64]
    for name in ("mean_kl", "flip_rate"):
        check = stored["checks"][name]
        assert check["lower"] > check["threshold"] and check["state"] == "outside"


def test_validation_that_cannot_run_is_an_error_not_a_skip(tiny_llama: Path, copies, tmp_path: Path,
                                                          monkeypatch) -> None:
    """Too little memory, no probe set, a reference that does not load: ValidationUnavailable naming the reason
    (before, the export logged a warning, wrote the variant and exited 0)."""
    same = shutil.copytree(copies["same"], tmp_path / "same")
    tiny_box = Hardware(kind="cpu", name="a 1 MB box", device="cpu", total_bytes=1 << 20, free_bytes=1 << 20,
                        host_total_bytes=1 << 20, host_free_bytes=1 << 20)
    monkeypatch.setattr("clef_local.planning.hardware.detect", lambda device="auto", **_: tiny_box)
    with pytest.raises(ValidationUnavailable, match=r"the reference does not fit here, not even streamed from disk "
                                                    r"\(bf16 does not fit on cpu \(a 1 MB box\) even streamed"):
        validate_export(tiny_llama, same, "int8")
    monkeypatch.undo()

    def no_data(*args, **kwargs):
        raise FileNotFoundError("BANKING77/NLU++ not found")

    monkeypatch.setattr("clef_local.export.probe_set.validation_probes", no_data)
    with pytest.raises(ValidationUnavailable, match="the packaged probe set cannot be read"):
        validate_export(tiny_llama, same, "int8")
    monkeypatch.undo()

    def no_reference(self, role, path, *args, **kwargs):
        if role == "reference":
            raise MemoryError("cannot allocate")
        raise AssertionError("the variant is not run when the reference cannot be")

    monkeypatch.setattr("clef_local.export.turns.Turns.predict", no_reference)
    with pytest.raises(ValidationUnavailable) as info:
        validate_export(tiny_llama, same, "int8")
    assert str(info.value) == ("validation cannot run: the reference could not be loaded or run (MemoryError: cannot "
                               "allocate); the variant was not written (pass --no-validate to write it unvalidated: "
                               "config.json and validation.json then say so)")
    assert not (same / "validation.json").exists()


def test_quantize_refuses_to_write_unvalidated_unless_told(tiny_llama: Path, tmp_path: Path, monkeypatch,
                                                           capsys) -> None:
    """No probe data: exit 2 with the reason before anything is written; --no-validate writes the variant and
    records validated: false in config.json and validation.json."""
    source_files = sorted(p.name for p in tiny_llama.iterdir())
    monkeypatch.setattr("clef_local.export.probe_set.validation_probes", lambda *a, **k: (_ for _ in ()).throw(
        FileNotFoundError("banking77/test.csv is missing")))
    written = []
    monkeypatch.setattr("clef_local.export.quantize.quantize_shards", lambda *a, **k: written.append(a))
    out = tmp_path / "int4"
    assert quantize_main(["--model", str(tiny_llama), "--bits", "4", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: validation cannot run: the packaged probe set cannot be read "
                                               "(banking77/test.csv is missing)"), err
    assert written == [] and list(tmp_path.iterdir()) == []  # refused before the export began
    monkeypatch.undo()
    assert quantize_main(["--model", str(tiny_llama), "--bits", "4", "--out", str(out), "--no-validate"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["clef_local"]["validated"] is False
    assert json.loads((out / "validation.json").read_text()) == {"validated": False, "skipped": "--no-validate"}
    assert "validation.json" in read_manifest(out)["files"] and verify(out) == []
    assert sorted(p.name for p in tiny_llama.iterdir()) == source_files


def test_validation_runs_on_the_packaged_probes_whatever_the_datasets_override(tmp_path: Path, monkeypatch) -> None:
    """$CLEF_LOCAL_DATASETS points elsewhere (here: nowhere): the export's probe set is still the shipped one."""
    monkeypatch.setenv("CLEF_LOCAL_DATASETS", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError):
        probe_requests(8)
    monkeypatch.delenv("CLEF_LOCAL_DATASETS")
    expected = validation_probes(8)
    monkeypatch.setenv("CLEF_LOCAL_DATASETS", str(tmp_path / "nowhere"))
    assert validate.validation_requests(8) == expected


def test_failed_validation_fails_the_export_and_removes_the_temp(tiny_llama: Path, tmp_path: Path,
                                                                 monkeypatch) -> None:
    seen = []

    def failing(reference, variant, scheme, *args, **kwargs):
        seen.append(Path(variant))
        assert (Path(variant) / "config.json").is_file()  # runs on the complete temp directory
        raise ValidationFailed(f"{scheme} variant fails validation: mean_kl 0.5 > 0.03")

    monkeypatch.setattr(validate, "validate_export", failing)
    out = tmp_path / "v"
    with pytest.raises(ValidationFailed, match=r"mean_kl 0\.5 > 0\.03"):
        quantize_release(tiny_llama, out, "int4")
    assert seen and seen[0].name.startswith(".v.tmp-") and not seen[0].exists()
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert quantize_main(["--model", str(tiny_llama), "--format", "nf4", "--out", str(out)]) == 1


@pytest.mark.skipif(importlib.util.find_spec("clef_local.backends.quantized") is None,
                    reason="the variant loader (clef_local.backends.quantized) is not there yet")
def test_export_with_validation_end_to_end(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    """int4 g32: the tiny random model's choices are near ties, and int4 g64 flips them at the threshold itself
    (4.7% of the short probe set's questions, 5.3% of the mixed set's first 64, 4.3% of its 128; g32: 3.3%)."""
    out = tmp_path / "int4"
    assert quantize_main(["--model", str(tiny_llama), "--bits", "4", "--group-size", "32", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    stored = json.loads((out / "validation.json").read_text())
    assert f"validation: pass after {stored['requests']} of 256 requests" in printed and "mean_kl" in printed
    assert stored["passed"] and stored["metrics"]["mean_kl"] <= THRESHOLDS["int4"]["mean_kl"]
    assert "validation.json" in read_manifest(out)["files"] and verify(out) == []
    assert not torch.isnan(torch.tensor(list(stored["metrics"].values()))).any()


def test_validation_requests_sets_the_probe_set_size(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    """--validation-requests N caps the probes both models run: 48 run, int4 g32 (its 5% flip limit can pass on
    them); 6 could never show int8's 1% flip limit and are refused before anything is quantized, as is 0."""
    out = tmp_path / "int4"
    code = quantize_main(["--model", str(tiny_llama), "--bits", "4", "--group-size", "32", "--out", str(out),
                          "--validation-requests", "48"])
    stored = json.loads((out / "validation.json" if code == 0 else tmp_path / "int4.validation.json").read_text())
    assert code == {"pass": 0, "fail": 1, "undecided": 3}[stored["verdict"]]
    used = validation_requests(48)[:stored["requests"]]
    assert stored["probe_set"] == 48 and stored["questions"] == sum(len(r["questions"]) for r in used)
    assert stored["sequential"]["schedule"] == [16, 32, 48] and {run["batches"] >= 1 for run in stored["runs"].values()}
    capsys.readouterr()
    written: list = []
    for n, message in (("6", "error: validation cannot run: 6 requests ("),
                       ("0", "error: --validation-requests 0: validation needs at least 1 probe request (default "
                             "1024 for int8; --no-validate skips it)")):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("clef_local.export.quantize.quantize_shards", lambda *a, **k: written.append(a))
            assert quantize_main(["--model", str(tiny_llama), "--bits", "8", "--out", str(tmp_path / "none"),
                                  "--validation-requests", n]) == 2
        assert capsys.readouterr().err.strip().startswith(message)
    assert written == [] and not (tmp_path / "none").exists()
