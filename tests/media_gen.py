"""Deterministic images and image requests for the vision tests, and the reference side of the parity checks (the
reference's model and a processor for it that needs no torchvision)."""

from __future__ import annotations

import base64
import io
import json
import random
from pathlib import Path
from typing import Any

import numpy as np

# (width, height): square, wide, tall, tiny (upscaled to the processor's minimum), odd sizes, one of 300 visual
# tokens (the tiny release's CPU time grows with the tokens: most images stay near the minimum of 64 tokens)
SIZES = [(64, 64), (320, 96), (90, 280), (17, 23), (257, 129), (640, 480), (33, 500), (300, 220)]
STATES: list[Any] = [
    "Is this receipt for a coffee?",
    {"document": "invoice", "fields": ["total", "date"], "vendor": {"name": "Café Ünïcode", "vat": 0.2}},
    ["scan", {"page": 2}, 3, None],
    "",
    "Screenshot of the agent's screen 🖥️ after step 4",
]


def image(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """An image file's bytes: smooth gradients plus noise, so that resizing and patches carry real signal."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / max(width, 1), y / max(height, 1), (x + y) / max(width + height, 1)], axis=-1) * 200
    pixels = np.clip(base + rng.normal(0, 25, (height, width, 3)), 0, 255).astype(np.uint8)
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def data_uri(data: bytes, fmt: str = "png") -> str:
    return f"data:image/{fmt};base64,{base64.b64encode(data).decode()}"


def vision_requests(n: int = 24, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` requests with 1–3 images of different sizes and aspect ratios (PNG and JPEG, data URIs and raw
    base64), text and JSON states, all three question types."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        count = 1 + i % 3
        images = []
        for k in range(count):
            w, h = SIZES[(i + 3 * k) % len(SIZES)]
            fmt = "JPEG" if (i + k) % 4 == 3 else "PNG"
            data = image(w, h, seed=100 * i + k, fmt=fmt)
            images.append(data_uri(data, fmt.lower()) if (i + k) % 5 else base64.b64encode(data).decode())
        questions: dict[str, Any] = {"damaged": {"type": "noul", "instructions": f"Is image {1 + i % count} damaged?"}}
        if i % 2 == 0:
            labels = rng.sample(["receipt", "invoice", "photo", "screenshot", "other"], rng.randint(2, 5))
            questions["kind"] = {"type": "choice", "instructions": "What is shown?",
                                 "criteria": {label: rng.choice([None, f"a {label}"]) for label in labels}}
        if i % 3 != 1:
            questions["quality"] = {"type": "score", "criteria": ["unreadable", "poor", "fine", "sharp"][: 2 + i % 3]}
        out.append({"model": "clef-test", "state": STATES[i % len(STATES)], "images": images, "questions": questions})
    return out


def reference_processor(path: Path) -> Any:
    """A genuine ``Qwen3VLProcessor`` for the reference, with the PIL image processor ``AutoImageProcessor`` picks
    here. transformers refuses to build one without a video processor, which needs torchvision; this subclass only
    lets ``video_processor=None`` through (every processing step is transformers' own)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor

    class ImageOnlyProcessor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImageOnlyProcessor(image_processor=AutoImageProcessor.from_pretrained(path),
                              tokenizer=AutoTokenizer.from_pretrained(path), video_processor=None)


def reference_model(oracle: Any, path: Path) -> Any:
    """The reference ``ClefModel`` over the release's ``Qwen3_5ForConditionalGeneration`` in float32."""
    import torch
    import transformers
    from safetensors.torch import load_file

    backbone = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    head = oracle.JointSchemaHead(**json.loads((path / "joint_head_config.json").read_text()))
    head.load_state_dict(load_file(path / "joint_head.safetensors"), strict=True)
    return oracle.ClefModel(backbone, head.float()).eval()


def reference_probabilities(oracle: Any, model: Any, processor: Any, encoded_records: list[Any]) -> list[list[Any]]:
    """The reference's per-question probabilities of its encoded records, run as one padded batch."""
    import torch

    batch = oracle.collate_records(encoded_records, processor.tokenizer.pad_token_id, torch.device("cpu"))
    with torch.inference_mode():
        logits = model(batch)
    return [[q.float().softmax(-1).numpy() for q in record] for record in logits]
