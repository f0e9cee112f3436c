"""A lean HTTP/1.1 client for the one engine behind the sidecar, in place of aiohttp's ClientSession.

Why: aiohttp's client is about half of the data path's CPU per request (py-spy of
``bench/floor_proxy.py``), and an asyncio ``Protocol`` with httptools' response parser over pooled
keep-alive connections did the same relay for 2.3-2.7x less CPU (``bench/floor_variants.py``,
``bench/results/floor-variants.md``). The proxy needs little of a general client: one origin, no
cookies, no redirects, no TLS, no proxies, no decompression; what it needs is kept here:

* the surface ``proxy.py`` uses: ``request(method, url, data=, headers=, allow_redirects=False)`` as an
  async context manager yielding ``status``, ``raw_headers`` and ``content.iter_any()``; ``close()``;
* aiohttp's exception classes, so ``proxy.py``'s error mapping holds unchanged: a refused or failed
  connect is a ``ClientConnectorError`` with its ``os_error``; a connect past its deadline is a
  ``ConnectionTimeoutError``, no byte for ``read_timeout_s`` a ``ServerTimeoutError`` (both
  ``TimeoutError``); a connection lost before the head a ``ServerDisconnectedError``; a body cut short
  or malformed a ``ClientPayloadError``;
* a connection limit (waiters queue in order), idle connections reused only while younger than
  ``keepalive_s`` (below the engine's own keep-alive, so we never reuse one it is closing) and never
  once the engine has sent EOF;
* a response left before its end (the client disconnected, an error) closes its connection instead of
  pooling it: the engine sees the connection drop and aborts the request;
* backpressure both ways: the body is written as the transport drains, and reading from the engine
  pauses while the relay has more than ``BUFFER_HIGH`` bytes unread (no read timeout while paused:
  the slow side is then the client, not the engine);
* framing by httptools (Content-Length, chunked), plus what it cannot know: a response to ``HEAD`` has
  no body, one with neither length nor chunking ends at EOF, ``1xx`` interim answers are skipped.

Request header values go out as UTF-8 (as aiohttp writes ``str`` values); a CR, LF or NUL in a name or
value is refused (``ValueError``) rather than written, so no header can split the request.
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import aiohttp
import httptools

# Reading from the engine pauses above this many unread bytes and resumes once the reader takes them.
BUFFER_HIGH = 256 * 1024
# A body below this goes out in one write with the head (joined); a larger one after it, uncopied.
INLINE_BODY = 64 * 1024
# Built once: an isinstance against `bytes | bytearray | memoryview` makes a union object per call.
_BYTES_LIKE = (bytes, bytearray, memoryview)
_BODILESS_STATUS = frozenset({204, 304})
_FRAMING = frozenset((b"content-length", b"transfer-encoding"))
# RFC 9110 9.2.2 (aiohttp's list): these may be sent again on a fresh connection when a reused one was stale.
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
_FORBIDDEN = re.compile(rb"[\r\n\x00]")
_FORBIDDEN_TARGET = re.compile(rb"[\x00-\x20\x7f]")
_OURS = frozenset((b"host", b"transfer-encoding"))


class UnreachableError(aiohttp.ClientConnectorError):
    """The engine's port could not be connected to (``os_error`` says why), as aiohttp reports it."""

    def __init__(self, host: str, port: int, os_error: OSError) -> None:
        self._where = f"{host}:{port}"
        if os_error.errno:  # asyncio words it "Connect call failed (addr)"; aiohttp's says why
            os_error = type(os_error)(os_error.errno, os.strerror(os_error.errno))
        self._os_error = os_error
        OSError.__init__(self, os_error.errno, os_error.strerror)
        self.args = (self._where, os_error)

    def __str__(self) -> str:
        return f"Cannot connect to host {self._where} [{self.strerror}]"


class Response:
    """The engine's answer: ``status``, ``raw_headers`` (name and value bytes as received),
    and ``content.iter_any()``. Read by one task; ends when the body has been read or the context left.

    ``splice(sink)`` hands what arrives straight to ``sink`` from the connection's own callback, so a
    stream's relay wakes no task per piece (issue #27): the reader waits once, for the end."""

    __slots__ = (
        "_conn",
        "_done",
        "_error",
        "_sink",
        "_size",
        "_waiter",
        "chunks",
        "raw_headers",
        "spliced",
        "status",
    )

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self.status = 0
        self.raw_headers: tuple[tuple[bytes, bytes], ...] = ()
        # The body pieces received and not yet read: the connection's own deque, which its parser
        # appends to directly (no Python call per piece).
        self.chunks: collections.deque[bytes] = conn.body
        self._size = 0  # bytes received unread (with their chunk framing): the backpressure's measure
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Callable[[bytes], bool] | None = None
        self.spliced = 0  # body bytes handed to a sink (``splice``)

    @property
    def content(self) -> Response:
        """aiohttp's ``resp.content``: the same object (``iter_any``, ``read``)."""
        return self

    # -- fed by the connection --------------------------------------------------------------------

    def _end(self, error: BaseException | None = None) -> None:
        if self._done or self._error is not None:
            return
        if error is None:
            self._done = True
        else:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- read by the relay --------------------------------------------------------------------------

    def take(self) -> bytes | None:
        """What :meth:`readany` would return now, without a coroutine (b"" at the end), or None when it
        would have to wait: a small answer arrives whole with its head, so the relay reads it here."""
        chunks = self.chunks
        if chunks:
            data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            self._size = 0
            if self._conn._paused:
                self._conn.resume()
            return data
        if self._error is not None:
            raise self._error
        return b"" if self._done else None

    async def readany(self) -> bytes:
        """Everything received since the last read (b"" at the end), waiting for at least a byte."""
        while (data := self.take()) is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return data

    async def splice(self, sink: Callable[[bytes], bool]) -> bytes:
        """Hand the body as it arrives to ``sink``, called from the connection's ``data_received``
        with what one read brought (no task woken, no coroutine per piece), until the end (b""), a
        piece ``sink`` refuses (returned, for the caller to send its own way, e.g. waiting for the
        client to drain) or the answer's error (raised). ``sink`` returns False to refuse a piece and
        must not raise; the bytes it took are added to ``spliced``."""
        while (data := self.take()) is None:
            self._sink = sink
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
                self._sink = None
        return data

    async def splice_via(self, server: Any, send: Any) -> bytes:
        """:meth:`splice` to the writer ``server`` makes for ``send`` (``server.body_writer(send)``,
        as the sidecar's guarded protocol offers one), else :meth:`readany`. Asked when the reader
        would wait, so an answer read whole at once (a small one) makes no writer."""
        make = getattr(server, "body_writer", None)
        writer = None if make is None else make(send)
        return await (self.readany() if writer is None else self.splice(writer))

    async def iter_any(self) -> AsyncIterator[bytes]:
        while data := await self.readany():
            yield data

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_any()])

    @property
    def complete(self) -> bool:
        return self._done and not self.chunks


class _Conn(asyncio.Protocol):
    """One keep-alive connection to the engine; one exchange at a time."""

    def __init__(self, pool: UpstreamClient) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        # The body pieces of the answer in progress (its Response reads them): httptools takes its
        # callbacks when the parser is made, so ``on_body`` is this deque's own ``append``, called from
        # C with no Python frame per piece (an SSE stream is a piece per event).
        self.body: collections.deque[bytes] = collections.deque()
        self.on_body = self.body.append
        self._complete_at = 0  # pieces in ``body`` when the answer ended, in the read that ended it
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.head: asyncio.Future[None] | None = None
        self.eof = False
        self.idle_since = 0.0
        self.bodiless = False
        self.reusable = False
        self.reused = False  # taken from the pool (it may have gone stale there)
        self.answered = False  # a byte of this exchange's answer came
        self._stray = False  # a second answer began in this exchange: out of step
        self._headers: list[tuple[bytes, bytes]] = []
        self._interim = False
        self._framed = False
        self._complete = False
        self._paused = False
        self._writable: asyncio.Future[None] | None = None
        self._write_paused = False
        # The read deadline: written per received piece (a float); one timer acts on it lazily.
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    # -- asyncio.Protocol ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def eof_received(self) -> bool:
        self.eof = True
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.pool._lost(self)
        self._stop_timer()
        w = self._writable
        if w is not None and not w.done():
            w.set_result(None)
        resp = self.response
        if resp is None:
            return
        if self.head is not None and not self.head.done():
            self.head.set_exception(
                aiohttp.ServerDisconnectedError("the engine closed the connection before its answer")
            )
        elif not self._complete:
            if not self._framed and exc is None:
                # neither length nor chunking: the body ends where the connection does (a clean EOF;
                # a reset is a break, as aiohttp reads it)
                self._complete = True
                resp._end()
            else:
                resp._end(aiohttp.ClientPayloadError("the engine's answer broke off before its end"))

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        w = self._writable
        if w is not None and not w.done():
            w.set_result(None)

    def data_received(self, data: bytes) -> None:
        resp = self.response
        if resp is None:  # nothing asked: the connection is out of step; drop it
            self.transport.close()  # type: ignore[union-attr]
            return
        self.answered = True
        if self._deadline is not None:
            self._deadline = self.loop.time() + self.pool.read_timeout_s  # type: ignore[operator]
        body = self.body
        before = len(body)
        ended = self._complete
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            if not self._complete:
                self._fail(aiohttp.ClientPayloadError(f"the engine's answer is not HTTP/1.1: {e}"))
                return
            self.reusable = False  # junk after a whole answer: the answer stands, the connection goes
        n = len(body)
        if n != before:
            if ended or self._complete:
                # Pieces past the answer's end (a second answer, a HEAD answer's announced body) are
                # not this answer's: ``on_body`` appends without looking (no reader ran in between).
                keep = before if ended else self._complete_at
                while len(body) > keep:
                    body.pop()
                n = len(body)
            if n != before:
                # All unread pieces, in order, to the response's sink when it splices (in this frame:
                # a stream's every read comes here); else, or refused, to its reader.
                sink = resp._sink
                piece = None if sink is None else body[0] if n == 1 else b"".join(body)
                if piece is not None and sink(piece):  # type: ignore[misc]
                    body.clear()
                    resp._size = 0
                    resp.spliced += len(piece)
                else:
                    self._unread(resp, len(data))
        if self._complete:
            self._finished()

    def _unread(self, resp: Response, size: int) -> None:
        """New pieces for the reader: woken, and reading paused above ``BUFFER_HIGH`` bytes unread."""
        resp._size += size
        if resp._size > BUFFER_HIGH:
            self.pause()
        resp._wake()

    # -- httptools ----------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._complete:  # more than one answer to one request: never reuse this connection
            self._stray = True
            self.reusable = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._stray:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            self._interim = True  # 100 Continue and the like: the answer follows
            self._headers = []
            return
        resp = self.response
        assert resp is not None and self.head is not None
        resp.status = status
        resp.raw_headers = tuple(self._headers)
        framed = status in _BODILESS_STATUS
        if not framed:
            for n, _ in resp.raw_headers:  # a loop, not a generator: every response's path
                if n.lower() in _FRAMING:
                    framed = True
                    break
        self._framed = framed
        if not self.head.done():
            self.head.set_result(None)
        if self.bodiless:  # httptools cannot be told a HEAD answer has no body: it ends here
            self._complete = True
            self._complete_at = len(self.body)

    def on_message_complete(self) -> None:
        if self._stray:
            return
        if self._interim:
            self._interim = False
            return
        # httptools answers should_keep_alive() truly only inside this callback.
        self.reusable = self.parser.should_keep_alive() and not self.bodiless
        self._complete = True
        self._complete_at = len(self.body)

    # -- the exchange -------------------------------------------------------------------------------

    def send(self, head: bytes, response: Response, bodiless: bool) -> asyncio.Future[None]:
        self.response = response
        self.body.clear()  # nothing of an earlier answer (a pooled connection's is read to its end)
        self.bodiless = bodiless
        self.reusable = self.answered = self._stray = False
        self._headers = []
        self._complete = self._framed = self._interim = False
        self.head = self.loop.create_future()
        t = self.transport
        if t is None or t.is_closing():
            raise _NotSent("the engine's connection closed before the request was written")
        try:
            t.write(head)
        except RuntimeError:  # the transport closed under us (the engine went between checks)
            raise _NotSent("the engine's connection closed before the request was written") from None
        self._arm_read()
        return self.head

    async def drain(self) -> None:
        if self._write_paused and not self.eof:
            self._writable = self.loop.create_future()
            await self._writable
        if self.eof and self.response is not None and not self._complete:
            raise aiohttp.ServerDisconnectedError("the engine closed the connection while the body was sent")

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
            self._deadline = None  # the reader is the slow side now

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.eof:
            self._paused = False
            self.transport.resume_reading()
            if not self._complete:
                self._arm_read()

    def _finished(self) -> None:
        # The deadline goes; the timer stays armed for the next exchange on this connection (it acts on
        # whatever deadline is set when it fires), so a keep-alive request arms no timer of its own.
        self._deadline = None
        resp = self.response
        assert resp is not None
        resp._end()

    def _fail(self, error: BaseException) -> None:
        self._stop_timer()
        resp = self.response
        if self.head is not None and not self.head.done():
            self.head.set_exception(error)
        elif resp is not None:
            resp._end(error)
        self._complete = True
        self.reusable = False
        if self.transport is not None:
            self.transport.close()

    # -- the read deadline --------------------------------------------------------------------------

    def _arm_read(self) -> None:
        if self.pool.read_timeout_s is None:
            return
        self._deadline = due = self.loop.time() + self.pool.read_timeout_s
        if self._timer is None or self._timer_at > due:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = due
            self._timer = self.loop.call_at(due, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        due = self._deadline
        if due is None or self._complete:
            return
        if self.loop.time() >= due:
            self._fail(
                aiohttp.ServerTimeoutError(f"no data from the engine in {self.pool.read_timeout_s:g} s")
            )
        else:  # data came since: wait for the deadline it set
            self._timer_at = due
            self._timer = self.loop.call_at(due, self._on_timer)

    def _stop_timer(self) -> None:
        self._deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _NotSent(aiohttp.ServerDisconnectedError):
    """The connection was found closed before a byte of the request went out on it."""


class _Exchange:
    """``async with client.request(...) as resp``: the connection is taken and the request sent on
    entry (which returns once the head is in); on exit a fully read answer returns its connection to
    the pool, anything else (an error, a cancellation, a body left unread) closes it, so the engine
    sees the request go.

    A pooled connection can go stale between its last answer and its next request (the engine closed
    it, and its EOF is still in flight): the request is tried once more on a fresh connection when
    nothing of it was written, or, for an idempotent method with a body we still hold, when the reused
    connection closed before any byte of the answer (RFC 9112 9.3.1; aiohttp's client does the same).
    A generation request (POST) that may have reached the engine is never sent twice."""

    __slots__ = (
        "_bodiless",
        "_chunked",
        "_client",
        "_conn",
        "_head",
        "_idempotent",
        "_inline",
        "_response",
        "_stream",
        "_writer",
    )

    def __init__(
        self,
        client: UpstreamClient,
        head: bytes,
        inline: Any,
        stream: Any,
        chunked: bool,
        bodiless: bool,
        idempotent: bool,
    ) -> None:
        self._client = client
        self._head = head
        self._inline = inline  # a large bytes-like body, written after the head without a copy
        self._stream = stream  # an async iterator body, written by a task of its own
        self._chunked = chunked
        self._bodiless = bodiless
        self._idempotent = idempotent
        self._conn: _Conn | None = None
        self._response: Response | None = None
        self._writer: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Response:
        retry = True
        while True:
            client = self._client
            conn = self._conn = client._pooled() or await client._acquire()
            resp = self._response = Response(conn)
            try:
                head = conn.send(self._head, resp, self._bodiless)
                if self._inline is not None:
                    conn.transport.write(self._inline)  # type: ignore[union-attr]
                if self._stream is not None:
                    # Written beside the wait for the head, as aiohttp does: an engine may answer (413,
                    # 400) before it has read the whole body.
                    self._writer = asyncio.get_running_loop().create_task(
                        _write(conn, self._stream, self._chunked)
                    )
                    self._stream = None
                await head
            except aiohttp.ServerDisconnectedError as e:
                self._close()
                if retry and (
                    isinstance(e, _NotSent)
                    or (conn.reused and not conn.answered and self._idempotent and self._writer is None)
                ):
                    retry = False
                    continue
                raise
            except BaseException:
                self._close()
                raise
            self._head = self._inline = None  # type: ignore[assignment]
            return resp

    async def __aexit__(self, *exc: object) -> None:
        conn, resp, writer = self._conn, self._response, self._writer
        if (
            conn is not None
            and resp is not None
            and exc[0] is None
            and resp.complete
            and conn.reusable
            and (writer is None or writer.done())
        ):
            self._conn = None
            self._client._release(conn)
            return
        self._close()

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if self._writer is not None and not self._writer.done():
            self._writer.cancel()
        if conn is not None:
            conn.response = None
            if conn.transport is not None:
                conn.transport.close()
            self._client._forget(conn)


async def _write(conn: _Conn, body: Any, chunked: bool) -> None:
    """An async iterator's pieces, as the transport drains; chunked unless the head gave a length."""
    t = conn.transport
    try:
        async for piece in body:
            if t is None or t.is_closing():
                return
            if not piece:
                continue
            if chunked:
                t.writelines((b"%x\r\n" % len(piece), piece, b"\r\n"))
            else:
                t.write(piece)
            await conn.drain()
        if chunked and t is not None and not t.is_closing():
            t.write(b"0\r\n\r\n")
    except aiohttp.ClientError:
        pass  # the connection broke: the answer's side reports it
    except Exception as e:  # the body's source failed (the client left mid-upload, say)
        # The engine must not wait for the rest (it would, up to its own timeout), nor the proxy for an
        # answer: the exchange fails and the connection closes.
        conn._fail(aiohttp.ClientOSError(f"the request body could not be read to the end: {e!r}"))
    finally:
        aclose = getattr(body, "aclose", None)
        if aclose is not None:
            await aclose()


class UpstreamClient:
    """A pool of HTTP/1.1 connections to one engine (``base_url``: ``http://host:port``)."""

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int = 100,
        connect_timeout_s: float | None = None,
        read_timeout_s: float | None = None,
        keepalive_s: float = 4.0,
    ) -> None:
        scheme, _, rest = base_url.partition("://")
        authority = rest.split("/", 1)[0]
        if scheme != "http" or not authority:
            raise ValueError(f"the engine's URL must be http://host[:port][/path], not {base_url!r}")
        host, sep, port = authority.rpartition(":")
        if not sep or not port.isdigit() or host.endswith(":"):  # no port (an IPv6 literal's colons)
            host, port = authority, "80"
        self.origin = f"http://{authority}"
        self.host, self.port = host.strip("[]"), int(port)
        self.host_header = authority.encode("ascii")
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_s = keepalive_s
        self.loop = asyncio.get_running_loop()
        self._idle: list[_Conn] = []
        self._busy: set[_Conn] = set()
        self._connecting = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the request --------------------------------------------------------------------------------

    def request(
        self,
        method: str,
        url: Any,
        *,
        data: Any = None,
        headers: Any = None,
        allow_redirects: bool = False,
    ) -> _Exchange:
        """``url``: this engine's URL (``str`` or ``yarl.URL``), or an origin-form target (``/path?q``);
        relayed byte for byte. ``data``: None, bytes-like (sent with its Content-Length) or an async
        iterator of bytes-like (chunked unless ``headers`` carry a Content-Length). Redirects are never
        followed (the proxy relays them)."""
        if allow_redirects:
            raise ValueError("this client relays redirects; it never follows them")
        if self._closed:
            raise RuntimeError("the client is closed")
        target = self._target(url)
        m = method.upper()
        parts = [m.encode("ascii"), b" ", target, b" HTTP/1.1\r\nHost: ", self.host_header, b"\r\n"]
        first = len(parts)
        has_length = False
        for k, v in _items(headers):
            # bytes as given (the proxy relays the client's header bytes); str as UTF-8, as aiohttp does
            kb = k if k.__class__ is bytes else k.encode("utf-8")
            vb = v if v.__class__ is bytes else v.encode("utf-8")
            if not kb or b":" in kb:
                raise ValueError(f"{kb!r} is not a header name")
            lk = kb.lower()
            if lk in _OURS:
                continue  # Host is ours; we frame the body ourselves
            if lk == b"content-length":
                has_length = True
            parts += (kb, b": ", vb, b"\r\n")
        lines = (len(parts) - first) // 4
        if lines:
            # One CR, one LF per header line and no NUL, or a header would split the request (or be cut
            # short): counted over all of them at once (C speed), the culprit named only when one fails.
            block = b"".join(parts[first:])
            if block.count(b"\n") != lines or block.count(b"\r") != lines or b"\x00" in block:
                bad = next(
                    parts[i]
                    for i in range(first, len(parts), 4)
                    if _FORBIDDEN.search(parts[i + 2] + parts[i])
                )
                raise ValueError(f"header {bad!r} has a character no HTTP/1.1 header may carry")
        inline = stream = None
        chunked = False
        if data is None:
            if m in ("POST", "PUT", "PATCH") and not has_length:
                parts.append(b"Content-Length: 0\r\n")
            parts.append(b"\r\n")
        elif isinstance(data, _BYTES_LIKE):
            if not has_length:
                parts += (b"Content-Length: ", str(len(data)).encode(), b"\r\n")
            parts.append(b"\r\n")
            if len(data) < INLINE_BODY:
                parts.append(data)  # one write for head and body
            else:
                inline = data
        else:
            if not has_length:
                parts.append(b"Transfer-Encoding: chunked\r\n")
                chunked = True
            parts.append(b"\r\n")
            stream = data
        return _Exchange(self, b"".join(parts), inline, stream, chunked, m == "HEAD", m in _IDEMPOTENT)

    def _target(self, url: Any) -> bytes:
        """The request target, origin-form, refused when it holds a byte no request line may carry."""
        if url.__class__ is bytes:  # as the proxy builds it from the client's request
            target = url
        elif isinstance(url, str):
            rest = url if url.startswith("/") else None
            if rest is None and url.startswith(self.origin):
                rest = url[len(self.origin) :]
                rest = rest if rest[:1] == "/" else "/" + rest if rest[:1] in ("", "?") else None
            if rest is None:
                raise ValueError(f"{url!r} is not on the engine at {self.origin}")
            target = rest.encode("latin-1")
        else:  # yarl.URL: its path and query as given (``URL(..., encoded=True)`` keeps them raw)
            if f"{url.scheme}://{url.raw_authority}" != self.origin:
                raise ValueError(f"{url} is not on the engine at {self.origin}")
            target = (url.raw_path_qs or "/").encode("latin-1")
        if not target.startswith(b"/") or _FORBIDDEN_TARGET.search(target):
            raise ValueError(f"{target!r} is not an origin-form request target")
        return target

    # -- the pool -----------------------------------------------------------------------------------

    def _pooled(self) -> _Conn | None:
        """An idle connection still fit for reuse, taken from the pool; None when there is none. Not a
        coroutine: a request on a keep-alive connection (nearly all) awaits nothing to get one."""
        if self._closed:
            raise RuntimeError("the client is closed")
        idle = self._idle
        if not idle:
            return None
        now = self.loop.time()
        while idle:
            conn = idle.pop()
            if conn.eof or conn.transport.is_closing() or now - conn.idle_since >= self.keepalive_s:  # type: ignore[union-attr]
                conn.transport.close()  # type: ignore[union-attr]
                continue
            conn.reused = True
            self._busy.add(conn)
            return conn
        return None

    async def _acquire(self) -> _Conn:
        while True:
            conn = self._pooled()
            if conn is not None:
                return conn
            if len(self._busy) + self._connecting < self.max_connections:
                return await self._connect()
            waiter = self.loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken for a free slot, then cancelled: the turn passes on
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    async def _connect(self) -> _Conn:
        self._connecting += 1
        try:
            coro = self.loop.create_connection(lambda: _Conn(self), self.host, self.port)
            try:
                if self.connect_timeout_s is None:
                    _, conn = await coro
                else:
                    _, conn = await asyncio.wait_for(coro, self.connect_timeout_s)
            except TimeoutError:
                raise aiohttp.ConnectionTimeoutError(
                    f"no connection to {self.host}:{self.port} in {self.connect_timeout_s:g} s"
                ) from None
            except OSError as e:
                raise UnreachableError(self.host, self.port, e) from None
        except BaseException:
            self._connecting -= 1
            self._wake_one()  # its slot is free again
            raise
        self._connecting -= 1
        self._busy.add(conn)
        return conn

    def _release(self, conn: _Conn) -> None:
        conn.response = None
        self._busy.discard(conn)
        if self._closed or conn.eof:
            conn.transport.close()  # type: ignore[union-attr]
        else:
            idle = self._idle
            conn.idle_since = now = self.loop.time()
            idle.append(conn)
            # Idle connections are taken from the top (the freshest); those left at the bottom past
            # keepalive_s are closed here, so a burst's connections do not stay open (fds on both sides)
            # until the engine closes them.
            while idle and idle[0].idle_since <= now - self.keepalive_s:
                idle.pop(0).transport.close()  # type: ignore[union-attr]
        self._wake_one()

    def _forget(self, conn: _Conn) -> None:
        self._busy.discard(conn)
        self._wake_one()

    def _lost(self, conn: _Conn) -> None:  # the connection closed, by either side
        self._busy.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    async def close(self) -> None:
        """Close every connection, idle or busy (a request in flight then fails), and refuse new ones."""
        self._closed = True
        for conn in [*self._idle, *self._busy]:
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()
        while self._waiters:  # they wake to find the client closed
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)


def _items(headers: Any) -> Iterable[tuple[Any, Any]]:
    if headers is None:
        return ()
    if hasattr(headers, "items"):
        return headers.items()
    return headers
