"""The hold queue at scale (issue #27): its structure, and a pump that costs what it can admit.

Pure and fast: a manual clock, no sockets. The controller's pump decides held requests only up to the
first one still held when the rules hold behind it (``core.decide.holds_behind``); the equivalence test
drives the same random traffic through that pump and through one that decides every held request at
every event (the old pump), and asserts that every request got the same decisions at the same instants.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from sidecar.admission import controller
from sidecar.admission.controller import Admission, Handle, Outcome
from sidecar.admission.hold_queue import HoldQueue
from sidecar.core import demand
from sidecar.core.decision import Action, Reason
from sidecar.core.snapshot import SourceHealth
from sidecar.signals.engine import EngineScraper, idle_poll_interval
from sidecar.signals.gpu import FileSource, GpuPoller
from tests.conftest import MIB, ManualClock, small_policy, snapshot, submit, with_engine
from tests.test_core import Log, lane, one_mib

# -- the structure ------------------------------------------------------------------------------------


@dataclass(eq=False)
class Item:
    sort_key: tuple[int, int]
    held: bool = True

    def __lt__(self, other: Item) -> bool:
        return self.sort_key < other.sort_key


def queue_of(*keys: tuple[int, int]) -> tuple[HoldQueue[Item], list[Item]]:
    q: HoldQueue[Item] = HoldQueue()
    items = [Item(k) for k in keys]
    for i, it in enumerate(items):
        q.push(it, arrived_at=float(i))
    return q, items


def test_priority_then_arrival_whatever_the_push_order() -> None:
    q, items = queue_of((1, 0), (0, 1), (1, 2), (-1, 3), (0, 4))
    assert [it.sort_key for it in q.walk()] == [(-1, 3), (0, 1), (0, 4), (1, 0), (1, 2)]
    assert q.head() is items[3] and q.live == 5


def test_the_walk_is_lazy_skips_the_gone_and_stops_when_pushed_to() -> None:
    q, items = queue_of(*((0, i) for i in range(5)))
    items[1].held = False
    walk = q.walk()
    assert next(walk) is items[0] and next(walk) is items[2]
    items[3].held = False  # left during the walk
    assert next(walk) is items[4]
    walk = q.walk()
    assert next(walk) is items[0]
    q.push(Item((0, 9)), arrived_at=9.0)
    assert list(walk) == []  # the indices moved under it: the caller walks again


def test_the_head_drops_the_gone_and_the_oldest_arrival_follows_the_live() -> None:
    q, items = queue_of((0, 0), (0, 1), (0, 2))
    assert q.oldest_arrival() == 0.0
    items[0].held = items[1].held = False
    q.left()
    q.left()
    assert q.head() is items[2] and q.items == [items[2]]
    assert q.oldest_arrival() == 2.0
    items[2].held = False
    q.left()
    assert q.head() is None and q.oldest_arrival() is None


def test_the_queue_and_its_arrivals_compact() -> None:
    q: HoldQueue[Item] = HoldQueue()
    keep = Item((0, 0))
    q.push(keep, 0.0)
    for i in range(1, 200):
        it = Item((0, i))
        q.push(it, float(i))
        it.held = False
        q.left()
    assert len(q.items) <= 2 * q.live + 16 and len(q._arrivals) <= 2 * q.live + 16
    assert list(q.walk()) == [keep] and q.oldest_arrival() == 0.0


# -- the pump ------------------------------------------------------------------------------------------


class Counted:
    """``controller.decide`` with a count of its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.inner = controller.decide

    def __call__(self, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        self.calls += 1
        return self.inner(*args, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counted:
    c = Counted()
    monkeypatch.setattr(controller, "decide", c)
    return c


def test_a_release_decides_the_head_not_the_whole_queue(clock: ManualClock, counted: Counted) -> None:
    a, _ = lane(clock, free_mib=1, hold__max_held=1000, hold__max_wait_s=60)
    first = submit(a, one_mib(a))
    held = [submit(a, one_mib(a, rid=str(i))) for i in range(500)]
    assert all(h.held for h in held)
    counted.calls = 0
    first.end(Outcome.COMPLETED)  # room for one: the head goes, the next is held, the pass stops
    assert held[0].admitted and held[1].held and counted.calls <= 3
    counted.calls = 0
    a.update_snapshot(snapshot(clock(), free_bytes=MIB))  # a poll, nothing new: the head only
    assert counted.calls <= 2
    for i in range(499):  # the queue drains one by one at a cost per event that does not grow
        counted.calls = 0
        held[i].end(Outcome.COMPLETED)
        assert held[i + 1].admitted and counted.calls <= 3


def test_deadlines_behind_the_head_still_time_out_each_at_its_own(clock: ManualClock) -> None:
    a, _ = lane(clock, free_mib=0, hold__max_held=100, hold__max_wait_s=30)
    early = [submit(a, one_mib(a)) for _ in range(3)]
    clock.advance(10)
    late = [submit(a, one_mib(a)) for _ in range(3)]
    clock.advance(20)
    assert all(h.outcome is Outcome.REJECTED for h in early)
    assert all(h.decision is not None and h.decision.reason is Reason.HOLD_TIMEOUT for h in early)
    assert all(h.held for h in late) and a.held == 3
    clock.advance(10)
    assert a.held == 0 and clock.pending == 0


def test_what_can_refuse_a_request_behind_the_head_is_decided_for_all(clock: ManualClock) -> None:
    """An engine that reports a shorter context makes a long request behind the head unfit at that poll."""
    a, _ = lane(clock, free_mib=0, hold__max_held=100)
    submit(a, one_mib(a))
    long = submit(a, demand.build(a.rules, 9000, arrived_at=clock(), exact=True))
    assert long.held
    a.update_snapshot(with_engine(snapshot(clock(), free_bytes=0), context_len=8000))
    assert long.outcome is Outcome.REJECTED and long.decision is not None
    assert long.decision.reason is Reason.UNFIT_REQUEST


@pytest.mark.parametrize("policy", [{"hold__backfill": True}, {"vram__on_exceed": "reject"}])
def test_a_policy_that_does_not_hold_behind_decides_every_held_request(
    clock: ManualClock, counted: Counted, policy: dict[str, object]
) -> None:
    a, _ = lane(clock, free_mib=0, hold__max_held=100, engine_queue__max_requests=1, **policy)
    a.update_snapshot(with_engine(snapshot(clock(), free_bytes=100 * MIB), queue_requests=1))
    held = [submit(a, one_mib(a)) for _ in range(20)]
    assert all(h.held for h in held)
    counted.calls = 0
    a.update_snapshot(with_engine(snapshot(clock(), free_bytes=100 * MIB), queue_requests=1))
    assert counted.calls >= 20


def test_after_a_pass_over_the_whole_queue_the_next_event_decides_the_head_only(
    clock: ManualClock, counted: Counted
) -> None:
    """A new engine shape decides every held request once (one may have become unfit); the polls after
    it, with that shape, cost the head again, not the queue."""
    a, _ = lane(clock, free_mib=1, hold__max_held=1000, hold__max_wait_s=60)
    submit(a, one_mib(a))
    held = [submit(a, one_mib(a, rid=str(i))) for i in range(300)]
    counted.calls = 0
    a.update_snapshot(with_engine(snapshot(clock(), free_bytes=MIB), context_len=50_000))
    assert counted.calls >= 300 and all(h.held for h in held)
    for _ in range(3):
        counted.calls = 0
        a.update_snapshot(with_engine(snapshot(clock(), free_bytes=MIB), context_len=50_000))
        assert counted.calls <= 2


def test_the_head_timing_out_lets_the_one_behind_it_in_at_that_instant(clock: ManualClock) -> None:
    """Held behind a request that does not fit, a small one that does waits in order; when the head's
    deadline comes it is refused, and the small one goes in then, not at the next poll or its own
    deadline. (Signals that stay fresh for a minute: no poll in between.)"""
    fresh = dict(engine__max_age_s=60, gpu__max_age_s=60)
    a, log = lane(clock, free_mib=3, cost__context_bytes_per_token=1024, hold__max_wait_s=30, **fresh)
    big = submit(a, demand.build(a.rules, 5000, arrived_at=clock(), request_id="big"))  # 6,000 KiB
    clock.advance(10)
    small = submit(a, demand.build(a.rules, 1000, arrived_at=clock(), request_id="small"))  # 2,000 KiB
    assert big.held and small.held and small.decision is not None
    assert small.decision.reason is Reason.VRAM_HEADROOM  # the head's reason: strict order
    clock.advance(20)
    assert big.outcome is Outcome.REJECTED and big.decision is not None
    assert big.decision.reason is Reason.HOLD_TIMEOUT
    assert small.admitted and small.waited_s == 20
    assert log.decisions[-2:] == [
        (Action.REJECT, Reason.HOLD_TIMEOUT, "big", 30.0, 0),
        (Action.ADMIT, None, "small", 20.0, 1),
    ]


def test_a_request_submitted_from_a_callback_during_a_pump_does_not_stop_it(clock: ManualClock) -> None:
    """A shell that submits from a held request's callback (a retry forwarded at once) pushes onto the
    queue under the walk: the pump walks again from the head, and what fits still goes in at that event.
    1,024 KiB of room: one request of 1,000 KiB admitted, three of 500 held behind it."""
    a, _ = lane(clock, free_mib=1, hold__max_held=10)
    first = submit(a, one_mib(a, "first"))
    later: list[Handle] = []

    def retry(h: Handle) -> None:
        later.append(submit(a, demand.build(a.rules, 500, arrived_at=clock(), request_id="c")))

    x, y = a.open(), a.open()
    x.submit(demand.build(a.rules, 500, arrived_at=clock(), request_id="x"), retry)
    y.submit(demand.build(a.rules, 500, arrived_at=clock(), request_id="y"), lambda h: None)
    assert x.held and y.held
    first.end(Outcome.COMPLETED)  # room for two of 500: x, then y, the retry held behind them
    (c,) = later
    assert x.admitted and y.admitted and c.held
    assert a.ledger.totals.requests == 2 and a.held == 1


def test_drain_refuses_every_held_request(clock: ManualClock) -> None:
    a, _ = lane(clock, free_mib=0, hold__max_held=100)
    held = [submit(a, one_mib(a)) for _ in range(50)]
    a.drain()
    assert all(h.decision is not None and h.decision.reason is Reason.DRAINING for h in held) and a.held == 0


def _traffic(seed: int, whole: bool, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str, float]]:
    """Random arrivals, priorities, sizes, ends, departures and polls; what each request was told when."""
    if whole:
        monkeypatch.setattr(controller, "holds_behind", lambda rules: False)
    else:
        monkeypatch.undo()
    rng = random.Random(seed)
    clock = ManualClock(5000.0)
    log = Log()
    a = Admission(small_policy(hold__max_held=40, hold__max_wait_s=5), clock, observer=log)
    a.update_snapshot(snapshot(clock(), free_bytes=2 * MIB))
    handles: list[Handle] = []
    for i in range(400):
        r = rng.random()
        if r < 0.45:
            tokens = rng.choice((100, 500, 1000, 1500))
            d = demand.build(
                a.rules, tokens, arrived_at=clock(), request_id=str(i), priority=rng.randint(0, 2)
            )
            handles.append(submit(a, d))
        elif r < 0.7:
            live = [h for h in handles if h.admitted and not h.ended]
            if live:
                rng.choice(live).end(Outcome.COMPLETED)
        elif r < 0.78:
            held = [h for h in handles if h.held]
            if held:
                rng.choice(held).end(Outcome.CLIENT_GONE)
        elif r < 0.9:
            clock.advance(rng.choice((0.05, 0.5, 2.0)))
        else:
            a.update_snapshot(snapshot(clock(), free_bytes=rng.choice((1, 2, 3)) * MIB))
    clock.advance(10)
    for h in handles:
        h.end(Outcome.COMPLETED)
    assert a.held == 0 and a.ledger.totals.requests == 0
    return sorted((rid, act.value, str(reason), waited) for act, reason, rid, waited, _ in log.decisions)


@pytest.mark.parametrize("seed", range(6))
def test_the_pump_that_stops_at_the_head_decides_as_the_one_that_walks_all(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = _traffic(seed, True, monkeypatch)
    head_only = _traffic(seed, False, monkeypatch)
    assert head_only == whole
    assert any(act == Action.HOLD.value for _, act, _, _ in whole)
    assert any(reason == Reason.HOLD_TIMEOUT.value for _, _, reason, _ in whole)


# -- idle: the pollers back off while nothing happens ------------------------------------------------


def test_quiet_after_a_poll_interval_of_nothing_and_ended_by_the_next_request(clock: ManualClock) -> None:
    a, _ = lane(clock, free_mib=1)  # engine.poll_interval_s: 0.5
    woken: list[int] = []
    a.on_busy = lambda: woken.append(1)
    assert not a.quiet()
    clock.advance(0.5)
    assert a.quiet()
    h = a.open()  # intake ends it at once: the pollers are woken
    assert woken == [1] and not a.quiet()
    h.submit(one_mib(a))
    clock.advance(5)
    assert h.admitted and not a.quiet(), "quiet with a request admitted"
    h.end(Outcome.COMPLETED)
    assert not a.quiet()
    clock.advance(0.5)
    assert a.quiet() and woken == [1]
    held = submit(a, demand.build(a.rules, 5000, arrived_at=clock()))
    clock.advance(5)
    assert held.held and not a.quiet(), "quiet with a request held"


def test_a_sidecar_that_never_went_quiet_wakes_nobody(clock: ManualClock) -> None:
    """The first requests after start end no quiet spell (the pollers never slowed down): nothing to
    wake, no read sooner than the interval."""
    a, _ = lane(clock, free_mib=1)
    woken: list[int] = []
    a.on_busy = lambda: woken.append(1)
    h = a.open()
    h.submit(one_mib(a))
    assert h.admitted and woken == []


def test_an_admission_ends_quiet_too(clock: ManualClock) -> None:
    """A request opened before the pollers went quiet and admitted after: the admission wakes them."""
    a, _ = lane(clock, free_mib=1)
    h = a.open()
    woken: list[int] = []
    a.on_busy = lambda: woken.append(1)
    a.quiet()
    clock.advance(0.5)
    assert a.quiet()
    h.submit(one_mib(a))
    assert h.admitted and woken == [1]


@pytest.mark.parametrize(
    ("interval", "max_age", "ceiling", "idle"),
    [(0.5, 30, 5.0, 5.0), (0.5, 5, 5.0, 2.5), (0.1, 2, 0.5, 0.5), (1.0, 1.5, 5.0, 1.0)],
)
def test_the_idle_interval_stays_within_half_the_max_age_and_never_below_the_interval(
    interval: float, max_age: float, ceiling: float, idle: float
) -> None:
    assert idle_poll_interval(interval, max_age, ceiling) == idle


def test_the_pollers_read_their_idle_interval_only_while_idle() -> None:
    idle = [False]
    for poller in (
        EngineScraper("http://127.0.0.1:9", interval_s=0.5),
        GpuPoller(FileSource(Path("x")), interval_s=0.5),
    ):
        assert poller.current_interval_s() == 0.5  # no idle interval wired
        poller.idle, poller.idle_interval_s = lambda: idle[0], 4.0
        assert poller.current_interval_s() == 0.5
        idle[0] = True
        assert poller.current_interval_s() == 4.0
        idle[0] = False


def test_a_failing_signal_is_read_at_its_interval(clock: ManualClock) -> None:
    """Failures are news (engine_unavailable after so many, and the recovery): no backing off."""
    a, _ = lane(clock, free_mib=1)
    clock.advance(0.5)
    assert a.quiet()
    failing = SourceHealth(last_ok_at=clock(), last_error="connection refused", consecutive_failures=1)
    a.update_snapshot(replace(a.snapshot, engine_health=failing))
    clock.advance(5)
    assert not a.quiet()
    a.update_snapshot(replace(a.snapshot, engine_health=SourceHealth(last_ok_at=clock())))
    clock.advance(0.5)
    assert a.quiet()
