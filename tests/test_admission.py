"""The admission controller: atomic check-and-charge, the hold queue, one outcome per request."""

from __future__ import annotations

from collections import Counter

from sidecar.admission import Admission, Outcome, Rejection, Ticket, Waiter
from sidecar.core.decision import Action, Decision, Reason
from sidecar.core.demand import Demand
from sidecar.core.ledger import LedgerTotals
from tests.conftest import MIB, ManualClock, ask, small_policy, snapshot


class Recorder:
    """A real Observer that keeps what it is told."""

    def __init__(self) -> None:
        self.decisions: list[tuple[Action, Reason | None]] = []
        self.outcomes: Counter[Outcome] = Counter()

    def decision(self, d: Decision, cost: Demand, waited_s: float, ledger: LedgerTotals) -> None:
        self.decisions.append((d.action, d.reason))

    def outcome(self, outcome: Outcome) -> None:
        self.outcomes[outcome] += 1


def make(clock: ManualClock, free_mib: int = 10, shadow: bool = False, **overrides: object):
    rec = Recorder()
    a = Admission(small_policy(**overrides), clock, shadow=shadow, observer=rec)
    a.update_snapshot(snapshot(clock(), free_bytes=free_mib * MIB))
    return a, rec


def cost_1mib(a: Admission, priority: int = 0) -> Demand:
    return ask(a, 1000, priority=priority)  # one 1000-token chunk at 1 KiB/token = 1000 KiB


def test_burst_admits_exactly_n(clock: ManualClock) -> None:
    """50 arrive in the same instant with room for exactly 10: 10 tickets, the rest held or rejected."""
    a, _ = make(clock, free_mib=10)
    results = [a.submit(cost_1mib(a), lambda r: None) for _ in range(50)]
    tickets = [r for r in results if isinstance(r, Ticket)]
    assert len(tickets) == 10
    assert a.ledger.totals.requests == 10
    assert sum(isinstance(r, Waiter) for r in results) == 10  # max_held
    assert sum(isinstance(r, Rejection) and r.reason is Reason.QUEUE_FULL for r in results) == 30


def test_release_lets_the_next_waiter_in_and_ledger_returns_to_zero(clock: ManualClock) -> None:
    a, rec = make(clock, free_mib=1)
    admitted: list[Ticket | Rejection] = []
    first = a.submit(cost_1mib(a), admitted.append)
    second = a.submit(cost_1mib(a), admitted.append)
    assert isinstance(first, Ticket) and isinstance(second, Waiter)
    clock.advance(1.5)
    first.prefill_done()  # the first token frees the prefill's share
    assert len(admitted) == 1 and isinstance(admitted[0], Ticket)
    assert admitted[0].waited_s == 1.5
    first.finish(Outcome.COMPLETED)
    admitted[0].finish(Outcome.COMPLETED)
    first.finish(Outcome.CLIENT_GONE)  # a second end is ignored: exactly one outcome per request
    assert a.ledger.totals == LedgerTotals()
    assert rec.outcomes == Counter({Outcome.COMPLETED: 2})


def test_strict_order_newcomer_waits_behind_held_request(clock: ManualClock) -> None:
    a, _ = make(clock, free_mib=1)
    big = ask(a, 1000)
    t = a.submit(big, lambda r: None)
    assert isinstance(t, Ticket)
    waiting_big = a.submit(big, lambda r: None)
    assert isinstance(waiting_big, Waiter)
    # A small request would fit in what is left, but an earlier request is waiting: no overtaking.
    tiny = ask(a, 10)
    assert isinstance(a.submit(tiny, lambda r: None), Waiter)


def test_backfill_lets_small_requests_pass(clock: ManualClock) -> None:
    a, _ = make(clock, free_mib=1, hold__backfill=True)
    a.submit(ask(a, 1000), lambda r: None)
    assert isinstance(a.submit(ask(a, 1000), lambda r: None), Waiter)
    assert isinstance(a.submit(ask(a, 10), lambda r: None), Ticket)


def test_priority_orders_the_queue(clock: ManualClock) -> None:
    a, _ = make(clock, free_mib=1)
    t = a.submit(cost_1mib(a), lambda r: None)
    order: list[int] = []
    for prio in (0, 5, 1):
        a.submit(cost_1mib(a, prio), lambda r, p=prio: order.append(p))
    assert isinstance(t, Ticket)
    t.finish(Outcome.COMPLETED)
    assert order == [5]  # larger value first (SGLang's default); room for one at a time


def test_client_leaving_while_held_is_removed_and_counted(clock: ManualClock) -> None:
    a, rec = make(clock, free_mib=1)
    t = a.submit(cost_1mib(a), lambda r: None)
    w = a.submit(cost_1mib(a), lambda r: None)
    assert isinstance(w, Waiter) and a.held == 1
    a.cancel(w)
    a.cancel(w)  # idempotent
    assert a.held == 0
    assert rec.outcomes[Outcome.CLIENT_GONE] == 1
    assert isinstance(t, Ticket)
    t.finish(Outcome.COMPLETED)
    assert a.ledger.totals == LedgerTotals()


def test_hold_timeout(clock: ManualClock) -> None:
    a, rec = make(clock, free_mib=1)
    a.submit(cost_1mib(a), lambda r: None)
    got: list[Ticket | Rejection] = []
    a.submit(cost_1mib(a), got.append)
    clock.advance(29.9)
    a.expire()
    assert got == []
    clock.advance(0.1)
    a.expire()
    assert len(got) == 1 and isinstance(got[0], Rejection)
    assert got[0].reason is Reason.HOLD_TIMEOUT and got[0].waited_s == 30
    assert got[0].decision.retry_after_s is not None and got[0].decision.retry_after_s >= 1
    assert rec.outcomes[Outcome.REJECTED] == 1


def test_new_signals_wake_the_queue(clock: ManualClock) -> None:
    a, _ = make(clock, free_mib=0)
    got: list[Ticket | Rejection] = []
    assert isinstance(a.submit(cost_1mib(a), got.append), Waiter)
    a.update_snapshot(snapshot(clock(), free_bytes=5 * MIB))
    assert len(got) == 1 and isinstance(got[0], Ticket)


def test_drain_rejects_new_and_held(clock: ManualClock) -> None:
    a, _ = make(clock, free_mib=0)
    got: list[Ticket | Rejection] = []
    a.submit(cost_1mib(a), got.append)
    a.drain()
    assert isinstance(got[0], Rejection) and got[0].reason is Reason.DRAINING
    r = a.submit(cost_1mib(a), lambda r: None)
    assert isinstance(r, Rejection) and r.reason is Reason.DRAINING


def test_shadow_mode_forwards_everything_but_records_the_real_decision(clock: ManualClock) -> None:
    a, rec = make(clock, free_mib=0, shadow=True)
    r = a.submit(cost_1mib(a), lambda r: None)
    assert isinstance(r, Ticket)
    assert r.shadow_reject is not None and r.shadow_reject.reason is Reason.VRAM_HEADROOM
    assert rec.decisions == [(Action.HOLD, Reason.VRAM_HEADROOM)]
    r.finish(Outcome.COMPLETED)
    assert a.ledger.totals == LedgerTotals()


def test_reentrant_finish_from_a_callback_is_safe(clock: ManualClock) -> None:
    """A waiter whose callback ends its ticket at once (replay does this) must not corrupt the queue."""
    a, rec = make(clock, free_mib=1)
    first = a.submit(cost_1mib(a), lambda r: None)
    for _ in range(5):
        a.submit(cost_1mib(a), lambda r: r.finish(Outcome.COMPLETED) if isinstance(r, Ticket) else None)
    assert isinstance(first, Ticket)
    first.finish(Outcome.COMPLETED)
    assert a.held == 0
    assert rec.outcomes[Outcome.COMPLETED] == 6
    assert a.ledger.totals == LedgerTotals()


def test_every_request_has_exactly_one_outcome(clock: ManualClock) -> None:
    """A mixed run: admitted, held then admitted, held then cancelled, timed out, queue full."""
    a, rec = make(clock, free_mib=2)
    tickets: list[Ticket] = []
    waiters: list[Waiter] = []

    def collect(r: Ticket | Rejection) -> None:
        if isinstance(r, Ticket):
            tickets.append(r)

    n = 40
    for i in range(n):
        r = a.submit(cost_1mib(a), collect)
        if isinstance(r, Ticket):
            tickets.append(r)
        elif isinstance(r, Waiter):
            waiters.append(r)
        if i % 7 == 0 and waiters:
            a.cancel(waiters.pop(0))
        if i % 5 == 0 and tickets:
            tickets.pop(0).finish(Outcome.COMPLETED)
    clock.advance(31)
    a.expire()
    while tickets:
        tickets.pop(0).finish(Outcome.COMPLETED)
    assert sum(rec.outcomes.values()) == n
    assert a.held == 0
    assert a.ledger.totals == LedgerTotals()
