"""The demo model's quality, robustness and speed (the figures of its model card), one table per section.

    python benchmarks/demo_model.py                              # every section on the default model (CPU)
    python benchmarks/demo_model.py --sections banking77 nlupp --device cuda --json metrics.json

- banking77: BANKING77 test, one choice over all 77 intents per row: accuracy, macro-F1, NLL, Brier, ECE (15 bins).
- nlupp: NLU++ banking folds 16–19, a noul per ontology intent: macro-F1 over intents (threshold 0.5) and ECE.
- robustness: 100 held-out mixed requests; renaming question ids, reordering questions, or adding three unrelated
  questions must move no probability by more than 0.05.
- speed: a 3-question request with a one-sentence state (median of 20) and the 77-option request.
- generation: the same backbone answering the same 3 questions by generating JSON (greedy) vs one decide pass.
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
from clef_local.data.datasets import banking77_examples, banking77_intents, banking77_rows, evenly, nlupp_examples
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
                         "mean_by_question": {k: float(np.mean([m[k] for m in moves])) for k in moves[0]}}
    return results


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
            "speed": section_speed, "generation": section_generation}


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
