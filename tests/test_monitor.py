"""The lane watch (sidecar/admission/lane_watch.py): `vram.idle_free_bytes: auto` and the under-prediction monitor.

The pure rules (`excess`, `raised_margin`) and the watch inside a real `Admission` fed snapshots on a
manual clock; `make mutation` runs these against the core's mutants. The acceptance run in replay and
the live sidecar are in `tests/test_monitor_lane.py`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from sidecar.admission.controller import Admission, Outcome
from sidecar.admission.lane_watch import LaneWatch, draw_bracket, excess, raised_margin
from sidecar.core.decision import Action
from sidecar.core.ledger import LedgerTotals
from sidecar.core.rules import HeadroomSource, Rules
from sidecar.core.snapshot import DeviceMemory, GpuSignals, Snapshot, SourceHealth
from sidecar.policy.in_force import rules_of
from sidecar.policy.schema import LoadedPolicy, Monitor
from tests.conftest import MIB, ManualClock, ask, small_policy, snapshot, submit

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
    # Projected with 1.05, allocated 1.2x that: 1.05 x 1.2 x 1.05 (the safety), at least + 0.05.
    assert raised_margin(1.05, 1.05, 1.05, 1.2, m) == pytest.approx(1.323)
    assert raised_margin(1.0, 1.0, 1.0, 1.01, m) == pytest.approx(1.0605)  # 1.01 x 1.05 > 1.01 + 0.05
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
    clock.advance(0.1)  # the new process's report, and a GPU reading after the restart
    a.update_snapshot(snapshot(clock.t, free_bytes=5 * GIB))  # engine_restarted does not reprice
    assert a.rules.vram.idle_free_bytes == 5 * GIB and not a.watch.idle.after_traffic  # type: ignore[union-attr]
    a.watch.engine_restarted(clock.t)
    clock.advance(0.1)
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
    with caplog.at_level("WARNING", logger="sidecar.admission.lane_watch"):
        a.update_snapshot(gpu(a.snapshot, clock.t, 10 * GIB - 1980 * MIB))
    assert a.watch.underestimates == 1
    f = a.watch.last
    assert f is not None and f.request_ids == ("r1", "r2")
    assert f.observed_bytes == 1980 * MIB and f.projected_bytes == 1650 * MIB
    assert f.ratio == pytest.approx(1.2) and a.watch.worst_ratio == pytest.approx(1.2)
    # 1.1 x 1.2 x 1.05: in force for the next request, and in the state with its reason.
    assert a.rules.cost.margin == pytest.approx(1.386)
    assert ask(a, 1000).projected_bytes == int(1000 * MIB * 1.386)
    margin = a.watch.state(clock.t + 3)["monitor"]["margin"]
    assert margin["raised"] and margin["since_age_s"] == 3 and "r1, r2" in margin["why"]
    (record,) = [r for r in caplog.records if r.name == "sidecar.admission.lane_watch"]
    fields = record.fields  # type: ignore[attr-defined]
    assert fields["event"] == "projection_underestimate" and fields["request_ids"] == ["r1", "r2"]
    assert fields["observed_bytes"] == 1980 * MIB and fields["margin_after"] == pytest.approx(1.386)
    # A reload is a new calibration: the policy's own margin again; what was counted stays counted.
    a.reload(a.loaded)
    assert a.rules.cost.margin == 1.1 and a.watch.underestimates == 1


def test_with_a_calibrated_ratio_a_reading_is_judged_against_the_cost_terms_not_the_margin(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Evidence D18: compared with the margin-priced projection, a lane that draws above its fit is
    not seen while the margin's safety covers it, and a prompt at the edge of the margin then draws
    past it. With ``cost.calibrated_ratio`` the same reading is a finding."""
    # 1,000 MiB of cost terms for r1, charged 1,100 MiB (margin 1.1); the lane allocates 1,080 MiB.
    plain = monitored(clock)
    submit(plain, ask(plain, 1000, request_id="r1"))
    clock.advance(0.1)
    plain.update_snapshot(gpu(plain.snapshot, clock.t, 10 * GIB - 1080 * MIB))
    assert plain.watch.underestimates == 0 and plain.rules.cost.margin == 1.1

    a = monitored(clock, cost__calibrated_ratio=1.0)
    submit(a, ask(a, 1000, request_id="r1"))
    clock.advance(0.1)
    with caplog.at_level("WARNING", logger="sidecar.admission.lane_watch"):
        a.update_snapshot(gpu(a.snapshot, clock.t, 10 * GIB - 1080 * MIB))
    assert a.watch.underestimates == 1
    f = a.watch.last
    assert f is not None and (f.observed_bytes, f.projected_bytes) == (1080 * MIB, 1000 * MIB)
    assert f.ratio == pytest.approx(1.08) and f.covered == 1.0
    # The margin covers what was seen times the safety: 1.08 x 1.05.
    assert a.rules.cost.margin == pytest.approx(1.134)
    (record,) = [r for r in caplog.records if r.name == "sidecar.admission.lane_watch"]
    assert "its cost terms x1.000" in record.getMessage() and record.fields["covered"] == 1.0  # type: ignore[attr-defined]
    # What a finding showed is known from then on: a new low within it and the tolerance is none ...
    assert a.watch.covered == pytest.approx(1.08)
    submit(a, ask(a, 10, request_id="r2"))  # charged at the raised margin, 1.134
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 10 * GIB - 1090 * MIB))
    assert a.watch.underestimates == 1 and a.watch.last is f
    # ... a reading beyond it is one. The ledger's bytes over the smallest margin they were charged
    # with (1.1) bound their cost terms from above: r2's 11.34 MiB count as 10.3, never less than 10.
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 10 * GIB - 1160 * MIB))
    assert a.watch.underestimates == 2 and a.watch.last.covered == pytest.approx(1.08)  # type: ignore[union-attr]
    terms = 1000 + 10 * 1.134 / 1.1
    assert a.watch.last.projected_bytes == pytest.approx(terms * 1.08 * MIB, rel=1e-4)  # type: ignore[union-attr]
    assert a.watch.state(clock.t)["monitor"]["covered_ratio"] == pytest.approx(1160 / terms, abs=1e-4)
    # A policy load is a new calibration: its ratio again. Loaded with a lower margin, the bytes
    # charged before it count over that one (the smallest any was priced with).
    lower = small_policy(
        cost__activation_bytes_per_chunk_token="1MiB",
        cost__margin=1.05,
        cost__calibrated_ratio=1.0,
        vram__headroom="idle_budget",
        vram__idle_free_bytes="auto",
    )
    a.reload(lower)
    assert a.watch.covered == 1.0 and a.rules.cost.margin == 1.05
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 10 * GIB - 1300 * MIB))
    assert a.watch.last.projected_bytes == pytest.approx((1100 + 11.34) / 1.05 * MIB, rel=1e-4)  # type: ignore[union-attr]


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


def test_admitting_nothing_the_gate_still_judges_what_it_sees(clock: ManualClock) -> None:
    """Memory taken while nothing was admitted is no projection gone wrong: noted, not counted."""
    a = monitored(clock)
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 10 * GIB - 200 * MIB))
    assert a.watch.underestimates == 0 and a.watch.unprojected == 1 and a.watch.last is None
    assert a.rules.cost.margin == 1.1 and a.watch.worst_ratio is None
    assert a.watch.state(clock.t)["monitor"]["unprojected_allocations"] == 1
    assert submit(a, ask(a, 10)).decision.action is Action.ADMIT  # type: ignore[union-attr]


def test_a_raised_margin_keeps_the_held_token_count_of_those_still_held(clock: ManualClock) -> None:
    """Retry-After counts the held requests' tokens: a reprice counts only those still held."""
    a = monitored(clock, vram__reserve_bytes="8GiB")  # 2 GiB of budget: one 1,100 MiB prefill at a time
    first = submit(a, ask(a, 1000, request_id="r1"))
    second = submit(a, ask(a, 1000, request_id="r2"))
    third = submit(a, ask(a, 900, request_id="r3"))
    assert second.held and third.held
    first.end(Outcome.COMPLETED)
    assert second.admitted and third.held
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 10 * GIB - 1400 * MIB))  # r2 over its projection
    assert a.rules.cost.margin > 1.1
    assert a.situation().held_tokens == 900
    # The admitted one keeps the demand it was charged with; only the held one is priced again.
    assert second.demand is not None and second.demand.projected_bytes == 1100 * MIB
    assert third.demand is not None and third.demand.projected_bytes == int(900 * MIB * a.rules.cost.margin)


# -- with the prefills' progress known -------------------------------------------------------------


def _watch_with_progress(**overrides: object) -> tuple[LaneWatch, Rules]:
    """A watch on a lane with a policy idle figure (10 GiB) and one admitted request, whose prefill's
    progress is known: readings are judged against ``in_flight``, what it allocates at that progress."""
    p = small_policy(
        vram__headroom="idle_budget",
        vram__idle_free_bytes="10GiB",
        monitor__tolerance=0.0,
        monitor__min_bytes="1MiB",
        monitor__raise_margin=False,
        **overrides,
    ).policy
    rules = rules_of(p)
    w = LaneWatch(rules)
    w.charged(1, "r1", LedgerTotals(requests=1, running_requests=1), rules.cost, progress=True)
    return w, rules


def test_with_progress_a_reading_is_judged_by_the_progress_now_not_by_an_earlier_over_estimate() -> None:
    """Progress estimates err large and are corrected when the engine's counters catch up. The next
    reading bounds everything allocated since the last one by the progress now (true progress only
    grows); judged against the earlier over-estimate, an overrun smaller than it went unseen, and on a
    lane whose margin leaves a prompt at the edge ~2 % of its peak that was a crash (docs/benchmarks.md "The band
    under noise")."""
    w, rules = _watch_with_progress()
    busy = LedgerTotals(requests=1, running_requests=1)
    base = snapshot(0.0, running_requests=1)
    w.observe(gpu(base, 0.1, 10 * GIB - 900 * MIB), busy, rules, 0.1, in_flight=1000 * MIB)
    assert w.underestimates == 0
    w.observe(gpu(base, 0.2, 10 * GIB - 970 * MIB), busy, rules, 0.2, in_flight=950 * MIB)
    assert w.underestimates == 1
    assert w.last is not None and w.last.projected_bytes == 950 * MIB and w.last.observed_bytes == 970 * MIB


def test_with_progress_the_batch_join_of_the_previous_reading_still_counts() -> None:
    """A running batch that shrank between two readings allocated its join with more requests; the
    allocator's cache still shows that peak, so the next reading allows for the earlier join."""
    w, rules = _watch_with_progress(cost__batch_join_bytes_per_running_request="100MiB")
    base = snapshot(0.0, running_requests=2)
    two, one = LedgerTotals(running_requests=2), LedgerTotals(running_requests=1)
    assert rules.cost.join_bytes(2) == 200 * MIB and rules.cost.join_bytes(1) == 0
    w.observe(gpu(base, 0.1, 10 * GIB - 150 * MIB), two, rules, 0.1, in_flight=10 * MIB)
    w.observe(gpu(base, 0.2, 10 * GIB - 195 * MIB), one, rules, 0.2, in_flight=10 * MIB)
    assert w.underestimates == 0
    w.observe(gpu(base, 0.3, 10 * GIB - 196 * MIB), one, rules, 0.3, in_flight=10 * MIB)
    assert w.underestimates == 1  # two readings on, the two-request join no longer vouches for it


def test_without_progress_the_previous_projection_still_counts() -> None:
    """Without progress a reading is judged against the ledger's final peaks, and a prefill that ended
    between two readings left the ledger while its peak stays in the allocator's cache."""
    w, rules = _watch_with_progress()
    base = snapshot(0.0, running_requests=1)
    busy, done = LedgerTotals(requests=1, projected_bytes=1000 * MIB), LedgerTotals()
    w.observe(gpu(base, 0.1, 10 * GIB - 500 * MIB), busy, rules, 0.1)
    w.observe(gpu(base, 0.2, 10 * GIB - 990 * MIB), done, rules, 0.2)
    assert w.underestimates == 0 and w.unprojected == 0


# -- the draw the readings bound (issue 29: the monitor in proportion) ---------------------------------


def test_a_lone_prefills_readings_bracket_its_draw_and_a_change_starts_the_bracket_again() -> None:
    # Projected 1,000 MiB of terms at progress, one chunk of growth 40 MiB: the engine may be a chunk
    # behind, so 1,030 MiB allocated is a draw of x1.030 at least and x1.030 / 0.96 at most.
    b = draw_bracket(1030 * MIB, 1000 * MIB, 40 * MIB, None)
    assert b == pytest.approx((1.03, 1030 / 960))
    # A reading between chunks (the projection a chunk ahead) narrows it from above: x1.03 confirmed.
    b = draw_bracket(1030 * MIB, 1040 * MIB, 40 * MIB, b)
    assert b == pytest.approx((1.03, 1.03))
    # A draw that no longer overlaps (the engine changed under the sidecar) starts it again.
    assert draw_bracket(1150 * MIB, 1040 * MIB, 40 * MIB, b) == pytest.approx((1150 / 1040, 1.15))
    # Terms within a chunk of zero bound nothing.
    assert draw_bracket(50 * MIB, 40 * MIB, 40 * MIB, b) is None


def test_a_draw_bounded_within_the_margin_in_force_raises_nothing() -> None:
    m = Monitor(max_margin=1.5)  # safety 0.05, step 0
    # Compared with the cost terms (projected with 1.0): a x1.03 draw under a margin of 1.05.
    assert raised_margin(1.05, 1.0, 1.05, 1.03, m, upper=1.035) == 1.05
    # The same reading with no upper bound (several requests, progress unknown): the safety goes on
    # top of the draw, which may be understated by the projection's lead.
    assert raised_margin(1.05, 1.0, 1.05, 1.03, m) == pytest.approx(1.0815)
    # A bound beyond the margin: at least the bound (every draw the readings allow), and at least the
    # draw seen with the safety on top (what the rule without a bound gives: never less than that).
    assert raised_margin(1.05, 1.0, 1.05, 1.046, m, upper=1.1) == pytest.approx(1.1)
    assert raised_margin(1.05, 1.0, 1.05, 1.06, m, upper=1.07) == pytest.approx(1.113)
    # Never below the margin in force, never above max_margin.
    assert raised_margin(1.2, 1.0, 1.05, 1.1, m, upper=1.15) == 1.2
    assert raised_margin(1.05, 1.0, 1.05, 1.4, m, upper=1.6) == 1.5


def test_chunk_growth_is_one_chunk_of_context_terms() -> None:
    from sidecar.admission.lane_watch import chunk_growth
    from sidecar.policy.schema import load_policy_file
    from tests.conftest import ROOT

    cost = rules_of(load_policy_file(ROOT / "policies" / "maxq-qwen3next-old.yaml").policy).cost
    # 8,192 more tokens of context at 4,783 bytes each (the old build's context terms, gather merged).
    assert chunk_growth(cost, 8192) == 8192 * 4783


def test_a_policy_step_is_the_least_a_margin_keeps_above_a_bounded_draw() -> None:
    # The emulator-exact policies' step 0.1: a margin of 1.13 covers bounded draws up to 1.03 only.
    m = Monitor(max_margin=1.5, step=0.1)
    assert raised_margin(1.13, 1.0, 1.0, 1.02, m, upper=1.025) == 1.13
    assert raised_margin(1.13, 1.0, 1.0, 1.05, m, upper=1.06) == pytest.approx(1.15)
