"""Validation of an ONNX export (optimum's habit): the exported graph against the torch backend in float32, per
output (``last_hidden_state``, probabilities, one record alone vs padded in a batch), on the same files and the probe
set. The tolerances (:data:`TOLERANCES`) and why they are relative: docs/hardware.md#onnx-runtime; one exceeded
raises :class:`clef_local.export.validate.ValidationFailed`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from clef_local.quant import registry

log = logging.getLogger(__name__)

VALIDATION = "validation.json"
_FP32 = {"hidden_rel": 1e-4, "max_abs_dp": 1e-3, "batch_rel": 1e-4}
# a MatMulNBits variant is held to fp32's tolerances: the graph computes the torch module's dequantized weights exactly
TOLERANCES: dict[str, dict[str, float]] = {
    "fp32": _FP32,
    **{name: dict(_FP32) for name in registry.by_precision() if registry.get(name).onnx_nbits},
    "fp16": {"hidden_rel": 1e-2, "max_abs_dp": 2e-2, "batch_rel": 1e-2},
}


def _masked_rel(ref: np.ndarray, var: np.ndarray, mask: np.ndarray) -> tuple[float, float]:
    real = mask.astype(bool)
    return float(np.abs(ref[real] - var[real]).max()), float(np.abs(ref[real]).max())


def run_parity(directory: Path, requests: list[dict[str, Any]], batch_size: int = 8) -> dict[str, Any]:
    """Hidden states and probabilities of the ONNX backend vs the torch backend (float32) on ``requests``."""
    import torch
    from tqdm import tqdm

    import clef_local
    from clef_local.backends.onnx_backend import OnnxBackend
    from clef_local.backends.torch_backend import TorchBackend
    from clef_local.export.validate import compare
    from clef_local.runtime.answers import softmax_rows
    from clef_local.runtime.layout import build_layout

    ref_model = clef_local.load(directory, backend="torch", dtype="float32")
    onnx_model = clef_local.load(directory, backend="onnx")
    torch_backend, onnx_backend = ref_model.backend, onnx_model.backend
    if not isinstance(torch_backend, TorchBackend) or not isinstance(onnx_backend, OnnxBackend):
        raise TypeError(f"expected the torch and onnx backends, got {torch_backend.name} and {onnx_backend.name}")
    encoded = [ref_model.encode(r, truncate_state=True) for r in requests]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].input_ids))
    pad = ref_model.tokenizer.pad_token_id
    hidden_diff = hidden_scale = 0.0
    ref_probs: list[list[np.ndarray]] = []
    var_probs: list[list[np.ndarray]] = []
    with tqdm(total=len(order), unit="probe", desc="validating", disable=None) as bar:
        for start in range(0, len(order), batch_size):
            records = [encoded[i] for i in order[start : start + batch_size]]
            layout = build_layout(records, max(len(r.input_ids) for r in records))
            ids, mask = _collate(records, pad)
            with torch.inference_mode():
                ref_h = torch_backend.backbone.forward(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
                ref_logits = torch_backend.logits(records, layout, pad)
            var_h = onnx_backend.hidden_states(ids, mask)
            diff, scale = _masked_rel(ref_h, var_h, mask)
            hidden_diff, hidden_scale = max(hidden_diff, diff), max(hidden_scale, scale)
            var_logits = onnx_backend.logits(records, layout, pad)
            for logits, sink in ((ref_logits, ref_probs), (var_logits, var_probs)):
                probs = softmax_rows(logits)
                row = 0
                for record in records:
                    sink.append([probs[row + q, : len(question.option_ids)]
                                 for q, question in enumerate(record.questions)])
                    row += len(record.questions)
            bar.update(len(records))
    # one record alone vs the same record padded among three (ONNX only): the batch axis is really dynamic
    trio = [encoded[order[0]], encoded[order[len(order) // 2]], encoded[order[-1]]]
    ids, mask = _collate(trio, pad)
    together = onnx_backend.hidden_states(ids, mask)
    alone_ids, alone_mask = _collate(trio[:1], pad)
    alone = onnx_backend.hidden_states(alone_ids, alone_mask)
    length = alone.shape[1]
    batch_diff, batch_scale = _masked_rel(alone[0], together[0, :length], alone_mask[0])
    metrics = compare(ref_probs, var_probs)
    return {"hidden_max_abs": hidden_diff, "hidden_rel": hidden_diff / max(hidden_scale, 1e-30),
            "batch_max_abs": batch_diff, "batch_rel": batch_diff / max(batch_scale, 1e-30),
            "max_abs_dp": metrics["max_abs_dp"], "mean_kl": metrics["mean_kl"], "flips": metrics["flips"],
            "questions": metrics["questions"], "requests": len(requests)}


def _collate(records: list[Any], pad: int) -> tuple[np.ndarray, np.ndarray]:
    from clef_local.runtime.layout import pad_batch

    return pad_batch(records, pad)


def checks(result: Mapping[str, Any], tolerances: Mapping[str, float]) -> list[dict[str, Any]]:
    """One row per output: output, metric, value, tolerance (None: reported), ok."""
    rows = [("last_hidden_state", "hidden_rel"), ("last_hidden_state", "hidden_max_abs"),
            ("probabilities", "max_abs_dp"), ("probabilities", "mean_kl"), ("probabilities", "flips"),
            ("batch 1 vs 3", "batch_rel")]
    out = []
    for output, metric in rows:
        limit = tolerances.get(metric)
        value = result[metric]
        out.append({"output": output, "metric": metric, "value": value, "tolerance": limit,
                    "ok": limit is None or (np.isfinite(value) and value <= limit)})
    return out


def parity_requests(n: int = 64, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` short packaged probes (``probe_requests``): ONNX's check is numerical parity, for which the long states
    and images of quantize's probe set would only cost time; ValidationUnavailable when they cannot be read."""
    from clef_local.data.datasets import packaged_datasets_dir
    from clef_local.data.probes import probe_requests
    from clef_local.export.validate import ValidationUnavailable

    try:
        return probe_requests(n, seed, root=packaged_datasets_dir())
    except (FileNotFoundError, OSError, ValueError) as exc:
        raise ValidationUnavailable(f"the packaged probe set cannot be read ({exc})") from exc


def validate_onnx(directory: Path, fmt: str, n: int = 64, seed: int = 0) -> dict[str, Any]:
    """Run :func:`run_parity` on :func:`parity_requests`, write ``onnx/validation.json``, raise
    ``ValidationFailed`` when a tolerance is exceeded and ``ValidationUnavailable`` when the probe set cannot be read
    (never a silent skip: ``--no-validate`` is the way to export without validating)."""
    from clef_local.export.validate import ValidationFailed

    started = time.perf_counter()
    target = directory / "onnx" / VALIDATION
    requests = parity_requests(n, seed)
    result = run_parity(directory, requests)
    rows = checks(result, TOLERANCES[fmt])
    failed = [f"{r['output']} {r['metric']} {r['value']:.6g} > {r['tolerance']:g}" for r in rows if not r["ok"]]
    result.update(format=fmt, tolerances=TOLERANCES[fmt], checks=rows, passed=not failed, failed=failed,
                  seconds=round(time.perf_counter() - started, 2))
    target.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    for row in rows:
        log.info("onnx validation %s %-17s %-14s %.6g", "✓" if row["ok"] else "✗", row["output"], row["metric"],
                 row["value"])
    if failed:
        raise ValidationFailed(f"ONNX export ({fmt}) fails validation against the torch backend: " + ", ".join(failed))
    return result


def validation_table(result: Mapping[str, Any]) -> Any:
    """A rich Table: output, metric, value, tolerance, ✓/✗."""
    from rich.table import Table

    table = Table(title=f"ONNX vs torch: {result['requests']} requests, {result['questions']} questions",
                  caption=f"{result['flips']} flipped decisions")
    for column in ("output", "metric", "value", "tolerance", ""):
        table.add_column(column, justify="right" if column in ("value", "tolerance") else "left")
    for row in result["checks"]:
        mark = "[green]✓[/green]" if row["ok"] else "[red]✗[/red]"
        tol = "reported" if row["tolerance"] is None else f"≤ {row['tolerance']:g}"
        table.add_row(row["output"], row["metric"], f"{row['value']:.3g}", tol, mark)
    return table
