"""bench/floor_variants.py measures only if its relays relay: every variant answers every benchmark shape
as the upstream does, byte for byte, and the raw relay (``d``) finds the body wherever the upstream's
head ends, however the bytes arrive."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from sidecar.http.server import serve_app

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import floor_proxy  # noqa: E402
import floor_variants as fv  # noqa: E402
import upstream as bench_upstream  # noqa: E402

SHAPES = [
    ("POST", "/generate", fv.overhead.SMALL_BODY),
    ("GET", "/v1/models", None),
    ("POST", f"/generate?events={fv.overhead.SSE_EVENTS}", fv.overhead.SSE_BODY),
    ("GET", "/nowhere", None),  # a 404 with a body
]


@asynccontextmanager
async def minimal_server(handler: object) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: fv.Downstream(handler), "127.0.0.1", 0)  # type: ignore[arg-type]
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def fetch(session: aiohttp.ClientSession, url: str, method: str, body: str | None) -> tuple:
    async with session.request(method, url, data=body, headers={"Content-Type": "application/json"}) as r:
        return r.status, r.headers.get("content-type"), await r.read()


async def test_every_variant_relays_every_shape_as_the_upstream_answers_it() -> None:
    async with AsyncExitStack() as stack:
        up = await stack.enter_async_context(serve_app(bench_upstream.app))
        paths = {
            "a": await stack.enter_async_context(serve_app(floor_proxy.FloorProxy(up))),
            "b": await stack.enter_async_context(serve_app(fv.MinimalClientApp(up))),
            "c": await stack.enter_async_context(minimal_server(fv.AiohttpRelay(up))),
            "d": await stack.enter_async_context(minimal_server(fv.Minimal(up, "raw"))),
            "e": await stack.enter_async_context(minimal_server(fv.Minimal(up, "raw-task"))),
            "f": await stack.enter_async_context(minimal_server(fv.Minimal(up, "reframe"))),
            "g": await stack.enter_async_context(serve_app(fv.LeanClientFloor(up))),
        }
        session = await stack.enter_async_context(aiohttp.ClientSession())
        for method, path, body in SHAPES:
            want = await fetch(session, up + path, method, body)
            assert want[0] in (200, 404) and want[2]
            for name, url in paths.items():
                for _ in range(3):  # the later ones on pooled connections, both sides
                    assert await fetch(session, url + path, method, body) == want, (name, path)


class Transport:
    """The least of an asyncio transport UpstreamConn uses, recording what it is told."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False
        self.reading = True

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


class Sink:
    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.raw_bytes = b""
        self.parsed = b""
        self.done_calls = 0
        self.up = None

    def head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status, self.headers = status, headers

    def raw(self, data: bytes) -> None:
        assert self.status, "body bytes before the head"
        self.raw_bytes += data

    def body(self, data: bytes) -> None:
        self.parsed += data

    def done(self) -> None:
        self.done_calls += 1

    def failed(self, exc: BaseException | None) -> None:
        raise AssertionError(f"failed: {exc}")


CHUNKED_BODY = b"5\r\nhello\r\n7\r\n, world\r\n0\r\n\r\n"
RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + CHUNKED_BODY
)


@pytest.mark.parametrize("raw", [True, False])
async def test_the_upstream_client_finds_the_body_at_every_split_of_the_bytes(raw: bool) -> None:
    pool = fv.UpstreamPool("127.0.0.1", 1)
    for cut in range(1, len(RESPONSE)):
        for pieces in (
            (RESPONSE[:cut], RESPONSE[cut:]),
            (RESPONSE[: cut // 2], RESPONSE[cut // 2 : cut], RESPONSE[cut:]),
        ):
            conn = fv.UpstreamConn(pool)
            conn.connection_made(Transport())
            sink = Sink()
            conn.send(b"GET / HTTP/1.1\r\n\r\n", sink, raw)
            for piece in pieces:
                if piece:
                    conn.data_received(piece)
            assert sink.status == 200 and (b"transfer-encoding", b"chunked") in sink.headers
            if raw:  # the framing relayed as it came, not one byte of the head in it
                assert (sink.raw_bytes, sink.parsed) == (CHUNKED_BODY, b""), cut
            else:
                assert (sink.parsed, sink.raw_bytes) == (b"hello, world", b""), cut
            assert sink.done_calls == 1
            assert pool.take() is conn  # kept alive: back in the pool


async def test_a_slow_client_pauses_the_upstream_and_resumes_it() -> None:
    """The raw relay writes as bytes come; once the client's transport is over its high-water mark,
    reading from the upstream pauses until the client's side drains."""
    pool = fv.UpstreamPool("127.0.0.1", 1)
    conn = fv.UpstreamConn(pool)
    up_transport = Transport()
    conn.connection_made(up_transport)
    down = fv.Downstream(lambda c, r: None)
    down.connection_made(Transport())
    relay = fv.RawRelay(down, fv.Request(b"GET", b"/", [], b"", True))
    conn.send(b"GET / HTTP/1.1\r\n\r\n", relay, True)
    conn.data_received(RESPONSE[:-5])
    assert up_transport.reading
    down.pause_writing()  # the client's transport is full
    conn.data_received(RESPONSE[-5:-3])
    assert not up_transport.reading
    down.resume_writing()
    assert up_transport.reading
    conn.data_received(RESPONSE[-3:])
    assert b"".join(down.transport.written).endswith(CHUNKED_BODY)  # type: ignore[union-attr]
