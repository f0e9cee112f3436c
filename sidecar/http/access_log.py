"""The access log, one line per HTTP request, and the count of requests in flight (for the drain).

Wraps the sidecar's ASGI app. What a line says comes from what the client was sent (status, bytes, the
``X-Admission-*`` and ``X-Request-Id`` headers) and from the proxy (the upstream's status, in the scope
under ``ACCESS_NOTE``), so the access log cannot disagree with the responses. Never the prompt, never
the query string (it may carry keys). Per request: one closure and, per body chunk, one addition.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("sidecar.http.access_log")

Scope = dict[str, Any]
ASGI = Callable[[Scope, Any, Any], Awaitable[None]]
# A dict the access log puts in the scope (copies of the scope share it); the proxy records the
# upstream's HTTP status in it under "upstream_status" (absent when the sidecar answered itself).
# A relayed body may bypass the per-message wrapper: its chunks go to the server's own send (under
# "raw_send") and their total length is added under "body_bytes" (an SSE stream is thousands of
# messages; the wrapper's coroutine per message was a measurable part of its CPU, issue #12). A relayed
# response's start and end may bypass it too: its status and headers are then put under "status" and
# "headers" before its start is sent (issue #27: two coroutines per request fewer).
ACCESS_NOTE = "sidecar.http.access_log"

_HEADERS = {
    b"x-admission-decision": "decision",
    b"x-admission-reason": "reason",
    b"x-admission-wait-ms": "wait_ms",
    b"x-admission-shadow-decision": "shadow_decision",
    b"x-admission-shadow-reason": "shadow_reason",
    b"x-request-id": "request_id",
}


class AccessLog:
    """ASGI middleware: logs each HTTP request when it ends and tracks how many are in flight."""

    def __init__(self, app: ASGI, clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self.clock = clock
        self.in_flight = 0
        # Drains waiting for no request in flight: a future each, made only when one waits (an Event
        # cleared and set around every request was two Python calls per request for nobody).
        self._idle_waiters: list[asyncio.Future[None]] = []

    async def wait_idle(self) -> None:
        """Return once no request is in flight (the drain waits on this)."""
        if self.in_flight:
            waiter = asyncio.get_running_loop().create_future()
            self._idle_waiters.append(waiter)
            await waiter

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        started = self.clock()
        status: int | None = None
        headers: list[tuple[bytes, bytes]] = []
        sent = 0

        async def send_and_note(message: dict[str, Any]) -> None:
            nonlocal status, headers, sent
            if message["type"] == "http.response.start":
                status, headers = message["status"], message.get("headers", [])
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        note: dict[str, Any] = {"raw_send": send}
        scope[ACCESS_NOTE] = note
        self.in_flight += 1
        ended = "completed"
        try:
            await self.app(scope, receive, send_and_note)
        except asyncio.CancelledError:
            ended = "client_gone"
            raise
        except Exception as e:
            ended = f"error:{type(e).__name__}"
            raise
        finally:
            # The server's send is a bound method of its request cycle, which holds this scope: left in
            # the note, cycle -> scope -> note -> send -> cycle would outlive the request until a
            # garbage collection (one such cycle per request, and full collections of them at load).
            del note["raw_send"]
            self.in_flight -= 1
            if not self.in_flight and self._idle_waiters:
                self._wake_idle()
            if log.isEnabledFor(logging.INFO):  # here, not in _log: no call per request with it off
                if status is None:  # a relayed response's start went by the note (``ACCESS_NOTE``)
                    status, headers = note.get("status"), note.get("headers", [])
                self._log(
                    scope, status, headers, sent + note.get("body_bytes", 0), self.clock() - started, ended
                )

    def _wake_idle(self) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _log(
        self,
        scope: Scope,
        status: int | None,
        headers: list[tuple[bytes, bytes]],
        sent: int,
        elapsed: float,
        ended: str,
    ) -> None:
        fields: dict[str, Any] = {
            "method": scope.get("method"),
            "path": scope.get("path"),
            "status": status,
            "decision": None,
            "reason": None,
            "wait_ms": None,
        }
        for name, value in headers:
            key = _HEADERS.get(name.lower())
            if key is not None:
                fields[key] = value.decode("latin-1")
        if "request_id" not in fields:
            for name, value in scope.get("headers", ()):
                if name == b"x-request-id":
                    fields["request_id"] = value.decode("latin-1")
        fields["upstream_status"] = scope[ACCESS_NOTE].get("upstream_status")
        fields["bytes"] = sent
        fields["duration_ms"] = round(elapsed * 1000, 1)
        client = scope.get("client")
        fields["client"] = f"{client[0]}:{client[1]}" if client else None
        if ended != "completed":
            fields["ended"] = ended
        log.info(
            "%s %s %s",
            fields["method"],
            fields["path"],
            status if status is not None else "-",
            extra={"fields": fields},
        )
