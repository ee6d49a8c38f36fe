"""The PyTorch backend: the backbone through ``transformers`` (a Qwen3.5 release with its vision tower, or any causal
LM), the head in float32 (:mod:`clef_local.heads.torch_head`). A quantized variant is built on the meta device with
its quantized linears swapped in (:func:`load_variant_backbone`, :mod:`clef_local.backends.quantized`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from clef_local.backends.linear_attention import log_linear_attention_paths
from clef_local.backends.placement import Stage, place_pipeline, to_device_except
from clef_local.backends.quantized import kernel_counts, prepare_quantized
from clef_local.backends.skeleton import load_variant_backbone
from clef_local.backends.streaming import StreamedModel
from clef_local.backends.torch_cache import cache_blocker, is_out_of_memory
from clef_local.backends.torch_pass import collate, hidden_states
from clef_local.errors import ReleaseError, one_line
from clef_local.formats.quant_plan import mixed_plan
from clef_local.formats.release import QWEN3_5, SINGLE_WEIGHTS, WEIGHTS_INDEX, Release, find_weight_files
from clef_local.formats.safetensors import read_header
from clef_local.formats.variant import variant_format
from clef_local.heads.torch_head import load_head
from clef_local.runtime.hf_bars import hf_progress_bars
from clef_local.runtime.layout import HeadLayout
from clef_local.runtime.state_cache import StateCache, model_identity
from clef_local.units import format_size

if TYPE_CHECKING:
    from clef_local.planning.choice import LoadDecision
    from clef_local.planning.prefill import PrefillBudget
    from clef_local.planning.stream import StreamDecision
    from clef_local.runtime.encoding import EncodedRecord

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype | None, release: Release) -> torch.dtype:
    """``None``/``"auto"`` is the release's stored dtype; a name or a torch dtype is taken as given."""
    if isinstance(name, torch.dtype):
        return name
    key = release.dtype if name in (None, "auto") else name
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {key!r}; use one of {', '.join(DTYPES)} or 'auto'")
    return DTYPES[key]


def qwen3_5_type(config: Any) -> str:
    """The transformers model type whose modeling module holds the text layers (``qwen3_5`` for Clef)."""
    return str(getattr(config, "model_type", "qwen3_5")).removesuffix("_text")


def variant_scheme(config: dict[str, Any]) -> str | None:
    """The scheme of a quantized variant's ``config.json`` (:func:`clef_local.formats.variant.variant_format`),
    else None."""
    fmt = variant_format(config)
    return None if fmt is None else fmt.scheme


class TorchBackbone:
    """A release's backbone through ``transformers``: final hidden states and output-embedding rows.

    ``layers`` maps each quantized linear's path to ``"scheme:kernel"`` (empty for a full-precision release).
    """

    def __init__(self, path: Path, config: dict[str, Any], *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, weight_files: Sequence[Path] | None = None,
                 host_embeddings: bool | None = None, split: Sequence[Stage] = (),
                 stream: StreamDecision | None = None) -> None:
        """``host_embeddings`` (default: on a CUDA device) keeps ``embed_tokens`` and ``lm_head`` in host memory:
        both are only gathered from (a few rows per request), and on Clef 27B they are ~2.5 GB each
        (docs/hardware.md). ``split``: ``(device, first layer, end layer)`` per pipeline stage
        (:mod:`clef_local.backends.placement`); ``device`` is then ignored: the hidden states come out on the last
        stage's device. ``stream``: run the backbone from its files a group of decoder layers at a time
        (:mod:`clef_local.backends.streaming`; the embeddings' rows are read from the files, like host embeddings)."""
        import transformers

        qwen3_5 = config.get("model_type") == "qwen3_5" or QWEN3_5 in (config.get("architectures") or [])
        cls = transformers.Qwen3_5ForConditionalGeneration if qwen3_5 else transformers.AutoModelForCausalLM
        self.scheme = variant_scheme(config)
        self.split = tuple(split)
        self.device = torch.device(self.split[-1][0] if self.split else device)
        self.input_device = torch.device(self.split[0][0]) if self.split else self.device  # where the layers start
        self.dtype = dtype
        path = Path(path)
        if weight_files is None and (self.scheme is not None or (path / SINGLE_WEIGHTS).is_file()
                                     or (path / WEIGHTS_INDEX).is_file()):
            weight_files = find_weight_files(path)  # a variant must have them; a bare backbone may hold other files
        weight_files = tuple(weight_files or ())
        if stream is not None and (self.split or not weight_files):
            raise ValueError("a streamed backbone runs on one device from its safetensors files"
                             + (f", not split over {len(self.split)} stages" if self.split else ": none found"))
        # Every header checked against its file first: a truncated or garbled file is one ReleaseError naming it,
        # never a traceback from inside safetensors or transformers.
        for file in weight_files:
            read_header(file)
        self.streamed: StreamedModel | None = None
        with hf_progress_bars(log.isEnabledFor(logging.INFO)):  # "Loading weights": noise in `decide`
            if stream is not None:
                self.streamed = StreamedModel(cls, path, weight_files, self.scheme, dtype, self.device, stream,
                                              mixed_plan(config))
                model = self.streamed.model
            elif self.scheme is not None:
                log.info("loading %s %s variant from %s in %s", cls.__name__, self.scheme, path, dtype)
                model = load_variant_backbone(cls, path, weight_files, self.scheme, dtype, mixed_plan(config))
            else:
                log.info("loading %s backbone from %s in %s", cls.__name__, path, dtype)
                try:
                    # trust_remote_code=False: never run (or ask on stdin whether to run) a release's Python files
                    model = cls.from_pretrained(path, dtype=dtype, local_files_only=True, trust_remote_code=False)
                except (OSError, ValueError, KeyError) as exc:
                    raise ReleaseError(f"{path}: the backbone cannot be loaded ({one_line(exc)})") from exc
        model.config.use_cache = False
        base = model.model
        # Without media only the text model runs (docs/format.md §3); with a vision tower it sits beside it.
        self.text_model = getattr(base, "language_model", base)
        self.host_embeddings = self.device.type == "cuda" if host_embeddings is None else host_embeddings
        if self.streamed is not None:
            self.host_embeddings = True  # the ids' rows come from the file on the host (FileRows)
        embeddings = {id(self.text_model.get_input_embeddings()), id(model.get_output_embeddings())}
        self.pipeline_hooks: list[Any] = []
        if self.streamed is not None:
            self.model = model.eval()  # placed as it was built: resident parts on the device, the rest on meta
        elif self.split:
            self.pipeline_hooks = place_pipeline(model, self.text_model, self.split,
                                                 embeddings if self.host_embeddings else set())
            if not self.host_embeddings:  # the output embedding is gathered for the head, on the last device
                model.get_output_embeddings().to(self.device)
            self.model = model.eval()
        elif self.host_embeddings:
            to_device_except(model, self.device, embeddings)
            self.model = model.eval()
        else:
            self.model = model.to(self.device).eval()
        self.layers = self.streamed.kernels if self.streamed is not None else prepare_quantized(self.model)
        # streamed: the matrix stays in the file (a meta tensor of its shape here; lexical_rows reads its rows)
        self.output_embedding = (self.streamed.output.weight if self.streamed is not None
                                 else self.model.get_output_embeddings().weight)
        text_config = self.model.config.get_text_config()
        self.linear_attention = (log_linear_attention_paths(self.device.type, qwen3_5_type(self.model.config))
                                 if "linear_attention" in (getattr(text_config, "layer_types", None) or []) else {})
        # transformers 5 renames past_key_values to cache (both accepted until 5.40)
        parameters = inspect.signature(self.text_model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        # why the state cache cannot run on this backbone (None: it can), torch_cache.cache_blocker; a pipeline split
        # keeps each layer's cache on its own device, which the continuation code does not place yet
        self.state_cache_blocker = ("the layers are split over several devices" if self.split
                                    else "the layers are streamed from disk" if self.streamed is not None
                                    else cache_blocker(self.text_model.config))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, cache: Any = None,
                position_ids: torch.Tensor | None = None,
                media: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The final hidden states of ``input_ids``: the text model's (docs/format.md §3), or with ``media`` (the
        pixel tensors and ``mm_token_type_ids`` of :func:`~clef_local.backends.torch_pass.collate_media`) the
        multimodal model's, ``model.model``: the vision tower's features in place of the pad tokens, Qwen's
        multimodal rope (docs/format.md §7). With ``cache`` (a ``transformers`` cache, filled or continued in place)
        the pass runs with ``use_cache=True`` and ``attention_mask`` covers the cached past + the new tokens."""
        device = self.device if media is not None else self.input_device
        model = self.model.model if media is not None else self.text_model
        kwargs: dict[str, Any] = {"attention_mask": attention_mask.to(device), "return_dict": True,
                                  "use_cache": cache is not None, **(media or {})}
        if cache is not None:
            kwargs[self._cache_argument] = cache
        if position_ids is not None:
            kwargs["position_ids"] = position_ids.to(device)
        with torch.inference_mode():
            if self.host_embeddings:  # gather on the host, ship only [B, T, hidden] to the device
                embeds = self.text_model.get_input_embeddings()(input_ids.cpu()).to(device)
                if media is not None:  # the ids still go along: they mark where the visual features go
                    kwargs["input_ids"] = input_ids.to(device)
                out = model(inputs_embeds=embeds, **kwargs)
            else:
                out = model(input_ids=input_ids.to(device), **kwargs)
        return out.last_hidden_state

    def lexical_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Output-embedding rows of ``token_ids``, on the compute device (the matrix may stay on the host, or in the
        file when streamed)."""
        if self.streamed is not None:
            return self.streamed.lexical_rows(token_ids).to(self.device)
        table = self.output_embedding
        return table.index_select(0, token_ids.to(table.device)).to(self.device)


class TorchBackend:
    """Runs the backbone and the head for a padded batch of encoded records."""

    name = "torch"
    accepts_media = True
    media_refusal = None
    load_decision: LoadDecision | None = None  # set by clef_local.backends.loader
    prefill: PrefillBudget | None = None  # set by clef_local.backends.loader

    def __init__(self, release: Release, *, device: str = "cpu", dtype: str | torch.dtype | None = None,
                 split: Sequence[Stage] = (), stream: StreamDecision | None = None) -> None:
        """``split``: a pipeline split of the decoder layers (:class:`TorchBackbone`); the head runs on the last
        stage's device. ``stream``: the backbone streamed from disk (:mod:`clef_local.backends.streaming`); its
        batches are cut at ``stream.batch_tokens`` padded tokens with ``stream.pad_waste`` (:attr:`batch_tokens`,
        :attr:`pad_waste`: a pass reads every layer once, so fewer, larger batches)."""
        self.release = release
        self.backbone = TorchBackbone(release.path, release.config, device=device,
                                      dtype=resolve_dtype(dtype, release), weight_files=release.weight_files,
                                      split=split, stream=stream)
        self.stream = stream
        self.batch_tokens = stream.batch_tokens if stream is not None else None
        self.pad_waste = stream.pad_waste if stream is not None else None
        self.device = self.backbone.device
        self.head = load_head(release, device=self.device)
        # the state cache's key prefix: what makes two loaded models compute the same states
        self.state_identity = model_identity(release.path, release.weight_files, backend=self.name,
                                             device=str(self.device), dtype=str(self.backbone.dtype))

    @property
    def state_cache_blocker(self) -> str | None:
        """Why this backbone cannot use a state cache (None: it can; :func:`torch_cache.cache_blocker`)."""
        return self.backbone.state_cache_blocker

    def logits(self, records: Sequence[EncodedRecord], layout: HeadLayout, pad_token_id: int,
               cache: StateCache | None = None) -> np.ndarray:
        """Option logits ``[questions, max_options]`` (float32, ``-inf`` padding) for right-padded ``records``;
        with ``cache``, each record's state from it and only its schema tokens run (:mod:`.torch_pass`)."""
        with torch.inference_mode():
            input_ids, attention_mask = collate(records, pad_token_id, self.device)
            try:
                hidden = hidden_states(self.backbone, records, input_ids, attention_mask, pad_token_id,
                                       chunk_for=self.chunk_for, cache=cache, identity=self.state_identity)
            except RuntimeError as exc:
                if cache is None or not is_out_of_memory(exc):
                    raise
                # what the cache holds can be given back: empty it and run the batch cold
                freed = cache.clear(out_of_memory=True)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                log.warning("out of memory with %s of cached states (%s); cleared the state cache, running the batch "
                            "of %d again without it", format_size(freed), str(exc).splitlines()[0][:200], len(records))
                hidden = hidden_states(self.backbone, records, input_ids, attention_mask, pad_token_id,
                                       chunk_for=self.chunk_for)
            device_layout = layout.map(lambda a: torch.from_numpy(a).to(self.device))
            lexical = self.backbone.lexical_rows(device_layout.option_token_ids)
            return self.head(hidden, attention_mask, lexical, device_layout).float().cpu().numpy()

    def chunk_for(self, tokens: int, rows: int) -> int | None:
        """The chunk length of a prefill of ``rows`` × ``tokens`` (None: one pass), from :attr:`prefill`."""
        return None if self.prefill is None else self.prefill.chunk(tokens, rows)

    def describe(self) -> dict[str, Any]:
        params = sum(p.numel() for p in self.backbone.model.parameters())
        head_params = sum(p.numel() for p in self.head.parameters())
        device = ",".join(d for d, _, _ in self.backbone.split) if self.backbone.split else str(self.device)
        out = {"backend": self.name, "device": device,
               "backbone_dtype": str(self.backbone.dtype).split(".")[-1],
               "embeddings": "host" if self.backbone.host_embeddings else "device",
               "backbone_parameters": params, "head_parameters": head_params, "head_dtype": "float32"}
        if self.backbone.linear_attention:
            out["linear_attention"] = dict(self.backbone.linear_attention)
        if self.backbone.split:
            out["split"] = [{"device": d, "layers": [a, b]} for d, a, b in self.backbone.split]
        if self.backbone.scheme is not None:
            out.update(scheme=self.backbone.scheme, kernels=kernel_counts(self.backbone.layers),
                       kernel_layers=dict(self.backbone.layers))
        if self.backbone.streamed is not None:
            out["embeddings"] = "file"
            out["streamed"] = self.backbone.streamed.describe()
        return out
