"""The in-flight prefill guard end to end: in replay (virtual time) and through the live sidecar in
front of the emulator on loopback, with the official `openai` client.

The old Max-Q lane (`sidecar_emulator/policies/maxq-qwen3next-old.yaml`, calibrated on the unperturbed `maxq-old`
profile): a prompt near the lane's limit on an engine whose transients run 1.2x the coefficients, and a
long prompt that no longer fits once another process on the card grows. Each run is also made with the
guard off, which must crash the engine: a test that passed with the guard broken would prove nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import openai
import pytest

from sidecar.admission.controller import Outcome
from sidecar.app import SidecarApp
from sidecar.http.server import serve_app
from sidecar.signals.gpu import parse_gpu_source
from sidecar_emulator.demo import scale_policy
from sidecar_emulator.probe_lane import perturbed
from sidecar_emulator.profiles import MiB, get_profile
from sidecar_emulator.replay import Driver
from sidecar_emulator.scenario import GpuEvent, Request, Requests, Scenario
from sidecar_emulator.server import EmulatorServer, build_emulator_app, build_model
from tests.conftest import maxq
from tests.harness import eventually

OTHER = 676 * MiB  # what the lane's other process holds (the policy's other_processes_bytes)


def scenario(requests: list[Request], retries: int = 0, gpu_events: list[GpuEvent] | None = None) -> Scenario:
    return Scenario(
        name="guard",
        profile="maxq-old",
        policy="sidecar_emulator/policies/maxq-qwen3next-old.yaml",
        duration_s=900,
        workload=[Requests(kind="requests", requests=requests, retries=retries)],
        gpu_events=gpu_events or [],
    )


def run(sc: Scenario, profile: Any, guard: bool) -> tuple[Driver, dict[str, Any]]:
    d = Driver(sc, profile, maxq().with_section("guard", enabled=guard), sc.seed)
    return d, d.run()


def outcomes(r: dict[str, Any]) -> dict[str, str]:
    return {q["rid"]: q["outcome"] for q in r["requests_detail"]}


def test_a_lane_running_1_2x_its_coefficients_aborts_the_first_oversize_prefill_and_stays_up() -> None:
    # 260,000 tokens: admitted at margin 1.051 (the policy admits up to ~261,800 on this lane); its
    # true peak at 1.2x is ~1,550 MiB on a 1,372 MiB budget. A shorter request follows.
    sc = scenario(
        [Request(t=0, prompt_tokens=260_000, max_new_tokens=64), Request(t=60, prompt_tokens=100_000)]
    )
    profile = perturbed(get_profile("maxq-old"), scale=1.2)

    _, rb = run(sc, profile, guard=False)
    assert rb["crashes"], "without the guard the first request must kill the engine (else no test)"
    crash_t = rb["crashes"][0]["t"]

    d, r = run(sc, profile, guard=True)
    assert r["crashes"] == []
    first, second = (q["rid"] for q in r["requests_detail"])
    assert outcomes(r) == {first: "rejected:prefill_overrun", second: "completed"}
    rec = {q["rid"]: q for q in r["requests_detail"]}[first]
    # Stopped well before the peak that killed the unguarded engine; never worth a retry here.
    assert rec["end"] < crash_t and rec["retry_after_s"] is None
    # The monitor saw the lane on the first request's early chunks, not near its last.
    f = d.admission.watch.last  # type: ignore[union-attr]
    assert f is not None and f.request_ids == (first,) and f.observed_bytes < 700 * MiB
    assert r["guard"]["aborted"] == 1 and r["guard"]["aborted_unfit"] == 1
    # Every request ended in exactly one counted outcome; the ledger is back at zero.
    assert r["ledger_at_end"] == 0 and r["in_flight_at_end"] == 0
    assert d.recorder.outcomes == {"prefill_overrun": 1, "completed": 1}
    assert r["decisions"]["reject/prefill_overrun"] == 1 and r["decisions"]["admit/none"] == 2


def test_a_neighbour_growing_mid_prefill_aborts_what_no_longer_fits_and_it_is_served_later() -> None:
    # 200,000 tokens: ~1,010 MiB at its last chunk, admitted on 1,356 MiB. At 3 s another process grows
    # by 400 MiB (972 MiB left for the engine) and shrinks back at 60 s.
    grown = [GpuEvent(t=3, other_process_bytes=OTHER + 400 * MiB), GpuEvent(t=60, other_process_bytes=OTHER)]
    sc = scenario([Request(t=0, prompt_tokens=200_000, max_new_tokens=64)], retries=5, gpu_events=grown)
    profile = get_profile("maxq-old")

    _, rb = run(sc, profile, guard=False)
    assert rb["crashes"], "without the guard the prefill's last chunks must not fit (else no test)"

    _, r = run(sc, profile, guard=True)
    assert r["crashes"] == []
    first, *retries = r["requests_detail"]
    assert first["outcome"] == "rejected:prefill_overrun" and 3 < first["end"] < 4
    assert first["retry_after_s"] is not None  # it fits an idle lane: come back later
    assert retries and retries[-1]["outcome"] == "completed"
    assert r["ledger_at_end"] == 0 and r["guard"]["aborted"] == 1 and r["guard"]["aborted_unfit"] == 0


def test_without_a_progress_counter_the_guard_still_acts_on_a_raised_margin() -> None:
    """An engine that exports no `realtime_tokens_total`: the monitor compares with the final peaks,
    as before the counter was read, and notices later; the guard still stops what it can."""
    import sidecar_emulator.replay as replay

    sc = scenario([Request(t=0, prompt_tokens=260_000, max_new_tokens=64)])
    profile = perturbed(get_profile("maxq-old"), scale=1.2)
    original = replay.engine_signals

    def blind(model: Any, now: float) -> Any:
        return dataclasses.replace(
            original(model, now), prefill_computed_tokens=None, prefill_cached_tokens=None
        )

    replay.engine_signals = blind  # type: ignore[assignment]
    try:
        d, r = run(sc, profile, guard=True)
    finally:
        replay.engine_signals = original  # type: ignore[assignment]
    assert r["guard"]["progress"] == "unknown (final peaks)"
    f = d.admission.watch.last  # type: ignore[union-attr]
    # Compared with the final peak, the finding waits until the prompt's transient exceeds it.
    assert f is None or f.observed_bytes > 1000 * MiB
    assert r["ledger_at_end"] == 0


# -- live: the sidecar in front of the emulator, the official client -------------------------------


SPEED = 4.0


@pytest.mark.parametrize("stream", [False, True])
async def test_the_client_gets_a_429_prefill_overrun_and_the_engine_never_crashes(
    tmp_path: Path, stream: bool
) -> None:
    model = build_model(get_profile("maxq-old"), seed=1)
    gpu_file = tmp_path / "gpu.json"
    emu_app = build_emulator_app(model, SPEED, gpu_file)
    async with contextlib.AsyncExitStack() as stack:
        emu = await stack.enter_async_context(EmulatorServer(emu_app))
        app = SidecarApp(
            upstream=emu.url,
            policy=scale_policy(maxq(), SPEED),
            gpu_source=parse_gpu_source(f"file:{gpu_file}"),
            trust_emulator_sizes=True,
        )
        url = await stack.enter_async_context(serve_app(app))
        client = await stack.enter_async_context(
            openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        )
        call = asyncio.ensure_future(
            client.completions.create(
                model="m",
                prompt="x",
                max_tokens=16,
                stream=stream,
                extra_body={"emulator": {"prompt_tokens": 200_000}},
            )
        )
        # Once the engine has computed its first chunks, another process on the card grows.
        await eventually(lambda: model.counters.prefill_compute_tokens >= 16_384, timeout=30)
        model.set_other_process_bytes(OTHER + 400 * MiB, emu.emulator.now())
        with pytest.raises(openai.RateLimitError) as info:
            await call
        e = info.value
        assert e.status_code == 429 and e.code == "prefill_overrun"
        h = e.response.headers
        assert h["x-admission-reason"] == "prefill_overrun" and h["x-should-retry"] == "true"
        assert int(h["retry-after"]) >= 1
        assert "stopped before its peak" in e.message
        assert e.response.json()["admission"]["reason"] == "prefill_overrun"
        # The upstream request was cancelled: the engine drops it, and never crashed.
        await eventually(lambda: model.in_flight == 0, timeout=30)
        assert model.crashes == [] and model.up
        a = app.admission
        assert a.ledger.totals.requests == 0 and a.guard_state()["aborted"] == 1
        counts = a.observer.inner._outcomes  # type: ignore[attr-defined]
        assert counts[Outcome.PREFILL_OVERRUN].n == 1
