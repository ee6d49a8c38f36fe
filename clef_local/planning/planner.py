"""``clef-local plan``: will a release or variant fit a device, in which format, before loading a tensor
(docs/hardware.md#clef-local-plan). :func:`footprint_from_release` and :func:`footprint_from_config` are the library
entry points: weights from :mod:`clef_local.planning.census`, activations, overhead and the verdict from
:mod:`clef_local.planning.estimate`; the Clef and Clef-flash shapes ship in ``clef_local/planning/configs``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_local.errors import ClefError
from clef_local.formats.release import Release, head_config_beside, read_head_config, read_json, read_release
from clef_local.planning.caps import parse_max_memory, resolve_devices
from clef_local.planning.census import (
    DEFAULT_GROUP_SIZE,
    FORMATS,
    WeightCensus,
    census_from_config,
    census_from_release,
    meta_shapes,
    precision_groups,
    stored_format,
)
from clef_local.planning.choice import as_cpu
from clef_local.planning.estimate import DTYPE_SIZE, ModelDims, Plan, best_fit, explain, max_context, plan
from clef_local.planning.hardware import Hardware, resolve_device
from clef_local.planning.read_probe import ReadRate
from clef_local.planning.split import SplitPlan, render_split, split_plan
from clef_local.planning.stream import StreamPlan, render_streamed, stream_plan
from clef_local.planning.vision import ImageLoad, VisionDims, image_load, parse_image_size, vision_activation_bytes
from clef_local.runtime.encoding import PUBLISHED_CONTEXT, default_max_length
from clef_local.runtime.processor import ImageGeometry
from clef_local.units import GiB

DEFAULT_CONTEXT = PUBLISHED_CONTEXT  # what a model loads with: Clef's published window (docs/format.md §2)
CONFIGS_DIR = Path(__file__).resolve().parent / "configs"  # NAME.config.json + NAME.joint_head_config.json
PACKAGED_CONFIGS = ("clef", "clef-flash")  # the published shapes of Cloudflare/clef and Cloudflare/clef-flash


def packaged_config(name: str) -> Path:
    """The packaged ``NAME.config.json`` of ``clef`` or ``clef-flash`` (its joint head config lies beside it)."""
    if name not in PACKAGED_CONFIGS:
        raise ValueError(f"unknown config {name!r}: the packaged ones are {', '.join(PACKAGED_CONFIGS)}")
    return CONFIGS_DIR / f"{name}.config.json"


def resolve_config(value: str | Path) -> Path:
    """A ``--config`` value as a file: a packaged name (``clef``, ``clef-flash``) or a path to a ``config.json``.

    A bare word that is neither a packaged name nor an existing file is an error listing the known names; anything
    that looks like a path (a separator or a ``.json`` suffix) is returned for the reader to check.
    """
    text = str(value)
    if text in PACKAGED_CONFIGS:
        return packaged_config(text)
    path = Path(text).expanduser()
    if path.exists() or "/" in text or "\\" in text or text.endswith(".json"):
        return path
    raise ValueError(f"unknown config {text!r}: give a path to a config.json or one of the packaged names "
                     f"({', '.join(PACKAGED_CONFIGS)})")


@dataclass(frozen=True)
class Footprint:
    """What the planner knows about one release, variant or config: weights per format and the shapes."""

    name: str
    architecture: str
    dims: ModelDims
    censuses: dict[str, WeightCensus]  # format -> census (a variant has only its own)
    stored: str  # the format the directory holds ("bf16" for a bare config)
    geometry: ImageGeometry | None = None  # how the processor cuts images (None: no vision tower)
    vision: VisionDims | None = None
    precision: tuple[dict[str, Any], ...] = ()  # a mixed variant's layer groups: census.precision_groups

    def image_load(self, width: int, height: int, images: int) -> ImageLoad:
        if self.geometry is None:
            raise ValueError(f"{self.name} has no vision tower: --image-size does not apply")
        return image_load(self.geometry, width, height, images)

    def plans(self, hardware: Hardware, *, context: int, batch: int = 1, dtype: str = "bfloat16",
              host_embeddings: bool = True, media: bool = False, images: ImageLoad | None = None,
              chunking: bool = False) -> dict[str, Plan]:
        vision = 0
        if images is not None and self.vision is not None:
            vision = vision_activation_bytes(self.vision, images, batch, DTYPE_SIZE[dtype])
        return {fmt: plan(c, self.dims, hardware, context=context, batch=batch, dtype=dtype,
                          host_embeddings=host_embeddings, media=media or images is not None,
                          visual_tokens=images.visual_tokens if images else 0, vision_activations=vision,
                          chunking=chunking)
                for fmt, c in self.censuses.items()}

    def streamed(self, hardware: Hardware, *, context: int, dtype: str = "bfloat16",
                 read_rate: ReadRate | None = None) -> dict[str, StreamPlan]:
        """Each format streamed from disk by the torch backend (:mod:`clef_local.planning.stream`; on a Mac torch
        runs on the CPU, in the whole unified memory)."""
        host = hardware if hardware.kind != "apple" else as_cpu(hardware)
        return {fmt: stream_plan(c, self.dims, host, context=context, dtype=dtype, read_rate=read_rate)
                for fmt, c in self.censuses.items()}

    def splits(self, devices: list[Hardware], *, context: int, batch: int = 1, dtype: str = "bfloat16",
               host_embeddings: bool = True, media: bool = False) -> dict[str, SplitPlan]:
        """Each format's pipeline split over ``devices`` (:mod:`clef_local.planning.split`)."""
        return {fmt: split_plan(c, self.dims, devices, context=context, batch=batch, dtype=dtype,
                                host_embeddings=host_embeddings, media=media) for fmt, c in self.censuses.items()}


def footprint_from_release(path: str | Path | Release, formats: tuple[str, ...] = FORMATS,
                           group_size: int = DEFAULT_GROUP_SIZE) -> Footprint:
    """Footprint of a release or variant directory from its headers (a variant: its stored format only); ``path``
    may be the :class:`Release` already read (it is not read again)."""
    release = path if isinstance(path, Release) else read_release(path)
    stored = stored_format(release.config)
    wanted = formats if stored == "bf16" else tuple(f for f in formats if f == stored) or (stored,)
    censuses = {fmt: census_from_release(release.path, release.weight_files, release.config, fmt,
                                         group_size=group_size) for fmt in wanted}
    dims = ModelDims.from_config(release.config, head_width=release.head_config.width)
    vision = VisionDims.from_config(release.config)
    geometry = ImageGeometry.from_release(release.path, release.config) if vision else None
    precision = tuple(precision_groups(release.config, censuses[stored])) if stored in censuses else ()
    return Footprint(release.path.name, release.architecture, dims, censuses, stored, geometry, vision, precision)


def footprint_from_config(config_path: Path, formats: tuple[str, ...] = FORMATS,
                          group_size: int = DEFAULT_GROUP_SIZE, head_config: Path | None = None) -> Footprint:
    """Footprint of a bare ``config.json`` (the architecture on the meta device; the head config beside it, as
    ``NAME.joint_head_config.json`` or ``joint_head_config.json``, when there is one)."""
    config = read_json(config_path)
    head_config = head_config or head_config_beside(config_path)
    width = read_head_config(head_config).width if head_config else 0
    shapes = meta_shapes(config_path)
    censuses = {fmt: census_from_config(config_path, fmt, head_config_path=head_config, group_size=group_size,
                                        shapes=shapes) for fmt in formats}
    architecture = str((config.get("architectures") or ["unknown"])[0])
    name = config_path.name.removesuffix(".json").removesuffix(".config")
    vision = VisionDims.from_config(config)
    geometry = ImageGeometry.from_config(config) if vision else None
    return Footprint(name, architecture, ModelDims.from_config(config, head_width=width), censuses, "bf16",
                     geometry, vision)


def default_dtype(hardware: Hardware) -> str:
    """The compute dtype ``auto`` means on ``hardware``: bf16 where it is fast, float16 on pre-Ampere CUDA,
    float32 on a CPU without AMX (bf16 would be slower there)."""
    if hardware.kind == "cuda":
        return "bfloat16" if hardware.bf16 else "float16"
    if hardware.kind == "apple":
        return "bfloat16"
    return "bfloat16" if hardware.fast_bf16 else "float32"


def chunked_prefill(hardware: Hardware) -> bool:
    """Whether the backend that runs on ``hardware`` chunks a prefill that does not fit in one pass: torch (CUDA, a
    CPU) does, MLX (Apple silicon) does not (docs/hardware.md#chunked-prefill)."""
    return hardware.kind != "apple"


def _gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def render(footprint: Footprint, plans: dict[str, Plan], *, show_explain: bool,
           images: ImageLoad | None = None, streamed: dict[str, StreamPlan] | None = None) -> str:
    """The human-readable report: one row per format, the verdict (fits resident, streams from disk, does not fit),
    the streamed table, and optionally the formula."""
    any_plan = next(iter(plans.values()))
    hw = any_plan.hardware
    lines = [f"{footprint.name} ({footprint.architecture}; weights from {any_plan.census.source}) on {hw.device}: "
             f"{hw.name}, {_gib(hw.free_bytes)} GiB available",
             f"context {any_plan.context:,} × batch {any_plan.batch}, {any_plan.dtype} activations"
             + ("" if hw.shares_host_memory else
                f"; embeddings {'in host memory' if any_plan.host_embeddings else 'on the device'}")
             + ("; vision tower loaded" if any_plan.media else ""),
             *([f"{images.images} image{'s' * (images.images != 1)} of {images.width}×{images.height}: "
                f"{images.tokens_per_image:,} visual tokens each, {images.visual_tokens:,} of the context; the "
                f"vision tower's pass needs {_gib(any_plan.vision_activations)} GiB of activations"]
               if images else []),
             "",
             f"{'format':<7}{'weights':>9}{'host':>7}{'activ.':>8}{'overhead':>10}{'need':>8}  verdict (GiB)"]
    for fmt, p in plans.items():
        verdict = ("fits" if p.fits else "streams from disk" if streamed and streamed[fmt].fits
                   else "does not fit")
        lines.append(f"{fmt:<7}{_gib(p.device_weights):>9}{_gib(p.host_weights):>7}{_gib(p.activations.total):>8}"
                     f"{_gib(p.overhead + p.margin):>10}{_gib(p.need):>8}  {verdict}"
                     + (f" (prefill in {p.chunk:,}-token chunks)" if p.chunk and p.fits else ""))
    if footprint.precision:
        lines += ["", f"{footprint.stored}: the format of each group of decoder layers (bytes as stored)"]
        lines += [f"  layers {g['layers']:<8}{g['format']:<10}{g['bytes'] / 1e6:>10.2f} MB"
                  for g in footprint.precision]
    best = best_fit(plans)
    lines.append("")
    if best is not None:
        lines.append(f"best precision that fits: {best.fmt} ({_gib(best.need)} of {_gib(best.available)} GiB)")
    else:
        smallest = min(plans.values(), key=lambda p: p.need)
        longest = max_context(smallest.census, footprint.dims, hw, batch=smallest.batch, dtype=smallest.dtype,
                              host_embeddings=smallest.host_embeddings, media=smallest.media,
                              chunking=chunked_prefill(hw))
        hint = f"; {smallest.fmt} fits up to {longest:,} tokens (--context)" if longest else ""
        lines.append(f"nothing fits: the smallest, {smallest.fmt}, needs {_gib(smallest.need)} GiB{hint}")
    if streamed:
        lines += ["", *render_streamed(streamed)]
    if show_explain:
        for fmt, p in plans.items():
            lines += ["", f"[{fmt}]", *explain(p)]
    return "\n".join(lines)


def render_splits(footprint: Footprint, splits: dict[str, SplitPlan], show: str | None) -> str:
    """The report for several devices: each format's need per device and verdict, then the split of ``show``
    (default: the best precision that fits, else the smallest format)."""
    any_split = next(iter(splits.values()))
    devices = [s.hardware for s in any_split.stages]
    lines = [f"{footprint.name} ({footprint.architecture}) split over {len(devices)} devices: "
             + ", ".join(f"{h.device} {h.name} ({_gib(h.free_bytes)} GiB)" for h in devices),
             f"context {any_split.context:,} × batch {any_split.batch}, {any_split.dtype} activations", "",
             f"{'format':<7}{'need per device (GiB)':>30}  verdict"]
    for fmt, sp in splits.items():
        lines.append(f"{fmt:<7}{' + '.join(_gib(s.need) for s in sp.stages):>30}  "
                     f"{'fits' if sp.fits else 'does not fit'}")
    best = next((splits[f] for f in FORMATS if f in splits and splits[f].fits), None)
    chosen = splits[show] if show else best or min(splits.values(), key=lambda sp: max(s.need for s in sp.stages))
    lines += ["", f"best precision that fits: {best.fmt}" if best else "nothing fits over these devices", "",
              *render_split(chosen)]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clef-local plan", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="release or variant directory (default: the demo model)")
    source.add_argument("--config", help="a bare config.json (architecture only, no weights), or the packaged "
                        f"shape of {' / '.join(PACKAGED_CONFIGS)} by name")
    parser.add_argument("--head-config", type=Path, help="joint_head_config.json for --config (default: beside it)")
    parser.add_argument("--format", default="all", choices=[*FORMATS, "all"], help="format to plan (default: all)")
    parser.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE, help="int4 group / nf4 block size")
    parser.add_argument("--context", type=int, help=f"tokens per record (default: min({DEFAULT_CONTEXT:,}, the "
                        "model's context))")
    parser.add_argument("--batch", type=int, default=1, help="records per prefill (default 1)")
    parser.add_argument("--device", default="auto",
                        help="auto, cpu, cuda[:N], mps, or a named device: rtx4090, l40s, a100-80g, h100, h200, "
                             "24GiB, mac-36, cpu-8, ...; several, comma-separated (cuda:0,cuda:1 or 24GiB,24GiB), for "
                             "a pipeline split of the layers")
    parser.add_argument("--max-memory", help="cap devices' memory: cuda:0=24GiB[,cuda:1=24GiB] or 24GiB for every "
                        "device (a large card planned as a smaller one)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_SIZE), help="compute dtype (default: the loader's choice)")
    parser.add_argument("--embeddings-on-device", action="store_true",
                        help="count embed_tokens and lm_head on the card (default: host memory, docs/hardware.md)")
    parser.add_argument("--media", action="store_true", help="requests carry images/videos: count the vision tower")
    parser.add_argument("--image-size", metavar="WxH", help="requests carry images of this size (e.g. 1024x768): "
                        "count their visual tokens and the vision tower's pass (implies --media)")
    parser.add_argument("--images", type=int, default=1, help="images per request with --image-size (default 1)")
    parser.add_argument("--read-rate", metavar="RATE",
                        help="the disk's read rate for the streamed estimates (e.g. 3GB/s; default: measured once "
                             "on --model's files, or 2 GB/s assumed for --config)")
    parser.add_argument("--explain", action="store_true", help="print the formula with the numbers")
    parser.add_argument("--json", action="store_true", help="print JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``clef-local plan``; exit 0 when some format fits, 1 when none does, 2 on bad input."""
    args = build_parser().parse_args(argv)
    formats = FORMATS if args.format == "all" else (args.format,)
    try:
        devices = resolve_devices(args.device, parse_max_memory(args.max_memory), resolve_device)
        hardware = devices[0]
        if args.config is not None:
            footprint = footprint_from_config(resolve_config(args.config), formats, args.group_size,
                                              args.head_config)
        else:
            if args.model is None:
                from clef_local.demo.default import default_model_path

                args.model = default_model_path()
            release = read_release(args.model)
            if release.is_gguf:
                return _main_gguf(args, release, devices)
            footprint = footprint_from_release(release, formats, args.group_size)
    except (ClefError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    context = args.context or default_max_length(footprint.dims.max_context)
    images = None
    try:
        if args.image_size:
            images = footprint.image_load(*parse_image_size(args.image_size), args.images)
            if images.visual_tokens >= context:
                raise ValueError(f"{images.images} image(s) of {args.image_size} need {images.visual_tokens:,} "
                                 f"visual tokens, more than the context of {context:,}: fewer or smaller images")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if len(devices) > 1:
        if images is not None:
            print("error: --image-size is planned on one device; drop it or plan each card with --device",
                  file=sys.stderr)
            return 2
        return _main_split(args, footprint, devices, context)
    dtype = args.dtype or default_dtype(hardware)
    plans = footprint.plans(hardware, context=context, batch=args.batch, dtype=dtype,
                            host_embeddings=not args.embeddings_on_device, media=args.media, images=images,
                            chunking=chunked_prefill(hardware))
    try:
        rate = _read_rate(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    streamed = footprint.streamed(hardware, context=context, dtype=dtype, read_rate=rate)
    best = best_fit(plans)
    if args.json:
        print(json.dumps({"model": footprint.name, "architecture": footprint.architecture,
                          "hardware": hardware.to_json(), "plans": [p.to_json() for p in plans.values()],
                          "streamed": [sp.to_json() for sp in streamed.values()],
                          **({"images": images.to_json()} if images else {}),
                          **({"precision_groups": list(footprint.precision)} if footprint.precision else {}),
                          "best": best.fmt if best else None}, indent=2))
    else:
        print(render(footprint, plans, show_explain=args.explain, images=images, streamed=streamed))
    return 0 if best is not None else 1


def _main_gguf(args: argparse.Namespace, release: Release, devices: list[Hardware]) -> int:
    """``plan`` of a GGUF release: llama.cpp's memory on one device (a GPU assumed to run a GPU build of it)."""
    from clef_local.planning.gguf_plan import gguf_footprint, gguf_plan, kv_dtype, render_gguf

    if len(devices) > 1:
        print("error: llama.cpp runs a GGUF on one device; plan one --device", file=sys.stderr)
        return 2
    hardware = devices[0]
    context = args.context or default_max_length(release.max_position_embeddings)
    p = gguf_plan(gguf_footprint(release), hardware, context=context, kv=kv_dtype(args.dtype),
                  offloaded=hardware.kind != "cpu")
    if args.json:
        print(json.dumps({"model": release.path.name, "architecture": p.footprint.architecture,
                          "hardware": hardware.to_json(), "gguf": p.footprint.to_json(),
                          "plans": [p.to_json()], "best": "gguf" if p.fits else None}, indent=2, default=str))
    else:
        print(render_gguf(p, show_explain=args.explain))
    return 0 if p.fits else 1


def _read_rate(args: argparse.Namespace) -> ReadRate:
    """``--read-rate``, else the rate measured once on ``--model``'s largest weight file, else the assumed one."""
    from clef_local.planning import read_probe

    if args.read_rate:
        return read_probe.given(args.read_rate)
    if args.model is not None:
        release = read_release(args.model)
        if release.weight_files:
            return read_probe.read_rate(max(release.weight_files, key=lambda f: f.stat().st_size))
    return read_probe.assumed()


def _main_split(args: argparse.Namespace, footprint: Footprint, devices: list[Hardware], context: int) -> int:
    try:
        splits = footprint.splits(devices, context=context, batch=args.batch,
                                  dtype=args.dtype or default_dtype(devices[0]),
                                  host_embeddings=not args.embeddings_on_device, media=args.media)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fits = any(sp.fits for sp in splits.values())
    if args.json:
        print(json.dumps({"model": footprint.name, "architecture": footprint.architecture,
                          "devices": [h.to_json() for h in devices], "splits": [sp.to_json() for sp in splits.values()],
                          "best": next((f for f in FORMATS if f in splits and splits[f].fits), None)}, indent=2))
    else:
        print(render_splits(footprint, splits, None if args.format == "all" else args.format))
    return 0 if fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
