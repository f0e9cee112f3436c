"""Hundreds of clients held by a real sidecar on loopback (issue #27): every one answered, the probes
answered while they wait, a client that leaves removed, every request's one outcome counted, the
ledger back to zero.

The upstream is ``bench/upstream.py`` (answers at once, an idle 10M-token engine on /metrics); the GPU
source is a file whose free memory holds every gated request (0) or lets them in. The clients speak raw
HTTP/1.1 on their own connections (``Connection: close``): a status line read is an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import httpx
import pytest

import sidecar.app
from bench.upstream import app as upstream_app
from sidecar.admission.controller import Outcome
from sidecar.app import SidecarApp
from sidecar.http.server import ServingLimits, serve_app
from sidecar.ops.telemetry import PREFIX
from sidecar.signals.gpu import parse_gpu_source
from tests.conftest import small_policy
from tests.harness import eventually

CLIENTS = 300
MAX_HELD = 250
BODY = b'{"text":"hi","sampling_params":{"max_new_tokens":1}}'
GIB = 1 << 30


async def ask(port: int) -> tuple[int | None, asyncio.StreamWriter]:
    """One gated request; its status (None: no answer) once the answer is complete."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /generate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(BODY), BODY)
        )
        line = await reader.readline()
        if not line.startswith(b"HTTP/1."):
            return None, writer
        await reader.read()
        return int(line.split()[1]), writer
    except asyncio.CancelledError:
        writer.close()  # the client leaves: its connection closes
        raise


def outcomes(app: SidecarApp) -> dict[str, float]:
    out = {}
    for o in Outcome:
        v = app.registry.get_sample_value(PREFIX + "requests_total", {"outcome": o.value})
        if v:
            out[o.value] = v
    return out


async def test_hundreds_held_are_all_answered_and_the_probes_answer_while_they_wait(tmp_path: Path) -> None:
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"free_bytes": 0, "total_bytes": 80 * GIB}))
    policy = small_policy(
        hold__max_held=MAX_HELD,
        hold__max_wait_s=120,
        engine_queue__max_requests=4,
        gpu__poll_interval_s=0.05,
        engine__max_age_s=60,
        gpu__max_age_s=60,
    )
    async with contextlib.AsyncExitStack() as stack:
        up = await stack.enter_async_context(serve_app(upstream_app))
        app = SidecarApp(upstream=up, policy=policy, gpu_source=parse_gpu_source(f"file:{gpu}"))
        url = await stack.enter_async_context(serve_app(app, limits=ServingLimits()))
        port = int(url.rsplit(":", 1)[1])
        await eventually(lambda: app.admission.snapshot.engine is not None)

        clients = [asyncio.ensure_future(ask(port)) for _ in range(CLIENTS)]
        # The queue fills to its bound; those beyond it are answered at once (429 queue_full).
        await eventually(
            lambda: app.admission.held == MAX_HELD and sum(c.done() for c in clients) == CLIENTS - MAX_HELD
        )
        early = [c.result()[0] for c in clients if c.done()]
        assert early == [429] * (CLIENTS - MAX_HELD)

        async with httpx.AsyncClient(base_url=url, timeout=30) as probe:
            for path in ("/healthz", "/readyz"):
                r = await probe.get(path)
                assert r.status_code == 200, (path, r.text)

        # A held client leaves: its request is removed from the queue, counted client_gone.
        leaver = next(c for c in clients if not c.done())
        leaver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leaver
        await eventually(lambda: app.admission.held == MAX_HELD - 1)

        gpu.write_text(json.dumps({"free_bytes": 60 * GIB, "total_bytes": 80 * GIB}))
        rest = [c for c in clients if c is not leaver and not c.done()]
        answers = await asyncio.wait_for(asyncio.gather(*rest), 60)
        assert [status for status, _ in answers] == [200] * (MAX_HELD - 1)
        for c in clients:
            if c is not leaver:
                c.result()[1].close()

        await eventually(lambda: app.admission.held == 0 and not len(app.admission.ledger))
        await eventually(lambda: sum(outcomes(app).values()) == CLIENTS)
        assert outcomes(app) == {
            "completed": MAX_HELD - 1,
            "rejected": CLIENTS - MAX_HELD,
            "client_gone": 1,
        }


async def test_a_quiet_sidecar_reads_the_engine_again_when_a_request_arrives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While idle the engine is read every IDLE_ENGINE_POLL_S and the GPU every IDLE_GPU_POLL_S (here
    ten minutes each): the reads that follow a request's arrival are the ones its intake asked for,
    not the idle polls'."""
    monkeypatch.setattr(sidecar.app, "IDLE_ENGINE_POLL_S", 600.0)
    monkeypatch.setattr(sidecar.app, "IDLE_GPU_POLL_S", 600.0)
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"free_bytes": 60 * GIB, "total_bytes": 80 * GIB}))
    policy = small_policy(
        engine__poll_interval_s=0.05, engine__max_age_s=1200, gpu__poll_interval_s=0.05, gpu__max_age_s=1200
    )
    async with contextlib.AsyncExitStack() as stack:
        up = await stack.enter_async_context(serve_app(upstream_app))
        app = SidecarApp(upstream=up, policy=policy, gpu_source=parse_gpu_source(f"file:{gpu}"))
        # What each poller itself was last told before it began a wait.
        told: dict[str, list[bool]] = {"engine-scraper": [], "gpu-poller": []}
        quiet = app.admission.quiet

        def engine_told() -> bool:
            said = quiet()
            task = asyncio.current_task()
            if task is not None and task.get_name() in told:
                told[task.get_name()].append(said)
            return said

        app.admission.quiet = engine_told  # type: ignore[method-assign]
        url = await stack.enter_async_context(serve_app(app, limits=ServingLimits()))
        assert app.scraper is not None and app.scraper.idle_interval_s == 600.0
        assert app.gpu_poller is not None and app.gpu_poller.idle_interval_s == 600.0
        await eventually(lambda: all(t and t[-1] for t in told.values()))
        # Both are waiting out ten minutes now: their last reads were reported before those waits began.
        engine = app.admission.snapshot.engine
        assert engine is not None
        read_at = engine.observed_at
        gpu_read_at = app.admission.snapshot.gpu_health.last_ok_at
        assert gpu_read_at is not None
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            r = await client.post("/generate", content=BODY, headers={"content-type": "application/json"})
        assert r.status_code == 200
        await eventually(lambda: app.admission.snapshot.engine.observed_at > read_at)  # type: ignore[union-attr]
        await eventually(lambda: (app.admission.snapshot.gpu_health.last_ok_at or 0) > gpu_read_at)
