"""The lane watch (sidecar/monitor.py): `vram.idle_free_bytes: auto` and the under-prediction monitor.

Three levels: the pure rules (`excess`, `raised_margin`), the watch inside a real `Admission` fed
snapshots on a manual clock, and the acceptance run in replay (virtual time): a policy calibrated on
the unperturbed engine, the engine's transients then 1.2x larger. One test runs the live sidecar over
HTTP (a fake engine, a GPU file) for `/admission/state` and `/metrics`.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.admission import Admission, Outcome
from sidecar.core.decision import Action
from sidecar.core.rules import HeadroomSource
from sidecar.core.snapshot import DeviceMemory, GpuSignals, Snapshot, SourceHealth
from sidecar.monitor import excess, raised_margin
from sidecar.policy import LoadedPolicy, Monitor
from sidecar.sim.probe_lane import perturbed
from sidecar.sim.profiles import get_profile
from sidecar.sim.replay import Driver
from sidecar.sim.scenario import load_scenario
from tests.conftest import MIB, ROOT, ManualClock, ask, maxq, small_policy, snapshot, submit
from tests.harness import FakeEngine, eventually, gen, lane, write_gpu_file

GIB = 1024 * MIB


# -- the pure rules ----------------------------------------------------------------------------------


def test_excess_counts_only_beyond_tolerance_and_min_bytes() -> None:
    m = Monitor(tolerance=0.02, min_bytes=32 * MIB)
    assert excess(1000 * MIB, 1000 * MIB, m) is None  # as projected
    assert excess(1020 * MIB, 1000 * MIB, m) is None  # within 2 %
    assert excess(1060 * MIB, 1050 * MIB, m) is None  # under 32 MiB over, though over 0 %
    assert excess(1100 * MIB, 1000 * MIB, m) == pytest.approx(1.1)
    assert excess(40 * MIB, 0, m) == math.inf  # memory taken while nothing was projected
    assert excess(40 * MIB, 0, Monitor(min_bytes=64 * MIB)) is None


def test_raised_margin_covers_the_ratio_within_the_policy_bounds() -> None:
    m = Monitor(max_margin=1.5, step=0.05)
    # Projected with 1.05, allocated 1.2x that: 1.05 x 1.2 + 0.05.
    assert raised_margin(1.05, 1.05, 1.05, 1.2, m) == pytest.approx(1.31)
    assert raised_margin(1.05, 1.05, 1.05, 3.0, m) == 1.5  # never above max_margin
    assert raised_margin(1.4, 1.05, 1.05, 1.1, m) == 1.4  # never below the margin in force
    assert raised_margin(1.05, 1.05, 1.05, math.inf, m) == 1.05  # nothing projected: no coefficient to fix
    assert raised_margin(1.05, 1.05, 1.05, 1.2, Monitor(raise_margin=False)) == 1.05
    # A policy margin above max_margin is its own bound.
    assert raised_margin(1.8, 1.8, 1.8, 1.2, m) == 1.8


# -- idle_free_bytes: auto -----------------------------------------------------------------------------


def auto_policy(**overrides: object) -> LoadedPolicy:
    return small_policy(vram__headroom="idle_budget", vram__idle_free_bytes="auto", **overrides)


def test_auto_idle_free_is_live_free_until_measured_then_the_budget(clock: ManualClock) -> None:
    a = Admission(auto_policy(), clock)
    assert a.rules.vram.headroom is HeadroomSource.NVML_FREE and a.rules.vram.idle_free_bytes is None
    busy = snapshot(clock.t, free_bytes=5 * GIB, running_requests=1)
    a.update_snapshot(busy)
    assert a.watch.idle is None and a.rules.vram.idle_free_bytes is None  # something runs
    a.update_snapshot(snapshot(clock.t, free_bytes=5 * GIB, queue_requests=2))
    assert a.watch.idle is None  # something waits
    a.update_snapshot(snapshot(clock.t, free_bytes=5 * GIB))
    assert a.rules.vram.headroom is HeadroomSource.IDLE_BUDGET
    assert a.rules.vram.idle_free_bytes == 5 * GIB and a.watch.idle is not None
    assert a.watch.idle.measured_at == clock.t and not a.watch.idle.after_traffic
    # Before any traffic a larger idle reading (warm-up settling) replaces it, a smaller does not.
    a.update_snapshot(snapshot(clock.t, free_bytes=6 * GIB))
    a.update_snapshot(snapshot(clock.t, free_bytes=4 * GIB))
    assert a.rules.vram.idle_free_bytes == 6 * GIB
    state = a.watch.state(clock.t + 5)
    assert state["idle_free"]["measured_bytes"] == 6 * GIB and state["idle_free"]["measured_age_s"] == 5


def test_auto_idle_free_waits_for_the_ledger_and_for_readings_after_the_last_request(
    clock: ManualClock,
) -> None:
    a = Admission(auto_policy(), clock)
    a.update_snapshot(snapshot(clock.t, running_requests=1))
    h = submit(a, ask(a, 1000, request_id="r1"))
    assert h.admitted
    clock.advance(1)
    a.update_snapshot(snapshot(clock.t, free_bytes=3 * GIB))  # the engine says idle, our request runs
    assert a.watch.idle is None
    stale = snapshot(clock.t, free_bytes=3 * GIB)
    clock.advance(1)
    h.end(Outcome.COMPLETED)
    a.update_snapshot(stale)  # readings taken before the request ended
    assert a.watch.idle is None
    a.update_snapshot(snapshot(clock.t, free_bytes=3 * GIB))
    assert a.watch.idle is not None and a.watch.idle.after_traffic  # a low-water mark, and says so
    a.update_snapshot(snapshot(clock.t, free_bytes=4 * GIB))
    assert a.rules.vram.idle_free_bytes == 3 * GIB  # after traffic it is not raised again
    assert "after traffic" in a.watch.state(clock.t)["idle_free"]["note"]


def test_auto_idle_free_is_measured_again_after_an_engine_restart(clock: ManualClock) -> None:
    a = Admission(auto_policy(), clock)
    a.update_snapshot(snapshot(clock.t, free_bytes=5 * GIB))
    submit(a, ask(a, 1000)).end(Outcome.COMPLETED)
    a.watch.engine_restarted(clock.t, "scheduler pid changed")
    assert a.watch.idle is None and a.watch.engine_restarts == 1
    a.update_snapshot(snapshot(clock.t, free_bytes=5 * GIB))  # engine_restarted does not reprice
    assert a.rules.vram.idle_free_bytes == 5 * GIB and not a.watch.idle.after_traffic  # type: ignore[union-attr]
    a.watch.engine_restarted(clock.t)
    a.update_snapshot(snapshot(clock.t, free_bytes=7 * GIB))
    assert a.rules.vram.idle_free_bytes == 7 * GIB


def test_a_policy_figure_stays_in_force_while_the_sidecar_measures(clock: ManualClock) -> None:
    p = small_policy(vram__headroom="idle_budget", vram__idle_free_bytes="2GiB")
    a = Admission(p, clock)
    a.update_snapshot(snapshot(clock.t, free_bytes=5 * GIB))
    assert a.watch.idle is not None and a.rules.vram.idle_free_bytes == 2 * GIB
    assert a.watch.state(clock.t)["idle_free"]["policy"] == 2 * GIB


# -- the monitor inside Admission -------------------------------------------------------------------


def gpu(snap: Snapshot, at: float, free: int, other: int | None = None) -> Snapshot:
    return replace(snap, gpu=GpuSignals(at, "test", (DeviceMemory("GPU-0", free, 80 * GIB, other),)))


def monitored(clock: ManualClock, **overrides: object) -> Admission:
    # 1 MiB per chunk token, margin 1.1: a 1000-token prompt is projected at 1,100 MiB.
    p = small_policy(
        cost__activation_bytes_per_chunk_token="1MiB",
        cost__margin=1.1,
        vram__headroom="idle_budget",
        vram__idle_free_bytes="auto",
        **overrides,
    )
    a = Admission(p, clock)
    a.update_snapshot(snapshot(clock.t, free_bytes=10 * GIB))
    assert a.watch.idle is not None
    return a


def test_an_allocation_within_the_projection_is_no_finding(clock: ManualClock) -> None:
    a = monitored(clock)
    submit(a, ask(a, 1000, request_id="r1"))
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 10 * GIB - 1000 * MIB))
    assert a.watch.underestimates == 0 and a.rules.cost.margin == 1.1


def test_an_allocation_beyond_the_projection_is_counted_named_and_raises_the_margin(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    a = monitored(clock)
    submit(a, ask(a, 1000, request_id="r1"))
    submit(a, ask(a, 500, request_id="r2"))  # projected 1,100 + 550 MiB
    clock.advance(0.1)
    with caplog.at_level("WARNING", logger="sidecar.monitor"):
        a.update_snapshot(gpu(a.snapshot, clock.t, 10 * GIB - 1980 * MIB))
    assert a.watch.underestimates == 1
    f = a.watch.last
    assert f is not None and f.request_ids == ("r1", "r2")
    assert f.observed_bytes == 1980 * MIB and f.projected_bytes == 1650 * MIB
    assert f.ratio == pytest.approx(1.2) and a.watch.worst_ratio == pytest.approx(1.2)
    # 1.1 x 1.2 + 0.05: in force for the next request, and in the state with its reason.
    assert a.rules.cost.margin == pytest.approx(1.37)
    assert ask(a, 1000).projected_bytes == int(1000 * MIB * 1.37)
    margin = a.watch.state(clock.t + 3)["monitor"]["margin"]
    assert margin["raised"] and margin["since_age_s"] == 3 and "r1, r2" in margin["why"]
    (record,) = [r for r in caplog.records if r.name == "sidecar.monitor"]
    fields = record.fields  # type: ignore[attr-defined]
    assert fields["event"] == "projection_underestimate" and fields["request_ids"] == ["r1", "r2"]
    assert fields["observed_bytes"] == 1980 * MIB and fields["margin_after"] == pytest.approx(1.37)
    # A reload is a new calibration: the policy's own margin again; what was counted stays counted.
    a.reload(a.loaded)
    assert a.rules.cost.margin == 1.1 and a.watch.underestimates == 1


def test_a_caching_allocator_is_judged_on_new_lows_against_the_largest_projection(clock: ManualClock) -> None:
    a = monitored(clock, monitor__raise_margin=False)
    big = submit(a, ask(a, 1000, request_id="big"))
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 10 * GIB - 1000 * MIB))
    big.end(Outcome.COMPLETED)
    # A small request reuses the cache: free stays at the low-water mark, which is no finding.
    small = submit(a, ask(a, 100, request_id="small"))
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 10 * GIB - 1000 * MIB))
    # A new low while only the small one runs is compared with the largest projection (1,100 MiB).
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 10 * GIB - 1090 * MIB))
    assert a.watch.underestimates == 0
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 10 * GIB - 1300 * MIB))
    assert a.watch.underestimates == 1 and a.watch.last.request_ids == ("small",)  # type: ignore[union-attr]
    # The same request's prefill growing further is the same finding, worse, not a new one.
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 10 * GIB - 1400 * MIB))
    assert a.watch.underestimates == 1 and a.watch.worst_ratio == pytest.approx(1400 / 1100)
    assert a.rules.cost.margin == 1.1  # raise_margin: false counts and logs only
    small.end(Outcome.COMPLETED)


def test_other_processes_growing_and_an_unanswering_engine_are_no_findings(clock: ManualClock) -> None:
    a = Admission(
        small_policy(
            cost__activation_bytes_per_chunk_token="1MiB",
            vram__headroom="idle_budget",
            vram__idle_free_bytes="auto",
        ),
        clock,
    )
    a.update_snapshot(gpu(snapshot(clock.t), clock.t, 10 * GIB, other=500 * MIB))
    submit(a, ask(a, 1000, request_id="r1"))
    clock.advance(0.1)
    # 1,000 MiB of the engine's, 2 GiB more of a neighbour's: the engine's share is as projected.
    a.update_snapshot(gpu(a.snapshot, clock.t, 10 * GIB - 3048 * MIB, other=2548 * MIB))
    assert a.watch.underestimates == 0
    # An engine that does not answer may be booting a new process: its memory is no request's.
    down = replace(a.snapshot, engine_health=SourceHealth(clock.t - 1, "refused", 2))
    clock.advance(0.1)
    a.update_snapshot(gpu(down, clock.t, 1 * GIB, other=2548 * MIB))
    assert a.watch.underestimates == 0


def test_held_requests_are_priced_again_with_the_raised_margin(clock: ManualClock) -> None:
    a = monitored(clock, vram__reserve_bytes="8GiB")  # 2 GiB of budget
    submit(a, ask(a, 1000, request_id="r1"))
    held = submit(a, ask(a, 1000, request_id="r2"))
    assert held.held and held.demand is not None and held.demand.projected_bytes == 1100 * MIB
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 10 * GIB - 1320 * MIB))
    assert held.demand.projected_bytes == int(1000 * MIB * a.rules.cost.margin) > 1100 * MIB


# -- acceptance: calibrated on the unperturbed engine, the engine perturbed afterwards -----------------


def test_the_monitor_reports_within_one_request_and_its_margin_stops_the_crash() -> None:
    """The outage burst on the old-gather lane: `policies/maxq-qwen3next-old.yaml` was calibrated on
    the unperturbed `maxq-old` profile; here every transient and the batch join are 1.2x larger."""
    sc = load_scenario(ROOT / "scenarios" / "maxq-outage-burst.yaml")
    profile = perturbed(get_profile(sc.profile), scale=1.2)

    def run(raise_margin: bool) -> Driver:
        d = Driver(sc, profile, maxq().with_section("monitor", raise_margin=raise_margin), sc.seed)
        d.run()
        return d

    blind = run(False)
    assert blind.crashes, "the perturbed lane must crash without the automatic margin (else no test)"
    first = blind.admission.watch.last  # type: ignore[union-attr]
    assert first is not None and first.at < blind.crashes[0]["t"]  # counted before the crash, too

    d = run(True)
    w = d.admission.watch  # type: ignore[union-attr]
    assert w.underestimates >= 1 and w.margin_finding is not None
    f = w.margin_finding
    # Within one request: the finding names the first request admitted, while it still runs.
    (rid,) = f.request_ids
    first_admitted = min(
        (a for a in d.attempts.values() if a.admitted_at is not None), key=lambda a: a.admitted_at or 0
    )
    assert rid == first_admitted.rid and f.at <= d.records[rid].end  # type: ignore[operator]
    assert f.ratio is not None and f.ratio > 1.1 and f.margin_after > 1.2
    assert not d.crashes
    summary = d.summary()
    assert summary["monitor"]["monitor"]["margin"]["effective"] == pytest.approx(f.margin_after, abs=1e-4)
    assert summary["ledger_at_end"] == 0 and summary["completed"] > 0


def test_the_unperturbed_lane_has_no_findings() -> None:
    sc = load_scenario(ROOT / "scenarios" / "maxq-outage-burst.yaml")
    d = Driver(sc, get_profile(sc.profile), maxq(), sc.seed)
    d.run()
    assert d.admission is not None and d.admission.watch.underestimates == 0
    assert not d.crashes


# -- the live sidecar ------------------------------------------------------------------------------


class RestartingEngine(FakeEngine):
    """A fake engine whose /metrics can fail, as while its process restarts."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    async def __call__(self, scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "http" and scope["path"] == "/metrics" and self.down:
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b"restarting"})
            return
        await super().__call__(scope, receive, send)


def _metric(text: str, name: str) -> float | None:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "sglang_sidecar_" + name:
                return s.value
    return None


async def test_state_and_metrics_show_the_idle_figure_and_the_monitor_live(tmp_path: Path) -> None:
    engine = RestartingEngine()
    engine.gate_headers.clear()  # a long prefill: the request stays in the ledger
    overrides = dict(
        vram__headroom="idle_budget",
        vram__idle_free_bytes="auto",
        cost__activation_bytes_per_chunk_token="1MiB",
        cost__margin=1.1,
    )
    async with (
        lane(tmp_path, engine, free_mib=4096, **overrides) as (url, app, gpu_file),
        httpx.AsyncClient(timeout=10) as client,
    ):

        async def state() -> dict:  # type: ignore[type-arg]
            return (await client.get(url + "/admission/state")).json()

        await eventually(lambda: app.admission.watch.idle is not None)
        s = await state()
        assert s["idle_free"]["measured_bytes"] == 4096 * MIB and s["idle_free"]["measured_at"].endswith("Z")
        assert (
            s["idle_free"]["headroom_in_force"] == "idle_budget"
            and s["idle_free"]["in_force_bytes"] == 4096 * MIB
        )
        text = (await client.get(url + "/metrics")).text
        assert _metric(text, "idle_free_bytes") == 4096 * MIB
        assert _metric(text, "projection_underestimates_total") == 0
        assert _metric(text, "cost_margin") == 1.1 and _metric(text, "policy_cost_margin") == 1.1

        # A 1000-token prefill is projected at 1,100 MiB; the GPU shows 1,400 MiB taken.
        pending = asyncio.ensure_future(client.post(url + "/generate", json=gen(tokens=1000, rid="slow-1")))
        await eventually(lambda: app.admission.ledger.totals.requests == 1)
        write_gpu_file(gpu_file, 4096 * MIB - 1400 * MIB)
        await eventually(lambda: app.admission.watch.underestimates == 1)
        s = await state()
        m = s["monitor"]
        assert m["last"]["request_ids"] == ["slow-1"] and m["last"]["at"].endswith("Z")
        assert m["margin"]["effective"] == pytest.approx(1.1 * 1400 / 1100 + 0.05, abs=1e-3)
        assert m["margin"]["raised"] and m["margin"]["since"].endswith("Z")
        text = (await client.get(url + "/metrics")).text
        assert _metric(text, "projection_underestimates_total") == 1
        assert _metric(text, "projection_underestimate_worst_ratio") == pytest.approx(1400 / 1100, abs=1e-3)
        explained = (await client.post(url + "/admission/explain", json={"prompt_tokens": 1000})).json()
        assert explained["margin"] == pytest.approx(m["margin"]["effective"], abs=1e-3)
        engine.gate_headers.set()
        engine.release.set()
        assert (await pending).status_code == 200

        # The engine restarts (failed scrapes, then answers again): idle free is measured anew.
        engine.down = True
        await eventually(lambda: app.admission.snapshot.engine_health.consecutive_failures > 0)
        write_gpu_file(gpu_file, 5000 * MIB)
        engine.down = False
        await eventually(lambda: app.admission.watch.engine_restarts == 1)
        await eventually(lambda: app.admission.rules.vram.idle_free_bytes == 5000 * MIB)
        s = await state()
        assert s["idle_free"]["engine_restarts"] == 1 and not s["idle_free"]["after_traffic"]


def test_check_policy_and_a_shipped_policy_with_auto(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from sidecar.cli import main

    text = (ROOT / "policies" / "maxq-qwen3next-old.yaml").read_text()
    path = tmp_path / "auto.yaml"
    path.write_text(text.replace("idle_free_bytes: 1372MiB", "idle_free_bytes: auto"))
    assert main(["check-policy", str(path)]) == 0
    out = capsys.readouterr().out
    assert "idle free memory: auto: measured by the sidecar" in out
    assert "nvml_free until idle free memory is measured, then idle_budget" in out
    assert "monitor: under-predictions are counted and logged, and raise cost.margin" in out
    path.write_text(text.replace("idle_free_bytes: 1372MiB", "idle_free_bytes: automatic"))
    assert main(["check-policy", str(path)]) != 0
    err = capsys.readouterr()
    assert "vram.idle_free_bytes" in err.out + err.err and "or auto" in err.out + err.err


def test_admitting_nothing_the_gate_still_judges_what_it_sees(clock: ManualClock) -> None:
    """Memory taken while nothing was admitted is a finding with no ratio, and no margin change."""
    a = monitored(clock)
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 10 * GIB - 200 * MIB))
    assert a.watch.underestimates == 1 and a.watch.last is not None and a.watch.last.ratio is None
    assert a.rules.cost.margin == 1.1 and a.watch.worst_ratio is None
    assert submit(a, ask(a, 10)).decision.action is Action.ADMIT  # type: ignore[union-attr]
