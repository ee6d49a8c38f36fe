"""The tensor layout of a Qwen3.5 model as MLX holds it (what ``mlx_vlm.convert`` writes), mapped back to the
release's (transformers') names and shapes, for the readers that build a transformers model.

``mlx_vlm.convert`` saves the tensors its MLX model holds after its ``sanitize``, not the release's:

* names: ``model.language_model.`` → ``language_model.model.``, ``lm_head.`` → ``language_model.lm_head.``,
  ``model.visual.`` → ``vision_tower.``;
* the gated-delta ``conv1d.weight`` ``[C, 1, K]`` → ``[C, K, 1]``; the vision ``patch_embed.proj.weight``
  ``[O, C, T, H, W]`` → ``[O, T, H, W, C]`` (MLX convolutions are channels-last);
* the text model's RMSNorm weights (:data:`NORM_SUFFIXES`) plus 1.0: Qwen3.5's RMSNorm scales by ``1 + w``, MLX's by
  ``w``; the sum is stored in the conversion's dtype (BF16), so the way back gives ``w`` to within BF16's rounding
  at 1.0 (2⁻⁸), the numbers the MLX model itself runs.

mlx-lm's own ``qwen3_5`` uses the same text layout (it drops the vision tower), and its ``sanitize`` reads this layout
as it is, so the MLX backend needs none of this. The names are told apart one by one: a release's tensors start with
``model.`` or ``lm_head.``, MLX's with ``language_model.`` or ``vision_tower.``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from clef_local.errors import ReleaseError

# (MLX prefix, release prefix): the inverse of mlx-vlm's qwen3_5 sanitize_key
RENAMES = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
           ("vision_tower.", "model.visual."))
NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")  # mlx-vlm's NORM_WEIGHT_SUFFIXES: offset by 1.0 in MLX
NORM_OFFSET = 1.0
_REFIX = "convert the release again with mlx_vlm.convert (docs/quantization.md#the-ecosystems-variants-read-here)"


def is_mlx_name(name: str) -> bool:
    """Whether ``name`` is a tensor name of MLX's layout (``language_model.…``, ``vision_tower.…``)."""
    return any(name.startswith(mlx) for mlx, _ in RENAMES)


def release_name(name: str) -> str:
    """The release's name of a tensor stored under MLX's ``name``; any other name as it is."""
    for mlx, ours in RENAMES:
        if name.startswith(mlx):
            return ours + name[len(mlx):]
    return name


@dataclass(frozen=True)
class Restore:
    """How one MLX-layout tensor becomes the release's: its axes permuted (``permute``, None: as stored), then
    ``offset`` subtracted (the RMSNorm weights)."""

    permute: tuple[int, ...] | None = None
    offset: float = 0.0

    def shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The release's shape of a tensor stored as ``shape``."""
        return tuple(shape[i] for i in self.permute) if self.permute else tuple(shape)


def restore(name: str, shape: Sequence[int]) -> Restore | None:
    """What turns the MLX-layout tensor ``name`` (stored as ``shape``) into the release's; None for a tensor stored as
    released (any name not of MLX's layout, and most of those that are). A tensor mlx-vlm would have written in
    another shape is a ReleaseError naming it."""
    if not is_mlx_name(name):
        return None
    if name.endswith(".conv1d.weight"):
        if len(shape) != 3 or shape[2] != 1:
            raise ReleaseError(f"{name} is {list(shape)}: mlx-vlm stores a gated-delta conv1d as [channels, kernel, "
                               f"1]; {_REFIX}")
        return Restore(permute=(0, 2, 1))
    if name.endswith("patch_embed.proj.weight"):
        if len(shape) != 5:
            raise ReleaseError(f"{name} is {list(shape)}: mlx-vlm stores the patch embedding as [out, time, height, "
                               f"width, channels]; {_REFIX}")
        return Restore(permute=(0, 4, 1, 2, 3))
    if name.startswith("language_model.") and name.endswith(NORM_SUFFIXES):
        if len(shape) != 1:
            raise ReleaseError(f"{name} is {list(shape)}, not a norm's weight vector; {_REFIX}")
        return Restore(offset=NORM_OFFSET)
    return None
