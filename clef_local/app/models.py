"""The models the app can run: the reference, the variants found beside it or given, loaded once each."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _config(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def is_release(path: Path) -> bool:
    """A directory that looks like a Clef release (backbone config plus joint head)."""
    return path.is_dir() and (path / "joint_head_config.json").is_file() and _config(path) is not None


def scheme_of(path: Path) -> str | None:
    """The quantization scheme a release's ``config.json`` describes
    (:func:`clef_local.formats.variant.variant_format`), or None for an unquantized release."""
    from clef_local.formats.variant import variant_format

    fmt = variant_format(_config(path) or {})
    return None if fmt is None else fmt.scheme


def find_variants(reference: Path) -> list[Path]:
    """Sibling directories of ``reference`` that are quantized releases clef-local reads (sorted by name); one
    whose quantization config it does not read is left out with a warning naming why."""
    from clef_local.errors import ReleaseError

    parent = reference.resolve().parent
    out = []
    for child in sorted(parent.iterdir()):
        if child.resolve() == reference.resolve() or not is_release(child):
            continue
        try:
            quantized = scheme_of(child) is not None
        except ReleaseError as exc:
            log.warning("not offering %s as a variant: %s", child, exc)
            continue
        if quantized:
            out.append(child)
    return out


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


@dataclass
class ModelStore:
    """Loads each release once (``clef_local.load``) and hands out the loaded ``ClefModel``."""

    reference: Path
    variants: list[Path]
    dtype: str | None = None
    max_length: int | None = None  # each model's longest request (None: its default)
    _models: dict[Path, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def choices(self) -> list[tuple[str, str]]:
        """(label, path) pairs: the reference first, then the variants."""
        out = [(f"{self.reference.name} (reference)", str(self.reference))]
        out += [(f"{v.name} ({scheme_of(v)})", str(v)) for v in self.variants]
        return out

    def is_known(self, path: str) -> bool:
        return Path(path) in {self.reference, *self.variants}

    def get(self, path: str | Path, progress: Callable[[float, str], None] | None = None) -> Any:
        """The loaded model at ``path`` (one of :meth:`choices`), loading it the first time."""
        key = Path(path)
        if not self.is_known(str(key)):
            raise ValueError(f"{key} is not one of this app's models; start it with --model/--compare {key}")
        with self._lock:
            if key not in self._models:
                import clef_local

                if progress is not None:
                    progress(0.1, f"loading {key.name}")
                # an edited schema on the same state runs only its own tokens: the state cache, sized by the planner
                self._models[key] = clef_local.load(key, dtype=self.dtype, max_length=self.max_length,
                                                    state_cache="auto")
                if progress is not None:
                    progress(1.0, f"loaded {key.name}")
            return self._models[key]

    def loaded(self, path: str | Path) -> bool:
        return Path(path) in self._models


def describe_markdown(model: Any) -> str:
    """The model panel's text: backend, device, scheme, size, from ``ClefModel.describe()``."""
    info = model.describe()
    scheme = info.get("scheme") or (scheme_of(Path(info["path"])) or "none (as released)")
    params = info.get("backbone_parameters")
    size_mb = _dir_bytes(Path(info["path"])) / 1e6
    vision = "yes" if info.get("vision_tower") else "no"
    params_text = (f"{params / 1e6:,.1f} M + {info.get('head_parameters', 0) / 1e6:,.1f} M head parameters"
                   if params else "parameters unknown")
    return (f"**{Path(info['path']).name}** · {info.get('architecture', '?')} · **{info.get('backend', '?')}** on "
            f"**{info.get('device', '?')}** · {info.get('backbone_dtype', '?')} · scheme **{scheme}** · "
            f"{size_mb:,.1f} MB on disk · {params_text} · context {info.get('context', '?')} tokens · "
            f"vision tower: {vision}  \n`{info['path']}`")


def media_note(model: Any | None) -> str:
    """What the image drop zone does for this model."""
    if model is None:
        return "Images: load a model first."
    media = model.describe().get("media")
    if not isinstance(media, dict):
        return f"Images are not accepted by this model: {media}. Send a text or JSON state."
    return ("Drop images here: they are sent with **Run**, after the prompt's prefix in this order, as `<image 1>`, "
            "`<image 2>`, … (write those markers in the state or the instructions to refer to them). "
            f"At most {media['max_images']} per request; each is resized into {media['pixels_per_image'][0]:,}–"
            f"{media['pixels_per_image'][1]:,} pixels.")
