"""The proxy with real uvicorn servers on loopback: streaming, disconnects, upstream failures, bursts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.app import SidecarApp
from sidecar.signals.gpu import parse_gpu_source
from tests.conftest import MIB, small_policy
from tests.harness import FAST, FakeEngine, eventually, gen, lane, serve, serve_both, write_gpu_file


async def test_sse_passes_through_unbuffered(tmp_path: Path) -> None:
    """The first event reaches the client before the engine sends the second."""
    engine = FakeEngine(events=3)
    async with lane(tmp_path, engine) as (url, app, _), httpx.AsyncClient(timeout=10) as client:
        async with client.stream("POST", url + "/generate", json=gen()) as r:
            assert r.status_code == 200
            assert r.headers["x-admission-decision"] == "admit"
            assert r.headers["content-type"] == "text/event-stream"
            lines = r.aiter_lines()
            first = await asyncio.wait_for(anext(lines), 10)  # would hang if the proxy buffered
            assert first == 'data: {"i": 0}'
            assert engine.release.is_set() is False
            engine.release.set()
            rest = [line async for line in lines if line]
        assert rest == ['data: {"i": 1}', 'data: {"i": 2}', "data: [DONE]"]
        assert app.admission.ledger.totals.requests == 0


async def test_disconnect_mid_stream_aborts_upstream_and_clears_ledger(tmp_path: Path) -> None:
    engine = FakeEngine(events=3)
    async with lane(tmp_path, engine) as (url, app, _), httpx.AsyncClient(timeout=10) as client:
        async with client.stream("POST", url + "/generate", json=gen(rid="leaver")) as r:
            await asyncio.wait_for(anext(r.aiter_lines()), 10)
        # The client has gone; the engine must see its connection drop.
        await eventually(lambda: engine.aborted == ["leaver"])
        await eventually(lambda: app.admission.ledger.totals.requests == 0)
        metrics = (await client.get(url.admin + "/metrics")).text
        assert 'sglang_sidecar_requests_total{outcome="client_gone"} 1.0' in metrics


async def test_disconnect_while_waiting_for_headers_aborts_upstream(tmp_path: Path) -> None:
    """A long prefill: no headers yet. The client leaves; the engine's request must be aborted."""
    engine = FakeEngine()
    engine.gate_headers.clear()
    async with lane(tmp_path, engine) as (url, app, _), httpx.AsyncClient(timeout=10) as client:
        task = asyncio.create_task(client.post(url + "/generate", json=gen(rid="prefill")))
        await eventually(lambda: len(engine.arrived) == 1)
        assert app.admission.ledger.totals.requests == 1
        task.cancel()
        await eventually(lambda: engine.aborted == ["prefill"])
        await eventually(lambda: app.admission.ledger.totals.requests == 0)


@pytest.mark.parametrize("padding", [0, 4 << 20], ids=["small", "large-body"])
async def test_disconnect_while_held_removes_the_request(tmp_path: Path, padding: int) -> None:
    """Also with a body large enough that the server paused reading it (uvicorn pauses above 64 KiB
    unread): the client's going must still be seen once the body has been read."""
    engine = FakeEngine()
    body = gen(rid="held") | ({"pad": "x" * padding} if padding else {})
    async with lane(tmp_path, engine, free_mib=0) as (url, app, _), httpx.AsyncClient(timeout=10) as client:
        task = asyncio.create_task(client.post(url + "/generate", json=body))
        await eventually(lambda: app.admission.held == 1)
        state = (await client.get(url.admin + "/admission/state")).json()
        assert state["queue"]["held"] == 1 and state["gate_open"] is False
        task.cancel()
        await eventually(lambda: app.admission.held == 0)
        assert engine.arrived == []
        assert app.admission.ledger.totals.requests == 0
        metrics = (await client.get(url.admin + "/metrics")).text
        assert 'sglang_sidecar_requests_total{outcome="client_gone"} 1.0' in metrics
        assert 'sglang_sidecar_held_total{check="vram_headroom",reason="vram_headroom"} 1.0' in metrics


async def test_held_request_is_admitted_when_memory_frees(tmp_path: Path) -> None:
    engine = FakeEngine(events=1)
    async with (
        lane(tmp_path, engine, free_mib=0) as (url, app, gpu_file),
        httpx.AsyncClient(timeout=10) as client,
    ):
        task = asyncio.create_task(client.post(url + "/generate", json=gen(stream=False)))
        await eventually(lambda: app.admission.held == 1)
        write_gpu_file(gpu_file, 1024 * MIB)
        r = await asyncio.wait_for(task, 10)
        assert r.status_code == 200
        assert r.headers["x-admission-decision"] == "admit"
        assert int(r.headers["x-admission-wait-ms"]) > 0


async def test_rejection_carries_the_contract(tmp_path: Path) -> None:
    engine = FakeEngine()
    async with (
        lane(tmp_path, engine, free_mib=0, hold__max_held=0, hold__retry_after_min_s=7) as (url, _, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        r = await client.post(
            url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert r.status_code == 429
        assert r.headers["x-admission-decision"] == "reject"
        assert r.headers["x-admission-reason"] == "queue_full"
        # A short prompt's estimate (well under a second at 1,000 tokens/s) is raised to the floor.
        assert r.headers["retry-after"] == "7"
        body = r.json()
        assert body["admission"]["retry_after_s"] == 7
        assert body["error"]["type"] == "admission_rejected"
        assert body["error"]["code"] == "queue_full"
        assert body["error"]["param"] is None
        assert body["admission"]["decision"] == "reject"
        assert engine.arrived == []


async def test_unfit_request_is_rejected_at_once(tmp_path: Path) -> None:
    async with lane(tmp_path, FakeEngine()) as (url, _, _), httpx.AsyncClient(timeout=10) as client:
        r = await client.post(url + "/generate", json=gen(tokens=200_000))  # context is 100,000
        assert r.status_code == 400  # longer than the context: what SGLang itself answers
        assert r.headers["x-admission-reason"] == "unfit_request"


async def test_burst_admits_exactly_n_through_the_proxy(tmp_path: Path) -> None:
    """30 requests at once, GPU room for exactly 4 prefills: exactly 4 reach the engine."""
    engine = FakeEngine(events=1)
    engine.gate_headers.clear()  # every admitted request sits in prefill until released
    # Each request projects 1000 tokens x 1 KiB = 1000 KiB; 4 MiB of room fits exactly 4.
    async with (
        lane(tmp_path, engine, free_mib=4, hold__max_held=100) as (url, app, _),
        httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=64)) as client,
    ):
        tasks = [
            asyncio.create_task(client.post(url + "/generate", json=gen(stream=False, rid=str(i))))
            for i in range(30)
        ]
        await eventually(lambda: len(engine.arrived) + app.admission.held == 30)
        assert len(engine.arrived) == 4
        assert app.admission.ledger.totals.requests == 4
        engine.gate_headers.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert [r.status_code for r in results] == [200] * 30
        assert app.admission.ledger.totals.requests == 0 and app.admission.held == 0


async def test_upstream_down_gives_clear_503(tmp_path: Path) -> None:
    async with (
        # ``engine.on_stale: reject``: 503 at once (``hold`` rides a restart through instead).
        lane(tmp_path, FakeEngine(), upstream="http://127.0.0.1:9", engine__on_stale="reject") as (
            url,
            app,
            _,
        ),
        httpx.AsyncClient(timeout=10) as client,
    ):
        r = await client.get(url + "/v1/models")
        assert r.status_code == 503
        assert "unreachable" in r.json()["error"]["message"]
        await eventually(lambda: app.admission.snapshot.engine_health.consecutive_failures >= 3)
        r = await client.post(url + "/generate", json=gen())
        assert r.status_code == 503
        assert r.headers["x-admission-reason"] == "engine_unavailable"
        ready = await client.get(url + "/readyz")
        assert ready.status_code == 503
        assert (await client.get(url + "/healthz")).status_code == 200  # liveness never follows the engine


async def test_passthrough_forwards_and_strips_hop_by_hop(tmp_path: Path) -> None:
    async with lane(tmp_path, FakeEngine()) as (url, _, _), httpx.AsyncClient(timeout=10) as client:
        r = await client.post(
            url + "/echo?a=1&b=%2F",
            content=b"payload",
            headers={"x-custom": "v", "connection": "keep-alive, x-drop", "x-drop": "1", "te": "trailers"},
        )
        seen = r.json()
        names = {k for k, _ in seen["headers"]}
        assert seen["query"] == "a=1&b=%2F" and seen["body"] == "payload" and seen["method"] == "POST"
        assert "x-custom" in names and "x-drop" not in names and "te" not in names
        r = await client.get(url + "/v1/models")
        assert r.status_code == 200 and "x-hop" not in r.headers
        # The proxy keeps no cookie jar: one user's Set-Cookie never rides along on another's request.
        r = await client.post(url + "/echo", content=b"")
        assert "cookie" not in {k for k, _ in r.json()["headers"]}


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b'{"text": 5}', 400, None),
        (b"x" * (33 * 1024 * 1024), 413, "body_too_large"),
    ],
)
async def test_bad_bodies_never_reach_the_engine(
    tmp_path: Path, body: bytes, status: int, code: str | None
) -> None:
    engine = FakeEngine()
    async with lane(tmp_path, engine) as (url, _, _), httpx.AsyncClient(timeout=10) as client:
        r = await client.post(url + "/generate", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status
        assert r.json()["error"]["message"]
        if code:
            assert r.json()["error"]["code"] == code
        assert engine.arrived == []


async def test_explain_charges_nothing(tmp_path: Path) -> None:
    async with lane(tmp_path, FakeEngine()) as (url, app, _), httpx.AsyncClient(timeout=10) as client:
        r = await client.post(url.admin + "/admission/explain", json={"prompt_tokens": 1000})
        out = r.json()
        assert out["decision"] == "admit" and out["prompt_tokens"] == 1000
        assert out["projected_bytes"] == 1000 * 1024 and out["headroom_bytes"] == 1024 * MIB
        assert app.admission.ledger.totals.requests == 0
        r = await client.post(url.admin + "/admission/explain", json=gen(tokens=500_000))
        assert r.json()["decision"] == "reject" and r.json()["reason"] == "unfit_request"


async def test_state_has_the_contract_fields_and_null_for_unknown(tmp_path: Path) -> None:
    async with lane(tmp_path, FakeEngine()) as (url, _, _), httpx.AsyncClient(timeout=10) as client:
        s = (await client.get(url.admin + "/admission/state")).json()
        for key in ("mode", "gate_open", "headroom_bytes", "engine", "gpu", "ledger", "queue", "policy"):
            assert key in s
        assert s["engine"]["running_requests"] == 0
        assert s["engine"]["mamba_usage"] is None  # the fake engine exports no Mamba gauge: unknown, not 0
        assert s["engine"]["pending_prefill_tokens"] is None
        assert s["gpu"]["free_bytes"] == 1024 * MIB and s["gpu"]["source"].startswith("file:")
        assert s["policy"]["name"] == "test-lane" and len(s["policy"]["sha256"]) == 64
        assert s["mode"] == "enforce"


async def test_policy_reload_endpoint(tmp_path: Path) -> None:
    engine = FakeEngine()
    gpu_file = tmp_path / "gpu.json"
    write_gpu_file(gpu_file, 1024 * MIB)
    policy = small_policy(**FAST)
    async with serve(engine) as engine_url:
        app = SidecarApp(
            upstream=engine_url,
            policy=policy,
            gpu_source=parse_gpu_source(f"file:{gpu_file}"),
            admin_token="s3cret",
        )
        async with serve_both(app) as url, httpx.AsyncClient(timeout=10) as client:
            new = small_policy(**FAST).policy.model_copy(update={"name": "reloaded"})
            import yaml

            text = yaml.safe_dump(json.loads(new.model_dump_json()))
            assert (await client.post(url.admin + "/admission/policy", content=text)).status_code == 401
            bad = await client.post(
                url.admin + "/admission/policy",
                content="name: x\nbogus: 1\n",
                headers={"authorization": "Bearer s3cret"},
            )
            assert bad.status_code == 422 and bad.json()["kept"] == "test-lane"
            assert any("bogus" in p for p in bad.json()["problems"])
            ok = await client.post(
                url.admin + "/admission/policy", content=text, headers={"authorization": "Bearer s3cret"}
            )
            assert ok.status_code == 200 and ok.json()["name"] == "reloaded"
            assert (await client.get(url.admin + "/admission/state")).json()["policy"]["name"] == "reloaded"


async def test_a_huge_prompt_is_parsed_off_the_loop_and_an_estimate_never_holds_for_ever(
    tmp_path: Path,
) -> None:
    """5 MB of text, no tokenizer: the bytes bound over-counts past the whole pool. Capped at the
    context, the request goes to the engine (which refuses a prompt really that long itself)."""
    engine = FakeEngine(events=1)
    async with lane(tmp_path, engine) as (url, app, _), httpx.AsyncClient(timeout=20) as client:
        r = await client.post(url + "/generate", json={"text": "word " * 1_000_000, "stream": False})
        assert r.status_code == 200 and len(engine.arrived) == 1
        assert app.admission.ledger.totals.requests == 0


async def test_the_parsed_request_is_dropped_once_the_stream_is_forwarded(tmp_path: Path) -> None:
    """A 500K-id body parses into ~18 MB of Python objects; while the engine streams (for minutes),
    only the raw bytes may stay alive, not the parsed request."""
    import gc

    from sidecar.intake.body import GenerationRequest

    engine = FakeEngine(events=2)
    async with (
        lane(tmp_path, engine) as (url, _app, _),
        httpx.AsyncClient(timeout=10) as client,
        client.stream("POST", url + "/generate", json={"input_ids": list(range(1000)), "stream": True}) as r,
    ):
        chunks = r.aiter_bytes()
        assert b'"i": 0' in await anext(chunks)  # the stream is open, the second event not sent yet
        gc.collect()
        assert [o for o in gc.get_objects() if isinstance(o, GenerationRequest)] == []
        engine.release.set()
        rest = b"".join([c async for c in chunks])
    assert b"[DONE]" in rest


async def test_a_large_body_is_forwarded_whole_and_let_go_of_while_the_stream_runs(tmp_path: Path) -> None:
    """500K-id-sized bodies live in the sidecar only until the engine has them: during the stream no
    gated body is still held (issue #12: RSS per in-flight request), and the engine got every id."""
    import gc

    from sidecar.http.proxy import _Body

    engine = FakeEngine(events=2)
    ids = [(i * 7919) % 151_000 for i in range(60_000)]  # ~400 KB: counted in the raw bytes, streamed
    async with (
        lane(tmp_path, engine) as (url, _app, _),
        httpx.AsyncClient(timeout=10) as client,
        client.stream("POST", url + "/generate", json={"input_ids": ids, "stream": True}) as r,
    ):
        chunks = r.aiter_bytes()
        assert b'"i": 0' in await anext(chunks)
        gc.collect()
        bodies = [o for o in gc.get_objects() if isinstance(o, _Body)]
        assert bodies and all(b.data is None for b in bodies), "a forwarded body is still referenced"
        engine.release.set()
        rest = b"".join([c async for c in chunks])
    assert b"[DONE]" in rest and engine.arrived[-1]["input_ids"] == ids


def test_the_parser_gets_the_headers_it_reads_and_the_forwarder_all_decoded_once() -> None:
    """The parser's dict holds only the priority headers and the policy's class header (decoding every
    header per request was work for nothing); the upstream request's headers read one decoded list,
    kept in the scope."""
    from sidecar.http.proxy import _headers_dict, _parser_header_names, _request_headers

    scope = {
        "headers": [
            (b"host", b"x"),
            (b"x-priority", b"3"),
            (b"x-tier", b"gold"),
            (b"user-agent", "café".encode()),
        ]
    }
    assert _headers_dict(scope, _parser_header_names(None)) == {"x-priority": "3"}
    assert _headers_dict(scope, _parser_header_names("X-Tier")) == {"x-priority": "3", "x-tier": "gold"}
    assert dict(_request_headers(scope)) == {"x-priority": "3", "x-tier": "gold", "user-agent": "café"}
    decoded = scope["sidecar.decoded_headers"]
    assert dict(_request_headers(scope)) == {"x-priority": "3", "x-tier": "gold", "user-agent": "café"}
    assert scope["sidecar.decoded_headers"] is decoded


@pytest.mark.parametrize("how", ["listener", "listener-after-body", "server-watch"])
async def test_until_disconnect_cancels_the_work_when_the_client_goes_and_says_so(how: str) -> None:
    """Both ways of learning that the client left: a task reading ``receive`` (a server that offers no
    watch, or a body still being relayed: ``after``), and the guarded server's own callback. The work
    is cancelled (its cleanup runs) and the caller is told ``ClientGone`` (what the admission handle's
    exit records); a work that ends first is not cancelled, and neither a callback nor the listener
    task outlives it."""
    from sidecar.http.proxy import ClientGone, _until_disconnect
    from sidecar.http.server import DISCONNECT_WATCH

    class Watch:
        def __init__(self) -> None:
            self.callback: Any = None

        def watch_disconnect(self, cb: Any) -> None:
            self.callback = cb

        def unwatch_disconnect(self, cb: Any) -> None:
            if self.callback is cb:
                self.callback = None

    leave = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await leave.wait()
        return {"type": "http.disconnect"}

    watch = Watch()
    scope: dict[str, Any] = {DISCONNECT_WATCH: watch} if how == "server-watch" else {}
    after = asyncio.Event() if how == "listener-after-body" else None
    started, cleaned = asyncio.Event(), asyncio.Event()

    async def work() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.set()

    runner = asyncio.create_task(_until_disconnect(work(), receive, scope, after=after))
    await started.wait()
    if after is not None:
        after.set()
    if how == "server-watch":
        assert watch.callback is not None
        watch.callback()
    else:
        leave.set()
    with pytest.raises(ClientGone):  # the cancellation was ours, taken back
        await asyncio.wait_for(runner, 10)
    assert cleaned.is_set() and not runner.cancelled() and watch.callback is None

    async def quick() -> None:
        return None

    async def silent() -> dict[str, Any]:
        await asyncio.Event().wait()  # a client that stays: only a cancellation ends this
        return {"type": "http.disconnect"}

    before = asyncio.all_tasks()
    await asyncio.wait_for(_until_disconnect(quick(), silent, scope), 10)
    assert watch.callback is None
    await eventually(lambda: asyncio.all_tasks() <= before)  # the fallback listener was cancelled
