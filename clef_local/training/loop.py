"""The pieces of a training loop: the optimiser's parameter groups and schedule, one step, resumable checkpoints
(refused when the run's settings changed) and the head files a run writes."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from clef_local.errors import ReleaseError
from clef_local.formats.release import read_head_config
from clef_local.heads.torch_head import HeadConfig, JointSchemaHead

log = logging.getLogger(__name__)


@contextlib.contextmanager
def flush_denormals() -> Iterator[None]:
    """Denormal floats flushed to zero while the block runs (CPU). Denormals are below 1.2e-38, so no result
    changes, but x86 handles them in microcode, several times slower (docs/benchmarks.md#head-training)."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def parameter_groups(head: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups of the parameters that require a gradient (a state-path head's zeroed branches stay out),
    weight decay on matrices only: decaying norms, biases and the logit scales pulls them towards 0 for no
    regularising gain (the scales at 0 mean logits within ±1)."""
    trainable = [p for p in head.parameters() if p.requires_grad]
    return [{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}]


def warmup_cosine(total: int, warmup_fraction: float = 0.05) -> Callable[[int], float]:
    """Linear warm-up over the first 5% of steps, then cosine decay to zero."""
    warmup = max(1, int(total * warmup_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def optimizer_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, scheduler: Any,
                   parameters: Iterable[torch.nn.Parameter]) -> float:
    """One step: gradients clipped to norm 1, the schedule advanced; returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(parameters, 1.0)
    optimizer.step()
    scheduler.step()
    return loss.item()


def check_settings(path: Path, saved: dict, settings: dict) -> None:
    """Refuse to resume the checkpoint at ``path`` when its run had other ``settings``: resuming it would silently
    finish a different run."""
    changed = sorted(k for k in {*saved, *settings} if saved.get(k) != settings.get(k))
    if changed:
        diff = ", ".join(f"{k}: {saved.get(k)!r} there, {settings.get(k)!r} now" for k in changed)
        raise ValueError(f"{path} is the checkpoint of a run with other settings ({diff}); delete it to start "
                         "over, or pass another --work")


def save_checkpoint(path: Path, state: dict) -> None:
    """``state`` written atomically (a kill mid-write keeps the last checkpoint)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, settings: dict, device: str | torch.device) -> dict:
    """A :func:`save_checkpoint` file whose ``"settings"`` are ``settings`` (:func:`check_settings`)."""
    state = torch.load(path, weights_only=False, map_location=device)
    check_settings(path, state.get("settings", {}), settings)
    return state


def save_head(head: JointSchemaHead, head_config: HeadConfig, out: Path, log_dict: dict) -> None:
    """The head part of a release: ``joint_head.safetensors`` (float32), its config, ``training_log.json``."""
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().cpu().contiguous() for k, v in head.state_dict().items()},
              str(out / "joint_head.safetensors"))
    config_dict = {k: v for k, v in head_config.to_json_dict().items() if k != "dropout"}
    (out / "joint_head_config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    (out / "training_log.json").write_text(json.dumps(log_dict, indent=2) + "\n")


def load_init_head(init: Path, hidden_size: int, device: str | torch.device) -> tuple[JointSchemaHead, HeadConfig]:
    """The head in ``init`` (``joint_head.*``, e.g. ``clef_local/demo/head``) to train on from its weights; it must
    read the backbone's ``hidden_size``."""
    head_config = read_head_config(init / "joint_head_config.json")
    if head_config.hidden_size != hidden_size:
        raise ReleaseError(f"--init {init}: the head reads hidden size {head_config.hidden_size}, the backbone has "
                           f"{hidden_size}; start from a head of this backbone")
    head = JointSchemaHead(head_config).to(device)
    head.load_state_dict(load_file(str(init / "joint_head.safetensors"), device=str(device)), strict=True)
    return head, head_config
