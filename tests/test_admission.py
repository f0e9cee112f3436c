"""The admission controller: atomic check-and-charge, the hold queue, one outcome per request."""

from __future__ import annotations

from collections import Counter

from sidecar.admission.controller import Admission, Handle, Outcome
from sidecar.core.decision import Action, Decision, Reason
from sidecar.core.demand import Demand
from sidecar.core.ledger import LedgerTotals
from tests.conftest import MIB, ManualClock, ask, small_policy, snapshot, submit


class Recorder:
    """A real Observer that keeps what it is told."""

    def __init__(self) -> None:
        self.decisions: list[tuple[Action, Reason | None]] = []
        self.outcomes: Counter[Outcome] = Counter()

    def decision(self, d: Decision, demand: Demand, waited_s: float, ledger: LedgerTotals) -> None:
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
    """50 arrive in the same instant with room for exactly 10: 10 admitted, the rest held or rejected."""
    a, _ = make(clock, free_mib=10)
    handles = [submit(a, cost_1mib(a)) for _ in range(50)]
    assert sum(h.admitted for h in handles) == 10
    assert a.ledger.totals.requests == 10
    assert sum(h.held for h in handles) == 10  # max_held
    rejected = [h for h in handles if h.outcome is Outcome.REJECTED]
    assert len(rejected) == 30 and all(
        h.decision and h.decision.reason is Reason.QUEUE_FULL for h in rejected
    )


def test_release_lets_the_next_waiter_in_and_ledger_returns_to_zero(clock: ManualClock) -> None:
    a, rec = make(clock, free_mib=1)
    answered: list[Handle] = []
    first = submit(a, cost_1mib(a), answered)
    second = submit(a, cost_1mib(a), answered)
    assert first.admitted and second.held
    clock.advance(1.5)
    first.prefill_done()  # the first token frees the prefill's share
    assert answered == [second] and second.admitted
    assert second.waited_s == 1.5
    first.end(Outcome.COMPLETED)
    second.end(Outcome.COMPLETED)
    first.end(Outcome.CLIENT_GONE)  # a second end is ignored: exactly one outcome per request
    assert a.ledger.totals == LedgerTotals()
    assert rec.outcomes == Counter({Outcome.COMPLETED: 2})


def test_strict_order_newcomer_waits_behind_held_request(clock: ManualClock) -> None:
    a, _ = make(clock, free_mib=1)
    assert submit(a, ask(a, 1000)).admitted
    waiting_big = submit(a, ask(a, 1000))
    assert waiting_big.held
    # A small request would fit in what is left, but an earlier request is waiting: no overtaking.
    tiny = submit(a, ask(a, 10))
    assert tiny.held and tiny.decision is not None and tiny.decision.reason is Reason.VRAM_HEADROOM


def test_backfill_lets_small_requests_pass(clock: ManualClock) -> None:
    a, _ = make(clock, free_mib=1, hold__backfill=True)
    submit(a, ask(a, 1000))
    assert submit(a, ask(a, 1000)).held
    assert submit(a, ask(a, 10)).admitted


def test_priority_orders_the_queue(clock: ManualClock) -> None:
    a, _ = make(clock, free_mib=1)
    t = submit(a, cost_1mib(a))
    order: list[int] = []
    for prio in (0, 5, 1):
        a.open().submit(cost_1mib(a, prio), lambda h, p=prio: order.append(p))
    assert t.admitted
    t.end(Outcome.COMPLETED)
    assert order == [5]  # larger value first (SGLang's default); room for one at a time


def test_retry_after_counts_every_held_request_in_front_once(clock: ManualClock) -> None:
    """Three held behind one admitted (1000 tokens each, 1000 tok/s): as each times out, the work that
    must drain is the ledger's 1000, the others still held, and its own 1000, each counted once."""
    a, _ = make(clock, free_mib=1)
    submit(a, cost_1mib(a))
    answered: list[Handle] = []
    held = [submit(a, cost_1mib(a), answered) for _ in range(3)]
    assert all(h.held for h in held)
    clock.advance(30)
    assert answered == held
    assert [h.decision.retry_after_s for h in held if h.decision is not None] == [4, 3, 2]


def test_client_leaving_while_held_is_removed_and_counted(clock: ManualClock) -> None:
    a, rec = make(clock, free_mib=1)
    t = submit(a, cost_1mib(a))
    w = submit(a, cost_1mib(a))
    assert w.held and a.held == 1
    w.end(Outcome.CLIENT_GONE)
    w.end(Outcome.CLIENT_GONE)  # idempotent
    assert a.held == 0 and not w.held
    assert rec.outcomes[Outcome.CLIENT_GONE] == 1
    assert t.admitted
    t.end(Outcome.COMPLETED)
    assert a.ledger.totals == LedgerTotals()


def test_hold_timeout_fires_on_the_injected_clock(clock: ManualClock) -> None:
    a, rec = make(clock, free_mib=1)
    submit(a, cost_1mib(a))
    answered: list[Handle] = []
    w = submit(a, cost_1mib(a), answered)
    clock.advance(29.9)
    assert answered == [] and w.held
    clock.advance(0.1)  # the deadline's timer, scheduled on the same clock, fires: nothing else runs
    assert answered == [w] and w.outcome is Outcome.REJECTED
    assert w.decision is not None and w.decision.reason is Reason.HOLD_TIMEOUT and w.waited_s == 30
    # The admitted request's 1000 prefill tokens ahead (ledger) plus its own 1000, at 1000 tok/s: 2 s.
    assert w.decision.retry_after_s == 2
    assert rec.outcomes[Outcome.REJECTED] == 1
    assert clock.pending == 0


def test_new_signals_wake_the_queue(clock: ManualClock) -> None:
    a, _ = make(clock, free_mib=0)
    answered: list[Handle] = []
    h = submit(a, cost_1mib(a), answered)
    assert h.held
    a.update_snapshot(snapshot(clock(), free_bytes=5 * MIB))
    assert answered == [h] and h.admitted
    assert clock.pending == 0, "an admitted request's deadline timer must be cancelled"


def test_drain_rejects_new_and_held(clock: ManualClock) -> None:
    a, _ = make(clock, free_mib=0)
    answered: list[Handle] = []
    held = submit(a, cost_1mib(a), answered)
    a.drain()
    assert answered == [held] and held.decision is not None and held.decision.reason is Reason.DRAINING
    late = submit(a, cost_1mib(a))
    assert late.outcome is Outcome.REJECTED and late.decision is not None
    assert late.decision.reason is Reason.DRAINING


def test_shadow_mode_forwards_everything_but_records_the_real_decision(clock: ManualClock) -> None:
    a, rec = make(clock, free_mib=0, shadow=True)
    h = submit(a, cost_1mib(a))
    assert h.admitted
    assert h.shadow_reject is not None and h.shadow_reject.reason is Reason.VRAM_HEADROOM
    assert rec.decisions == [(Action.HOLD, Reason.VRAM_HEADROOM)]
    assert a.ledger.totals.requests == 1
    h.end(Outcome.COMPLETED)
    assert a.ledger.totals == LedgerTotals()


def test_reentrant_end_from_a_callback_is_safe(clock: ManualClock) -> None:
    """A waiter whose callback ends its handle at once (replay does this) must not corrupt the queue."""
    a, rec = make(clock, free_mib=1)
    first = submit(a, cost_1mib(a))
    for _ in range(5):
        a.open().submit(cost_1mib(a), lambda h: h.end(Outcome.COMPLETED))
    assert first.admitted
    first.end(Outcome.COMPLETED)
    assert a.held == 0
    assert rec.outcomes[Outcome.COMPLETED] == 6
    assert a.ledger.totals == LedgerTotals()


def test_every_request_has_exactly_one_outcome(clock: ManualClock) -> None:
    """A mixed run: admitted, held then admitted, held then cancelled, timed out, queue full."""
    a, rec = make(clock, free_mib=2)
    admitted: list[Handle] = []
    waiting: list[Handle] = []
    n = 40
    for i in range(n):
        h = a.open()
        h.submit(cost_1mib(a), lambda h: admitted.append(h) if h.admitted else None)
        if h.admitted:
            admitted.append(h)
        elif h.held:
            waiting.append(h)
        if i % 7 == 0 and waiting:
            waiting.pop(0).end(Outcome.CLIENT_GONE)
        if i % 5 == 0 and admitted:
            admitted.pop(0).end(Outcome.COMPLETED)
    clock.advance(31)
    while admitted:
        admitted.pop(0).end(Outcome.COMPLETED)
    assert sum(rec.outcomes.values()) == n
    assert a.held == 0
    assert a.ledger.totals == LedgerTotals()
    assert clock.pending == 0


# -- reads sooner than the poll interval after an admitted request ends (Admission.report_wanted) --


def running(a: Admission, clock: ManualClock) -> Handle:
    """A 60,000-token request past its first token, as the engine's report shows it then."""
    h = submit(a, ask(a, 60_000))
    assert h.admitted
    h.prefill_done()
    a.update_snapshot(
        snapshot(clock(), free_bytes=10 * MIB, kv_available_tokens=40_000, kv_used_tokens=60_000)
    )
    return h


def test_an_end_while_a_request_is_held_asks_for_a_report_for_one_poll_interval(clock: ManualClock) -> None:
    """What an ended request held shows only in a report read after its end: while a request waits,
    the shell is asked to read sooner, for one engine poll interval (0.5 s here), not longer."""
    a, _ = make(clock)
    asked: list[float] = []
    a.on_report_wanted = lambda: asked.append(clock())
    first = running(a, clock)
    held = submit(a, ask(a, 60_000))
    assert held.held and held.decision is not None and held.decision.reason is Reason.KV_POOL
    assert not a.report_wanted() and asked == []  # nothing ended yet: no report can show more
    clock.advance(1.0)
    first.end(Outcome.COMPLETED)
    assert held.held  # the report in hand still shows the first request's KV
    assert asked == [clock()] and a.report_wanted()
    clock.advance(0.4999)
    assert a.report_wanted()
    clock.advance(0.0001)
    assert not a.report_wanted()  # the periodic poll has read the engine since
    a.update_snapshot(snapshot(clock(), free_bytes=10 * MIB))
    assert held.admitted


def test_nothing_held_or_nothing_admitted_ended_asks_for_no_report(clock: ManualClock) -> None:
    a, _ = make(clock)
    asked: list[float] = []
    a.on_report_wanted = lambda: asked.append(clock())
    alone = submit(a, ask(a, 1000))
    alone.end(Outcome.COMPLETED)
    assert asked == [] and not a.report_wanted()  # nobody waits: the next poll is soon enough
    clock.advance(10)
    a.update_snapshot(snapshot(clock(), free_bytes=10 * MIB))
    running(a, clock)
    waiting = submit(a, ask(a, 60_000))
    assert waiting.held and asked == []  # the last end was 10 s ago: reports since show it
    gone = submit(a, ask(a, 60_000))
    gone.end(Outcome.CLIENT_GONE)  # a held request leaving released nothing in the engine
    assert asked == [] and not a.report_wanted()


def test_a_request_held_just_after_an_end_asks_for_a_report(clock: ManualClock) -> None:
    """A round of requests arriving at the instant the last one ended: the report in hand predates
    the end, so the first one held asks for a read (nothing was held at the end itself)."""
    a, _ = make(clock)
    asked: list[float] = []
    a.on_report_wanted = lambda: asked.append(clock())
    last = running(a, clock)
    clock.advance(1.0)
    last.end(Outcome.COMPLETED)
    assert asked == []
    clock.advance(0.1)
    small = submit(a, ask(a, 1000))
    assert small.admitted and asked == []  # admitted: no wait, no read
    waiting = submit(a, ask(a, 60_000))
    assert waiting.held and asked == [clock()]


# -- the handle as the shell holds it: one outcome, decided on exit ---------------------------------------


def test_a_handle_left_before_submitting_is_a_refused_body_or_a_client_gone(clock: ManualClock) -> None:
    import asyncio

    from sidecar.admission.controller import ClientGone

    a, rec = make(clock)
    with a.open():
        pass  # answered 400/413/415 here: never reached the gate
    for gone in (ClientGone(), asyncio.CancelledError()):
        try:
            with a.open():
                raise gone
        except (ClientGone, asyncio.CancelledError):
            pass
    assert rec.outcomes == Counter({Outcome.BAD_REQUEST: 1, Outcome.CLIENT_GONE: 2})


def test_an_admitted_handle_completes_only_once_relayed_and_releases_on_any_exit(clock: ManualClock) -> None:
    a, rec = make(clock)
    with a.open() as h:
        assert h.submit(cost_1mib(a)) is Action.ADMIT
        h.prefill_done()
        h.relayed()
    with a.open() as h:
        h.submit(cost_1mib(a))  # the engine failed, answered here with a 502: not relayed
    try:
        with a.open() as h:
            h.submit(cost_1mib(a))
            raise RuntimeError("broke mid-stream")
    except RuntimeError:
        pass
    assert rec.outcomes == Counter({Outcome.COMPLETED: 1, Outcome.UPSTREAM_ERROR: 2})
    assert len(a.ledger) == 0 and a.ledger.totals == LedgerTotals()


def test_the_gates_own_outcome_stands_on_exit(clock: ManualClock) -> None:
    a, rec = make(clock, free_mib=0, hold__max_held=0)
    with a.open() as h:
        assert h.submit(cost_1mib(a)) is Action.REJECT
        assert h.outcome is Outcome.REJECTED
    assert rec.outcomes == Counter({Outcome.REJECTED: 1})
