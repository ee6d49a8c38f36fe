"""The calls of ``clef-local mcp``: each tool call becomes a SystemOne request (:mod:`.tools`), is validated and
encoded on one encode thread (``ClefModel.encode``, as ``serve`` does), answered through ``serve``'s scheduler
(:class:`~clef_local.server.scheduler.BatchScheduler`: ``ClefModel.run`` on one inference thread, the queue limit),
and comes back as an MCP result; :func:`build_server` puts it behind the SDK's low-level ``Server``.

An answer is the ``/v1/systemone`` response (floats rounded as on the wire) as JSON text and as structured content,
then a line naming the state's digest (also in ``_meta``) for ``ask_again``. A refused call is an MCP tool error
(``isError``): one line naming the argument path, as the HTTP 4xx would, never a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from mcp import types
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError

import clef_local
from clef_local.errors import ApiUsageError, ClefError, RequestValidationError
from clef_local.mcp.states import DEFAULT_BUDGET, StateStore, sent_state
from clef_local.mcp.tools import (
    MEDIA_FIELDS,
    TYPED,
    Call,
    ToolError,
    again_call,
    decide_call,
    tool_error,
    tool_specs,
    typed_call,
)
from clef_local.runtime.answers import round_floats
from clef_local.runtime.media import IMAGE_FORMATS
from clef_local.runtime.schema import QUESTION_TYPES, validate_request
from clef_local.server.body import check_value
from clef_local.server.config import ModelTable, ServerConfig
from clef_local.server.scheduler import BatchScheduler, QueueFullError

if TYPE_CHECKING:
    from clef_local.model import ClefModel
    from clef_local.runtime.encoding import EncodedRecord

log = logging.getLogger(__name__)

STATE_META = "clef-local/state"  # the `_meta` key of an answer's state digest
INSTRUCTIONS = (
    "Local Clef decision models: they answer typed questions about a state (a text, JSON, images) with a "
    "probability for every allowed option, in one pass, never free text. ask_yes_no, choose and rate ask one "
    "question; decide answers a whole schema; ask_again asks more about a state already sent, by the digest its "
    "answer returned; models lists what is served.")
ANNOTATIONS = types.ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True,
                                    open_world_hint=False)


class UnknownStateError(ClefError):
    """``ask_again`` named a digest this server does not keep (HTTP 404's meaning)."""

    status_code = 404
    error_type = "not_found"


@dataclass(frozen=True)
class Prepared:
    """A call ready for the scheduler: the served model, the encoded request and its state's digest."""

    model: str
    record: EncodedRecord
    digest: str


class ClefTools:
    """The tools over loaded models (``{name: ClefModel}``; the first is the default). ``config``: the scheduler's
    batch and queue settings, confidence and threads, as ``serve``'s; ``remember``: bytes of states kept for
    ``ask_again`` (:class:`~clef_local.mcp.states.StateStore`)."""

    def __init__(self, models: Mapping[str, ClefModel], config: ServerConfig | None = None, *,
                 remember: int = DEFAULT_BUDGET) -> None:
        self.config = config or ServerConfig()
        self.table = ModelTable(models, aliases=())  # MCP clients pick from the listed names: no Jev aliases
        self.models = dict(models)
        self.scheduler = BatchScheduler(self.models, max_batch=self.config.max_batch,
                                        max_wait_ms=self.config.max_wait_ms, max_queue=self.config.max_queue,
                                        confidence=self.config.confidence, threads=self.config.threads)
        self.states = StateStore(remember)
        default = self.models[self.table.default]
        self.specs = {s.name: s for s in tool_specs(list(self.models), default.limits)}
        self.descriptions = {name: _describe(model) for name, model in self.models.items()}
        # calls being prepared or answered at once, at most the scheduler's queue and one batch: beyond it the
        # call is refused at once (429's meaning), so a flood holds no unbounded backlog of arguments
        self.max_calls = self.config.max_queue + self.config.max_batch
        self._calls = 0
        self._encoder: ThreadPoolExecutor | None = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ClefTools]:
        """Start the encode thread and the scheduler (on the running loop); stop them, in-flight calls first."""
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clef-mcp-encode")
        await self.scheduler.start()
        log.info("MCP tools for %s (default %s)", ", ".join(self.models), self.table.default)
        try:
            yield self
        finally:
            await self.scheduler.stop(self.config.graceful_timeout_s)
            self._encoder.shutdown(wait=True)
            self._encoder = None

    def tools(self) -> list[types.Tool]:
        """What ``tools/list`` answers."""
        return [types.Tool(name=s.name, title=s.title, description=s.description, input_schema=s.input_schema,
                           output_schema=s.output_schema, annotations=ANNOTATIONS) for s in self.specs.values()]

    def listing(self) -> dict[str, Any]:
        """The ``models`` tool's answer: each model's description and its state cache's counters now."""
        return {"default": self.table.default,
                "models": [{"name": name, **self.descriptions[name],
                            "state_cache": model.state_cache.stats().to_json()}
                           for name, model in self.models.items()],
                "remembered_states": self.states.describe()}

    async def call(self, name: str, arguments: Mapping[str, Any] | None) -> types.CallToolResult:
        """Answer one tool call; an unknown tool is a protocol error (the spec's), everything else a result."""
        if name not in self.specs:
            raise MCPError(types.INVALID_PARAMS, f"unknown tool {name[:100]!r}; the tools are "
                                                 f"{', '.join(self.specs)}")
        if name == "models":
            if arguments:
                return error_result(tool_error(RequestValidationError([{
                    "loc": ["body", str(next(iter(arguments)))[:100]], "type": "extra_forbidden",
                    "msg": "models takes no arguments"}])))
            listing = self.listing()
            return types.CallToolResult(content=[types.TextContent(text=json.dumps(listing))],
                                        structured_content=listing)
        if self._encoder is None:
            return error_result(ToolError(503, "unavailable", "the server is not running; retry shortly"))
        if self._calls >= self.max_calls:
            busy = QueueFullError(f"{self._calls} calls are waiting, the limit; retry shortly", 1.0)
            return error_result(tool_error(busy))
        self._calls += 1
        try:
            loop = asyncio.get_running_loop()
            prepared = await loop.run_in_executor(self._encoder, self.prepare, name, dict(arguments or {}))
            if isinstance(prepared, ToolError):
                return error_result(prepared)
            response = round_floats(await self.scheduler.submit(prepared.model, prepared.record), 4)
        except ClefError as exc:
            return error_result(tool_error(exc))
        except Exception:
            log.exception("internal error in the MCP tool %s", name)
            return error_result(ToolError(500, "internal_error", "internal error; the server log has the details"))
        finally:
            self._calls -= 1
        return answer_result(response, prepared.digest)

    def prepare(self, name: str, args: dict[str, Any]) -> Prepared | ToolError:
        """On the encode thread: the call's request, validated and encoded, its state remembered (as ``serve``'s
        ``ServerState.prepare``: a request is checked against the model it names, or the default model's limits
        when it names none that is served, before the name is refused)."""
        call: Call | None = None
        try:
            check_value(args)  # serve's body checks that still apply to parsed JSON: depth, lone surrogates, NaN
            call = self._call(name, args)
            data = call.body
            asked = data.get("model")
            known = self._known(asked) if isinstance(asked, str) else None
            request = validate_request(data, self.table.get(known or self.table.default).limits)
        except ClefError as exc:
            return tool_error(exc, call, "state" if isinstance(exc, UnknownStateError) else None)
        try:
            served = self.table.resolve(request.model)
        except ApiUsageError as exc:
            return tool_error(exc, call, "model")
        model = self.table.get(served)
        try:
            record = model.encode(request.model_copy(update={"model": served}))
        except ClefError as exc:
            return tool_error(exc, call)
        digest = model.state_digest(record)
        fields = {k: getattr(request, k) for k in ("state", *MEDIA_FIELDS) if getattr(request, k) is not None}
        self.states.remember(digest, sent_state(served, fields))
        return Prepared(served, record, digest)

    def _call(self, name: str, args: dict[str, Any]) -> Call:
        if name == "decide":
            return decide_call(args, self.table.default)
        if name in TYPED:
            return typed_call(name, args, self.table.default)
        digest = again_call(args)
        sent = self.states.recall(digest)
        if sent is None:
            raise UnknownStateError(f"the state {digest[:12]}… is not known here: it was not sent to this server, or "
                                    f"was forgotten (it keeps the most recent states within --remember, now "
                                    f"{self.states.describe()['budget']}); send it again with decide or a typed "
                                    "tool")
        return Call({**sent.fields, "model": sent.model, "questions": args["questions"]})

    def _known(self, asked: str) -> str | None:
        try:
            return self.table.resolve(asked)
        except ApiUsageError:
            return None


def answer_result(response: dict[str, Any], digest: str) -> types.CallToolResult:
    """An answer: the response as JSON text and structured content, then the digest line for ``ask_again``."""
    result = types.CallToolResult(
        content=[types.TextContent(text=json.dumps(response, ensure_ascii=False)),
                 types.TextContent(text=f"state: {digest} (pass it to ask_again as `state` to ask more about this "
                                        "state without sending it again)")],
        structured_content=response)
    result.meta = {STATE_META: digest}  # the field's name is `_meta` on the wire
    return result


def error_result(error: ToolError) -> types.CallToolResult:
    """A tool error (``isError``): the one-line message, and its status, type and argument paths as structured
    content."""
    return types.CallToolResult(content=[types.TextContent(text=error.message)], structured_content=error.to_json(),
                                is_error=True)


def _describe(model: ClefModel) -> dict[str, Any]:
    """What the ``models`` tool says of a model that does not change while it is served."""
    info = model.describe()
    media = info.get("media")  # a dict when images are accepted, else the reason they are not
    return {"path": info.get("path"), "architecture": info.get("architecture"), "context_tokens": model.max_length,
            "question_types": list(QUESTION_TYPES), "limits": asdict(model.limits),
            "weights": {"quantization": info.get("quantization"), "dtype": info.get("backbone_dtype")},
            "backend": info.get("backend"), "device": info.get("device"), "confidence": model.confidence,
            "state_formats": ["string", "object", "array"], "media": media,
            "image_formats": list(IMAGE_FORMATS) if isinstance(media, dict) else [],
            "media_limits": asdict(model.media_limits)}


def build_server(tools: ClefTools) -> Server[dict[str, Any]]:
    """The SDK's low-level server over ``tools``: ``tools/list`` and ``tools/call``; its lifespan runs
    :meth:`ClefTools.running` (once per process on stdio and on streamable HTTP)."""

    async def list_tools(_: Any, __: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools.tools())

    async def call_tool(_: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        return await tools.call(params.name, params.arguments)

    @asynccontextmanager
    async def lifespan(_: Server[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        async with tools.running():
            yield {}

    return Server("clef-local", version=clef_local.__version__, title="clef-local", instructions=INSTRUCTIONS,
                  lifespan=lifespan, on_list_tools=list_tools, on_call_tool=call_tool)
