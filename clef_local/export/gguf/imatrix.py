"""``clef-local export-gguf --imatrix``: an importance matrix from the decision probes' activations, handed to
llama.cpp's quantizer.

What llama.cpp's quantizer reads (``llama_model_quantize_params.imatrix``, include/llama.h of the bundled llama.cpp):
a C array of ``{name, data, size}`` entries ended by a NULL name, one per GGUF weight, ``data`` the mean over tokens
of each input column's squared activation (what ``llama-quantize`` computes from an ``imatrix.gguf``: its
``in_sum2`` divided by its ``counts``). So no ``imatrix.gguf`` file is needed: the means are computed here, with the
torch backbone on calibration requests in the validation probes' shapes drawn from the training splits
(:func:`clef_local.export.gptq_calibration.calibration_requests`, never the probes validation runs), and passed in
memory. A weight whose input columns the converter reorders (Qwen3.5's ``ssm_out``) gets its means reordered the same
way (:attr:`clef_local.export.gguf.convert.TensorPlan.columns`).
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from clef_local.export.staging import ExportError

log = logging.getLogger(__name__)

REQUESTS = 64


@dataclass
class ImportanceMatrix:
    """Per GGUF weight name, the mean squared input activation of each column (float32), and how it was made."""

    values: dict[str, np.ndarray]
    requests: int
    tokens: int
    dtype: str
    seconds: float

    def describe(self) -> dict[str, Any]:
        """The ``imatrix`` entry of gguf_config.json."""
        return {"entries": len(self.values), "requests": self.requests, "tokens": self.tokens, "dtype": self.dtype,
                "data": "calibration requests from the training splits (clef_local.export.gptq_calibration)",
                "seconds": round(self.seconds, 1)}

    def c_array(self) -> tuple[Any, list[Any]]:
        """``(array, keep)``: the NULL-terminated ``llama_model_imatrix_data[]`` for the quantizer, and the Python
        objects its pointers point into (keep them referenced until the quantizer returns)."""
        import llama_cpp

        entry = llama_cpp.llama_model_imatrix_data
        keep: list[Any] = []
        array = (entry * (len(self.values) + 1))()
        for i, (name, values) in enumerate(sorted(self.values.items())):
            data = np.ascontiguousarray(values, dtype=np.float32)
            encoded = name.encode()
            keep += [data, encoded]
            array[i].name = encoded
            array[i].data = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            array[i].size = data.size
        array[len(self.values)].name = None
        return array, keep


def importance_matrix(release: Any, plans: list[Any], *, requests: int = REQUESTS,
                      include_output: bool = False) -> ImportanceMatrix:
    """Run ``requests`` calibration requests through the torch backbone of ``release`` and collect, at every linear
    layer whose weight ``plans`` (the converter's :class:`~clef_local.export.gguf.convert.TensorPlan` list) writes,
    the mean squared input per column; ``include_output`` adds the LM head (``output.weight``) when it is quantized."""
    import torch

    import clef_local
    from clef_local.backends.torch_backend import TorchBackend
    from clef_local.export.gguf.plan import keeps_float32
    from clef_local.export.gptq_calibration import calibration_dtype, calibration_requests

    if requests < 1:
        raise ExportError(f"--imatrix-requests must be at least 1, not {requests}")
    try:
        batch = calibration_requests(requests)
    except FileNotFoundError as exc:
        raise ExportError(f"--imatrix needs the calibration data: {exc}") from None
    # the matrices llama.cpp quantizes and multiplies (not the embedding table: a row lookup; not the F32 ones)
    by_source = {p.source: p for p in plans if not keeps_float32(p.name, p.shape) and p.name != "token_embd.weight"
                 and (include_output or p.name != "output.weight")}
    started = time.perf_counter()
    dtype, why = calibration_dtype(release, "cpu")
    log.info("importance matrix compute dtype: %s", why)
    model = clef_local.load(release, backend="torch", device="cpu", dtype=dtype)
    if not isinstance(model.backend, TorchBackend):
        raise ExportError(f"--imatrix runs the torch backend, not {model.backend.name}")
    backbone = model.backend.backbone
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def accumulate(source: str):
        def hook(module: Any, args: tuple) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).to(torch.float64)
            sums[source] = sums[source] + (x * x).sum(0) if source in sums else (x * x).sum(0)
            counts[source] = counts.get(source, 0) + x.shape[0]
        return hook

    hooks = []
    for name, module in backbone.model.named_modules():
        if isinstance(module, torch.nn.Linear) and f"{name}.weight" in by_source:
            hooks.append(module.register_forward_pre_hook(accumulate(f"{name}.weight")))
    tokens = 0
    try:
        with torch.inference_mode():
            for request in batch:
                ids = torch.tensor([model.encode(request).input_ids])
                tokens += ids.shape[1]
                out = backbone.text_model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
                if include_output:  # the LM head is not part of the text model: its input is the final state
                    backbone.model.get_output_embeddings()(out.last_hidden_state)
    finally:
        for hook in hooks:
            hook.remove()
    missing = sorted(set(by_source) - set(sums))
    if missing:
        raise ExportError(f"--imatrix: {len(missing)} weights never ran on the calibration requests (first: "
                          f"{missing[0]}); the release's modules do not match its weight names")
    values = {}
    for source, plan in by_source.items():
        mean = (sums[source] / counts[source]).to(torch.float32).numpy()
        values[plan.name] = plan.columns(mean) if plan.columns is not None else mean
    seconds = time.perf_counter() - started
    log.info("importance matrix: %d weights from %d requests (%d tokens) in %.0f s", len(values), len(batch), tokens,
             seconds)
    return ImportanceMatrix(values, len(batch), tokens, str(backbone.dtype).removeprefix("torch."), seconds)
