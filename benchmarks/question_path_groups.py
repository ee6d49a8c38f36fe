"""Calibration of question-path heads per question group, on the demo recipe's validation split.

    python benchmarks/question_path_groups.py                                   # the packaged demo head
    python benchmarks/question_path_groups.py --head STAGE1 --head HEAD --cache /tmp/qp-val

Rebuilds the records of ``clef-local train-head --method question-path`` on the demo data with its defaults, cuts the
same validation split (seed 0, 5% of the units: questions no stage of the demo head trained on), computes those
records' question-span means (~2 min here, cached) and prints per group — the evaluation's 77-way prompt, other
wordings over all 77 intents, choices over 2–12 intents, nouls from BANKING77 and from NLU++, scores — accuracy, ECE
(15 bins), NLL, and the logit multiplier of least NLL (1 = calibrated; above 1 = underconfident). This is how the
demo head's calibration fine-tune was chosen (clef_local/demo/head/MODEL_CARD.md).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from scipy.optimize import minimize_scalar

import clef_local
from clef_local.backends.torch_backend import TorchBackbone
from clef_local.data.datasets import banking77_examples, banking77_intents
from clef_local.formats.release import read_head_config, read_json
from clef_local.heads.torch_head import JointSchemaHead
from clef_local.quality.metrics import ece
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.common import encode_examples, max_length
from clef_local.training.demo_data import training_examples, twin_records
from clef_local.training.question_path import LexicalTable, question_means, question_path_logits
from clef_local.training.question_path_train import CLI_DEFAULTS, PathConfig, build_questions, split_units


def _probabilities(logits: np.ndarray, multiplier: float) -> np.ndarray:
    z = logits * multiplier
    z = z - z.max(1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(1, keepdims=True)


def _stats(logits: np.ndarray, gold: np.ndarray, multiplier: float = 1.0) -> tuple[float, float, float]:
    p = _probabilities(logits, multiplier)
    hit = p.argmax(1) == gold
    nll = float(-np.log(np.clip(p[np.arange(len(gold)), gold], 1e-30, None)).mean())
    return nll, ece(p.max(1), hit), float(hit.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", type=Path, action="append", help="joint_head.* directory (repeatable; default: "
                        "the packaged demo head)")
    parser.add_argument("--backbone", type=Path, help="release whose backbone the heads read (default: the demo model)")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/clef-question-path-val"),
                        help="question-span means of the validation records")
    args = parser.parse_args()
    backbone = args.backbone or clef_local.default_model_path()
    heads = args.head or [Path(clef_local.__file__).parent / "demo" / "head"]

    d = CLI_DEFAULTS
    examples = training_examples(d["banking77"], d["nlupp"], hard=0.5, max_options=d["max_options"], full_share=0.0)
    twins = twin_records(d["twins"])
    canonical = banking77_examples("train")
    records = [*examples, *(e for t in twins for e in (t.first, t.second)), *canonical]
    tokenizer = ReleaseTokenizer(backbone)
    pairs = encode_examples(tokenizer, records, max_length(backbone))
    encoded, gold = [e for e, _ in pairs], [g for _, g in pairs]
    table = LexicalTable(TorchBackbone(backbone, read_json(backbone / "config.json"), device="cpu",
                                       dtype=torch.float32).output_embedding.detach())
    split = split_units(tokenizer, encoded, gold, table, banking77_intents(), len(examples), twins,
                        random.Random(PathConfig.seed), validation=0.05)  # train_question_path's defaults
    val, record_of = split.val, split.record_of
    val_records = sorted({record_of(r) for unit in val for r in unit})
    means = dict(zip(val_records, question_means(backbone, [encoded[i] for i in val_records], args.cache),
                     strict=True))
    hidden = next(iter(means.values())).shape[1]
    full = [means.get(i, np.zeros((len(r.questions), hidden), np.float32)) for i, r in enumerate(encoded)]
    questions, _ = build_questions(tokenizer, encoded, gold, full, table, banking77_intents())
    rows = torch.tensor([r for unit in val for r in unit if int(questions.gold[r]) >= 0])

    first_canonical = len(records) - len(canonical)
    kind = questions.types[rows].numpy()
    view = questions.full_view[rows].numpy()
    is_canonical = np.array([record_of(int(r)) >= first_canonical for r in rows])
    nlupp = np.array(["nlupp" in getattr(records[record_of(int(r))], "id", "") for r in rows])
    groups = {"77-way evaluation prompt": (kind == 1) & is_canonical,
              "77-way, other wordings": (kind == 1) & view,
              "choice over 2-12 intents": (kind == 1) & ~view & ~is_canonical,
              "noul, BANKING77": (kind == 0) & ~nlupp, "noul, NLU++": (kind == 0) & nlupp,
              "score": kind == 2, "all": kind >= 0}
    lexical = table.tensor()
    print(f"validation split: {len(val)} units, {len(rows)} labelled questions")
    print("| head | group | questions | accuracy | ECE | NLL | multiplier of least NLL |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for head_dir in heads:
        head = JointSchemaHead(read_head_config(head_dir / "joint_head_config.json"))
        head.load_state_dict(load_file(str(head_dir / "joint_head.safetensors")))
        head.eval()
        with torch.no_grad():
            batch, target = questions.batch(rows, lexical)
            logits = question_path_logits(head, batch).numpy()
        target = target.numpy()
        for name, mask in groups.items():
            group_logits, group_gold = logits[mask], target[mask]
            nll, error, accuracy = _stats(group_logits, group_gold)
            best = minimize_scalar(lambda m, z=group_logits, g=group_gold: _stats(z, g, m)[0],
                                   bounds=(0.2, 5.0), method="bounded").x
            print(f"| {head_dir.name} | {name} | {int(mask.sum())} | {accuracy:.3f} | {error:.3f} | {nll:.3f} | "
                  f"{best:.2f} |")


if __name__ == "__main__":
    main()
