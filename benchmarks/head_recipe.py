"""Compare joint-schema-head recipes on cached backbone hidden states (how the demo model's head was chosen).

    python benchmarks/head_recipe.py --cache /work/demo-build/cpu/work/hidden --out /work/demo-build/cpu/recipes \
        --recipe base:epochs=20 --recipe no-twins:epochs=20,twins=0 --eval-rows 200 --score clef_local/demo/head

Each recipe trains a head with ``train-head``'s :func:`train` on cached training records (BANKING77 / NLU++ / twin
counts may differ per recipe; a shared cache computes each block once) and is scored on cached held-out features:
BANKING77 test (first N rows, one 77-way choice): accuracy, macro-F1, ECE; NLU++ folds 16–19 (first M rows): noul
macro-F1; the robustness requests of ``demo_model.py``: mean / max |Δp| and share within 0.05. Hidden states are
cached in BF16, so scores are within rounding of a real ``decide``; re-measure the chosen head with demo_model.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import torch
from demo_model import robustness_requests, robustness_summary
from safetensors.torch import load_file

import clef_local
from clef_local.data.datasets import Example, banking77_examples, banking77_intents, evenly, nlupp_examples
from clef_local.formats.release import read_head_config, read_json
from clef_local.heads.torch_head import JointSchemaHead
from clef_local.quality.metrics import classification_report, macro_f1
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.common import encode_examples, max_length
from clef_local.training.demo_data import splice_states, training_examples, twin_records
from clef_local.training.hidden_cache import cache_hidden_states
from clef_local.training.train_head import TrainConfig, record_batch, train

DATA_KEYS = {"banking77": 1024, "nlupp": 1024, "twins": 512,  # defaults: what the CPU cache holds first
             "hard": 0, "max_options": 0,  # % of hard-negative choices; choice size cap (0: none, full 77s kept)
             "full": 15}  # % of BANKING77 choices over all 77 intents


def parse_recipe(text: str) -> tuple[str, TrainConfig, dict[str, int]]:
    """``name:key=value,...`` → (name, TrainConfig, data counts); keys are TrainConfig fields or data counts."""
    name, _, body = text.partition(":")
    fields = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    config, data = {}, dict(DATA_KEYS)
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        if key in DATA_KEYS:
            data[key] = int(value)
        elif key in fields:
            kind = fields[key]
            config[key] = (float(value) if kind in ("float", float) else value if kind in ("str", str)
                           else int(value))
        else:
            raise SystemExit(f"recipe {name}: unknown key {key!r}; use {sorted([*fields, *DATA_KEYS])}")
    return name, TrainConfig(**config), data


class HeldOut:
    """Encoded held-out requests with cached hidden states, scored for any head."""

    def __init__(self, backbone: Path, cache: Path, rows: int, nlupp_rows: int, robustness: int):
        tokenizer = ReleaseTokenizer(backbone)
        self.b77 = evenly(banking77_examples("test"), rows)  # the split is sorted by intent: sample across it
        self.nlupp = evenly(nlupp_examples(range(16, 20)), nlupp_rows)
        self.base, self.variants, self.same = robustness_requests(robustness)
        requests = [e.request for e in self.b77 + self.nlupp] + self.base
        requests += [r for name in self.variants for r in self.variants[name]]
        examples = [Example(str(n), r) for n, r in enumerate(requests)]
        self.encoded = [e for e, _ in encode_examples(tokenizer, examples, max_length(backbone))]
        self.hidden = cache_hidden_states(backbone, self.encoded, cache)

    def probabilities(self, head: JointSchemaHead, embedding: torch.Tensor, batch: int = 8) -> list[list[np.ndarray]]:
        head.eval()
        out: list[list[np.ndarray]] = []
        gold = [[0] * len(e.questions) for e in self.encoded]
        with torch.no_grad():
            for start in range(0, len(self.encoded), batch):
                items = list(range(start, min(start + batch, len(self.encoded))))
                states, mask, lexical, layout, _ = record_batch(items, self.encoded, self.hidden, gold, embedding)
                probs = torch.softmax(head(states, mask, lexical, layout), -1).nan_to_num(0.0).numpy()
                row = 0
                for i in items:
                    n = len(self.encoded[i].questions)
                    out.append([p[: len(q.option_ids)] for p, q in zip(probs[row : row + n], self.encoded[i].questions,
                                                                       strict=True)])
                    row += n
        return out

    def score(self, head: JointSchemaHead, embedding: torch.Tensor) -> dict[str, float]:
        probs = self.probabilities(head, embedding)
        order = sorted(banking77_intents())
        b77 = np.stack([p[0] for p in probs[: len(self.b77)]])
        report = classification_report(b77, np.array([order.index(e.labels["intent"]) for e in self.b77]))
        result = {"b77_accuracy": report["accuracy"], "b77_macro_f1": report["macro_f1"], "b77_ece": report["ece"]}
        nlu = probs[len(self.b77) : len(self.b77) + len(self.nlupp)]
        encoded = self.encoded[len(self.b77) : len(self.b77) + len(self.nlupp)]
        pred: dict[str, list[bool]] = {}
        truth: dict[str, list[bool]] = {}
        for example, record, record_probs in zip(self.nlupp, encoded, nlu, strict=True):
            for question, p in zip(record.questions, record_probs, strict=True):
                pred.setdefault(question.question_id, []).append(bool(p[0] >= 0.5))
                truth.setdefault(question.question_id, []).append(bool(example.labels[question.question_id]))
        result["nlupp_macro_f1"] = float(np.mean([macro_f1(pred[k], truth[k], [True]) for k in sorted(pred)]))
        start = len(self.b77) + len(self.nlupp)
        base_probs, start = probs[start : start + len(self.base)], start + len(self.base)
        for name, requests in self.variants.items():
            moved = []
            for n, (request, ref) in enumerate(zip(self.base, base_probs, strict=True)):
                ids = list(request["questions"])
                new_ids = list(requests[n]["questions"])
                new = probs[start + n]
                moved.append(max(float(np.abs(ref[k] - new[new_ids.index(self.same[name][n][qid])]).max())
                                 for k, qid in enumerate(ids)))
            start += len(requests)
            summary = robustness_summary(moved)
            result[f"{name} mean"], result[f"{name} max"] = summary["mean"], summary["max"]
        return result


def _load_head(directory: Path) -> JointSchemaHead:
    head = JointSchemaHead(read_head_config(directory / "joint_head_config.json"))
    head.load_state_dict(load_file(str(directory / "joint_head.safetensors")))
    return head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", type=Path, help="backbone directory (default: the demo release)")
    parser.add_argument("--cache", type=Path, required=True, help="shared hidden-state cache directory")
    parser.add_argument("--out", type=Path, required=True, help="one sub-directory per recipe (head, checkpoint)")
    parser.add_argument("--recipe", action="append", default=[], help="name:key=value,... (repeatable)")
    parser.add_argument("--score", action="append", default=[], type=Path, metavar="HEAD_DIR",
                        help="also score an existing head (a directory with joint_head.*), e.g. clef_local/demo/head")
    parser.add_argument("--eval-rows", type=int, default=200, help="BANKING77 test rows (77-way)")
    parser.add_argument("--nlupp-rows", type=int, default=60, help="NLU++ folds 16-19 rows")
    parser.add_argument("--robustness", type=int, default=100, help="robustness requests (demo_model.py's)")
    parser.add_argument("--init", type=Path, metavar="HEAD_DIR",
                        help="recipes fine-tune this head instead of a fresh one (train-head --init)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    backbone = args.backbone or clef_local.default_model_path()
    held_out = HeldOut(backbone, args.cache, args.eval_rows, args.nlupp_rows, args.robustness)
    from clef_local.backends.torch_backend import TorchBackbone

    embedding = TorchBackbone(backbone, read_json(backbone / "config.json"), device="cpu",
                              dtype=torch.float32).output_embedding.detach()
    results = {}
    for directory in args.score:
        results[directory.name] = held_out.score(_load_head(directory), embedding)
        print(json.dumps({directory.name: results[directory.name]}, indent=1), flush=True)
    for text in args.recipe:
        name, config, data = parse_recipe(text)
        examples = training_examples(data["banking77"], data["nlupp"], hard=data["hard"] / 100,
                                     max_options=data["max_options"] or None, full_share=data["full"] / 100)
        log = train(backbone, examples, args.out / name, work=args.out / name, config=config,
                    twins=twin_records(data["twins"]), cache=args.cache, init=args.init,
                    states=splice_states() if config.spliced else None)
        results[name] = {**data, **log["history"][-1], **held_out.score(_load_head(args.out / name), embedding)}
        print(json.dumps({name: results[name]}, indent=1), flush=True)
    columns = ["b77_accuracy", "b77_macro_f1", "b77_ece", "nlupp_macro_f1", "rename ids mean", "reorder questions mean",
               "add 3 unrelated mean", "add 3 unrelated max"]
    print("\n| recipe | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.3f}" for c in columns) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
