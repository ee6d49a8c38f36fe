"""Validation metrics of a training run and the calibration folded into the head at its end."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from clef_local.heads.torch_head import JointSchemaHead
from clef_local.quality.metrics import ece
from clef_local.training.head_losses import question_loss

log = logging.getLogger(__name__)


@dataclass
class ValidationTally:
    """Validation metrics gathered batch by batch: loss, accuracy (all labelled questions; the full views alone),
    NLL, ECE (15 bins) and the twins' |Δp|."""

    label_smoothing: float
    brier_weight: float
    losses: list[float] = field(default_factory=list)
    hits: list[bool] = field(default_factory=list)
    full_hits: list[bool] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    moved: list[float] = field(default_factory=list)

    def add(self, logits: torch.Tensor, target: torch.Tensor, full_view: torch.Tensor,
            pairs: Sequence[tuple[int, int]]) -> None:
        """One batch: ``logits`` ``[Q, K]``, ``target`` ``[Q]`` (-1 without a label), ``full_view`` ``[Q]`` (bool,
        on ``logits``' device), ``pairs`` the twin pairs' positions in the batch."""
        labelled = target >= 0
        if bool(labelled.any()):
            self.losses.append(float(question_loss(logits, target, self.label_smoothing, self.brier_weight)))
        right = (logits.argmax(-1) == target)[labelled]
        log_p = torch.log_softmax(logits[labelled], -1)
        self.nll += (-log_p.gather(1, target[labelled][:, None])[:, 0]).tolist()
        self.confidence += log_p.max(-1).values.exp().tolist()
        self.hits += right.tolist()
        self.full_hits += right[full_view[labelled]].tolist()
        probs = torch.softmax(logits, -1).nan_to_num(0.0)
        self.moved += [float((probs[a] - probs[b]).abs().max()) for a, b in pairs]

    def metrics(self, **extra: float) -> dict:
        """The metrics, ``extra`` after the NLL and ECE."""
        metrics = {"val_loss": float(np.mean(self.losses)), "val_accuracy": float(np.mean(self.hits)),
                   "val_nll": float(np.mean(self.nll)),
                   "val_ece": ece(np.array(self.confidence), np.array(self.hits)), **extra}
        if self.full_hits:
            metrics["val_accuracy_full_views"] = float(np.mean(self.full_hits))
        if self.moved:
            metrics |= {"val_twin_mean_dp": float(np.mean(self.moved)), "val_twin_max_dp": float(np.max(self.moved))}
        return metrics


def apply_temperature(head: JointSchemaHead, temperature: float) -> None:
    """Multiply every logit of ``head`` by ``temperature``, in its own weights: the lexical prior's and the cosine's
    log scales grow by ``log(temperature)`` and the residual scorer's output layer is multiplied by it, so the
    release format is unchanged."""
    shift = math.log(temperature)
    for name in ("prior_logit_scale", "joint_logit_scale"):
        scale = float(getattr(head, name).detach()) + shift
        if scale > math.log(100.0):
            raise ValueError(f"temperature {temperature:.3f} would take {name} past its clamp of 100 "
                             f"(exp({scale:.2f})); the head is too far from calibrated to fix this way")
    with torch.no_grad():
        head.prior_logit_scale.add_(shift)
        head.joint_logit_scale.add_(shift)
        head.residual_scorer[3].weight.mul_(temperature)
        head.residual_scorer[3].bias.mul_(temperature)


def fold_temperature(head: JointSchemaHead, temperature: float, evaluate: Callable[[], dict]) -> dict:
    """Fold ``temperature`` into ``head``'s weights (:func:`apply_temperature`); the validation NLL and ECE before
    and after (``evaluate`` gives :class:`ValidationTally` metrics), for the training log."""
    before = evaluate()
    apply_temperature(head, temperature)
    after = evaluate()
    log.info("temperature %.3f: validation NLL %.4f -> %.4f, ECE %.4f -> %.4f", temperature, before["val_nll"],
             after["val_nll"], before["val_ece"], after["val_ece"])
    return {"temperature": temperature, "val_nll_before": before["val_nll"], "val_nll": after["val_nll"],
            "val_ece_before": before["val_ece"], "val_ece": after["val_ece"]}
