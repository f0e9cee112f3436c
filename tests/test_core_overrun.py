"""The in-flight prefill guard's pure rule (sidecar/core/overrun.py) and the transient at a point of a
prefill (core/cost.py: project_at_progress), with round numbers; the guard inside a real `Admission`
on a manual clock. `make mutation` runs these against the core's mutants. The replay and live-proxy
acceptance runs are in tests/test_guard.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.admission import Admission, Outcome
from sidecar.core import demand
from sidecar.core.cost import project_at_progress
from sidecar.core.decision import Action, Charge, Check, Decision, Reason
from sidecar.core.demand import Demand
from sidecar.core.overrun import Overrun, Prefill, PrefillProgress, in_flight_bytes, overruns, rejection
from sidecar.core.rules import Rules
from sidecar.core.snapshot import DeviceMemory, GpuSignals, Snapshot
from sidecar.intake import rules_of
from sidecar.policy import LoadedPolicy
from tests.conftest import ManualClock, small_policy, snapshot

KIB = 1024

# 1 KiB per chunk token, 1 KiB per context token, chunks of 1,000: a cold prompt of P tokens peaks at
# (1,000 + P) KiB. An idle budget of 20,000 KiB, another process holding 1,000 KiB when it was measured.
LANE = dict(
    cost__context_bytes_per_token=KIB,
    vram__headroom="idle_budget",
    vram__idle_free_bytes=20_000 * KIB,
    vram__other_processes_bytes=1_000 * KIB,
)


def policy(**overrides: object) -> LoadedPolicy:
    return small_policy(**{**LANE, **overrides})


def rules(**overrides: object) -> Rules:
    return rules_of(policy(**overrides).policy)


def ask(r: Rules, prompt: int, rid: str, cached: int = 0, at: float = 0.0) -> Demand:
    return demand.build(r, prompt, arrived_at=at, cached_tokens=cached, request_id=rid)


def gpu(other_kib: int = 1_000) -> Snapshot:
    dev = DeviceMemory("GPU-0", 5_000 * KIB, 80_000 * KIB, other_kib * KIB)
    return Snapshot(gpu=GpuSignals(0.0, "test", (dev,)))


def three(r: Rules, prompt: int = 5_000) -> list[Prefill]:
    """Three cold prefills of ``prompt`` tokens priced by ``r``, oldest first."""
    return [Prefill(k, ask(r, prompt, f"r{k}")) for k in (1, 2, 3)]


# -- the transient at a point of the prefill -------------------------------------------------------------


def test_the_chunk_after_the_progress_ends_at_the_context_reached_and_never_beyond_the_prompt() -> None:
    c = rules().cost
    # First chunk of a cold 5,000-token prompt: 1,000 tokens ending at 1,000 of context.
    assert project_at_progress(c, 5_000, 5_000, 1_000, 0, 0) == 2_000 * KIB
    assert project_at_progress(c, 5_000, 5_000, 1_000, 2_000, 0) == 4_000 * KIB
    # The last chunk: the whole prompt (the admission's figure); past it, still the last.
    assert project_at_progress(c, 5_000, 5_000, 1_000, 4_000, 0) == 6_000 * KIB
    assert project_at_progress(c, 5_000, 5_000, 1_000, 4_500, 0) == 6_000 * KIB
    assert project_at_progress(c, 5_000, 5_000, 1_000, 9_000, 0) == 6_000 * KIB
    # A cached prefix is context from the first chunk on.
    assert project_at_progress(c, 5_000, 3_000, 1_000, 0, 2_000) == 4_000 * KIB
    # A chunk is never larger than what is left uncached; a fully cached prompt still runs one token.
    assert project_at_progress(c, 5_000, 400, 1_000, 0, 4_600) == (400 + 5_000) * KIB
    assert project_at_progress(c, 5_000, 0, 1_000, 0, 5_000) == (1 + 5_000) * KIB
    # Negative inputs count as none.
    assert project_at_progress(c, 5_000, 5_000, 1_000, -5, -5) == 2_000 * KIB


def test_the_projection_at_progress_carries_the_margin() -> None:
    c = rules(cost__margin=1.5).cost
    assert project_at_progress(c, 5_000, 5_000, 1_000, 2_000, 0) == 6_000 * KIB


# -- the rule ----------------------------------------------------------------------------------------


def test_nothing_to_abort_while_the_rules_and_the_room_are_those_of_the_admission() -> None:
    r = rules()
    assert overruns([], r, gpu()) == ()
    assert overruns(three(r), r, gpu()) == ()  # 18,000 KiB of 20,000


def test_a_raised_margin_aborts_the_youngest_first_and_stops_once_the_rest_fits() -> None:
    r = rules()
    raised = replace(r, cost=replace(r.cost, margin=1.2))  # 7,200 KiB each: 21,600 of 20,000
    (o,) = overruns(three(r), raised, gpu())
    assert (o.key, o.request_id, o.fits_idle) == (3, "r3", True)
    assert o.projected_bytes == 7_200 * KIB and o.room_bytes == 20_000 * KIB
    assert "21,600" not in o.why and "21 MiB" in o.why and "20 MiB" in o.why
    # Twice as much over: two go, youngest first.
    much = replace(r, cost=replace(r.cost, margin=1.7))  # 10,200 each
    assert [o.key for o in overruns(three(r), much, gpu())] == [3, 2]


def test_a_sum_exactly_at_the_room_fits() -> None:
    r = rules()
    assert overruns(three(r), r, gpu(other_kib=3_000)) == ()  # room 18,000 KiB = the sum
    (o,) = overruns(three(r), r, gpu(other_kib=3_001))
    assert o.key == 3 and o.room_bytes == 17_999 * KIB


def test_a_neighbour_that_grew_shrinks_the_room_by_its_growth_less_the_reserve() -> None:
    r = rules(vram__reserve_bytes=500 * KIB)
    # 20,000 - 2,500 grown - 500 reserve = 17,000 for 18,000: the youngest goes.
    (o,) = overruns(three(r), r, gpu(other_kib=3_500))
    assert o.key == 3 and o.room_bytes == 17_000 * KIB and o.fits_idle


def test_one_the_lane_can_never_run_under_the_new_rules_goes_first_without_retry() -> None:
    r = rules()
    big, small = ask(r, 15_000, "big"), ask(r, 2_000, "small")
    raised = replace(r, cost=replace(r.cost, margin=1.5))  # big: 24,000 KiB > the 20,000 cap
    found = overruns([Prefill(1, big), Prefill(2, small)], raised, gpu())
    assert [(o.key, o.request_id, o.fits_idle) for o in found] == [(1, "big", False)]
    assert found[0].room_bytes == 20_000 * KIB and found[0].projected_bytes == 24_000 * KIB
    assert "exceeds" in found[0].why
    # The cap is the policy's max_transient_bytes when it sets one; exactly at it fits.
    capped = replace(raised, vram=replace(raised.vram, max_transient_bytes=24_000 * KIB))
    (o,) = overruns([Prefill(1, big)], capped, gpu())
    assert o.fits_idle  # not beyond the cap; beyond the room


def test_the_batch_the_prefills_join_must_fit_the_room_too() -> None:
    # Joining a batch of n costs 10,000 + 2,000 x n KiB; small prefills (2,000 KiB each) fit alone.
    r = rules(cost__batch_join_bytes=10_000 * KIB, cost__batch_join_bytes_per_running_request=2_000 * KIB)
    ps = [Prefill(k, ask(r, 1_000, f"r{k}")) for k in (1, 2, 3)]
    assert overruns(ps, r, gpu(), running=5) == ()  # 20,000: exactly the room
    (o,) = overruns(ps, r, gpu(), running=6)  # 22,000: one fewer joining is 20,000
    assert o.key == 3 and o.fits_idle and "batch of 6" in o.why
    assert [o.key for o in overruns(ps, r, gpu(), running=7)] == [3, 2]
    # Requests already decoding have joined: aborting every prefill is all the guard can do.
    assert [o.key for o in overruns(ps, r, gpu(), running=12)] == [3, 2, 1]


def test_an_unfit_one_leaves_the_join_too() -> None:
    r = rules(cost__batch_join_bytes=16_000 * KIB, cost__batch_join_bytes_per_running_request=1_000 * KIB)
    big, small = ask(r, 25_000, "big"), ask(r, 1_000, "small")
    # big is unfit; without it the batch is 3 (16,000 + 3,000 = 19,000): small stays.
    found = overruns([Prefill(1, small), Prefill(2, big)], r, gpu(), running=4)
    assert [o.key for o in found] == [2]


def test_with_live_nvml_free_only_what_can_never_fit_is_aborted() -> None:
    r = rules(vram__headroom="nvml_free", vram__idle_free_bytes=None, vram__max_transient_bytes=7_000 * KIB)
    raised = replace(r, cost=replace(r.cost, margin=1.2))  # 7,200 KiB each: over the cap
    assert [o.fits_idle for o in overruns(three(r), raised, gpu())] == [False, False, False]
    assert overruns(three(r), r, gpu(other_kib=50_000)) == ()  # the room is not judged


# -- what the in-flight prefills allocate at the progress reached ----------------------------------------


def test_unknown_progress_is_none_so_the_monitor_compares_with_the_final_peaks() -> None:
    r = rules()
    ps = three(r)
    assert in_flight_bytes(ps, r.cost) is None
    assert in_flight_bytes([replace(ps[0], done_tokens=0), ps[1]], r.cost) is None
    assert in_flight_bytes([], r.cost) == 0


def test_a_started_prefill_with_a_full_chunk_left_runs_alone() -> None:
    r = rules()
    head, nxt = ask(r, 5_000, "head"), ask(r, 3_000, "next")
    ps = [Prefill(1, head, 2_000, True, 0), Prefill(2, nxt, 0, False, 0)]
    assert in_flight_bytes(ps, r.cost) == 4_000 * KIB  # the head's chunk ending at 3,000
    # Exactly one chunk left still fills the batch.
    ps = [Prefill(1, head, 4_000, True, 0), Prefill(2, nxt, 0, False, 0)]
    assert in_flight_bytes(ps, r.cost) == 6_000 * KIB


def test_one_not_started_may_be_running_with_an_uncounted_hit_so_it_counts_its_final_peak() -> None:
    r = rules()
    head, nxt = ask(r, 5_000, "head"), ask(r, 3_000, "next")
    # The head's last chunk is short: the next one can share its batch, at any cache hit.
    ps = [Prefill(1, head, 4_500, True, 0), Prefill(2, nxt, 0, False, 0)]
    assert in_flight_bytes(ps, r.cost) == (6_000 + 4_000) * KIB
    # A started one after one not started (the pure rule takes any order): both count.
    ps = [Prefill(1, nxt, 0, False, 0), Prefill(2, head, 2_000, True, 0)]
    assert in_flight_bytes(ps, r.cost) == (4_000 + 4_000) * KIB
    # Nothing started: every one counts its final peak.
    ps = [Prefill(1, head, 0, False, 0), Prefill(2, nxt, 0, False, 0)]
    assert in_flight_bytes(ps, r.cost) == (6_000 + 4_000) * KIB


def test_a_started_prefill_counts_the_cache_hits_it_may_have_had() -> None:
    r = rules()
    head, nxt = ask(r, 5_000, "head"), ask(r, 3_000, "next")
    # Up to 2,500 tokens of hits: its chunk may end at 2,500 + 1,000 + 1,000 = 4,500 tokens; 1,500
    # surely left fill the batch.
    ps = [Prefill(1, head, 1_000, True, 2_500), Prefill(2, nxt, 0, False, 2_500)]
    assert in_flight_bytes(ps, r.cost) == 5_500 * KIB
    # Up to 3,500: the last chunk, and only 500 surely left: the next one may share the batch.
    ps = [Prefill(1, head, 1_000, True, 3_500), Prefill(2, nxt, 0, False, 3_500)]
    assert in_flight_bytes(ps, r.cost) == (6_000 + 4_000) * KIB
    # The gate's own cached count bounds it when larger.
    cached = ask(r, 5_000, "cached", cached=2_500)
    assert in_flight_bytes([Prefill(1, cached, 1_000, True, 0)], r.cost) == 5_500 * KIB


# -- the counter attributed to the prefills ------------------------------------------------------------


def test_without_a_counter_there_is_no_progress() -> None:
    p = PrefillProgress()
    assert p.done([5_000]) is None
    p.observe(None, None, 1.0, idle=True)
    assert p.done([5_000]) is None
    r = rules()
    (one,) = p.prefills([(1, ask(r, 5_000, "a"))])
    assert one.done_tokens is None and not one.started
    p.left([5_000], 0)  # harmless
    p.started()
    assert p.base is None


def test_the_counter_goes_to_the_oldest_first_each_up_to_its_uncached_tokens() -> None:
    p = PrefillProgress()
    p.observe(100, 40, 0.0, idle=True)  # earlier work
    p.observe(2_600, 40, 1.0, idle=False)
    assert p.done([2_000, 3_000, 1_000]) == [(2_000, 2_000, 0), (500, 500, 0), (0, 0, 0)]
    p.observe(2_600, 40, 1.5, idle=False)  # no growth is no restart
    assert p.done([2_000, 3_000, 1_000]) == [(2_000, 2_000, 0), (500, 500, 0), (0, 0, 0)]
    # The first left with its share: the rest keep theirs.
    p.left([2_000, 3_000, 1_000], 0)
    assert p.base == 2_100
    assert p.done([3_000, 1_000]) == [(500, 500, 0), (0, 0, 0)]
    # One in the middle leaves: those after it keep their shares.
    p.observe(4_600, 40, 2.0, idle=False)
    assert p.done([3_000, 1_000]) == [(2_500, 2_500, 0), (0, 0, 0)]
    p.left([3_000, 1_000], 1)
    assert p.done([3_000]) == [(2_500, 2_500, 0)]


def test_hits_since_the_prefills_began_bound_any_started_ones_hit() -> None:
    p = PrefillProgress()
    p.observe(0, 1_000, 0.0, idle=True)
    p.observe(500, 4_000, 1.0, idle=False)
    assert p.done([2_000]) == [(500, 500, 3_000)]
    r = rules()
    (a, b) = p.prefills([(1, ask(r, 5_000, "a")), (2, ask(r, 5_000, "b"))])
    assert (a.done_tokens, a.started, a.cached_bound) == (500, True, 3_000)
    assert (b.done_tokens, b.started) == (0, False)
    # Without a cache counter any hit is possible: the bound is the whole prompt.
    p.observe(600, None, 2.0, idle=False)
    (a,) = p.prefills([(1, ask(r, 5_000, "a"))])
    assert a.cached_bound == 5_000


def test_an_idle_ledger_follows_the_counter_and_a_restart_starts_it_again() -> None:
    p = PrefillProgress()
    p.observe(1_000, 0, 0.0, idle=True)
    p.observe(3_000, 0, 1.0, idle=True)  # nothing of ours in flight: someone else's work
    assert p.done([5_000]) == [(0, 0, 0)]
    p.observe(4_000, 0, 2.0, idle=False)
    assert p.done([5_000]) == [(1_000, 1_000, 0)]
    p.observe(200, 0, 3.0, idle=False)  # a new engine process
    assert p.done([5_000]) == [(0, 0, 0)]
    p.observe(700, 0, 4.0, idle=False)
    assert p.done([5_000]) == [(500, 500, 0)]
    p.observe(800, 300, 5.0, idle=False)
    p.observe(900, 100, 6.0, idle=False)  # the cache counter went back: a restart too
    assert p.done([5_000]) == [(0, 0, 0)]
    p.observe(950, 1, 6.5, idle=False)
    p.observe(1_000, 0, 6.6, idle=False)  # from 1 to 0 hits: a restart
    assert p.done([5_000]) == [(0, 0, 0)]
    p.observe(1_900, 100, 7.0, idle=False)
    p.observe(1_500, 100, 8.0, idle=False)  # below the last reading, above the base: a restart
    assert p.done([5_000]) == [(0, 0, 0)]


def test_started_sets_the_base_at_the_counter_the_first_prefill_was_admitted_on() -> None:
    p = PrefillProgress()
    p.observe(1_000, 0, 0.0, idle=False)  # the first report: nothing of it is ours
    assert p.done([5_000]) == [(0, 0, 0)]
    p.observe(3_000, 0, 1.0, idle=False)
    p.started()
    assert p.done([5_000]) == [(0, 0, 0)]
    p.observe(3_500, 80, 2.0, idle=False)
    p.started()  # hits before it are older work too
    assert p.done([5_000]) == [(0, 0, 0)]


def test_a_counter_older_than_the_reading_is_advanced_by_the_rate_and_a_chunk() -> None:
    p = PrefillProgress()
    p.observe(0, 0, 10.0, idle=True)
    assert p.rate == 0 and p.done([9_000], now=11.0) == [(0, 0, 0)]  # no rate yet, no chunk: nothing
    p.observe(1_000, 0, 10.5, idle=False)  # 2,000 tokens/s over the last interval
    assert p.rate == 2_000
    # Half a second later: twice the counter's rate for 0.5 s, plus a chunk; never started by it.
    assert p.done([9_000], now=11.0, chunk=1_000) == [(1_000, 4_000, 0)]
    assert p.done([9_000], now=11.0, allowance_rate=10_000, chunk=1_000) == [(1_000, 7_000, 0)]
    assert p.done([9_000], now=10.5, allowance_rate=10_000, chunk=1_000) == [(1_000, 1_000, 0)]
    # What is beyond the first one's uncached tokens goes to the next, without starting it.
    assert p.done([2_000, 9_000], now=11.0, chunk=1_000) == [(1_000, 2_000, 0), (0, 2_000, 0)]
    assert p.done([2_000, 9_000], now=11.0, allowance_rate=10_000, chunk=1_000) == [
        (1_000, 2_000, 0),
        (0, 5_000, 0),
    ]
    r = rules()
    a, b = p.prefills([(1, ask(r, 2_000, "a")), (2, ask(r, 9_000, "b"))], now=11.0)
    assert (a.done_tokens, a.started) == (2_000, True) and (b.done_tokens, b.started) == (2_000, False)
    assert p.prefills([], now=11.0) == []
    # A reading taken before the counter was read adds nothing.
    assert p.done([9_000], now=10.0, chunk=1_000) == [(1_000, 1_000, 0)]
    # A fully cached prompt computes nothing: the counter goes on to the next one.
    assert p.done([0, 9_000]) == [(0, 0, 0), (1_000, 1_000, 0)]
    assert p.done([0, 9_000], now=11.0, chunk=1_000) == [(0, 0, 0), (1_000, 4_000, 0)]
    # The rate is the last interval's (never negative; an interval of no time changes nothing).
    p.observe(1_000, 0, 12.0, idle=False)
    assert p.rate == 0
    # With no rate, only what the caller allows (and the chunk) advances an old counter.
    (one,) = p.prefills([(1, ask(r, 9_000, "a"))], now=13.0)
    assert one.done_tokens == 1_000 + 1_000
    (one,) = p.prefills([(1, ask(r, 9_000, "a"))], now=13.0, allowance_rate=100)
    assert one.done_tokens == 1_000 + 100 + 1_000
    p.observe(1_500, 0, 12.0, idle=False)
    assert p.rate == 0
    # One token counted starts a prefill.
    p.observe(0, 0, 20.0, idle=True)
    p.observe(1, 0, 21.0, idle=False)
    (one,) = p.prefills([(1, ask(r, 9_000, "a"))])
    assert one.started and one.done_tokens == 1


# -- the guard inside Admission ----------------------------------------------------------------------------


def admitted(a: Admission, prompts: list[int]) -> list:
    hs = []
    for i, n in enumerate(prompts):
        h = a.open()
        assert h.submit(ask(a.rules, n, f"r{i + 1}", at=a.clock.now())) is Action.ADMIT
        hs.append(h)
    return hs


def test_a_stricter_policy_aborts_the_youngest_admitted_prefill(clock: ManualClock) -> None:
    a = Admission(policy(), clock)
    a.update_snapshot(snapshot(clock.t))
    hs = admitted(a, [5_000, 5_000, 5_000])
    stopped = []
    for h in hs:
        h.on_overrun(stopped.append)
    assert a.guard_state()["aborted"] == 0 and a.guard_state()["prefilling"] == 3
    a.reload(policy(cost__margin=1.2))
    assert stopped == [hs[2]]
    h = hs[2]
    assert h.outcome is Outcome.PREFILL_OVERRUN and not h.admitted
    assert h.decision is not None and h.decision.reason is Reason.PREFILL_OVERRUN
    assert h.decision.retry_after_s is not None and h.decision.retry_after_s >= 1
    assert a.ledger.totals.requests == 2 and a.ledger.totals.projected_bytes == 12_000 * KIB
    state = a.guard_state()
    assert state["aborted"] == 1 and state["aborted_unfit"] == 0 and state["prefilling"] == 2
    assert state["last"]["request_id"] == "r3" and state["last"]["retry"] is True
    # The others finish normally; the ledger returns to zero.
    for h in hs[:2]:
        h.prefill_done()
        h.end(Outcome.COMPLETED)
    assert a.ledger.totals.requests == 0 and len(a.ledger) == 0


def test_a_prefill_that_never_fits_the_new_rules_gets_no_retry_after(clock: ManualClock) -> None:
    a = Admission(policy(), clock)
    a.update_snapshot(snapshot(clock.t))
    (h,) = admitted(a, [15_000])
    a.reload(policy(cost__margin=1.5))
    assert h.outcome is Outcome.PREFILL_OVERRUN and h.decision is not None
    assert h.decision.retry_after_s is None
    assert a.guard_state()["aborted_unfit"] == 1


def test_only_prefills_are_checked_shadow_never_aborts_and_the_guard_can_be_off(clock: ManualClock) -> None:
    a = Admission(policy(), clock)
    a.update_snapshot(snapshot(clock.t))
    hs = admitted(a, [5_000, 5_000, 5_000])
    hs[2].prefill_done()  # streaming already: its prefill is over
    a.reload(policy(cost__margin=1.2))
    assert all(h.outcome is None for h in hs)  # 2 x 7,200 in flight fit
    off = Admission(policy(guard={"enabled": False}), clock)
    off.update_snapshot(snapshot(clock.t))
    hs = admitted(off, [5_000, 5_000, 5_000])
    off.reload(policy(guard={"enabled": False}, cost__margin=1.2))
    assert all(h.outcome is None for h in hs) and off.guard_state()["enabled"] is False
    shadow = Admission(policy(), clock, shadow=True)
    shadow.update_snapshot(snapshot(clock.t))
    hs = admitted(shadow, [5_000, 5_000, 5_000])
    shadow.reload(policy(cost__margin=1.2))
    assert all(h.outcome is None for h in hs) and shadow.guard_state()["enabled"] is False


def test_a_neighbour_growing_on_a_gpu_reading_aborts_what_no_longer_fits(clock: ManualClock) -> None:
    a = Admission(policy(), clock)
    base = snapshot(clock.t)
    a.update_snapshot(with_other(base, 1_000))
    hs = admitted(a, [5_000, 5_000, 5_000])
    a.update_snapshot(with_other(base, 2_500))  # room 18,500 for 18,000: fine
    assert all(h.outcome is None for h in hs)
    a.update_snapshot(with_other(base, 3_500))  # room 17,500
    assert [h.outcome for h in hs] == [None, None, Outcome.PREFILL_OVERRUN]
    # Held requests wait for the room; the freed charge lets nothing in that does not fit.
    late = a.open()
    assert late.submit(ask(a.rules, 5_000, "late", at=clock.t)) is Action.HOLD, late.decision


def with_other(s: Snapshot, other_kib: int) -> Snapshot:
    assert s.gpu is not None
    dev = replace(s.gpu.devices[0], other_process_bytes=other_kib * KIB)
    return replace(s, gpu=replace(s.gpu, devices=(dev,)))


@pytest.mark.parametrize("completed", [True, False])
def test_progress_follows_the_counter_and_leaves_with_each_prefill(
    clock: ManualClock, completed: bool
) -> None:
    a = Admission(policy(), clock)
    a.update_snapshot(snapshot(clock.t, prefill_computed_tokens=100, prefill_cached_tokens=0))
    h1, h2 = admitted(a, [5_000, 3_000])
    a.update_snapshot(snapshot(clock.t, prefill_computed_tokens=2_100, prefill_cached_tokens=0))
    assert [(p.done_tokens, p.started) for p in a.in_flight()] == [(2_000, True), (0, False)]
    assert a.guard_state()["progress"] == "counter"
    if completed:
        a.update_snapshot(snapshot(clock.t, prefill_computed_tokens=5_100, prefill_cached_tokens=0))
        h1.prefill_done()
    else:
        h1.end(Outcome.CLIENT_GONE)
    assert [(p.key, p.done_tokens) for p in a.in_flight()] == [(h2._key, 0)]
    a.update_snapshot(snapshot(clock.t, prefill_computed_tokens=5_600 if completed else 2_600))
    assert [p.done_tokens for p in a.in_flight()] == [500]


def test_a_younger_prefill_that_leaves_first_takes_only_its_own_share(clock: ManualClock) -> None:
    """First come first served: what the counter grew by is the older prefill's first. A younger one
    that leaves (its client gone) takes into done work only what was left over for it."""
    a = Admission(policy(), clock)
    a.update_snapshot(snapshot(clock.t, prefill_computed_tokens=100, prefill_cached_tokens=0))
    h1, h2 = admitted(a, [5_000, 3_000])
    a.update_snapshot(snapshot(clock.t, prefill_computed_tokens=6_100, prefill_cached_tokens=0))
    assert [p.done_tokens for p in a.in_flight()] == [5_000, 1_000]
    h2.end(Outcome.CLIENT_GONE)
    # h2 took its 1,000; the 5,000 before it stay h1's (not 3,000, as if h2 had been first).
    assert [(p.key, p.done_tokens) for p in a.in_flight()] == [(h1._key, 5_000)]


def test_a_counter_too_old_for_a_reading_defers_the_comparison() -> None:
    p = PrefillProgress()
    assert not p.too_old(100.0, 10_000, 1_000)  # no counter: nothing to defer
    p.observe(0, 0, 10.0, idle=True)
    p.observe(1_000, 0, 10.5, idle=False)  # the counter's own rate: 2,000 tokens/s, twice: 4,000
    assert not p.too_old(10.75, 0, 1_000)  # 0.25 s x 4,000 = exactly a chunk
    assert p.too_old(10.76, 0, 1_000)
    assert p.too_old(10.6, 20_000, 1_000)  # the caller's rate when larger: 0.1 s x 20,000
    assert not p.too_old(10.6, 20_000, 3_000)
    assert not p.too_old(10.0, 20_000, 1_000)  # a reading older than the counter


def test_an_aborted_request_ends_with_its_admission_s_checks_and_the_guard_s() -> None:
    admitted = Decision(
        Action.ADMIT, None, None, 9, (Check("vram_headroom", True, 1, 9),), Charge(prefill_tokens=5)
    )
    fits = Overrun(3, "r3", 7_000, 6_000, True, "over")
    d = rejection(fits, admitted, 12)
    assert (d.action, d.reason, d.retry_after_s, d.headroom_bytes) == (
        Action.REJECT,
        Reason.PREFILL_OVERRUN,
        12,
        6_000,
    )
    assert d.charge == admitted.charge
    assert d.checks == (admitted.checks[0], Check("prefill_overrun", False, 7_000, 6_000, "over", ""))
    never = rejection(replace(fits, fits_idle=False), admitted, 12)
    assert never.retry_after_s is None and never.checks[-1].limit == "transient"
    assert fits.fields() == {
        "request_id": "r3",
        "projected_bytes": 7_000,
        "room_bytes": 6_000,
        "retry": True,
        "why": "over",
    }


def test_the_state_says_what_the_guard_did(clock: ManualClock) -> None:
    a = Admission(policy(), clock)
    a.update_snapshot(snapshot(clock.t))
    assert a.guard_state() == {
        "enabled": True,
        "progress": "unknown (final peaks)",
        "prefilling": 0,
        "aborted": 0,
        "aborted_unfit": 0,
        "last": None,
    }
    hs = admitted(a, [5_000, 5_000, 5_000])
    a.reload(policy(cost__margin=1.2))
    clock.advance(2.5)
    state = a.guard_state()
    assert state["last"] == {
        "request_id": "r3",
        "projected_bytes": 7_200 * KIB,
        "room_bytes": 20_000 * KIB,
        "retry": True,
        "why": state["last"]["why"],
        "age_s": 2.5,
    }
    assert state["prefilling"] == 2 and state["aborted"] == 1 and hs[2].outcome is Outcome.PREFILL_OVERRUN


def test_the_join_of_every_admitted_request_is_checked(clock: ManualClock) -> None:
    p = policy(cost__batch_join_bytes=10_000 * KIB, cost__batch_join_bytes_per_running_request=2_000 * KIB)
    a = Admission(p, clock)
    a.update_snapshot(snapshot(clock.t))
    hs = admitted(a, [1_000, 1_000, 1_000, 1_000, 1_000])  # a batch of 5: 20,000 KiB to join
    hs[0].prefill_done()
    hs[1].prefill_done()  # decoding: they joined already
    a.update_snapshot(with_other(snapshot(clock.t), 1_001))  # 1 KiB less room: one fewer may join
    assert [h.outcome for h in hs] == [None, None, None, None, Outcome.PREFILL_OVERRUN]


def test_the_allowance_is_twice_the_faster_of_the_measured_and_the_policy_rate(clock: ManualClock) -> None:
    a = Admission(policy(), clock)  # hold.prefill_tokens_per_s: 1,000
    a.update_snapshot(snapshot(clock.t, prefill_computed_tokens=0, prefill_cached_tokens=0))
    admitted(a, [9_000])
    a.update_snapshot(snapshot(clock.t, prefill_computed_tokens=1_000, prefill_cached_tokens=0))
    # Counted 1,000; 0.5 s later: 2 x 1,000 tokens/s x 0.5 s, plus a chunk of 1,000.
    (p,) = a.in_flight(clock.t + 0.5)
    assert p.done_tokens == 1_000 + 1_000 + 1_000 and p.started


def test_a_prefill_that_ended_between_two_readings_is_no_finding(clock: ManualClock) -> None:
    """Its last chunk (the peak) shows in the next reading although it is no longer in flight."""
    a = Admission(policy(monitor__min_bytes=0), clock)  # a KiB-sized lane: no rounding slack
    idle = 20_000 * KIB
    a.update_snapshot(snapshot(clock.t, free_bytes=idle, prefill_computed_tokens=0, prefill_cached_tokens=0))
    (h,) = admitted(a, [9_000])
    a.update_snapshot(snapshot(clock.t, free_bytes=idle - 2_000 * KIB, prefill_computed_tokens=1_000))
    h.prefill_done()
    # The allocator still holds the last chunk's 10,000 KiB: as priced at admission.
    a.update_snapshot(snapshot(clock.t, free_bytes=idle - 10_000 * KIB, prefill_computed_tokens=9_000))
    assert a.watch.underestimates == 0
    # More than that is one.
    a.update_snapshot(snapshot(clock.t, free_bytes=idle - 10_300 * KIB, prefill_computed_tokens=9_000))
    assert a.watch.underestimates == 1
