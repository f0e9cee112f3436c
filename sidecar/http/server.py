"""Serving: uvicorn with the connection limits the sidecar needs, and a loopback runner for tests.

Why a protocol of our own: uvicorn's httptools protocol has no header-size limit and no header or
body timeout, and arms its keep-alive timer only after a response. Probing found connections that
send nothing, or half a request line, open for ever; a stalled body never timed out; a 64 MiB header
forwarded to the engine. ``GuardedHttpToolsProtocol`` adds, per connection (``ServingLimits``):

* header deadline: the request line and headers must arrive within ``header_timeout_s`` of the
  connection opening or of the previous response ending; a connection that sent nothing is closed,
  one that sent part of a request gets ``408 Request Timeout`` (RFC 9110 §15.5.9) and is closed;
* header size: more than ``max_header_bytes`` before the headers end is ``431 Request Header Fields
  Too Large`` (RFC 6585 §5), answered as soon as the limit is passed, nothing buffered beyond it;
* body gap: once a request's headers are in, no more than ``body_timeout_s`` between body bytes
  (408 if the response has not started, else the connection is closed);

and uvicorn's ``limit_concurrency`` caps connections (503 beyond it). It also tells the app of a client
that left (``watch_disconnect``, offered in the scope under ``DISCONNECT_WATCH``) from the connection's
own ``connection_lost``, so the proxy needs no task per request parked on ``receive`` to see it. ``run_loopback`` / ``serve_app``
runs an app inside the current event loop (the demo and the tests use real sockets, because ASGI test
transports buffer streams and hide disconnects).
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import uvicorn
from uvicorn.logging import TRACE_LOG_LEVEL
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


@dataclass(frozen=True, slots=True)
class ServingLimits:
    """Per-connection limits of the data port (documented in docs/operate.md and SECURITY.md)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_header_bytes: int = 64 * 1024
    # Header fields per request, counted as the parser reads each one: one write of 9,000 small
    # headers (~100 KiB) was parsed whole and reached the engine before the byte count looked.
    max_header_count: int = 100
    # Connections (and in-flight requests) before new ones get 503; keep it below the fd limit.
    max_client_connections: int = 2048
    keep_alive_s: int = 5
    # Connections beyond the cap answered 503 at once (each holds its descriptor for TURN_AWAY_S); more
    # than this many beyond it are closed without an answer. ``fit_to_descriptors`` raises it to the
    # descriptors the cap leaves spare, so a burst of arrivals is answered, not reset; this default is
    # the least whatever the limit (a burst beyond it cannot eat FD_RESERVE).
    turn_away_max: int = 16


log = logging.getLogger("sidecar.http.server")

# Descriptors kept free whatever the clients do: the pollers' sockets and the GPU file, the log
# pipeline, a tokenizer load, the engine's /metrics, a policy reload. 300 idle connections under
# `nofile=256` once left the GPU poller with `Too many open files`.
FD_RESERVE = 64
# The admin port serves Prometheus and operators: a few connections, never the data port's thousands.
ADMIN_MAX_CONNECTIONS = 64


def fit_to_descriptors(
    limits: ServingLimits, *, admin: bool = False, soft: int | None = None
) -> ServingLimits:
    """``limits`` with ``max_client_connections`` lowered to what the process's descriptor limit holds,
    and ``turn_away_max`` raised to the descriptors it leaves spare.

    A data-port connection may hold an upstream connection to the engine as well, so each counts
    twice; the admin port's connections and ``FD_RESERVE`` are set aside first. With the deploy files'
    ``LimitNOFILE=8192`` the default 2,048 fits; under a smaller limit the cap is lowered and logged.
    A connection turned away (503) holds one descriptor for ``TURN_AWAY_S`` and never an upstream one:
    what the cap leaves of the limit answers a burst beyond it (10,000 clients arriving at a cap of
    4,096 under ``nofile`` 20,000: every one answered, issue #27), and only beyond that is a connection
    closed unanswered.
    """
    if admin:
        return replace(
            limits, max_client_connections=min(limits.max_client_connections, ADMIN_MAX_CONNECTIONS)
        )
    if soft is None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return replace(limits, turn_away_max=max(limits.turn_away_max, limits.max_client_connections))
    usable = soft - FD_RESERVE - ADMIN_MAX_CONNECTIONS
    fit = max(1, usable // 2)
    if fit >= limits.max_client_connections:
        spare = usable - 2 * limits.max_client_connections
        return replace(limits, turn_away_max=max(limits.turn_away_max, spare))
    log.warning(
        "max_client_connections lowered from %d to %d: the descriptor limit (nofile) is %d; raise it "
        "(LimitNOFILE, ulimit -n) to %d for the configured figure",
        limits.max_client_connections,
        fit,
        soft,
        2 * limits.max_client_connections + FD_RESERVE + ADMIN_MAX_CONNECTIONS,
    )
    return replace(limits, max_client_connections=fit)


# The scope key under which the guarded protocol offers watch_disconnect / unwatch_disconnect.
DISCONNECT_WATCH = "sidecar.disconnect_watch"


class BodyWriter:
    """Writes a body piece of one request's response to its connection as uvicorn's ``send`` writes a
    ``more_body`` piece of a chunked answer, from a plain call: no message dict, no coroutine, none of
    ``send``'s checks per piece. The proxy's relay hands a stream's pieces to it from the engine
    connection's own callback, so a relayed event wakes no task (issue #27).

    Refuses (returns False, writes nothing) whatever ``send`` must handle itself: a response not
    started or already complete, one not chunked (a Content-Length, a HEAD), a client gone or a
    transport closing, and a client not keeping up (the transport paused writing: ``send`` waits for
    it to drain). Never raises: it runs inside another connection's ``data_received``."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle

    def __call__(self, data: bytes) -> bool:
        c = self._cycle
        if (
            c.chunked_encoding is not True
            or c.response_complete
            or c.disconnected
            or c.flow.write_paused
            or c.transport.is_closing()
        ):
            return False
        c.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True


# What ``BodyWriter`` reads of uvicorn's ``RequestResponseCycle`` (httptools_impl, uvicorn 0.36-0.55).
_CYCLE_STATE = ("chunked_encoding", "response_complete", "disconnected", "flow", "transport")

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline, a header size limit and a body gap limit.

    Both deadlines share one timer per connection, armed lazily: an event only writes when its
    deadline falls (a float), and the timer, when it fires, acts on a deadline that has passed or
    re-arms at the next one. A timer per deadline cost every request three ``call_later`` and three
    cancels (header deadline at its first byte, body gap at its headers and again at its body), about
    3 % of a small gated request's CPU (py-spy, issue #12); now a keep-alive connection arms about one
    timer per ``header_timeout_s``.
    """

    limits: ClassVar[ServingLimits] = ServingLimits()
    LINGER_S: ClassVar[float] = 1.0
    TURN_AWAY_S: ClassVar[float] = 0.2
    _discarding = False
    _on_lost: Callable[[], None] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # At uvicorn's trace level its message logger wraps the app's send: every body piece is
        # logged through it, so no ``BodyWriter`` goes around it.
        self._body_writer = self.logger.getEffectiveLevel() > TRACE_LOG_LEVEL
        self._in_headers = True
        self._header_bytes = 0
        self._header_due: float | None = None
        self._body_due: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._header_count = 0
        self._parsed_bytes = 0
        self._overflow: str | None = None
        self._arm_header_deadline()
        over = len(self.connections) - self.limits.max_client_connections
        if over > self.limits.turn_away_max:
            # A burst: each 503 would hold its descriptor for TURN_AWAY_S and eat the reserve.
            self._cancel_timers()
            transport.abort()
        elif over > 0:
            self._turn_away()

    def _turn_away(self) -> None:
        """Beyond the cap: 503 now and the descriptor back within ``TURN_AWAY_S``, before the client
        could hold it idle for a header deadline (uvicorn's limit_concurrency answers only once a
        request arrives, and a silent connection never sends one). What the client sends meanwhile is
        discarded, so the close does not reset the connection before it has read the answer."""
        self._cancel_timers()
        self._discarding = True
        body = b"connection limit reached (--max-client-connections)"
        self.transport.write(
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"retry-after: 1\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(self.TURN_AWAY_S, self.transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)
        on_lost = self._on_lost
        if on_lost is not None and self.cycle is not None and self.cycle.disconnected:
            self._on_lost = None
            on_lost()

    # -- the client's disconnect, told to the app without a task reading ``receive`` -------------------

    def watch_disconnect(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the client goes before the current request's answer is complete
        (uvicorn's ``http.disconnect``), until :meth:`unwatch_disconnect`. For an app that has read the
        whole body: a task per request parked on ``receive`` did the same for more CPU (issue #12)."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return
        if cycle.disconnected:
            callback()
            return
        self._on_lost = callback
        # As receive() does before it waits: a transport paused by a large body must read again, or
        # the client's FIN would go unseen.
        self.flow.resume_reading()

    def body_writer(self, send: Any) -> BodyWriter | None:
        """A ``BodyWriter`` for the response that ``send`` (the server's own, as the app was given it)
        sends on this connection; None when ``send`` is not that (a wrapper's), or at uvicorn's trace
        level. Made on demand, held by the caller alone: kept in the scope, writer -> cycle -> scope
        would be a reference cycle per request, left for the garbage collector."""
        cycle = getattr(send, "__self__", None)
        if not self._body_writer or getattr(cycle, "transport", None) is not self.transport:
            return None
        # The writer reads uvicorn's cycle by attribute (not an API): a uvicorn without one of them
        # relays through ``send`` as before, rather than failing inside the engine's callback.
        if not all(hasattr(cycle, name) for name in _CYCLE_STATE) or not hasattr(cycle.flow, "write_paused"):
            return None
        return BodyWriter(cycle)

    def unwatch_disconnect(self, callback: Callable[[], None]) -> None:
        if self._on_lost is callback:  # a later request on this connection may have its own by now
            self._on_lost = None

    def _cancel_timers(self) -> None:
        self._header_due = self._body_due = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _ensure_timer(self, due: float) -> None:
        """The timer fires no later than ``due`` (a later deadline waits for the earlier firing)."""
        if self._timer is not None:
            if self._timer_at <= due:
                return
            self._timer.cancel()
        self._timer_at = due
        self._timer = self.loop.call_at(due, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        now = self.loop.time()
        if self._header_due is not None and now >= self._header_due:
            self._header_due = None
            self._header_deadline()
        if self._body_due is not None and now >= self._body_due:
            self._body_due = None
            self._body_gap()
        # A loop may fire a timer a little early: whatever has not fallen due is waited for again.
        pending = [d for d in (self._header_due, self._body_due) if d is not None]
        if pending and not self.transport.is_closing():
            self._ensure_timer(min(pending))

    def _arm_header_deadline(self) -> None:
        self._header_due = due = self.loop.time() + self.limits.header_timeout_s
        self._ensure_timer(due)

    def _header_deadline(self) -> None:
        if self.transport.is_closing() or not self._in_headers or self._discarding:
            return
        if self._header_bytes:
            self._refuse(408, "the request line and headers did not arrive in time")
        else:
            self.transport.close()  # idle: nothing to answer

    def _arm_body_gap(self) -> None:
        self._body_due = due = self.loop.time() + self.limits.body_timeout_s
        self._ensure_timer(due)

    def _body_gap(self) -> None:
        if self.transport.is_closing() or self._discarding:
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            self._refuse(408, "the request body stalled")
        else:
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` and close. The client may still be sending (a huge header): what it sends
        is discarded for up to ``LINGER_S`` first, since closing a socket with unread input resets the
        connection and the client would never read the answer."""
        body = message.encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (status, _REASONS[status], len(body), body)
        )
        self._cancel_timers()
        self._discarding = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(self.LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        if self._in_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        over = self._in_headers and self._header_bytes > self.limits.max_header_bytes
        if over and not self.transport.is_closing() and not self._discarding:
            self._refuse(431, f"request headers over {self.limits.max_header_bytes:,} bytes")

    def on_url(self, url: bytes) -> None:
        self._parsed_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        """Count each header as the parser reads it, so the limits hold inside one write: a raise
        here stops httptools before the headers complete (the app never sees the request), and
        :meth:`send_400_response` answers 431 instead of uvicorn's 400."""
        self._header_count += 1
        self._parsed_bytes += len(name) + len(value) + 4
        limits = self.limits
        if self._header_count > limits.max_header_count:
            self._overflow = f"more than {limits.max_header_count} request header fields"
        elif self._parsed_bytes > limits.max_header_bytes:
            self._overflow = f"request headers over {limits.max_header_bytes:,} bytes"
        if self._overflow is not None:
            raise _HeaderOverflow(self._overflow)
        super().on_header(name, value)

    def send_400_response(self, msg: str) -> None:
        if self._overflow is None:
            super().send_400_response(msg)
        elif not self._discarding:
            self._refuse(431, self._overflow)

    def on_message_begin(self) -> None:
        self._header_count = 0
        self._parsed_bytes = 0
        super().on_message_begin()
        self._in_headers = True
        self._arm_header_deadline()

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._header_bytes = 0
        self._header_due = None
        self.scope[DISCONNECT_WATCH] = self  # type: ignore[literal-required]
        super().on_headers_complete()
        self._arm_body_gap()

    def on_body(self, body: bytes) -> None:
        # Later than the armed firing, always: a float written, no timer touched.
        self._body_due = self.loop.time() + self.limits.body_timeout_s
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._body_due = None
        # What arrives next is the next request's line and headers: counted from its first byte (that
        # byte is received before httptools calls on_message_begin), so a keep-alive connection's
        # stalled second request is answered 408 like a first one, not closed as if idle.
        self._in_headers = True
        super().on_message_complete()


class _HeaderOverflow(Exception):
    """Raised inside the parser's header callback to stop it at the limit."""


def guarded_protocol(limits: ServingLimits) -> type[GuardedHttpToolsProtocol]:
    """A protocol class bound to ``limits`` (uvicorn takes a class, not an instance)."""
    return type("GuardedHttpTools", (GuardedHttpToolsProtocol,), {"limits": limits})


def uvicorn_options(
    limits: ServingLimits, forwarded_allow_ips: str | None = None, *, admin: bool = False
) -> dict[str, Any]:
    """The uvicorn.Config arguments that apply ``limits``.

    ``forwarded_allow_ips``: the proxies whose ``X-Forwarded-For`` / ``X-Forwarded-Proto`` rewrite a
    request's client address and scheme (uvicorn's syntax: addresses or networks, comma-separated, or
    ``*``). None: no proxy is trusted and uvicorn's proxy-headers middleware is not installed at all.
    uvicorn's own default trusts 127.0.0.1, which lets any process on the host write the client
    address in the access log, and costs every request (and every resumption of a streaming one) a
    middleware frame that only the access log's ``client`` field reads.
    """
    limits = fit_to_descriptors(limits, admin=admin)
    options: dict[str, Any] = {
        "http": guarded_protocol(limits),
        "limit_concurrency": limits.max_client_connections,
        # The kernel's queue of connections not yet accepted (capped by net.core.somaxconn): as deep as
        # the cap, so a burst of that many waits to be accepted instead of retrying its SYN for seconds.
        "backlog": max(2048, limits.max_client_connections),
        "timeout_keep_alive": limits.keep_alive_s,
        "proxy_headers": forwarded_allow_ips is not None,
    }
    if forwarded_allow_ips is not None:
        options["forwarded_allow_ips"] = forwarded_allow_ips
    return options


@asynccontextmanager
async def serve_app(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    lifespan: str = "on",
    limits: ServingLimits | None = None,
    admin: bool = False,
) -> AsyncIterator[str]:
    """Serve ``app``; yield its base URL. Port 0 lets the OS pick a free one. Start-up errors raise."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan=lifespan,
        interface="asgi3",  # a bound method (``app.admin_asgi``) is not auto-detected as ASGI 3
        log_level="warning",
        access_log=False,
        log_config=None,  # lines go through the process's logging, not uvicorn's own handlers
        timeout_graceful_shutdown=2,
        **(uvicorn_options(limits, admin=admin) if limits is not None else {"proxy_headers": False}),
    )
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("uvicorn exited during start-up (see the log above)")
        await asyncio.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), 10)
        except TimeoutError:
            server.force_exit = True
            await task


@asynccontextmanager
async def serve_sidecar(
    app: Any, host: str = "127.0.0.1", *, limits: ServingLimits | None = None
) -> AsyncIterator[tuple[str, str]]:
    """Serve a ``SidecarApp`` as ``serve`` does: the data port (with its lifespan, which starts the
    pollers) and the admin port (``app.admin_asgi``); yield both base URLs, each on a free port."""
    async with (
        serve_app(app, host, limits=limits) as url,
        serve_app(app.admin_asgi, host, lifespan="off", limits=limits, admin=True) as admin_url,
    ):
        yield url, admin_url
