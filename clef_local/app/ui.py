"""``clef-local ui`` (docs/ui.md): a Gradio app to build schemas, run them, read the probabilities, compare a variant.

Local by default, behind the server's ``Host`` / ``Origin`` guard (:mod:`clef_local.server.guard`) and Gradio's
``strict_cors``; it calls only the public Python API and the quality functions. Its stable ``elem_id``s (``q0-id``,
``add-question``, ``run``, ``results`` …) are the browser test's contract.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clef_local.app import schema_builder
from clef_local.app.builder_view import Wiring, render_questions
from clef_local.app.handlers import NO_VARIANT, Handlers
from clef_local.app.models import ModelStore, find_variants, is_release
from clef_local.app.results import COMPARE_HEADERS, SUMMARY_HEADERS
from clef_local.app.schema_builder import EXAMPLES, STATE_MODES, QuestionDraft
from clef_local.errors import ApiUsageError
from clef_local.options import add_max_length_flag, add_model_flags

if TYPE_CHECKING:
    import gradio as gr

UI_MODULES = ("gradio", "matplotlib")  # what the ui extra installs (pyproject.toml), by import name


def require_ui_extra() -> None:
    """Fail at once, before any model loads, when the ``ui`` extra is not installed (one line, exit status 2)."""
    missing = [name for name in UI_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise ApiUsageError(f"clef-local ui needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'}"
                            " not installed: pip install 'clef-local[ui]'")


def launch_options(host: str = "127.0.0.1", allowed_hosts: Sequence[str] = ()) -> dict[str, Any]:
    """``Blocks.launch`` keyword arguments that keep the app local: no share link, Gradio's ``strict_cors``, and
    the Host / Origin guard of ``clef-local serve`` in front of every route (``main`` and the tests use them)."""
    from starlette.middleware import Middleware

    from clef_local.server.guard import HostGuard, allowed_host_names

    guard = Middleware(HostGuard, hosts=allowed_host_names(host, allowed_hosts))
    return {"server_name": host, "share": False, "strict_cors": True, "app_kwargs": {"middleware": [guard]}}


def _resolve_models(model_path: str | Path | None, compare_path: str | Path | None) -> tuple[Path, list[Path]]:
    import clef_local

    reference = Path(model_path).expanduser() if model_path else clef_local.default_model_path()
    if not is_release(reference):
        raise ValueError(f"{reference} is not a Clef release (no config.json / joint_head_config.json); "
                         "pass --model DIR with a release directory")
    variants = find_variants(reference)
    if compare_path:
        extra = Path(compare_path).expanduser()
        if not is_release(extra):
            raise ValueError(f"{extra} is not a Clef release; pass --compare DIR with a release or variant directory")
        variants = [extra, *[v for v in variants if v.resolve() != extra.resolve()]]
    return reference, variants


def build_app(model_path: str | Path | None = None, compare_path: str | Path | None = None, *,
              dtype: str | None = None, max_length: int | None = None) -> gr.Blocks:
    """The app's Blocks (not launched). ``model_path`` defaults to the demo model; ``compare_path`` preselects a
    variant to compare with (variants beside the model are listed too); ``max_length``: the longest request in
    tokens (``clef_local.load(max_length=…)``)."""
    import gradio as gr

    reference, variants = _resolve_models(model_path, compare_path)
    store = ModelStore(reference, variants, dtype=dtype, max_length=max_length)
    handlers = Handlers(store)
    first_example = next(iter(EXAMPLES))
    initial, initial_mode, initial_state = schema_builder.request_to_drafts(
        schema_builder.example_request(first_example))

    # No analytics calls: the app must work (and stay quiet) on an offline machine.
    with gr.Blocks(title="clef-local", analytics_enabled=False) as demo:
        gr.Markdown("# clef-local\nBuild a schema, run it on your own text, read the calibrated probabilities, "
                    "and see what quantization changed. Everything runs on this machine.")
        # ------------------------------------------------------------ model panel
        with gr.Accordion("Model", open=True):
            with gr.Row():
                model_dd = gr.Dropdown(store.choices(), value=str(reference), label="model in use",
                                       elem_id="model", scale=2)
                variant_dd = gr.Dropdown([("(none)", NO_VARIANT), *store.choices()],
                                         value=str(variants[0]) if compare_path else NO_VARIANT,
                                         label="compare with variant", elem_id="variant", scale=2)
            model_md = gr.Markdown("Loading the model…", elem_id="model-info")
            variant_md = gr.Markdown("", elem_id="variant-info")
            model_status = gr.Markdown("", elem_id="model-status")

        questions = gr.State(initial)
        with gr.Row(equal_height=False):
            # -------------------------------------------------------- schema builder
            with gr.Column(scale=5):
                gr.Markdown("## Schema")
                with gr.Row():
                    example_dd = gr.Dropdown(list(EXAMPLES), value=first_example, label="examples",
                                             elem_id="example", scale=3)
                    example_btn = gr.Button("Load example", elem_id="load-example", scale=1)
                    clear_btn = gr.Button("Clear questions", elem_id="clear-questions", scale=1)
                @gr.render(inputs=[questions])
                def render_builder(drafts: list[QuestionDraft]) -> None:
                    render_questions(drafts, wiring)

                add_btn = gr.Button("+ Add question", elem_id="add-question")
                validation_md = gr.Markdown("", elem_id="validation")
                with gr.Accordion("Request JSON: import / export / copy", open=False, elem_id="json-panel"):
                    request_json = gr.Code("", language="json", label="request JSON (edit, import or run it)",
                                           interactive=True, elem_id="request-json", lines=8)
                    with gr.Row():
                        import_btn = gr.Button("Import into builder", elem_id="import")
                        run_json_btn = gr.Button("Run this JSON", elem_id="run-json")
                        export_btn = gr.Button("Export .json", elem_id="export")
                    with gr.Row():
                        upload = gr.File(label="import a .json file", file_types=[".json"], type="filepath",
                                         elem_id="upload")
                        export_file = gr.File(label="exported request", elem_id="export-file", interactive=False)
                    curl_code = gr.Code("", language="shell", label="copy as curl (clef-local serve)",
                                        interactive=False, elem_id="curl", buttons=["copy"])
                    python_code = gr.Code("", language="python", label="copy as Python (typesafe-sdk)",
                                          interactive=False, elem_id="python", buttons=["copy"])
            # -------------------------------------------------------- state and results
            with gr.Column(scale=6):
                gr.Markdown("## State")
                state_mode = gr.Radio(list(STATE_MODES), value=initial_mode, label="state is", elem_id="state-mode")
                state_text = gr.Textbox(initial_state, lines=5, label="state", elem_id="state",
                                        placeholder="the text (or JSON) the questions are about")
                with gr.Accordion("Images", open=True):
                    media_md = gr.Markdown("", elem_id="media-note")
                    image_files = gr.File(label="images (drop files here)", file_count="multiple",
                                          file_types=["image"], type="filepath", elem_id="image-upload", height=120)
                run_btn = gr.Button("Run", variant="primary", elem_id="run")
                status_md = gr.Markdown("", elem_id="status")
                with gr.Tabs():
                    with gr.Tab("Results", elem_id="results-tab"):
                        results_html = gr.HTML("", elem_id="results")
                        summary_df = gr.Dataframe(headers=SUMMARY_HEADERS, value=[], label="decisions",
                                                  elem_id="summary", interactive=False)
                        raw_json = gr.Code("", language="json", label="raw response JSON", elem_id="raw-json",
                                           interactive=False)
                        sent_gallery = gr.Gallery(label="images sent (in order after the prompt's prefix)",
                                                  elem_id="sent-images", columns=4, height=180, interactive=False)
                    with gr.Tab("Compare", elem_id="compare-tab"):
                        gr.Markdown("Choose a variant in the model panel, then **Run**: the same request goes "
                                    "through both; bars are overlaid (reference filled, variant outlined).")
                        compare_html = gr.HTML("", elem_id="compare")
                        compare_df = gr.Dataframe(headers=COMPARE_HEADERS, value=[], label="drift per question",
                                                  elem_id="compare-table", interactive=False)
                        probe_btn = gr.Button("Run the drift probe (12 built-in requests)", elem_id="probe")
                        probe_md = gr.Markdown("", elem_id="probe-summary")
                        probe_file = gr.File(label="drift report (HTML)", elem_id="probe-report", interactive=False)

        run_outputs = [request_json, status_md, results_html, summary_df, raw_json, compare_html, compare_df,
                       sent_gallery]
        preview_outputs = [validation_md, request_json, curl_code, python_code]
        wiring = Wiring(handlers, questions, add_btn, run_btn, model_dd, variant_dd, state_mode, state_text,
                        run_outputs, preview_outputs, image_files)

        # ------------------------------------------------------------ listeners on static components
        tracker = gr.Progress()  # gradio swaps in a tracker per call; it finds the parameter by this default

        def load_model(path: str, progress: gr.Progress = tracker) -> tuple[str, str, str]:
            return handlers.load_model(path, progress)

        demo.load(load_model, [model_dd], [model_md, media_md, model_status], api_visibility="private")
        model_dd.change(load_model, [model_dd], [model_md, media_md, model_status], api_visibility="private")

        def load_variant(path: str, progress: gr.Progress = tracker) -> tuple[Any, Any]:
            if not path:
                return "", gr.skip()
            info, _, status = handlers.load_model(path, progress)
            return (f"Compared with: {info}" if info else ""), status

        variant_dd.change(load_variant, [variant_dd], [variant_md, model_status], api_visibility="private")
        demo.load(load_variant, [variant_dd], [variant_md, model_status], api_visibility="private")

        def run_json(text: str, model: str, variant: str,
                     progress: gr.Progress = tracker) -> tuple[Any, ...]:
            return handlers.run_json(text, model, variant, progress)

        run_json_btn.click(run_json, [request_json, model_dd, variant_dd], run_outputs, api_name="run")

        def probe(model: str, variant: str, progress: gr.Progress = tracker) -> tuple[str, str | None]:
            return handlers.probe(model, variant, progress)

        probe_btn.click(probe, [model_dd, variant_dd], [probe_md, probe_file], api_name="probe")

        def imported(drafts: list[QuestionDraft] | None, mode: str | None, state: str | None,
                     status: str) -> tuple[Any, ...]:
            if drafts is None:
                return gr.skip(), gr.skip(), gr.skip(), status
            return drafts, mode, state, status

        def import_json(text: str) -> tuple[Any, ...]:
            return imported(*handlers.import_request(text))

        import_outputs = [questions, state_mode, state_text, validation_md]
        import_btn.click(import_json, [request_json], import_outputs, api_name="import")
        example_btn.click(lambda name: imported(*handlers.load_example(name)), [example_dd], import_outputs,
                          api_visibility="private")
        clear_btn.click(lambda: [], None, [questions], api_visibility="private")

        def uploaded(path: str | None) -> tuple[Any, ...]:
            if not path:
                return (gr.skip(),) * 5
            try:
                text = Path(path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                return gr.skip(), gr.skip(), gr.skip(), gr.skip(), f"**Error:** {Path(path).name}: cannot read ({exc})"
            return (text, *import_json(text))

        upload.upload(uploaded, [upload], [request_json, *import_outputs], api_visibility="private")
        export_btn.click(handlers.export_request, [request_json], [export_file], api_visibility="private")

        def preview_drafts(drafts: list[QuestionDraft], mode: str, state: str) -> tuple[str, str, str, str]:
            return handlers.preview(mode, state, *[v for d in drafts for v in d.fields()])

        demo.load(preview_drafts, [questions, state_mode, state_text], preview_outputs, api_visibility="private")
        questions.change(preview_drafts, [questions, state_mode, state_text], preview_outputs,
                         api_visibility="private", show_progress="hidden")
    return demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clef-local ui", description="Open the desktop app (a local web page): "
                                     "build schemas, run them, read the probabilities, compare a variant.")
    add_model_flags(parser, backend=False, device=False)
    add_max_length_flag(parser)
    parser.add_argument("--compare", help="a variant (or any release) to compare with, preselected in the page")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="also answer requests whose Host is NAME (repeatable; localhost, 127.0.0.1, [::1] and "
                             "the --host address always are)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Start the app and serve it until interrupted."""
    args = build_parser().parse_args(argv)
    require_ui_extra()  # before the models resolve and load: a missing extra is a one-line error
    try:
        demo = build_app(args.model, args.compare, dtype=None if args.dtype == "auto" else args.dtype,
                         max_length=args.max_length)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host}: anyone who can reach this address can run the model",
              file=sys.stderr)
    print(f"clef-local ui on http://{args.host}:{args.port} (Ctrl+C to stop)")
    import gradio as gr

    # System fonts: the default theme would fetch web fonts, and this app runs offline.
    theme = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                              font_mono=["ui-monospace", "Consolas", "monospace"])
    demo.queue().launch(server_port=args.port, inbrowser=False, show_error=False, quiet=True, theme=theme,
                        **launch_options(args.host, args.allowed_host))
    return 0


if __name__ == "__main__":
    sys.exit(main())
