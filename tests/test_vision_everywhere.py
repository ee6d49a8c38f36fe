"""Images beyond the Python API: ``decide --image``, eval/drift JSONL rows with image files, quantized variants (the
vision tower kept as released), ``plan --image-size``, ``doctor``, and the MLX/ONNX backends' refusal."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from media_gen import data_uri, image

import clef_local
from clef_local.cli import main
from clef_local.errors import ApiUsageError
from clef_local.runtime.answers import round_floats

PHOTO, WIDE = image(120, 90, seed=21), image(400, 100, seed=22, fmt="JPEG")
QUESTIONS = {"ok": {"type": "noul", "instructions": "Is <image 1> fine?"},
             "kind": {"type": "choice", "criteria": {"a": "like <image 2>", "b": None}}}


def test_tiny_vision_release(tiny_vision: Path, tiny_qwen: Path, tmp_path: Path) -> None:
    """vision=True names the PIL image processor (the default install has it); every other byte is vision=False's;
    transformers and the reference's processor load it offline; the processors load on the first image only."""
    from transformers import AutoImageProcessor

    from clef_local.testing import build_tiny_release

    config = json.loads((tiny_vision / "preprocessor_config.json").read_text())
    assert config["image_processor_type"] == "Qwen2VLImageProcessorPil"
    assert json.loads((tiny_qwen / "preprocessor_config.json").read_text())["image_processor_type"] == \
        "Qwen2VLImageProcessorFast"  # the default release as before
    for name in ("model.safetensors", "joint_head.safetensors", "tokenizer.json", "config.json",
                 "video_preprocessor_config.json"):
        assert (tiny_vision / name).read_bytes() == (tiny_qwen / name).read_bytes(), name
    assert type(AutoImageProcessor.from_pretrained(tiny_vision, backend="pil")).__name__ == "Qwen2VLImageProcessorPil"
    with pytest.raises(ValueError, match="vision=True needs backbone='qwen3_5'"):
        build_tiny_release(tmp_path / "x", backbone="llama", vision=True)
    model = clef_local.load(tiny_vision, dtype="float32")
    model.decide({"model": "m", "state": "text only", "questions": {"q": {"type": "noul"}}})
    processor = model.encoder.media.processor
    assert processor is not None and not processor.loaded  # text needs only the tokenizer
    model.decide({"model": "m", "state": "s", "images": [data_uri(PHOTO)], "questions": {"q": {"type": "noul"}}})
    assert processor.loaded


def test_decide_with_image_files(tiny_vision: Path, vision_model: Any, tmp_path: Path, capsys) -> None:
    (tmp_path / "a.png").write_bytes(PHOTO)
    (tmp_path / "b.jpg").write_bytes(WIDE)
    request = tmp_path / "r.json"
    request.write_text(json.dumps({"model": "m", "state": "two pictures", "questions": QUESTIONS}))
    assert main(["decide", "--model", str(tiny_vision), "--dtype", "float32", "--request", str(request),
                 "--image", str(tmp_path / "a.png"), "--image", str(tmp_path / "b.jpg")]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = vision_model.decide({"model": "m", "state": "two pictures", "questions": QUESTIONS,
                                    "images": [data_uri(PHOTO), data_uri(WIDE, "jpeg")]})
    assert printed == round_floats(expected, 4)
    assert main(["decide", "--model", str(tiny_vision), "--request", str(request), "--image",
                 str(tmp_path / "missing.png")]) == 2
    assert "missing.png: no such image file" in capsys.readouterr().err
    assert main(["decide", "--model", str(tiny_vision), "--request", str(request), "--image", str(request)]) == 2
    assert "not an image" in capsys.readouterr().err  # one error line, exit 2
    assert main(["decide", "--model", str(tiny_vision), "--request", str(request), "--max-images", "1",
                 "--image", str(tmp_path / "a.png"), "--image", str(tmp_path / "a.png")]) == 2
    assert "more than the limit of 1" in capsys.readouterr().err


def test_jsonl_images_are_files_beside_it_for_eval_and_drift(tiny_vision: Path, vision_model: Any,
                                                             tmp_path: Path, capsys) -> None:
    from clef_local.data.jsonl import DataFormatError, read_jsonl
    from clef_local.quality.drift_cli import main as drift_main
    from clef_local.quality.evaluate import main as eval_main

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(PHOTO)
    (tmp_path / "img" / "b.jpg").write_bytes(WIDE)
    rows = [{"id": "r0", "state": "s", "images": ["img/a.png", "img/b.jpg"], "questions": QUESTIONS,
             "labels": {"ok": True, "kind": "a"}},
            {"id": "r1", "state": {"k": 1}, "images": [data_uri(WIDE, "jpeg"), "img/a.png"], "questions": QUESTIONS,
             "labels": {"kind": "b"}}]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = read_jsonl(data)
    assert examples[0].request["images"] == [PHOTO, WIDE]  # read relative to the JSONL
    got = vision_model.predict([examples[0].request])[0].probabilities
    want = vision_model.predict([{**examples[0].request, "images": [data_uri(PHOTO), data_uri(WIDE, "jpeg")]}])[
        0].probabilities
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert eval_main(["--model", str(tiny_vision), "--data", str(data), "--dtype", "float32", "--no-progress",
                      "--json", str(tmp_path / "m.json")]) == 0
    assert json.loads((tmp_path / "m.json").read_text())["requests"] == 2
    assert drift_main(["--reference", str(tiny_vision), "--candidate", str(tiny_vision), "--data", str(data),
                       "--dtype", "float32", "--no-progress", "--gate", "flips<=0", "--json",
                       str(tmp_path / "d.json")]) == 0
    assert json.loads((tmp_path / "d.json").read_text())["drift"][0]["summary"]["flips"] == 0
    (tmp_path / "bad.jsonl").write_text(json.dumps({**rows[0], "images": ["img/nope.png"]}) + "\n")
    with pytest.raises(DataFormatError, match=r"bad.jsonl:1: image 'img/nope.png' cannot be read"):
        read_jsonl(tmp_path / "bad.jsonl")
    capsys.readouterr()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_variants_keep_the_vision_tower_and_answer_images(tiny_vision: Path, tmp_path: Path,
                                                                    scheme: str) -> None:
    from safetensors import safe_open

    from clef_local.export.quantize import quantize_release

    out = tmp_path / scheme
    quantize_release(tiny_vision, out, scheme, validate=False, log_summary=False)
    with safe_open(str(tiny_vision / "model.safetensors"), "pt") as src, \
            safe_open(str(out / "model.safetensors"), "pt") as dst:
        vision = [n for n in src.keys() if ".visual." in n]  # noqa: SIM118
        assert vision and all(src.get_tensor(n).dtype == dst.get_tensor(n).dtype for n in vision)
        assert all(src.get_tensor(n).equal(dst.get_tensor(n)) for n in vision)
    assert (out / "preprocessor_config.json").read_bytes() == (tiny_vision / "preprocessor_config.json").read_bytes()
    variant = clef_local.load(out, dtype="float32")
    request = {"model": "m", "state": "s", "images": [data_uri(PHOTO)], "questions": QUESTIONS}
    answer = variant.decide(request)
    assert set(answer["answers"]) == set(QUESTIONS) and answer["usage"]["input_tokens"] > 64


def test_plan_counts_visual_tokens_like_the_processor(tiny_vision: Path, vision_model: Any, capsys) -> None:
    from clef_local.planning.planner import main as plan_main

    assert plan_main(["--model", str(tiny_vision), "--image-size", "1024x768", "--images", "2", "--json",
                      "--device", "cpu-8"]) in (0, 1)
    info = json.loads(capsys.readouterr().out)
    encoded = vision_model.encode({"model": "m", "state": "s", "questions": {"q": {"type": "noul"}},
                                      "images": [data_uri(image(1024, 768, seed=s)) for s in (1, 2)]})
    assert info["images"]["visual_tokens"] == encoded.media.visual_tokens == 2 * 768
    assert all(p["visual_tokens"] == 1536 and p["vision_activation_bytes"] > 0 for p in info["plans"])
    assert plan_main(["--config", "clef", "--image-size", "1024x768", "--images", "2"]) in (0, 1)
    text = capsys.readouterr().out
    assert "2 images of 1024×768: 768 visual tokens each, 1,536 of the context" in text
    # 2 × 21,390 visual tokens: over a 16,384-token context (under the 65,536 default)
    assert plan_main(["--config", "clef", "--image-size", "4096x4096", "--images", "2", "--context", "16384"]) == 2
    assert "more than the context" in capsys.readouterr().err
    assert plan_main(["--config", "clef", "--image-size", "1024by768"]) == 2
    assert "WIDTHxHEIGHT" in capsys.readouterr().err


def test_doctor_says_whether_videos_work(capsys) -> None:
    from clef_local.planning.doctor import main as doctor_main
    from clef_local.runtime.processor import video_unavailable

    assert doctor_main(["--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["media"]["images"].startswith("accepted")
    reason = video_unavailable()
    assert info["media"]["videos"] == ("accepted" if reason is None else info["media"]["videos"])
    if reason is not None:
        assert info["media"]["videos"].startswith("refused") and "clef-local[video]" in info["media"]["videos"]
    assert {c["name"]: c["extra"] for c in info["components"]}["torchvision"] == "video"


def test_mlx_and_onnx_backends_name_the_torch_backend(tiny_vision: Path) -> None:
    request = {"model": "m", "state": "s", "images": [data_uri(PHOTO)], "questions": QUESTIONS}
    pytest.importorskip("mlx.core")
    mlx = clef_local.load(tiny_vision, backend="mlx", dtype="float32")
    with pytest.raises(ApiUsageError, match=r"mlx backend does not run the vision tower.*--backend torch"):
        mlx.decide(request)
    assert "--backend torch" in mlx.describe()["media"]
    assert mlx.decide({**request, "images": None})["answers"]  # text still works
    # the ONNX backend class takes no media (an export is not needed to see the refusal: it is the model's check)
    from clef_local.backends.onnx_backend import OnnxBackend
    from clef_local.formats.release import read_release
    from clef_local.model import ClefModel
    from clef_local.runtime.tokenizer import ReleaseTokenizer

    assert OnnxBackend.accepts_media is False
    onnx_like = SimpleNamespace(name="onnx", device="cpu", load_decision=None, describe=dict, accepts_media=False,
                                media_refusal=None, state_cache_blocker=OnnxBackend.state_cache_blocker,
                                batch_tokens=None, pad_waste=None)
    model = ClefModel(read_release(tiny_vision), onnx_like, ReleaseTokenizer(tiny_vision))  # type: ignore[arg-type]
    with pytest.raises(ApiUsageError, match=r"onnx backend does not run the vision tower.*--backend torch"):
        model.decide(request)


def test_a_release_without_vision_says_so(tiny_llama: Path) -> None:
    model = clef_local.load(tiny_llama, dtype="float32")
    with pytest.raises(ApiUsageError, match="has no vision tower"):
        model.decide({"model": "m", "state": "s", "images": [data_uri(PHOTO)], "questions": QUESTIONS})
    assert model.describe()["media"].startswith("none")
