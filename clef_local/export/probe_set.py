"""The requests export validation runs: the packaged probe set (:func:`clef_local.data.probes.validation_probes`)
or the user's own (``clef-local quantize --validation-data FILE``, read as ``clef-local drift --data`` reads them:
:func:`clef_local.data.jsonl.read_jsonl`). docs/quantization.md#validation.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from clef_local.data.datasets import packaged_datasets_dir
from clef_local.data.jsonl import DataFormatError, read_jsonl
from clef_local.data.probes import validation_probes
from clef_local.errors import ClefError, one_line
from clef_local.export.validation_errors import ValidationUnavailable

log = logging.getLogger(__name__)


def read_validation_data(path: str | Path, n: int) -> list[dict[str, Any]]:
    """The first ``n`` requests of the JSONL file ``path`` (all of them when it holds fewer, logged), each checked
    against the request schema now, so that a bad file is refused before an export writes anything;
    :class:`~clef_local.export.validation_errors.ValidationUnavailable` naming the file and the problem otherwise."""
    from clef_local.runtime.schema import validate_request

    path = Path(path)
    try:
        examples = read_jsonl(path, limit=n)
    except DataFormatError as exc:  # names the file and line already
        raise ValidationUnavailable(f"--validation-data {one_line(exc)}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ValidationUnavailable(f"--validation-data {path} cannot be read ({one_line(exc)})") from exc
    if not examples:
        raise ValidationUnavailable(f"--validation-data {path} holds no requests (one SystemOne request per line)")
    for number, example in enumerate(examples, start=1):
        try:
            validate_request(example.request)
        except ClefError as exc:
            raise ValidationUnavailable(f"--validation-data {path}: request {number} ({example.id}) is not a valid "
                                        f"request ({one_line(exc)})") from exc
    if len(examples) < n:
        log.info("validation on all %d requests of %s (fewer than the %d asked for)", len(examples), path, n)
    else:
        log.info("validation on the first %d requests of %s", n, path)
    return [example.request for example in examples]


def validation_set(n: int, seed: int = 0, *, data: str | Path | None = None, vision: bool = False
                   ) -> list[dict[str, Any]]:
    """The requests export validation runs: the first ``n`` of ``data`` (a JSONL file of requests, in file order; all
    of them when fewer) or, without ``data``, ``n`` packaged probes drawn with ``seed`` (image requests among them
    when ``vision``: the model reads images). :class:`~clef_local.export.validation_errors.ValidationUnavailable`
    (one line, naming the file and the problem) when ``data`` cannot be read or holds an invalid request, or when the
    packaged probe set cannot be read."""
    if data is not None:
        return read_validation_data(data, n)
    try:
        return validation_probes(n, seed, vision=vision, root=packaged_datasets_dir())
    except (FileNotFoundError, OSError, ValueError) as exc:
        raise ValidationUnavailable(f"the packaged probe set cannot be read ({exc})") from exc
