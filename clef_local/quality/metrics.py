"""Classification and calibration metrics on numpy arrays (no sklearn): accuracy, macro-F1, NLL, Brier, ECE.

Conventions: ``probs`` is ``[n, k]`` (rows sum to 1), ``gold`` the gold class index per row. ECE uses equal-width
confidence bins (15 by default, as in Guo et al. 2017) over the top-class probability.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_EPS = 1e-12
LABEL_DELTAS = ("accuracy", "macro_f1", "nll", "brier", "ece", "adaptive_ece")


def accuracy(pred: Sequence[int] | np.ndarray, gold: Sequence[int] | np.ndarray) -> float:
    pred, gold = np.asarray(pred), np.asarray(gold)
    return float((pred == gold).mean()) if len(gold) else float("nan")


def macro_f1(pred: Sequence, gold: Sequence, labels: Sequence | None = None) -> float:
    """Unweighted mean of per-class F1 over ``labels`` (default: every class seen in gold or pred)."""
    pred, gold = list(pred), list(gold)
    classes = list(labels) if labels is not None else sorted(set(gold) | set(pred), key=str)
    scores = []
    for c in classes:
        tp = sum(p == c and g == c for p, g in zip(pred, gold, strict=True))
        fp = sum(p == c and g != c for p, g in zip(pred, gold, strict=True))
        fn = sum(p != c and g == c for p, g in zip(pred, gold, strict=True))
        scores.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return float(np.mean(scores)) if scores else float("nan")


def nll(probs: np.ndarray, gold: np.ndarray) -> float:
    """Mean negative log-likelihood of the gold class."""
    return float(-np.log(np.clip(probs[np.arange(len(gold)), gold], _EPS, 1.0)).mean())


def brier(probs: np.ndarray, gold: np.ndarray) -> float:
    """Mean over rows of Σ_k (p_k − y_k)² (multi-class Brier; 0 is perfect, 2 the worst)."""
    target = np.zeros_like(probs)
    target[np.arange(len(gold)), gold] = 1.0
    return float(((probs - target) ** 2).sum(-1).mean())


def ece(confidence: np.ndarray, correct: np.ndarray, bins: int = 15) -> float:
    """Expected calibration error: Σ_b |B|/n · |acc(B) − conf(B)| over equal-width confidence bins."""
    confidence, correct = np.asarray(confidence, float), np.asarray(correct, float)
    edges = np.linspace(0.0, 1.0, bins + 1)
    # bin b holds (edges[b], edges[b+1]]; confidence 0 falls into the first bin
    which = np.clip(np.searchsorted(edges, confidence, side="left") - 1, 0, bins - 1)
    total = 0.0
    for b in range(bins):
        members = which == b
        if members.any():
            total += members.mean() * abs(correct[members].mean() - confidence[members].mean())
    return float(total)


def adaptive_ece(confidence: np.ndarray, correct: np.ndarray, bins: int = 15) -> float:
    """ECE with equal-count bins (robust when confidences cluster near 1)."""
    confidence, correct = np.asarray(confidence, float), np.asarray(correct, float)
    order = np.argsort(confidence, kind="stable")
    total = 0.0
    for members in np.array_split(order, bins):
        if len(members):
            total += len(members) / len(order) * abs(correct[members].mean() - confidence[members].mean())
    return float(total)


def classification_report(probs: np.ndarray, gold: np.ndarray, labels: Sequence | None = None,
                          bins: int = 15) -> dict[str, float]:
    """Accuracy, macro-F1, NLL, Brier, ECE and adaptive ECE of ``[n, k]`` probabilities against gold indices."""
    probs, gold = np.asarray(probs, float), np.asarray(gold, int)
    pred = probs.argmax(-1)
    confidence = probs.max(-1)
    correct = pred == gold
    classes = range(probs.shape[1]) if labels is None else labels
    return {
        "n": len(gold),
        "accuracy": accuracy(pred, gold),
        "macro_f1": macro_f1(pred.tolist(), gold.tolist(), list(classes)),
        "nll": nll(probs, gold),
        "brier": brier(probs, gold),
        "ece": ece(confidence, correct, bins),
        "adaptive_ece": adaptive_ece(confidence, correct, bins),
    }


def labelled_report(probs: Sequence[np.ndarray], gold: Sequence[int], options: Sequence[Sequence[str]] | None = None,
                    bins: int = 15) -> dict[str, float]:
    """:func:`classification_report` for questions with different option counts (one vector per question).

    ``gold`` is each question's gold index; ``options`` each question's option ids, so macro-F1 counts classes
    by name (a BANKING77 intent is the same class whichever 8 intents its question offered); without it,
    classes are option indices. Brier sums over each question's own options.
    """
    if len(probs) != len(gold):
        raise ValueError(f"{len(probs)} probability vectors but {len(gold)} gold indices")
    if not len(gold):
        return {"n": 0, **{k: float("nan") for k in ("accuracy", "macro_f1", "nll", "brier", "ece",
                                                       "adaptive_ece", "confidence")}}
    vectors = [np.asarray(p, dtype=float).reshape(-1) for p in probs]
    gold_idx = np.asarray(gold, dtype=int)
    pred = np.array([int(np.argmax(p)) for p in vectors])
    confidence = np.array([float(p.max()) for p in vectors])
    gold_p = np.array([p[g] for p, g in zip(vectors, gold_idx, strict=True)])
    brier_rows = [float(((p - np.eye(len(p))[g]) ** 2).sum()) for p, g in zip(vectors, gold_idx, strict=True)]
    if options is None:
        names_pred, names_gold = pred.tolist(), gold_idx.tolist()
    else:
        names_pred = [str(o[i]) for o, i in zip(options, pred, strict=True)]
        names_gold = [str(o[i]) for o, i in zip(options, gold_idx, strict=True)]
    correct = pred == gold_idx
    return {
        "n": len(gold_idx),
        "accuracy": float(correct.mean()),
        "macro_f1": macro_f1(names_pred, names_gold),
        "nll": float(-np.log(np.clip(gold_p, _EPS, 1.0)).mean()),
        "brier": float(np.mean(brier_rows)),
        "ece": ece(confidence, correct, bins),
        "adaptive_ece": adaptive_ece(confidence, correct, bins),
        "confidence": float(confidence.mean()),
    }


def reliability_bins(confidence: np.ndarray, correct: np.ndarray, bins: int = 15) -> list[tuple[float, float, int]]:
    """``(mean confidence, accuracy, count)`` per non-empty equal-width bin, as :func:`ece` bins them."""
    confidence, correct = np.asarray(confidence, float), np.asarray(correct, float)
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.searchsorted(edges, confidence, side="left") - 1, 0, bins - 1)
    return [(float(confidence[which == b].mean()), float(correct[which == b].mean()), int((which == b).sum()))
            for b in range(bins) if (which == b).any()]
