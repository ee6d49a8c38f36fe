"""Hidden-state parity of llama.cpp against torch float32, and the demo model's probabilities through both.

    python benchmarks/gguf_parity.py                     # tiny llama, tiny Qwen3.5, the demo model
    python benchmarks/gguf_parity.py --tokens 300 600

Each release is written as an F32 GGUF (``clef_local.export.gguf.convert.write_gguf``) and run through the llamacpp
backend's own context (``LlamaCppContext``, F32 KV cache, flash attention off) on the same token ids as clef-local's
torch backbone in float32: max |Δh| / max |h| per release and length. Then the demo model decides the jevcompat
requests (the conformance suite's ticket with its noul, choice and score questions, together and alone, and its
Hangul/emoji choice: built from jevcompat.checks' constants) through
``--backend llamacpp`` (F32 GGUF, ``dtype="float32"``) and through torch float32: the largest |Δp| over every
option. Table in docs/benchmarks.md#gguf-on-llamacpp.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np


def torch_hidden(release_dir: Path, ids: list[int]) -> np.ndarray:
    import torch

    from clef_local.backends.torch_backend import TorchBackbone
    from clef_local.formats.release import read_release

    release = read_release(release_dir)
    backbone = TorchBackbone(release.path, release.config, dtype=torch.float32, weight_files=release.weight_files)
    with torch.no_grad():
        x = torch.tensor([ids])
        return backbone.forward(x, torch.ones_like(x))[0].float().numpy()


def jevcompat_requests() -> list[dict]:
    """The requests jevcompat's answer checks send (its public constants), as SystemOne bodies."""
    from jevcompat.checks import CHOICE, NOUL, SCORE, TICKET, UNICODE_OPTIONS

    questions = {"refund": NOUL, "team": CHOICE, "frustration": SCORE}
    unicode = {"type": "choice", "instructions": "이 문의는 어떤 유형인가요?", "criteria": dict(UNICODE_OPTIONS)}
    bodies = [{"state": TICKET, "questions": questions},
              *({"state": TICKET, "questions": {k: v}} for k, v in questions.items()),
              {"state": "배송이 3일째 안 와요. 그냥 환불해 주세요 😡", "questions": {"kind": unicode}}]
    return [{"model": "clef-local", **body} for body in bodies]


def gguf_release(source: Path, work: Path) -> Path:
    """An F32 GGUF release of ``source`` (no validation: this benchmark is the comparison)."""
    from clef_local.export.gguf.export import export_gguf

    out = work / f"{source.name}-f32"
    if not out.is_dir():
        export_gguf(source, out, "F32", validate=False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 600])
    parser.add_argument("--work", type=Path, help="a folder for the releases (default: a temporary one)")
    args = parser.parse_args()

    from clef_local.backends.llamacpp_context import LlamaCppContext
    from clef_local.demo.default import default_model_path
    from clef_local.formats.gguf_release import GGUF_PATH
    from clef_local.formats.release import read_release
    from clef_local.testing import build_tiny_release

    work = args.work or Path(tempfile.mkdtemp(prefix="gguf-parity-"))
    sources = {"tiny llama": build_tiny_release(work / "llama", "llama", seed=5) if not (work / "llama").is_dir()
               else work / "llama",
               "tiny Qwen3.5": build_tiny_release(work / "qwen3_5", "qwen3_5", seed=5)
               if not (work / "qwen3_5").is_dir() else work / "qwen3_5",
               "demo (SmolLM2-135M)": default_model_path()}
    print("| release | tokens | max abs Δh | max abs h | relative | llama.cpp s | torch s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for name, source in sources.items():
        release = gguf_release(source, work)
        vocab = int(read_release(source).text_config.get("vocab_size") or 256)
        for n in args.tokens:
            ids = rng.integers(0, vocab, size=n).tolist()
            started = time.perf_counter()
            with LlamaCppContext(release / GGUF_PATH, context=max(n, 64), kv_type="f32") as ctx:
                got = ctx.hidden_states(ids)
            lcpp = time.perf_counter() - started
            started = time.perf_counter()
            want = torch_hidden(source, ids)
            ref = time.perf_counter() - started
            diff = float(np.abs(got - want).max())
            scale = float(np.abs(want).max())
            print(f"| {name} | {n} | {diff:.2e} | {scale:.1f} | {diff / scale:.2e} | {lcpp:.2f} | {ref:.2f} |",
                  flush=True)

    import clef_local

    demo = gguf_release(default_model_path(), work)
    on_llamacpp = clef_local.load(demo, dtype="float32")
    on_torch = clef_local.load(default_model_path(), dtype="float32", backend="torch")
    requests = jevcompat_requests()
    a = on_llamacpp.predict(requests)
    b = on_torch.predict(requests)
    worst = max(float(np.abs(x - y).max()) for p, q in zip(a, b, strict=True)
                for x, y in zip(p.probabilities, q.probabilities, strict=True))
    questions = sum(len(p.probabilities) for p in a)
    print(f"\ndemo on the {len(requests)} jevcompat requests ({questions} questions), llama.cpp F32 GGUF + F32 KV vs "
          f"torch float32: max |Δp| {worst:.2e}")


if __name__ == "__main__":
    main()
