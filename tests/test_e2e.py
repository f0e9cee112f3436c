"""End to end on loopback: the engine emulator, the real sidecar, HTTP clients. No GPU, no SGLang."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from sidecar.core.decision import Action
from sidecar.policy.schema import load_policy_file
from sidecar.signals.engine import EngineScraper, make_control_client
from sidecar_emulator.demo import DEFAULT_SCENARIO, run_phase, scale_policy
from sidecar_emulator.profiles import get_profile
from sidecar_emulator.readings import engine_signals
from sidecar_emulator.scenario import load_scenario
from sidecar_emulator.server import EmulatorServer, build_emulator_app, build_model
from tests.conftest import ROOT
from tests.harness import eventually

SPEED = 50.0


async def test_outage_burst_crashes_the_engine_without_the_gate_and_not_with_it() -> None:
    scenario = load_scenario(DEFAULT_SCENARIO)
    policy = load_policy_file(scenario.policy_path(DEFAULT_SCENARIO.parent))
    ungated = await run_phase(scenario, None, SPEED, scenario.seed, "no gate", 240.0)
    gated = await run_phase(scenario, scale_policy(policy, SPEED), SPEED, scenario.seed, "gated", 240.0)

    assert len(ungated["crashes"]) >= 1 and ungated["failed"] > 0
    assert gated["crashes"] == [] and gated["failed"] == 0
    # No request is lost: each ended completed or rejected, with a Retry-After unless it can never fit.
    for rec in gated["requests_detail"]:
        assert rec["outcome"] == "completed" or rec["outcome"].startswith("rejected:"), rec
        if rec["outcome"].startswith("rejected:"):
            unfit = rec["outcome"] == "rejected:unfit_request"
            assert (rec["retry_after_s"] is None) if unfit else (rec["retry_after_s"] > 0), rec
    assert gated["held_then_admitted"] > 0
    assert gated["ledger_at_end"] == 0
    assert gated["completed"] > ungated["completed"]


async def test_the_sidecar_scraper_reads_the_emulator_as_the_model_holds_it() -> None:
    model = build_model(get_profile("maxq-old"), seed=3)
    model.submit("a", 150_000, max_new_tokens=32, now=0.0)
    model.submit("b", 90_000, max_new_tokens=32, now=0.0)
    model.advance(4.0)  # a prefill batch or two: gauges published, some requests still waiting
    app = build_emulator_app(model, speed=1e-9)  # the model stands still while we read it
    async with EmulatorServer(app) as emu, make_control_client() as client:
        scraped = await EngineScraper(emu.url, client, interval_s=1.0).poll_once()
    held = engine_signals(model, scraped.observed_at)
    for field, value in asdict(held).items():
        if field in ("observed_at", "sources", "prefill_counted_at"):
            continue
        got = getattr(scraped, field)
        assert got == pytest.approx(value), field
    assert scraped.queue_requests is not None and scraped.kv_available_tokens is not None


async def test_engine_crash_drops_streams_and_the_sidecar_reports_it_unavailable() -> None:
    """A crash seen through the sidecar: the request in flight fails (a 502, its stream not started),
    then the gate says engine_unavailable."""
    import aiohttp

    from sidecar.app import SidecarApp
    from sidecar.signals.gpu import parse_gpu_source
    from tests.harness import serve_both

    profile = get_profile("maxq-old").replace(restart_s=600.0)
    model = build_model(profile, seed=1)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        gpu_file = Path(tmp) / "gpu.json"
        async with EmulatorServer(build_emulator_app(model, 20.0, gpu_file)) as emu:
            policy = scale_policy(
                load_policy_file(ROOT / "sidecar_emulator/policies/maxq-qwen3next-old.yaml"), 20.0
            )
            # Gate off for this request's size: let a too-large prompt through to kill the engine.
            policy = policy.__class__(
                policy.policy.model_copy(
                    update={
                        # Refuse while the engine is down (``hold`` rides a restart through instead:
                        # test_robustness_lane's upgrade test).
                        "engine": policy.policy.engine.model_copy(update={"on_stale": Action.REJECT}),
                        "vram": policy.policy.vram.model_copy(
                            update={"max_transient_bytes": None, "reserve_bytes": 0}
                        ),
                        "cost": policy.policy.cost.model_copy(
                            update={
                                "margin": 1.0,
                                "context_bytes_per_token": 0,
                                "gather_bytes_per_context_token": 0,
                            }
                        ),
                    }
                ),
                policy.sha256,
                policy.path,
            )
            app = SidecarApp(
                upstream=emu.url,
                policy=policy,
                gpu_source=parse_gpu_source(f"file:{gpu_file}"),
                trust_emulator_sizes=True,
            )
            async with serve_both(app) as url, aiohttp.ClientSession() as session:
                await eventually(lambda: app.admission.snapshot.engine is not None)
                body = {"text": "x", "stream": True, "emulator": {"prompt_tokens": 400_000}}
                # The engine dies in the prefill, before the stream's first byte: the answer has not
                # started (a gated answer starts with the engine's first byte), so the client gets a
                # clean 502 instead of a cut stream.
                async with session.post(url + "/generate", json=body) as resp:
                    assert resp.status == 502
                    assert (await resp.json())["error"]["code"] == "upstream_error"
                await eventually(lambda: app.admission.snapshot.engine_health.consecutive_failures >= 3)
                async with session.post(url + "/generate", json=body | {"stream": False}) as resp:
                    assert resp.status == 503
                    assert resp.headers["x-admission-reason"] == "engine_unavailable"
                    retry = int(resp.headers["retry-after"])
                    assert retry >= 1 and retry == (await resp.json())["admission"]["retry_after_s"]
                assert app.admission.ledger.totals.requests == 0
                metrics = await (await session.get(url.admin + "/metrics")).text()
                assert 'sglang_sidecar_requests_total{outcome="upstream_error"} 1.0' in metrics
