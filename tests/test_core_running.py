"""The core's terms for requests already running, with exact numbers: the batch join, the Mamba slots
kept until the end, the prefill rate Retry-After divides by, and the held work ahead of a newcomer.

Written against the mutants of ``make mutation`` that the rest of the core's tests let through: each
test pins a boundary, a sum, or a figure shown to operators. Pure and on a manual clock: no sleeps.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.admission.controller import Admission, Handle, Outcome
from sidecar.core import demand
from sidecar.core.cost import UNBOUNDED_BYTES, Shape, chunk_context, project_bytes
from sidecar.core.decide import Situation, decide, retry_after_s
from sidecar.core.decision import Action, Charge, Check, Reason
from sidecar.core.ledger import Ledger, LedgerTotals
from sidecar.core.prefill_rate import PrefillRate
from sidecar.core.rules import CostModel, Rules
from sidecar.policy.in_force import rules_of
from tests.conftest import MIB, ManualClock, small_policy, snapshot, submit, with_engine

NOW = 5000.0
KIB = 1024


def rules(**overrides: object) -> Rules:
    return rules_of(small_policy(**overrides).policy)


def cost(**terms: object) -> CostModel:
    base: dict[str, object] = dict(
        fixed_bytes=0,
        activation_bytes_per_chunk_token=0,
        context_bytes_per_token=0,
        gather_bytes_per_context_token=0,
        gather_cap_bytes=None,
        margin=1.0,
    )
    return CostModel(**{**base, **terms})  # type: ignore[arg-type]


# -- the cost of joining the running batch ----------------------------------------------------------


def test_join_bytes_grow_with_the_batch_from_two_requests_on() -> None:
    both = cost(batch_join_bytes=1000, batch_join_bytes_per_running_request=10, margin=1.5)
    assert [both.join_bytes(n) for n in (0, 1, 2, 3)] == [0, 0, 1530, 1545]
    # Either coefficient alone is a join cost; a join never measured (None) adds nothing fixed.
    assert cost(batch_join_bytes=1000).join_bytes(2) == 1000
    assert cost(batch_join_bytes_per_running_request=10).join_bytes(4) == 40
    assert cost(batch_join_bytes=None, batch_join_bytes_per_running_request=7).join_bytes(3) == 21
    assert cost().join_bytes(5) == 0 and cost(batch_join_bytes=0).join_bytes(5) == 0


def test_the_chunk_context_term_is_chunk_times_context() -> None:
    c = cost(chunk_context_bytes=2.0)
    assert chunk_context(c, Shape(prompt_tokens=10, uncached_tokens=10, chunk_tokens=4)) == 80


def test_a_projection_past_float_range_is_unbounded_not_an_error() -> None:
    """A float term that overflows to inf (a policy's 1e300 coefficient) is more than any device has,
    so the request is judged unfit: never an OverflowError out of int(inf)."""
    huge = cost(chunk_context_bytes=1e300)
    s = Shape(prompt_tokens=500_000, uncached_tokens=500_000, chunk_tokens=16_384)
    assert project_bytes(huge, s) == UNBOUNDED_BYTES
    # An integer term too large for the float ones it is added to is unbounded as well.
    assert project_bytes(cost(fixed_bytes=10**400, chunk_context_bytes=1.0), s) == UNBOUNDED_BYTES


JOIN = dict(
    cost__batch_join_bytes=1000 * KIB, cost__batch_join_bytes_per_running_request=100 * KIB, cost__margin=1.5
)


def situation(r: Rules, ledger: LedgerTotals, free: int | None) -> Situation:
    return Situation(r, snapshot(NOW, free_bytes=free), ledger, NOW)


def join_check(r: Rules, ledger: LedgerTotals, free: int | None) -> Check | None:
    d = decide(demand.build(r, 10, arrived_at=NOW), situation(r, ledger, free))
    return next((c for c in d.checks if c.name == "batch_join"), None)


def test_a_request_alone_has_no_join_to_check() -> None:
    r = rules(**JOIN)
    assert join_check(r, LedgerTotals(), 0) is None
    d = decide(demand.build(r, 10, arrived_at=NOW), situation(r, LedgerTotals(), MIB))
    assert d.admitted and [c.name for c in d.checks] == [
        "vram_headroom",
        "kv_pool",
        "engine_queue",
        "pending_prefill_tokens",
    ]


def test_the_join_is_checked_against_free_memory_before_the_prefills() -> None:
    """One runs, one still prefills (1 MiB booked): the newcomer's join is (1,000 + 100 x 2) KiB x 1.5 =
    1,800 KiB, against 1,800 KiB free before the ledger's prefills, which the headroom has subtracted."""
    r = rules(**JOIN)
    need = 1800 * KIB
    ledger = LedgerTotals(running_requests=1, requests=1, sequences=1, projected_bytes=MIB)
    assert join_check(r, ledger, need) == Check("batch_join", True, need, need, "joining 1 running")
    assert join_check(r, ledger, need - 1) == Check("batch_join", False, need, need - 1, "joining 1 running")
    two = replace(ledger, running_requests=2)
    assert join_check(r, two, 10 * MIB) == Check(
        "batch_join", True, 1950 * KIB, 10 * MIB, "joining 2 running"
    )


def test_a_join_that_does_not_fit_holds_for_vram() -> None:
    r = rules(**JOIN)
    d = decide(
        demand.build(r, 10, arrived_at=NOW), situation(r, LedgerTotals(running_requests=1), 1700 * KIB)
    )
    assert (d.action, d.reason) == (Action.HOLD, Reason.VRAM_HEADROOM)
    assert [c.name for c in d.checks if not c.ok] == ["batch_join"]
    rejecting = rules(**JOIN, vram__on_exceed="reject")
    s = situation(rejecting, LedgerTotals(running_requests=1), 1700 * KIB)
    d = decide(demand.build(rejecting, 10, arrived_at=NOW), s)
    assert (d.action, d.reason) == (Action.REJECT, Reason.VRAM_HEADROOM)


def test_without_a_gpu_signal_the_join_passes_with_a_note() -> None:
    r = rules(**JOIN, gpu__required=False)
    got = join_check(r, LedgerTotals(running_requests=1), None)
    assert got == Check("batch_join", True, 1800 * KIB, None, "no GPU signal")


# -- Mamba slots kept until the end -------------------------------------------------------------------

MAMBA = dict(lane__mamba_slots=51, mamba__slots_per_request=1, mamba__reserve_slots=1)


def test_mamba_claim_keeps_a_decoding_request_s_checkpoints_less_its_working_slot() -> None:
    """A prefills (3 slots: 1 working + 2 checkpoints), B decodes (5 slots): claimed 3 + 5 - 1 (B's
    working slot, which the engine shows as used by now) = 7; 20 available - 7 - 1 reserved = 12."""
    ledger = Ledger()
    ledger.charge(Charge(mamba_slots=3))
    b = ledger.charge(Charge(mamba_slots=5))
    ledger.prefill_done(b)
    r = rules(**MAMBA)
    snap = with_engine(snapshot(NOW), mamba_used_slots=30, mamba_available_slots=20, mamba_evictable_slots=0)
    d = decide(demand.build(r, 10, arrived_at=NOW), Situation(r, snap, ledger.totals, NOW))
    assert next(c for c in d.checks if c.name == "mamba_slots") == Check("mamba_slots", True, 1, 12)


# -- the prefill rate ---------------------------------------------------------------------------------


def test_prefill_rate_is_a_decayed_ratio_of_sums() -> None:
    rate = PrefillRate()
    assert rate.tokens_per_s is None
    rate.prefilled(1000, 1.0)  # before the ledger was ever busy: nothing to time it from
    assert rate.tokens_per_s is None
    rate.busy(10.0)
    rate.prefilled(1000, 12.0)
    assert rate.tokens_per_s == 500.0  # exactly 1,000 tokens in 2 s: the sums start at zero
    rate.prefilled(900, 12.5)  # timed from the last first byte, not from busy: 0.5 s
    assert rate.tokens_per_s == pytest.approx((0.8 * 1000 + 900) / (0.8 * 2 + 0.5))
    rate.prefilled(1, 13.0)  # one token is a sample too
    assert rate.tokens_per_s == pytest.approx((0.8 * 1700 + 1) / (0.8 * 2.1 + 0.5))


def test_prefill_rate_ignores_empty_prefills_and_a_clock_that_steps_back() -> None:
    rate = PrefillRate(keep=0.5)
    rate.busy(0.0)
    rate.prefilled(100, 4.0)
    rate.prefilled(0, 10.0)  # a fully cached prompt: no tokens, no time, the mark stays
    assert rate.tokens_per_s == 25.0
    rate.prefilled(100, 12.0)  # 8 s since the last real sample
    assert rate.tokens_per_s == (0.5 * 100 + 100) / (0.5 * 4 + 8)
    rate.prefilled(50, 11.0)  # a step back adds tokens and no time
    assert rate.tokens_per_s == (0.5 * 150 + 50) / (0.5 * 10)


def test_the_admission_times_prefills_from_the_instant_the_ledger_became_busy(clock: ManualClock) -> None:
    a = Admission(small_policy(), clock)
    a.update_snapshot(snapshot(clock(), free_bytes=10 * MIB))
    first = submit(a, demand.build(a.rules, 1000, arrived_at=clock()))
    clock.advance(1)
    second = submit(a, demand.build(a.rules, 500, arrived_at=clock()))  # the ledger is busy already
    clock.advance(1)
    first.prefill_done()  # a stream's first byte: measured by default
    assert a.prefill_rate.tokens_per_s == 500.0  # 1,000 tokens in the 2 s since busy
    assert a.situation().prefill_tokens_per_s == 500.0
    clock.advance(2)
    second.prefill_done(measured=False)  # a whole non-streamed answer: not a prefill's end
    assert a.prefill_rate.tokens_per_s == 500.0
    first.end(Outcome.COMPLETED)
    second.end(Outcome.COMPLETED)


# -- the work held ahead of a newcomer, and Retry-After ---------------------------------------------


def test_held_tokens_follow_the_queue_through_leaving_and_reload(clock: ManualClock) -> None:
    a = Admission(small_policy(), clock)
    a.update_snapshot(snapshot(clock(), free_bytes=0))
    held: list[Handle] = [submit(a, demand.build(a.rules, n, arrived_at=clock())) for n in (100, 200, 400)]
    assert all(h.held for h in held)
    assert a.situation().held_tokens == 700
    held[1].end(Outcome.CLIENT_GONE)
    assert a.situation().held_tokens == 500
    a.reload(small_policy(hold__max_wait_s=60))  # the one that left is still in the heap: not counted
    assert a.situation().held_tokens == 500
    assert a.situation(own_tokens=100).held_tokens == 400
    held[0].end(Outcome.CLIENT_GONE)
    held[2].end(Outcome.CLIENT_GONE)
    assert a.situation().held_tokens == 0


def test_retry_after_counts_no_own_tokens_unless_told() -> None:
    r = rules()  # 1,000 prefill tokens/s
    s = Situation(r, with_engine(snapshot(NOW), pending_prefill_tokens=2000), LedgerTotals(), NOW)
    assert retry_after_s(s, Reason.QUEUE_FULL) == 2
    assert retry_after_s(s, Reason.QUEUE_FULL, 1) == 3


def test_draining_retries_at_the_minimum_whatever_the_work_ahead() -> None:
    r = rules(hold__retry_after_min_s=3)
    busy = LedgerTotals(requests=1, sequences=1, prefill_tokens=100_000)
    s = Situation(r, snapshot(NOW), busy, NOW, draining=True)
    d = decide(demand.build(r, 10, arrived_at=NOW), s)
    assert (d.action, d.reason, d.retry_after_s) == (Action.REJECT, Reason.DRAINING, 3)


def test_a_new_admission_is_not_draining(clock: ManualClock) -> None:
    """``draining`` is published as a JSON boolean (routing signals, admin state): never null."""
    a = Admission(small_policy(), clock)
    assert a.draining is False
    a.drain()
    assert a.draining is True
    assert a.situation().draining is True


def test_the_hold_queue_compacts_exactly_past_twice_the_held_plus_16(clock: ManualClock) -> None:
    """Handles that left stay in the heap (lazy removal) until it holds more than 2 x held + 16: the
    memory bound, at its documented limit."""
    a = Admission(small_policy(hold__max_held=100), clock)
    a.update_snapshot(snapshot(clock(), free_bytes=0))
    keep = [submit(a, demand.build(a.rules, 10, arrived_at=clock())) for _ in range(3)]
    for _ in range(19):
        submit(a, demand.build(a.rules, 10, arrived_at=clock())).end(Outcome.CLIENT_GONE)
    assert len(a._queue.items) == 22  # 2 x 3 + 16: not yet
    submit(a, demand.build(a.rules, 10, arrived_at=clock())).end(Outcome.CLIENT_GONE)
    assert a._queue.items == sorted(keep) and all(h.held for h in keep)
