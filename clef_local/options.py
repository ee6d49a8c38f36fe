"""The flags every command shares, defined once: which model, on which backend, device and compute dtype, and
whether the network stays off. Each command module's parser calls these, so the help reads the same everywhere."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
BACKENDS = ("auto", "torch", "mlx", "onnx", "llamacpp")
CONFIDENCES = ("jev", "reference")

DTYPE_HELP = ("backbone compute dtype (default auto: the loader's choice for this machine — bfloat16 on GPUs with bf16 "
              "and Apple silicon, on a CPU bfloat16 where a one-time probe measured it faster, else float32); the "
              "head always runs in float32")
BACKEND_HELP = "runtime for the backbone (default auto: chosen from the hardware and the variant, see `doctor`)"
DEVICE_HELP = ("auto, cpu, cuda, cuda:N or mps (default auto); several, comma-separated (cuda:0,cuda:1), split the "
               "decoder layers over them")
MAX_MEMORY_HELP = ("cap device memory, e.g. cuda:0=24GiB,cuda:1=24GiB or 24GiB for every device: refuse what does "
                   "not fit under it (on CUDA the allocator is capped too)")
OFFLOADS = ("none", "auto", "disk")
OFFLOAD_HELP = {
    "none": "disk: stream the backbone from its files a decoder layer at a time when it does not fit in memory "
            "(slow: every batch reads every layer; torch only); auto: only when it does not fit; default none: "
            "refuse what does not fit (docs/hardware.md#streamed-from-disk)",
    "auto": "default auto: a model that does not fit in memory is streamed from its files a decoder layer at a "
            "time (torch only; slow); disk: always streamed; none: refuse what does not fit "
            "(docs/hardware.md#streamed-from-disk)",
}


def add_model_flags(parser: argparse.ArgumentParser, *, model_help: str | None = None, backend: bool = True,
                    device: bool = True, dtype: bool = True, offload: str | None = "none") -> None:
    """``--model`` (and ``--backend``, ``--device``, ``--dtype`` unless switched off, ``--offload`` with its
    default) on ``parser``."""
    parser.add_argument("--model", type=Path,
                        help=model_help or "release or variant directory (default: the built-in demo model)")
    add_runtime_flags(parser, backend=backend, device=device, dtype=dtype, max_memory=device,
                      offload=offload if device else None)


def add_runtime_flags(parser: argparse.ArgumentParser, *, backend: bool = True, device: bool = True,
                      dtype: bool = True, max_memory: bool = False, offload: str | None = None) -> None:
    """``--backend``, ``--device``, ``--dtype`` (for commands whose model flag is their own), ``--max-memory``
    for commands that load through :func:`load_options`, and ``--offload`` defaulting to ``offload`` (``none``
    for ``decide``, ``serve``, ``batch``; ``auto`` for the reference runs of the quality commands)."""
    if dtype:
        parser.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP)
    if backend:
        parser.add_argument("--backend", choices=BACKENDS, default="auto", help=BACKEND_HELP)
    if device:
        parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    if max_memory:
        parser.add_argument("--max-memory", help=MAX_MEMORY_HELP)
    if offload is not None:
        parser.add_argument("--offload", choices=OFFLOADS, default=offload, help=OFFLOAD_HELP[offload])


MAX_LENGTH_HELP = ("the longest request in tokens, up to the backbone's context (default: 65,536, the window Clef is "
                   "published with, or the backbone's context when shorter); the memory check at load counts it, "
                   "and a longer request is refused (413)")


def add_max_length_flag(parser: argparse.ArgumentParser) -> None:
    """``--max-length N`` for commands that load a model for requests (``load(max_length=N)``)."""
    parser.add_argument("--max-length", type=int, metavar="N", help=MAX_LENGTH_HELP)


def add_network_flag(parser: argparse.ArgumentParser) -> None:
    """``--allow-network``: commands that load a model run air-gapped unless it is given."""
    parser.add_argument("--allow-network", action="store_true",
                        help="do not block network access (default: air-gapped, loopback only)")


def add_confidence_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--confidence", choices=CONFIDENCES, default="jev",
                        help="jev: distance from uniform (default); reference: peak probability")


def load_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``clef_local.load`` keyword arguments of the runtime flags present on ``args``."""
    out: dict[str, Any] = {}
    if hasattr(args, "dtype"):
        out["dtype"] = None if args.dtype == "auto" else args.dtype
    if hasattr(args, "backend"):
        out["backend"] = args.backend
    if hasattr(args, "device"):
        out["device"] = args.device
    if getattr(args, "max_memory", None):
        out["max_memory"] = args.max_memory
    if getattr(args, "max_length", None) is not None:
        out["max_length"] = args.max_length
    if hasattr(args, "offload"):
        out["offload"] = args.offload
    return out


def model_path(value: str | Path | None) -> Path:
    """``--model``'s directory, or the built-in default model (built into the user cache on first use)."""
    if value:
        return Path(value).expanduser()
    from clef_local.demo.default import default_model_path

    return default_model_path()


def add_media_flags(parser: argparse.ArgumentParser) -> None:
    """Limits on the images and videos a request may carry (docs/format.md §7)."""
    group = parser.add_argument_group("media limits")
    group.add_argument("--max-images", type=int, metavar="N", help="images per request (default 16)")
    group.add_argument("--max-image-pixels", type=int, metavar="N",
                       help="width × height of a decoded image or frame, checked before decoding (a decompression "
                            "bomb guard; default 50,000,000)")
    group.add_argument("--max-pixels", type=int, metavar="N",
                       help="resize images to at most N pixels before the vision tower (fewer visual tokens; "
                            "default: the release's processor bound)")
    group.add_argument("--max-video-frames", type=int, metavar="N", help="frames per video (default 256)")


def media_limits(args: argparse.Namespace) -> Any:
    """The :class:`~clef_local.runtime.media.MediaLimits` of the media flags (and ``--allow-network``: fetch http(s)
    image URLs) present on ``args``."""
    from clef_local.runtime.media import MediaLimits

    flags = {"max_images": "max_images", "max_input_pixels": "max_image_pixels", "max_pixels": "max_pixels",
             "max_frames": "max_video_frames"}
    given = {field: getattr(args, flag, None) for field, flag in flags.items()}
    kwargs: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    try:
        return MediaLimits(**kwargs, allow_urls=bool(getattr(args, "allow_network", False)))
    except ValueError as exc:
        from clef_local.errors import ApiUsageError

        raise ApiUsageError(str(exc)) from exc
