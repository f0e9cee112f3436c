"""A request that starts its own prefill batch, priced by its own chunk schedule (``core/decide``).

On the old Max-Q lane priced as it was before evidence D19 (budget 1,372 MiB, reserve 16 MiB, margin
1.011; the shipped policy now keeps 2 MiB at margin 1.0, which admits this prompt either way), a cold
273,347-token prompt projects 1,357.6 MiB with a full last chunk at the whole context, over the 1,356
MiB the lane can ever run: unfit. Its own last chunk is 3,011 tokens; its own schedule peaks at 1,343.7 MiB (the full chunk
before it). Alone, nothing can shift its chunks, and the gate admits it at that price.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.core import demand as demand_mod
from sidecar.core.cost import project_own
from sidecar.core.decide import Situation, decide
from sidecar.core.decision import Action, Check, Reason
from sidecar.core.ledger import LedgerTotals
from sidecar.core.overrun import Prefill, overruns, peak
from sidecar.core.snapshot import DeviceMemory, GpuSignals
from sidecar.policy.in_force import rules_of
from tests.conftest import MIB, ask, maxq, small_policy, snapshot, submit, with_engine

NOW = 1000.0
BAND = 273_347  # 96.1 % of the 284,359 tokens the lane serves alone (bench band family, seed 0)
# The arithmetic below rests on these two figures, not on whatever the shipped policy holds.
LANE = maxq().with_section("cost", margin=1.011).with_section("vram", reserve_bytes=16 * MIB)
RULES = rules_of(LANE.policy)


EMPTY = LedgerTotals()


def _situation(ledger: LedgerTotals = EMPTY, verifies: bool = True, **engine: object) -> Situation:
    pool = {"max_total_tokens": 522_880, "kv_available_tokens": 522_880}
    snap = snapshot(NOW, free_bytes=None, **(pool | engine))
    return Situation(RULES, snap, ledger, NOW, verifies_hits=verifies)


def _ask(tokens: int = BAND, **kw: object) -> demand_mod.Demand:
    return demand_mod.build(RULES, tokens, arrived_at=NOW, max_new_tokens=1024, **kw)  # type: ignore[arg-type]


def test_the_band_request_is_unfit_at_a_full_last_chunk_and_fits_by_its_own_schedule() -> None:
    d = _ask()
    cap = RULES.vram.transient_cap()
    assert cap is not None and d.own_bytes(RULES) <= cap < d.projected_bytes
    assert d.own_bytes(RULES) == project_own(RULES.cost, BAND, BAND, 8192)


def test_alone_it_is_admitted_at_its_own_price_and_marked_so() -> None:
    d = decide(_ask(), _situation())
    assert d.action is Action.ADMIT
    assert d.charge.projected_bytes == _ask().own_bytes(RULES) and d.charge.own_prefills == 1


def test_without_sight_of_the_engine_s_hits_it_stays_unfit() -> None:
    """No prefill counters (or no guard): a hit the gate did not count could not be seen moving its
    chunks, so the full last chunk stands."""
    d = decide(_ask(), _situation(verifies=False))
    assert d.action is Action.REJECT and d.reason is Reason.UNFIT_REQUEST


@pytest.mark.parametrize(
    ("ledger", "engine"),
    [
        (LedgerTotals(requests=1, running_requests=1), {}),  # an admitted prefill ahead of it
        (LedgerTotals(), {"queue_requests": 1}),  # a request waiting in the engine
        (LedgerTotals(), {"queue_requests": None}),  # unknown: as good as one
        (LedgerTotals(), {"pending_prefill_tokens": 2_000}),  # a prefill in the engine's hands
        (LedgerTotals(), {"pending_prefill_tokens": None}),
    ],
)
def test_with_anything_that_could_start_ahead_of_it_it_waits(ledger: LedgerTotals, engine: dict) -> None:
    """Not alone: held (not unfit), until it would start its own batch."""
    d = decide(_ask(), _situation(ledger, **engine))
    assert d.action is Action.HOLD and d.reason is Reason.VRAM_HEADROOM
    assert d.charge.own_prefills == 0


def test_on_a_stale_engine_report_it_is_not_priced_alone() -> None:
    s = _situation()
    old = replace(s, snapshot=with_engine(s.snapshot, observed_at=NOW - 100), now=NOW)
    d = decide(
        _ask(), replace(old, rules=replace(RULES, engine=replace(RULES.engine, on_stale=Action.ADMIT)))
    )
    assert d.action is Action.HOLD and d.charge.own_prefills == 0


def test_a_batch_of_prompts_is_never_priced_alone() -> None:
    d = decide(_ask(prompts=2), _situation())
    assert d.action is Action.REJECT and d.reason is Reason.UNFIT_REQUEST


def test_a_request_that_fits_at_a_full_last_chunk_keeps_that_price() -> None:
    """The own price is taken only where the full one does not fit: it holds newcomers back."""
    d = decide(_ask(200_000), _situation())
    assert d.admitted and d.charge.projected_bytes == _ask(200_000).projected_bytes
    assert d.charge.own_prefills == 0


def test_newcomers_wait_while_an_own_priced_prefill_runs() -> None:
    ledger = LedgerTotals(requests=1, running_requests=1, own_prefills=1, projected_bytes=1)
    d = decide(_ask(1_000), _situation(ledger))
    assert d.action is Action.HOLD and d.reason is Reason.VRAM_HEADROOM
    assert [c.name for c in d.checks if not c.ok] == ["own_schedule"]
    assert "own_schedule" not in {c.name for c in decide(_ask(1_000), _situation()).checks}


# -- the in-flight guard prices it by its own schedule, and by every hit the counters allow --------


def _own() -> demand_mod.Demand:
    return _ask(own_schedule=True)


def test_the_guard_keeps_the_own_price_until_the_counters_show_a_larger_hit() -> None:
    d = _own()
    own, worst = d.own_bytes(RULES), d.projected_bytes
    # Not started: the cache counter's growth is not its own yet (nothing of it has run).
    assert peak(RULES, Prefill(1, d, done_tokens=0, cached_bound=3_000)) == own
    assert peak(RULES, Prefill(1, d, done_tokens=8192, started=True, cached_bound=0)) == own
    moved = peak(RULES, Prefill(1, d, done_tokens=8192, started=True, cached_bound=3_000))
    assert moved == project_own(RULES.cost, BAND, BAND, 8192, 3_000) and own < moved < worst
    # No counter: the hit cannot be seen at all.
    assert peak(RULES, Prefill(1, d)) == worst
    # A request not priced alone keeps its full last chunk whatever the counters say.
    assert peak(RULES, Prefill(1, _ask(), done_tokens=0)) == worst


def test_a_hit_the_gate_counted_is_not_taken_for_a_larger_one() -> None:
    d = _ask(cached_tokens=1_000, own_schedule=True)
    counted = Prefill(1, d, done_tokens=8192, started=True, cached_bound=1_000)
    assert peak(RULES, counted) == d.own_bytes(RULES) < d.projected_bytes
    more = Prefill(1, d, done_tokens=8192, started=True, cached_bound=1_500)
    assert peak(RULES, more) == project_own(RULES.cost, BAND, BAND - 1_000, 8192, 500)


def test_the_guard_aborts_it_when_a_hit_moved_its_chunks_past_the_room() -> None:
    snap = snapshot(NOW, free_bytes=None, max_total_tokens=522_880, kv_available_tokens=522_880)
    fine = Prefill(1, _own(), done_tokens=8192, started=True, cached_bound=0)
    assert overruns([fine], RULES, snap, running=1) == ()
    shifted = Prefill(1, _own(), done_tokens=8192, started=True, cached_bound=3_100)
    (o,) = overruns([shifted], RULES, snap, running=1)
    assert o.key == 1 and not o.fits_idle


def test_the_own_price_is_checked_against_the_room_now() -> None:
    """Another process grew by 100 MiB: the request still fits the lane when idle (not unfit), but not
    the room left now, even priced alone: held."""
    s = _situation()
    grown = (RULES.vram.other_processes_bytes or 0) + 100 * 2**20
    gpu = GpuSignals(NOW, "test", (DeviceMemory("g", 0, 96 << 30, other_process_bytes=grown),))
    d = decide(_ask(), replace(s, snapshot=replace(s.snapshot, gpu=gpu)))
    assert d.action is Action.HOLD and d.reason is Reason.VRAM_HEADROOM


def test_a_request_whose_own_price_is_exactly_the_cap_fits() -> None:
    """1 KiB per chunk token, 1 B per context token, 1,000-token chunks, 1,500 tokens: a full last
    chunk costs 1,025,500 B, its own schedule 1,025,000 B (the full first chunk ending at 1,000)."""
    policy = small_policy(
        cost__context_bytes_per_token=1, vram__max_transient_bytes=1_025_000, engine__max_age_s=5
    ).policy
    rules = rules_of(policy)
    d = demand_mod.build(rules, 1_500, arrived_at=NOW)
    assert (d.own_bytes(rules), d.projected_bytes) == (1_025_000, 1_025_500)
    s = Situation(rules, snapshot(NOW), LedgerTotals(), NOW, verifies_hits=True)
    # Not unfit; and on this lane's room it goes in at the full price (the own one is for when that
    # does not fit).
    fits = decide(d, s)
    assert fits.admitted and fits.charge.projected_bytes == 1_025_500 and not fits.charge.own_prefills
    assert decide(d, replace(s, verifies_hits=False)).reason is Reason.UNFIT_REQUEST


def test_the_holds_name_themselves_in_the_decision() -> None:
    """What explain and the decision log show for the two holds."""
    own = decide(_ask(1_000), _situation(LedgerTotals(requests=1, running_requests=1, own_prefills=1)))
    assert (
        Check("own_schedule", False, note="a prefill priced by its own chunk schedule is in flight")
        in own.checks
    )
    join = decide(_ask(10_000), replace(_situation(), join_settles_at=NOW + 1))
    assert (
        Check("join_pending", False, note="a streaming request has not joined the running batch yet")
        in join.checks
    )


# -- the shell: the gate sees the engine's counters and runs the guard --------------------------


def _lane(clock, *, counters: bool = True, guard: bool = True):  # type: ignore[no-untyped-def]
    from sidecar.admission.controller import Admission

    policy = LANE if guard else LANE.with_section("guard", enabled=False)
    a = Admission(policy, clock)
    progress = {"prefill_computed_tokens": 0, "prefill_cached_tokens": 0} if counters else {}
    a.update_snapshot(
        snapshot(clock(), free_bytes=None, max_total_tokens=522_880, kv_available_tokens=522_880, **progress)
    )
    return a


@pytest.mark.parametrize(("counters", "guard"), [(False, True), (True, False)])
def test_without_the_counters_or_the_guard_the_shell_keeps_the_full_chunk(
    clock, counters: bool, guard: bool
) -> None:  # type: ignore[no-untyped-def]
    a = _lane(clock, counters=counters, guard=guard)
    h = submit(a, ask(a, BAND, max_new_tokens=1024))
    assert h.decision is not None and h.decision.reason is Reason.UNFIT_REQUEST


def test_off_by_default_the_shell_keeps_the_full_chunk(clock) -> None:  # type: ignore[no-untyped-def]
    """Own-schedule pricing is ``experimental`` (docs/evidence.md G5): a lane policy without the key
    prices the band prompt at its full last chunk, as without the counters."""
    from sidecar.admission.controller import Admission

    a = Admission(LANE.with_section("experimental", own_schedule_pricing=False), clock)
    progress = {"prefill_computed_tokens": 0, "prefill_cached_tokens": 0}
    a.update_snapshot(
        snapshot(clock(), free_bytes=None, max_total_tokens=522_880, kv_available_tokens=522_880, **progress)
    )
    h = submit(a, ask(a, BAND, max_new_tokens=1024))
    assert h.decision is not None and h.decision.reason is Reason.UNFIT_REQUEST


def test_the_shell_admits_it_alone_and_the_guard_prices_it_so(clock) -> None:  # type: ignore[no-untyped-def]
    a = _lane(clock)
    h = submit(a, ask(a, BAND, max_new_tokens=1024))
    assert h.admitted and a.ledger.totals.own_prefills == 1
    (p,) = a.in_flight()
    assert p.demand.own_schedule
    # Its first batch ran with no hit beyond the count: the guard, on this report, leaves it be.
    clock.advance(1.0)
    a.update_snapshot(
        snapshot(
            clock(),
            free_bytes=None,
            max_total_tokens=522_880,
            kv_available_tokens=514_688,
            prefill_computed_tokens=8192,
            prefill_cached_tokens=0,
        )
    )
    assert h.admitted and not h.ended and a.overruns == 0
    assert submit(a, ask(a, 1_000)).held  # nothing may start ahead of it
