"""The losses of head training: :func:`question_loss` (label-smoothed cross-entropy + Brier, as Clef was trained),
:func:`twin_loss` (symmetric KL between twin questions), :func:`state_mass_loss` (``-log`` of the routing layers'
attention on prefix + state) and :func:`logit_temperature` (the temperature of least validation NLL).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def question_loss(logits: torch.Tensor, gold: torch.Tensor, smoothing: float, brier_weight: float) -> torch.Tensor:
    """Mean over questions of label-smoothed CE + Brier; ``logits`` ``[Q, K]`` with ``-inf`` padding.

    Questions whose gold index is ``-1`` (no label) are left out; with none labelled the loss is 0.
    """
    labelled = gold >= 0
    if not bool(labelled.all()):
        if not bool(labelled.any()):
            return logits.new_zeros(())
        logits, gold = logits[labelled], gold[labelled]
    valid = torch.isfinite(logits)
    log_p = torch.log_softmax(logits, dim=-1).masked_fill(~valid, 0.0)
    count = valid.sum(-1)
    nll = -log_p.gather(1, gold[:, None]).squeeze(1)
    uniform = -log_p.sum(-1) / count
    ce = (1 - smoothing) * nll + smoothing * uniform
    target = F.one_hot(gold, logits.shape[1]).to(logits.dtype)
    brier = ((log_p.exp() * valid - target) ** 2).sum(-1)
    return (ce + brier_weight * brier).mean()


@torch.no_grad()
def logit_temperature(logits: torch.Tensor, target: torch.Tensor) -> float:
    """The temperature ``t`` (0.25…4) of least mean NLL of ``target`` under ``softmax(logits · t)``: golden-section
    search in log ``t`` (``logits`` ``[Q, K]``, ``-inf`` padding; every target labelled)."""

    def nll(log_t: float) -> float:
        return float(F.cross_entropy(logits * math.exp(log_t), target))

    low, high = math.log(0.25), math.log(4.0)
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(40):
        a, b = high - ratio * (high - low), low + ratio * (high - low)
        if nll(a) < nll(b):
            high = b
        else:
            low = a
    return math.exp((low + high) / 2)


def twin_loss(logits: torch.Tensor, rows: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Mean symmetric KL between the option distributions of twin question rows (``-inf`` padding ignored)."""
    if not rows:
        return logits.new_zeros(())
    first = logits[[a for a, _ in rows]]
    second = logits[[b for _, b in rows]]
    valid = torch.isfinite(first)
    log_p = torch.log_softmax(first, -1).masked_fill(~valid, 0.0)
    log_q = torch.log_softmax(second, -1).masked_fill(~valid, 0.0)
    return (0.5 * (log_p.exp() - log_q.exp()) * (log_p - log_q)).sum(-1).mean()


def state_mass_loss(mass: torch.Tensor) -> torch.Tensor:
    """Mean ``-log`` attention mass on prefix + state (0 when every query reads only the state); ``mass``
    ``[options, routing layers]`` (:func:`.state_path.state_logits`)."""
    return -mass.clamp_min(1e-9).log().mean() if mass.numel() else mass.new_zeros(())
