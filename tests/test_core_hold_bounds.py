"""The hold queue's bounds in the core, with the exact numbers a refusal reports: a newcomer refused at
once when the work ahead at the measured prefill rate outlasts its deadline (``decide.expected_wait_s``,
``_expected_late``), only a newcomer that would be held, and the check each hold or refusal names
(``Decision.check``: the ``check`` label of ``held_total``).

Written against the mutants of ``make mutation`` that the rest of the core's tests let through: each
test pins a boundary, a source of the work ahead, or a figure shown to operators and clients (the
check's need, have and note travel in the refusal's body and the decision log). Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import replace

from sidecar.core import demand
from sidecar.core.decide import Situation, decide, expected_wait_s
from sidecar.core.decision import Action, Check, Reason
from sidecar.core.demand import Demand
from sidecar.core.ledger import LedgerTotals
from sidecar.core.rules import Rules
from sidecar.policy.in_force import rules_of
from tests.conftest import small_policy, snapshot

NOW = 1000.0
LATE = "expected wait (work ahead at the measured prefill rate) exceeds hold.max_wait_s"


def rules(**overrides: object) -> Rules:
    return rules_of(small_policy(**overrides).policy)


def ask(r: Rules, prompt_tokens: int = 1000) -> Demand:
    return demand.build(r, prompt_tokens, arrived_at=NOW)  # deadline NOW + 30 s (hold.max_wait_s)


def held_situation(
    r: Rules,
    *,
    rate: float | None = 1000.0,
    pending: int | None = 0,
    held_tokens: int = 0,
    ledger: LedgerTotals | None = None,
    now: float = NOW,
) -> Situation:
    """A lane whose KV pool is full (every newcomer is held for ``kv_pool``), one request held."""
    snap = snapshot(now, pending_prefill_tokens=pending, kv_available_tokens=0)
    return Situation(
        r, snap, ledger or LedgerTotals(), now, held=1, held_tokens=held_tokens, prefill_tokens_per_s=rate
    )


# -- expected_wait_s: the work ahead and the rate -------------------------------------------------------


def test_without_an_engine_report_the_ledger_s_prefill_tokens_are_the_work_ahead() -> None:
    """The engine never read (its report is None): the tokens forwarded are the ledger's alone, and
    nothing forwarded is no wait at all (not one token's)."""
    r = rules()
    blind = Situation(
        r, replace(snapshot(NOW), engine=None), LedgerTotals(), NOW, prefill_tokens_per_s=1000.0
    )
    assert expected_wait_s(blind) == 0.0
    booked = replace(blind, ledger=LedgerTotals(prefill_tokens=2500))
    assert expected_wait_s(booked) == 2.5
    # Under strict order the held requests' tokens are ahead too.
    assert expected_wait_s(replace(booked, held_tokens=500)) == 3.0


def test_an_engine_that_reports_no_pending_count_adds_no_token() -> None:
    """``pending_prefill_tokens`` None (an engine before 0.5.9): the held work alone, exactly 30 s at
    1,000 tokens/s, which is exactly the newcomer's 30 s: parked, not refused."""
    r = rules()
    s = held_situation(r, pending=None, held_tokens=30_000)
    assert expected_wait_s(s) == 30.0
    assert decide(ask(r), s).action is Action.HOLD


def test_a_slow_measured_rate_still_counts() -> None:
    """A lane measured at 1 token/s (a crawling engine) is a measured rate like any other: 40 tokens
    ahead are 40 s, beyond the newcomer's 30 s. Only no rate (or a non-positive one) refuses nobody."""
    r = rules()
    assert expected_wait_s(held_situation(r, rate=1.0, pending=40)) == 40.0
    d = decide(ask(r), held_situation(r, rate=1.0, pending=40))
    assert (d.action, d.reason) == (Action.REJECT, Reason.HOLD_TIMEOUT)
    assert expected_wait_s(held_situation(r, rate=0.0, pending=40)) is None
    assert expected_wait_s(held_situation(r, rate=-5.0, pending=40)) is None


# -- _expected_late: the boundary and the check a refusal reports -------------------------------------


def test_a_wait_that_ends_exactly_at_the_deadline_is_parked() -> None:
    r = rules()
    at_deadline = held_situation(r, pending=30_000)  # 30 s at 1,000 tokens/s: the deadline itself
    d = decide(ask(r), at_deadline)
    assert (d.action, d.reason) == (Action.HOLD, Reason.KV_POOL)
    assert all(c.name != "expected_wait" for c in d.checks)
    over = decide(ask(r), held_situation(r, pending=30_001))
    assert (over.action, over.reason, over.checks[-1].need) == (Action.REJECT, Reason.HOLD_TIMEOUT, 30.001)


def test_the_refusal_reports_the_expected_wait_and_the_time_left_to_three_decimals() -> None:
    """The body and the decision log show need (the expected wait) and have (what is left of the
    deadline), in seconds rounded to the millisecond: 100,001 tokens at 3,000 tokens/s are
    33.333667 s; decided 1.23456 s after arrival, 28.76544 s are left."""
    r = rules()
    s = held_situation(r, rate=3000.0, pending=100_001, now=NOW + 1.23456)
    d = decide(ask(r), s)
    assert (d.action, d.reason, d.check) == (Action.REJECT, Reason.HOLD_TIMEOUT, "hold_timeout")
    assert d.checks[-1] == Check("expected_wait", False, 33.334, 28.765, LATE)
    assert d.retry_after_s == 34  # the work ahead and its own 1,000 tokens: 101,001 / 3,000 s, rounded up


# -- only a newcomer that would be held ------------------------------------------------------------------


def test_a_newcomer_that_fits_is_admitted_whatever_the_work_ahead() -> None:
    """The expected wait refuses a newcomer that would be PARKED; one the constraints admit now waits
    for nothing (40 s of work ahead, its deadline 30 s away)."""
    r = rules()
    s = replace(held_situation(r, pending=40_000), snapshot=snapshot(NOW, pending_prefill_tokens=40_000))
    d = decide(ask(r), s)
    assert (d.action, d.reason, d.check) == (Action.ADMIT, None, None)
    assert all(c.name != "expected_wait" for c in d.checks)


# -- Decision.check: which check held or refused -----------------------------------------------------------


def test_a_queue_full_refusal_names_its_bound() -> None:
    r = rules(hold__max_held=1)
    d = decide(ask(r), held_situation(r))
    assert (d.action, d.reason, d.check) == (Action.REJECT, Reason.QUEUE_FULL, "queue_full")


def test_a_request_past_its_deadline_names_the_timeout() -> None:
    r = rules()
    s = replace(held_situation(r, now=NOW + 30), queued=True)
    d = decide(ask(r), s)
    assert (d.action, d.reason, d.check) == (Action.REJECT, Reason.HOLD_TIMEOUT, "hold_timeout")


def test_a_hold_names_the_check_that_held_it() -> None:
    """``held_total{reason, check}`` counts holds by this name: the constraint's own, or
    ``strict_order`` for one that fits but waits behind an earlier request (its reason that one's)."""
    r = rules()
    full = decide(ask(r), held_situation(r))
    assert (full.action, full.reason, full.check) == (Action.HOLD, Reason.KV_POOL, "kv_pool")
    fits = Situation(r, snapshot(NOW), LedgerTotals(), NOW, held=1, ahead=Reason.VRAM_HEADROOM)
    behind = decide(ask(r), fits)
    assert (behind.action, behind.reason, behind.check) == (Action.HOLD, Reason.VRAM_HEADROOM, "strict_order")
