"""What the proxy tells the admission handle, with real uvicorn servers on loopback: the first byte
releases the prefill charge (streamed or not), only a stream's first byte times the lane's prefill
rate, and each request ends in exactly one outcome, the right one (``Handle.outcome_on_exit``)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import FakeEngine, eventually, gen, lane, read_body

Scope = dict[str, Any]


class PausedAnswer(FakeEngine):
    """A non-streaming answer sent in two pieces: its first bytes, then the rest once ``release`` is
    set (the window in which the request has had its first byte but has not ended)."""

    async def _generate(self, scope: Scope, receive: Any, send: Any) -> None:
        self.arrived.append(json.loads(await read_body(receive)))
        start = {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
        await send(start)
        await send({"type": "http.response.body", "body": b'{"text": "o', "more_body": True})
        await self.release.wait()
        await send({"type": "http.response.body", "body": b'k"}'})


def outcomes(metrics: str) -> dict[str, float]:
    found = re.findall(r'^sglang_sidecar_requests_total\{outcome="(\w+)"\} (\S+)$', metrics, re.M)
    return {k: float(v) for k, v in found if float(v)}


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
async def test_the_first_byte_releases_the_prefill_charge_and_only_a_stream_times_the_prefill(
    tmp_path: Path, stream: bool
) -> None:
    """Between the first byte and the end, the request runs (still charged as running) but its prefill
    is over: the ledger no longer holds its prefill tokens and transient, so the guard can no longer
    abort a request whose answer has begun. Only a stream's first byte is its prefill's end, so only it
    feeds the measured prefill rate (a non-streaming first byte is the whole answer)."""
    engine = FakeEngine(events=3) if stream else PausedAnswer()
    async with lane(tmp_path, engine) as (url, app, _), httpx.AsyncClient(timeout=10) as client:
        a = app.admission
        assert a.prefill_rate.tokens_per_s is None
        async with client.stream("POST", url + "/generate", json=gen(stream=stream)) as r:
            assert r.status_code == 200
            raw = r.aiter_raw()
            await asyncio.wait_for(anext(raw), 10)
            t = a.ledger.totals
            assert t.running_requests == 1 and len(a.ledger) == 1  # still running, still charged
            assert (t.requests, t.prefill_tokens, t.projected_bytes) == (0, 0, 0)  # its prefill is over
            assert (a.prefill_rate.tokens_per_s is not None) is stream
            engine.release.set()
            async for _ in raw:
                pass
        await eventually(lambda: len(a.ledger) == 0)
        metrics = (await client.get(url.admin + "/metrics")).text
        assert outcomes(metrics) == {"completed": 1.0}


async def test_an_engine_error_status_is_relayed_and_not_timed(tmp_path: Path) -> None:
    """A stream the engine refuses (a 4xx/5xx body) ends no prefill: the rate stays unmeasured; the
    answer was relayed to its end, so the outcome is ``completed``."""

    class Refusing(FakeEngine):
        async def _generate(self, scope: Scope, receive: Any, send: Any) -> None:
            await read_body(receive)
            body = b'{"error": "no"}'
            start = {
                "type": "http.response.start",
                "status": 400,
                "headers": [(b"content-type", b"application/json")],
            }
            await send(start)
            await send({"type": "http.response.body", "body": body})

    async with lane(tmp_path, Refusing()) as (url, app, _), httpx.AsyncClient(timeout=10) as client:
        r = await client.post(url + "/generate", json=gen(stream=True))
        assert r.status_code == 400
        assert app.admission.prefill_rate.tokens_per_s is None
        await eventually(lambda: len(app.admission.ledger) == 0)
        assert outcomes((await client.get(url.admin + "/metrics")).text) == {"completed": 1.0}


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [
        (b"{not json", {"content-type": "application/json"}, 400),
        (b"x" * 2048, {"content-type": "application/json"}, 413),
        (b'{"text": "hi"}', {"content-type": "text/plain"}, 415),
    ],
    ids=["400", "413", "415"],
)
async def test_a_refused_body_is_one_bad_request_never_client_gone(
    tmp_path: Path, body: bytes, headers: dict[str, str], status: int
) -> None:
    engine = FakeEngine()
    async with (
        lane(tmp_path, engine, limits__max_body_bytes=1024) as (url, app, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        r = await client.post(url + "/generate", content=body, headers=headers)
        assert r.status_code == status
        assert engine.arrived == [] and len(app.admission.ledger) == 0
        assert outcomes((await client.get(url.admin + "/metrics")).text) == {"bad_request": 1.0}


async def test_a_413_read_in_pieces_is_a_bad_request_too(tmp_path: Path) -> None:
    """No Content-Length: the limit is found while reading (``read_body``), not from the header."""

    async def pieces() -> Any:
        for _ in range(4):
            yield b"x" * 512

    async with (
        lane(tmp_path, FakeEngine(), limits__max_body_bytes=1024) as (url, _, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        r = await client.post(
            url + "/generate", content=pieces(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 413
        assert outcomes((await client.get(url.admin + "/metrics")).text) == {"bad_request": 1.0}
