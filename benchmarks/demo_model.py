"""The demo model's quality, robustness and speed (the figures of its model card), one table per section.

    python benchmarks/demo_model.py                              # every section on the default model (CPU)
    python benchmarks/demo_model.py --sections banking77 nlupp --device cuda --json metrics.json

- banking77: BANKING77 test, one choice over all 77 intents per row: accuracy, macro-F1, NLL, Brier, ECE (15 bins).
- nlupp: NLU++ banking folds 16–19, a noul per ontology intent: macro-F1 over intents (threshold 0.5) and ECE.
- robustness: 100 held-out mixed requests; renaming question ids, reordering questions, or adding three unrelated
  questions must move no probability by more than 0.05.
- ordinal: the held-out severity ladders (clef_local/data/cases, 8 situations x 4 rising severities) asked a
  severity score at 3, 5 and 10 levels: Spearman of the expected level against the true rank (pooled), and the share
  of ladders whose expected level rises at every step.
- negation: a noul and its negation asked of the same held-out state in separate requests (NLU++ folds 16-19,
  BANKING77 test): mean and max |p + p_neg - 1|.
- speed: a 3-question request with a one-sentence state (median of 20) and the 77-option request.
- generation: the same backbone answering the same 3 questions by generating JSON (greedy) vs one decide pass.
Tables in docs/benchmarks.md#the-demo-models-heads and clef_local/demo/head/MODEL_CARD.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import numpy as np
from _timing import median_ms

import clef_local
from clef_local.data.datasets import (
    banking77_examples,
    banking77_intents,
    banking77_rows,
    evenly,
    intent_description,
    nlupp_examples,
    nlupp_intents,
    nlupp_rows,
)
from clef_local.data.sources import severity_ladders
from clef_local.quality.metrics import classification_report, ece, macro_f1

THREE = {
    "complaint": {"type": "noul", "instructions": "Is the customer complaining about something that went wrong?"},
    "topic": {"type": "choice", "instructions": "Which area does the message concern?",
              "criteria": {"cards": "Cards and card payments", "transfers": "Transfers and top-ups",
                           "account": "Account, identity and security"}},
    "urgency": {"type": "score", "instructions": "How urgent is the message?",
                "criteria": ["not urgent", "somewhat urgent", "very urgent"]},
}


def section_banking77(model, limit: int | None) -> dict[str, Any]:
    examples = evenly(banking77_examples("test"), limit)  # the split is sorted by intent: sample across it
    order = sorted(banking77_intents())  # choice options are sorted by id in the prompt
    predictions = model.predict([e.request for e in examples], batch_size=8)
    probs = np.stack([p.probabilities[0] for p in predictions])
    gold = np.array([order.index(e.labels["intent"]) for e in examples])
    report = classification_report(probs, gold)
    report["tokens_per_request"] = float(np.mean([len(p.encoded.input_ids) for p in predictions]))
    return report


def section_nlupp(model, limit: int | None) -> dict[str, Any]:
    examples = evenly(nlupp_examples(range(16, 20)), limit)
    predictions = model.predict([e.request for e in examples], batch_size=16)
    p_true, truth, intents = [], [], []
    for example, prediction in zip(examples, predictions, strict=True):
        for question, probs in zip(prediction.encoded.questions, prediction.probabilities, strict=True):
            p_true.append(float(probs[0]))  # noul options are (true, false)
            truth.append(bool(example.labels[question.question_id]))
            intents.append(question.question_id)
    p, y = np.array(p_true), np.array(truth)
    pred = p >= 0.5
    per_intent = [macro_f1(pred[[i == name for i in intents]].tolist(), y[[i == name for i in intents]].tolist(),
                           [True]) for name in sorted(set(intents))]
    return {"questions": len(p), "intents": len(per_intent), "macro_f1": float(np.mean(per_intent)),
            "accuracy": float((pred == y).mean()), "ece": ece(np.maximum(p, 1 - p), pred == y),
            "positive_rate": float(y.mean())}


def _mixed(text: str, rng: random.Random, intents: list[str], gold: str) -> dict[str, Any]:
    options = [gold, *rng.sample([i for i in intents if i != gold], 7)]
    return {"model": "clef-demo", "state": text, "questions": {
        "intent": {"type": "choice", "criteria": {i: None for i in options}},
        "is_card": {"type": "noul", "instructions": "Is the customer asking about their card?"},
        "urgency": THREE["urgency"]}}


def robustness_requests(n: int = 100) -> tuple[list[dict], dict[str, list[dict]], dict[str, list[dict[str, str]]]]:
    """``n`` held-out mixed requests, their three perturbations, and per perturbation the question-id maps."""
    rng = random.Random(7)
    intents = list(banking77_intents())
    rows = banking77_rows("test")
    rng.shuffle(rows)
    base = [_mixed(text, rng, intents, gold) for text, gold in rows[:n]]
    unrelated = {"weather": {"type": "noul", "instructions": "Does the message mention the weather?"},
                 "language": {"type": "choice", "criteria": {"english": None, "french": None, "german": None}},
                 "length": {"type": "score", "criteria": ["short", "medium", "long"]}}
    renamed = [{k: f"q_{k}_{i}" for i, k in enumerate(r["questions"])} for r in base]
    variants = {
        "rename ids": [{**r, "questions": {names[k]: v for k, v in r["questions"].items()}}
                       for r, names in zip(base, renamed, strict=True)],
        "reorder questions": [{**r, "questions": dict(reversed(r["questions"].items()))} for r in base],
        "add 3 unrelated": [{**r, "questions": {**unrelated, **r["questions"]}} for r in base],
    }
    same = {"rename ids": renamed, "reorder questions": [{k: k for k in r["questions"]} for r in base],
            "add 3 unrelated": [{k: k for k in r["questions"]} for r in base]}
    return base, variants, same


def robustness_summary(moved: list[float]) -> dict[str, float]:
    """Max, mean and share within 0.05 of the per-request largest probability move."""
    return {"max": float(np.max(moved)), "mean": float(np.mean(moved)),
            "within_0.05": float(np.mean(np.array(moved) <= 0.05))}


def section_robustness(model, n: int = 100) -> dict[str, Any]:
    """Per perturbation, the summary of each request's largest move, and each question's mean move (which moves)."""
    base, variants, same = robustness_requests(n)
    reference = model.decide_batch(base)
    results = {}
    for name, requests in variants.items():
        moves = [{k: _max_delta(ref["answers"][k], new["answers"][names[k]]) for k in ref["answers"]}
                 for ref, new, names in zip(reference, model.decide_batch(requests), same[name], strict=True)]
        results[name] = {**robustness_summary([max(m.values()) for m in moves]),
                         "mean_by_question": {k: float(np.mean([m[k] for m in moves])) for k in moves[0]},
                         "max_by_question": {k: float(np.max([m[k] for m in moves])) for k in moves[0]}}
    return results


ORDINAL_LEVELS = {3: ["minor", "significant", "critical"], 5: ["negligible", "low", "medium", "high", "critical"],
                  10: [str(n) for n in range(1, 11)]}
ORDINAL_QUESTION = "Rate how critical this support case is."  # not a wording of the training data


def _ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(len(values))
    for value in np.unique(values):  # ties share their mean rank
        ranks[values == value] = ranks[values == value].mean()
    return ranks


def spearman(a: Any, b: Any) -> float:
    ra, rb = _ranks(np.asarray(a, dtype=float)), _ranks(np.asarray(b, dtype=float))
    return float(np.corrcoef(ra, rb)[0, 1])


def section_ordinal(model) -> dict[str, Any]:
    """The held-out severity ladders: does a score's expected level rise with the case's severity?"""
    ladders = severity_ladders("heldout")
    out: dict[str, Any] = {"cases": sum(len(lad.levels) for lad in ladders)}
    for count, levels in ORDINAL_LEVELS.items():
        requests = [{"model": "clef-demo", "state": text, "questions": {"severity": {
            "type": "score", "instructions": ORDINAL_QUESTION, "criteria": levels}}}
            for ladder in ladders for text in ladder.levels]
        expected = [a["answers"]["severity"]["score"] / (count - 1) for a in model.decide_batch(requests)]
        truth = [rank for ladder in ladders for rank in range(len(ladder.levels))]
        per_ladder = np.array(expected).reshape(len(ladders), -1)
        out[f"levels_{count}"] = {"spearman": spearman(truth, expected),
                                  "rising_ladders": float(np.mean([np.all(np.diff(r) > 0) for r in per_ladder])),
                                  "mean_expected_by_rank": per_ladder.mean(0).round(3).tolist()}
    return out


def negation_pairs(n: int = 60) -> list[tuple[dict, dict]]:
    """(request, its negated twin) over held-out states: NLU++ folds 16-19 and BANKING77 test rows."""
    rng = random.Random(11)
    intents = nlupp_intents()
    pairs = []
    for text, _ in evenly(nlupp_rows(range(16, 20)), n):
        name = rng.choice([k for k, v in intents.items() if v.startswith("is the intent ")])
        question = intents[name]
        negated = "is the intent not " + question.removeprefix("is the intent ")
        pairs.append(({"model": "clef-demo", "state": text, "questions": {"q": {"type": "noul",
                                                                             "instructions": question}}},
                      {"model": "clef-demo", "state": text, "questions": {"q": {"type": "noul",
                                                                             "instructions": negated}}}))
    b77 = banking77_intents()
    for text, gold in evenly(banking77_rows("test"), n):
        intent = gold if rng.random() < 0.5 else rng.choice(b77)
        about = intent_description(intent)
        pairs.append(({"model": "clef-demo", "state": text, "questions": {"q": {
            "type": "noul", "instructions": f"Is the customer asking about {about}?"}}},
                      {"model": "clef-demo", "state": text, "questions": {"q": {
                          "type": "noul", "instructions": f"Is the customer not asking about {about}?"}}}))
    return pairs


def section_negation(model) -> dict[str, Any]:
    pairs = negation_pairs()
    plain = model.decide_batch([p for p, _ in pairs])
    negated = model.decide_batch([q for _, q in pairs])
    gap = np.array([abs(a["answers"]["q"]["noul"] + b["answers"]["q"]["noul"] - 1)
                    for a, b in zip(plain, negated, strict=True)])
    return {"pairs": len(pairs), "mean_abs_p_plus_pneg_minus_1": float(gap.mean()), "max": float(gap.max()),
            "nlupp_mean": float(gap[: len(gap) // 2].mean()), "banking77_mean": float(gap[len(gap) // 2 :].mean())}


def _max_delta(a: dict, b: dict) -> float:
    if a["type"] == "noul":
        return abs(a["noul"] - b["noul"])
    return max(abs(a["probabilities"][k] - b["probabilities"][k]) for k in a["probabilities"])


def section_speed(model) -> dict[str, Any]:
    three = {"model": "clef-demo", "state": "My card payment was declined twice at the supermarket today.",
             "questions": THREE}
    full = banking77_examples("test", limit=1)[0].request
    return {"three_questions_ms": median_ms(lambda: model.decide(three), 20),
            "three_questions_tokens": model.decide(three)["usage"]["input_tokens"],
            "banking77_77_options_ms": median_ms(lambda: model.decide(full), 5),
            "banking77_77_options_tokens": model.decide(full)["usage"]["input_tokens"]}


def _generation_prompt(text: str) -> str:
    lines = [f"Message: {text}", "", "Answer these questions about the message as one JSON object:"]
    lines.append('- "complaint": true or false (is the customer complaining about something that went wrong?)')
    lines.append('- "topic": one of "cards", "transfers", "account"')
    lines.append('- "urgency": one of "not urgent", "somewhat urgent", "very urgent"')
    lines.append("Reply with the JSON object only.")
    return "\n".join(lines)


def _valid(text: str) -> tuple[bool, bool]:
    """(parses as a JSON object with the three keys, every answer is an allowed option)."""
    start, end = text.find("{"), text.rfind("}")
    try:
        value = json.loads(text[start : end + 1]) if start >= 0 else None
    except json.JSONDecodeError:
        return False, False
    if not isinstance(value, dict) or set(value) != {"complaint", "topic", "urgency"}:
        return False, False
    allowed = (isinstance(value["complaint"], bool) and value["topic"] in THREE["topic"]["criteria"]
               and value["urgency"] in THREE["urgency"]["criteria"])
    return True, allowed


def section_generation(model, n: int = 20) -> dict[str, Any]:
    import torch

    backbone = model.backend.backbone
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.path)
    texts = [t for t, _ in banking77_rows("test")[:n]]
    gen_ms, dec_ms, parsed, allowed = [], [], 0, 0
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": _generation_prompt(text)}],
                                            add_generation_prompt=True, return_tensors="pt", return_dict=True)
        started = time.perf_counter()
        with torch.inference_mode():
            out = backbone.model.generate(**ids, max_new_tokens=80, do_sample=False,
                                          pad_token_id=tokenizer.pad_token_id)
        gen_ms.append(1e3 * (time.perf_counter() - started))
        ok, good = _valid(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
        parsed += ok
        allowed += good
        request = {"model": "clef-demo", "state": text, "questions": THREE}
        started = time.perf_counter()
        model.decide(request)
        dec_ms.append(1e3 * (time.perf_counter() - started))
    return {"requests": n, "generate_median_ms": statistics.median(gen_ms), "decide_median_ms":
            statistics.median(dec_ms), "ratio": statistics.median(gen_ms) / statistics.median(dec_ms),
            "json_parse_failures": 1 - parsed / n, "invalid_or_unparsed": 1 - allowed / n}


SECTIONS = {"banking77": section_banking77, "nlupp": section_nlupp, "robustness": section_robustness,
            "ordinal": section_ordinal, "negation": section_negation, "speed": section_speed,
            "generation": section_generation}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="release directory (default: the demo model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--limit", type=int, help="rows per dataset section (default: all)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    model = clef_local.load(args.model or clef_local.default_model_path(), device=args.device, dtype=args.dtype)
    results: dict[str, Any] = {"model": str(model.path), "device": args.device, "dtype": args.dtype}
    for name in args.sections:
        started = time.perf_counter()
        kwargs = {"limit": args.limit} if name in ("banking77", "nlupp") else {}
        results[name] = SECTIONS[name](model, **kwargs)
        print(f"\n{name} ({time.perf_counter() - started:.0f} s)")
        for key, value in _flatten(results[name]).items():
            print(f"  {key:<40} {value:.4f}" if isinstance(value, float) else f"  {key:<40} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def _flatten(value: dict, prefix: str = "") -> dict:
    out = {}
    for key, item in value.items():
        if isinstance(item, dict):
            out.update(_flatten(item, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = item
    return out


if __name__ == "__main__":
    main()
