"""The demo model's variants in the ecosystem's tools: last hidden states vs clef-local's, float32, on the CPU.

    python benchmarks/ecosystem_parity.py                 # fp8, int8 (transformers) and int4 (mlx-lm)
    python benchmarks/ecosystem_parity.py --out DIR fp8   # keep the exported variants in DIR
    python benchmarks/ecosystem_parity.py int4-compressed-mse int4-compressed-mlx    # pack-quantized int4
    python benchmarks/ecosystem_parity.py --tiny int4-compressed-mlx  # a tiny random Qwen3.5 release instead

fp8 / int8 / int4-compressed-mse, -mlx (int4 in compressed-tensors' pack-quantized layout, ``--int4-layout
compressed``, on the mse / mlx grid): transformers with compressed-tensors (``CompressedTensorsConfig(
dequantize=True)``: the only route that runs on a CPU, docs/quantization.md#what-reads-each-variant); int4:
``mlx_lm.utils.load_model`` cast to float32. Each variant is exported with ``validate=False`` from the demo release
(``--tiny``: ``clef_local.testing.build_tiny_release(backbone="qwen3_5", seed=0)``); the input is 2 × 64 random
token ids. Results in docs/benchmarks.md#variants-in-the-ecosystems-tools.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

# scheme name -> (clef-local scheme, quantize_release options)
VARIANTS = {"fp8": ("fp8", {}), "int8": ("int8", {}), "int4": ("int4", {}),
            "int4-compressed-mse": ("int4", {"int4_layout": "compressed", "int4_grid": "mse"}),
            "int4-compressed-mlx": ("int4", {"int4_layout": "compressed", "int4_grid": "mlx"})}


def reference_hidden_states(path: Path, scheme: str, ids: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    """The other tool's last hidden states of ``ids`` for the variant at ``path``."""
    if scheme == "int4":
        import mlx.core as mx
        from mlx_lm.utils import load_model

        model, _ = load_model(path)
        model.set_dtype(mx.float32)
        return np.array(model.model(mx.array(ids.numpy())).astype(mx.float32))
    import transformers

    architecture = transformers.AutoConfig.from_pretrained(path).architectures[0]
    cls = getattr(transformers, architecture) if architecture.startswith("Qwen3_5") else \
        transformers.AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=torch.float32,
                                quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    inner = getattr(model.model, "language_model", model.model)
    with torch.inference_mode():
        return inner(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()


def main() -> None:
    import clef_local
    from clef_local.demo.default import default_model_path
    from clef_local.export.quantize import quantize_release

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("schemes", nargs="*", default=["fp8", "int8", "int4"], choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, help="where the variants are written (default: a temporary directory)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Qwen3.5 release instead of the demo")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="ecosystem-"))
    root.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        from clef_local.testing import build_tiny_release

        source = root / "tiny-qwen3_5"
        if not source.exists():
            build_tiny_release(source, backbone="qwen3_5", seed=0)
    else:
        source = default_model_path()
    ids = torch.tensor(np.random.default_rng(0).integers(3, 200, (2, 64)) if args.tiny else
                       np.random.default_rng(0).integers(100, 40000, (2, 64)))
    mask = torch.ones_like(ids)
    print("| scheme | read by | max abs Δ | relative to max abs h |\n|---|---|---|---|")
    for name in args.schemes:
        scheme, options = VARIANTS[name]
        out = root / (f"tiny-{name}" if args.tiny else name)
        if not out.exists():
            quantize_release(source, out, scheme, validate=False, log_summary=False, **options)
        model = clef_local.load(out, dtype="float32", backend="torch")
        ours = model.backend.backbone.forward(ids, mask).float().numpy()
        reference = reference_hidden_states(out, name, ids, mask)
        delta = float(np.abs(ours - reference).max())
        tool = "mlx-lm" if name == "int4" else "transformers + compressed-tensors"
        print(f"| {name} | {tool} | {delta:.3g} | {delta / float(np.abs(reference).max()):.3g} |")


if __name__ == "__main__":
    main()
