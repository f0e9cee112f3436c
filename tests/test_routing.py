"""Routing signals against the emulator's true state: the fit signal is never above what the engine
can really run now, and the /v1/loads view adds the sidecar's held and in-flight work."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from sidecar.app import SidecarApp
from sidecar.signals.gpu import parse_gpu_source
from sidecar.sim.demo import scale_policy
from sidecar.sim.events import Crashed, FirstToken
from sidecar.sim.profiles import get_profile
from sidecar.sim.server import EmulatorServer, build_emulator_app, build_model
from tests.conftest import maxq
from tests.harness import eventually, serve_both


def runs_without_crash(model, tokens: int) -> bool:  # type: ignore[no-untyped-def]
    """The engine's truth: submitted now, does a prompt of ``tokens`` reach its first token alive?"""
    t = model.now
    model.submit("probe", tokens, max_new_tokens=1, now=t)
    while True:
        t = model.next_event_time() or (t + 1.0)
        for ev in model.advance(t):
            if isinstance(ev, Crashed):
                return False
            if isinstance(ev, FirstToken) and ev.rid == "probe":
                return True


async def test_fit_signal_is_never_above_what_the_engine_can_run(tmp_path: Path) -> None:
    gpu_file = tmp_path / "gpu.json"
    fits: list[int] = []
    for busy in (False, True):
        model = build_model(get_profile("maxq-old"), seed=1)
        # The emulator stands still while we read it (speed ~0): the state we measure stays the state.
        async with EmulatorServer(build_emulator_app(model, 1e-6, gpu_file)) as emu:
            app = SidecarApp(
                upstream=emu.url,
                policy=scale_policy(maxq(), 20.0),
                gpu_source=parse_gpu_source(f"file:{gpu_file}"),
                trust_emulator_sizes=True,
            )
            async with serve_both(app) as url, httpx.AsyncClient(timeout=30) as client:
                await eventually(lambda app=app: app.admission.snapshot.engine is not None)
                task = None
                if busy:  # a 150K-token prefill admitted through the sidecar, still prefilling
                    body = {"text": "x", "stream": True, "emulator": {"prompt_tokens": 150_000}}
                    task = asyncio.create_task(client.post(url + "/generate", json=body))
                    await eventually(lambda app=app: app.admission.ledger.totals.requests == 1)
                sig = (await client.get(url.admin + "/admission/signals")).json()
                metrics = (await client.get(url.admin + "/metrics")).text
                loads = (await client.get(url.admin + "/admission/loads")).json()["loads"][0]
                fit = sig["fit_prompt_tokens"]
                # The fit the gate advertises, run on the engine as it stands (the 150K prefill in
                # it when busy): no crash.
                assert fit > 0 and runs_without_crash(model, fit), (busy, fit)
                if task is not None:
                    task.cancel()
        fits.append(fit)
        assert f"sglang_sidecar_fit_prompt_tokens {float(fit)}" in metrics
        assert loads["sidecar"]["ledger_requests"] == (1 if busy else 0)
        assert loads["num_waiting_uncached_tokens"] >= (150_000 if busy else 0)
    # A busy lane advertises less room than an idle one, and the idle fit is near the engine's real
    # limit, not a timid constant: a third more than it kills an idle engine.
    assert fits[1] < fits[0]
    assert not runs_without_crash(build_model(get_profile("maxq-old"), seed=1), fits[0] * 4 // 3)


async def test_fit_signal_is_zero_when_nothing_would_be_admitted(tmp_path: Path) -> None:
    from tests.harness import FakeEngine, lane

    async with (
        lane(tmp_path, FakeEngine(), free_mib=0) as (url, _app, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        sig = (await client.get(url.admin + "/admission/signals")).json()
        assert sig["fit_prompt_tokens"] == 0 and sig["held_requests"] == 0
        assert sig["headroom_bytes"] <= 0
