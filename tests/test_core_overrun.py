"""The in-flight prefill guard's pure rule (sidecar/core/overrun.py) and the transient at a point of a
prefill (core/cost.py: project_at_progress), with round numbers; the guard inside a real `Admission`
on a manual clock. `make mutation` runs these against the core's mutants. The replay and live-proxy
acceptance runs are in tests/test_guard.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.admission.controller import Admission, Outcome
from sidecar.core import demand
from sidecar.core.cost import project_at_progress
from sidecar.core.decision import Action, Charge, Check, Decision, Reason
from sidecar.core.demand import Demand
from sidecar.core.overrun import (
    Overrun,
    Prefill,
    PrefillProgress,
    done_bytes,
    final_bytes,
    in_flight_bytes,
    overruns,
    rejection,
)
from sidecar.core.rules import Rules
from sidecar.core.snapshot import DeviceMemory, GpuSignals, Snapshot
from sidecar.policy.in_force import rules_of
from sidecar.policy.schema import LoadedPolicy
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


def test_prefills_exactly_at_the_room_blame_the_join_that_overruns_it() -> None:
    """Two prefills of 10,000 KiB fill the 20,000 KiB room exactly: they fit, the batch of 6 they join
    (22,000 KiB) does not, and the abort says so (the log and the answer carry ``why``)."""
    r = rules(cost__batch_join_bytes=10_000 * KIB, cost__batch_join_bytes_per_running_request=2_000 * KIB)
    ps = [Prefill(k, ask(r, 9_000, f"r{k}")) for k in (1, 2)]
    (o,) = overruns(ps, r, gpu(), running=6)
    assert o.key == 2 and o.projected_bytes == 10_000 * KIB and o.room_bytes == 20_000 * KIB
    assert o.why.startswith("joining the running batch of 6 projects 21 MiB"), o.why


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
    p.admitted(1, 5_000)
    p.left(1)  # harmless
    p.started()
    assert p.base is None


def test_the_counter_goes_to_the_oldest_first_each_up_to_its_uncached_tokens() -> None:
    p = PrefillProgress()
    p.observe(100, 40, 0.0, idle=True)  # earlier work
    for key, u in ((1, 2_000), (2, 3_000), (3, 1_000)):
        p.admitted(key, u)
    p.observe(2_600, 40, 1.0, idle=False)
    assert p.done([2_000, 3_000, 1_000]) == [(2_000, 2_000, 0), (500, 500, 0), (0, 0, 0)]
    p.observe(2_600, 40, 1.5, idle=False)  # no growth is no restart
    assert p.done([2_000, 3_000, 1_000]) == [(2_000, 2_000, 0), (500, 500, 0), (0, 0, 0)]
    # The first left with its share: the rest keep theirs.
    p.left(1)
    assert p.base == 2_100
    assert p.done([3_000, 1_000]) == [(500, 500, 0), (0, 0, 0)]
    # The last one leaves with none: the one before keeps its share.
    p.observe(4_600, 40, 2.0, idle=False)
    assert p.done([3_000, 1_000]) == [(2_500, 2_500, 0), (0, 0, 0)]
    p.left(3)
    assert p.base == 2_100
    assert p.done([3_000]) == [(2_500, 2_500, 0)]
    # A partly done one leaves: its share is done work, and the counter goes on to the next.
    p.admitted(4, 1_000)
    p.left(2)
    assert p.base == 4_600
    p.observe(5_000, 40, 3.0, idle=False)
    assert p.done([1_000]) == [(400, 400, 0)]


def test_a_newcomer_takes_what_the_counter_grew_by_beyond_the_prefills_in_flight() -> None:
    """The gate's uncached count is an upper bound: a prompt the engine found cached computes less, and
    the counter's surplus goes to the next prefill, even one admitted after the report."""
    p = PrefillProgress()
    p.observe(0, 0, 0.0, idle=True)
    p.started()
    p.admitted(1, 1_000)
    p.observe(1_500, 0, 1.0, idle=False)  # 500 beyond the first one's 1,000
    p.admitted(2, 300)
    p.admitted(3, 2_000)  # 200 left for it
    p.admitted(4, 2_000)  # and none for this one
    p.left(3)
    assert p.base == 200
    p.left(1)
    p.left(4)
    assert p.base == 1_200
    p.left(2)
    assert p.base == 1_500
    # Admitted after a counter that went backwards (a new engine process): nothing is spare.
    p.observe(100, 0, 2.0, idle=False)
    p.admitted(5, 1_000)
    p.left(5)
    assert p.base == 100


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
    assert d.check == "prefill_overrun"  # the check that refused it, as every refusal names
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
    a = Admission(
        policy(monitor__min_bytes=0, monitor__allocator_block_bytes=0), clock
    )  # KiB-sized: no rounding
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


# -- a prefill's end is O(1); what the monitor expects after it ----------------------------------------


def counted(
    a: Admission, computed: int, *, free_kib: int | None = None, cached: int = 0, **engine: object
) -> None:
    """An engine report with the prefill counters (and a GPU reading showing ``free_kib`` free, if any)."""
    free = None if free_kib is None else free_kib * KIB
    a.update_snapshot(
        snapshot(
            a.clock.now(),
            free_bytes=free,
            prefill_computed_tokens=computed,
            prefill_cached_tokens=cached,
            **engine,
        )
    )


def quiet(**overrides: object) -> LoadedPolicy:
    """The lane with a monitor that counts every byte over and leaves the margin alone."""
    return policy(
        monitor__min_bytes=0,
        monitor__allocator_block_bytes=0,
        monitor__tolerance=0.0,
        monitor__raise_margin=False,
        **overrides,
    )


IDLE_KIB = 20_000


def test_a_prefill_s_end_reads_none_of_the_other_prefills(clock: ManualClock, monkeypatch) -> None:
    """It runs at every gated request's first byte: pricing the others there made a burst of first
    bytes quadratic in the prefills in flight. The work is done once per engine report instead."""
    a = Admission(quiet(), clock)
    counted(a, 0, free_kib=IDLE_KIB)
    hs = admitted(a, [100] * 64)
    counted(a, 3_000)  # the first 30 done, the 31st started
    progress = {p.key: p.done_tokens for p in a.in_flight()}
    calls: list[str] = []

    def counting(owner: object, name: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args: object, **kw: object) -> object:
            calls.append(name)
            return original(*args, **kw)

        monkeypatch.setattr(owner, name, wrapper)

    import sidecar.admission.controller

    counting(Admission, "in_flight")
    counting(PrefillProgress, "done")
    counting(PrefillProgress, "prefills")
    counting(PrefillProgress, "_attribute")
    counting(sidecar.admission.controller, "in_flight_bytes")
    # The youngest first: the order that made each end walk every prefill admitted before it.
    for h in reversed(hs[1:]):
        if h is hs[40]:
            h.end(Outcome.CLIENT_GONE)
        else:
            h.prefill_done()
    assert calls == []
    # Each took its own share into done work: the oldest keeps its progress.
    assert a.progress.base == 3_000 - 100
    assert [(p.key, p.done_tokens) for p in a.in_flight()] == [(hs[0]._key, progress[hs[0]._key])]
    assert calls == ["in_flight", "prefills", "done"]


class _OldProgress(PrefillProgress):
    """The attribution as it was before a prefill's end was O(1): its share from a walk of the list."""

    def __init__(self) -> None:
        super().__init__()
        self.flight: list[tuple[int, int]] = []

    def admitted(self, key: int, uncached: int) -> None:
        self.flight.append((key, uncached))

    def left(self, key: int) -> None:
        keys = [k for k, _ in self.flight]
        if key not in keys:
            return
        i = keys.index(key)
        shares = self.done([u for _, u in self.flight])
        if shares is not None and self.base is not None:
            self.base += shares[i][0]
        del self.flight[i]


@pytest.mark.parametrize("seed", range(40))
def test_the_kept_shares_are_the_attribution_of_a_walk(seed: int) -> None:
    """The O(1) end against the walk it replaces, through admissions, ends in any order, engine
    reports (growth, none, a counter that goes back, an idle ledger) and a counter that disappears."""
    import random

    rnd = random.Random(seed)
    new, old = PrefillProgress(), _OldProgress()
    flight: list[tuple[int, int]] = []
    counter, cached, key, t = 0, 0, 0, 0.0
    for _ in range(120):
        op = rnd.random()
        if op < 0.35:
            key += 1
            u = rnd.choice([0, 1, 50, 400, 1_000, 3_000])
            for p in (new, old):
                if not flight:
                    p.started()
                p.admitted(key, u)
            flight.append((key, u))
        elif op < 0.7 and flight:
            k, _ = flight.pop(rnd.randrange(len(flight)))
            new.left(k)
            old.left(k)
        else:
            t += 0.5
            roll = rnd.random()
            if roll < 0.05:
                report: tuple[int | None, int | None] = (None, None)
            elif roll < 0.1:
                counter, cached = rnd.randrange(counter + 1), cached
                report = (counter, cached)
            else:
                counter += rnd.choice([0, 10, 300, 1_000, 5_000])
                cached += rnd.choice([0, 0, 100])
                report = (counter, cached)
            for p in (new, old):
                p.observe(*report, t, idle=not flight)
        assert new.base == old.base
        us = [u for _, u in flight]
        assert new.done(us) == old.done(us)
        if new.base is not None:
            assert list(new._share.values()) == [s for s, _, _ in new.done(us) or []]


def test_the_monitor_expects_the_peaks_that_ended_plus_what_is_in_flight_at_the_reading(
    clock: ManualClock,
) -> None:
    a = Admission(quiet(), clock)
    counted(a, 0, free_kib=IDLE_KIB)
    h1, h2, h3 = admitted(a, [4_000, 3_000, 2_000])  # peaks 5,000, 4,000 and 3,000 KiB
    counted(a, 1_000, free_kib=IDLE_KIB - 1_000)
    # h1 at 1,000 of 4,000: its next chunk ends at 2,000 tokens (3,000 KiB), and with a full chunk and
    # more left it fills every batch: the others cannot be running.
    assert in_flight_bytes(a.in_flight(clock.t), a.watch.priced) == 3_000 * KIB
    h2.end(Outcome.CLIENT_GONE)  # not the oldest, with the counter present
    h3.prefill_done()
    # Both may show at their final peaks beside h1's progress: 4,000 + 3,000 + 3,000.
    counted(a, 1_000, free_kib=IDLE_KIB - 10_000)
    assert a.watch.underestimates == 0
    counted(a, 1_000, free_kib=IDLE_KIB - 10_001)
    f = a.watch.last
    assert a.watch.underestimates == 1 and f is not None and f.projected_bytes == 10_000 * KIB
    # Compared once: after it a drop that is no new low (compared with the window, not the peak since
    # idle) expects what is in flight only (h1 now at 2,000: 4,000 KiB).
    counted(a, 2_000, free_kib=IDLE_KIB - 1_000)
    counted(a, 2_000, free_kib=IDLE_KIB - 4_001)
    assert a.watch.last is not f and a.watch.last is not None
    assert a.watch.last.projected_bytes == 4_000 * KIB
    h1.prefill_done()
    assert a.guard_state()["prefilling"] == 0


def test_prefills_that_never_overlapped_are_expected_one_at_a_time(clock: ManualClock) -> None:
    a = Admission(quiet(), clock)
    counted(a, 0, free_kib=IDLE_KIB)
    for prompt in (4_000, 6_000, 2_000):  # peaks 5,000, 7,000, 3,000 KiB, one after the other
        (h,) = admitted(a, [prompt])
        h.prefill_done()
        h.end(Outcome.COMPLETED)
    counted(a, 12_000, free_kib=IDLE_KIB - 7_001)
    f = a.watch.last
    assert f is not None and f.projected_bytes == 7_000 * KIB
    # Two that overlapped, then one alone: the pair's sum, the larger.
    a.watch.last = None
    h1, h2 = admitted(a, [4_000, 2_000])
    h1.prefill_done()
    h2.prefill_done()
    (h3,) = admitted(a, [6_000])
    h3.prefill_done()
    counted(a, 24_000, free_kib=IDLE_KIB - 8_001)
    f = a.watch.last
    assert f is not None and f.projected_bytes == 8_000 * KIB


def test_a_deferred_reading_keeps_what_ended_for_the_next_one(clock: ManualClock) -> None:
    a = Admission(quiet(), clock)
    counted(a, 0, free_kib=IDLE_KIB)
    h1, h2 = admitted(a, [9_000, 1_000])  # peaks 10,000 and 2,000 KiB
    counted(a, 1_000, free_kib=IDLE_KIB - 1_000)
    h2.end(Outcome.CLIENT_GONE)
    clock.advance(2.0)
    # A reading with a counter 2 s older: 2 x 1,000 tokens/s x 2 s is more than a chunk, so h1 could be
    # anywhere up to 6,000 tokens by then (8,000 KiB): the comparison waits for the next report.
    old = snapshot(clock.t - 2.0, free_bytes=(IDLE_KIB - 7_001) * KIB, prefill_computed_tokens=1_000)
    a.update_snapshot(old)
    assert a.watch.last is None
    # The next report, with the same reading: h1 at 3,000 (its next chunk 5,000 KiB) and h2's 2,000 KiB.
    fresh = snapshot(clock.t, prefill_computed_tokens=3_000, prefill_cached_tokens=0)
    a.update_snapshot(replace(old, engine=fresh.engine))
    f = a.watch.last
    assert f is not None and f.projected_bytes == 7_000 * KIB
    h1.prefill_done()


@pytest.mark.parametrize("seed", range(25))
def test_what_the_monitor_expects_after_ends_is_never_below_pricing_the_flight_at_each_end(
    clock: ManualClock, seed: int
) -> None:
    """The figure each end used to expect (its peak plus every prefill in flight priced at its
    progress then), against what the next reading is compared with: never lower, while the engine's
    counter is the one read at the ends (``LaneWatch._ended`` says why, and what else bounds it)."""
    import random

    rnd = random.Random(seed)
    idle = 1_000_000
    a = Admission(quiet(vram__idle_free_bytes=idle * KIB), clock)
    computed, flight = 0, []
    counted(a, 0, free_kib=idle - 900_000)  # the low-water mark: every later drop is compared with the window
    for _ in range(12):
        computed += rnd.choice([0, 500, 2_000, 6_000])
        clock.advance(5.0)  # the counter's own rate stays below the policy's: 0.1 s is no "too old"
        at = clock.t
        counted(a, computed, free_kib=idle, prefill_counted_at=at)
        walked = []
        for _ in range(10):
            clock.advance(0.01)
            if rnd.random() < 0.5 or not flight:
                flight += admitted(a, [rnd.choice([100, 900, 2_500, 7_000])])
                continue
            h = flight.pop(rnd.randrange(len(flight)))
            assert h.demand is not None
            if rnd.random() < 0.3:
                h.end(Outcome.CLIENT_GONE)
            else:
                h.prefill_done(measured=False)
            rest = in_flight_bytes(a.in_flight(clock.t), a.watch.priced)
            assert rest is not None
            walked.append(h.demand.projected_bytes + rest)
        a.watch.last = None
        counted(a, computed, free_kib=idle - 800_000, prefill_counted_at=at)
        f = a.watch.last
        assert f is not None
        assert f.projected_bytes >= max(walked, default=0)


def test_final_bytes_is_the_last_chunk_s_peak_under_the_cost_or_as_admitted_when_larger() -> None:
    r = rules()
    d = ask(r, 4_000, "a", cached=1_000)  # 1,000 + 4,000 KiB at its last chunk
    assert d.projected_bytes == final_bytes(d, r.cost) == 5_000 * KIB
    assert final_bytes(d, replace(r.cost, margin=1.5)) == 7_500 * KIB
    assert final_bytes(d, replace(r.cost, margin=0.5)) == 5_000 * KIB


@pytest.mark.parametrize("margin", [0.5, 1.0, 1.5])
def test_final_bytes_is_project_at_progress_with_the_whole_prompt_done(margin: float) -> None:
    """``final_bytes`` projects the whole prompt's context directly (no frame, no clamps: issue #27):
    the same figure as the plain path, ``project_at_progress`` with every prompt token done, on every
    shape (single and many chunks, cached, fully cached, a chunk larger than the prompt)."""
    r = rules()
    cost = replace(r.cost, margin=margin)
    for prompt in (1, 7, 999, 1_000, 1_001, 4_000, 12_345):
        for cached in sorted({0, 1, prompt // 2, prompt - 1, prompt}):
            for chunk in (1, 64, 1_000, 8_192, 100_000):
                d = replace(ask(r, prompt, "a", cached=cached), chunk_size=chunk)
                u = d.uncached_tokens
                plain = project_at_progress(cost, d.prompt_tokens, u, chunk, d.prompt_tokens, 0)
                assert final_bytes(d, cost) == max(d.projected_bytes, plain), (prompt, cached, chunk)


# -- the guard's wiring in Admission: what each snapshot feeds it, what an abort records ------------------


def test_with_the_counter_a_reading_is_compared_with_the_progress_not_the_final_peak(
    clock: ManualClock,
) -> None:
    a = Admission(quiet(), clock)
    counted(a, 0, free_kib=IDLE_KIB)
    admitted(a, [9_000])  # 10,000 KiB at its last chunk
    counted(a, 1_000, free_kib=IDLE_KIB - 3_001)  # at 1,000 tokens its next chunk peaks at 3,000 KiB
    f = a.watch.last
    assert f is not None and f.projected_bytes == 3_000 * KIB and f.request_ids == ("r1",)


def test_the_counter_s_cache_hits_bound_a_started_prefill_s_hit(clock: ManualClock) -> None:
    a = Admission(quiet(), clock)
    counted(a, 0, cached=200)
    admitted(a, [5_000])
    counted(a, 500, cached=1_700)
    (p,) = a.in_flight()
    assert (p.done_tokens, p.started, p.cached_bound) == (500, True, 1_500)


def test_what_the_counter_grew_by_before_a_prefill_was_admitted_is_not_its_progress(
    clock: ManualClock,
) -> None:
    a = Admission(quiet(), clock)
    counted(a, 0)
    (h1,) = admitted(a, [1_000])
    counted(a, 3_000)  # its 1,000 and 2,000 of work that was not the sidecar's
    h1.prefill_done()
    (h2,) = admitted(a, [5_000])
    assert [(p.done_tokens, p.started) for p in a.in_flight()] == [(0, False)]
    # One admitted while another is in flight comes after it: what is counted stays the older one's.
    admitted(a, [2_000])
    counted(a, 4_000)
    assert [p.done_tokens for p in a.in_flight()] == [1_000, 0]
    assert h2.outcome is None


def test_without_a_measured_rate_the_allowance_is_twice_the_policy_s_even_below_a_token_a_second(
    clock: ManualClock,
) -> None:
    a = Admission(policy(hold__prefill_tokens_per_s=0.5), clock)
    counted(a, 0)
    admitted(a, [9_000])
    counted(a, 1_000)
    (p,) = a.in_flight(clock.t + 10.0)
    assert p.done_tokens == 1_000 + 10 + 1_000  # 2 x 0.5 tokens/s x 10 s, and a chunk


def test_a_reading_newer_than_the_counter_takes_the_progress_the_lane_can_have_made_since(
    clock: ManualClock,
) -> None:
    """The counter's own time (``prefill_counted_at``), not the report's, is what it is advanced from."""
    a = Admission(quiet(), clock)
    counted(a, 0, free_kib=IDLE_KIB)
    admitted(a, [9_000])
    read_at = clock.t
    counted(a, 1_000, free_kib=IDLE_KIB - 1_000, prefill_counted_at=read_at)
    clock.advance(0.25)
    # 2 x 1,000 tokens/s x 0.25 s and a chunk beyond the 1,000 counted: its next chunk may end at
    # 3,500 tokens (4,500 KiB); not too old to compare (500 tokens since, under a chunk).
    counted(a, 1_000, free_kib=IDLE_KIB - 4_500, prefill_counted_at=read_at)
    assert a.watch.last is None
    counted(a, 1_000, free_kib=IDLE_KIB - 4_501, prefill_counted_at=read_at)
    f = a.watch.last
    assert f is not None and f.projected_bytes == 4_500 * KIB


def test_with_no_prefill_in_flight_the_counter_s_age_defers_nothing(clock: ManualClock) -> None:
    a = Admission(quiet(), clock)
    counted(a, 0, free_kib=IDLE_KIB)
    (h,) = admitted(a, [4_000])  # 5,000 KiB at its last chunk
    h.prefill_done()
    clock.advance(10.0)
    counted(a, 4_000, free_kib=IDLE_KIB - 5_001, prefill_counted_at=clock.t - 10.0)
    f = a.watch.last
    assert f is not None and f.projected_bytes == 5_000 * KIB


class _Seen:
    def __init__(self) -> None:
        self.decisions: list[tuple[Decision, Demand, float, object]] = []

    def decision(self, d: Decision, dem: Demand, waited_s: float, ledger: object) -> None:
        self.decisions.append((d, dem, waited_s, ledger))

    def outcome(self, outcome: Outcome) -> None:
        pass


def test_aborts_are_answered_before_a_held_request_is_let_in_and_each_is_recorded(clock: ManualClock) -> None:
    seen = _Seen()
    a = Admission(policy(), clock, observer=seen)
    a.update_snapshot(snapshot(clock.t))
    hs = []
    for i in range(3):
        h = a.open()
        assert h.submit(ask(a.rules, 5_000, f"r{i + 1}", at=clock.t - 1.5)) is Action.ADMIT
        hs.append(h)
    order: list[str] = []
    for h in hs:
        h.on_overrun(lambda h: order.append(f"abort {h.demand.request_id}"))
    held = a.open()
    assert (
        held.submit(ask(a.rules, 2_000, "held", at=clock.t), lambda h: order.append("answer held"))
        is Action.HOLD
    )
    before = a.ledger.totals
    # At margin 1.7 each prefill peaks at 10,200 KiB: one fits the 20,000 KiB room; the held one's
    # 5,100 fits beside it only once both younger prefills are gone.
    a.reload(policy(cost__margin=1.7))
    assert order == ["abort r3", "abort r2", "answer held"]
    assert held.admitted and hs[0].outcome is None
    state = a.guard_state()
    assert state["aborted"] == 2 and state["aborted_unfit"] == 0
    # Each abort is recorded with its request, its wait and the ledger it was decided on.
    r3 = next(x for x in seen.decisions if x[1].request_id == "r3" and not x[0].admitted)
    assert r3 == (hs[2].decision, hs[2].demand, 1.5, before)
    r2 = next(x for x in seen.decisions if x[1].request_id == "r2" and not x[0].admitted)
    assert r2[0].reason is Reason.PREFILL_OVERRUN and r2[3].requests == 2


def test_the_counts_of_aborts_add_up_across_events(clock: ManualClock) -> None:
    a = Admission(policy(), clock)
    a.update_snapshot(snapshot(clock.t))
    (big,) = admitted(a, [15_000])
    a.reload(policy(cost__margin=1.5))  # 24,000 KiB: more than the lane ever has
    assert big.outcome is Outcome.PREFILL_OVERRUN and a.guard_state()["aborted_unfit"] == 1
    a.reload(policy())
    hs = admitted(a, [5_000, 5_000, 5_000])
    a.reload(policy(cost__margin=1.2))
    assert [h.outcome for h in hs] == [None, None, Outcome.PREFILL_OVERRUN]
    state = a.guard_state()
    assert state["aborted"] == 2 and state["aborted_unfit"] == 1


def test_a_shell_that_fails_to_abort_is_logged_and_one_without_a_callback_is_not(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    a = Admission(policy(), clock)
    a.update_snapshot(snapshot(clock.t))
    hs = admitted(a, [5_000, 5_000, 5_000, 1_000])

    def broken(h: object) -> None:
        raise RuntimeError("upstream gone")

    hs[2].on_overrun(broken)
    with caplog.at_level("ERROR", logger="sidecar.admission.controller"):
        a.reload(policy(cost__margin=1.7))  # r4 and r3 (then r2) no longer fit; only r3 has a callback
    assert [h.outcome for h in hs] == [
        None,
        Outcome.PREFILL_OVERRUN,
        Outcome.PREFILL_OVERRUN,
        Outcome.PREFILL_OVERRUN,
    ]
    failed = [r for r in caplog.records if r.name == "sidecar.admission.controller"]
    assert [r.getMessage() for r in failed] == ["the shell failed to abort r3 upstream"]
    assert failed[0].exc_info is not None and failed[0].exc_info[0] is RuntimeError


def test_the_state_gives_the_last_abort_s_age_in_milliseconds(clock: ManualClock) -> None:
    a = Admission(policy(), clock)
    a.update_snapshot(snapshot(clock.t))
    admitted(a, [5_000, 5_000, 5_000])
    a.reload(policy(cost__margin=1.2))
    clock.advance(1.23456)
    assert a.guard_state()["last"]["age_s"] == 1.235


def test_an_unfit_prefill_aborted_first_no_longer_joins_the_batch() -> None:
    """The join check counts the batch without the prefills already aborted as unfit: with them, a
    batch of 5 would need 21,000 KiB and a fit prefill would go too; without, 4 need 20,000: it stays."""
    r = rules(
        vram__max_transient_bytes=19_000 * KIB,
        cost__batch_join_bytes=16_000 * KIB,
        cost__batch_join_bytes_per_running_request=1_000 * KIB,
    )
    big, small = ask(r, 25_000, "big"), ask(r, 1_000, "small")
    found = overruns([Prefill(1, small), Prefill(2, big)], r, gpu(), running=5)
    assert [(o.key, o.fits_idle) for o in found] == [(2, False)]


# -- the seam: what ``update_snapshot`` hands the lane watch of a lone prefill's done work --------------


def _observed_done(a: Admission, snap: Snapshot) -> list[int | None]:
    """The ``done`` bytes ``update_snapshot`` passes to ``LaneWatch.observe`` for ``snap``."""
    seen: list[int | None] = []
    real = a.watch.observe

    def spy(*args: object) -> bool:
        seen.append(args[-1])  # type: ignore[arg-type]
        return real(*args)  # type: ignore[arg-type]

    a.watch.observe = spy  # type: ignore[method-assign]
    try:
        a.update_snapshot(snap)
    finally:
        del a.watch.observe
    return seen


def test_a_lone_prefill_s_done_bytes_reach_the_lane_watch_with_a_counter_no_later_than_the_reading(
    clock: ManualClock,
) -> None:
    """The upper bound on a lone prefill's draw needs what it has surely allocated (``done_bytes``, the
    chunk after those its counter showed done). The controller passes it when the engine's counter was
    read no later than the GPU reading (the same instant included), and None when later: a later
    counter may count chunks run after the reading (``update_snapshot``)."""
    a = Admission(policy(), clock)
    a.update_snapshot(snapshot(clock.t, prefill_computed_tokens=100, prefill_cached_tokens=0))
    admitted(a, [5_000])
    same = snapshot(clock.t, prefill_computed_tokens=2_100, prefill_cached_tokens=0)
    assert same.engine is not None and same.gpu is not None
    assert same.engine.observed_at == same.gpu.observed_at
    (done,) = _observed_done(a, same)
    expected = done_bytes(a.in_flight(), a.watch.priced)
    assert done == expected and expected is not None and expected > 0
    # A counter read after the reading: nothing sure, None (not 0, which would also say "nothing").
    clock.advance(0.01)
    later = snapshot(clock.t, prefill_computed_tokens=3_100, prefill_cached_tokens=0)
    assert later.gpu is not None
    later = replace(later, gpu=GpuSignals(clock.t - 0.005, "test", later.gpu.devices))
    assert _observed_done(a, later) == [None]
    # A reading newer than the counter: passed again, at the new progress.
    clock.advance(0.01)
    newer = snapshot(clock.t, prefill_computed_tokens=3_100, prefill_cached_tokens=0)
    assert newer.gpu is not None
    newer = replace(newer, gpu=GpuSignals(clock.t + 0.005, "test", newer.gpu.devices))
    (done,) = _observed_done(a, newer)
    assert done == done_bytes(a.in_flight(), a.watch.priced) and done is not None and done > expected
