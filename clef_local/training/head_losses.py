"""The losses of head training: per-question supervision, twin consistency, and a prior on where evidence lies.

- :func:`question_loss`: label-smoothed cross-entropy + Brier per question, as Clef was trained.
- :func:`twin_loss`: symmetric KL between the answers of twin questions (renamed, reordered, in other company).
- :class:`StateAttention`: ``-log`` of the cross-attention mass the head puts on the state's tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from clef_local.heads.torch_head import JointSchemaHead
from clef_local.runtime.encoding import EncodedRecord


def question_loss(logits: torch.Tensor, gold: torch.Tensor, smoothing: float, brier_weight: float,
                  weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over questions of label-smoothed CE + Brier; ``logits`` ``[Q, K]`` with ``-inf`` padding.

    Questions whose gold index is ``-1`` (no label) are left out; with none labelled the loss is 0. ``weights``
    ``[Q]`` makes it a weighted mean (a question of weight 3 counts as three).
    """
    labelled = gold >= 0
    if not bool(labelled.all()):
        if not bool(labelled.any()):
            return logits.new_zeros(())
        logits, gold = logits[labelled], gold[labelled]
        weights = None if weights is None else weights[labelled]
    valid = torch.isfinite(logits)
    log_p = torch.log_softmax(logits, dim=-1).masked_fill(~valid, 0.0)
    count = valid.sum(-1)
    nll = -log_p.gather(1, gold[:, None]).squeeze(1)
    uniform = -log_p.sum(-1) / count
    ce = (1 - smoothing) * nll + smoothing * uniform
    target = F.one_hot(gold, logits.shape[1]).to(logits.dtype)
    brier = ((log_p.exp() * valid - target) ** 2).sum(-1)
    per_question = ce + brier_weight * brier
    if weights is None:
        return per_question.mean()
    weights = weights.to(per_question.dtype)
    return (per_question * weights).sum() / weights.sum()


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


class StateAttention:
    """Training-only: ``-log`` of the cross-attention mass that the head's routing and field layers put on the
    state's tokens, averaged over heads and queries.

    Forward hooks on the head's cross-attention modules recompute their attention logits (the modules run with
    ``need_weights=False``); :meth:`loss` reads what the last forward saw. Set :attr:`state_mask` (``[B, T]``,
    true on state tokens) before each forward.
    """

    def __init__(self, head: JointSchemaHead) -> None:
        self.state_mask: torch.Tensor | None = None
        self.terms: list[torch.Tensor] = []
        modules = [layer.attention for layer in head.evidence_layers] + [layer.multihead_attn for layer in head.layers]
        self.handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m in modules]

    def _hook(self, module: torch.nn.MultiheadAttention, args, kwargs, output) -> None:
        if self.state_mask is None:
            return
        query, key = args[0], args[1]
        width, heads = module.embed_dim, module.num_heads
        q = F.linear(query, module.in_proj_weight[:width], module.in_proj_bias[:width])
        k = F.linear(key, module.in_proj_weight[width : 2 * width], module.in_proj_bias[width : 2 * width])
        q = q.unflatten(-1, (heads, -1)).transpose(1, 2)  # [B, h, Q, d]
        k = k.unflatten(-1, (heads, -1)).transpose(1, 2)  # [B, h, T, d]
        logits = q @ k.transpose(-1, -2) / math.sqrt(width // heads)
        pad = kwargs.get("key_padding_mask")
        if pad is not None:
            logits = logits.masked_fill(pad[:, None, None, :], float("-inf"))
        log_attention = torch.log_softmax(logits, dim=-1)
        on_state = log_attention.masked_fill(~self.state_mask[:, None, None, :], float("-inf")).logsumexp(-1)
        mass = on_state.exp().mean(1)  # [B, Q]: heads may split the work, the query's mass is what counts
        self.terms.append(-torch.log(mass.clamp_min(1e-6)).mean())

    def loss(self) -> torch.Tensor:
        """The mean term of the forward since the last call."""
        terms, self.terms = self.terms, []
        return torch.stack(terms).mean()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def state_mask(records: Sequence[EncodedRecord], length: int) -> torch.Tensor:
    """``[B, length]``, true on each record's state tokens."""
    mask = torch.zeros(len(records), length, dtype=torch.bool)
    for row, record in enumerate(records):
        mask[row, record.state_start : record.state_start + record.state_tokens] = True
    return mask
