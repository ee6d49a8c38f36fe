"""Which quantized format a release's ``config.json`` describes, and which tool wrote it: the one place that decides.

clef-local's own variants carry ``quantization_config.clef_local`` (``{"scheme", "group_size", …}``) beside the
standard config of their layout: compressed-tensors' for fp8 / int8 and for int4 in its ``pack-quantized`` layout
(``--int4-layout compressed``), bitsandbytes' for nf4, mlx-lm's ``quantization`` block for int4 in the MLX affine
layout (variants written before those configs have ``"quant_method": "clef-local"`` instead, and still load). The
ecosystem's own checkpoints have no ``clef_local`` member: an mlx-lm or mlx-vlm conversion (``mlx_lm.convert -q``,
``mlx_vlm.convert -q``) is read from its top-level ``quantization`` block, a compressed-tensors checkpoint from its
``config_groups``. The census, the loaders, the app and ``inspect`` all ask :func:`variant_format`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_local.errors import ReleaseError
from clef_local.formats.quant_plan import MIXED
from clef_local.quant import compressed, registry

SCHEMES = (*registry.SCHEMES, MIXED)
MLX_INT4_GROUPS = (32, 64, 128)  # clef-local's int4 groups (quant.int4.GROUP_SIZES), all of which MLX runs
_MLX_KEYS = {"group_size", "bits", "mode"}
# A variant refused by export validation and kept with --quarantine (clef_local.export.refusal) has this file and
# quantization_config.clef_local.quarantined; either one is enough for the loaders to refuse it.
QUARANTINED = "QUARANTINED"


@dataclass(frozen=True)
class VariantFormat:
    """A quantized release's scheme (one of :data:`SCHEMES`), its group size (int4 / nf4; None otherwise), the
    layout its config names and the tool that wrote it (``clef-local``, ``mlx-lm``, ``mlx-vlm``,
    ``compressed-tensors``, ``bitsandbytes``)."""

    scheme: str
    group_size: int | None
    layout: str
    writer: str

    def to_json(self) -> dict[str, Any]:
        """What ``inspect`` prints under ``format``: ``{"scheme", "group_size", "layout", "written_by"}``."""
        return {"scheme": self.scheme, "group_size": self.group_size, "layout": self.layout,
                "written_by": self.writer}

    @property
    def label(self) -> str:
        """``fp8 (compressed-tensors float-quantized, written by clef-local)``."""
        group = f" g{self.group_size}" if self.group_size else ""
        return f"{self.scheme}{group} ({self.layout}, written by {self.writer})"


def _ours(quant: Mapping[str, Any], member: Mapping[str, Any]) -> VariantFormat:
    scheme = member.get("scheme")
    if scheme not in SCHEMES:
        raise ReleaseError(f"config.json: quantization_config.clef_local.scheme {scheme!r} is not one of "
                           f"{', '.join(SCHEMES)}")
    group = member.get("group_size") or quant.get("group_size")
    method = quant.get("quant_method")
    if method == compressed.QUANT_METHOD:
        try:
            found, _ = compressed.read_weights(quant)
        except ValueError as exc:
            raise ReleaseError(f"config.json: {exc}") from None
        if found != scheme:
            raise ReleaseError(f"config.json: quantization_config describes {found} tensors but its clef_local "
                               f"member says {scheme}; re-export the variant with clef-local quantize")
        layout = f"compressed-tensors {quant.get('format')}"
    elif scheme == MIXED:
        layout = "clef-local mixed"
    else:  # the layout of the scheme's own config (fp8 / int8 written before their compressed-tensors config: the
        # same tensors, a descriptive config)
        layout = registry.get(str(scheme)).config_layout
    return VariantFormat(str(scheme), group if isinstance(group, int) else None, layout, "clef-local")


def _mlx_lm(block: Mapping[str, Any], writer: str) -> VariantFormat:
    group, bits, mode = block.get("group_size"), block.get("bits"), block.get("mode", "affine")
    if set(block) - _MLX_KEYS or bits != 4 or mode != "affine" or group not in MLX_INT4_GROUPS:
        extra = sorted(set(block) - _MLX_KEYS)
        raise ReleaseError(f"config.json: {writer} quantization {dict(block)!r} is not one clef-local reads: it reads "
                           f"4-bit affine with group_size {'/'.join(map(str, MLX_INT4_GROUPS))} and no per-layer "
                           f"entries{' (found ' + ', '.join(extra[:3]) + ')' if extra else ''}; convert with "
                           f"{writer.replace('-', '_')}.convert -q --q-bits 4 --q-group-size 64")
    return VariantFormat("int4", int(group), "mlx affine", writer)


def variant_format(config: Mapping[str, Any]) -> VariantFormat | None:
    """The quantized format ``config`` (a ``config.json``) describes; None for a full-precision release.
    :class:`ReleaseError` names a quantization config clef-local does not read."""
    found = config.get("quantization_config")
    block = config.get("quantization")
    if not isinstance(found, Mapping) and not isinstance(block, Mapping):
        return None
    quant: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    member = quant.get("clef_local")
    if isinstance(member, Mapping):
        return _ours(quant, member)
    if isinstance(block, Mapping):
        # mlx-vlm keeps the vision tower and always writes a vision_config; mlx-lm's Qwen3.5 drops both
        return _mlx_lm(block, "mlx-vlm" if "vision_config" in config else "mlx-lm")
    method = quant.get("quant_method")
    if method == compressed.QUANT_METHOD:
        try:
            scheme, group = compressed.read_weights(quant)
            return VariantFormat(scheme, group, f"compressed-tensors {quant.get('format')}", "compressed-tensors")
        except ValueError as exc:
            raise ReleaseError(f"config.json: {exc}") from None
    if method == "bitsandbytes" and quant.get("bnb_4bit_quant_type") == "nf4":
        return VariantFormat("nf4", None, "bitsandbytes nf4", "bitsandbytes")
    raise ReleaseError(f"config.json: quantization_config with quant_method {method!r} is not a format clef-local "
                       f"reads (clef-local's own variants, mlx-lm 4-bit affine, compressed-tensors fp8/int8 per "
                       f"channel and int4 pack-quantized per group, bitsandbytes nf4)")


def quarantine_reason(path: str | Path, config: Mapping[str, Any]) -> str | None:
    """Why the variant at ``path`` (its ``config.json`` read as ``config``) was quarantined by ``quantize
    --quarantine``: ``quantization_config.clef_local.quarantined``, else the :data:`QUARANTINED` file's first line;
    None for any other directory."""
    quant = config.get("quantization_config")
    member = quant.get("clef_local") if isinstance(quant, Mapping) else None
    reason = member.get("quarantined") if isinstance(member, Mapping) else None
    if reason:
        return str(reason)
    marker = Path(path) / QUARANTINED
    if marker.is_file():
        lines = marker.read_text(encoding="utf-8", errors="replace").splitlines()
        return lines[0].strip() if lines and lines[0].strip() else "it failed export validation"
    return None


def check_not_quarantined(path: str | Path, config: Mapping[str, Any]) -> None:
    """Refuse to run a quarantined variant (:func:`quarantine_reason`): :class:`ReleaseError` naming why and where its
    report is. Its files can still be read (``inspect``, ``verify``); only running it is refused."""
    reason = quarantine_reason(path, config)
    if reason is None:
        return
    raise ReleaseError(f"{path} is a quarantined variant: export validation refused it ({reason}); its report is "
                       f"{Path(path) / 'validation.json'}. clef-local does not run it: export the variant again "
                       f"(another scheme or group size, --calibrate), or with --no-validate to write one "
                       f"unvalidated on purpose")
