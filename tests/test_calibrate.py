"""Temperature fitting: recovers a known temperature, reduces ECE on a miscalibrated case, stored and applied."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from clef_local.quality.calibrate import fit_temperature_match, fit_temperature_nll, main, scale
from clef_local.quality.metrics import labelled_report


def _overconfident(seed: int = 0, n: int = 1500, k: int = 4, sharpen: float = 3.0):
    """Gold drawn from softmax(z); the 'model' reports softmax(sharpen·z): overconfident by a factor ``sharpen``."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, k)) * 1.5
    true = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    gold = [int(rng.choice(k, p=p)) for p in true]
    reported = np.exp(sharpen * z) / np.exp(sharpen * z).sum(1, keepdims=True)
    return list(reported), gold, list(true)


def test_scale_is_tempered_softmax():
    p = np.array([0.7, 0.2, 0.1])
    assert np.allclose(scale(p, 1.0), p)
    z = np.log(p) / 2
    assert np.allclose(scale(p, 2.0), np.exp(z) / np.exp(z).sum())
    assert int(np.argmax(scale(p, 5.0))) == 0  # temperature never changes the decision


def test_nll_fit_recovers_temperature_and_reduces_ece():
    reported, gold, _ = _overconfident()
    t = fit_temperature_nll(reported, gold)
    assert t == pytest.approx(3.0, rel=0.15)
    before = labelled_report(reported, gold)
    after = labelled_report([scale(p, t) for p in reported], gold)
    assert after["ece"] < 0.5 * before["ece"] and after["nll"] < before["nll"]
    assert after["accuracy"] == before["accuracy"]


def test_match_fit_recovers_temperature():
    reported, _, true = _overconfident(seed=1, n=300)
    assert fit_temperature_match(true, reported) == pytest.approx(3.0, rel=0.02)


@pytest.fixture()
def variant(tiny_llama: Path, tmp_path: Path) -> Path:
    from clef_local.formats.manifest import write_manifest

    out = tmp_path / "variant"
    shutil.copytree(tiny_llama, out)
    write_manifest(out, name="tiny variant")
    return out


def test_calibrate_cli_stores_applies_and_reduces_ece(variant: Path, tmp_path: Path, capsys):
    """Underconfident by construction: each label is the model's own argmax, so accuracy is 1 and ECE is
    1 − mean confidence; the fitted temperature (< 1) sharpens and ECE falls. Stored, the manifest still checks."""
    import clef_local
    from clef_local.formats.manifest import verify

    requests = [{"model": "m", "state": f"message {i} about cards and transfers", "questions": {
        "n": {"type": "noul", "instructions": f"question {i}"},
        "c": {"type": "choice", "criteria": {"card": None, "transfer": None, "fee": None, "loan": None}}}}
        for i in range(6)]
    model = clef_local.load(variant, dtype="float32")
    labels = []
    for pred in model.predict(requests):
        labels.append({q.question_id: q.option_ids[int(np.argmax(p[: len(q.option_ids)]))]
                       for q, p in zip(pred.encoded.questions, pred.probabilities, strict=True)})
    data = tmp_path / "fit.jsonl"
    data.write_text("".join(json.dumps({**r, "labels": {k: (v == "true") if k == "n" else v for k, v in lab.items()}})
                            + "\n" for r, lab in zip(requests, labels, strict=True)))
    before = [p.probabilities for p in model.predict(requests)]
    assert main(["--model", str(variant), "--data", str(data), "--dtype", "float32", "--json",
                 str(tmp_path / "c.json"), "--report", str(tmp_path / "c.html")]) == 0
    out = capsys.readouterr().out
    assert "network: off" in out and "stored in" in out
    result = json.loads((tmp_path / "c.json").read_text())
    for kind in ("noul", "choice"):
        entry = result["types"][kind]
        assert entry["temperature"] < 1 and entry["after"]["ece"] < entry["before"]["ece"]
    config = json.loads((variant / "config.json").read_text())
    temps = config["clef_local_calibration"]["temperatures"]
    assert verify(variant) == []  # the manifest entry of config.json was rewritten
    reloaded = clef_local.load(variant, dtype="float32")
    assert reloaded.temperatures == temps
    after = [p.probabilities for p in reloaded.predict(requests)]
    for b, a in zip(before, after, strict=True):
        assert np.allclose(a[0][:2], scale(b[0][:2], temps["noul"]), atol=1e-5)
        assert np.allclose(a[1][:4], scale(b[1][:4], temps["choice"]), atol=1e-5)
    assert "ECE before" in (tmp_path / "c.html").read_text()


def test_bad_stored_temperature_is_named(variant: Path):
    import clef_local
    from clef_local.errors import ReleaseError

    config = json.loads((variant / "config.json").read_text())
    config["clef_local_calibration"] = {"temperatures": {"noul": -1}}
    (variant / "config.json").write_text(json.dumps(config))
    (variant / "clef_local_manifest.json").unlink()
    with pytest.raises(ReleaseError, match="temperatures"):
        clef_local.load(variant, dtype="float32")
