"""The server's body writer (``server.BodyWriter``) and the relay that hands a stream to it from the
engine connection's callback (``Response.splice``; issue #27), on real uvicorn servers on loopback."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.http.server import DISCONNECT_WATCH, BodyWriter, ServingLimits
from tests.harness import FakeEngine, answer_lifespan, eventually, gen, lane, read_body, serve


class WriterApp:
    """Answers each path with the writer and ``send`` mixed; records what the writer said."""

    def __init__(self) -> None:
        self.said: dict[str, list[bool]] = {}
        self.sent: dict[str, int] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        write = scope[DISCONNECT_WATCH].body_writer(send)
        assert scope[DISCONNECT_WATCH].body_writer(lambda m: send(m)) is None  # not the server's send
        await read_body(receive)
        path = scope["path"]
        said = self.said[f"{scope['method']} {path}"] = [write(b"early")]  # not started: refused
        if path == "/length":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"3")]})
            said.append(write(b"abc"))  # a length-framed answer is send's to frame
            await send({"type": "http.response.body", "body": b"abc"})
            return
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        )
        if path == "/chunked":
            said += [write(b"one"), write(b"two")]
            await send({"type": "http.response.body", "body": b"three", "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            said.append(write(b"late"))  # complete: refused
        elif path == "/flood":
            # The client reads nothing yet: the writer takes pieces until the transport stops
            # draining, then refuses; send waits for the client and the rest follows in order.
            piece = b"x" * 65536
            n = 0
            while write(piece):
                n += 1
                assert n < 2000, "the writer never saw the client fall behind"
            said.append(False)
            await send({"type": "http.response.body", "body": b"tail", "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            self.sent[path] = n * len(piece) + 4
        elif path == "/gone":
            said.append(write(b"first"))
            while (await receive())["type"] != "http.disconnect":
                pass
            said.append(write(b"after"))  # the client has gone: refused


async def test_the_writer_frames_a_chunked_answer_and_refuses_what_send_must_handle() -> None:
    app = WriterApp()
    async with serve(app, limits=ServingLimits()) as url, httpx.AsyncClient(timeout=10) as client:
        r = await client.get(url + "/chunked")
        assert r.content == b"onetwothree" and r.headers["transfer-encoding"] == "chunked"
        assert app.said["GET /chunked"] == [False, True, True, False]
        r = await client.get(url + "/length")
        assert r.content == b"abc" and app.said["GET /length"] == [False, False]
        r = await client.head(url + "/chunked")  # a HEAD answer has no body to write
        assert r.content == b"" and app.said["HEAD /chunked"] == [False, False, False, False]
        async with client.stream("GET", url + "/gone") as s:
            assert await anext(s.aiter_raw()) == b"first"
        await eventually(lambda: len(app.said["GET /gone"]) == 3)
        assert app.said["GET /gone"] == [False, True, False]


async def test_the_writer_refuses_once_the_client_falls_behind_and_send_waits_for_it() -> None:
    app = WriterApp()
    async with serve(app, limits=ServingLimits()) as url, httpx.AsyncClient(timeout=30) as client:
        async with client.stream("GET", url + "/flood") as s:
            await eventually(lambda: "GET /flood" in app.said and len(app.said["GET /flood"]) == 2)
            got = b"".join([chunk async for chunk in s.aiter_raw()])
        assert len(got) == app.sent["/flood"] and got.endswith(b"xxtail")


class BigStreams(FakeEngine):
    """FakeEngine whose /generate streams ``count`` SSE events of ``size`` bytes as fast as it can."""

    def __init__(self, count: int, size: int) -> None:
        super().__init__()
        self.count, self.size = count, size

    async def _generate(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await read_body(receive)
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for i in range(self.count):
            event = b"data: %d %s\n\n" % (i, b"y" * (self.size - 20))
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def test_a_slow_client_gets_the_whole_stream_in_order_and_the_log_counts_every_byte(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay writes around ``send`` while the client keeps up and goes through ``send`` (which
    waits for it) when it falls behind: every byte arrives, in order, once, and the access log counts
    them all."""
    events, size = 300, 32 * 1024
    caplog.set_level(logging.INFO, logger="sidecar.http.access_log")
    said: list[bool] = []
    write = BodyWriter.__call__

    def spied(self: BodyWriter, data: bytes) -> bool:
        said.append(write(self, data))
        return said[-1]

    monkeypatch.setattr(BodyWriter, "__call__", spied)
    engine = BigStreams(events, size)
    async with (
        lane(tmp_path, engine) as (url, app, _),
        httpx.AsyncClient(timeout=30) as client,
    ):
        async with client.stream("POST", url + "/generate", json=gen()) as r:
            assert r.status_code == 200
            parts = r.aiter_bytes()
            first = await anext(parts)
            # The engine runs ahead while this client reads nothing, until the writer refuses.
            await eventually(lambda: False in said)
            body = first + b"".join([p async for p in parts])
        await eventually(lambda: app.admission.ledger.totals.requests == 0)
    lines = body.split(b"\n\n")
    assert lines[-2:] == [b"data: [DONE]", b""]
    assert lines[:-2] == [b"data: %d %s" % (i, b"y" * (size - 20)) for i in range(events)]
    refused = said.index(False)  # pieces went around send before it waited for the client, and after
    assert True in said[:refused] and True in said[refused:]
    logged = [
        json.loads(json.dumps(rec.fields))  # type: ignore[attr-defined]
        for rec in caplog.records
        if rec.name == "sidecar.http.access_log" and rec.fields["path"] == "/generate"  # type: ignore[attr-defined]
    ]
    assert [f["bytes"] for f in logged] == [len(body)]


def test_no_writer_where_uvicorns_cycle_lacks_what_the_writer_reads() -> None:
    """The writer reads uvicorn's cycle by attribute: a cycle without one of them (another uvicorn)
    gets no writer, so the relay goes through ``send`` rather than failing in the engine's callback."""
    from types import SimpleNamespace

    from sidecar.http.server import GuardedHttpToolsProtocol

    transport = object()
    full = {
        "chunked_encoding": True,
        "response_complete": False,
        "disconnected": False,
        "flow": SimpleNamespace(write_paused=False),
        "transport": transport,
    }
    server = SimpleNamespace(_body_writer=True, transport=transport)

    def writer(cycle_fields: dict[str, Any]) -> Any:
        cycle = type("Cycle", (), {"send": lambda self, m: None})()
        cycle.__dict__.update(cycle_fields)
        return GuardedHttpToolsProtocol.body_writer(server, cycle.send)  # type: ignore[arg-type]

    assert isinstance(writer(full), BodyWriter)
    for name in ("chunked_encoding", "response_complete", "disconnected", "flow"):
        assert writer({k: v for k, v in full.items() if k != name}) is None, name
    assert writer({**full, "flow": SimpleNamespace()}) is None
