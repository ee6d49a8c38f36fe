"""BANKING77 test, 77-way, all 3,080 rows, for a question-path head in ~2 minutes of CPU (not ~35).

    python benchmarks/question_path_eval.py                                  # the packaged demo head
    python benchmarks/question_path_eval.py --head DIR --cache /tmp/qp-test  # from train-head --method question-path

A head trained with ``clef-local train-head --method question-path`` reads the backbone only through the mean of
each question's span (clef_local/training/question_path.py), and a question's span precedes its options: the
backbone pass can stop there (~95 tokens per row instead of 1,679). The numbers are the head's own —
tests/test_question_path.py checks the shortcut against the full forward — so this is the quick loop for recipes; the
release-level figures come from ``benchmarks/demo_model.py``. A head whose other branches are not zero is refused.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

import clef_local
from clef_local.backends.torch_backend import TorchBackbone
from clef_local.data.datasets import banking77_examples, banking77_intents, evenly
from clef_local.formats.release import read_head_config, read_json
from clef_local.heads.torch_head import JointSchemaHead
from clef_local.quality.metrics import classification_report
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.common import encode_examples, max_length
from clef_local.training.question_path import (
    LexicalTable,
    QuestionBatch,
    question_means,
    question_path_logits,
    zeroed_parameters,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", type=Path, help="directory with joint_head.* (default: the packaged demo head)")
    parser.add_argument("--backbone", type=Path, help="release whose backbone the head reads (default: the demo model)")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/clef-question-path-test"),
                        help="question-span means of the test rows (reused across heads)")
    parser.add_argument("--limit", type=int, help="rows spread over test.csv (default: all 3,080)")
    args = parser.parse_args()
    backbone = args.backbone or clef_local.default_model_path()
    head_dir = args.head or Path(clef_local.__file__).parent / "demo" / "head"
    head = JointSchemaHead(read_head_config(head_dir / "joint_head_config.json"))
    head.load_state_dict(load_file(str(head_dir / "joint_head.safetensors")))
    head.eval()
    state = head.state_dict()
    if live := [n for n in zeroed_parameters(head) if bool(state[n].any())]:
        raise SystemExit(f"{head_dir}: not a question-path head ({live[0]} is not zero); measure it with "
                         "benchmarks/demo_model.py")

    started = time.perf_counter()
    tokenizer = ReleaseTokenizer(backbone)
    examples = evenly(banking77_examples("test"), args.limit)
    encoded = [e for e, _ in encode_examples(tokenizer, examples, max_length(backbone))]
    means = question_means(backbone, encoded, args.cache)
    embedding = TorchBackbone(backbone, read_json(backbone / "config.json"), device="cpu",
                              dtype=torch.float32).output_embedding.detach()  # as train-head reads it
    table = LexicalTable(embedding)
    options = torch.tensor(table.lookup(encoded[0], 0))  # every row asks the same 77 options, sorted by id
    n = len(examples)
    question, slot = torch.arange(n).repeat_interleave(len(options)), torch.arange(len(options)).repeat(n)
    batch = QuestionBatch(torch.from_numpy(np.stack([m[0] for m in means])), torch.ones(n, dtype=torch.long),
                          question, slot, table.tensor()[options], slot, len(options))
    with torch.no_grad():
        probs = torch.softmax(question_path_logits(head, batch), -1).numpy()
    order = sorted(banking77_intents())
    gold = np.array([order.index(e.labels["intent"]) for e in examples])
    report = classification_report(probs, gold)
    print(f"BANKING77 test, 77-way, {n} rows, head {head_dir} ({time.perf_counter() - started:.0f} s)")
    print("| accuracy | macro-F1 | NLL | Brier | ECE (15 bins) | mean confidence |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {report['accuracy']:.3f} | {report['macro_f1']:.3f} | {report['nll']:.3f} | {report['brier']:.3f} | "
          f"{report['ece']:.3f} | {float(probs.max(-1).mean()):.3f} |")


if __name__ == "__main__":
    main()
