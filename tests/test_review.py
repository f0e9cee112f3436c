"""Adversarial review of the request path and the admission bookkeeping (each bug it found is fixed;
the tests stay as the invariants).

Each test states one invariant. Real uvicorn servers on 127.0.0.1 where the proxy is involved, direct
unit tests of Admission (and of the proxy's acquire step) where the race has to be placed exactly.
No timed assertions: every wait is bounded and only turns a hang into a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import random
import re
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from sidecar.admission.clock import LoopClock
from sidecar.admission.controller import Admission, Handle, Outcome
from sidecar.core.decision import Reason
from sidecar.core.ledger import LedgerTotals
from sidecar.http.proxy import Proxy, _Body, make_session
from sidecar.intake.tokens import PromptCounter
from sidecar.ops.telemetry import Telemetry
from tests.conftest import MIB, ManualClock, ask, small_policy, snapshot, submit
from tests.harness import (
    FAST,
    METRICS_TEMPLATE,
    FakeEngine,
    answer_lifespan,
    eventually,
    gen,
    lane,
    read_body,
    send_sse_start,
    serve,
    write_gpu_file,
)
from tests.test_admission import Recorder

# -- helpers ------------------------------------------------------------------------------------------


async def outcomes(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(url.admin + "/metrics")).text
    found = re.findall(r'sglang_sidecar_requests_total\{outcome="(\w+)"\} ([0-9.e+]+)', text)
    return {k: float(v) for k, v in found if float(v)}


class OddEngine:
    """An upstream that misbehaves on purpose: duplicated Connection headers, a stream that breaks."""

    def __init__(self) -> None:
        self.arrived: list[str] = []
        self.tokenize_gate = asyncio.Event()  # /tokenize answers only once set

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        path = scope["path"]
        body = await read_body(receive)
        self.arrived.append(path)
        if path == "/metrics":
            payload = METRICS_TEMPLATE.format(running=0.0, queue=0.0).encode()
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
            )
            await send({"type": "http.response.body", "body": payload})
        elif path == "/dup-connection":
            headers = [
                (b"content-type", b"text/plain"),
                (b"connection", b"keep-alive"),
                (b"connection", b"x-hop-a"),
                (b"x-hop-a", b"1"),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"ok"})
        elif path == "/echo":
            info = {"headers": [[k.decode(), v.decode()] for k, v in scope["headers"]]}
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": json.dumps(info).encode()})
        elif path == "/tokenize":
            await self.tokenize_gate.wait()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": b'{"count": 10}'})
        elif path == "/size":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": json.dumps({"size": len(body)}).encode()})
        elif path == "/generate":
            # Headers and one event, then the engine process dies: the chunked body never terminates.
            await send_sse_start(send)
            raise RuntimeError("engine died mid-stream (on purpose)")
        else:
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})


# -- bugs ---------------------------------------------------------------------------------------------


async def test_client_leaving_as_the_gate_admits_it_leaks_nothing() -> None:
    """The client of a held request leaves; before its task runs the CancelledError handler, something
    else on the loop pumps the queue (a scrape, a release, a timer) and the gate admits it.

    Once `Proxy._acquire`'s ``on_done`` dropped the ticket because the future was already cancelled,
    and the ``except`` branch then called ``Admission.cancel`` on a waiter already done (a no-op): the
    ticket was never finished, its ledger entry leaked for ever and the request had no outcome. Now
    the handle ends (client_gone) whatever state the gate left it in.
    """
    loop = asyncio.get_running_loop()
    rec = Recorder()
    a = Admission(small_policy(), LoopClock(loop.time), observer=rec)
    a.update_snapshot(snapshot(loop.time(), free_bytes=0))
    proxy = Proxy("http://127.0.0.1:9", a, PromptCounter())
    scope = {"type": "http", "method": "POST", "path": "/generate", "headers": []}
    sent: list[dict[str, Any]] = []

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    handle = a.open()

    async def gated() -> None:
        with handle:  # as the proxy holds it: the outcome is decided on exit
            await proxy._gated(scope, _Body(json.dumps(gen()).encode()), send, handle)

    task = asyncio.create_task(gated())
    await eventually(lambda: a.held == 1)

    task.cancel()  # what _until_disconnect's listener does when http.disconnect arrives
    # Same loop iteration, before the task wakes: room opens and the pump admits the waiter.
    a.update_snapshot(snapshot(loop.time(), free_bytes=10 * MIB))
    with pytest.raises(asyncio.CancelledError):
        await task

    assert a.held == 0 and handle.outcome is Outcome.CLIENT_GONE and sent == []
    assert a.ledger.totals == LedgerTotals(), "ledger entry of a request whose client left leaked"
    assert sum(rec.outcomes.values()) == 1 and rec.outcomes[Outcome.CLIENT_GONE] == 1


async def test_aborted_held_clients_racing_room_opening_leak_nothing(tmp_path: Path) -> None:
    """The same race end to end: 100 held requests whose connections are aborted while the GPU poller
    reports room. Every request must end with exactly one outcome and the ledger must return to zero.
    Today entries leak (each one 1,000 KV tokens of a 100,000-token pool), and after a few rounds the
    leaked entries fill the KV check for good: the gate never opens again."""
    rng = random.Random(7)
    engine = FakeEngine(events=1)
    async with (
        lane(tmp_path, engine, free_mib=0, hold__max_held=1000, gpu__poll_interval_s=0.001) as (
            url,
            app,
            gpu,
        ),
        httpx.AsyncClient(timeout=10) as client,
    ):
        host, port = url.removeprefix("http://").split(":")
        sent = 0
        for round_ in range(5):
            write_gpu_file(gpu, 0)
            await eventually(lambda: app.admission.snapshot.gpu.free_bytes == 0)
            writers = []
            for i in range(100):
                _, w = await asyncio.open_connection(host, int(port))
                body = json.dumps(gen(stream=False, rid=f"{round_}-{i}")).encode()
                head = "POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                w.write(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
                writers.append(w)
            sent += 100
            await eventually(lambda: app.admission.held == 100)
            opens_at = rng.randint(0, 99)
            for j, w in enumerate(rng.sample(writers, len(writers))):
                if j == opens_at:
                    write_gpu_file(gpu, 1024 * MIB)
                w.transport.abort()
                if rng.random() < 0.3:
                    await asyncio.sleep(0)
            await eventually(lambda: app.admission.held == 0)
            await eventually(lambda: app.admission.ledger.totals == LedgerTotals(), timeout=5)

        async def all_counted() -> bool:
            return sum((await outcomes(client, url)).values()) == sent

        await eventually(all_counted, timeout=5)


async def test_put_generate_is_gated(tmp_path: Path) -> None:
    """SGLang serves /generate for POST *and* PUT (`@app.api_route("/generate", methods=["POST",
    "PUT"])`). The app gates only POST, so PUT /generate is forwarded ungated: no decision, no ledger,
    no outcome - a full bypass of admission while the gate is shut."""
    engine = FakeEngine(events=1)
    async with (
        lane(tmp_path, engine, free_mib=0, hold__max_held=0) as (url, _, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        post = await client.post(url + "/generate", json=gen(stream=False, rid="post"))
        assert post.status_code == 429  # the gate is shut
        put = await client.put(url + "/generate", json=gen(stream=False, rid="put"))
        assert engine.arrived == [], "PUT /generate reached the engine past a shut gate"
        assert put.status_code == 429 and put.headers.get("x-admission-decision") == "reject"


def test_observer_failure_after_charge_leaks_the_ledger() -> None:
    """`Admission._admit` charges the ledger, then tells the observer. The default observer writes the
    decision log (stderr or --decision-log FILE) synchronously; if that write fails (ENOSPC, EPIPE)
    the exception escapes `submit` after the charge, the handle never learns it, and the entry can never be
    released: every such failure shrinks the lane's headroom for good (and the request, answered 500
    by uvicorn, has no outcome)."""

    class FullDisk:
        def write(self, s: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self) -> None:
            pass

    clock = ManualClock()
    a = Admission(small_policy(), clock, observer=Telemetry(CollectorRegistry(), FullDisk()))
    a.update_snapshot(snapshot(clock(), free_bytes=10 * MIB))
    h = a.open()
    with contextlib.suppress(OSError):
        h.submit(ask(a, 1000))
    h.end(Outcome.COMPLETED)
    assert h.outcome is Outcome.COMPLETED
    assert a.ledger.totals == LedgerTotals(), "charged, but nobody holds a handle to release it"


def test_policy_reload_recosts_held_requests(clock: ManualClock) -> None:
    """A reload that corrects an over-pessimistic cost model must let held requests in. Waiters keep
    the Demand projected under the old policy, so they stay held; in strict order they also
    block every newcomer that the new policy admits (explain says "admit", the request is held)
    until hold_timeout."""
    snap = snapshot(clock(), free_bytes=600 * 1024)  # 600 KiB free
    cheaper = small_policy(cost__activation_bytes_per_chunk_token=512)  # 500 KiB per request
    probe = Admission(cheaper, clock)
    probe.update_snapshot(snap)
    assert probe.evaluate(ask(cheaper.policy, 1000)).admitted  # fits under the new policy

    a = Admission(small_policy(), clock)
    a.update_snapshot(snap)
    got: list[Handle] = []
    w = submit(a, ask(a, 1000), got)  # 1000 KiB under the old cost model
    assert w.held
    a.reload(cheaper)
    assert got == [w] and w.admitted, "held request still priced by the old policy"


async def test_duplicate_connection_headers_in_the_response_are_all_honoured(tmp_path: Path) -> None:
    """RFC 9110 7.6.1: Connection is a list header and may appear more than once; every option named in
    any of them is hop-by-hop. (Once only the first was read.)"""
    async with lane(tmp_path, OddEngine()) as (url, _, _), httpx.AsyncClient(timeout=10) as client:
        r = await client.get(url + "/dup-connection")
        assert r.status_code == 200
        assert "x-hop-a" not in r.headers, "header named in the second Connection header leaked out"


async def test_duplicate_connection_headers_in_the_request_are_all_honoured(tmp_path: Path) -> None:
    async with lane(tmp_path, OddEngine()) as (url, _, _), httpx.AsyncClient(timeout=10) as client:
        r = await client.post(
            url + "/echo",
            content=b"",
            headers=[("connection", "keep-alive"), ("connection", "x-hop-b"), ("x-hop-b", "1")],
        )
        names = {k for k, _ in r.json()["headers"]}
        assert "x-hop-b" not in names, "header named in the second Connection header was forwarded"


async def test_passthrough_body_is_forwarded_unchanged_whatever_its_size(tmp_path: Path) -> None:
    """The contract: every path other than the gated ones is forwarded unchanged. The generation body limit
    (limits.max_body_bytes) is for gated paths only; a large pass-through body is relayed as it arrives
    (a 33 MiB upload once got the sidecar's 413)."""
    engine = OddEngine()
    async with lane(tmp_path, engine) as (url, _, _), httpx.AsyncClient(timeout=30) as client:
        r = await client.post(url + "/size", content=b"x" * (33 * MIB))
        assert "/size" in engine.arrived, f"never forwarded: {r.status_code} {r.text[:120]}"
        assert r.json() == {"size": 33 * MIB}


async def test_admitted_request_whose_engine_fails_still_says_admit(tmp_path: Path) -> None:
    """The contract: an admitted request carries X-Admission-Decision: admit and X-Admission-Wait-Ms.
    When the engine times out before its headers, the sidecar's own 504 drops both, so a client or
    dashboard cannot tell an admitted-then-failed request from one that never passed the gate."""
    engine = FakeEngine()
    engine.gate_headers.clear()
    async with (
        lane(tmp_path, engine, app_kwargs={"read_timeout_s": 0.3}) as (url, _, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        r = await client.post(url + "/generate", json=gen(rid="slow"))
        assert r.status_code == 504
        assert r.headers.get("x-admission-decision") == "admit"
        assert "x-admission-wait-ms" in r.headers


def test_decision_log_is_written_off_the_event_loop() -> None:
    """The Observer protocol says "Must not block": the decision log (a file, or stderr) is written on
    its own thread, so a slow disk or a full stderr pipe cannot stall requests or /healthz (it once
    was written and flushed inside submit(), on the event loop's thread)."""
    seen: list[bool] = []

    class Probe:
        def write(self, s: str) -> int:
            try:
                asyncio.get_running_loop()
                seen.append(True)
            except RuntimeError:
                seen.append(False)
            return len(s)

        def flush(self) -> None:
            pass

    telemetry = Telemetry(CollectorRegistry(), Probe())

    async def one_request() -> None:
        loop = asyncio.get_running_loop()
        a = Admission(small_policy(), LoopClock(loop.time), observer=telemetry)
        a.update_snapshot(snapshot(loop.time(), free_bytes=10 * MIB))
        t = submit(a, ask(a, 1000))
        assert t.admitted
        t.end(Outcome.COMPLETED)

    asyncio.run(one_request())
    telemetry.close()  # drain the writer thread: the lines are written by now, off the loop
    assert seen and not any(seen), f"decision-log I/O ran on the event loop thread {threading.get_ident()}"


# -- invariants that hold (kept to pin them down) ---------------------------------------------------


async def test_every_relayed_response_is_counted_completed_once(tmp_path: Path) -> None:
    engine = FakeEngine(events=2)
    engine.release.set()
    async with lane(tmp_path, engine) as (url, app, _), httpx.AsyncClient(timeout=10) as client:
        rs = await asyncio.gather(
            *(client.post(url + "/generate", json=gen(stream=i % 2 == 0, rid=str(i))) for i in range(20))
        )
        assert [r.status_code for r in rs] == [200] * 20
        await eventually(lambda: app.admission.ledger.totals == LedgerTotals())
        assert await outcomes(client, url) == {"completed": 20.0}


async def test_upstream_timeout_before_headers(tmp_path: Path) -> None:
    engine = FakeEngine()
    engine.gate_headers.clear()
    async with (
        lane(tmp_path, engine, app_kwargs={"read_timeout_s": 0.3}) as (url, app, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        r = await client.post(url + "/generate", json=gen(rid="slow"))
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
        await eventually(lambda: engine.aborted == ["slow"])  # the engine sees the request dropped
        assert app.admission.ledger.totals == LedgerTotals()
        assert await outcomes(client, url) == {"upstream_error": 1.0}


async def test_upstream_breaking_mid_stream_drops_the_client_and_clears_ledger(tmp_path: Path) -> None:
    engine = OddEngine()
    async with lane(tmp_path, engine) as (url, app, _), httpx.AsyncClient(timeout=10) as client:
        with pytest.raises(httpx.HTTPError):
            async with client.stream("POST", url + "/generate", json=gen(rid="broken")) as r:
                assert r.status_code == 200
                async for _ in r.aiter_bytes():
                    pass
        assert engine.arrived.count("/generate") == 1  # forwarded once, never retried
        await eventually(lambda: app.admission.ledger.totals == LedgerTotals())
        assert await outcomes(client, url) == {"upstream_error": 1.0}


async def test_shadow_mode_forwards_everything_and_ledger_returns_to_zero(tmp_path: Path) -> None:
    engine = FakeEngine(events=1)
    async with (
        lane(tmp_path, engine, free_mib=0, app_kwargs={"mode_shadow": True}) as (url, app, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        rs = await asyncio.gather(
            *(client.post(url + "/generate", json=gen(stream=False, rid=str(i))) for i in range(5))
        )
        assert [r.status_code for r in rs] == [200] * 5
        assert all(r.headers["x-admission-shadow-reason"] == "vram_headroom" for r in rs)
        assert len(engine.arrived) == 5 and app.admission.held == 0
        await eventually(lambda: app.admission.ledger.totals == LedgerTotals())
        assert await outcomes(client, url) == {"completed": 5.0}


async def test_hold_timeout_over_the_wire(tmp_path: Path) -> None:
    engine = FakeEngine()
    async with (
        lane(tmp_path, engine, free_mib=0, hold__max_wait_s=0.2) as (url, app, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        r = await client.post(url + "/generate", json=gen(rid="late", tokens=5000))
        assert r.status_code == 429 and r.headers["x-admission-reason"] == "hold_timeout"
        assert r.headers["retry-after"] == "5"  # its own 5,000 prefill tokens at 1,000 tokens/s
        assert engine.arrived == [] and app.admission.held == 0
        assert app.admission.ledger.totals == LedgerTotals()
        assert await outcomes(client, url) == {"rejected": 1.0}


async def test_drain_rejects_the_held_with_retry_after(tmp_path: Path) -> None:
    engine = FakeEngine()
    async with (
        lane(tmp_path, engine, free_mib=0, hold__retry_after_min_s=4) as (url, app, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        task = asyncio.create_task(client.post(url + "/generate", json=gen(rid="held")))
        await eventually(lambda: app.admission.held == 1)
        app.admission.drain()
        r = await asyncio.wait_for(task, 10)
        assert r.status_code == 503 and r.headers["x-admission-reason"] == "draining"
        assert r.headers["retry-after"] == "4"  # draining: the policy's minimum
        r = await client.post(url + "/generate", json=gen(rid="new"))
        assert r.headers["x-admission-reason"] == "draining"
        assert (await client.get(url + "/readyz")).status_code == 503
        assert await outcomes(client, url) == {"rejected": 2.0}


async def test_policy_reload_while_held_admits_under_new_limits(tmp_path: Path) -> None:
    engine = FakeEngine(events=1)
    async with (
        lane(tmp_path, engine, free_mib=4, engine_queue__max_requests=1) as (url, app, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        engine.gate_headers.clear()
        first = asyncio.create_task(client.post(url + "/generate", json=gen(stream=False, rid="a")))
        await eventually(lambda: len(engine.arrived) == 1)
        second = asyncio.create_task(client.post(url + "/generate", json=gen(stream=False, rid="b")))
        await eventually(lambda: app.admission.held == 1)
        app.apply_policy(small_policy(**FAST, engine_queue__max_requests=10))
        await eventually(lambda: len(engine.arrived) == 2)
        engine.gate_headers.set()
        rs = await asyncio.wait_for(asyncio.gather(first, second), 10)
        assert [r.status_code for r in rs] == [200, 200]
        await eventually(lambda: app.admission.ledger.totals == LedgerTotals())
        assert await outcomes(client, url) == {"completed": 2.0}


def test_retry_after_is_never_zero_on_any_rejection(clock: ManualClock) -> None:
    """Every rejection the controller can produce, each with retry_after_s >= 1."""
    a = Admission(small_policy(hold__max_held=1, hold__max_wait_s=5), clock)
    a.update_snapshot(snapshot(clock(), free_bytes=0))
    seen: list[Handle] = []
    submit(a, ask(a, 1000), seen)  # held
    seen.append(submit(a, ask(a, 1000)))  # queue_full
    seen.append(submit(a, ask(a, 200_000)))  # unfit_request
    clock.advance(5)  # hold_timeout
    clock.advance(60)
    stale = submit(a, ask(a, 1000, priority=1), seen)  # signals stale: held
    assert stale.held
    a.drain()  # draining, for the held one and a new one
    seen.append(submit(a, ask(a, 1)))
    assert all(h.outcome is Outcome.REJECTED and h.decision is not None for h in seen)
    reasons = {h.decision.reason for h in seen if h.decision}
    assert reasons == {Reason.QUEUE_FULL, Reason.UNFIT_REQUEST, Reason.HOLD_TIMEOUT, Reason.DRAINING}
    # An unfit request gets none: no wait will help. Every other one gets at least a second.
    assert all(
        h.decision.retry_after_s is None
        if h.decision.reason is Reason.UNFIT_REQUEST
        else h.decision.retry_after_s is not None and h.decision.retry_after_s >= 1
        for h in seen
        if h.decision
    )


def test_hold_queue_heap_stays_bounded_under_churn(clock: ManualClock) -> None:
    """Cancelled waiters are removed lazily; the heap must not grow with the number ever held."""
    a = Admission(small_policy(hold__max_held=100), clock)
    a.update_snapshot(snapshot(clock(), free_bytes=0))
    keep = [submit(a, ask(a, 1000)) for _ in range(5)]
    for _ in range(10_000):
        w = submit(a, ask(a, 1000))
        assert w.held
        w.end(Outcome.CLIENT_GONE)
    assert a.held == 5 and all(w.held for w in keep)
    assert len(a._queue.items) <= 2 * a.held + 17


def test_no_await_between_decision_and_charge(clock: ManualClock) -> None:
    """submit is a plain function: the decision and the charge happen in one synchronous call."""
    import inspect

    assert not inspect.iscoroutinefunction(Handle.submit)
    assert not inspect.iscoroutinefunction(Admission.pump)
    a = Admission(small_policy(), clock)
    a.update_snapshot(snapshot(clock(), free_bytes=3 * MIB))
    results = [submit(a, ask(a, 1000)) for _ in range(6)]
    assert sum(h.admitted for h in results) == 3 and a.ledger.totals.requests == 3


async def test_client_leaving_while_tokens_are_counted(tmp_path: Path) -> None:
    """An await point before the decision: the engine's /tokenize (opted in, and asked because the
    prompt's upper bound does not fit). The client leaves there: one client_gone, nothing charged,
    nothing forwarded."""
    engine = OddEngine()
    async with (
        lane(tmp_path, engine, free_mib=0, prompt__use_engine_tokenize=True) as (url, app, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        task = asyncio.create_task(client.post(url + "/generate", json={"text": "hello", "stream": True}))
        await eventually(lambda: "/tokenize" in engine.arrived)
        task.cancel()

        async def counted() -> bool:
            return await outcomes(client, url) == {"client_gone": 1.0}

        await eventually(counted)
        engine.tokenize_gate.set()
        assert "/generate" not in engine.arrived
        assert app.admission.ledger.totals == LedgerTotals() and app.admission.held == 0
        assert await outcomes(client, url) == {"client_gone": 1.0}


async def test_held_request_is_never_admitted_after_its_client_left(tmp_path: Path) -> None:
    engine = FakeEngine()
    async with (
        lane(tmp_path, engine, free_mib=0) as (url, app, gpu_file),
        httpx.AsyncClient(timeout=10) as client,
    ):
        task = asyncio.create_task(client.post(url + "/generate", json=gen(rid="gone")))
        await eventually(lambda: app.admission.held == 1)
        task.cancel()
        await eventually(lambda: app.admission.held == 0)
        write_gpu_file(gpu_file, 1024 * MIB)  # room opens after the client left
        await eventually(lambda: (app.admission.snapshot.gpu.free_bytes or 0) == 1024 * MIB)
        r = await client.post(url + "/generate", json=gen(stream=False, rid="next"))  # a later one passes
        assert r.status_code == 200
        assert [a["rid"] for a in engine.arrived] == ["next"]
        assert await outcomes(client, url) == {"client_gone": 1.0, "completed": 1.0}


async def test_exception_inside_send_still_ends_the_ticket(tmp_path: Path) -> None:
    """The server's send() raising mid-response (here: on the first body chunk) must not leak the
    ledger entry nor lose the outcome. Driven through the proxy's ASGI entry with a real engine."""
    engine = FakeEngine(events=2)
    engine.release.set()
    loop = asyncio.get_running_loop()
    rec = Recorder()
    a = Admission(small_policy(), LoopClock(loop.time), observer=rec)
    a.update_snapshot(snapshot(loop.time(), free_bytes=10 * MIB))
    async with serve(engine) as engine_url:
        proxy = Proxy(engine_url, a, PromptCounter())
        proxy.session = make_session(16, 5.0, 30.0, upstream=engine_url)
        try:
            body = json.dumps(gen(rid="boom")).encode()
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive() -> dict[str, Any]:
                if messages:
                    return messages.pop()
                await asyncio.Event().wait()  # never disconnects
                raise AssertionError

            async def send(msg: dict[str, Any]) -> None:
                if msg["type"] == "http.response.body":
                    raise RuntimeError("transport exploded")

            scope = {
                "type": "http",
                "method": "POST",
                "path": "/generate",
                "raw_path": b"/generate",
                "query_string": b"",
                "headers": [(b"content-type", b"application/json")],
            }
            with pytest.raises(RuntimeError, match="transport exploded"):
                await proxy(scope, receive, send, gated=True)
        finally:
            await proxy.session.close()
    assert a.ledger.totals == LedgerTotals()
    assert sum(rec.outcomes.values()) == 1
