"""Checks shared by the question-path and state-path tests: the backbone they cache with, and the comparison of a
path's training logits with the released head's forward."""

from __future__ import annotations

from pathlib import Path

import torch

from clef_local.training.hidden_cache import cache_dtype


def cache_backbone(path: Path):
    """The tiny backbone at ``path`` in the dtype the training caches compute in on a CPU."""
    from clef_local.backends.torch_backend import TorchBackbone
    from clef_local.formats.release import read_json

    return TorchBackbone(path, read_json(path / "config.json"), device="cpu", dtype=cache_dtype("cpu"))


def assert_forward_logits(full: torch.Tensor, shortcut: torch.Tensor) -> None:
    """``shortcut`` (a training path's logits) equals ``full`` (the head's forward): the same padding, values within
    float noise of the backbone's dtype, and the logits say something (the comparison is not of constants)."""
    assert full.shape == shortcut.shape
    finite = torch.isfinite(full)
    assert torch.equal(finite, torch.isfinite(shortcut))
    assert float((full[finite] - shortcut[finite]).abs().max()) < 2e-3 * float(full[finite].abs().max())
    assert float(full[finite].std()) > 0.1
