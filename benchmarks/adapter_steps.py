"""What a step of adapter training costs (train-head --adapters): ms per backbone token, forward + backward, for a
few adapted depths, on the same decision records; and the tokens a record costs up to its last question span.

    python benchmarks/adapter_steps.py --backbone DEMO --layers 4 10 30 --records 16 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from clef_local.runtime.head_reach import question_reach
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.adapter_train import AdapterConfig, AdapterModel
from clef_local.training.common import encode_records, training_records
from clef_local.training.decision_data import decision_data
from clef_local.training.head_losses import question_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", type=Path, required=True)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 10, 30])
    parser.add_argument("--records", type=int, default=16, help="records per step")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per depth (after one warm-up)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    examples, twins = decision_data(400)
    records = training_records(examples, twins)
    encoded, gold = encode_records(ReleaseTokenizer(args.backbone), records, args.backbone)
    reach = [question_reach(e) for e in encoded]
    print(f"records: {len(encoded)}, tokens to the last question span: mean {statistics.mean(reach):.0f}, "
          f"median {statistics.median(reach):.0f}, max {max(reach)} (whole records: mean "
          f"{statistics.mean(len(e.input_ids) for e in encoded):.0f})")
    batch = list(range(args.records))
    tokens = sum(reach[i] for i in batch)
    print("\n| adapted layers | trainable parameters | ms per step | ms per token | tokens per step |")
    print("|---|---|---|---|---|")
    for layers in args.layers:
        model = AdapterModel(args.backbone, replace(AdapterConfig(), adapter_layers=layers), args.device, None)
        params = model.adapter_parameters() + [p for p in model.head.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        target = torch.tensor([g for i in batch for g in gold[i]])
        times = []
        for repeat in range(args.repeats + 1):
            started = time.perf_counter()
            logits, _ = model.forward([encoded[i] for i in batch])
            loss = question_loss(logits, target, 0.05, 1.0)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if repeat:
                times.append(1e3 * (time.perf_counter() - started))
        ms = min(times)
        print(f"| {layers} | {sum(p.numel() for p in model.adapter_parameters()):,} | {ms:.0f} | "
              f"{ms / tokens:.2f} | {tokens} |")


if __name__ == "__main__":
    main()
