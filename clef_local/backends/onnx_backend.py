"""The ONNX Runtime backend: the exported text model (``onnx/model.onnx``) and the joint schema head in numpy.

Imports neither torch nor safetensors, so an exported release decides where PyTorch is not installed. A provider
that is not available is an :class:`OnnxProviderError`, never a silent CPU fallback; sessions take the
:func:`~clef_local.planning.hardware.thread_plan` threads (:func:`session_options`). docs/hardware.md#onnx-runtime.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clef_local.errors import ClefError, ReleaseError
from clef_local.formats.release import Release, read_json
from clef_local.formats.safetensors import bf16_to_float32
from clef_local.heads.numpy_head import load_head
from clef_local.planning.hardware import ThreadPlan, thread_plan
from clef_local.runtime.layout import pad_batch
from clef_local.runtime.state_cache import model_identity

if TYPE_CHECKING:
    from clef_local.planning.choice import LoadDecision
    from clef_local.planning.prefill import PrefillBudget
    from clef_local.runtime.encoding import EncodedRecord
    from clef_local.runtime.layout import HeadLayout
    from clef_local.runtime.state_cache import StateCache

log = logging.getLogger(__name__)

ONNX_DIR = "onnx"
ONNX_CONFIG = "onnx_config.json"
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


class OnnxProviderError(ClefError, ValueError):
    """The requested ONNX Runtime execution provider is not available here."""


def providers_for(device: str, available: list[str]) -> list[Any]:
    """The provider list for ``device`` (``cpu``, ``cuda``, ``cuda:N``); raises naming ``available`` otherwise."""
    kind, _, index = device.partition(":")
    wanted = PROVIDERS.get(kind)
    if wanted is None:
        raise OnnxProviderError(f"the onnx backend runs on cpu or cuda, not {device!r}; available providers: "
                                f"{', '.join(available)}")
    if wanted not in available:
        hint = " (install onnxruntime-gpu instead of onnxruntime, with a CUDA GPU)" if kind == "cuda" else ""
        raise OnnxProviderError(f"{wanted} is not available{hint}; available providers: {', '.join(available)}")
    if kind == "cuda":
        return [(wanted, {"device_id": int(index or 0)}), "CPUExecutionProvider"]
    return [wanted]


def session_options(plan: ThreadPlan | None = None) -> Any:
    """``onnxruntime.SessionOptions`` for an inference session: all graph optimizations, warnings off, sequential
    execution with ``plan``'s threads (default :func:`~clef_local.planning.hardware.thread_plan` for one worker in
    this process's role: every physical core in a one-shot ``clef-local`` command, one fewer in ``serve``, ``ui``
    and the Python API)."""
    import onnxruntime as ort

    plan = plan or thread_plan(workers=1)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # ORT's warnings about CPU placement of shape ops are noise here
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = plan.intra_op
    options.inter_op_num_threads = plan.inter_op
    return options


def read_onnx_config(path: Path) -> dict[str, Any]:
    """``onnx/onnx_config.json`` of a release; a release without an export is a :class:`ReleaseError` with the fix."""
    file = path / ONNX_DIR / ONNX_CONFIG
    if not file.is_file():
        raise ReleaseError(f"{path} has no ONNX export ({ONNX_DIR}/{ONNX_CONFIG}); write one with "
                           f"`clef-local export-onnx --model {path} --out DIR` and load DIR with backend='onnx'")
    return read_json(file)


class OnnxBackend:
    """Runs ``onnx/model.onnx`` through ONNX Runtime and the head in numpy float32."""

    name = "onnx"
    accepts_media = False  # the export holds the text model only: a media request is refused, naming --backend torch
    media_refusal = None  # ClefModel's line says it
    state_cache_blocker = "the ONNX Runtime backend runs every state in full (the state cache is torch's)"
    batch_tokens: int | None = None  # the device's default batches (ClefModel.run)
    pad_waste: float | None = None
    load_decision: LoadDecision | None = None  # set by clef_local.backends.loader
    prefill: PrefillBudget | None = None  # set by clef_local.backends.loader

    def __init__(self, release: Release, *, device: str = "cpu", dtype: str | None = None) -> None:
        import onnxruntime as ort

        self.release = release
        self.config = read_onnx_config(release.path)
        self.format = str(self.config.get("format"))
        if dtype not in (None, "auto", self.config.get("dtype")):
            # The graph's precision is fixed at export; the loader passes its CPU default here, so this is a notice.
            log.warning("this ONNX export computes in %s (%s); dtype %r does not apply (export another --format "
                        "for another precision)", self.config.get("dtype"), self.format, dtype)
        directory = release.path / ONNX_DIR
        self.device = "cpu" if device in ("auto", "") else device
        providers = providers_for(self.device, ort.get_available_providers())
        self.thread_plan = thread_plan(workers=1)
        options = session_options(self.thread_plan)
        try:
            self.session = ort.InferenceSession(str(directory / self.config["model"]), options, providers=providers)
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph/NoSuchFile classes
            raise ReleaseError(f"{directory / self.config['model']}: ONNX Runtime cannot load it ({exc})") from exc
        primary = providers[0][0] if isinstance(providers[0], tuple) else providers[0]
        if primary not in self.session.get_providers():
            raise OnnxProviderError(f"ONNX Runtime did not start {primary} (session providers: "
                                    f"{', '.join(self.session.get_providers())})")
        embedding = self.config["output_embedding"]
        self.embedding = np.load(directory / embedding["file"], mmap_mode="r")
        self.embedding_dtype = embedding["dtype"]
        self.head = load_head(release)
        self.state_identity = model_identity(release.path, [*release.weight_files, directory / self.config["model"]],
                                             backend=self.name, device=self.device, dtype=str(self.config.get("dtype")))
        log.info("onnx backend: %s (%s) on %s; %s", directory / self.config["model"], self.format,
                 ", ".join(self.session.get_providers()), self.thread_plan.describe())

    def hidden_states(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """``last_hidden_state`` ``[B, T, hidden]`` as float32."""
        out = self.session.run([self.config["output"]], {"input_ids": input_ids, "attention_mask": attention_mask})
        return out[0].astype(np.float32, copy=False)

    def lexical_rows(self, token_ids: np.ndarray) -> np.ndarray:
        """Output-embedding rows of ``token_ids`` as float32 (only those rows are read from the file)."""
        rows = np.asarray(self.embedding[token_ids])
        return bf16_to_float32(rows) if self.embedding_dtype == "bfloat16" else rows.astype(np.float32)

    def logits(self, records: Sequence[EncodedRecord], layout: HeadLayout, pad_token_id: int,
               cache: StateCache | None = None) -> np.ndarray:
        """Option logits ``[questions, max_options]`` (float32, ``-inf`` padding) for right-padded ``records``."""
        if cache is not None:
            raise ValueError(self.state_cache_blocker)
        input_ids, attention_mask = pad_batch(records, pad_token_id)
        hidden = self.hidden_states(input_ids, attention_mask)
        return self.head(hidden, attention_mask, self.lexical_rows(layout.option_token_ids), layout)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "device": self.device, "providers": self.session.get_providers(),
                "onnx_format": self.format, "backbone_dtype": self.config.get("dtype"),
                "matmul_nbits": self.config.get("matmul_nbits"), "head_dtype": "float32", "head_runtime": "numpy",
                "intra_op_threads": self.thread_plan.intra_op, "inter_op_threads": self.thread_plan.inter_op}
