"""The schema builder's components, rendered again whenever the list of questions changes shape: the inputs hold the
truth while the user types, and structural edits (add, remove, move) read every input, apply the edit to the drafts
and store them. Stable ``elem_id``s per question: ``q{i}-id``, ``-type``, ``-instructions``, ``-options``,
``-true``, ``-false``, and the buttons ``q{i}-up``, ``-down``, ``-remove``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from clef_local.app import schema_builder
from clef_local.app.handlers import Handlers
from clef_local.app.schema_builder import QuestionDraft
from clef_local.runtime.schema import QUESTION_TYPES

OPTION_HELP = {
    "choice": ("options, one per line", "label, or label: description", "card_payments: Card payments\nother"),
    "score": ("levels, one per line (level 0 first)", "the text of each level", "Not urgent\nToday\nImmediately"),
}


def option_field(qtype: str) -> dict[str, Any]:
    """Label, help and visibility of a question's options box for its type (hidden for noul)."""
    label, info, placeholder = OPTION_HELP.get(qtype, OPTION_HELP["choice"])
    return {"label": label, "info": info, "placeholder": placeholder, "visible": qtype != "noul"}


@dataclass
class Wiring:
    """The static components the rendered builder reads from and writes to."""

    handlers: Handlers
    questions: Any  # gr.State holding list[QuestionDraft]
    add_btn: Any
    run_btn: Any
    model_dd: Any
    variant_dd: Any
    state_mode: Any
    state_text: Any
    run_outputs: list[Any]
    preview_outputs: list[Any]
    images: Any = None  # the image drop zone (gr.File, file paths), sent with Run


def _type_changed(qtype: str) -> tuple[Any, Any, Any]:
    import gradio as gr

    return gr.Textbox(**option_field(qtype)), gr.Textbox(visible=qtype == "noul"), gr.Textbox(visible=qtype == "noul")


def _question(i: int, draft: QuestionDraft) -> tuple[list[Any], tuple[Any, Any, Any]]:
    """One question's inputs (in :data:`schema_builder.FIELDS` order) and its up/down/remove buttons."""
    import gradio as gr

    with gr.Group(elem_id=f"question-{i}"):
        with gr.Row(equal_height=True):
            qid = gr.Textbox(draft.id, label=f"question {i + 1}: id", elem_id=f"q{i}-id", scale=3,
                             interactive=True)
            qtype = gr.Dropdown(list(QUESTION_TYPES), value=draft.type, label="type", elem_id=f"q{i}-type",
                                scale=2, interactive=True)
            up = gr.Button("↑", elem_id=f"q{i}-up", size="sm", scale=0, min_width=40)
            down = gr.Button("↓", elem_id=f"q{i}-down", size="sm", scale=0, min_width=40)
            rm = gr.Button("✕", elem_id=f"q{i}-remove", size="sm", scale=0, min_width=40)
        instructions = gr.Textbox(draft.instructions, label="instructions", elem_id=f"q{i}-instructions",
                                  placeholder="the question to ask (empty: the id is used)", interactive=True)
        options = gr.Textbox(draft.options, lines=3, elem_id=f"q{i}-options", interactive=True,
                             **option_field(draft.type))
        with gr.Row():
            noul_true = gr.Textbox(draft.noul_true, label="true means (optional; null: no description)",
                                   elem_id=f"q{i}-true", visible=draft.type == "noul", interactive=True)
            noul_false = gr.Textbox(draft.noul_false, label="false means (optional; null: no description)",
                                    elem_id=f"q{i}-false", visible=draft.type == "noul", interactive=True)
    qtype.change(_type_changed, [qtype], [options, noul_true, noul_false], api_visibility="private")
    return [qid, qtype, instructions, options, noul_true, noul_false], (up, down, rm)


def _edited(change: Any, *values: Any) -> list[QuestionDraft]:
    return change(schema_builder.drafts_from_values(list(values)))


def _appended(drafts: list[QuestionDraft]) -> list[QuestionDraft]:
    return [*drafts, schema_builder.new_draft(drafts)]


def render_questions(drafts: list[QuestionDraft], wiring: Wiring) -> None:
    """Lay out every question and attach the listeners that need the rendered inputs (called inside gr.render)."""
    import gradio as gr

    comps: list[Any] = []
    buttons: list[tuple[Any, Any, Any]] = []
    if not drafts:
        gr.Markdown("No questions yet: **+ Add question** or load an example.", elem_id="no-questions")
    for i, draft in enumerate(drafts):
        inputs, row_buttons = _question(i, draft)
        comps += inputs
        buttons.append(row_buttons)

    for i, (up, down, rm) in enumerate(buttons):
        for button, change in ((up, partial(schema_builder.move, index=i, offset=-1)),
                               (down, partial(schema_builder.move, index=i, offset=1)),
                               (rm, partial(schema_builder.remove, index=i))):
            button.click(partial(_edited, change), comps, [wiring.questions], api_visibility="private")
    wiring.add_btn.click(partial(_edited, _appended), comps, [wiring.questions], api_visibility="private")

    handlers = wiring.handlers

    tracker = gr.Progress()
    fixed = [wiring.model_dd, wiring.variant_dd, wiring.state_mode, wiring.state_text]
    extra = [wiring.images] if wiring.images is not None else []

    # A set of inputs gives the function one dict, so the Progress parameter stays positional (gradio finds it
    # only among positional parameters) however many inputs the builder has.
    def run_builder(data: dict[Any, Any], progress: gr.Progress = tracker) -> tuple[Any, ...]:
        model, variant, mode, state = (data[c] for c in fixed)
        images = [str(f) for f in data[wiring.images] or []] if extra else None
        return handlers.run_builder(model, variant, mode, state, *(data[c] for c in comps), progress=progress,
                                    images=images)

    wiring.run_btn.click(run_builder, {*fixed, *extra, *comps}, wiring.run_outputs, api_visibility="private")
    preview_inputs = [wiring.state_mode, wiring.state_text, *comps]
    for component in preview_inputs:
        component.change(handlers.preview, preview_inputs, wiring.preview_outputs, api_visibility="private",
                         show_progress="hidden")
