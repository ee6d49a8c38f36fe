"""Labelled JSONL: round trip, per-line errors, and the BANKING77 / NLU++ converters on the packaged datasets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clef_local.data.convert import load_dataset, main, parse_folds
from clef_local.data.datasets import DATASETS_ENV, Example, banking77_examples, datasets_dir, evenly
from clef_local.data.jsonl import DataFormatError, read_jsonl, write_jsonl


def test_datasets_are_packaged(monkeypatch, tmp_path: Path):
    """Without $CLEF_LOCAL_DATASETS the data is the package's own copy (a clone or wheel needs nothing beside it)."""
    import clef_local.data

    monkeypatch.delenv(DATASETS_ENV, raising=False)
    root = datasets_dir()
    assert root == Path(clef_local.data.__file__).resolve().parent
    assert (root / "banking77" / "LICENSE").is_file() and (root / "nlupp" / "LICENSE").is_file()
    assert len(list((root / "nlupp" / "banking").glob("fold*.json"))) == 20
    assert len(json.loads((root / "banking77" / "categories.json").read_text())) == 77
    for line in ("BANKING77", "NLU++", "CC BY 4.0", "Casanueva"):
        assert line in (root / "README.md").read_text(encoding="utf-8")
    monkeypatch.setenv(DATASETS_ENV, str(root))
    assert datasets_dir() == root
    monkeypatch.setenv(DATASETS_ENV, str(tmp_path))  # an override without banking77/ is an error, not a fallback
    with pytest.raises(FileNotFoundError, match=DATASETS_ENV):
        datasets_dir()


def test_roundtrip(tmp_path: Path):
    examples = [Example("a", {"model": "m", "state": {"x": "é"}, "questions": {"q": {"type": "noul"}}}, {"q": False}),
                Example("b", {"model": "m", "state": "s",
                              "questions": {"s": {"type": "score", "criteria": ["lo", "hi"]}}})]
    path = tmp_path / "d.jsonl"
    assert write_jsonl(examples, path) == 2
    assert "é" in path.read_text(encoding="utf-8")  # not \u-escaped
    again = read_jsonl(path)
    assert again == examples
    assert read_jsonl(path, limit=1) == examples[:1]


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "d.jsonl:2: not valid JSON"),
    ("[1, 2]", "d.jsonl:2: expected a JSON object"),
    ('{"state": "s", "questions": {}}', "d.jsonl:2: \"questions\" must be a non-empty object"),
    ('{"questions": {"q": {"type": "noul"}}}', "d.jsonl:2: missing \"state\""),
    ('{"state": "s", "questions": {"q": {"type": "noul"}}, "labels": {"z": true}}', "label for 'z'"),
    ('{"state": "s", "questions": {"q": {"type": "noul"}}, "labels": {"q": [1]}}', "label 'q' must be"),
    ('{"state": "s", "questions": {"q": {"type": "noul"}}, "labels": [1]}', "\"labels\" must be an object"),
])
def test_bad_lines_are_named(tmp_path: Path, line: str, message: str):
    path = tmp_path / "d.jsonl"
    path.write_text('{"state": "ok", "questions": {"q": {"type": "noul"}}}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=message.replace("(", r"\(")):
        read_jsonl(path)


def test_parse_folds():
    assert parse_folds("16-19") == [16, 17, 18, 19] and parse_folds("0,3,5-6") == [0, 3, 5, 6]
    for bad in ("20", "a-b", "3-1x"):
        with pytest.raises(ValueError, match="fold"):
            parse_folds(bad)


def test_banking77_and_nlupp_loaders():
    full = load_dataset("banking77", limit=3)
    assert len(full) == 3 and len(full[0].request["questions"]["intent"]["criteria"]) == 77
    gold = full[0].labels["intent"]
    assert gold in full[0].request["questions"]["intent"]["criteria"]
    window = load_dataset("banking77", offset=1, limit=2)
    assert [e.id for e in window] == [e.id for e in full[1:3]]
    kway = load_dataset("banking77", limit=5, k=8, seed=3)
    assert all(len(e.request["questions"]["intent"]["criteria"]) == 8 for e in kway)
    assert all(e.labels["intent"] in e.request["questions"]["intent"]["criteria"] for e in kway)
    assert kway == load_dataset("banking77", limit=5, k=8, seed=3)  # reproducible
    nlupp = load_dataset("nlupp", folds=[16], limit=2)
    utterances = {e.id.rsplit("-", 1)[0] for e in nlupp}
    assert len(utterances) == 2
    questions = [q for e in nlupp for q in e.request["questions"].values()]
    assert all(q["type"] == "noul" for q in questions)
    assert all(isinstance(v, bool) for e in nlupp for v in e.labels.values())


def test_convert_cli(tmp_path: Path, capsys):
    out = tmp_path / "b.jsonl"
    assert main(["convert", "--dataset", "banking77", "--split", "test", "--limit", "4", "--k", "5",
                 "--out", str(out)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 4 and all(len(x["questions"]["intent"]["criteria"]) == 5 for x in lines)
    assert "wrote 4 requests" in capsys.readouterr().out
    out2 = tmp_path / "n.jsonl"
    assert main(["convert", "--dataset", "nlupp", "--folds", "16-17", "--limit", "1", "--out", str(out2)]) == 0
    assert read_jsonl(out2)
    with pytest.raises(SystemExit):
        main(["convert", "--dataset", "banking77", "--k", "1", "--out", str(out)])
    assert main(["convert", "--dataset", "nlupp", "--folds", "25", "--out", str(out2)]) == 2


def test_evenly_samples_across_a_sorted_split():
    assert evenly(list(range(10)), 3) == [0, 3, 6]
    assert evenly([1, 2], 5) == [1, 2] and evenly([1, 2], None) == [1, 2]
    rows = banking77_examples("test")
    prefix = {e.labels["intent"] for e in rows[:150]}
    spread = {e.labels["intent"] for e in evenly(rows, 150)}
    assert len(prefix) <= 4 and len(spread) == 77  # the split is sorted by intent
