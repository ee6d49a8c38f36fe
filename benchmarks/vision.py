"""Images on this CPU: time per image size of each step, and the planner's visual tokens against the processor's.

    python benchmarks/vision.py                          # the tiny vision release (built in a temp dir), float32
    python benchmarks/vision.py --model DIR --repeats 5  # a real release (torch backend)
    python benchmarks/vision.py --threads 2              # torch threads (default 1: see below)

For each image size, one request with that image (a PNG of gradients and noise, base64) and a two-question schema:

- decode: base64 → PIL image (``clef_local.runtime.media.decode_image``: EXIF orientation, RGB);
- preprocess: the release's image processor (resize into the pixel range, patches) and the placeholder ids
  (``MediaProcessor.encode``);
- vision tower: ``model.model.get_image_features`` on those pixels alone;
- prefill: the whole backbone pass with the image (vision tower + text model, ``TorchBackbone.forward`` with the media);
- decide: ``ClefModel.decide`` end to end (validation, decode, preprocess, backbone, head, answers).

``planner`` is ``clef-local plan``'s count of visual tokens for that size (:mod:`clef_local.planning.vision`),
``processor`` the pad tokens the processor actually put in the prompt: the table says whether they are equal.
Times are medians over ``--repeats`` runs after one warm-up, in milliseconds. On a small machine shared with other
jobs, two torch threads wait on each other at every operator (the tiny vision tower: 8 ms on one thread, 270 ms on
two, measured on the CI machine), so the default is one thread.
Table in docs/benchmarks.md#vision-images-and-video.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import platform
import tempfile
from pathlib import Path

import numpy as np
import torch
from _timing import median_ms

import clef_local
from clef_local.planning.planner import footprint_from_release
from clef_local.runtime.media import decode_image

SIZES = ((64, 64), (320, 240), (640, 480), (1024, 768), (1920, 1080), (3000, 2000))


def png(width: int, height: int, seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200
    pixels = np.clip(base + rng.normal(0, 25, (height, width, 3)), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="a release with a vision tower (default: the tiny vision release)")
    parser.add_argument("--dtype", default="float32", help="backbone compute dtype (default float32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from clef_local.testing import build_tiny_release

            path = build_tiny_release(Path(tmp) / "tiny-vision", vision=True)
        model = clef_local.load(path, dtype=args.dtype, backend="torch")
        footprint = footprint_from_release(path, formats=("bf16",))
        processor = model.media_processor()
        backbone = model.backend.backbone  # type: ignore[attr-defined]
        print(f"{path.name}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
              f"{torch.__version__} (threads: {torch.get_num_threads()}), {args.dtype}, image processor "
              f"{type(processor.image_processor).__name__}, median of {args.repeats}\n")
        print("| image | visual tokens: planner | processor | equal | decode ms | preprocess ms | vision tower ms "
              "| prefill ms | decide ms |")
        print("|---|---|---|---|---|---|---|---|---|")
        questions = {"kind": {"type": "choice", "instructions": "What does <image 1> show?",
                              "criteria": {"receipt": None, "photo": None, "screen": None}},
                     "readable": {"type": "noul", "instructions": "Is the text readable?"}}
        from clef_local.backends.torch_pass import collate, collate_media

        for width, height in SIZES:
            text = base64.b64encode(png(width, height)).decode()
            request = {"model": "m", "state": "An upload.", "images": [text], "questions": questions}
            planner = footprint.image_load(width, height, 1).visual_tokens
            decoded = decode_image(text, ("images", 0))
            inputs = processor.encode([decoded], [])
            encoded = model.encode(request)
            ids, mask = collate([encoded], model.tokenizer.pad_token_id, backbone.device)
            media = collate_media([encoded], ids.shape[1], backbone.device)
            pixels = torch.from_numpy(inputs.pixel_values)
            grid = torch.from_numpy(inputs.image_grid_thw)

            def tower(pixels: torch.Tensor = pixels, grid: torch.Tensor = grid) -> object:
                with torch.inference_mode():
                    return backbone.model.model.get_image_features(pixels, grid)

            times = [median_ms(lambda t=text: decode_image(t, ("images", 0)), args.repeats),
                     median_ms(lambda d=decoded: processor.encode([d], []), args.repeats),
                     median_ms(tower, args.repeats),
                     median_ms(lambda i=ids, m=mask, x=media: backbone.forward(i, m, media=x), args.repeats),
                     median_ms(lambda r=request: model.decide(r), args.repeats)]
            print(f"| {width}×{height} | {planner:,} | {inputs.visual_tokens:,} | "
                  f"{'yes' if planner == inputs.visual_tokens else 'NO'} | "
                  + " | ".join(f"{t:,.1f}" for t in times) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
