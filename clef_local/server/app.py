"""The FastAPI application of ``clef-local serve`` (docs/serving.md): routes, body handling, auth and error shapes.

:meth:`ServerState.prepare` decodes, parses, validates and encodes a body (``ClefModel.encode``) on the encode thread,
never on the event loop, before it is queued (:mod:`.scheduler`). A ``ClefError`` becomes its status and ``detail``;
anything else is a bug, logged with its traceback and answered 500.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as FastAPIValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import clef_local
from clef_local.errors import ApiUsageError, ClefError
from clef_local.runtime.answers import round_floats
from clef_local.runtime.schema import (
    DEFAULT_LIMITS,
    ModelsResponse,
    SystemOneRequest,
    SystemOneResponse,
    validate_request,
)
from clef_local.server.assets import is_multipart, split_multipart
from clef_local.server.body import BodyTooLargeError, check_content_type, decode_content, parse_json
from clef_local.server.config import ModelTable, ServerConfig
from clef_local.server.guard import HostGuard
from clef_local.server.metrics import CONTENT_TYPE, MetricsMiddleware, ServerMetrics
from clef_local.server.scheduler import BatchScheduler, QueueFullError, ShuttingDownError

if TYPE_CHECKING:
    from clef_local.model import ClefModel
    from clef_local.runtime.encoding import EncodedRecord

log = logging.getLogger(__name__)

SYSTEMONE_PATH = "/v1/systemone"
CLOUDFLARE_PATH = "/accounts/{account}/ai/run/@cf/cloudflare/{model}"
KNOWN_ENCODINGS = frozenset({"identity", "zstd", "gzip", "x-gzip", "deflate"})
DRAIN_FACTOR = 4  # an oversized body up to this many limits is read (and dropped) so the client sees the 413


class AuthenticationError(ClefError):
    """A missing or wrong API key (HTTP 401)."""

    status_code = 401
    error_type = "authentication_error"


class ErrorDetail(BaseModel):
    error_type: str
    message: str


class ErrorBody(BaseModel):
    """``{"detail": {"error_type", "message"}}``: every error except validation."""

    detail: ErrorDetail


class ValidationItem(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationBody(BaseModel):
    """422: ``{"detail": [{"loc": ["body", ...], "msg", "type"}]}``."""

    detail: list[ValidationItem]


class CloudflareEnvelope(BaseModel):
    """Cloudflare's Workers AI envelope around a ``/v1/systemone`` response."""

    result: SystemOneResponse | None
    success: bool
    errors: list[dict[str, Any]]
    messages: list[Any]


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "api_usage_error (unknown model, unsupported input), bad encoding, "
                                             "invalid_host (a Host this server does not answer to)"},
    401: {"model": ErrorBody, "description": "authentication_error (with --api-key)"},
    403: {"model": ErrorBody, "description": "forbidden_origin: a web page's Origin not given with --cors-origin"},
    408: {"model": ErrorBody, "description": "request_timeout: headers or body too slow"},
    413: {"model": ErrorBody, "description": "request_too_large (> 13 MiB) or max_tokens_exceeded"},
    415: {"model": ErrorBody, "description": "unsupported_media_type: not application/json, or an unknown "
                                             "Content-Encoding"},
    422: {"model": ValidationBody, "description": "the body is not a valid SystemOne request"},
    429: {"model": ErrorBody, "description": "rate_limit_error: the queue is full; see Retry-After"},
}


class ServerState:
    """What the routes share: the model table, the scheduler, metrics and settings."""

    def __init__(self, models: Mapping[str, ClefModel], config: ServerConfig) -> None:
        self.config = config
        self.table = ModelTable(models, config.aliases)
        # bodies are decoded, validated, tokenized and their images decoded here, one at a time, never on the loop
        self.encoder: ThreadPoolExecutor | None = None
        self.scheduler = BatchScheduler(models, max_batch=config.max_batch, max_wait_ms=config.max_wait_ms,
                                        max_queue=config.max_queue, confidence=config.confidence,
                                        threads=config.threads)
        self.metrics = ServerMetrics(lambda: self.scheduler.queue_depth, lambda: self.scheduler.in_flight)
        self.scheduler.metrics = self.metrics

    # ------------------------------------------------------------------ pieces
    def authorize(self, request: Request) -> None:
        """Bearer auth when ``--api-key`` is set; otherwise every ``Authorization`` header is accepted."""
        key = self.config.api_key
        if not key:
            return
        header = request.headers.get("authorization")
        if not header:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise AuthenticationError("invalid API key")

    def check_declared_length(self, request: Request) -> None:
        """413 at once for a ``Content-Length`` far over the limit (the body is never read)."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > DRAIN_FACTOR * limit:
            raise BodyTooLargeError(f"the body is {declared[:20]} bytes; the limit is {limit}")

    async def read_body(self, request: Request) -> bytes:
        """The raw body, at most ``max_body_bytes`` (413 beyond; a moderately larger one is drained first)."""
        limit = self.config.max_body_bytes
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > DRAIN_FACTOR * limit:
                break
            if size <= limit:
                chunks.append(chunk)
        if size > limit:
            raise BodyTooLargeError(f"the body is over the limit of {limit} bytes")
        return b"".join(chunks)

    def prepare(self, raw: bytes, encoding: str | None, path_model: str | None,
                content_type: str | None = None) -> tuple[str, EncodedRecord]:
        """Decode, parse, validate and encode a body (JSON, or multipart with image parts): the served model's name
        and the encoded request (on the encode thread)."""
        decoded = decode_content(raw, encoding, self.config.max_body_bytes)
        parts = None
        if is_multipart(content_type):
            decoded, parts = split_multipart(decoded, content_type or "")
        data = parse_json(decoded)
        if path_model is not None and isinstance(data, dict):
            data = {**data, "model": path_model}
        asked = data.get("model") if isinstance(data, dict) else None
        known = None
        if isinstance(asked, str):
            try:
                known = self.table.resolve(asked)
            except ApiUsageError:
                known = None
        model = self.table.get(known or self.table.default)
        request = validate_request(data, getattr(model, "limits", DEFAULT_LIMITS))  # 422 before the name's 400
        served = self.table.resolve(request.model)
        model = self.table.get(served)
        return served, model.encode(request.model_copy(update={"model": served}), parts=parts)

    def error(self, exc: ClefError, envelope: bool) -> JSONResponse:
        """The HTTP response of a ``ClefError``."""
        status = exc.status_code
        if status >= 500:
            log.error("%s: %s", type(exc).__name__, exc)
        headers: dict[str, str] = {}
        if isinstance(exc, QueueFullError):
            headers["Retry-After"] = str(int(exc.retry_after))
            headers["retry-after-ms"] = str(int(exc.retry_after * 1000))
        if isinstance(exc, AuthenticationError):
            headers["WWW-Authenticate"] = "Bearer"
        if envelope:
            body: Any = {"result": None, "success": False,
                         "errors": [{"code": status, "message": str(exc), "error_type": exc.error_type}],
                         "messages": []}
        else:
            body = {"detail": exc.to_detail()}
        return JSONResponse(body, status_code=status, headers=headers)

    async def answer(self, request: Request, path_model: str | None = None, envelope: bool = False) -> Response:
        """The whole ``POST`` pipeline: auth, body, validation, the scheduler, the wire format."""
        try:
            self.authorize(request)
            self.check_declared_length(request)
            check_content_type(request.headers.get("content-type"))
            raw = await self.read_body(request)
            content_type = request.headers.get("content-type")
            encoding = request.headers.get("content-encoding")
            label = (encoding or "identity").strip().lower()
            self.metrics.bodies.labels(label if label in KNOWN_ENCODINGS else "other").inc()
            if self.encoder is None:
                raise ShuttingDownError("the server is not running; retry on another instance")
            loop = asyncio.get_running_loop()
            served, record = await loop.run_in_executor(self.encoder, self.prepare, raw, encoding, path_model,
                                                        content_type)
            response = round_floats(await self.scheduler.submit(served, record), 4)
        except ClefError as exc:
            return self.error(exc, envelope)
        except ClientDisconnect:
            return JSONResponse({"detail": {"error_type": "client_disconnected", "message": "client went away"}},
                                status_code=400)
        except Exception:
            log.exception("internal error while answering %s", request.url.path)
            return internal_error(envelope)
        if envelope:
            return JSONResponse({"result": response, "success": True, "errors": [], "messages": []})
        return JSONResponse(response)


def internal_error(envelope: bool = False) -> JSONResponse:
    message = "internal server error; the server log has the details"
    if envelope:
        return JSONResponse({"result": None, "success": False, "errors": [{"code": 500, "message": message}],
                             "messages": []}, status_code=500)
    return JSONResponse({"detail": {"error_type": "internal_error", "message": message}}, status_code=500)


def create_app(models: Mapping[str, ClefModel], config: ServerConfig | None = None) -> FastAPI:
    """The ASGI app serving ``models`` (``{name: ClefModel}``; the first is the default and the alias target)."""
    config = config or ServerConfig()
    state = ServerState(models, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clef-encode")
        await state.scheduler.start()
        log.info("serving %s (aliases: %s), max batch %d, max wait %g ms, max queue %d", ", ".join(models),
                 ", ".join(config.aliases) or "none", config.max_batch, config.max_wait_ms, config.max_queue)
        try:
            yield
        finally:
            await state.scheduler.stop(config.graceful_timeout_s)
            state.encoder.shutdown(wait=True)
            state.encoder = None

    app = FastAPI(title="clef-local", version=clef_local.__version__, lifespan=lifespan, redirect_slashes=False,
                  description="Clef decision models served locally: the SystemOne API (`POST /v1/systemone`) "
                              "that Jev clients speak, and Cloudflare's Workers AI envelope.")
    app.state.clef = state
    # outermost last: metrics see every answer, the guard runs before CORS and the routes
    if config.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type", "content-encoding"],
                           expose_headers=["retry-after", "retry-after-ms"], max_age=600)
    app.add_middleware(HostGuard, hosts=config.host_names, origins=config.cors_origins)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics,
                       static_paths=[p for p in (app.docs_url, app.redoc_url, app.openapi_url) if p])

    @app.post(SYSTEMONE_PATH, summary="Answer a SystemOne request", response_model=None,
              responses={200: {"model": SystemOneResponse}, **ERROR_RESPONSES})
    async def systemone(request: Request) -> Response:
        """Answer every question of the request in one pass (zstd, gzip or plain JSON bodies up to 13 MiB)."""
        return await state.answer(request)

    @app.post(CLOUDFLARE_PATH, summary="Cloudflare Workers AI envelope", response_model=None,
              responses={200: {"model": CloudflareEnvelope}, **ERROR_RESPONSES})
    async def cloudflare(account: str, model: str, request: Request) -> Response:
        """The same request, the model named by the path, the answer wrapped as ``{"result", "success", ...}``."""
        return await state.answer(request, path_model=model, envelope=True)

    @app.get("/v1/models", summary="List served models", response_model=None,
             responses={200: {"model": ModelsResponse}, 401: ERROR_RESPONSES[401]})
    async def list_models(request: Request) -> Response:
        """Every served model and alias, with a description and release date."""
        try:
            state.authorize(request)
        except ClefError as exc:
            return state.error(exc, envelope=False)
        return JSONResponse({"models": state.table.listing()})

    @app.get("/health", summary="Liveness")
    async def health() -> dict[str, Any]:
        """``{"status": "ok"}`` while the server runs (never needs a key)."""
        return {"status": "ok", "models": list(models), "queue_depth": state.scheduler.queue_depth}

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        """Requests by route and status, latency, batch sizes, inference time and queue depth."""
        try:
            state.authorize(request)
        except ClefError as exc:
            return state.error(exc, envelope=False)
        return PlainTextResponse(state.metrics.render(), media_type=CONTENT_TYPE)

    _install_error_handlers(app)
    _install_openapi(app)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    names = {400: "api_usage_error", 401: "authentication_error", 403: "forbidden", 404: "not_found",
             405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large",
             415: "unsupported_media_type"}

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = {"detail": {"error_type": names.get(exc.status_code, "http_error"), "message": str(exc.detail)}}
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(FastAPIValidationError)
    async def validation_error(_: Request, exc: FastAPIValidationError) -> JSONResponse:
        detail = [{"loc": list(e.get("loc", ["body"])), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
                  for e in exc.errors()]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return internal_error()


def _install_openapi(app: FastAPI) -> None:
    """Document the request body the handlers parse themselves (they read raw bytes for zstd and limits)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        request_schema = SystemOneRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(request_schema.pop("$defs", {}))
        components["SystemOneRequest"] = request_schema
        body = {"required": True, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/SystemOneRequest"}}}}
        for path in (SYSTEMONE_PATH, CLOUDFLARE_PATH):
            schema["paths"][path]["post"]["requestBody"] = body
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
