"""Joint schema head speed: ours (batched) vs Cloudflare's reference (Python loops) on the same hidden states.

    python benchmarks/head_speed.py                  # tiny head and Clef-flash's head shape, CPU float32
    python benchmarks/head_speed.py --device cuda    # the same on a GPU

Both heads get identical weights (ours saved, the reference loaded strictly from our state dict) and identical
random hidden states and output embeddings; the prompt spans come from real encodings of choice requests. Times
are medians of ``--repeats`` runs after one warm-up; "max |Δp|" checks that the numbers agree. A second table puts
the head's share of a whole ``decide`` on a tiny release.
Tables in docs/benchmarks.md#head-speed.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from _timing import median_ms

import clef_local
from clef_local.heads.torch_head import HeadConfig, JointSchemaHead
from clef_local.runtime.encoding import encode_request
from clef_local.runtime.layout import build_layout
from clef_local.runtime.schema import validate_request
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.testing import build_tiny_release, load_reference_oracle

HEADS = {
    "tiny": HeadConfig(hidden_size=64, width=32, routing_layers=1, layers=2, heads=4, feedforward=64),
    # Clef-flash's head (clef_local/planning/configs/clef-flash.joint_head_config.json).
    "clef-flash": HeadConfig(hidden_size=4096, width=1024, routing_layers=2, layers=4, heads=16, feedforward=4096),
}
CASES = [(1, 10), (8, 10), (64, 10), (4, 255)]


def _request(questions: int, options: int) -> dict:
    return {"model": "bench", "state": "The customer writes about a card payment that was charged twice.",
            "questions": {f"q{i}": {"type": "choice", "instructions": f"Question {i}?",
                                    "criteria": {f"o{j}": None for j in range(options)}}
                          for i in range(questions)}}


def _median_ms(fn, repeats: int) -> float:
    return median_ms(fn, repeats, torch.cuda.synchronize if torch.cuda.is_available() else None)


def head_table(tokenizer: ReleaseTokenizer, name: str, config: HeadConfig, device: str, repeats: int) -> None:
    oracle = load_reference_oracle()
    torch.manual_seed(0)
    ours = JointSchemaHead(config).to(device).eval()
    for p in (ours.prior_logit_scale, ours.joint_logit_scale, ours.residual_gate):
        p.data.fill_(0.7)
    reference = oracle.JointSchemaHead(**config.to_json_dict()).to(device).eval()
    reference.load_state_dict(ours.state_dict(), strict=True)
    embedding = torch.randn(tokenizer.vocab_size, config.hidden_size, device=device)
    print(f"\nhead {name} ({sum(p.numel() for p in ours.parameters()) / 1e6:.1f} M params) on {device}, float32")
    print(f"{'questions x options':>20} {'tokens':>7} {'ours ms':>9} {'reference ms':>13} {'speed-up':>9} "
          f"{'max |dp|':>9}")
    for questions, options in CASES:
        encoded = encode_request(tokenizer, validate_request(_request(questions, options)), max_length=1 << 20)
        length = len(encoded.input_ids)
        hidden = torch.randn(1, length, config.hidden_size, device=device)
        mask = torch.ones(1, length, dtype=torch.long, device=device)
        ids = torch.tensor([encoded.input_ids], device=device)
        ref_record = oracle.EncodedRecord(
            input_ids=encoded.input_ids, record_id="bench",
            questions=tuple(oracle.EncodedQuestion(q.question_id, q.question_type, q.question_span, q.option_spans,
                                                   q.option_ids) for q in encoded.questions))

        def run_ours(encoded=encoded, hidden=hidden, mask=mask) -> torch.Tensor:
            layout = build_layout([encoded], hidden.shape[1]).map(lambda a: torch.from_numpy(a).to(device))
            return ours(hidden, mask, embedding.index_select(0, layout.option_token_ids), layout)

        def run_reference(hidden=hidden, ids=ids, mask=mask, record=ref_record) -> list:
            return reference(hidden, ids, mask, [record], embedding)[0]

        with torch.inference_mode():
            ours_ms, ref_ms = _median_ms(run_ours, repeats), _median_ms(run_reference, repeats)
            mine = run_ours().softmax(-1)
            theirs = run_reference()
            worst = max(float((mine[i, : len(t)] - t.softmax(-1)).abs().max()) for i, t in enumerate(theirs))
        print(f"{f'{questions} x {options}':>20} {length:>7} {ours_ms:>9.2f} {ref_ms:>13.2f} "
              f"{ref_ms / ours_ms:>8.1f}x {worst:>9.1e}")


def share_table(path: Path, device: str, repeats: int) -> None:
    model = clef_local.load(path, device=device)
    request = _request(3, 4)
    request["questions"]["q0"] = {"type": "noul", "instructions": "Charged twice?"}
    request["questions"]["q2"] = {"type": "score", "criteria": ["low", "mid", "high"]}
    total = _median_ms(lambda: model.decide(request), repeats)
    encoded = model.encode(request)
    length = len(encoded.input_ids)
    ids = torch.tensor([encoded.input_ids], device=device)
    mask = torch.ones_like(ids)
    hidden = model.backend.backbone.forward(ids, mask)
    backbone = _median_ms(lambda: model.backend.backbone.forward(ids, mask), repeats)

    def head_only() -> torch.Tensor:
        layout = build_layout([encoded], length).map(lambda a: torch.from_numpy(a).to(device))
        return model.backend.head(hidden, mask, model.backend.backbone.lexical_rows(layout.option_token_ids), layout)

    with torch.inference_mode():
        head = _median_ms(head_only, repeats)
    info = model.describe()
    print(f"\n{info['architecture']} ({info['backbone_parameters'] / 1e6:.1f} M params, {info['backbone_dtype']}), "
          f"3-question request, {length} tokens")
    print(f"{'decide total ms':>16} {'backbone ms':>12} {'head ms':>8} {'head share':>11}")
    print(f"{total:>16.2f} {backbone:>12.2f} {head:>8.2f} {100 * head / total:>10.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--heads", nargs="+", choices=list(HEADS), default=list(HEADS))
    parser.add_argument("--release", help="also measure the head's share of a decide on this release")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_release(Path(tmp) / "tiny", seed=0)
        tokenizer = ReleaseTokenizer(path)
        for name in args.heads:
            head_table(tokenizer, name, HEADS[name], args.device, args.repeats)
        share_table(path, args.device, args.repeats)
    if args.release:
        share_table(Path(args.release), args.device, args.repeats)


if __name__ == "__main__":
    main()
