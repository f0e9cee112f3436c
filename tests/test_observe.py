"""What the sidecar tells dashboards and on-call: the contract's metric names, the decision log, modes."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sidecar.app import SidecarApp
from sidecar.signals.gpu import parse_gpu_source
from tests.conftest import MIB, small_policy
from tests.harness import FAST, FakeEngine, eventually, gen, lane, serve, write_gpu_file

CONTRACT_METRICS = {
    "decisions",
    "requests",
    "hold_seconds",
    "held_requests",
    "gate_open",
    "headroom_bytes",
    "projected_bytes",
    "gpu_free_bytes",
    "engine_queue_requests",
    "engine_running_requests",
    "engine_token_usage_ratio",
    "pending_prefill_tokens",
    "signal_age_seconds",
    "policy_info",
    # issue #8 item 8: summable counters, ratios named so, build and process facts, first byte
    "held",
    "build_info",
    "upstream_first_byte_seconds",
    "signal_consecutive_failures",
    "policy_reloads",
    "policy_last_reload_successful",
}


async def test_metrics_carry_the_contract_names_and_parse(tmp_path: Path) -> None:
    engine = FakeEngine(events=1)
    async with lane(tmp_path, engine) as (url, _, _), httpx.AsyncClient(timeout=10) as client:
        assert (await client.post(url + "/generate", json=gen(stream=False))).status_code == 200
        text = (await client.get(url.admin + "/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    names = {n.removeprefix("sglang_sidecar_") for n in families if n.startswith("sglang_sidecar_")}
    assert names >= CONTRACT_METRICS, CONTRACT_METRICS - names
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples
    }
    assert samples[("sglang_sidecar_decisions_total", (("decision", "admit"), ("reason", "none")))] == 1
    assert samples[("sglang_sidecar_requests_total", (("outcome", "completed"),))] == 1
    assert samples[("sglang_sidecar_gate_open", ())] == 1
    assert samples[("sglang_sidecar_engine_token_usage_ratio", (("pool", "full"),))] == 0
    # The fake engine exports no Mamba gauge: the series is absent, not 0.
    assert ("sglang_sidecar_engine_token_usage_ratio", (("pool", "mamba"),)) not in samples
    assert any(k[0] == "sglang_sidecar_policy_info" and dict(k[1])["name"] == "test-lane" for k in samples)


async def test_one_json_decision_line_per_decision_without_prompt_text(tmp_path: Path) -> None:
    log = io.StringIO()
    async with (
        lane(tmp_path, FakeEngine(events=1), free_mib=0, app_kwargs={"decision_log": log}) as (
            url,
            app,
            gpu_file,
        ),
        httpx.AsyncClient(timeout=10) as client,
    ):
        secret = "the launch codes are 0000"
        task = asyncio.create_task(client.post(url + "/generate", json={"text": secret, "stream": False}))
        await eventually(lambda: app.admission.held == 1)
        write_gpu_file(gpu_file, 1024 * MIB)
        assert (await task).status_code == 200
    lines = [json.loads(x) for x in log.getvalue().splitlines()]
    assert [(x["decision"], x["reason"]) for x in lines] == [("hold", "vram_headroom"), ("admit", None)]
    first = lines[0]
    for key in (
        "prompt_tokens",
        "projected_bytes",
        "headroom_bytes",
        "ledger",
        "checks",
        "engine",
        "gpu",
        "policy",
    ):
        assert key in first
    assert first["gpu"]["free_bytes"] == 0 and first["engine"]["queue"] == 0
    assert lines[1]["waited_s"] > 0
    assert secret not in log.getvalue()


async def test_shadow_mode_forwards_what_enforce_would_hold(tmp_path: Path) -> None:
    engine = FakeEngine(events=1)
    async with (
        lane(tmp_path, engine, free_mib=0, app_kwargs={"mode_shadow": True}) as (url, app, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        r = await client.post(url + "/generate", json=gen(stream=False))
        assert r.status_code == 200 and len(engine.arrived) == 1
        assert r.headers["x-admission-decision"] == "admit"
        assert r.headers["x-admission-shadow-decision"] == "hold"
        assert r.headers["x-admission-shadow-reason"] == "vram_headroom"
        text = (await client.get(url.admin + "/metrics")).text
        assert 'sglang_sidecar_held_total{check="vram_headroom",reason="vram_headroom"} 1.0' in text
        assert 'sglang_sidecar_decisions_total{decision="admit",reason="none"} 1.0' in text
        assert (await client.get(url.admin + "/admission/state")).json()["mode"] == "shadow"
        assert app.admission.ledger.totals.requests == 0


async def test_sighup_reloads_the_policy_file_and_keeps_it_on_error(tmp_path: Path) -> None:
    import yaml

    engine = FakeEngine()
    gpu_file = tmp_path / "gpu.json"
    write_gpu_file(gpu_file, 1024 * MIB)
    policy_file = tmp_path / "policy.yaml"
    data = json.loads(small_policy(**FAST).policy.model_dump_json())
    policy_file.write_text(yaml.safe_dump(data))
    from sidecar.policy.schema import load_policy_file

    async with serve(engine) as engine_url:
        app = SidecarApp(
            upstream=engine_url,
            policy=load_policy_file(policy_file),
            policy_path=str(policy_file),
            gpu_source=parse_gpu_source(f"file:{gpu_file}"),
        )
        async with serve(app):
            policy_file.write_text(yaml.safe_dump(data | {"name": "after-hup"}))
            os.kill(os.getpid(), signal.SIGHUP)
            await eventually(lambda: app.admission.policy.name == "after-hup")
            policy_file.write_text("name: broken\nnot_a_field: 1\n")
            os.kill(os.getpid(), signal.SIGHUP)
            await eventually(lambda: app.policy_source.last_failure is not None)  # the refusal happened
            assert app.admission.policy.name == "after-hup"


async def test_drain_rejects_new_requests_and_fails_readiness(tmp_path: Path) -> None:
    async with lane(tmp_path, FakeEngine()) as (url, app, _), httpx.AsyncClient(timeout=10) as client:
        assert (await client.get(url + "/readyz")).status_code == 200
        app.admission.drain()
        r = await client.post(url + "/generate", json=gen())
        assert r.status_code == 503 and r.headers["x-admission-reason"] == "draining"
        ready = await client.get(url + "/readyz")
        assert ready.status_code == 503 and "draining" in ready.json()["problems"]


def test_the_decision_log_writer_keeps_every_line_in_order_and_drops_past_its_bound() -> None:
    """Lines put from several threads all reach the stream, each thread's in order; close() flushes;
    a writer whose stream is stuck drops (and counts) lines past max_pending instead of growing."""
    import io
    import threading

    from sidecar.ops.telemetry import LineWriter

    out = io.StringIO()
    writer = LineWriter(out, batch_s=0.001)
    threads = [
        threading.Thread(target=lambda t=t: [writer.put(f"{t}:{i}".encode()) for i in range(2000)])
        for t in range(4)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    writer.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 8000 and writer.dropped == 0
    for t in range(4):
        assert [ln for ln in lines if ln.startswith(f"{t}:")] == [f"{t}:{i}" for i in range(2000)]

    class Stuck(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.release = threading.Event()

        def write(self, s: str) -> int:
            self.release.wait(10)
            return super().write(s)

    stuck = Stuck()
    bounded = LineWriter(stuck, max_pending=10)
    for i in range(100):
        bounded.put(str(i).encode())
    stuck.release.set()
    bounded.close()
    assert bounded.dropped >= 100 - 10 - 1  # at most one line was already taken by the writer
    assert len(stuck.getvalue().splitlines()) == 100 - bounded.dropped

    class Broken(Stuck):
        def write(self, s: str) -> int:
            self.release.wait(10)
            raise OSError("disk full")

    # Both threads drop: the loop's ``put`` while the buffer is full, the writer every line it could not
    # write. Each line is written or counted, once: here none is written, so all 100 are counted.
    broken = Broken()
    failing = LineWriter(broken, max_pending=10)
    for i in range(100):
        failing.put(str(i).encode())
    full = failing.dropped
    assert 100 - 2 * 10 <= full < 100  # the writer holds what it took (at most a full buffer), the rest waits
    broken.release.set()
    failing.close()
    assert failing.dropped == 100 and broken.getvalue() == ""


async def test_no_decision_record_is_built_when_nothing_writes_it(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """No decision-log file and the `sidecar.decision` logger above INFO: the per-decision record (a
    dict of ~30 fields and the lane context) is never built. At INFO it is, once per decision."""
    import logging

    import sidecar.ops.telemetry

    built: list[object] = []
    real = sidecar.ops.telemetry.decision_record

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        built.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(sidecar.ops.telemetry, "decision_record", spy)
    logger = logging.getLogger("sidecar.decision")
    old = logger.level
    engine = FakeEngine(events=1)
    try:
        async with lane(tmp_path, engine) as (url, _, _), httpx.AsyncClient(timeout=10) as client:
            logger.setLevel(logging.WARNING)
            assert (await client.post(url + "/generate", json=gen(stream=False))).status_code == 200
            assert built == []
            logger.setLevel(logging.INFO)
            assert (await client.post(url + "/generate", json=gen(stream=False, rid="r2"))).status_code == 200
            assert len(built) == 1
    finally:
        logger.setLevel(old)
