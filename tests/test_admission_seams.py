"""The admission controller's shell seams, pinned fast on a manual clock: what the hold queue waits
for (the live view), when the pollers may slow down (``quiet``) and what ends it, an engine restart
with work admitted, and strict order kept when held requests are decided again or time out."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from sidecar.admission.controller import Admission, Outcome
from sidecar.core.decision import Reason
from sidecar.core.ledger import LedgerTotals
from sidecar.core.snapshot import SourceHealth
from tests.conftest import MIB, ManualClock, ask, snapshot, submit
from tests.test_admission import make
from tests.test_lane_learning import GIB, failing, gpu, lane

POLL_S = 0.5  # small_policy's engine.poll_interval_s


def test_waiting_for_names_the_first_held_requests_reason_and_bytes(clock: ManualClock) -> None:
    """The live view's "waiting for": nothing while nothing is held, else the head's reason and its
    projected bytes (what must change for the queue to move), not a later request's."""
    a, _ = make(clock, free_mib=1)
    assert a.waiting_for() == (None, None)
    first = submit(a, ask(a, 1000))
    assert first.admitted and a.waiting_for() == (None, None)
    big = submit(a, ask(a, 1000))
    tiny = submit(a, ask(a, 10))
    assert big.held and tiny.held
    assert a.waiting_for() == ("vram_headroom", big.demand.projected_bytes)  # type: ignore[union-attr]
    assert big.demand.projected_bytes == 1000 * 1024  # type: ignore[union-attr]


def test_waiting_for_stale_signals_with_nothing_admitted(clock: ManualClock) -> None:
    """Signals too old hold a request with the ledger empty: the view says so, with its bytes."""
    a, _ = make(clock, free_mib=1)
    clock.advance(6.0)  # past engine.max_age_s
    h = submit(a, ask(a, 1000))
    assert h.held and len(a.ledger) == 0
    assert a.waiting_for() == ("signals_stale", 1000 * 1024)


def test_quiet_after_one_poll_interval_of_nothing_and_not_a_hair_before(clock: ManualClock) -> None:
    """The pollers slow down only after a whole poll interval with nothing opened, admitted, held or
    failing: exactly at the interval it is quiet, just before it is not (reads must not thin early)."""
    a, _ = make(clock)
    assert a.quiet() is False  # the clock is far from zero: elapsed time, not the instant, counts
    clock.advance(POLL_S - 0.001)
    assert a.quiet() is False
    clock.advance(0.001)
    assert a.quiet() is True
    assert a.quiet() is True


def test_an_intake_ends_quiet_at_once_and_restarts_the_interval(clock: ManualClock) -> None:
    """A gated request's intake wakes the pollers (``on_busy``) without a clock read, and the next
    ``quiet`` counts the interval again from then, even though nothing was admitted."""
    a, _ = make(clock)
    woken: list[int] = []
    a.on_busy = lambda: woken.append(1)
    clock.advance(POLL_S)
    assert a.quiet() is True
    h = a.open()  # intake only: nothing submitted, nothing charged
    assert woken == [1] and a._quiet is False
    a.open()
    assert woken == [1]  # already busy: one wake-up
    clock.advance(POLL_S)
    assert a.quiet() is False  # the opens were news: the interval starts now
    clock.advance(POLL_S - 0.001)
    assert a.quiet() is False
    clock.advance(0.001)
    assert a.quiet() is True
    del h


def test_admitted_work_keeps_the_pollers_busy(clock: ManualClock) -> None:
    """A request in the ledger (nothing held) keeps reads at the poll interval: its release is what
    the held ones will wait for."""
    a, _ = make(clock)
    h = submit(a, ask(a, 1000))
    assert h.admitted and a.held == 0
    a.quiet()
    clock.advance(POLL_S * 3)
    assert a.quiet() is False


def test_held_work_keeps_the_pollers_busy(clock: ManualClock) -> None:
    """A held request with the ledger empty (signals stale) keeps reads at the poll interval: the next
    read is what lets it in."""
    a, _ = make(clock)
    clock.advance(6.0)
    h = submit(a, ask(a, 1000))
    assert h.held and len(a.ledger) == 0
    a.quiet()
    clock.advance(POLL_S * 3)
    assert a.quiet() is False


def test_a_failing_engine_or_gpu_source_is_read_at_its_interval(clock: ManualClock) -> None:
    """Either source failing alone keeps the pollers busy (its failures and recovery are news); both
    healthy again, quiet returns one interval later."""
    for field in ("engine_health", "gpu_health"):
        a, _ = make(clock)
        failing = SourceHealth(None, "connection refused", 2)
        a.snapshot = replace(a.snapshot, **{field: failing})
        clock.advance(POLL_S * 3)
        assert a.quiet() is False, field
        a.snapshot = replace(a.snapshot, **{field: SourceHealth()})
        clock.advance(POLL_S)
        assert a.quiet() is True, field


def test_an_admission_ends_quiet(clock: ManualClock) -> None:
    """An admission into an empty ledger wakes the pollers, and ``quiet`` is over until the next
    quiet interval: the admitted request's release must be seen at once."""
    a, _ = make(clock)
    woken: list[int] = []
    a.on_busy = lambda: woken.append(1)
    clock.advance(POLL_S)
    assert a.quiet() is True
    a._quiet = True
    h = a.open()
    assert woken == [1] and a._quiet is False
    a._quiet = True  # quiet said again between intake and admission (a poller asked)
    h.submit(ask(a, 1000))
    assert h.admitted and woken == [1, 1] and a._quiet is False


def test_a_restart_with_work_admitted_is_read_as_a_crash_of_that_set(clock: ManualClock) -> None:
    """The engine restarts with a request still charged (no failed scrape first): that set, as of the
    restart, is the evidence the new process's first report is read against (a crash raises the
    margin), named with the scraper's reason; the GPU reading of the old process is marked blind."""
    a = lane(clock)
    big = submit(a, ask(a, 3000, request_id="big"))
    assert big.admitted
    clock.advance(1.0)
    at = clock.t
    a.engine_restarted("scheduler pid [1] -> [2]")
    assert a.snapshot.engine_restarted_at == at
    assert a.watch.crashes == 0
    clock.advance(0.5)
    a.update_snapshot(gpu(snapshot(clock.t, version="0.5.23"), clock.t, 4 * GIB))
    crash = a.watch.last_crash
    assert a.watch.crashes == 1 and crash is not None
    assert crash.why == "scheduler pid [1] -> [2]"
    assert crash.admitted.at == at and crash.admitted.request_ids == ("big",)
    assert crash.admitted.projected_bytes == 3000 * MIB and crash.admitted.budget_bytes == 4 * GIB
    assert a.rules.cost.margin > 1.0


def test_an_idle_restart_is_no_crash(clock: ManualClock) -> None:
    """Nothing admitted and nothing seen failing: a restart is a restart (a deploy), never a crash
    that raises the margin."""
    a = lane(clock)
    a.engine_restarted("scheduler pid [1] -> [2]")
    assert a.snapshot.engine_restarted_at == clock.t
    clock.advance(0.5)
    a.update_snapshot(gpu(snapshot(clock.t, version="0.5.23"), clock.t, 4 * GIB))
    assert a.watch.crashes == 0 and a.watch.last_crash is None and a.rules.cost.margin == 1.0


def _strict_order(clock: ManualClock) -> tuple[Admission, list]:
    """1 MiB free: one admitted request fills it; ``big`` waits for room, ``tiny`` (which alone would
    fit the 24 KiB left) waits behind it."""
    a, _ = make(clock, free_mib=1)
    first = submit(a, ask(a, 1000))
    big = submit(a, ask(a, 1000))
    tiny = submit(a, ask(a, 10))
    assert first.admitted and big.held and tiny.held
    return a, [first, big, tiny]


def test_strict_order_holds_when_the_queue_is_decided_again(clock: ManualClock) -> None:
    """A new reading decides every held request again, each told why the first one ahead waits: a
    small request that would fit stays behind the big one (no overtaking)."""
    a, (_, big, tiny) = _strict_order(clock)
    clock.advance(0.1)
    a.update_snapshot(snapshot(clock.t, free_bytes=MIB + 1))
    assert big.held and tiny.held
    assert tiny.decision is not None and tiny.decision.reason is Reason.VRAM_HEADROOM


def test_a_timed_out_request_behind_the_head_is_refused_not_let_past_it(clock: ManualClock) -> None:
    """A held request whose deadline comes while one ahead still waits is refused ``hold_timeout``,
    even though it would fit: timing out must not let it overtake the head."""
    a, (_, big, tiny) = _strict_order(clock)
    clock.advance(1.0)
    head = submit(a, ask(a, 1000, priority=1))  # a later deadline, first in the queue
    clock.advance(28.9)
    a.update_snapshot(snapshot(clock.t, free_bytes=MIB))  # fresh signals at the deadline
    assert a._queue.head() is head and tiny.held
    clock.advance(0.1)  # the tiny and big requests' deadline
    for h in (big, tiny):
        assert h.outcome is not None and h.outcome.value == "rejected"
        assert h.decision is not None and h.decision.reason is Reason.HOLD_TIMEOUT
    assert head.held and a.waiting_for() == ("vram_headroom", 1000 * 1024)


def test_a_held_request_failing_upstream_names_no_admitted_set(clock: ManualClock) -> None:
    """Only an admitted request's upstream failure says the engine may be dying with what is admitted:
    a held one that ends ``upstream_error`` is no evidence, so a later idle restart is no crash."""
    a = lane(clock, hold__max_wait_s=30)
    big = submit(a, ask(a, 3000, request_id="big"))
    waiting = submit(a, ask(a, 3000, request_id="waiting"))
    assert big.admitted and waiting.held
    waiting.end(Outcome.UPSTREAM_ERROR)
    big.end(Outcome.COMPLETED)
    a.engine_restarted("scheduler pid [1] -> [2]")
    clock.advance(0.5)
    a.update_snapshot(gpu(snapshot(clock.t, version="0.5.23"), clock.t, 4 * GIB))
    assert a.watch.crashes == 0 and a.rules.cost.margin == 1.0


def test_an_admitted_request_failing_upstream_dates_the_evidence(clock: ManualClock) -> None:
    """An admitted request's upstream failure records the admitted set as of that instant: the crash
    read later names when the gate last saw that set, for the operator's timeline."""
    a = lane(clock)
    big = submit(a, ask(a, 3000, request_id="big"))
    clock.advance(2.0)
    failed_at = clock.t
    big.end(Outcome.UPSTREAM_ERROR)
    clock.advance(1.0)
    a.engine_restarted("scheduler pid [1] -> [2]")
    clock.advance(0.5)
    a.update_snapshot(gpu(snapshot(clock.t, version="0.5.23"), clock.t, 4 * GIB))
    crash = a.watch.last_crash
    assert crash is not None and crash.admitted.at == failed_at
    assert crash.admitted.request_ids == ("big",)


def test_a_second_first_byte_is_harmless(clock: ManualClock) -> None:
    """The first-byte signal may come twice (a shell path that marks it again): the second changes
    nothing and raises nothing; the request still ends with the ledger back at zero."""
    a, rec = make(clock)
    h = submit(a, ask(a, 1000))
    h.prefill_done()
    totals = a.ledger.totals
    h.prefill_done()
    assert a.ledger.totals == totals and a.in_flight() == []
    h.end(Outcome.COMPLETED)
    assert a.ledger.totals == LedgerTotals() and rec.outcomes == Counter({Outcome.COMPLETED: 1})


def test_every_intake_is_news_to_quiet(clock: ManualClock) -> None:
    """Each gated request's intake counts, not only the first: a second one after a quiet interval
    keeps the pollers at their interval."""
    a, _ = make(clock)
    a.open()
    assert a.quiet() is False
    clock.advance(POLL_S)
    assert a.quiet() is True
    a.open()
    clock.advance(POLL_S)
    assert a.quiet() is False


def _risked(a: Admission, clock: ManualClock):
    """One request admitted, then a failed scrape: that set is kept as the evidence (at ``clock.t``)."""
    h = submit(a, ask(a, 3000, request_id="big"))
    clock.advance(0.1)
    a.update_snapshot(failing(a.snapshot))
    return h


def _restart_and_report(a: Admission, clock: ManualClock) -> None:
    a.engine_restarted("scheduler pid [1] -> [2]")
    clock.advance(0.5)
    a.update_snapshot(gpu(snapshot(clock.t, version="0.5.23"), clock.t, 4 * GIB))


def test_a_report_of_the_same_engine_after_a_lost_scrape_clears_the_evidence(clock: ManualClock) -> None:
    """The same engine answering with a report read no earlier than one poll interval before the
    failure (here exactly that) says it did not die: a later idle restart is no crash."""
    a = lane(clock)
    h = _risked(a, clock)
    failed_at = clock.t
    clock.advance(1.0)
    a.update_snapshot(gpu(snapshot(failed_at + POLL_S), clock.t, 4 * GIB - 3000 * MIB))
    h.end(Outcome.COMPLETED)
    _restart_and_report(a, clock)
    assert a.watch.crashes == 0 and a.rules.cost.margin == 1.0


def test_a_report_read_too_soon_after_the_failure_keeps_the_evidence(clock: ManualClock) -> None:
    """A report read less than a poll interval after the failure may predate the engine's death: the
    set stays the evidence, and the restart is read as a crash of it."""
    a = lane(clock)
    h = _risked(a, clock)
    failed_at = clock.t
    clock.advance(1.0)
    a.update_snapshot(gpu(snapshot(failed_at + POLL_S - 0.01), clock.t, 4 * GIB - 3000 * MIB))
    h.end(Outcome.COMPLETED)
    _restart_and_report(a, clock)
    crash = a.watch.last_crash
    assert a.watch.crashes == 1 and crash is not None and crash.admitted.request_ids == ("big",)


def test_healthy_reports_with_work_admitted_are_no_evidence(clock: ManualClock) -> None:
    """Work admitted under a healthy engine is not a risk: after it completes, a restart is no crash."""
    a = lane(clock)
    h = submit(a, ask(a, 3000, request_id="big"))
    clock.advance(1.0)
    a.update_snapshot(gpu(snapshot(clock.t), clock.t, 4 * GIB - 3000 * MIB))
    h.end(Outcome.COMPLETED)
    _restart_and_report(a, clock)
    assert a.watch.crashes == 0 and a.rules.cost.margin == 1.0


def test_a_pump_with_nothing_changed_decides_only_the_head(clock: ManualClock) -> None:
    """Issue 27's hold queue at scale: while the inputs behind the first held request stand, an event
    decides only the head, not every request behind it (their decisions stay as they were)."""
    a, (_, big, tiny) = _strict_order(clock)
    before_big, before_tiny = big.decision, tiny.decision
    a.pump()
    assert big.decision is not before_big  # the head is decided again
    assert tiny.decision is before_tiny  # the one behind it is not


def test_a_refused_body_ending_moves_nothing_in_the_queue(clock: ManualClock) -> None:
    """A request that ends without being admitted or held (a refused body) frees nothing: the held
    queue is not decided again and no sooner engine read is asked for."""
    a, _ = make(clock)
    first = submit(a, ask(a, 1000))
    clock.advance(6.0)  # the signals go stale: what arrives now waits for a fresh read
    waiting = submit(a, ask(a, 1000))
    assert first.admitted and waiting.held
    wanted: list[int] = []
    a.on_report_wanted = lambda: wanted.append(1)
    first.end(Outcome.COMPLETED)
    assert waiting.held and wanted == [1]  # a release with one held: read the engine sooner
    before = waiting.decision
    with a.open():
        pass  # a body refused before submitting: outcome bad_request
    assert wanted == [1] and waiting.decision is before
