""""Copy as curl" and "copy as Python (typesafe-sdk)" for a request, aimed at a local ``clef-local serve``."""

from __future__ import annotations

import json
from typing import Any

SERVE_URL = "http://127.0.0.1:8077"
SYSTEMONE_PATH = "/v1/systemone"
_SDK_CLASSES = {"noul": "Noul", "choice": "Choice", "score": "Score"}


def curl_snippet(request: dict[str, Any], base_url: str = SERVE_URL) -> str:
    """A shell command that POSTs the request; the body goes through a quoted heredoc, so no escaping is needed."""
    body = json.dumps(request, ensure_ascii=False, indent=2)
    return (f"curl -sS {base_url}{SYSTEMONE_PATH} \\\n"
            "  -H 'Content-Type: application/json' \\\n"
            "  --data-binary @- <<'JSON'\n"
            f"{body}\nJSON\n")


def _literal(value: Any, indent: int) -> str:
    """A Python literal for a JSON value (repr is valid Python for str/int/float/bool/None/list/dict)."""
    if isinstance(value, dict) and value:
        pad = " " * (indent + 4)
        items = ",\n".join(f"{pad}{key!r}: {_literal(v, indent + 4)}" for key, v in value.items())
        return "{\n" + items + ",\n" + " " * indent + "}"
    return repr(value)


def python_snippet(request: dict[str, Any], base_url: str = SERVE_URL) -> str:
    """Python using the official ``typesafe-sdk`` client (``TypeSafeClient.system_one``) against ``clef-local serve``.

    The SDK requires an API key; ``clef-local serve`` without ``--api-key`` accepts any.
    """
    questions = request.get("questions") or {}
    used = sorted({_SDK_CLASSES[q.get("type")] for q in questions.values() if q.get("type") in _SDK_CLASSES})
    lines = [f"from typesafe_sdk import {', '.join([*used, 'TypeSafeClient'])}", "",
             "# `clef-local serve` speaks the same API; without --api-key it accepts any key.",
             f"with TypeSafeClient(base_url={base_url!r}, api_key='local', "
             f"model={request.get('model', 'clef-local')!r}) as client:",
             "    result = client.system_one(",
             f"        state={_literal(request.get('state'), 8)},",
             "        questions={"]
    for qid, question in questions.items():
        cls = _SDK_CLASSES.get(question.get("type"), "dict")
        args = [f"{key}={_literal(question[key], 12)}" for key in ("instructions", "criteria") if key in question]
        lines.append(f"            {qid!r}: {cls}({', '.join(args)}),")
    lines += ["        },", "    )", "print(result.model_dump_json(indent=2))", ""]
    return "\n".join(lines)
