"""The MCP SDK's own client, held open on a background event loop so that synchronous tests call tools one line at a
time: over stdio (``clef-local mcp`` as a subprocess, as a desktop host launches it) or streamable HTTP (a URL)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]
STATE = "I was charged twice for my coffee this morning and the second charge is still pending."
QUESTIONS: dict[str, Any] = {
    "refund": {"type": "noul", "instructions": "Does the customer want money back?"},
    "team": {"type": "choice", "criteria": {"cards": "Card payments", "transfers": None}},
    "urgency": {"type": "score", "criteria": ["low", "medium", "high"]},
}


def close(got: Any, want: Any, tol: float = 2e-4, where: str = "") -> None:
    """Equal JSON, floats within ``tol`` (the server rounds to 4 decimals, and runs on its own threads)."""
    if isinstance(want, float):
        assert isinstance(got, int | float) and abs(got - want) <= tol, f"{where}: {got} != {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{where}: {list(got)} != {list(want)}"
        for key in want:
            close(got[key], want[key], tol, f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            close(a, b, tol, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def stdio_parameters(args: Sequence[str], env: dict[str, str] | None = None) -> Any:
    """``python -m clef_local.cli mcp ARGS`` from this checkout, with this environment (the SDK's default keeps
    only a few variables; the cache, the thread settings and PYTHONPATH must reach the server)."""
    from mcp import StdioServerParameters

    environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return StdioServerParameters(command=sys.executable, args=["-m", "clef_local.cli", "mcp", *args],
                                 env=environment, cwd=str(ROOT))


@asynccontextmanager
async def http_transport(url: str, headers: dict[str, str] | None = None) -> AsyncIterator[Any]:
    """The SDK's streamable HTTP transport to ``url`` with extra ``headers`` (an API key), its HTTP client closed
    with it."""
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    async with httpx2.AsyncClient(headers=headers or {}, timeout=httpx2.Timeout(60.0, read=300.0)) as client, \
            streamable_http_client(url, http_client=client) as streams:
        yield streams


class McpSession:
    """A connected ``mcp.Client`` on its own thread and loop. ``target``: :func:`stdio_parameters`, a URL or a
    transport. ``with McpSession(target) as s: s.call("decide", {...})``."""

    def __init__(self, target: Any, timeout: float = 300.0) -> None:
        self.target = target
        self.timeout = timeout
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="mcp-client", daemon=True)
        self.client: Any = None
        self._stop: asyncio.Event | None = None
        self._held: Future[None] | None = None

    def __enter__(self) -> McpSession:
        from mcp import Client

        self.thread.start()
        ready = threading.Event()
        failure: list[BaseException] = []

        async def hold() -> None:
            self._stop = asyncio.Event()
            try:
                async with Client(self.target, read_timeout_seconds=self.timeout) as client:
                    self.client = client
                    ready.set()
                    await self._stop.wait()
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                raise

        self._held = asyncio.run_coroutine_threadsafe(hold(), self.loop)
        if not ready.wait(self.timeout) or failure:
            self._held = None  # its failure is this one
            self.__exit__()
            raise RuntimeError(f"the MCP client did not connect: {failure[0] if failure else 'timeout'}")
        return self

    def run(self, coroutine: Awaitable[T]) -> T:
        """Run a coroutine on the client's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(self.timeout)  # type: ignore[arg-type]

    def call(self, name: str, arguments: dict[str, Any] | None = None) -> Any:
        """``tools/call``: the ``CallToolResult``."""
        return self.run(self.client.call_tool(name, arguments))

    def tools(self) -> list[Any]:
        return list(self.run(self.client.list_tools()).tools)

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        try:
            if self._held is not None:
                self._held.result(60)  # the client closed cleanly (a server that died mid-test raises here)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)


def digest_of(result: Any) -> str:
    """The state digest an answer returned (its ``_meta``, the same as its last text line's)."""
    digest = str(result.meta["clef-local/state"])
    assert digest in result.content[-1].text
    return digest
