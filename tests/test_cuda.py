"""CUDA checks of the runtime (run by benchmarks/gpu_check.sh on a GPU machine; skipped cleanly without CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from request_gen import varied_requests

import clef_local

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_float32_matches_cpu(tiny_qwen, qwen_model):
    gpu = clef_local.load(tiny_qwen, device="cuda", dtype="float32")
    requests = varied_requests(12, seed=5)
    worst = 0.0
    for cpu_p, gpu_p in zip(qwen_model.predict(requests), gpu.predict(requests), strict=True):
        assert cpu_p.encoded == gpu_p.encoded
        for a, b in zip(cpu_p.probabilities, gpu_p.probabilities, strict=True):
            worst = max(worst, float(np.abs(a - b).max()))
    print(f"max |Δp| cuda float32 vs cpu float32: {worst:.2e}")
    assert worst <= 1e-4


def test_cuda_bf16_backbone_stays_close(tiny_qwen, qwen_model):
    gpu = clef_local.load(tiny_qwen, device="cuda", dtype="bfloat16")
    requests = varied_requests(12, seed=6)
    worst = max(float(np.abs(a - b).max())
                for cpu_p, gpu_p in zip(qwen_model.predict(requests), gpu.predict(requests), strict=True)
                for a, b in zip(cpu_p.probabilities, gpu_p.probabilities, strict=True))
    print(f"max |Δp| cuda bf16 backbone vs cpu float32: {worst:.2e}")
    assert worst <= 0.05
