"""How much BANKING77 intent the frozen backbone's state features carry: a linear probe, the head's ceiling estimate.

    python benchmarks/probe_ceiling.py                     # the demo backbone, every row (~3 min of features here)
    python benchmarks/probe_ceiling.py --train-rows 2000 --features /tmp/b77-features.npz

The joint schema head sees the state only through the backbone's hidden states (its memory and the option spans
that attend back to it). This script encodes each BANKING77 row exactly as a request does — the docs/format.md §2
prefix, then ``render(state)`` as its own piece — and takes the final hidden states over the state tokens (the prefix's
keys and values are computed once and reused, so only the state tokens cost anything). A logistic regression on ``[mean,
last]`` of those states, trained on BANKING77 ``train.csv``, is then scored on ``test.csv``: a direct 77-class
classifier with all training rows, so a fair estimate of what a head on this frozen backbone can reach (the head must in
addition read the 77 options from the prompt). Nearest class centroid (cosine) is shown beside.

Features are cached in ``--features`` (npz) so the classifiers can be rerun without the backbone.

``--curve`` adds the probe's learning curve (random subsets of the training rows, C = 0.1): how many labelled rows a
77-way decision on these features needs, to compare with a head trained on as many records.

``--candidate NAME=DIR`` (repeatable; a quantized variant of the same release) feeds the candidate's test features
to the probe trained on the reference's: accuracy, flips of its decision and mean KL(reference‖candidate) show how
much of the decision information a quantized backbone keeps, independently of any trained head.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import clef_local
from clef_local.data.datasets import banking77_intents, banking77_rows, evenly
from clef_local.quality.drift import question_drift
from clef_local.quality.metrics import classification_report
from clef_local.runtime.encoding import PREFIX, render


def state_features(model, texts: list[str], batch_size: int) -> np.ndarray:
    """``[mean, last]`` of the final hidden states over each text's state tokens, after the shared prefix."""
    backend = model.backend
    text_model = backend.backbone.text_model
    prefix_ids, *_ = model.tokenizer.encode_pieces([PREFIX])
    pad = model.tokenizer.pad_token_id
    with torch.inference_mode():
        prefix = text_model(input_ids=torch.tensor([prefix_ids], device=backend.device), use_cache=True)
        cache = prefix.cache
    states = [model.tokenizer.encode_pieces([render(t)])[0] for t in texts]
    order = sorted(range(len(texts)), key=lambda i: len(states[i]))  # similar lengths together: little padding
    out = np.zeros((len(texts), 2 * text_model.config.hidden_size), dtype=np.float32)
    for start in tqdm(range(0, len(order), batch_size), desc="state features", unit="batch"):
        chunk = order[start : start + batch_size]
        width = max(len(states[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), len(prefix_ids) + width), dtype=torch.long)
        mask[:, : len(prefix_ids)] = 1
        for row, i in enumerate(chunk):
            ids[row, : len(states[i])] = torch.tensor(states[i])
            mask[row, len(prefix_ids) : len(prefix_ids) + len(states[i])] = 1
        past = copy.deepcopy(cache)
        past.batch_repeat_interleave(len(chunk))
        positions = torch.arange(len(prefix_ids), len(prefix_ids) + width).expand(len(chunk), -1)
        with torch.inference_mode():
            hidden = text_model(input_ids=ids.to(backend.device), attention_mask=mask.to(backend.device),
                                position_ids=positions.to(backend.device), cache=past,
                                use_cache=True).last_hidden_state.float().cpu()
        for row, i in enumerate(chunk):
            h = hidden[row, : len(states[i])]
            out[i] = torch.cat([h.mean(0), h[-1]]).numpy()
    return out


def check_prefix_reuse(model, text: str) -> float:
    """Max |Δ| between the cached-prefix features and one plain pass over prefix + state (must be float noise)."""
    ids = [t for piece in model.tokenizer.encode_pieces([PREFIX, render(text)]) for t in piece]
    n_prefix = len(model.tokenizer.encode_pieces([PREFIX])[0])
    tensor = torch.tensor([ids], device=model.backend.device)
    hidden = model.backend.hidden_states(tensor, torch.ones_like(tensor))[0, n_prefix:].float().cpu()
    plain = torch.cat([hidden.mean(0), hidden[-1]]).numpy()
    return float(np.abs(plain - state_features(model, [text], 1)[0]).max())


def features(model, path: Path | None, train: list, test: list, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    if path and path.exists():
        cached = np.load(path)
        if len(cached["train"]) == len(train) and len(cached["test"]) == len(test):
            return cached["train"], cached["test"]
    x_train = state_features(model, [t for t, _ in train], batch_size)
    x_test = state_features(model, [t for t, _ in test], batch_size)
    if path:
        np.savez(path, train=x_train, test=x_test)
    return x_train, x_test


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="release directory (default: the demo model)")
    parser.add_argument("--train-rows", type=int, default=None, help="spread over train.csv (default: all 10,003)")
    parser.add_argument("--test-rows", type=int, default=None, help="spread over test.csv (default: all 3,080)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--features", type=Path, default=None, help="npz cache of the features")
    parser.add_argument("--candidate", action="append", default=[], metavar="NAME=DIR",
                        help="a variant whose test features go through the reference's probe (repeatable)")
    parser.add_argument("--curve", action="store_true", help="also print the probe's learning curve")
    args = parser.parse_args()

    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    model = clef_local.load(args.model or clef_local.default_model_path(), dtype="float32")
    train = evenly(banking77_rows("train"), args.train_rows)
    test = evenly(banking77_rows("test"), args.test_rows)
    intents = banking77_intents()
    y_train = np.array([intents.index(i) for _, i in train])
    y_test = np.array([intents.index(i) for _, i in test])
    reuse_error = check_prefix_reuse(model, test[0][0])
    started = time.perf_counter()
    x_train, x_test = features(model, args.features, train, test, args.batch_size)
    encode_s = time.perf_counter() - started

    scaler = StandardScaler().fit(x_train)
    probes = {c: LogisticRegression(C=c, max_iter=3000).fit(scaler.transform(x_train), y_train)
              for c in (0.01, 0.1, 1.0)}
    probs = {c: probe_probs(probe, scaler.transform(x_test), len(intents)) for c, probe in probes.items()}
    reports = {c: classification_report(p, y_test) for c, p in probs.items()}
    unit = x_train / np.linalg.norm(x_train, axis=1, keepdims=True)
    centroids = np.stack([unit[y_train == k].mean(0) for k in range(len(intents))])
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    scores = (x_test / np.linalg.norm(x_test, axis=1, keepdims=True)) @ centroids.T
    nearest = classification_report(np.eye(len(intents))[scores.argmax(1)], y_test)

    print(f"\nfrozen {model.describe()['architecture']} backbone, {len(train)} train / {len(test)} test "
          f"rows, features in {encode_s:.0f} s; cached-prefix vs plain pass max |Δ| {reuse_error:.1e}\n")
    print("| probe on state features | accuracy | macro-F1 | ECE (15 bins) |")
    print("|---|---:|---:|---:|")
    for c, report in reports.items():
        print(f"| logistic regression, C={c} | {report['accuracy']:.3f} | {report['macro_f1']:.3f} "
              f"| {report['ece']:.3f} |")
    # one-hot decisions: no confidence, so no ECE
    print(f"| nearest centroid (cosine) | {nearest['accuracy']:.3f} | {nearest['macro_f1']:.3f} | — |")
    if args.curve:
        learning_curve(x_train, y_train, x_test, y_test, len(intents))
    if args.candidate:
        best = max(reports, key=lambda c: reports[c]["accuracy"])
        compare_candidates(args.candidate, probes[best], scaler, probs[best], x_test, test, y_test,
                           args.batch_size, f"C={best}")


def learning_curve(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray, classes: int,
                   sizes: tuple[int, ...] = (260, 520, 1000, 2000, 5000), seed: int = 0) -> None:
    """Logistic regression (C = 0.1) on random subsets of the training rows, scored on all test rows."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(seed)
    print("\n| training rows (random subset) | rows per intent | accuracy | macro-F1 |")
    print("|---:|---:|---:|---:|")
    for size in (*[s for s in sizes if s < len(x_train)], len(x_train)):
        rows = rng.choice(len(x_train), size, replace=False)
        scaler = StandardScaler().fit(x_train[rows])
        probe = LogisticRegression(C=0.1, max_iter=3000).fit(scaler.transform(x_train[rows]), y_train[rows])
        report = classification_report(probe_probs(probe, scaler.transform(x_test), classes), y_test)
        print(f"| {size:,} | {size / 77:.0f} | {report['accuracy']:.3f} | {report['macro_f1']:.3f} |")


def probe_probs(probe, x: np.ndarray, classes: int) -> np.ndarray:
    probs = np.zeros((len(x), classes))
    probs[:, probe.classes_] = probe.predict_proba(x)
    return probs


def compare_candidates(candidates: list[str], probe, scaler, reference: np.ndarray, x_reference: np.ndarray,
                       test: list, y_test: np.ndarray, batch_size: int, label: str) -> None:
    """The reference-trained probe on each candidate's test features: quality, flips and KL against the reference."""
    print(f"\nthe reference's probe ({label}) on each candidate's test features:\n")
    print("| backbone | accuracy | macro-F1 | ECE | flips vs reference | mean KL(ref‖cand) | feature rel. error |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for spec in candidates:
        name, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"--candidate takes NAME=DIR, got {spec!r}")
        x = state_features(clef_local.load(path, dtype="float32"), [t for t, _ in test], batch_size)
        probs = probe_probs(probe, scaler.transform(x), reference.shape[1])
        report = classification_report(probs, y_test)
        drifts = [question_drift(p, q, "choice") for p, q in zip(reference, probs, strict=True)]
        flips = float(np.mean([d.flipped for d in drifts]))
        kl = float(np.mean([d.kl for d in drifts]))
        error = float(np.median(np.linalg.norm(x - x_reference, axis=1) / np.linalg.norm(x_reference, axis=1)))
        print(f"| {name} | {report['accuracy']:.3f} | {report['macro_f1']:.3f} | {report['ece']:.3f} "
              f"| {flips:.1%} | {kl:.4f} | {error:.3f} |")


if __name__ == "__main__":
    main()
