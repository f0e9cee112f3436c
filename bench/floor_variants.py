"""Where the floor's CPU goes: the relay of ``bench/floor_proxy.py`` with one side at a time replaced.

A benchmark tool, not product code. Every variant does the floor's job and nothing else: read the
request, forward it to the upstream on a pooled keep-alive connection, relay status, headers and body,
stream chunked SSE. One process each, all on uvloop, loaded one at a time against nginx in the same run:

- ``a``  uvicorn (httptools protocol, ASGI) + aiohttp ``ClientSession``: ``bench/floor_proxy.py`` itself.
- ``b``  uvicorn + a minimal upstream client: an asyncio ``Protocol`` with httptools' response parser
  over pooled connections, the body handed to the ASGI task chunk by chunk (as ``iter_any``).
- ``c``  a minimal server (asyncio ``Protocol`` + httptools' request parser, no ASGI) + aiohttp; one
  task per request, the response chunked by the server as uvicorn does.
- ``d``  minimal server + minimal client, no task per request: the upstream connection's callbacks
  write to the client's transport, the body bytes as they came (a chunked body keeps its framing: HTTP/1.1
  lets a proxy relay it unchanged to an HTTP/1.1 client), only the head re-made.
- ``e``  ``d`` with one task per request that awaits the upstream's answer (what a gate's ``await``
  in the request path costs on top of ``d``).
- ``f``  minimal both with a task per request that reads the parsed body and writes it chunked again,
  as ``c`` does with aiohttp's: ``f`` against ``e`` is the per-chunk relay, ``f`` against ``c``
  the client alone under the same server, ``b`` against ``a`` the client alone under uvicorn.
- ``g``  ``a`` with ``sidecar/http/engine_client.py``'s client in place of aiohttp's: ``b``'s client with what
  the sidecar needs on top (timeouts, a connection limit, idle expiry, error classes, backpressure).

Shapes as ``bench/overhead.py``'s saturation (wrk, 64 connections): ``small`` (a small ``POST
/generate``), ``small-passthrough`` (``GET /v1/models``), ``sse`` (100 events of ~200 B a request).
Each round loads every path once per shape in a shuffled order; the figures are CPU per 1,000
requests / events and req/s of each process, each divided by nginx's of the same round; the
medians over rounds are reported with their spread (min-max). ``--profile`` adds a py-spy profile of
``a`` (small and SSE) attributed to uvicorn/ASGI, the aiohttp client, the app's glue, asyncio and
the event loop (uvloop's C and the system calls under it, with ``--native``).

    .venv/bin/python bench/floor_variants.py [--quick] [--rounds N] [--seconds S] [--profile]
    .venv/bin/python bench/floor_variants.py serve --variant d --upstream URL --port PORT

Writes ``bench/results/floor-variants.json`` (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import http
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import floor_proxy  # bench/ is not a package: imported from beside this file
import overhead

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "a": "uvicorn + aiohttp (the floor)",
    "b": "uvicorn + minimal client",
    "c": "minimal server + aiohttp",
    "d": "minimal both, callbacks, raw body relay",
    "e": "minimal both + a task per request",
    "f": "minimal both + a task, body re-framed",
    "g": "uvicorn + sidecar/http/engine_client.py (the product's lean client)",
}
# Hop-by-hop (RFC 9110 §7.6.1) plus what the relay sets itself.
_DROP_REQUEST = frozenset(
    b"connection keep-alive proxy-connection te trailer transfer-encoding upgrade host content-length".split()
)
_DROP_RESPONSE_REFRAMED = frozenset(b"connection keep-alive transfer-encoding".split())
_DROP_RESPONSE_RAW = frozenset(b"connection keep-alive".split())  # the framing is relayed as it is
_REASON = {s.value: s.phrase.encode() for s in http.HTTPStatus}
BUFFER_HIGH = 256 * 1024  # a relay pauses its reading side above this much unwritten data
POOL_IDLE_S = 4.0  # below uvicorn's 5 s keep-alive, as the sidecar's connector


# --------------------------------------------------------------------------------------------------
# the minimal upstream client: asyncio Protocol + httptools' response parser, pooled connections
# --------------------------------------------------------------------------------------------------


class UpstreamConn:
    """One keep-alive connection to the upstream; one exchange at a time, handed to a ``sink``.

    The sink gets ``head(status, headers)``, then either ``body(bytes)`` per parsed (de-chunked)
    piece or, in raw mode, ``raw(bytes)``: the body bytes as received, framing included; then
    ``done()``, or ``failed(exc)`` if the connection breaks first.
    """

    __slots__ = (
        "_complete",
        "_head_done",
        "_keep_alive",
        "_tail",
        "headers",
        "parser",
        "pool",
        "raw_mode",
        "sink",
        "transport",
    )

    def __init__(self, pool: UpstreamPool) -> None:
        import httptools

        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.sink: Any = None
        self.raw_mode = False
        self.headers: list[tuple[bytes, bytes]] = []
        self._head_done = False
        self._complete = False
        self._keep_alive = False
        self._tail = b""

    # asyncio.Protocol
    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool.discard(self)
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.failed(exc or ConnectionError("upstream closed the connection"))

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        pass

    def eof_received(self) -> None:
        return None

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is None:  # nothing asked: a late byte or a close notice; the connection is unusable
            self.transport.close()  # type: ignore[union-attr]
            return
        head_before = self._head_done
        try:
            self.parser.feed_data(data)
        except Exception as e:
            self.sink = None
            self.transport.close()  # type: ignore[union-attr]
            sink.failed(e)
            return
        if self.raw_mode:
            if not head_before:
                if not self._head_done:
                    self._tail = (self._tail + data)[-3:]
                    return
                sink.head(self.parser.get_status_code(), self.headers)
                # The head ends in this piece (httptools saw its end): the rest is body bytes. Its end
                # may straddle pieces, so the previous piece's last 3 bytes are searched with it.
                end = (self._tail + data).find(b"\r\n\r\n") + 4 - len(self._tail)
                data = data[end:]
            if data:
                sink.raw(data)
        if self._complete:
            self._finish()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._head_done = True
        if not self.raw_mode:
            self.sink.head(self.parser.get_status_code(), self.headers)

    def on_body(self, body: bytes) -> None:
        if not self.raw_mode:
            self.sink.body(body)

    def on_message_complete(self) -> None:
        # httptools answers should_keep_alive() truly only inside this callback (False once it returns).
        self._complete = True
        self._keep_alive = self.parser.should_keep_alive()

    def _finish(self) -> None:
        sink, self.sink = self.sink, None
        if self._keep_alive:
            self.pool.release(self)
        else:
            self.transport.close()  # type: ignore[union-attr]
        sink.done()

    def send(self, request: bytes, sink: Any, raw: bool) -> None:
        self.sink = sink
        self.raw_mode = raw
        self.headers = []
        self._head_done = self._complete = False
        self._tail = b""
        sink.up = self
        self.transport.write(request)  # type: ignore[union-attr]


class UpstreamPool:
    """Idle keep-alive connections to one upstream, newest first; a connection idle for
    ``POOL_IDLE_S`` is closed rather than reused (the upstream may be closing it)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[tuple[UpstreamConn, float]] = []
        self.loop = asyncio.get_event_loop()

    def take(self) -> UpstreamConn | None:
        now = self.loop.time()
        while self.idle:
            conn, since = self.idle.pop()
            if now - since < POOL_IDLE_S and not conn.transport.is_closing():  # type: ignore[union-attr]
                return conn
            conn.transport.close()  # type: ignore[union-attr]
        return None

    async def connect(self) -> UpstreamConn:
        _, conn = await self.loop.create_connection(lambda: UpstreamConn(self), self.host, self.port)
        return conn

    async def acquire(self) -> UpstreamConn:
        return self.take() or await self.connect()

    def send(self, request: bytes, sink: Any, raw: bool) -> None:
        """Send on an idle connection now, or on a new one once connected (no task unless connecting)."""
        conn = self.take()
        if conn is not None:
            conn.send(request, sink, raw)
            return

        def connected(f: asyncio.Future[UpstreamConn]) -> None:
            if f.exception() is not None:
                sink.failed(f.exception())
            else:
                f.result().send(request, sink, raw)

        self.loop.create_task(self.connect()).add_done_callback(connected)

    def release(self, conn: UpstreamConn) -> None:
        self.idle.append((conn, self.loop.time()))

    def discard(self, conn: UpstreamConn) -> None:
        for i, (c, _) in enumerate(self.idle):
            if c is conn:
                del self.idle[i]
                return


def request_bytes(method: bytes, target: bytes, host: bytes, headers: Any, body: bytes) -> bytes:
    """An HTTP/1.1 request head with the client's end-to-end headers, and the body by Content-Length."""
    parts = [method, b" ", target, b" HTTP/1.1\r\nhost: ", host, b"\r\n"]
    for k, v in headers:
        if k.lower() not in _DROP_REQUEST:
            parts += (k, b": ", v, b"\r\n")
    if body or method in (b"POST", b"PUT", b"PATCH"):
        parts += (b"content-length: ", str(len(body)).encode(), b"\r\n")
    parts += (b"\r\n", body)
    return b"".join(parts)


class AsyncResponse:
    """A sink for a coroutine consumer (``b``): ``await started``, then ``await read()`` until None.
    Like aiohttp's ``iter_any``: each read returns everything received since the last one."""

    __slots__ = ("chunks", "eof", "error", "headers", "paused", "size", "started", "status", "up", "waiter")

    def __init__(self) -> None:
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: collections.deque[bytes] = collections.deque()
        self.size = 0
        self.waiter: asyncio.Future[None] | None = None
        self.eof = False
        self.error: BaseException | None = None
        self.up: UpstreamConn | None = None
        self.paused = False

    def head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status, self.headers = status, headers
        self.started.set_result(None)

    def body(self, data: bytes) -> None:
        self.chunks.append(data)
        self.size += len(data)
        if self.size > BUFFER_HIGH and self.up is not None and not self.paused:
            self.paused = True
            self.up.transport.pause_reading()  # type: ignore[union-attr]
        self._wake()

    def done(self) -> None:
        self.eof = True
        self._wake()

    def failed(self, exc: BaseException) -> None:
        self.error = exc
        if not self.started.done():
            self.started.set_exception(exc)
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def read(self) -> bytes | None:
        while not self.chunks:
            if self.error is not None:
                raise self.error
            if self.eof:
                return None
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
            self.waiter = None
        data = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.size = 0
        if self.paused:
            self.paused = False
            self.up.transport.resume_reading()  # type: ignore[union-attr]
        return data


# --------------------------------------------------------------------------------------------------
# (a), (b): ASGI apps under uvicorn
# --------------------------------------------------------------------------------------------------


class MinimalClientApp:
    """(b): the floor's ASGI app with the minimal client in place of aiohttp."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").rstrip("/").partition(":")
        self.hostport = f"{host}:{port}".encode()
        self.addr = (host, int(port))
        self.pool: UpstreamPool | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    self.pool = UpstreamPool(*self.addr)
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        assert self.pool is not None
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        target = scope["raw_path"]
        if scope["query_string"]:
            target += b"?" + scope["query_string"]
        resp = AsyncResponse()
        conn = await self.pool.acquire()
        conn.send(
            request_bytes(scope["method"].encode(), target, self.hostport, scope["headers"], body),
            resp,
            False,
        )
        await resp.started
        out = [(k.lower(), v) for k, v in resp.headers if k.lower() not in _DROP_RESPONSE_REFRAMED]
        await send({"type": "http.response.start", "status": resp.status, "headers": out})
        while (chunk := await resp.read()) is not None:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


class LeanClientFloor(floor_proxy.FloorProxy):
    """(g): the floor with the sidecar's own lean client (``sidecar/http/engine_client.py``) for aiohttp's."""

    def make_session(self) -> Any:
        from sidecar.http.engine_client import UpstreamClient

        return UpstreamClient(
            self.upstream, max_connections=1024, connect_timeout_s=5.0, read_timeout_s=1800.0
        )


# --------------------------------------------------------------------------------------------------
# (c), (d), (e): the minimal server
# --------------------------------------------------------------------------------------------------


class Request:
    __slots__ = ("body", "headers", "keep_alive", "method", "target")

    def __init__(self, method: bytes, target: bytes, headers: list, body: bytes, keep_alive: bool) -> None:
        self.method, self.target, self.headers, self.body, self.keep_alive = (
            method,
            target,
            headers,
            body,
            keep_alive,
        )


class Downstream:
    """One client connection: httptools' request parser, one request relayed at a time (a pipelined
    next request waits its turn), the response written straight to the transport. ``handler(self,
    request)`` starts a request's relay; the relay calls :meth:`finished` when the response is out."""

    def __init__(self, handler: Callable[[Downstream, Request], None]) -> None:
        import httptools

        self.handler = handler
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.queue: collections.deque[Request] = collections.deque()
        self.writable: asyncio.Future[None] | None = None
        self.paused = False
        self.on_resume: Callable[[], None] | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def eof_received(self) -> None:
        return None

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        if self.on_resume is not None:
            self.on_resume()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception:
            self.write_error(400)

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        req = Request(
            self.parser.get_method(), self._url, self._headers, body, self.parser.should_keep_alive()
        )
        if self.busy:
            self.queue.append(req)
        else:
            self.busy = True
            self.handler(self, req)

    def finished(self, keep_alive: bool) -> None:
        if self.transport is None:
            return
        if not keep_alive:
            self.transport.close()
            return
        if self.queue:
            self.handler(self, self.queue.popleft())
        else:
            self.busy = False

    def write_error(self, status: int) -> None:
        if self.transport is not None:
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                % (status, _REASON[status])
            )
            self.transport.close()
            self.transport = None

    async def drain(self) -> None:
        if self.paused and self.transport is not None:
            self.writable = asyncio.get_running_loop().create_future()
            await self.writable


def response_head(status: int, headers: Any, drop: frozenset[bytes], chunked: bool) -> bytes:
    parts = [b"HTTP/1.1 %d %s\r\n" % (status, _REASON.get(status, b"Unknown"))]
    for k, v in headers:
        if k.lower() not in drop:
            parts += (k, b": ", v, b"\r\n")
    if chunked:
        parts.append(b"transfer-encoding: chunked\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


class AiohttpRelay:
    """(c): a task per request, aiohttp's client, the body re-framed as chunks when it has no length."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.session: Any = None

    def __call__(self, conn: Downstream, req: Request) -> None:
        asyncio.get_running_loop().create_task(self.relay(conn, req))

    async def relay(self, conn: Downstream, req: Request) -> None:
        import aiohttp
        from yarl import URL

        if self.session is None:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1024), auto_decompress=False
            )
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in req.headers
            if k.lower() not in (b"host", b"content-length")
        ]
        url = URL(self.upstream + req.target.decode("latin-1"), encoded=True)
        try:
            async with self.session.request(
                req.method.decode(), url, data=req.body or None, headers=headers
            ) as resp:
                t = conn.transport
                if t is None:
                    return
                chunked = b"content-length" not in (k.lower() for k, _ in resp.raw_headers)
                t.write(response_head(resp.status, resp.raw_headers, _DROP_RESPONSE_REFRAMED, chunked))
                async for chunk in resp.content.iter_any():
                    if conn.transport is None:
                        return
                    if chunked:
                        conn.transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
                    else:
                        conn.transport.write(chunk)
                    await conn.drain()
                if chunked and conn.transport is not None:
                    conn.transport.write(b"0\r\n\r\n")
        except (aiohttp.ClientError, OSError):
            conn.write_error(502)
            return
        conn.finished(req.keep_alive)


class RawRelay:
    """(d): the upstream connection's callbacks write the response to the client: the head re-made,
    the body bytes as received (a chunked body keeps its framing). No task, no future per request."""

    __slots__ = ("conn", "req", "up")

    def __init__(self, conn: Downstream, req: Request) -> None:
        self.conn, self.req = conn, req
        self.up: UpstreamConn | None = None

    def head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        t = self.conn.transport
        if t is not None:
            t.write(response_head(status, headers, _DROP_RESPONSE_RAW, False))

    def raw(self, data: bytes) -> None:
        t = self.conn.transport
        if t is not None:
            t.write(data)
            if self.conn.paused and self.up is not None:  # the client reads slower than the upstream sends
                up = self.up
                up.transport.pause_reading()  # type: ignore[union-attr]
                self.conn.on_resume = lambda: up.transport.resume_reading()  # type: ignore[union-attr]

    def done(self) -> None:
        self.conn.on_resume = None
        self.conn.finished(self.req.keep_alive)

    def failed(self, exc: BaseException | None) -> None:
        t = self.conn.transport
        if t is not None:
            t.close()  # mid-response (or before the head): a broken connection is the honest answer
            self.conn.transport = None


class Minimal:
    """(d), (e), (f): the minimal server handing each request to the minimal client. ``mode``:
    ``raw`` (d: callbacks only), ``raw-task`` (e: a task awaits the raw relay's end), ``reframe``
    (f: a task reads the parsed body and writes it chunked again, as c does with aiohttp's)."""

    def __init__(self, upstream: str, mode: str = "raw") -> None:
        host, _, port = upstream.removeprefix("http://").rstrip("/").partition(":")
        self.hostport = f"{host}:{port}".encode()
        self.addr = (host, int(port))
        self.pool: UpstreamPool | None = None
        self.mode = mode

    def __call__(self, conn: Downstream, req: Request) -> None:
        if self.pool is None:
            self.pool = UpstreamPool(*self.addr)
        data = request_bytes(req.method, req.target, self.hostport, req.headers, req.body)
        if self.mode == "raw":
            self.pool.send(data, RawRelay(conn, req), True)
        elif self.mode == "raw-task":
            asyncio.get_running_loop().create_task(self.relay_in_task(conn, req, data))
        else:
            asyncio.get_running_loop().create_task(self.reframe(conn, req, data))

    async def reframe(self, conn: Downstream, req: Request, data: bytes) -> None:
        assert self.pool is not None
        resp = AsyncResponse()
        up = await self.pool.acquire()
        up.send(data, resp, False)
        try:
            await resp.started
            t = conn.transport
            if t is None:
                return
            chunked = b"content-length" not in (k.lower() for k, _ in resp.headers)
            t.write(response_head(resp.status, resp.headers, _DROP_RESPONSE_REFRAMED, chunked))
            while (chunk := await resp.read()) is not None:
                if conn.transport is None:
                    return
                if chunked:
                    conn.transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
                else:
                    conn.transport.write(chunk)
                await conn.drain()
            if chunked and conn.transport is not None:
                conn.transport.write(b"0\r\n\r\n")
        except Exception:  # the upstream broke: so does the client's connection
            if conn.transport is not None:
                conn.transport.close()
                conn.transport = None
            return
        conn.finished(req.keep_alive)

    async def relay_in_task(self, conn: Downstream, req: Request, data: bytes) -> None:
        assert self.pool is not None
        sink = _AwaitedRawRelay(conn, req)
        up = await self.pool.acquire()
        up.send(data, sink, True)
        await sink.finished


class _AwaitedRawRelay(RawRelay):
    __slots__ = ("finished",)

    def __init__(self, conn: Downstream, req: Request) -> None:
        super().__init__(conn, req)
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def done(self) -> None:
        super().done()
        self.finished.set_result(None)

    def failed(self, exc: BaseException | None) -> None:
        super().failed(exc)
        if not self.finished.done():
            self.finished.set_result(None)


def serve(variant: str, upstream: str, port: int) -> None:
    import uvloop

    if variant == "a":
        import uvicorn

        uvicorn.run(floor_proxy.FloorProxy(upstream), host="127.0.0.1", port=port, log_level="warning",
                    access_log=False, loop="uvloop", http="httptools")  # fmt: skip
        return
    if variant == "g":
        import uvicorn

        uvicorn.run(LeanClientFloor(upstream), host="127.0.0.1", port=port, log_level="warning",
                    access_log=False, loop="uvloop", http="httptools")  # fmt: skip
        return
    if variant == "b":
        import uvicorn

        uvicorn.run(MinimalClientApp(upstream), host="127.0.0.1", port=port, log_level="warning",
                    access_log=False, loop="uvloop", http="httptools")  # fmt: skip
        return
    handler: Callable[[Downstream, Request], None] = (
        AiohttpRelay(upstream)
        if variant == "c"
        else Minimal(upstream, mode={"d": "raw", "e": "raw-task", "f": "reframe"}[variant])
    )

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: Downstream(handler), "127.0.0.1", port, backlog=4096)
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(main())


# --------------------------------------------------------------------------------------------------
# the measurement
# --------------------------------------------------------------------------------------------------

SHAPES = {
    "small": ("/generate", "POST", overhead.SMALL_BODY, 1),
    "small-passthrough": ("/v1/models", "GET", None, 0),
    "sse": (f"/generate?events={overhead.SSE_EVENTS}", "POST", overhead.SSE_BODY, overhead.SSE_EVENTS),
}


def plan_cores(pin: str) -> overhead.Cores:
    """overhead.py's plan (12+ cores: each server its own; the variants on the sidecar's two).
    Fewer: ``pin=split`` puts the proxy under test alone on the last core, the upstream and wrk on
    the others; ``pin=none`` lets everything share."""
    cores = overhead.Cores.plan()
    cpus = sorted(os.sched_getaffinity(0))
    if cores.sidecar is None and pin == "split" and len(cpus) >= 2:
        rest = cpus[:-1]
        return overhead.Cores(upstream=rest, nginx=cpus[-1:], sidecar=cpus[-1:], wrk=rest,
                              client=rest, upstream_workers=1, wrk_threads=min(2, len(rest)))  # fmt: skip
    return cores


@contextlib.contextmanager
def servers(
    args: argparse.Namespace, cores: overhead.Cores, tmp: Path
) -> Iterator[dict[str, overhead.Server]]:
    env = overhead.bench_env(args)
    up = overhead.Server("direct", f"http://127.0.0.1:{overhead.free_port()}")
    ng = overhead.Server("nginx", f"http://127.0.0.1:{overhead.free_port()}")
    variants = {v: overhead.Server(v, f"http://127.0.0.1:{overhead.free_port()}") for v in args.variants}
    procs: list[subprocess.Popen[bytes]] = []
    log = (tmp / "servers.log").open("wb")
    try:
        overhead.start_upstream(up, cores, env, log)
        procs.append(up.proc)  # type: ignore[arg-type]
        overhead.start_nginx(ng, up, args, cores, tmp, log)
        procs.append(ng.proc)  # type: ignore[arg-type]
        for v, s in variants.items():
            s.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "serve", "--variant", v, "--upstream", up.url,
                 "--port", s.url.rsplit(":", 1)[1]],
                cwd=ROOT, env=env, stdout=log, stderr=log, preexec_fn=overhead._pinned(cores.sidecar),
            )  # fmt: skip
            procs.append(s.proc)
        for s in (up, ng, *variants.values()):
            asyncio.run(overhead.wait_up(s.url + "/health"))
        yield {"nginx": ng, **variants, "direct": up}
    except BaseException:
        log.flush()
        sys.stderr.write((tmp / "servers.log").read_text()[-4000:])
        raise
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()


async def _fetch(url: str, method: str, body: str | None) -> tuple[int, bytes]:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.request(method, url, data=body,
                                                       headers={"Content-Type": "application/json"}) as r:  # fmt: skip
        return r.status, await r.read()


def check(srv: dict[str, overhead.Server]) -> None:
    """Every path answers every shape as the upstream does, byte for byte, twice (the second on a
    pooled connection): a variant that relays wrongly measures nothing."""
    for kind, (path, method, body, _) in SHAPES.items():
        want = asyncio.run(_fetch(srv["direct"].url + path, method, body))
        for name, s in srv.items():
            for _ in range(2):
                got = asyncio.run(_fetch(s.url + path, method, body))
                if got != want:
                    raise RuntimeError(f"{name} answers {kind} wrongly: {got[0]} {got[1][:200]!r}")


def measure(args: argparse.Namespace, cores: overhead.Cores, srv: dict[str, overhead.Server], tmp: Path,
            rounds: int) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    paths = [p for p in srv if p != "direct"]
    for rnd in range(rounds):
        for kind, (path, method, body, events) in SHAPES.items():
            script = overhead.lua_script(tmp, kind, method, body)
            order = random.sample(paths, len(paths))
            for name in order:
                s = srv[name]
                overhead.wrk(args, cores, s.url + path, script, 1)  # warm: connections, first-use paths
                load0 = os.getloadavg()[0]
                cpu0 = overhead.cpu_seconds(s.pid)
                r = overhead.wrk(args, cores, s.url + path, script, args.seconds)
                cpu = overhead.cpu_seconds(s.pid) - cpu0
                n = r["requests"]
                dur = r["duration_us"] / 1e6
                rows.append({
                    "round": rnd, "kind": kind, "path": name, "requests": n, "requests_per_s": n / dur,
                    "cpu_ms_per_1000_requests": 1e6 * cpu / max(1, n),
                    "cpu_ms_per_1000_events": 1e6 * cpu / max(1, n * events) if events > 1 else None,
                    "cpu_share": cpu / dur, "p50_ms": r["p50_us"] / 1000, "p99_ms": r["p99_us"] / 1000,
                    "errors": r["errors"] + r["status_errors"], "load1": round(load0, 2),
                })  # fmt: skip
                print(f"  round {rnd + 1} {kind:18} {name:6} {n / dur:>9,.0f} req/s "
                      f"{1e6 * cpu / max(1, n):>7.1f} ms CPU/1k req  cpu {cpu / dur:4.2f}  load {load0:.1f}",
                      flush=True)  # fmt: skip
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per shape and path: medians of the per-round figures and of their ratios to nginx's same round."""
    out = []
    for kind in SHAPES:
        metric = "cpu_ms_per_1000_events" if kind == "sse" else "cpu_ms_per_1000_requests"
        ng = {r["round"]: r for r in rows if r["kind"] == kind and r["path"] == "nginx"}
        for path in dict.fromkeys(r["path"] for r in rows):
            mine = [r for r in rows if r["kind"] == kind and r["path"] == path]
            cpu_ratio = [r[metric] / ng[r["round"]][metric] for r in mine]
            rps_ratio = [r["requests_per_s"] / ng[r["round"]]["requests_per_s"] for r in mine]
            floor = {r["round"]: r for r in rows if r["kind"] == kind and r["path"] == "a"}
            vs_floor = [floor[r["round"]][metric] / r[metric] for r in mine] if floor else []
            out.append({
                "kind": kind, "path": path, "label": VARIANTS.get(path, path), "metric": metric,
                "rounds": len(mine),
                "cpu_ms_per_1000": statistics.median(r[metric] for r in mine),
                "requests_per_s": statistics.median(r["requests_per_s"] for r in mine),
                "cpu_vs_nginx": statistics.median(cpu_ratio),
                "cpu_vs_nginx_min": min(cpu_ratio), "cpu_vs_nginx_max": max(cpu_ratio),
                "requests_per_s_vs_nginx": statistics.median(rps_ratio),
                "floor_cpu_over_this": statistics.median(vs_floor) if vs_floor else None,
                "cpu_share": statistics.median(r["cpu_share"] for r in mine),
                "errors": sum(r["errors"] for r in mine),
            })  # fmt: skip
    return out


# -- py-spy ----------------------------------------------------------------------------------------

# Which component a frame belongs to, by its file (py-spy prints ``name (file:line)``; native frames
# name the C file of the extension: multidict's hashtable headers, aiohttp's and httptools' parsers).
OWNERS = (
    (
        "aiohttp client",
        (
            "aiohttp/",
            "yarl/",
            "multidict/",
            "aiosignal/",
            "frozenlist/",
            "propcache/",
            "aiohappyeyeballs/",
            "_http_parser.c",
            "_multidict.c",
            "htkeys.h",
            "hashtable.h",
            "iter.h",
            "http_parser.c",
            "_websocket",
        ),
    ),
    ("uvicorn/ASGI server", ("uvicorn/", "parser.c", "httptools/")),
    ("app glue (floor_proxy.py)", ("floor_proxy.py",)),
    ("asyncio tasks/futures", ("asyncio/", "_asynciomodule.c")),
    (
        "uvloop/libuv (C)",
        (
            "loop.c",
            "uvloop/",
            "core.c",
            "linux.c",
            "stream.c",
            "heap-inl.h",
            "uv-common.c",
            "queue.h",
            "loop-watcher.c",
            "tcp.c",
            "handle.c",
        ),
    ),
)


def classify(stack: list[str]) -> str:
    """The component a sample's CPU belongs to. A leaf in libc (py-spy ``--native``: mostly the
    send/recv/epoll system calls under uvloop's transports) is counted as such; otherwise the
    innermost frame that belongs to a component (CPython's own C frames belong to the Python frame
    above them)."""
    leaf = stack[-1]
    if "(libc.so" in leaf or "(libpthread" in leaf:
        return "libc (system calls, mostly)"
    for frame in reversed(stack):
        where = frame.rsplit(" (", 1)[-1]
        for label, needles in OWNERS:
            if any(where.startswith(n) or f"/{n}" in where for n in needles):
                return label
    return "other"


LOOP_ROOTS = ("uvicorn/server.py", "uvicorn/main.py", "uvicorn/_compat.py", "asyncio/runners.py",
              "floor_variants.py", "floor_proxy.py:8")  # fmt: skip


def syscall_owner(stack: list[str]) -> str:
    """Who made a libc sample's call: the innermost Python frame's component, or the event loop itself
    (reads and polling happen under ``run_forever`` with no Python frame below it)."""
    for frame in reversed(stack):
        where = frame.rsplit(" (", 1)[-1]
        if ".py:" not in where:
            continue
        if any(r in where for r in LOOP_ROOTS):
            return "event loop (reads, polling)"
        for label, needles in OWNERS:
            if any(where.startswith(n) or f"/{n}" in where for n in needles):
                return label
        return "other"
    return "event loop (reads, polling)"


def profile(
    args: argparse.Namespace, cores: overhead.Cores, srv: dict[str, overhead.Server], tmp: Path
) -> dict:
    """py-spy of ``a`` under wrk, small and SSE: the share of samples per component, and (native
    stacks) the share whose innermost frame is a system call."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return {"error": "py-spy not found (pip install py-spy)"}
    out: dict[str, Any] = {}
    for kind in ("small", "small-passthrough", "sse"):
        path, method, body, _ = SHAPES[kind]
        script = overhead.lua_script(tmp, kind, method, body)
        raw = tmp / f"spy-{kind}.txt"
        secs = max(2, round(args.profile_seconds))
        # Native stacks (libc, uvloop's C) when asked; where ptrace cannot unwind them (a sandboxed
        # kernel), Python stacks only.
        err = b""
        for native in dict.fromkeys((args.native, False)):
            cmd = [spy, "record", "--pid", str(srv["a"].pid), "--rate", "400", "--format", "raw",
                   "-o", str(raw), "--duration", str(secs)] + (["--native"] if native else ["--nonblocking"])  # fmt: skip
            spyp = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(0.5)  # py-spy attaches before the load starts
            overhead.wrk(args, cores, srv["a"].url + path, script, secs + 1)
            try:
                _, err = spyp.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                spyp.kill()
                _, err = spyp.communicate()
            if raw.exists():
                break
        if not raw.exists():
            out[kind] = {"error": err.decode()[-500:]}
            continue
        counts: collections.Counter[str] = collections.Counter()
        sys_by: collections.Counter[str] = collections.Counter()
        total = 0
        for line in raw.read_text().splitlines():
            stack_s, _, n_s = line.rpartition(" ")
            if not n_s.isdigit():
                continue
            n = int(n_s)
            stack = stack_s.split(";")
            total += n
            label = classify(stack)
            counts[label] += n
            if label.startswith("libc"):
                sys_by[syscall_owner(stack)] += n
        out[kind] = {
            "native": native,
            "samples": total,
            "share": {k: round(v / total, 3) for k, v in counts.most_common()} if total else {},
            "libc_share_by_caller": {k: round(v / total, 3) for k, v in sys_by.most_common()}
            if total
            else {},
        }
        keep = Path(args.json).with_name(f"floor-variants-spy-{kind}.txt")
        if args.keep_profiles:
            shutil.copy(raw, keep)
    return out


def print_table(summary: list[dict[str, Any]]) -> None:
    print(f"\n{'kind':18}{'path':7}{'req/s':>9}{'cpu ms/1k':>11}{'cpu/nginx':>11}{'(min-max)':>15}"
          f"{'req/s /nginx':>13}{'floor/this':>11}{'err':>5}  variant")  # fmt: skip
    for s in summary:
        fl = "-" if s["floor_cpu_over_this"] is None else f"{s['floor_cpu_over_this']:.2f}"
        print(f"{s['kind']:18}{s['path']:7}{s['requests_per_s']:>9,.0f}{s['cpu_ms_per_1000']:>11.2f}"
              f"{s['cpu_vs_nginx']:>10.2f}x{s['cpu_vs_nginx_min']:>8.2f}-{s['cpu_vs_nginx_max']:<6.2f}"
              f"{s['requests_per_s_vs_nginx']:>12.2f}x{fl:>11}{s['errors']:>5}  {s['label']}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["serve"]:
        sp = argparse.ArgumentParser(prog="floor_variants.py serve")
        sp.add_argument("--variant", choices=sorted(VARIANTS), required=True)
        sp.add_argument("--upstream", required=True)
        sp.add_argument("--port", type=int, required=True)
        a = sp.parse_args(argv[1:])
        serve(a.variant, a.upstream, a.port)
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 2 s phases")
    ap.add_argument("--rounds", type=int, help="rounds (default 5, quick 2)")
    ap.add_argument("--seconds", type=float, help="length of each measured phase (default 5, quick 2)")
    ap.add_argument("--variants", default="abcdefg", help="which variants (default abcdefg)")
    ap.add_argument("--pin", choices=("split", "none"), default="split",
                    help="under 12 cores: split (the proxy alone on the last core) or none")  # fmt: skip
    ap.add_argument("--profile", action="store_true", help="py-spy a profile of variant a (small, SSE)")
    ap.add_argument("--profile-seconds", type=float, default=5.0)
    ap.add_argument("--native", action="store_true", help="py-spy --native (system-call share)")
    ap.add_argument("--keep-profiles", action="store_true", help="keep py-spy's raw stacks beside the JSON")
    ap.add_argument("--machine", help="label (default: cores and CPU model)")
    ap.add_argument("--metrics-repeat", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument(
        "--tools-dir", type=Path, default=overhead.debtools.TOOLS, help="where nginx/wrk are extracted"
    )
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "floor-variants.json")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.seconds = args.seconds or (2.0 if args.quick else 5.0)
    args.variants = [v for v in args.variants if v in VARIANTS]
    machine = args.machine or f"{os.cpu_count()} cores, {overhead.cpu_model()}"
    cores = plan_cores(args.pin)
    started = time.monotonic()
    load_before = os.getloadavg()
    import aiohttp
    import httptools
    import uvicorn
    import uvloop

    doc: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine,
        "cores": os.cpu_count(),
        "pinning": vars(cores),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"},
        "versions": {
            "python": platform.python_version(),
            "uvicorn": uvicorn.__version__,
            "aiohttp": aiohttp.__version__,
            "uvloop": uvloop.__version__,
            "httptools": httptools.__version__,
        },
        "variants": {v: VARIANTS[v] for v in args.variants},
    }

    def write(**more: Any) -> None:
        doc.update(more, wall_s=round(time.monotonic() - started, 1))
        doc["load1_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="floor-variants-") as t, servers(args, cores, Path(t)) as srv:
        doc["versions"]["nginx"] = srv["nginx"].extra.get("version")
        check(srv)
        print(f"all paths relay every shape byte for byte; {args.rounds} rounds of {args.seconds:g} s phases")
        rows = measure(args, cores, srv, Path(t), args.rounds)
        summary = summarize(rows)
        print_table(summary)
        write(summary=summary, rows=rows, profile_a=None)  # the figures are safe before py-spy runs
        if args.profile and "a" in srv:
            try:
                spy: Any = profile(args, cores, srv, Path(t))
            except (
                Exception
            ) as e:  # a profiler that cannot attach (a sandboxed kernel) costs the profile only
                spy = {"error": repr(e)}
            print("\npy-spy of a (uvicorn + aiohttp), share of samples")
            for kind, prof in spy.items():
                print(f"  {kind}: " + json.dumps(prof))
            write(profile_a=spy)
    print(f"\nwrote {args.json} ({doc['wall_s']:g} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
