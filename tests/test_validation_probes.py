"""The validation probe set (clef_local.data.probes.validation_probes: kinds mixed in every 8, long, JSON, long option
lists, images) and quantize --validation-data (the user's requests, checked before anything is written)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from clef_local.data.probes import LONG_FIRST, long_state_requests, probe_requests, validation_probes
from clef_local.export.quantize import main as quantize_main
from clef_local.export.validate import ValidationUnavailable, validation_requests
from clef_local.runtime.schema import validate_request


def kind(request: dict[str, Any]) -> str:
    """What a probe is: vision, json, long (a conversation log), choice_long (40+ options), or its question types."""
    if "images" in request:
        return "vision"
    if not isinstance(request["state"], str):
        return "json"
    if request["state"].startswith("Support conversation log"):
        return "long"
    if "intent" in request["questions"] and len(request["questions"]["intent"]["criteria"]) >= 40:
        return "choice_long"
    return "+".join(sorted({q["type"] for q in request["questions"].values()}))


KINDS = {"choice", "choice_long", "noul", "noul+score", "json", "long"}


def test_every_prefix_of_8_mixes_the_kinds_and_the_set_is_fixed_by_its_seed() -> None:
    probes = validation_probes(256)
    for start in range(0, 256, 8):
        kinds = [kind(r) for r in probes[start : start + 8]]
        # every kind in each run of 8 but one of the two costly ones, which take turns, in a seeded order
        assert set(kinds) == KINDS - ({"long"} if start % 16 else {"choice_long"}), (start, kinds)
    assert [kind(r) for r in probes[:8]] != [kind(r) for r in probes[8:16]]  # shuffled, not one fixed pattern
    assert probes == validation_probes(256, seed=0) and probes[:64] == validation_probes(64)  # prefixes are stable
    assert validation_probes(64, seed=1) != probes[:64] and len(validation_probes(13)) == 13
    choice_long = [len(r["questions"]["intent"]["criteria"]) for r in probes if kind(r) == "choice_long"]
    assert min(choice_long) >= 40 and max(choice_long) <= 77 and len(set(choice_long)) > 5
    json_states = [r["state"] for r in probes if kind(r) == "json"]
    assert {type(s) for s in json_states} == {dict, list}  # objects (event, transaction) and arrays of events
    for request in probes:
        validate_request(request)
    # rows are drawn without repeats (BANKING77 itself holds a few duplicate texts)
    assert len({r["state"] if isinstance(r["state"], str) else json.dumps(r["state"]) for r in probes}) >= 250


def test_vision_probes_carry_images_named_by_their_questions() -> None:
    probes = validation_probes(32, vision=True)
    for start in range(0, 32, 8):
        assert "vision" in {kind(r) for r in probes[start : start + 8]}
    for request in (r for r in probes if "images" in r):
        assert 1 <= len(request["images"]) <= 2
        assert all(i.startswith("data:image/png;base64,") for i in request["images"])
        assert "<image 1>" in request["questions"]["shows"]["instructions"]
        validate_request(request)
    assert validation_probes(32, vision=True) == probes  # images too are deterministic
    assert not any("images" in r for r in validation_probes(32))


@pytest.fixture(scope="module")
def demo_tokens(demo_release: Path):
    """Tokens of a whole request (its prompt as the model encodes it) and of a text, by the demo's tokenizer."""
    from clef_local.runtime.encoder import RequestEncoder
    from clef_local.runtime.tokenizer import ReleaseTokenizer

    tokenizer = ReleaseTokenizer(demo_release)
    encoder = RequestEncoder(tokenizer, max_length=1 << 20)
    return (lambda request: len(encoder.encode(request).input_ids),
            lambda text: len(tokenizer.encode_pieces([text])[0]))


@pytest.mark.parametrize("tokens", [1000, 4000, 16000])
def test_long_states_reach_their_token_lengths(demo_tokens, tokens: int) -> None:
    _, count = demo_tokens
    aimed = [count(r["state"]) for r in long_state_requests(3, tokens, seed=2)]
    assert all(0.9 * tokens <= n <= 1.1 * tokens for n in aimed), aimed  # no tokenizer: CHARS_PER_TOKEN
    exact = [count(r["state"]) for r in long_state_requests(2, tokens, seed=2, count_tokens=count)]
    assert all(tokens <= n <= tokens + 150 for n in exact), exact  # at least the target, within a message more


def test_the_first_64_cost_about_twice_the_short_set(demo_tokens) -> None:
    """The budget: at most ~1.75x the short-only set's tokens in the first 64; the 8K and 16K states late."""
    request_tokens, count = demo_tokens
    probes = validation_probes(256)
    first = sum(request_tokens(r) for r in probes[:64])
    short = sum(request_tokens(r) for r in probe_requests(64))
    assert 1.2 * short <= first <= 1.75 * short, (first, short)
    positions = [i for i, r in enumerate(probes) if kind(r) == "long"]  # one per 16 requests, in order
    lengths = [count(probes[i]["state"]) for i in positions]
    assert len(positions) == 16 and all(i // 16 == n for n, i in enumerate(positions)), positions
    assert all(0.9 * t <= n <= 1.1 * t for t, n in zip(LONG_FIRST, lengths[:4], strict=True)), lengths
    assert max(lengths[:4]) < 4600 and max(lengths[:11]) < 4600 and max(lengths) > 14000  # 16K only late
    assert 0.9 * 8192 <= lengths[11] <= 1.1 * 8192


def test_json_states_and_long_option_lists_run_through_decide(qwen_model) -> None:
    probes = [r for r in validation_probes(16) if kind(r) in ("json", "choice_long")]
    assert len(probes) == 3  # two JSON states, one long option list (the other block holds the long state)
    for request in probes:
        answers = qwen_model.decide(request)["answers"]
        assert set(answers) == set(request["questions"])
        for qid, question in request["questions"].items():
            if question["type"] == "choice":  # every option answered, in request order, summing to 1
                probabilities = answers[qid]["probabilities"]
                assert list(probabilities) == list(question["criteria"])
                assert sum(probabilities.values()) == pytest.approx(1.0, abs=1e-5)


def test_vision_probes_run_on_a_vision_release(vision_model) -> None:
    probes = [r for r in validation_probes(16, vision=True) if "images" in r]
    predictions = vision_model.predict(probes)
    assert len(predictions) == 3  # one in the first 8, two in the next (its long-state slot is short there)
    for request, prediction in zip(probes, predictions, strict=True):
        assert len(prediction.probabilities) == len(request["questions"])


def test_drift_builtin_set_is_validations() -> None:
    """A reference file saved by drift on its built-in set validates an export (the same requests, same digest)."""
    from clef_local.quality.command import read_requests

    read = read_requests(argparse.Namespace(data=None, limit=8), validation=True)
    assert read.requests == validation_requests(8)


def _lines(path: Path, requests: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests), encoding="utf-8")
    return path


BAD = {
    "bad.jsonl": ('{"state": "x", "questions": {"q": {"type": "noul"}}}\n{"state": \n',
                  r"bad\.jsonl:2: not valid JSON"),
    "empty.jsonl": ("\n", r"empty\.jsonl holds no requests"),
    "type.jsonl": ('{"state": "x", "questions": {"q": {"type": "maybe"}}}\n',
                   r"type\.jsonl: request 1 \(.*\) is not a valid request"),
}


@pytest.mark.parametrize("name", [*BAD, "missing.jsonl"])
def test_a_bad_validation_data_file_is_refused_before_anything_is_written(tiny_llama: Path, tmp_path: Path,
                                                                          monkeypatch, capsys, name: str) -> None:
    import re

    data = tmp_path / "data" / name
    data.parent.mkdir()
    if name in BAD:
        data.write_text(BAD[name][0], encoding="utf-8")
    written: list = []
    monkeypatch.setattr("clef_local.export.quantize.quantize_shards", lambda *a, **k: written.append(a))
    out = tmp_path / "int8"
    assert quantize_main(["--model", str(tiny_llama), "--bits", "8", "--out", str(out),
                          "--validation-data", str(data)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: validation cannot run: --validation-data ")
    assert str(data) in err[0]
    pattern = BAD[name][1] if name in BAD else r"missing\.jsonl cannot be read \(.*No such file"
    assert re.search(pattern, err[0]), err[0]
    assert written == [] and not out.exists()
    with pytest.raises(ValidationUnavailable):
        validation_requests(4, data=data)


def test_validation_data_is_what_validation_runs(tiny_llama: Path, tmp_path: Path) -> None:
    """Its first --validation-requests requests, in file order (all when fewer): validation.json counts them."""
    own = [r for r in validation_probes(128) if kind(r) not in ("long", "choice_long")][:60]  # the user's, short
    data = _lines(tmp_path / "own.jsonl", own)
    out = tmp_path / "int4"
    code = quantize_main(["--model", str(tiny_llama), "--bits", "4", "--group-size", "32", "--out", str(out),
                          "--validation-data", str(data)])
    stored = _report(out, code)
    assert stored["probe_set"] == len(own)
    assert stored["questions"] == sum(len(r["questions"]) for r in own[:stored["requests"]])
    assert validation_requests(2, data=data) == own[:2] and validation_requests(1000, data=data) == own


def _report(out: Path, code: int) -> dict:
    """validation.json of the export to ``out``: in the variant when it passed, else kept beside it."""
    stored = json.loads((out / "validation.json" if code == 0 else out.with_name(out.name + ".validation.json"))
                        .read_text())
    assert code == {"pass": 0, "fail": 1, "undecided": 3}[stored["verdict"]]
    return stored


def test_a_drift_reference_file_of_a_vision_release_matches_its_validation(tiny_vision: Path, tmp_path: Path) -> None:
    """drift's built-in set takes the image probes for a release with a vision tower, as validation does: the file
    it saves passes quantize --reference-file's request check."""
    from clef_local.quality import reference_file
    from clef_local.quality.drift_cli import main as drift_main

    file = tmp_path / "ref.json"
    assert drift_main(["--reference", str(tiny_vision), "--save-reference", str(file), "--limit", "8",
                       "--dtype", "float32", "--no-progress"]) == 0
    stored = reference_file.read(file)
    reference_file.check_requests(stored, validation_requests(8, vision=True), "validation")
    with pytest.raises(reference_file.ReferenceFileError):
        reference_file.check_requests(stored, validation_requests(8), "validation")


def test_a_vision_release_is_validated_on_image_probes_too(tiny_vision: Path, tmp_path: Path, monkeypatch) -> None:
    from clef_local.export.turns import Turns

    seen: list[list[dict]] = []
    real = Turns.predict
    monkeypatch.setattr(Turns, "predict", lambda self, role, path, requests, **k: (
        seen.append(list(requests)), real(self, role, path, requests, **k))[1])
    out = tmp_path / "int4"
    code = quantize_main(["--model", str(tiny_vision), "--bits", "4", "--group-size", "32", "--out", str(out),
                          "--validation-requests", "48"])
    assert _report(out, code)["probe_set"] == 48
    assert len(seen) >= 2 and all(any("images" in r for r in requests) for requests in seen)


def test_validation_data_is_refused_where_it_does_not_apply(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    data = _lines(tmp_path / "own.jsonl", validation_probes(2))
    with pytest.raises(SystemExit) as info:
        quantize_main(["--model", str(tiny_llama), "--format", "mixed", "--max-kl", "0.01", "--out",
                       str(tmp_path / "m"), "--validation-data", str(data)])
    assert info.value.code == 2 and "--validation-data applies to a single scheme" in capsys.readouterr().err
    assert quantize_main(["--model", str(tiny_llama), "--bits", "8", "--out", str(tmp_path / "n"),
                          "--validation-data", str(data), "--no-validate"]) == 2
    assert "--validation-data is what validation runs on" in capsys.readouterr().err
    assert not (tmp_path / "m").exists() and not (tmp_path / "n").exists()
