"""sidecar/http/engine_client.py against real sockets: an engine scripted per test on loopback, so each fault the
proxy's tests inject (refused, silent, stalled, broken mid-answer, cancelled) is the real thing; and the
proxy's own error mapping applied to what the client raises."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from yarl import URL

from sidecar.http.engine_client import BUFFER_HIGH, UnreachableError, UpstreamClient
from sidecar.http.proxy import _upstream_error
from sidecar.http.server import serve_app
from tests.harness import FakeEngine, eventually

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter, dict[str, Any]], Awaitable[bool]]


class Engine:
    """A loopback HTTP/1.1 server whose answers a test writes byte by byte. Each request is parsed
    (head, Content-Length or chunked body) and handed to ``answer``, which returns whether to keep
    the connection for the next request. Records connections, requests and EOFs it saw."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.open = 0
        self.max_open = 0
        self.requests: list[dict[str, Any]] = []
        self.eofs = 0
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.max_open = max(self.max_open, self.open)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.eofs += 1
                    return
                req = parse_head(head)
                if req["headers"].get("transfer-encoding") == "chunked":
                    body = b""
                    while True:
                        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                        chunk = await reader.readexactly(size + 2)
                        if size == 0:
                            break
                        body += chunk[:-2]
                else:
                    body = await reader.readexactly(int(req["headers"].get("content-length", "0")))
                req["body"] = body
                self.requests.append(req)
                if not await self.answer(reader, writer, req):
                    return
        finally:
            self.open -= 1
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


def parse_head(head: bytes) -> dict[str, Any]:
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ")
    headers: dict[str, str] = {}
    raw = []
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
            raw.append(line)
    return {"method": method, "target": target, "headers": headers, "raw": raw, "head": head}


@asynccontextmanager
async def engine(answer: Answer) -> AsyncIterator[Engine]:
    e = Engine(answer)
    e.server = await asyncio.start_server(e.handle, "127.0.0.1", 0)
    try:
        yield e
    finally:
        e.server.close()


@asynccontextmanager
async def client(url: str, **kw: Any) -> AsyncIterator[UpstreamClient]:
    c = UpstreamClient(url, **({"max_connections": 10, "connect_timeout_s": 5, "read_timeout_s": 5} | kw))
    try:
        yield c
    finally:
        await c.close()


def ok(body: bytes = b"ok", extra: bytes = b"") -> Answer:
    async def answer(reader: Any, writer: asyncio.StreamWriter, req: dict[str, Any]) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body))
        await writer.drain()
        return True

    return answer


async def get(c: UpstreamClient, url: str, method: str = "GET", **kw: Any) -> tuple[int, bytes]:
    async with c.request(method, url, **kw) as r:
        return r.status, await r.read()


# -- the happy paths ---------------------------------------------------------------------------------


async def test_the_benchmark_upstream_answers_as_aiohttp_gets_it() -> None:
    """bench/upstream.py (uvicorn): small JSON, a 404, and an SSE stream of 100 events, each equal to what
    aiohttp's client reads, and all of them on one connection."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import upstream as bench_upstream

    async with serve_app(bench_upstream.app) as url, client(url) as c, aiohttp.ClientSession() as s:
        for method, path, body in (
            ("POST", "/generate", b'{"text":"hi"}'),
            ("GET", "/v1/models", None),
            ("GET", "/nowhere", None),
            ("POST", "/generate?events=100", b'{"text":"hi","stream":true}'),
        ):
            async with s.request(method, url + path, data=body) as r:
                want = (r.status, r.headers["content-type"], await r.read())
            async with c.request(method, URL(url + path, encoded=True), data=body) as r:
                headers = {k.lower(): v for k, v in r.raw_headers}
                got = (r.status, headers[b"content-type"].decode(), await r.read())
            assert got == want, path
        assert len(c._idle) == 1 and not c._busy  # one keep-alive connection, back in the pool


async def test_requests_reuse_one_keep_alive_connection_and_say_what_they_carry() -> None:
    async with engine(ok()) as e, client(e.url) as c:
        for i in range(5):
            assert await get(c, e.url + f"/echo?i={i}", "POST", data=b"x" * i, headers={"X-A": "é"}) == (
                200,
                b"ok",
            )
        assert e.connections == 1
        first = e.requests[0]
        assert first["method"] == "POST" and first["target"] == "/echo?i=0"
        assert first["headers"]["host"] == e.url.removeprefix("http://")
        assert first["headers"]["content-length"] == "0"
        assert e.requests[3]["body"] == b"xxx"
        assert "x-a: é".encode() in e.requests[3]["head"].lower()  # UTF-8, as aiohttp writes str values


async def test_the_target_is_relayed_byte_for_byte() -> None:
    async with engine(ok()) as e, client(e.url) as c:
        odd = "/generate/%2F..%2f?q=%20a+b&x=%zz"
        await get(c, URL(e.url + odd, encoded=True))
        await get(c, e.url + odd)
        assert [r["target"] for r in e.requests] == [odd, odd]
        with pytest.raises(ValueError):
            c.request("GET", "http://elsewhere:1/x")


async def test_bodies_of_every_shape_arrive_whole() -> None:
    """bytes (Content-Length), a large memoryview (written after the head, uncopied), an async iterator
    (chunked) and an async iterator under a given Content-Length (as the proxy relays a large one)."""
    big = bytes(range(256)) * 1024  # 256 KiB

    async def pieces(*parts: bytes) -> AsyncIterator[bytes]:
        for p in parts:
            yield p

    async with engine(ok()) as e, client(e.url) as c:
        await get(c, e.url + "/a", "POST", data=b"small")
        await get(c, e.url + "/b", "POST", data=memoryview(big))
        await get(c, e.url + "/c", "POST", data=pieces(b"one ", b"", b"two"))
        await get(
            c,
            e.url + "/d",
            "POST",
            data=pieces(big[:1000], big[1000:]),
            headers={"Content-Length": str(len(big))},
        )
        a, b, chunked, sized = e.requests
        assert (a["body"], b["body"], chunked["body"], sized["body"]) == (b"small", big, b"one two", big)
        assert (
            chunked["headers"]["transfer-encoding"] == "chunked"
            and "content-length" not in chunked["headers"]
        )
        assert (
            sized["headers"]["content-length"] == str(len(big))
            and "transfer-encoding" not in sized["headers"]
        )
        assert e.connections == 1


async def test_a_header_that_could_split_the_request_is_refused_before_anything_is_sent() -> None:
    async with engine(ok()) as e, client(e.url) as c:
        for bad in ({"X-A": "1\r\nX-Injected: 1"}, {"X-A\n": "1"}, {"X-A": "\x00"}):
            with pytest.raises(ValueError):
                c.request("GET", e.url + "/", headers=bad)
        assert e.connections == 0


async def test_framing_the_parser_cannot_know() -> None:
    """A HEAD answer has no body; a 1xx interim answer is skipped; an answer with neither length nor
    chunking ends at EOF; 204 has no body."""

    async def answer(reader: Any, writer: asyncio.StreamWriter, req: dict[str, Any]) -> bool:
        if req["target"] == "/head":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n")
        elif req["target"] == "/continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nhi")
        elif req["target"] == "/nocontent":
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")
            await writer.drain()
            return False
        await writer.drain()
        return True

    async with engine(answer) as e, client(e.url) as c:
        assert await get(c, e.url + "/head", "HEAD") == (200, b"")
        assert await get(c, e.url + "/continue", "POST", data=b"x") == (201, b"hi")
        assert await get(c, e.url + "/nocontent") == (204, b"")
        assert await get(c, e.url + "/eof") == (200, b"until the end")
        assert await get(c, e.url + "/nocontent") == (204, b"")  # on a new connection: the last one closed


async def test_the_connection_limit_queues_requests_and_lets_them_all_through() -> None:
    go = asyncio.Event()

    async def held(reader: Any, writer: asyncio.StreamWriter, req: dict[str, Any]) -> bool:
        await go.wait()
        return await ok()(reader, writer, req)

    async with engine(held) as e, client(e.url, max_connections=2) as c:
        tasks = [asyncio.create_task(get(c, e.url + f"/{i}")) for i in range(5)]
        await eventually(lambda: len(e.requests) == 2)
        assert e.open == 2
        go.set()
        assert [await t for t in tasks] == [(200, b"ok")] * 5
        assert e.max_open == 2 and e.connections == 2


# -- connections the engine closes, or that are too old ---------------------------------------------------


async def test_an_idle_connection_is_not_reused_after_eof_or_past_keepalive() -> None:
    closes = {"n": 0}

    async def answer_then_close(reader: Any, writer: asyncio.StreamWriter, req: dict[str, Any]) -> bool:
        await ok()(reader, writer, req)
        closes["n"] += 1
        return False  # no Connection: close said: the client learns it from the EOF

    async with engine(answer_then_close) as e, client(e.url) as c:
        await get(c, e.url + "/1")
        await eventually(lambda: not c._idle)  # the EOF took it out of the pool
        assert await get(c, e.url + "/2") == (200, b"ok")
        assert e.connections == 2
    async with engine(ok()) as e, client(e.url, keepalive_s=0) as c:
        await get(c, e.url + "/1")
        await get(c, e.url + "/2")
        assert e.connections == 2  # older than keepalive_s: closed, a new one opened
        await eventually(lambda: e.eofs == 1)


# -- faults, and the proxy's mapping of them ------------------------------------------------------------


async def test_a_refused_connection_is_aiohttps_connector_error_and_the_proxys_503() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        async with client(f"http://127.0.0.1:{port}") as c:
            with pytest.raises(UnreachableError) as info:
                await get(c, f"http://127.0.0.1:{port}/generate")
    err = info.value
    assert isinstance(err, aiohttp.ClientConnectorError) and err.os_error.strerror
    status, headers, payload = _upstream_error(err, "http://127.0.0.1")
    assert status == 503 and (b"retry-after", b"5") in headers
    assert b"connection refused" in payload.lower()
    assert not c._busy and c._connecting == 0


async def test_an_engine_that_never_answers_times_out_as_the_proxys_504() -> None:
    """Also on a kept-alive connection whose first answer came in time (the read timer outlives an
    exchange: it must act on the next one's deadline, not lapse with the first)."""

    async def silent(reader: asyncio.StreamReader, writer: Any, req: dict[str, Any]) -> bool:
        if req["target"] == "/fine":
            return await ok()(reader, writer, req)
        await reader.read()  # until the client gives up and closes
        return False

    async with engine(silent) as e, client(e.url, read_timeout_s=1.0) as c:
        assert await get(c, e.url + "/fine") == (200, b"ok")
        with pytest.raises(aiohttp.ServerTimeoutError) as info:
            await asyncio.wait_for(get(c, e.url + "/generate", "POST", data=b"{}"), 10)
        assert e.connections == 1
        await eventually(lambda: e.open == 0)  # the connection was closed, not pooled
        assert not c._idle
    assert isinstance(info.value, TimeoutError)
    assert _upstream_error(info.value, "http://engine")[0] == 504


async def test_a_stall_or_a_break_mid_answer_raises_from_the_body() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: dict[str, Any]) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        if req["target"] == "/stall":
            await reader.read()
        return False  # /die: the connection closes mid-answer

    async with engine(stall) as e, client(e.url, read_timeout_s=1.0) as c:
        for target, error in (("/stall", aiohttp.ServerTimeoutError), ("/die", aiohttp.ClientPayloadError)):
            got = b""
            with pytest.raises(error):
                async with c.request("GET", e.url + target) as r:
                    async for chunk in r.content.iter_any():
                        got += chunk
            assert got == b"first", target
        assert not c._idle and not c._busy


async def test_a_short_body_is_a_payload_error_and_a_500_is_an_answer() -> None:
    async def short(reader: Any, writer: asyncio.StreamWriter, req: dict[str, Any]) -> bool:
        if req["target"] == "/500":
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\n\r\noops")
            await writer.drain()
            return True
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
        await writer.drain()
        return False

    async with engine(short) as e, client(e.url) as c:
        assert await get(c, e.url + "/500") == (500, b"oops")
        with pytest.raises(aiohttp.ClientPayloadError):
            await get(c, e.url + "/short")


async def test_a_body_source_that_fails_fails_the_exchange_and_the_engine_sees_the_connection_go() -> None:
    """A relayed upload whose client left halfway: no answer is waited for, no body for the engine to
    wait on (aiohttp fails the request the same way)."""

    class ClientLeft(Exception):
        pass

    async def upload() -> AsyncIterator[bytes]:
        yield b"half"
        raise ClientLeft

    async def head_only(reader: asyncio.StreamReader, writer: Any) -> None:
        engine_saw.append(await reader.read())  # everything until EOF

    engine_saw: list[bytes] = []
    server = await asyncio.start_server(head_only, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with client(url, read_timeout_s=60) as c:  # what answers must not be the read timeout
            with pytest.raises(aiohttp.ClientOSError):
                await asyncio.wait_for(get(c, url + "/upload", "POST", data=upload()), 10)
            await eventually(lambda: len(engine_saw) == 1)
            assert engine_saw[0].endswith(b"4\r\nhalf\r\n")  # the half that came, then EOF
            assert not c._idle and not c._busy
    finally:
        server.close()


async def test_garbage_from_the_engine_is_a_client_error() -> None:
    async def garbage(reader: Any, writer: asyncio.StreamWriter, req: dict[str, Any]) -> bool:
        writer.write(b"SPDY/9 what\r\n\r\n")
        await writer.drain()
        return False

    async with engine(garbage) as e, client(e.url) as c:
        with pytest.raises(aiohttp.ClientError) as info:
            await get(c, e.url + "/")
    assert _upstream_error(info.value, "http://engine")[0] == 502


async def test_leaving_early_closes_the_connection_so_the_engine_sees_the_request_go() -> None:
    """Cancelled while waiting for the head (a client gone during prefill), or leaving with the body
    unread (gone mid-stream): the engine gets EOF, and the connection is never pooled."""
    headers_sent = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: dict[str, Any]) -> bool:
        if req["target"] == "/prefill":
            await reader.read()  # EOF: the client left
            return False
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        headers_sent.set()
        await reader.read()
        return False

    async with engine(slow) as e, client(e.url) as c:
        task = asyncio.create_task(get(c, e.url + "/prefill", "POST", data=b"{}"))
        await eventually(lambda: len(e.requests) == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await eventually(lambda: e.open == 0)
        async with c.request("GET", e.url + "/stream") as r:
            assert await r.content.readany() == b"first"
        await eventually(lambda: e.open == 0 and e.connections == 2)
        assert not c._idle and not c._busy


async def test_a_slow_reader_pauses_the_engine_instead_of_buffering_its_answer() -> None:
    total = 8 * 1024 * 1024

    async def firehose(reader: Any, writer: asyncio.StreamWriter, req: dict[str, Any]) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        for _ in range(total // 65536):
            writer.write(b"x" * 65536)
            await writer.drain()
        return True

    async with engine(firehose) as e, client(e.url, read_timeout_s=1.0) as c:
        async with c.request("GET", e.url + "/big") as r:
            await eventually(lambda: r._conn._paused)
            assert r._size <= BUFFER_HIGH + 65536 * 4  # what it holds unread is bounded
            assert r._conn._deadline is None  # paused: the slow side is the reader, no read timeout runs
            got = 0
            async for chunk in r.content.iter_any():
                got += len(chunk)
        assert got == total
        assert len(c._idle) == 1


# -- the proxy, unchanged, on this client -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lean", "aiohttp"])
async def test_the_proxy_relays_through_either_client_and_the_engine_sees_a_leaver_go(
    tmp_path: Any, kind: str
) -> None:
    """The sidecar on the default client (lean) and on aiohttp's (``--upstream-client aiohttp``): a
    stream relays, hop-by-hop headers go, and a client that leaves mid-stream aborts the engine's request
    and clears the ledger (test_proxy's cases, which run on the default)."""
    import httpx

    from tests.harness import gen, lane

    fake = FakeEngine(events=3)
    chosen = {"upstream_client": kind}
    async with (
        lane(tmp_path, fake, app_kwargs=chosen) as (url, app, _),
        httpx.AsyncClient(timeout=10) as http,
    ):
        want = UpstreamClient if kind == "lean" else aiohttp.ClientSession
        assert isinstance(app.proxy.session, want)
        fake.release.set()
        r = await http.post(url + "/generate", json=gen(rid="whole"))
        assert r.status_code == 200 and r.headers["x-admission-decision"] == "admit"
        events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        assert events == [{"i": 0}, {"i": 1}, {"i": 2}]
        fake.release.clear()
        async with http.stream("POST", url + "/generate", json=gen(rid="leaver")) as s:
            await asyncio.wait_for(anext(s.aiter_lines()), 10)
        await eventually(lambda: fake.aborted == ["leaver"])
        await eventually(lambda: app.admission.ledger.totals.requests == 0)
        models = await http.get(url + "/v1/models")
        assert models.status_code == 200 and "x-hop" not in models.headers and "set-cookie" in models.headers


async def test_lean_is_the_default_and_an_https_engine_is_reached_through_aiohttp() -> None:
    from sidecar.http.proxy import make_session
    from sidecar.settings import Settings

    assert Settings(upstream="http://127.0.0.1:30000", policy="p.yaml").upstream_client == "lean"
    for upstream, client_kind, want in (
        ("http://127.0.0.1:30000", "lean", UpstreamClient),
        ("https://engine.internal:30000", "lean", aiohttp.ClientSession),  # the lean client has no TLS
        ("http://127.0.0.1:30000", "aiohttp", aiohttp.ClientSession),
    ):
        session = make_session(4, 1.0, 1.0, upstream=upstream, client=client_kind)
        try:
            assert isinstance(session, want), (upstream, client_kind)
        finally:
            await session.close()


# -- the hostile review's cases ------------------------------------------------------------------------


def closes_each_connection_on_its_second_request(methods: list[str]) -> Answer:
    """An engine that closed a kept-alive connection just as the next request went out on it (its idle
    timer and our request crossed): the second request on every connection gets EOF, no answer."""
    seen: dict[int, int] = {}

    async def answer(reader: Any, writer: asyncio.StreamWriter, req: dict[str, Any]) -> bool:
        n = seen[id(writer)] = seen.get(id(writer), 0) + 1
        methods.append(req["method"])
        if n == 2:
            return False
        return await ok()(reader, writer, req)

    return answer


async def test_a_stale_pooled_connection_is_retried_once_for_an_idempotent_request_only() -> None:
    """GET (idempotent) goes out again on a fresh connection; POST (a generation) that may have reached
    the engine is never sent twice: it fails as the proxy's 502, as aiohttp's client does."""
    methods: list[str] = []
    async with engine(closes_each_connection_on_its_second_request(methods)) as e, client(e.url) as c:
        assert await get(c, e.url + "/v1/models") == (200, b"ok")
        assert await get(c, e.url + "/v1/models") == (200, b"ok")  # stale, then a fresh connection
        assert e.connections == 2 and methods == ["GET", "GET", "GET"]
        with pytest.raises(aiohttp.ServerDisconnectedError) as info:
            await get(c, e.url + "/generate", "POST", data=b"{}")  # on the fresh one's second request
        assert methods == ["GET", "GET", "GET", "POST"] and e.connections == 2
        assert _upstream_error(info.value, "http://engine")[0] == 502

    # A fresh connection that closes before its answer is not retried: only a reused one can have gone
    # stale; a fresh one closing says something about the request (aiohttp would send it twice).
    async def hang_up(reader: Any, writer: Any, req: dict[str, Any]) -> bool:
        return False

    async with engine(hang_up) as e, client(e.url) as c:
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await get(c, e.url + "/v1/models")
        assert len(e.requests) == 1 and e.connections == 1


async def test_a_request_is_taken_to_a_fresh_connection_when_its_own_was_closed_before_a_byte_went() -> None:
    """A connection that closed between the pool's check and the write (nothing of the request sent):
    any method, POST included, goes out on a fresh one."""
    async with engine(ok()) as e, client(e.url) as c:
        await get(c, e.url + "/first")
        stale = c._idle[-1]
        stale.transport.close()
        real_acquire = c._acquire
        handed: list[Any] = []

        async def acquire_the_closed_one_first() -> Any:
            if not handed:
                handed.append(stale)
                c._busy.add(stale)
                return stale
            return await real_acquire()

        c._acquire = acquire_the_closed_one_first  # type: ignore[method-assign]
        assert await get(c, e.url + "/generate", "POST", data=b"{}") == (200, b"ok")
        assert [r["target"] for r in e.requests] == ["/first", "/generate"] and e.connections == 2


async def test_a_waiter_woken_for_a_free_slot_and_cancelled_passes_the_slot_on() -> None:
    async with engine(ok()) as e, client(e.url, max_connections=1) as c:
        held = await c._acquire()
        b = asyncio.create_task(get(c, e.url + "/b"))
        d = asyncio.create_task(get(c, e.url + "/d"))
        await eventually(lambda: len(c._waiters) == 2)
        c._release(held)  # wakes b ...
        b.cancel()  # ... which leaves before it runs
        assert await asyncio.wait_for(d, 10) == (200, b"ok")
        assert b.cancelled()


async def test_idle_connections_past_keepalive_are_closed_when_one_returns_not_left_open() -> None:
    go = asyncio.Event()

    async def held(reader: Any, writer: asyncio.StreamWriter, req: dict[str, Any]) -> bool:
        await go.wait()
        return await ok()(reader, writer, req)

    async with engine(held) as e, client(e.url, keepalive_s=30) as c:
        tasks = [asyncio.create_task(get(c, e.url + f"/{i}")) for i in range(3)]
        await eventually(lambda: len(e.requests) == 3)
        go.set()
        await asyncio.gather(*tasks)
        assert len(c._idle) == 3
        for conn in c._idle[:2]:  # the bottom of the pool, never taken since: long idle
            conn.idle_since -= 60
        await get(c, e.url + "/again")  # takes the freshest; on its return the stale two are closed
        await eventually(lambda: e.eofs == 2)
        assert len(c._idle) == 1 and e.connections == 3


async def test_a_second_answer_or_junk_after_the_answer_keeps_the_answer_and_drops_the_connection() -> None:
    async def doubled(reader: Any, writer: asyncio.StreamWriter, req: dict[str, Any]) -> bool:
        extra = {
            "/twice": b"HTTP/1.1 500 Oops\r\ncontent-length: 3\r\n\r\nbad",
            "/junk": b"SPDY/9 what\r\n\r\n",
            "/clean": b"",
        }[req["target"]]
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok" + extra)
        await writer.drain()
        return True

    async with engine(doubled) as e, client(e.url) as c:
        assert await get(c, e.url + "/twice") == (200, b"ok")
        assert await get(c, e.url + "/junk") == (200, b"ok")
        assert await get(c, e.url + "/clean") == (200, b"ok")
        assert e.connections == 3  # the first two were not pooled; the clean one was
        assert len(c._idle) == 1


async def test_a_reset_mid_answer_is_a_break_even_when_the_answer_ends_at_eof() -> None:
    """Without a length the body ends at the connection's end, but only a clean EOF ends it: a reset
    is a broken answer (502 before the head, a cut stream after it), not a short success."""
    import struct

    async def reset(reader: Any, writer: asyncio.StreamWriter, req: dict[str, Any]) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\npart")
        await writer.drain()
        await reader.read(1)  # the client has the head and "part": it waits for more
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST, not FIN
        return False

    async with engine(reset) as e, client(e.url) as c:
        got = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async with c.request("GET", e.url + "/eof") as r:
                got += await r.content.readany()
                # one byte to let the engine go on (it reads a byte, then resets the connection)
                r._conn.transport.write(b"!")
                async for chunk in r.content.iter_any():
                    got += chunk
        assert got == b"part"


async def test_an_early_answer_stops_the_upload_and_closes_its_source() -> None:
    """The engine answers (413) before reading the body: the answer is returned, the writer stops, the
    body's source is closed, the connection is not pooled (the engine has unread bytes on it)."""
    closed = asyncio.Event()

    async def endless() -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"x" * 65536
                await asyncio.sleep(0)
        finally:
            closed.set()

    async def early(reader: Any, writer: asyncio.StreamWriter, req: dict[str, Any]) -> bool:
        writer.write(b"HTTP/1.1 413 Too Large\r\ncontent-length: 3\r\n\r\nbig")
        await writer.drain()
        await reader.read()
        return False

    server_reqs: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server_reqs.append(await reader.readuntil(b"\r\n\r\n"))
        await early(reader, writer, {})
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with client(url) as c:
            assert await asyncio.wait_for(get(c, url + "/upload", "POST", data=endless()), 10) == (
                413,
                b"big",
            )
            await asyncio.wait_for(closed.wait(), 10)
            assert not c._idle and not c._busy
    finally:
        server.close()


async def test_header_bytes_go_as_given_and_no_target_or_header_byte_can_split_the_request() -> None:
    """The proxy hands the client's header bytes over undecoded: they go out byte for byte (non-ASCII
    included). A CR, LF or NUL anywhere in a header, a control byte or space in the target, is refused
    before anything is sent; through the sidecar none can arrive (uvicorn's parser answers 400 first)."""
    async with engine(ok()) as e, client(e.url) as c:
        await get(c, b"/raw?q=1", headers=[(b"x-name", "café".encode()), (b"x-bin", b"\xff\xfe")])
        assert e.requests[0]["target"] == "/raw?q=1"
        assert b"\r\nx-name: caf\xc3\xa9\r\nx-bin: \xff\xfe\r\n" in e.requests[0]["head"]
        bad_headers = (
            [(b"x-a", b"1\rx-b: 2")],
            [(b"x-a", b"1\nx-b: 2")],
            [(b"x-a", b"1"), (b"x-b", b"\x00")],
            [(b"x-a\r\nx-b", b"1")],
            [(b"", b"1")],
            [(b"x-a: 1\r\nx", b"1")],
        )
        for bad in bad_headers:
            with pytest.raises(ValueError):
                c.request("GET", b"/", headers=bad)
        for target in (b"/a b", b"/a\r\nx: y", b"a", b"/\x00", "/a b", e.url + "/\n"):
            with pytest.raises(ValueError):
                c.request("GET", target)
        assert e.connections == 1 and len(e.requests) == 1


async def test_a_304_and_a_head_answer_end_at_their_head_whatever_length_they_announce() -> None:
    async def answer(reader: Any, writer: asyncio.StreamWriter, req: dict[str, Any]) -> bool:
        status = b"304 Not Modified" if req["target"] == "/304" else b"200 OK"
        writer.write(b"HTTP/1.1 %s\r\ncontent-length: 10\r\netag: x\r\n\r\n" % status)
        await writer.drain()
        return True

    async with engine(answer) as e, client(e.url) as c:
        assert await get(c, e.url + "/304") == (304, b"")
        assert await get(c, e.url + "/304") == (304, b"")
        assert e.connections == 1  # a 304 is a whole answer: its connection is reused
        assert await get(c, e.url + "/head", "HEAD") == (200, b"")
        assert not c._idle  # after HEAD the parser cannot be trusted with the connection: closed


# -- splice: the body handed to a sink from the connection's callback (issue #27) --------------------


def _stepped(pieces: list[bytes], steps: asyncio.Queue[str]) -> Answer:
    """A chunked answer whose pieces go out one per step the test puts: ``piece``, ``end`` (the last
    chunk; the connection kept) or ``die`` (the connection closes mid-answer)."""

    async def answer(reader: Any, writer: asyncio.StreamWriter, req: dict[str, Any]) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for p in pieces:
            if await steps.get() == "die":
                return False
            writer.write(b"%x\r\n%s\r\n" % (len(p), p))
            await writer.drain()
        if await steps.get() == "die":
            return False
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    return answer


async def test_a_spliced_body_goes_to_the_sink_read_by_read_and_the_reader_wakes_at_the_end() -> None:
    steps: asyncio.Queue[str] = asyncio.Queue()
    taken: list[bytes] = []

    def sink(data: bytes) -> bool:
        taken.append(data)
        return True

    async with engine(_stepped([b"one", b"two", b"three"], steps)) as e, client(e.url) as c:
        async with c.request("GET", e.url + "/stream") as r:
            steps.put_nowait("piece")
            assert await r.readany() == b"one"  # read as ever before the splice
            spliced = asyncio.create_task(r.splice(sink))
            for n, piece in enumerate((b"two", b"three"), 1):
                steps.put_nowait("piece")
                await eventually(lambda n=n: len(taken) == n)
                assert taken[-1] == piece and not spliced.done()  # taken without waking the reader
            steps.put_nowait("end")
            assert await spliced == b""
            assert r.spliced == len(b"twothree") and r.complete
        assert len(c._idle) == 1  # read to its end: pooled


async def test_a_piece_the_sink_refuses_comes_back_to_the_reader_in_order_and_a_break_raises() -> None:
    steps: asyncio.Queue[str] = asyncio.Queue()
    taken: list[bytes] = []
    refuse = {b"two"}

    def sink(data: bytes) -> bool:
        if data in refuse:
            return False
        taken.append(data)
        return True

    async with engine(_stepped([b"one", b"two", b"three"], steps)) as e, client(e.url) as c:
        with pytest.raises(aiohttp.ClientPayloadError):
            async with c.request("GET", e.url + "/stream") as r:
                steps.put_nowait("piece")
                steps.put_nowait("piece")
                got = await r.readany()
                if got == b"one":
                    assert await r.splice(sink) == b"two"  # refused: the reader sends it its own way
                else:
                    assert got == b"onetwo"  # both came in one read
                steps.put_nowait("piece")
                spliced = asyncio.create_task(r.splice(sink))
                await eventually(lambda: taken == [b"three"])
                assert r.spliced == len(b"three")
                steps.put_nowait("die")
                await spliced
    assert not c._idle and not c._busy


async def test_a_second_answer_arriving_after_the_first_was_read_is_not_read_as_its_body() -> None:
    extra = asyncio.Event()

    async def then_more(reader: Any, writer: asyncio.StreamWriter, req: dict[str, Any]) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await extra.wait()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstray")
        await writer.drain()
        await reader.read()
        return False

    async with engine(then_more) as e, client(e.url) as c:
        async with c.request("GET", e.url + "/x") as r:
            assert await r.readany() == b"ok"
            extra.set()
            await eventually(lambda: r._conn._stray)  # it came, in a read of its own
            assert await r.readany() == b"" and r.take() == b""
        assert not c._idle  # out of step: never pooled
