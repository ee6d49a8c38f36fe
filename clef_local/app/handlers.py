"""What the page's buttons do, as plain functions of plain values (no Gradio here; ``ui.py`` wires them).

Every handler catches what a user can cause and returns it as a message for the page; nothing a user types ends
in a traceback. Unexpected errors are logged with their traceback and shown as one line.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_local.app import results, schema_builder
from clef_local.app.compare import compare_request, probe_markdown, run_probe
from clef_local.app.models import ModelStore, describe_markdown, media_note
from clef_local.app.schema_builder import BuilderError, QuestionDraft
from clef_local.app.snippets import curl_snippet, python_snippet

log = logging.getLogger(__name__)
Progress = Callable[..., Any]
NO_VARIANT = ""


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def _messages_md(title: str, messages: list[str]) -> str:
    return f"**{title}**\n\n" + "\n".join(f"- `{m}`" for m in messages)


def error_md(exc: BaseException) -> str:
    """A user-facing message for an error raised while answering (API messages kept verbatim)."""
    from clef_local.errors import ClefError, RequestValidationError

    if isinstance(exc, RequestValidationError):
        return _messages_md("Invalid request (the API would answer 422):",
                            [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors])
    if isinstance(exc, BuilderError):
        return _messages_md("The schema cannot form a request yet:", exc.messages)
    if isinstance(exc, ClefError | ValueError | FileNotFoundError):
        return f"**Error:** {exc}"
    log.error("unexpected error in the UI", exc_info=exc)
    return f"**Internal error:** {type(exc).__name__}: {exc} (the terminal running `clef-local ui` has the details)"


@dataclass(frozen=True)
class RunOutputs:
    """Everything a run puts on the page (the order of ``ui.RUN_OUTPUTS``)."""

    request_json: str
    status: str
    results_html: str = ""
    summary: list[list[Any]] | None = None
    raw_json: str = ""
    compare_html: str = ""
    compare_rows: list[list[Any]] | None = None
    images: list[tuple[Any, str]] | None = None  # the images the request sent, with their markers

    def values(self) -> tuple[Any, ...]:
        return (self.request_json, self.status, self.results_html, self.summary or [], self.raw_json,
                self.compare_html, self.compare_rows or [], self.images or [])


def request_text(request: Any) -> str:
    """The request as JSON for the page; image bytes (dropped files) are shown by their size."""
    return json.dumps(request, ensure_ascii=False, indent=2,
                      default=lambda v: f"<image file, {len(v):,} bytes>" if isinstance(v, bytes) else str(v))


def sent_images(request: Any) -> list[tuple[Any, str]]:
    """The decoded images of a request with their markers (``<image N>``: their order after the prefix)."""
    from clef_local.runtime.media import resolve_media
    from clef_local.runtime.schema import validate_request

    if not isinstance(request, dict) or not any(request.get(k) for k in ("images", "assets")):
        return []
    media = resolve_media(validate_request(request))
    return [(image, f"<image {i}>") for i, image in enumerate(media.images, start=1)]


def _report_progress(progress: Progress | None, fraction: float, text: str) -> None:
    if progress is not None:
        progress(fraction, desc=text)


class Handlers:
    """The app's actions over one :class:`ModelStore`."""

    def __init__(self, store: ModelStore) -> None:
        self.store = store

    def _model(self, path: str, progress: Progress | None) -> Any:
        if not path:
            raise ValueError("no model selected; choose one in the model panel")
        if not self.store.loaded(path):
            _report_progress(progress, 0.05, f"loading {Path(path).name} (first use)")
        return self.store.get(path, None if progress is None else lambda f, t: _report_progress(progress, f, t))

    # ---------------------------------------------------------------- model panel

    def load_model(self, path: str, progress: Progress | None = None) -> tuple[str, str, str]:
        """(model panel markdown, image-upload note, status) after loading ``path``."""
        try:
            started = time.perf_counter()
            model = self._model(path, progress)
            seconds = time.perf_counter() - started
            return describe_markdown(model), media_note(model), f"Model ready ({seconds:.1f} s)."
        except Exception as exc:  # shown in the page; logged when unexpected
            return "", media_note(None), error_md(exc)

    # ---------------------------------------------------------------- builder

    def preview(self, state_mode: str, state_text: str, *values: Any) -> tuple[str, str, str, str]:
        """(validation markdown, request JSON, curl, Python) for the builder's current fields."""
        try:
            request = schema_builder.build_request(schema_builder.drafts_from_values(list(values)),
                                                   state_mode, state_text)
        except BuilderError as exc:
            return error_md(exc), "", "", ""
        messages = schema_builder.validation_messages(request)
        text = json.dumps(request, ensure_ascii=False, indent=2)
        if messages:
            return _messages_md("Invalid request (the API would answer 422):", messages), text, "", ""
        n = len(request["questions"])
        return (f"Valid request: {n} question{'s' * (n != 1)}.", text, curl_snippet(request),
                python_snippet(request))

    def import_request(self, text: str) -> tuple[list[QuestionDraft] | None, str | None, str | None, str]:
        """(drafts, state mode, state text, status) from request JSON text; drafts None when it is invalid."""
        try:
            request = schema_builder.parse_request_json(text)
            drafts, mode, state = schema_builder.request_to_drafts(request)
        except Exception as exc:
            return None, None, None, error_md(exc)
        return drafts, mode, state, f"Imported {len(drafts)} question{'s' * (len(drafts) != 1)}."

    def load_example(self, name: str) -> tuple[list[QuestionDraft] | None, str | None, str | None, str]:
        try:
            text = json.dumps(schema_builder.example_request(name))
        except ValueError as exc:
            return None, None, None, error_md(exc)
        return self.import_request(text)

    def export_request(self, request_json: str) -> str | None:
        """Write the request JSON to a temp file for download; None when there is nothing valid to export."""
        if not request_json.strip():
            return None
        directory = Path(tempfile.mkdtemp(prefix="clef-ui-export-"))
        path = directory / "request.json"
        path.write_text(request_json, encoding="utf-8")
        return str(path)

    # ---------------------------------------------------------------- running

    def run_builder(self, model_path: str, variant_path: str, state_mode: str, state_text: str, *values: Any,
                    progress: Progress | None = None, images: list[str] | None = None) -> tuple[Any, ...]:
        """Build the request from the builder's fields (and the dropped image files) and run it (see
        :meth:`run_request`)."""
        try:
            request = schema_builder.build_request(schema_builder.drafts_from_values(list(values)),
                                                   state_mode, state_text)
            if images:
                request["images"] = [Path(path).read_bytes() for path in images]
        except BuilderError as exc:
            return RunOutputs("", error_md(exc)).values()
        except OSError as exc:
            return RunOutputs("", f"**Error:** an image file cannot be read ({exc})").values()
        return self.run_request(request, model_path, variant_path, progress)

    def run_json(self, request_json: str, model_path: str, variant_path: str,
                 progress: Progress | None = None) -> tuple[Any, ...]:
        """Run request JSON text (the "Run this JSON" button and the ``/run`` API)."""
        try:
            request = schema_builder.parse_request_json(request_json)
        except BuilderError as exc:
            return RunOutputs(request_json, error_md(exc)).values()
        return self.run_request(request, model_path, variant_path, progress)

    def run_request(self, request: Any, model_path: str, variant_path: str,
                    progress: Progress | None = None) -> tuple[Any, ...]:
        """Answer ``request`` with the selected model, and with the variant too when one is chosen."""
        text = request_text(request)
        try:
            messages = schema_builder.validation_messages(request)
            if messages:
                return RunOutputs(text, _messages_md("Invalid request (the API would answer 422):",
                                                     messages)).values()
            model = self._model(model_path, progress)
            if variant_path and variant_path != model_path:
                return self._compare(request, text, model, self._model(variant_path, progress), progress)
            _report_progress(progress, 0.5, "running")
            hits = model.state_cache.stats().hits
            started = time.perf_counter()
            response = model.decide(request)
            seconds = time.perf_counter() - started
            images = sent_images(request)
            # the model's state cache: an edited schema on the same state runs only the schema's tokens
            reused = model.state_cache.stats().hits > hits
        except Exception as exc:
            return RunOutputs(text, error_md(exc)).values()
        views = results.question_views(response)
        shown = f" · **{_plural(len(images), 'image')}**" if images else ""
        status = (f"**{_plural(len(views), 'question')}** answered by `{Path(model_path).name}`{shown} · "
                  f"**{response['usage']['input_tokens']} input tokens** · **{seconds:.3f} s**"
                  + (" · state from the cache: only the schema ran" if reused else ""))
        return RunOutputs(text, status, results.results_html(response), results.summary_rows(views),
                          json.dumps(response, ensure_ascii=False, indent=2), images=images).values()

    def _compare(self, request: dict[str, Any], text: str, model: Any, variant: Any,
                 progress: Progress | None) -> tuple[Any, ...]:
        _report_progress(progress, 0.5, "running reference and variant")
        comparison = compare_request(model, variant, request)
        response = comparison.reference
        views = results.question_views(response)
        flips = sum(d.flipped for d in comparison.drifts.values())
        names = (Path(str(model.path)).name, Path(str(variant.path)).name)
        status = (f"**{_plural(len(views), 'question')}** · **{response['usage']['input_tokens']} input tokens** · "
                  f"reference `{names[0]}` **{comparison.reference_seconds:.3f} s**, variant `{names[1]}` "
                  f"**{comparison.variant_seconds:.3f} s** · **{flips} flipped decision{'s' * (flips != 1)}**")
        raw = json.dumps({"reference": response, "variant": comparison.variant}, ensure_ascii=False, indent=2)
        return RunOutputs(text, status, results.results_html(response), results.summary_rows(views), raw,
                          results.compare_html(response, comparison.variant, comparison.drifts, names),
                          results.compare_rows(response, comparison.variant, comparison.drifts),
                          sent_images(request)).values()

    def probe(self, model_path: str, variant_path: str, progress: Progress | None = None) -> tuple[str, str | None]:
        """(markdown, HTML report path) of the built-in drift probe, reference against the chosen variant."""
        if not variant_path or variant_path == model_path:
            return "**Choose a variant** to compare with the reference first.", None
        try:
            model = self._model(model_path, progress)
            variant = self._model(variant_path, progress)

            def step(done: int, total: int) -> None:
                _report_progress(progress, done / max(total, 1), f"drift probe: {done}/{total} requests")

            summary, report = run_probe(model, variant, step)
        except Exception as exc:
            return error_md(exc), None
        return probe_markdown(summary, report), str(report)
