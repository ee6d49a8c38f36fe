"""Slow and surplus connections are dropped: uvicorn's h11 protocol with read deadlines and a connection cap.

uvicorn bounds only the idle time between requests, so a client trickling its headers or body (slowloris) would be
held for ever. :func:`guarded_protocol` reads h11's own state after every chunk and response; the deadlines, the cap
and the 408 / 503 answers are docs/serving.md ("Slow clients").
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

log = logging.getLogger(__name__)


def _raw_response(status: int, reason: str, error_type: str, message: str, extra: str = "") -> bytes:
    """A complete ``Connection: close`` JSON error response, for when no request cycle exists to send one."""
    body = json.dumps({"detail": {"error_type": error_type, "message": message}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{extra}\r\n")
    return head.encode("ascii") + body


def guarded_protocol(header_timeout: float, body_timeout: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's ``H11Protocol`` with the deadlines and the cap of the module docstring (pass it as ``http=``)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        """HTTP/1.1 with header and body read deadlines and a cap on open connections."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.deadline: asyncio.TimerHandle | None = None
            self.phase: str | None = None  # "headers" | "body" | None: what the running deadline waits for

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log.warning("refused a connection from %s: %d connections are open (--max-connections %d)",
                            self._peer(), len(self.connections) - 1, max_connections)
                self.transport.write(_raw_response(
                    503, "Service Unavailable", "too_many_connections",
                    f"the server has {max_connections} connections open, its limit; retry shortly",
                    "retry-after: 1\r\n"))
                self.transport.close()
                return
            self._follow_state()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._follow_state()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._follow_state()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the running application's answer is dropped, not sent into h11's error
                cycle.message_event.set()
                if cycle.response_started:  # half an answer is out: no 400 can follow it
                    self.transport.close()
                    return
            super().send_400_response(msg)

        # ------------------------------------------------------------------ deadlines
        def _follow_state(self) -> None:
            """Start, keep or stop the deadline that matches what h11 is waiting for from the client now."""
            if self.transport.is_closing():
                self._cancel()
                return
            state = self.conn.their_state
            phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
            if phase == self.phase:
                return
            self._cancel()
            if phase is not None:
                seconds = header_timeout if phase == "headers" else body_timeout
                self.deadline = self.loop.call_later(seconds, self._expired, phase)
                self.phase = phase

        def _cancel(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            self.deadline = None
            self.phase = None

        def _expired(self, phase: str) -> None:
            self.deadline = None
            if self.transport.is_closing():
                return
            if phase == "headers":
                pending = bool(self.conn.trailing_data[0])
                if pending:  # a request was started but its headers did not arrive in time
                    self.transport.write(_raw_response(
                        408, "Request Timeout", "request_timeout",
                        f"the request headers did not arrive within {header_timeout:g} s"))
                log.debug("closed a connection from %s: %s after %g s", self._peer(),
                          "request headers incomplete" if pending else "no request", header_timeout)
            else:
                cycle = self.cycle
                if cycle is not None and not cycle.response_started:
                    cycle.disconnected = True  # the application's receive() now reports a disconnect
                    cycle.message_event.set()
                    self.transport.write(_raw_response(
                        408, "Request Timeout", "request_timeout",
                        f"the request body did not arrive within {body_timeout:g} s"))
                log.debug("closed a connection from %s: request body incomplete after %g s", self._peer(),
                          body_timeout)
            self.transport.close()

        def _peer(self) -> str:
            return f"{self.client[0]}:{self.client[1]}" if self.client else "?"

    return GuardedH11Protocol
