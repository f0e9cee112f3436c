"""Every rule of the core, one at a time, with the exact numbers it reports.

Written against the mutants that survived the rest of the suite (``make mutation``): each test pins a
boundary (``<`` against ``<=``), a source (the engine's report against the policy's fallback, the
ledger against the gauge), or a number shown to operators (need, have, note, Retry-After).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import pytest

from sidecar.admission.controller import Admission, Handle, Outcome
from sidecar.core import demand
from sidecar.core.cost import shape
from sidecar.core.decide import Situation, charge_of, decide, headroom_bytes, retry_after_s
from sidecar.core.decision import Action, Charge, Check, Decision, Reason
from sidecar.core.demand import Demand
from sidecar.core.ledger import Ledger, LedgerTotals
from sidecar.core.rules import Rules
from sidecar.core.snapshot import GpuSignals, Snapshot, SourceHealth
from sidecar.intake.body import parse_generation
from sidecar.intake.demand import demand_of
from sidecar.intake.tokens import TokenCount
from sidecar.policy.in_force import rules_of
from tests.conftest import MIB, ManualClock, small_policy, snapshot, submit, with_engine

NOW = 5000.0
KIB = 1024
EMPTY = LedgerTotals()


def rules(**overrides: object) -> Rules:
    return rules_of(small_policy(**overrides).policy)


def ask(r: Rules, prompt_tokens: int, *, now: float = NOW, **kw: object) -> Demand:
    return demand.build(r, prompt_tokens, arrived_at=now, **kw)  # type: ignore[arg-type]


def judge(
    r: Rules, d: Demand, snap: Snapshot | None = None, ledger: LedgerTotals = EMPTY, **queue: object
) -> Decision:
    return decide(d, Situation(r, snap or snapshot(NOW), ledger, NOW, **queue))  # type: ignore[arg-type]


def check(d: Decision, name: str) -> Check:
    return next(c for c in d.checks if c.name == name)


LIMIT = {
    "prompt + max_new_tokens > context": "context",
    "larger than KV pool": "kv_pool",
    "more Mamba slots than the pool has": "mamba_slots",
    "transient larger than the lane frees": "transient",
}


def unfit(note: str, need: float, have: float) -> tuple[Check, ...]:
    return (Check("unfit_request", False, need, have, note, LIMIT[note]),)


# -- unfit_request ------------------------------------------------------------------------------------


def test_context_bound_is_prompt_plus_output_and_exactly_the_context_fits() -> None:
    r = rules()  # context 100,000
    d = judge(r, ask(r, 90_000, max_new_tokens=20_000))
    assert (d.action, d.reason) == (Action.REJECT, Reason.UNFIT_REQUEST)
    assert d.checks == unfit("prompt + max_new_tokens > context", 110_000, 100_000)
    assert d.retry_after_s is None  # no wait will help
    assert judge(r, ask(r, 90_000, max_new_tokens=10_000)).admitted  # 100,000: exactly the context
    # A prompt that fills the context leaves no room for one token.
    assert judge(r, ask(r, 100_000)).checks == unfit("prompt + max_new_tokens > context", 100_000, 100_000)


def test_engine_reported_context_wins_over_the_policy() -> None:
    r = rules()
    snap = with_engine(snapshot(NOW), context_len=50_000)
    assert judge(r, ask(r, 60_000), snap).checks == unfit("prompt + max_new_tokens > context", 60_000, 50_000)


def test_engine_reported_pool_wins_and_the_reserve_counts() -> None:
    r = rules(lane__context_len=1_000_000, kv__reserve_tokens=1000)
    snap = with_engine(snapshot(NOW), max_total_tokens=40_000, kv_available_tokens=40_000)
    assert judge(r, ask(r, 39_000), snap).admitted  # 40,000 - 1,000: exactly fits
    assert judge(r, ask(r, 39_001), snap).checks == unfit("larger than KV pool", 39_001, 39_000)


def test_policy_pool_is_the_fallback_when_the_engine_reports_none() -> None:
    r = rules(lane__context_len=1_000_000)  # lane pool 100,000
    snap = with_engine(snapshot(NOW), max_total_tokens=None, kv_available_tokens=500_000)
    assert judge(r, ask(r, 100_001), snap).checks == unfit("larger than KV pool", 100_001, 100_000)


def test_an_estimate_is_never_condemned_for_length() -> None:
    r = rules()
    d = ask(r, 150_000, exact=False)
    assert d.prompt_tokens == 100_000  # capped at the context
    assert judge(r, d).reason is not Reason.UNFIT_REQUEST


MAMBA = dict(lane__mamba_slots=51, mamba__slots_per_request=1, mamba__reserve_slots=1)


def test_more_mamba_slots_than_the_pool_is_unfit() -> None:
    r = rules(**MAMBA)
    assert judge(r, ask(r, 10, samples=50)).admitted  # 51 - 1 reserved
    d = judge(r, ask(r, 10, samples=51))
    assert d.checks == unfit("more Mamba slots than the pool has", 51, 50)


def test_engine_reported_mamba_pool_wins() -> None:
    r = rules(**MAMBA)
    snap = with_engine(snapshot(NOW), mamba_used_slots=0, mamba_available_slots=10, mamba_evictable_slots=0)
    assert judge(r, ask(r, 10, samples=10), snap).checks == unfit("more Mamba slots than the pool has", 10, 9)


def test_transient_cap_boundary() -> None:
    r = rules(vram__max_transient_bytes=1000 * KIB)  # one 1,000-token chunk at 1 KiB per token
    assert judge(r, ask(r, 1000)).admitted
    r = rules(vram__max_transient_bytes=1000 * KIB - 1)
    d = judge(r, ask(r, 1000))
    assert d.checks == unfit("transient larger than the lane frees", 1000 * KIB, 1000 * KIB - 1)


# -- sight: unavailable and stale -------------------------------------------------------------------


def test_engine_unavailable_after_the_configured_failures() -> None:
    r = rules(engine__on_stale="reject")
    down = replace(snapshot(NOW), engine_health=SourceHealth(NOW - 10, "connection refused", 3))
    d = judge(r, ask(r, 10), down)
    assert (d.action, d.reason) == (Action.REJECT, Reason.ENGINE_UNAVAILABLE)
    assert d.checks == (Check("engine_unavailable", False, note="connection refused"),)
    assert d.retry_after_s == 5  # at least one engine max_age: the next reads will tell
    # ``on_stale: hold`` rides a restart through: held within the hold bounds, no answer yet.
    held = judge(rules(), ask(r, 10), down)
    assert (held.action, held.reason, held.retry_after_s) == (Action.HOLD, Reason.ENGINE_UNAVAILABLE, None)
    two = replace(snapshot(NOW), engine_health=SourceHealth(NOW, "connection refused", 2))
    assert judge(r, ask(r, 10), two).admitted
    silent = replace(snapshot(NOW), engine_health=SourceHealth(None, None, 3))
    assert judge(r, ask(r, 10), silent).checks[0].note == "engine unreachable"


def test_after_an_engine_restart_a_holding_policy_waits_for_a_newer_gpu_reading() -> None:
    """The GPU reading before the restart saw the old process: whatever the headroom, a policy that
    holds when blind waits one GPU poll for the new process's reading; one that rejects does not
    turn that gap into refusals."""
    for r in (rules(), rules(vram__headroom="idle_budget", vram__idle_free_bytes=10 * MIB)):
        restarted = replace(snapshot(NOW), engine_restarted_at=NOW + 0.01)  # the GPU read at NOW
        d = judge(r, ask(r, 10), restarted)
        assert (d.action, d.reason) == (Action.HOLD, Reason.SIGNALS_STALE)
        assert d.checks[0].note == "gpu not read since the engine restarted"
        assert judge(r, ask(r, 10), replace(snapshot(NOW), engine_restarted_at=NOW)).admitted
    r = rules(gpu__on_stale="reject")
    assert judge(r, ask(r, 10), replace(snapshot(NOW), engine_restarted_at=NOW + 0.01)).admitted


def test_stale_signals_say_which_and_how_old() -> None:
    r = rules()
    fresh_gpu = snapshot(NOW).gpu
    d = judge(r, ask(r, 10), replace(snapshot(NOW - 6), gpu=fresh_gpu))
    assert (d.action, d.reason) == (Action.HOLD, Reason.SIGNALS_STALE)
    assert d.checks == (Check("signals_stale", False, 5.0, 6.0, "engine signals 6.0s old"),)
    d = judge(r, ask(r, 10), Snapshot(gpu=fresh_gpu))
    assert d.checks == (Check("signals_stale", False, 5.0, None, "engine signals never read"),)
    stale_gpu = replace(snapshot(NOW), gpu=snapshot(NOW - 3).gpu)
    assert judge(r, ask(r, 10), stale_gpu).checks == (
        Check("signals_stale", False, 2.0, 3.0, "gpu signals 3.0s old"),
    )
    assert judge(r, ask(r, 10), replace(snapshot(NOW - 5), gpu=fresh_gpu)).admitted  # exactly max_age: fresh


def test_admit_blind_never_reads_the_stale_values() -> None:
    """on_stale: admit passes the blind signal's constraints; it must not judge by its old numbers."""
    r = rules(engine__on_stale="admit", gpu__on_stale="admit")
    old = snapshot(NOW - 60, free_bytes=0, kv_available_tokens=0, queue_requests=999, full_token_usage=1.0)
    d = judge(r, ask(r, 1000), old)
    assert d.admitted
    assert check(d, "kv_pool") == Check("kv_pool", True, 1.0, None, "usage only")
    assert check(d, "vram_headroom") == Check("vram_headroom", True, 1000 * KIB, None, "no GPU signal")
    assert check(d, "engine_queue") == Check("engine_queue", True, 1, 1000)


def test_idle_budget_ignores_a_stale_gpu_and_a_gpu_that_is_not_required() -> None:
    r = rules(vram__headroom="idle_budget", vram__idle_free_bytes=10 * MIB)
    assert judge(r, ask(r, 10), replace(snapshot(NOW), gpu=None)).admitted
    r = rules(gpu__required=False)
    assert judge(r, ask(r, 10), replace(snapshot(NOW), gpu=None)).admitted


# -- the constraints ----------------------------------------------------------------------------------


def test_kv_pool_counts_evictable_ledger_and_reserve() -> None:
    r = rules(kv__reserve_tokens=100)
    snap = with_engine(snapshot(NOW), kv_available_tokens=1000, kv_evictable_tokens=500)
    booked = LedgerTotals(requests=1, sequences=1, kv_tokens=200)
    assert check(judge(r, ask(r, 1200), snap, booked), "kv_pool") == Check("kv_pool", True, 1200, 1200)
    d = judge(r, ask(r, 1201), snap, booked)
    assert (d.reason, check(d, "kv_pool")) == (Reason.KV_POOL, Check("kv_pool", False, 1201, 1200))
    strict = rules(kv__reserve_tokens=100, kv__count_evictable_as_free=False)
    assert check(judge(strict, ask(strict, 10), snap, booked), "kv_pool").have == 700
    unknown = with_engine(snap, kv_evictable_tokens=None)
    assert check(judge(r, ask(r, 10), unknown, booked), "kv_pool").have == 700


def test_kv_check_reads_the_ledger_200_requests_into_room_for_100() -> None:
    clock = ManualClock(NOW)
    a = Admission(small_policy(hold__max_held=0), clock)
    a.update_snapshot(snapshot(NOW, kv_available_tokens=100 * 1000))
    handles = [submit(a, ask(a.rules, 1000)) for _ in range(200)]
    assert sum(h.admitted for h in handles) == 100
    refused = [h.decision for h in handles if not h.admitted]
    assert all(d and d.reason is Reason.QUEUE_FULL and not check(d, "kv_pool").ok for d in refused)


def test_kv_max_usage_is_enforced_with_and_without_absolute_figures() -> None:
    r = rules(kv__max_usage=0.9)
    assert judge(r, ask(r, 10), with_engine(snapshot(NOW), full_token_usage=0.89)).admitted
    d = judge(r, ask(r, 10), with_engine(snapshot(NOW), full_token_usage=0.9))
    assert d.reason is Reason.KV_POOL
    usage_only = with_engine(snapshot(NOW), kv_available_tokens=None, full_token_usage=0.95)
    d = judge(r, ask(r, 10), usage_only)
    assert (d.reason, check(d, "kv_pool")) == (
        Reason.KV_POOL,
        Check("kv_pool", False, 0.9, 0.95, "usage only"),
    )
    low = with_engine(usage_only, full_token_usage=0.5)
    assert check(judge(r, ask(r, 10), low), "kv_pool") == Check("kv_pool", True, 0.9, 0.5, "usage only")


def test_decode_reserve_is_per_sequence() -> None:
    r = rules(kv__decode_reserve_fraction=0.5)
    d = ask(r, 1000, max_new_tokens=100, samples=2)
    assert d.kv_tokens == 1000 + 100 and d.sequences == 2


def test_mamba_slots_count_evictable_ledger_and_reserve() -> None:
    """Lane 2: the pool that ran out first. Exact numbers both ways of the boundary."""
    r = rules(**MAMBA)
    snap = with_engine(snapshot(NOW), mamba_used_slots=40, mamba_available_slots=5, mamba_evictable_slots=2)
    booked = LedgerTotals(requests=1, sequences=1, mamba_slots=1)
    ok = judge(r, ask(r, 10, samples=5), snap, booked)
    assert check(ok, "mamba_slots") == Check("mamba_slots", True, 5, 5) and ok.admitted
    d = judge(r, ask(r, 10, samples=6), snap, booked)
    assert (d.action, d.reason) == (Action.HOLD, Reason.MAMBA_SLOTS)
    assert check(d, "mamba_slots") == Check("mamba_slots", False, 6, 5)
    none_evictable = with_engine(snap, mamba_evictable_slots=None)
    assert check(judge(r, ask(r, 10), none_evictable, booked), "mamba_slots").have == 3


def test_mamba_max_usage_is_enforced() -> None:
    r = rules(**MAMBA, mamba__max_usage=0.95)
    snap = with_engine(snapshot(NOW), mamba_used_slots=0, mamba_available_slots=40, mamba_usage=0.95)
    assert judge(r, ask(r, 10), snap).reason is Reason.MAMBA_SLOTS
    assert judge(r, ask(r, 10), with_engine(snap, mamba_usage=0.94)).admitted
    usage_only = with_engine(snapshot(NOW), mamba_usage=0.99)
    d = judge(r, ask(r, 10), usage_only)
    assert check(d, "mamba_slots") == Check("mamba_slots", False, 0.95, 0.99, "usage only")
    blind = rules(**MAMBA, engine__on_stale="admit")
    stale = judge(blind, ask(blind, 10), replace(snapshot(NOW - 60), gpu=snapshot(NOW).gpu))
    assert check(stale, "mamba_slots") == Check("mamba_slots", True, 1.0, None, "usage only")
    quiet = with_engine(snapshot(NOW), mamba_usage=None)
    assert check(judge(r, ask(r, 10), quiet), "mamba_slots") == Check(
        "mamba_slots", True, 0.95, None, "usage only"
    )


def test_mamba_applies_only_where_there_is_a_pool() -> None:
    no_section = rules()
    assert "mamba_slots" not in {c.name for c in judge(no_section, ask(no_section, 10)).checks}
    no_pool = rules(mamba__slots_per_request=1)  # a section, but neither the lane nor the engine has slots
    d = judge(no_pool, ask(no_pool, 10))
    assert d.admitted and d.charge.mamba_slots == 0
    assert "mamba_slots" not in {c.name for c in d.checks}
    reported = with_engine(snapshot(NOW), mamba_used_slots=1, mamba_available_slots=9)
    assert charge_of(ask(no_pool, 10, samples=3), no_pool, reported).mamba_slots == 3


@pytest.mark.parametrize(
    ("section", "snap_changes", "reason"),
    [
        ("vram", {"free": 0}, Reason.VRAM_HEADROOM),
        ("kv", {"kv_available_tokens": 0}, Reason.KV_POOL),
        ("mamba", {"mamba_used_slots": 51, "mamba_available_slots": 0}, Reason.MAMBA_SLOTS),
        ("engine_queue", {"queue_requests": 1000}, Reason.ENGINE_QUEUE),
        ("pending_prefill", {"pending_prefill_tokens": 10_000_000}, Reason.PENDING_PREFILL_TOKENS),
    ],
)
def test_on_exceed_reject_rejects_at_once(section: str, snap_changes: dict, reason: Reason) -> None:
    changes = dict(snap_changes)
    free = changes.pop("free", 100 * 1024 * MIB)
    snap = snapshot(NOW, free_bytes=free, **changes)
    held = rules(**MAMBA)
    assert (judge(held, ask(held, 10), snap).action, judge(held, ask(held, 10), snap).reason) == (
        Action.HOLD,
        reason,
    )
    rejecting = rules(**MAMBA, **{f"{section}__on_exceed": "reject"})
    d = judge(rejecting, ask(rejecting, 10), snap)
    assert (d.action, d.reason) == (Action.REJECT, reason)
    assert d.retry_after_s is not None


def test_vram_headroom_boundary_and_numbers() -> None:
    r = rules()
    snap = snapshot(NOW, free_bytes=1000 * KIB)
    assert check(judge(r, ask(r, 1000), snap), "vram_headroom") == Check(
        "vram_headroom", True, 1000 * KIB, 1000 * KIB
    )
    d = judge(r, ask(r, 1000), snap, LedgerTotals(requests=1, sequences=1, projected_bytes=1))
    assert check(d, "vram_headroom") == Check("vram_headroom", False, 1000 * KIB, 1000 * KIB - 1)
    assert d.headroom_bytes == 1000 * KIB - 1


def test_engine_queue_counts_sequences_and_reports_its_limit() -> None:
    r = rules(engine_queue__max_requests=4)
    booked = LedgerTotals(requests=1, sequences=3)
    assert check(judge(r, ask(r, 10), snapshot(NOW), booked), "engine_queue") == Check(
        "engine_queue", True, 4, 4
    )
    d = judge(r, ask(r, 10, samples=2), snapshot(NOW), booked)
    assert check(d, "engine_queue") == Check("engine_queue", False, 5, 4)


def test_headroom_from_the_idle_budget_less_a_grown_neighbour() -> None:
    r = rules(
        vram__headroom="idle_budget",
        vram__idle_free_bytes=10 * MIB,
        vram__other_processes_bytes=1 * MIB,
        vram__reserve_bytes=1 * MIB,
    )
    ledger = LedgerTotals(requests=1, sequences=1, projected_bytes=1 * MIB)

    def with_other(other: int | None) -> Snapshot:
        snap = snapshot(NOW)
        assert snap.gpu is not None
        dev = replace(snap.gpu.devices[0], other_process_bytes=other)
        return replace(snap, gpu=replace(snap.gpu, devices=(dev,)))

    assert headroom_bytes(r, with_other(3 * MIB), ledger) == 10 * MIB - 2 * MIB - 1 * MIB - 1 * MIB
    assert headroom_bytes(r, with_other(MIB // 2), ledger) == 8 * MIB  # a neighbour that shrank gives nothing
    assert headroom_bytes(r, with_other(None), ledger) == 8 * MIB
    assert headroom_bytes(r, replace(snapshot(NOW), gpu=None), ledger) == 8 * MIB
    live = rules(vram__reserve_bytes=1 * MIB)
    assert headroom_bytes(live, snapshot(NOW, free_bytes=5 * MIB), ledger) == 3 * MIB
    assert headroom_bytes(live, replace(snapshot(NOW), gpu=GpuSignals(NOW, "test")), ledger) is None


# -- the hold queue's rules, Retry-After --------------------------------------------------------------


def test_draining_rejects_everything_with_the_minimum_retry() -> None:
    r = rules(hold__retry_after_min_s=3)
    assert judge(r, ask(r, 10), draining=True) == Decision(
        Action.REJECT, Reason.DRAINING, 3, check="draining"
    )


def test_strict_order_holds_behind_the_reason_ahead_and_backfill_does_not() -> None:
    r = rules()
    d = judge(r, ask(r, 10), ahead=Reason.KV_POOL)
    assert (d.action, d.reason) == (Action.HOLD, Reason.KV_POOL)
    backfill = rules(hold__backfill=True)
    assert judge(backfill, ask(backfill, 10), ahead=Reason.KV_POOL).admitted


def test_hold_deadline_and_queue_bounds() -> None:
    r = rules(engine_queue__max_requests=1)
    busy = LedgerTotals(requests=1, sequences=1)
    late = ask(r, 10, now=NOW - 30)  # its deadline is now
    d = judge(r, late, snapshot(NOW), busy, queued=True)
    assert (d.action, d.reason, d.retry_after_s) == (Action.REJECT, Reason.HOLD_TIMEOUT, 1)
    almost = ask(r, 10, now=NOW - 29.999)
    assert judge(r, almost, snapshot(NOW), busy, queued=True).action is Action.HOLD
    assert judge(r, ask(r, 10), snapshot(NOW), busy, held=10).reason is Reason.QUEUE_FULL
    assert judge(r, ask(r, 10), snapshot(NOW), busy, held=9).action is Action.HOLD
    assert judge(r, ask(r, 10), snapshot(NOW), busy, held=10, queued=True).action is Action.HOLD


def test_retry_after_estimates_the_prefill_ahead() -> None:
    r = rules()  # 1,000 prefill tokens/s, retry 1..60 s
    s = Situation(r, with_engine(snapshot(NOW), pending_prefill_tokens=5000), LedgerTotals(), NOW)
    assert retry_after_s(s, Reason.QUEUE_FULL, 1000) == 6
    s = replace(s, ledger=LedgerTotals(requests=1, sequences=1, prefill_tokens=9000))
    assert retry_after_s(s, Reason.QUEUE_FULL, 1000) == 10  # the ledger knows more than the gauge
    assert retry_after_s(replace(s, held_tokens=2000), Reason.QUEUE_FULL, 1000) == 12  # held in front
    assert retry_after_s(replace(s, prefill_tokens_per_s=2000.0), Reason.QUEUE_FULL, 1000) == 5  # measured
    blind = replace(s, snapshot=Snapshot(), ledger=LedgerTotals())
    assert retry_after_s(blind, Reason.QUEUE_FULL, 0) == 1
    assert retry_after_s(replace(s, snapshot=Snapshot()), Reason.SIGNALS_STALE, 1000) == 10
    assert retry_after_s(blind, Reason.SIGNALS_STALE, 10) == 5
    assert retry_after_s(blind, Reason.ENGINE_UNAVAILABLE, 10) == 5
    assert retry_after_s(s, Reason.UNFIT_REQUEST, 10) is None
    assert retry_after_s(s, Reason.QUEUE_FULL, 10_000_000) == 60
    assert retry_after_s(replace(s, rules=rules(hold__retry_after_min_s=3)), Reason.DRAINING) == 3
    # Unknown is not 1: no pending tokens reported, none booked, 1,000 own tokens at 1,000/s is 1 s.
    quiet = replace(
        s, snapshot=with_engine(snapshot(NOW), pending_prefill_tokens=None), ledger=LedgerTotals()
    )
    assert retry_after_s(quiet, Reason.QUEUE_FULL, 1000) == 1
    assert retry_after_s(replace(quiet, snapshot=Snapshot()), Reason.QUEUE_FULL, 1000) == 1


def test_only_a_rejection_carries_retry_after() -> None:
    r = rules()
    assert judge(r, ask(r, 10)).retry_after_s is None
    held = judge(r, ask(r, 10), snapshot(NOW, free_bytes=0))
    assert held.action is Action.HOLD and held.retry_after_s is None


# -- the demand ------------------------------------------------------------------------------------


def test_prefix_cache_credit_lowers_kv_prefill_and_transient() -> None:
    r = rules()
    d = ask(r, 1000, cached_tokens=300)
    assert (d.cached_tokens, d.uncached_tokens, d.kv_tokens) == (300, 700, 700)
    assert d.projected_bytes == 700 * KIB
    assert charge_of(d, r, snapshot(NOW)) == Charge(
        prefill_tokens=700, kv_tokens=700, projected_bytes=700 * KIB, mamba_slots=0, sequences=1
    )
    assert ask(r, 1000, cached_tokens=5000).uncached_tokens == 0
    assert ask(r, 1000, cached_tokens=-5).uncached_tokens == 1000
    assert ask(r, 1000, cached_tokens=1000).projected_bytes == 1 * KIB  # one extend step over the last token


def test_demand_defaults_and_chunk() -> None:
    r = rules()
    d = ask(r, 3000, max_new_tokens=None, priority=None)
    assert (d.max_new_tokens, d.priority, d.chunk_size, d.request_id, d.exact) == (0, 0, 1000, "", True)
    assert d.projected_bytes == 1000 * KIB
    assert ask(r, 3000, max_new_tokens=-4).max_new_tokens == 0
    small_chunk = ask(r, 3000, chunk=500)
    assert (small_chunk.chunk_size, small_chunk.projected_bytes) == (500, 500 * KIB)
    assert (d.arrived_at, d.deadline) == (NOW, NOW + 30)
    assert shape(100, 0, 1000) == shape(100, 0, 1000, 1) and shape(100, 0, 1000).chunk_tokens == 1


def test_mamba_checkpoints() -> None:
    r = rules(**MAMBA, mamba__checkpoint_interval_tokens=4096)
    assert ask(r, 8192).mamba_slots == 1 + 2
    assert ask(r, 8193).mamba_slots == 1 + 3
    assert ask(r, 8192, prompts=2).mamba_slots == 2 + 2 + 1
    assert ask(rules(**MAMBA), 8192).mamba_slots == 1
    assert ask(rules(), 8192).mamba_slots == 0


def test_reprice_keeps_everything_but_the_price() -> None:
    cheap, dear = rules(), rules(cost__activation_bytes_per_chunk_token=2048, hold__max_wait_s=60)
    d = ask(
        cheap,
        1500,
        exact=False,
        cached_tokens=100,
        max_new_tokens=77,
        prompts=2,
        samples=3,
        chunk=500,
        priority=4,
        request_id="r",
    )
    again = demand.reprice(dear, d)
    assert again == replace(d, projected_bytes=2 * d.projected_bytes, deadline=NOW + 60)
    assert type(again.sequences) is int


# -- intake ------------------------------------------------------------------------------------------


def test_demand_of_reads_the_engine_chunk_and_passes_the_request_through() -> None:
    r = rules()
    req = parse_generation(
        "/generate",
        b'{"text": "a", "priority": 3, "sampling_params": {"max_new_tokens": 9}}',
        max_body_bytes=1 << 20,
    )
    snap = with_engine(snapshot(NOW), chunked_prefill_size=500)
    d = demand_of(r, snap, req, TokenCount(2000, False, "estimate"), now=NOW, request_id="x")
    assert (d.chunk_size, d.projected_bytes, d.exact, d.priority, d.max_new_tokens, d.request_id) == (
        500,
        500 * KIB,
        False,
        3,
        9,
        "x",
    )
    assert demand_of(r, Snapshot(), req, TokenCount(2000, True, "t"), now=NOW).chunk_size == 1000
    assert demand_of(r, Snapshot(), req, TokenCount(2000, True, "t"), now=NOW).request_id == ""
    declared = parse_generation(
        "/generate",
        b'{"text": "a", "emulator": {"prompt_tokens": 10, "cached_tokens": 4}}',
        max_body_bytes=1 << 20,
    )
    assert demand_of(r, Snapshot(), declared, TokenCount(10, True, "declared"), now=NOW).uncached_tokens == 6


def test_rules_hold_plain_ints_not_pydantic_sizes() -> None:
    r = rules(vram__reserve_bytes="1MiB")
    assert type(r.vram.reserve_bytes) is int and r.vram.reserve_bytes == MIB
    assert type(r.cost.activation_bytes_per_chunk_token) is int


def test_signal_ages_never_go_negative() -> None:
    snap = snapshot(NOW)
    assert (snap.engine_age(NOW - 1), snap.gpu_age(NOW - 1)) == (0.0, 0.0)
    assert (snap.engine_age(NOW + 0.5), snap.gpu_age(NOW + 0.5)) == (0.5, 0.5)


# -- the ledger ---------------------------------------------------------------------------------------


def totals(*n: int) -> LedgerTotals:
    """Requests, sequences, prefill tokens, KV tokens, bytes, Mamba slots; running requests, their slots."""
    names = ("requests", "sequences", "prefill_tokens", "kv_tokens", "projected_bytes", "mamba_slots")
    return LedgerTotals(**dict(zip((*names, "running_requests", "running_mamba_slots"), n, strict=True)))


def test_ledger_totals_and_idempotent_release() -> None:
    ledger = Ledger()
    a = ledger.charge(
        Charge(prefill_tokens=100, kv_tokens=120, projected_bytes=5, mamba_slots=2, sequences=3)
    )
    b = ledger.charge(Charge(prefill_tokens=10, kv_tokens=12, projected_bytes=1, mamba_slots=1, sequences=1))
    assert ledger.totals == totals(2, 4, 110, 132, 6, 3, 2, 3) and len(ledger) == 2
    assert ledger.prefill_done(a) is True
    assert ledger.prefill_done(a) is False
    assert ledger.totals == totals(1, 1, 10, 12, 1, 1, 2, 3)  # a still runs, with its 2 Mamba slots
    assert ledger.release(a) is True
    assert ledger.release(a) is False
    assert ledger.totals == totals(1, 1, 10, 12, 1, 1, 1, 1)
    assert ledger.release(b) and ledger.totals == LedgerTotals()


# -- the admission controller -----------------------------------------------------------------------


class Log:
    """An observer that keeps every argument it is given."""

    def __init__(self) -> None:
        self.decisions: list[tuple[Action, Reason | None, str, float, int]] = []
        self.outcomes: list[Outcome] = []

    def decision(self, d: Decision, dem: Demand, waited_s: float, ledger: LedgerTotals) -> None:
        self.decisions.append((d.action, d.reason, dem.request_id, waited_s, ledger.requests))

    def outcome(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


def lane(
    clock: ManualClock, free_mib: float = 1, shadow: bool = False, **overrides: object
) -> tuple[Admission, Log]:
    log = Log()
    a = Admission(small_policy(**overrides), clock, shadow=shadow, observer=log)
    a.update_snapshot(snapshot(clock(), free_bytes=int(free_mib * MIB)))
    return a, log


def one_mib(a: Admission, rid: str = "", priority: int = 0) -> Demand:
    return demand.build(a.rules, 1000, arrived_at=a.clock.now(), request_id=rid, priority=priority)


def test_observer_is_told_every_decision_with_its_numbers(clock: ManualClock) -> None:
    a, log = lane(clock, hold__max_held=1)
    first = submit(a, one_mib(a, "a"))
    second = submit(a, one_mib(a, "b"))
    submit(a, one_mib(a, "c"))  # queue full
    clock.advance(2)
    first.end(Outcome.COMPLETED)
    assert second.admitted and second.waited_s == 2
    assert log.decisions == [
        (Action.ADMIT, None, "a", 0.0, 1),
        (Action.HOLD, Reason.VRAM_HEADROOM, "b", 0.0, 1),
        (Action.REJECT, Reason.QUEUE_FULL, "c", 0.0, 1),
        (Action.ADMIT, None, "b", 2.0, 1),
    ]
    assert log.outcomes == [Outcome.REJECTED, Outcome.COMPLETED]


def test_a_fresh_admission_is_blind_and_a_fresh_handle_is_nothing_yet(clock: ManualClock) -> None:
    a = Admission(small_policy(), clock)
    assert a.policy.name == "test-lane"
    h = a.open()
    assert (h.admitted, h.held, h.ended, h.waited_s, h.decision) == (False, False, False, 0.0, None)
    h.submit(one_mib(a))
    assert (
        h.held and h.decision is not None and h.decision.reason is Reason.SIGNALS_STALE and h.waited_s == 0.0
    )


def test_a_handle_submits_once(clock: ManualClock) -> None:
    a, _ = lane(clock, free_mib=10)
    h = submit(a, one_mib(a))
    assert h.admitted
    with pytest.raises(RuntimeError, match=r"^a handle submits once, before it ends$"):
        h.submit(one_mib(a))
    gone = a.open()
    gone.end(Outcome.BAD_REQUEST)
    with pytest.raises(RuntimeError):
        gone.submit(one_mib(a))


def test_shadow_admits_with_the_real_numbers(clock: ManualClock) -> None:
    a, log = lane(clock, free_mib=0, shadow=True)
    h = submit(a, one_mib(a, "s"))
    assert h.admitted and h.decision is not None and h.shadow_reject is not None
    assert (h.decision.headroom_bytes, h.decision.checks) == (
        h.shadow_reject.headroom_bytes,
        h.shadow_reject.checks,
    )
    assert h.decision.charge == h.shadow_reject.charge and a.ledger.totals.projected_bytes == 1000 * KIB
    assert log.decisions == [(Action.HOLD, Reason.VRAM_HEADROOM, "s", 0.0, 0)]


def test_strict_order_survives_a_pump_and_blocks_newcomers(clock: ManualClock) -> None:
    """Room for a small request only: the big one waits, and everything behind it waits with its reason."""
    a, _ = lane(clock, free_mib=0.5)
    big = submit(a, one_mib(a))
    small = submit(a, demand.build(a.rules, 10, arrived_at=clock()))
    a.update_snapshot(snapshot(clock(), free_bytes=MIB // 2))
    assert big.held and small.held
    assert small.decision is not None and small.decision.reason is Reason.VRAM_HEADROOM
    late = submit(a, demand.build(a.rules, 10, arrived_at=clock()))
    assert late.held
    assert a.evaluate(demand.build(a.rules, 10, arrived_at=clock())).action is Action.HOLD  # explain agrees
    urgent = demand.build(a.rules, 10, arrived_at=clock(), priority=9)
    assert a.evaluate(urgent).admitted and submit(a, urgent).admitted  # a higher priority is not behind


def test_queued_requests_are_never_queue_full(clock: ManualClock) -> None:
    a, _ = lane(clock, free_mib=0, hold__max_held=1)
    h = submit(a, one_mib(a))
    a.update_snapshot(snapshot(clock(), free_bytes=0))
    assert h.held


def test_a_cancelled_head_does_not_block_newcomers(clock: ManualClock) -> None:
    a, _ = lane(clock, free_mib=0.5)
    head = submit(a, one_mib(a))
    head.end(Outcome.CLIENT_GONE)
    assert submit(a, demand.build(a.rules, 10, arrived_at=clock())).admitted


def test_low_priority_values_first_reverses_the_order(clock: ManualClock) -> None:
    a, _ = lane(clock, hold__low_priority_values_first=True)
    first = submit(a, one_mib(a))
    order: list[int] = []
    for prio in (5, 0, 3):
        a.open().submit(one_mib(a, priority=prio), lambda h, p=prio: order.append(p))
    first.end(Outcome.COMPLETED)
    assert order == [0]


def test_reload_reprices_and_moves_the_deadline(clock: ManualClock) -> None:
    a, _ = lane(clock, free_mib=0.75)
    blocker = submit(a, demand.build(a.rules, 10, arrived_at=clock()))
    h = submit(a, one_mib(a))
    a.reload(small_policy(hold__max_wait_s=60))
    assert a.policy.hold.max_wait_s == 60 and h.demand is not None and h.demand.deadline == clock() + 60
    clock.advance(30)
    assert h.held, "timed out at the old deadline"
    clock.advance(30)
    assert (
        h.outcome is Outcome.REJECTED and h.decision is not None and h.decision.reason is Reason.HOLD_TIMEOUT
    )
    a.reload(small_policy(cost__activation_bytes_per_chunk_token=512))
    a.update_snapshot(snapshot(clock(), free_bytes=int(0.75 * MIB)))
    again = submit(a, one_mib(a))
    assert again.admitted  # 500 KiB under the new cost model
    blocker.end(Outcome.COMPLETED)
    again.end(Outcome.COMPLETED)
    assert clock.pending == 0


def test_oldest_wait(clock: ManualClock) -> None:
    a, _ = lane(clock, free_mib=0)
    assert a.oldest_wait_s() is None
    first = submit(a, one_mib(a))
    clock.advance(3)
    submit(a, one_mib(a))
    clock.advance(1)
    assert a.oldest_wait_s() == 4
    first.end(Outcome.CLIENT_GONE)
    assert a.oldest_wait_s() == 1


class EarlyClock(ManualClock):
    """A loop that fires a timer a hair before its time (as asyncio's clock resolution allows), once."""

    early = True

    def call_at(self, when: float, fn: Callable[[], None]):  # type: ignore[no-untyped-def]
        early, self.early = self.early, False
        return super().call_at(when - 0.001 if early else when, fn)


def test_a_deadline_timer_that_fires_early_waits_the_rest() -> None:
    clock = EarlyClock(NOW)
    a, _ = lane(clock, free_mib=0)
    h = submit(a, one_mib(a))
    clock.advance(29.9995)  # the timer fired 1 ms early: still held, re-armed
    assert h.held
    clock.advance(0.0005)
    assert (
        h.outcome is Outcome.REJECTED and h.decision is not None and h.decision.reason is Reason.HOLD_TIMEOUT
    )


def test_a_release_during_a_pass_gets_another_pass(clock: ManualClock) -> None:
    """B's callback ends B and Y, after the pass already decided A: A must not wait for the next event."""
    a, _ = lane(clock, free_mib=2, hold__backfill=True)
    x, y = submit(a, one_mib(a)), submit(a, one_mib(a))
    big = submit(a, demand.build(a.rules, 2000, arrived_at=clock(), chunk=2000))
    b = a.open()
    b.submit(one_mib(a), lambda h: (h.end(Outcome.COMPLETED), y.end(Outcome.COMPLETED)))
    assert big.held and b.held
    x.end(Outcome.COMPLETED)
    assert b.outcome is Outcome.COMPLETED and big.admitted


def test_the_queue_compacts_and_keeps_its_order(clock: ManualClock) -> None:
    a, _ = lane(clock, free_mib=0, hold__max_held=100)
    keep = [submit(a, one_mib(a, rid=str(i))) for i in range(3)]
    for _ in range(100):
        submit(a, one_mib(a)).end(Outcome.CLIENT_GONE)
    a.pump()
    assert len(a._queue.items) <= 2 * 3 + 16
    answered: list[str] = []
    for h in keep:
        h._on_done = lambda h: answered.append(h.demand.request_id if h.demand else "")
    a.update_snapshot(snapshot(clock(), free_bytes=10 * MIB))
    assert answered == ["0", "1", "2"]


def test_a_failing_observer_is_logged_and_admission_goes_on(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        def decision(self, *args: object) -> None:
            raise RuntimeError("disk full")

        def outcome(self, *args: object) -> None:
            raise RuntimeError("disk full")

    a = Admission(small_policy(), clock, observer=Broken())
    a.update_snapshot(snapshot(clock(), free_bytes=10 * MIB))
    with caplog.at_level(logging.ERROR, logger="sidecar.admission.controller"):
        h = submit(a, one_mib(a))
        h.end(Outcome.COMPLETED)
    assert a.ledger.totals == LedgerTotals() and h.outcome is Outcome.COMPLETED
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "observer failed on a decision; admission goes on",
        "observer failed on an outcome; admission goes on",
    ]


def test_the_guard_passes_every_argument_through(clock: ManualClock) -> None:
    a, log = lane(clock, free_mib=10)
    h = submit(a, one_mib(a, "g"))
    h.end(Outcome.COMPLETED)
    assert log.decisions == [(Action.ADMIT, None, "g", 0.0, 1)] and log.outcomes == [Outcome.COMPLETED]


def test_explain_charges_nothing(clock: ManualClock) -> None:
    a, _ = lane(clock, free_mib=10)
    d = a.evaluate(one_mib(a))
    assert d.admitted and a.ledger.totals == LedgerTotals() and a.held == 0
    h = submit(a, one_mib(a))  # the evaluation did not take a place in the order
    assert h.sort_key == (0, 0)


def test_handles_carry_their_decision_and_wait(clock: ManualClock) -> None:
    a, _ = lane(clock, free_mib=0)
    answered: list[Handle] = []
    h = submit(a, one_mib(a), answered)
    clock.advance(30)
    assert answered == [h] and h.waited_s == 30


def test_a_long_cascade_of_callbacks_stays_iterative(clock: ManualClock) -> None:
    """Replay ends a handle inside its own callback; 1,500 of them in a row must not recurse 1,500 deep."""
    a, _ = lane(clock, free_mib=1, hold__max_held=2000)
    first = submit(a, one_mib(a))
    done: list[Handle] = []
    for _ in range(1500):
        a.open().submit(one_mib(a), lambda h: (done.append(h), h.end(Outcome.COMPLETED)))
    first.end(Outcome.COMPLETED)
    assert len(done) == 1500 and a.held == 0 and a.ledger.totals == LedgerTotals()


# -- the hold queue's one deadline timer (issue #12: not a timer per waiter) -------------------------


def timed_out(h: Handle) -> bool:
    return (
        h.outcome is Outcome.REJECTED and h.decision is not None and h.decision.reason is Reason.HOLD_TIMEOUT
    )


def test_one_timer_times_many_waiters_earliest_deadline_first(clock: ManualClock) -> None:
    a, _ = lane(clock, free_mib=0)
    late = submit(a, one_mib(a))  # deadline +30
    early = submit(a, demand.build(a.rules, 1000, arrived_at=clock() - 10))  # arrived earlier: +20
    third = submit(a, one_mib(a))
    assert clock.pending == 1, "one timer for the whole queue"
    clock.advance(19.99)
    assert early.held and late.held
    clock.advance(0.01)
    assert timed_out(early) and late.held and third.held and clock.pending == 1
    clock.advance(10)
    assert timed_out(late) and timed_out(third) and clock.pending == 0


def test_the_timed_waiter_leaving_moves_the_timer_to_the_next(clock: ManualClock) -> None:
    a, _ = lane(clock, free_mib=0)
    first = submit(a, one_mib(a))  # deadline +30
    clock.advance(5)
    second = submit(a, one_mib(a))  # deadline +35
    first.end(Outcome.CLIENT_GONE)
    assert clock.pending == 1
    clock.advance(29.99)
    assert second.held
    clock.advance(0.01)
    assert timed_out(second) and clock.pending == 0
    assert a.held == 0


def test_a_waiter_leaving_behind_the_timed_one_keeps_the_timer(clock: ManualClock) -> None:
    a, _ = lane(clock, free_mib=0)
    first = submit(a, one_mib(a))
    clock.advance(5)
    second = submit(a, one_mib(a))
    second.end(Outcome.CLIENT_GONE)
    assert clock.pending == 1
    clock.advance(25)
    assert timed_out(first) and clock.pending == 0


@pytest.mark.parametrize("wait_s", [10.0, 60.0])
def test_a_reload_retimes_held_requests_to_their_new_deadline(clock: ManualClock, wait_s: float) -> None:
    a, _ = lane(clock, free_mib=0)  # held under max_wait_s 30, then priced again under wait_s
    held = [submit(a, one_mib(a)) for _ in range(3)]
    a.reload(small_policy(hold__max_wait_s=wait_s))
    assert clock.pending == 1
    clock.advance(wait_s - 0.01)
    assert all(h.held for h in held), "timed out before its new deadline (at the old one, if later)"
    clock.advance(0.01)
    assert all(timed_out(h) for h in held) and clock.pending == 0


def test_the_queue_walks_in_priority_then_arrival_order_after_the_head_left(clock: ManualClock) -> None:
    a, _ = lane(clock, free_mib=0)
    first = submit(a, one_mib(a, "first"))
    low = submit(a, one_mib(a, "low", priority=5))
    high = submit(a, one_mib(a, "high", priority=-5))
    second = submit(a, one_mib(a, "second"))
    high.end(Outcome.CLIENT_GONE)
    later = submit(a, one_mib(a, "later"))  # reads the head (which left) for its strict-order wait
    admitted: list[str] = []
    for h in (first, low, second, later):
        h._on_done = lambda h: admitted.append(h.demand.request_id)  # type: ignore[union-attr]
    a.update_snapshot(snapshot(clock(), free_bytes=100 * MIB))
    low_first = a.rules.hold.low_priority_values_first
    assert admitted == (
        ["first", "second", "later", "low"] if low_first else ["low", "first", "second", "later"]
    )
    assert a.held == 0


def test_readiness_asks_the_decisions_own_thresholds() -> None:
    """``/readyz`` (``readiness``) and ``decide`` agree: a signal the gate does not read (the GPU under
    an idle budget) or one the policy admits blind on is no reason to be unready; an engine is
    unavailable after ``unavailable_after_failures`` failed reads, not at the first."""
    from sidecar.core.decide import readiness

    snap = snapshot(NOW)
    assert snap.gpu is not None
    old_gpu = replace(snap, gpu=replace(snap.gpu, observed_at=NOW - 100))

    def both(r: Rules, sn: Snapshot, **queue: object) -> tuple[Check | None, Decision]:
        s = Situation(r, sn, EMPTY, NOW, **queue)  # type: ignore[arg-type]
        return readiness(s), decide(ask(r, 100), s)

    budget = rules(vram__headroom="idle_budget", vram__idle_free_bytes="10GiB")
    why, d = both(budget, old_gpu)
    assert why is None and d.admitted
    why, d = both(rules(), old_gpu)
    assert why is not None and why.name == "signals_stale" and "gpu" in why.note
    assert d.reason is Reason.SIGNALS_STALE
    assert both(rules(gpu__on_stale="admit"), old_gpu)[0] is None
    for failures, ready in ((2, True), (3, False)):
        sick = replace(snap, engine_health=SourceHealth(consecutive_failures=failures, last_error="boom"))
        why, d = both(rules(), sick)
        assert (why is None) is ready
        assert d.reason is (None if ready else Reason.ENGINE_UNAVAILABLE)
    why, d = both(rules(), snap, draining=True)
    assert why is not None and why.note == "draining" and d.reason is Reason.DRAINING
