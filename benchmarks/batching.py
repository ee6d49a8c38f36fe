"""What a padded batch buys on this device: 8 requests one at a time vs one padded batch vs the device's budget.

    python benchmarks/batching.py                      # the default model on the CPU, median of 3
    python benchmarks/batching.py --model DIR --device cuda --repeats 5

Two sets of 8 requests from the built-in examples: "equal" (8 × the triage request: no padding at all) and
"mixed" (triage, moderation, routing round-robin: 294–444 tokens on the demo model, a padded batch of them is
22% padding). Each set runs one request at a time, as ONE padded batch (no length bound), and as
``model.predict`` splits it with its device's padding budget (:mod:`clef_local.runtime.batching`). Times are per set.
Table in docs/benchmarks.md#serving (padded batches on a CPU).
"""

from __future__ import annotations

import argparse
import json
from importlib import resources

from _timing import median_ms

import clef_local

EXAMPLES = ("triage", "moderation", "routing")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="release directory (default: the default model)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model = clef_local.load(args.model or clef_local.default_model_path(), device=args.device)
    sync = None
    if str(model.backend.device).startswith("cuda"):
        import torch

        sync = torch.cuda.synchronize
    files = resources.files("clef_local.demo.examples")
    examples = [json.loads(files.joinpath(f"{name}.json").read_text()) for name in EXAMPLES]
    sets = {"equal": [examples[0]] * 8, "mixed": [examples[i % 3] for i in range(8)]}
    budget = model.pad_waste

    def run(requests, waste):
        model.pad_waste = waste
        return lambda: model.predict(requests, batch_size=8)

    print(f"\n{model.describe()['architecture']} on {model.backend.device}, padding budget {budget}×; "
          f"ms per set of 8, median of {args.repeats}\n")
    print("| set | tokens | one at a time | one padded batch | device budget | batch / one | budget / one |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, requests in sets.items():
        tokens = sorted({len(model.encode(r).input_ids) for r in requests})
        alone = median_ms(lambda requests=requests: [model.predict([r]) for r in requests], args.repeats, sync)
        padded = median_ms(run(requests, float("inf")), args.repeats, sync)
        bounded = median_ms(run(requests, budget), args.repeats, sync)
        print(f"| {name} | {', '.join(map(str, tokens))} | {alone:.0f} | {padded:.0f} | {bounded:.0f} "
              f"| {alone / padded:.2f}× | {alone / bounded:.2f}× |")
    model.pad_waste = budget


if __name__ == "__main__":
    main()
