"""The admission controller: books and releases charges and orders the hold queue; no I/O, no asyncio.

It decides nothing itself: every rule is in :func:`sidecar.core.decide`. Every gated request gets one
:class:`Handle` at intake (``Admission.open``), before its body is even parsed, in the manner of a
concurrency-limits listener: the handle ``submit``s the request's :class:`~sidecar.core.Demand` once
and is admitted (charged with the decision's charge in the same synchronous call as the decision: no
``await`` can slip between check and charge), rejected, or held. Held handles are re-decided in queue
order by :meth:`Admission.pump` whenever something that could let them in or time them out changes
(new signals, a ledger release, a policy reload, a handle leaving, a deadline on the injected clock),
each told whose turn comes first (strict order is the decision's rule too).

The handle alone records the request's outcome, exactly once. The shell holds it as a context
manager: the outcome is decided on exit from what happened (``Handle.outcome_on_exit``), whatever
path the request leaves by; the gate records its own (a rejection, a guard's abort) when it decides.
Ending releases whatever the handle still holds (its ledger charge, its place in the queue), so no
path can leak.
"""

from __future__ import annotations

import heapq
import logging
from asyncio import CancelledError
from collections.abc import Callable
from dataclasses import replace
from enum import StrEnum
from itertools import count
from typing import Protocol

from sidecar.admission.clock import Clock, Timer
from sidecar.admission.hold_queue import HoldQueue
from sidecar.admission.lane_watch import LaneWatch
from sidecar.core.decide import (
    Situation,
    behind_inputs,
    decide,
    holds_behind,
    join_pending,
    join_settles,
    make_situation,
    retry_after_s,
)
from sidecar.core.decision import Action, Decision, Reason
from sidecar.core.demand import Demand, reprice
from sidecar.core.ledger import Ledger, LedgerTotals
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
from sidecar.core.prefill_rate import PrefillRate
from sidecar.core.rules import Rules
from sidecar.core.snapshot import Snapshot
from sidecar.policy.in_force import rules_in_force, rules_of
from sidecar.policy.schema import LoadedPolicy

log = logging.getLogger("sidecar.admission.controller")


class Outcome(StrEnum):
    """How a gated request ended. Exactly one per request; `requests_total{outcome}` counts them."""

    COMPLETED = "completed"  # the upstream's response was relayed to the end (whatever its status)
    REJECTED = "rejected"  # 503 from the sidecar (reason in decisions_total)
    CLIENT_GONE = "client_gone"  # the client left: while held, waiting for headers, or mid-stream
    UPSTREAM_ERROR = "upstream_error"  # the engine could not be reached or broke the response
    BAD_REQUEST = "bad_request"  # 400/413: never reached the engine
    # Admitted, then aborted by the in-flight guard before its prefill peak: 503 prefill_overrun.
    PREFILL_OVERRUN = "prefill_overrun"


class ClientGone(Exception):
    """The client disconnected before its request was complete."""


class Observer(Protocol):
    """Where decisions and outcomes go (metrics, the decision log). Must not block."""

    def decision(self, d: Decision, demand: Demand, waited_s: float, ledger: LedgerTotals) -> None: ...

    def outcome(self, outcome: Outcome) -> None: ...


class NullObserver:
    def decision(self, d: Decision, demand: Demand, waited_s: float, ledger: LedgerTotals) -> None:
        pass

    def outcome(self, outcome: Outcome) -> None:
        pass


class _Guarded:
    """An observer that cannot break the bookkeeping: a failing metrics or log call is logged, never
    raised into ``submit``/``end`` after the ledger was charged (that would leak the entry)."""

    def __init__(self, inner: Observer) -> None:
        self.inner = inner

    def decision(self, d: Decision, demand: Demand, waited_s: float, ledger: LedgerTotals) -> None:
        try:
            self.inner.decision(d, demand, waited_s, ledger)
        except Exception:
            log.exception("observer failed on a decision; admission goes on")

    def outcome(self, outcome: Outcome) -> None:
        try:
            self.inner.outcome(outcome)
        except Exception:
            log.exception("observer failed on an outcome; admission goes on")


class Handle:
    """One gated request, from intake to its end. Only it records the request's outcome, once.

    ``submit`` (once) returns the action: ``ADMIT`` (charged; call ``prefill_done`` at the first byte
    and ``relayed`` at the last), ``REJECT`` (ended, outcome ``rejected``; ``decision`` says why), or
    ``HOLD`` (queued; ``on_done(handle)`` is called when the gate admits or rejects it). Used as a
    context manager, it ends on exit (``outcome_on_exit``); ``end`` records an outcome directly (the
    emulator, tests): the first outcome recorded stands and releases what is held.
    """

    __slots__ = (
        "_held",
        "_key",
        "_on_done",
        "_on_overrun",
        "_owner",
        "_relayed",
        "decision",
        "demand",
        "outcome",
        "shadow_reject",
        "sort_key",
        "waited_s",
    )

    def __init__(self, owner: Admission) -> None:
        self._owner = owner
        self.demand: Demand | None = None
        # The latest decision: the hold while held, then the admission or the rejection.
        self.decision: Decision | None = None
        # Shadow mode: what enforcement would have done to this admitted request.
        self.shadow_reject: Decision | None = None
        self.waited_s = 0.0
        self.outcome: Outcome | None = None
        self.sort_key: tuple[int, int] = (0, 0)
        self._key: int | None = None  # the ledger entry, while charged
        self._held = False
        self._on_done: Callable[[Handle], None] | None = None
        self._on_overrun: Callable[[Handle], None] | None = None
        self._relayed = False  # the response went out to its end

    @property
    def admitted(self) -> bool:
        return self.decision is not None and self.decision.admitted

    @property
    def held(self) -> bool:
        return self._held

    @property
    def ended(self) -> bool:
        return self.outcome is not None

    def submit(self, demand: Demand, on_done: Callable[[Handle], None] = lambda h: None) -> Action:
        return self._owner._submit(self, demand, on_done)

    def prefill_done(self, measured: bool = True) -> None:
        """First token seen: the prefill's transient is gone, its KV now shows in the engine's gauges;
        the request still runs (its running part stays charged until :meth:`end`).

        ``measured``: this first byte marks the prefill's end (a stream), so it times the lane's
        prefill rate; a non-streaming response's first byte is the whole answer and must not.
        """
        self._owner._prefill_done(self, measured)

    def relayed(self) -> None:
        """The engine's response went out to the client to its end (whatever its status)."""
        self._relayed = True

    def end(self, outcome: Outcome) -> None:
        self._owner._end(self, outcome)

    def outcome_on_exit(self, exc: BaseException | None) -> Outcome:
        """The outcome of a request whose handle is left with ``exc`` (None: normally), unless the
        gate recorded one already: the client gone (its disconnect cancels the task) or anything else
        raised is ``client_gone`` / ``upstream_error``; a normal exit before submitting is a refused
        body (400/413/415, never forwarded); after it, ``completed`` once the response was relayed to
        its end, else the engine's failure that was answered here (502/503/504)."""
        if exc is not None:
            gone = isinstance(exc, ClientGone | CancelledError)
            return Outcome.CLIENT_GONE if gone else Outcome.UPSTREAM_ERROR
        if self.demand is None:
            return Outcome.BAD_REQUEST
        return Outcome.COMPLETED if self._relayed else Outcome.UPSTREAM_ERROR

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if self.outcome is None:
            # ``outcome_on_exit``'s first answer taken here: a relayed response that left normally.
            done = exc is None and self._relayed and self.demand is not None
            self._owner._end(self, Outcome.COMPLETED if done else self.outcome_on_exit(exc))

    def on_overrun(self, callback: Callable[[Handle], None]) -> None:
        """What the shell does when the in-flight guard aborts this admitted request before its first
        byte (``core/overrun.py``): cancel the upstream request and answer the client with the
        handle's ``decision`` (a 503 ``prefill_overrun``). By then the handle has ended (outcome
        ``prefill_overrun``) and released its charge; the callback must not block."""
        self._on_overrun = callback

    def __lt__(self, other: Handle) -> bool:
        return self.sort_key < other.sort_key


class Admission:
    def __init__(
        self,
        policy: LoadedPolicy,
        clock: Clock,
        *,
        shadow: bool = False,
        observer: Observer | None = None,
    ) -> None:
        self.loaded = policy
        # What the sidecar learns of its lane (idle free memory, under-predictions): the rules in
        # force are the policy's with what it has learnt (``rules_in_force``).
        self.watch = LaneWatch(rules_of(policy.policy))
        self.rules: Rules = rules_in_force(policy.policy, self.watch.learned)
        self.clock = clock
        self.shadow = shadow
        self.observer: Observer = _Guarded(observer or NullObserver())
        self.snapshot = Snapshot()
        self.ledger = Ledger()
        # The lane's delivered prefill rate, from the ledger's own releases: what Retry-After divides by.
        self.prefill_rate = PrefillRate()
        self.draining = False
        self._queue: HoldQueue[Handle] = HoldQueue()
        # ``behind_inputs`` when every held request was last decided: while they and the rules'
        # ``holds_behind`` stand, a pump decides only up to the first held request (and the timed out).
        self._behind_at: tuple[object, ...] | None = None
        self._seq = count()
        # Deadlines of held handles, earliest first, behind one timer at the earliest (not a timer per
        # waiter). Entries of handles that left, or were priced again, are dropped when they surface.
        self._deadlines: list[tuple[float, int, Handle]] = []
        self._timer: Timer | None = None
        self._timer_at: float | None = None
        self._pumping = False
        self._repump = False
        # The in-flight prefill guard (core/overrun.py): admitted handles whose prefill has not
        # finished, in admission order (a dict keeps it), the engine's prefill counter attributed to
        # them, and what it did.
        self._prefilling: dict[int, Handle] = {}
        self.progress = PrefillProgress()
        self.overruns = 0
        self.overruns_unfit = 0
        self.last_overrun: tuple[float, Overrun] | None = None
        # When an admitted request last ended, and what the shell calls when reads sooner than the
        # poll interval become wanted (``report_wanted``).
        self._released_at: float | None = None
        self.on_report_wanted: Callable[[], None] = lambda: None
        # A streaming request's batch join still to come (core/constraints.JoinPending): new prefills
        # wait until this instant, and until no admitted prefill is ahead of the join.
        self._join_at: float | None = None
        self._join_timer: Timer | None = None
        # Gated requests opened (a count, no clock read on the request path), what ``quiet`` saw last
        # and when it last saw activity, whether it said quiet, and what the shell calls when that ends.
        self._opened = 0
        self._opened_seen = 0
        self._active_at = clock.now()
        self._quiet = False
        self.on_busy: Callable[[], None] = lambda: None

    @property
    def policy(self):
        """The validated policy, for what is not a rule (body limits, answers, priority bounds, its
        name); the decision, the guard and the lane watch read :attr:`rules`."""
        return self.loaded.policy

    @property
    def held(self) -> int:
        return self._queue.live

    def waiting_for(self) -> tuple[str | None, int | None]:
        """What the first held request waits for (the reason of its last decision) and its projected
        bytes: what must change for the queue to move (the live view shows it)."""
        head = self._queue.head()
        if head is None or head.decision is None or head.demand is None:
            return None, None
        return (head.decision.reason.value if head.decision.reason else None), head.demand.projected_bytes

    def oldest_wait_s(self) -> float | None:
        oldest = self._queue.oldest_arrival()
        return None if oldest is None else self.clock.now() - oldest

    def situation(
        self,
        *,
        queued: bool = False,
        ahead: Reason | None = None,
        own_tokens: int = 0,
        now: float | None = None,
    ) -> Situation:
        """What the decision reads now, besides the request (``own_tokens``: a held request's own,
        left out of the held total, which the decision counts once as the request's; ``now``: the
        clock's reading, when the caller has just taken it)."""
        rules, queue = self.rules, self._queue
        # Positional, in ``Situation``'s field order: built once per decision (issue #27).
        return make_situation(
            rules,
            self.snapshot,
            self.ledger.totals,
            self.clock.now() if now is None else now,
            queue.live,  # held
            queued,
            ahead,
            self.draining,
            queue.tokens - own_tokens,  # held_tokens
            self.prefill_rate.tokens_per_s,
            self._join_at,  # join_settles_at
            # verifies_hits (``_guarding`` spelt out: a property call per decision)
            rules.experimental.own_schedule_pricing
            and not self.shadow
            and rules.guard.enabled
            and self.progress.counter is not None,
        )

    # -- the request path -------------------------------------------------------------------------

    def open(self) -> Handle:
        """A gated request has arrived: its handle, before anything else can go wrong with it."""
        self._opened += 1
        if self._quiet:
            self._busy()
        return Handle(self)

    def quiet(self) -> bool:
        """Nothing admitted, nothing held, no signal failing and no gated request opened for one engine
        poll interval: the pollers may read less often (``signals.engine.idle_poll_interval``). They
        ask before each wait (a request's intake only counts itself, no clock read on the request
        path). The next intake or admission ends it at once (``on_busy``: the shell wakes the pollers).
        A failing source is read at its interval: its failures are news (``engine_unavailable`` after
        so many, and its recovery)."""
        now = self.clock.now()
        snap = self.snapshot
        failing = snap.engine_health.consecutive_failures or snap.gpu_health.consecutive_failures
        if self._opened != self._opened_seen or len(self.ledger) or self._queue.live or failing:
            self._opened_seen, self._active_at = self._opened, now
        self._quiet = now - self._active_at >= self.rules.engine.poll_interval_s
        return self._quiet

    def _busy(self) -> None:
        self._quiet = False
        self.on_busy()

    def evaluate(self, demand: Demand) -> Decision:
        """What would happen to this request now, charging nothing (``/admission/explain``)."""
        return decide(demand, self.situation(ahead=self._ahead_of(self._sort_key(demand, advance=False))))

    # -- the shell calls these when the world changes --------------------------------------------

    def update_snapshot(self, snap: Snapshot) -> None:
        self.snapshot = snap
        now = self.clock.now()
        e = snap.engine
        health = snap.engine_health
        if health.consecutive_failures and self.ledger.totals.requests:
            # The engine may be dying with this set in it: the evidence, if it turns out to restart.
            self.watch.at_risk(self.watch.admitted_set(self.ledger.totals, self.rules, snap, now))
        elif not health.consecutive_failures and e is not None:
            self.watch.engine_ok(now, e.observed_at - self.rules.engine.poll_interval_s)
        if e is not None:
            at = e.observed_at if e.prefill_counted_at is None else e.prefill_counted_at
            self.progress.observe(
                e.prefill_computed_tokens, e.prefill_cached_tokens, at, idle=not self._prefilling
            )
        # Progress as of now: any GPU reading in hand was read before now, so what the engine can have
        # computed since its counters were requested covers it. Counters too old for that, and the
        # comparison waits for the next engine report (a caching allocator's reading keeps its peak).
        # With no prefill in flight their age does not matter: there is no progress to estimate (the
        # prefills that ended are expected at their final peaks, ``LaneWatch.left``).
        prefills = self.in_flight(now)
        in_flight = in_flight_bytes(prefills, self.watch.priced)
        defer = bool(prefills) and self.progress.too_old(
            now, self._allowance_rate(), max(p.demand.chunk_size for p in prefills)
        )
        # What a lone prefill has surely allocated, from the chunks the counter showed done: only for a
        # counter read no later than the GPU reading (a later one may count chunks run after it).
        done = None
        if e is not None and snap.gpu is not None and e.observed_at <= snap.gpu.observed_at:
            done = done_bytes(prefills, self.watch.priced)
        if self.watch.observe(snap, self.ledger.totals, self.rules, now, in_flight, defer, done):
            self._apply_rules()
        self._guard()
        self.pump()

    def engine_restarted(self, why: str) -> None:
        """The engine scraper saw a new engine process. With admitted work in it (now, or when the engine
        was last seen failing) it is a crash: the lane watch raises the margin so that the set would not
        have fitted (``lane_watch.crash_margin``); held requests are priced again under it."""
        now = self.clock.now()
        admitted = (
            self.watch.admitted_set(self.ledger.totals, self.rules, self.snapshot, now)
            if self.ledger.totals.requests
            else None
        )
        # The GPU reading saw the old process: the decision waits for a newer one (``decide._blindness``).
        self.snapshot = replace(self.snapshot, engine_restarted_at=now)
        if self.watch.engine_restarted(now, why, admitted):
            self._apply_rules()
            self.pump()

    def reload(self, policy: LoadedPolicy) -> None:
        """A new policy: held requests are priced again under it (a new deadline too), then re-decided;
        admitted prefills are checked against it (the in-flight guard)."""
        self.loaded = policy
        self.watch.reload(rules_of(policy.policy))
        self._apply_rules()
        self._guard()
        self.pump()

    def in_flight(self, now: float | None = None) -> list[Prefill]:
        """The admitted requests whose prefill has not finished, oldest first, with the progress the
        engine's counter shows for each (None without the counter). With ``now``, a counter read before
        ``now`` is advanced by what the lane could have computed since, at twice the faster of its
        measured and its policy's prefill rate: progress is never under-counted (the safe side for the
        monitor, which compares a reading with the transient at that progress)."""
        entries = [(k, h.demand) for k, h in self._prefilling.items() if h.demand is not None]
        return self.progress.prefills(entries, now, self._allowance_rate())

    def _allowance_rate(self) -> float:
        """Tokens per second the lane may compute between a counter's report and a later reading: twice
        the faster of its measured and its policy's prefill rate (the counter's own rate is added by
        ``PrefillProgress``)."""
        return 2.0 * max(self.prefill_rate.tokens_per_s or 0.0, self.rules.hold.prefill_tokens_per_s)

    def guard_state(self) -> dict[str, object]:
        """For /admission/state: the in-flight guard's counts and its latest abort."""
        now = self.clock.now()
        last = self.last_overrun
        return {
            "enabled": self._guarding,
            "progress": "counter" if self.progress.counter is not None else "unknown (final peaks)",
            "prefilling": len(self._prefilling),
            "aborted": self.overruns,
            "aborted_unfit": self.overruns_unfit,
            "last": None if last is None else last[1].fields() | {"age_s": round(now - last[0], 3)},
        }

    def refresh_rules(self) -> None:
        """The lane watch learned something outside a snapshot (a state file restored at start)."""
        self._apply_rules()

    def _apply_rules(self) -> None:
        """The rules in force changed (a policy, a measured idle figure, a raised margin): held
        requests are priced again under them."""
        self.rules = rules_in_force(self.loaded.policy, self.watch.learned)
        held = self._queue.all_live()
        for h in held:
            if h.demand is not None:
                h.demand = reprice(self.rules, h.demand)
                self._arm(h)
        self._queue.tokens = sum(h.demand.uncached_tokens for h in held if h.demand)

    def drain(self) -> None:
        """Stop admitting: new requests and everything held get 503 ``draining``."""
        self.draining = True
        self.pump()

    def pump(self) -> None:
        """Re-decide every held request in queue order, each told the reason of the first one still
        waiting ahead of it (the decision keeps strict order with it).

        Re-entrant calls (a callback ending a handle, say) are folded into one more pass.
        """
        if self._pumping:
            self._repump = True
            return
        self._pumping = True
        try:
            self._repump = True
            while self._repump:
                self._repump = False
                self._pump_once()
        finally:
            self._pumping = False

    # -- internals ---------------------------------------------------------------------------------

    def _submit(self, h: Handle, demand: Demand, on_done: Callable[[Handle], None]) -> Action:
        if h.demand is not None or h.outcome is not None:
            raise RuntimeError("a handle submits once, before it ends")
        h.demand = demand
        # ``_sort_key(demand)``, inline (every gated request).
        h.sort_key = (
            demand.priority if self.rules.hold.low_priority_values_first else -demand.priority,
            next(self._seq),
        )
        # One reading of the clock: the decision's instant, its wait, and (admitted) its charge's.
        now = self.clock.now()
        h.waited_s = now - demand.arrived_at
        ahead = self._ahead_of(h.sort_key) if self._queue.live else None
        d = decide(demand, self.situation(ahead=ahead, now=now))
        if self.shadow and d.action is not Action.ADMIT:
            # Shadow mode: record what enforcement would have done, then forward anyway.
            self.observer.decision(d, demand, h.waited_s, self.ledger.totals)
            h.shadow_reject = d
            d = Decision(Action.ADMIT, None, None, d.headroom_bytes, d.checks, d.charge)
        if d.action is Action.ADMIT:
            self._admit(h, d, now)
        elif d.action is Action.REJECT:
            self._reject(h, d)
        else:
            self.observer.decision(d, demand, h.waited_s, self.ledger.totals)
            h.decision, h._held, h._on_done = d, True, on_done
            if not self._queue.live:
                self._behind_at = behind_inputs(self.situation())  # the one held was decided under it
            self._queue.push(h, demand.arrived_at)
            self._queue.tokens += demand.uncached_tokens
            self._arm(h)
            self._want_report()
        return d.action

    def _pump_once(self) -> None:
        """One pass in queue order. Under ``holds_behind`` rules, once a request is held, those behind it
        stay held (strict order) unless their deadline came or ``behind_inputs`` changed since they
        were all last decided: the pass stops there and decides only the timed out (O(1) per event
        for a queue of thousands, not O(held)). Otherwise every held request is decided."""
        if not self._queue.live:
            return
        ahead: Reason | None = None
        queue = self._queue
        version = queue.version
        key = behind_inputs(self.situation())
        whole = not holds_behind(self.rules) or key != self._behind_at
        for h in queue.walk():
            if ahead is not None and not whole:
                break
            self._redecide(h, ahead)
            if h.held and ahead is None and h.decision is not None:
                ahead = h.decision.reason
        if queue.version != version:
            self._repump = True  # a push moved the queue under the walk: walk again from the head
        elif whole:
            self._behind_at = key
        else:
            self._expire(ahead)

    def _redecide(self, h: Handle, ahead: Reason | None) -> None:
        """Decide one held request again, told the reason of the first one held ahead of it."""
        assert h.demand is not None
        d = decide(h.demand, self.situation(queued=True, ahead=ahead, own_tokens=h.demand.uncached_tokens))
        h.decision = d
        if d.action is Action.HOLD:
            return
        self._leave_queue(h)
        if d.action is Action.ADMIT:
            self._admit(h, d)
        else:
            self._reject(h, d)
        if h._on_done is not None:
            h._on_done(h)

    def _expire(self, ahead: Reason | None) -> None:
        """The held requests behind the first held one whose deadline has come: decided (refused
        ``hold_timeout``), earliest deadline first, from the deadline heap, not by walking the queue."""
        dl, now = self._deadlines, self.clock.now()
        while dl and dl[0][0] <= now:
            entry = heapq.heappop(dl)
            if _due_entry(entry):
                self._redecide(entry[2], ahead)

    def _arm(self, h: Handle) -> None:
        """The handle's deadline, on the clock that measures it (the decision times it out)."""
        assert h.demand is not None
        heapq.heappush(self._deadlines, (h.demand.deadline, next(self._seq), h))
        self._schedule()

    def _schedule(self) -> None:
        """The one deadline timer, at the earliest deadline of a handle still held (none when none is)."""
        dl = self._deadlines
        while dl and not _due_entry(dl[0]):
            heapq.heappop(dl)
        when = dl[0][0] if dl else None
        if when == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, when
        if when is not None:
            self._timer = self.clock.call_at(when, self._deadline)

    def _deadline(self) -> None:
        """The timer fired: pump (the decision times out whoever's deadline has come; a loop may fire a
        hair early, and then nobody yet), then time the next deadline."""
        self._timer = self._timer_at = None
        self.pump()
        self._schedule()

    def _leave_queue(self, h: Handle) -> None:
        assert h.demand is not None
        h._held = False
        self._queue.left()
        self._queue.tokens -= h.demand.uncached_tokens
        if h.demand.deadline == self._timer_at:
            self._schedule()  # it was the one timed: time the next (or none)

    def _ahead_of(self, sort_key: tuple[int, int]) -> Reason | None:
        """The reason the first request held ahead of one with this key is waiting, if there is one."""
        head = self._queue.head()
        if head is None or not head.sort_key < sort_key or head.decision is None:
            return None
        return head.decision.reason

    def _sort_key(self, demand: Demand, *, advance: bool = True) -> tuple[int, int]:
        prio = demand.priority if self.rules.hold.low_priority_values_first else -demand.priority
        return (prio, next(self._seq) if advance else 1 << 62)

    def _waited(self, h: Handle) -> float:
        assert h.demand is not None
        return self.clock.now() - h.demand.arrived_at

    def _admit(self, h: Handle, d: Decision, now: float | None = None) -> None:
        """Charge the admitted request (``now``: the decision's instant, when just read)."""
        demand = h.demand
        assert demand is not None
        if now is None:
            now = self.clock.now()
        h.decision, h.waited_s = d, now - demand.arrived_at
        ledger, charge = self.ledger, d.charge
        if not ledger.totals.running_requests:  # the ledger is empty (one running request per entry)
            self.prefill_rate.busy(now)
            if self._quiet:
                self._busy()
        if not self._prefilling:
            self.progress.started()
        h._key = key = ledger.charge(charge)
        if charge.own_prefills:  # priced by its own chunk schedule: the guard prices it so too
            h.demand = demand = replace(demand, own_schedule=True)
        self._prefilling[key] = h
        self.progress.admitted(key, demand.uncached_tokens)
        totals = ledger.totals
        tracked = self.progress.counter is not None
        self.watch.charged(key, demand.request_id, totals, self.rules.cost, tracked, charge.projected_bytes)
        if h.shadow_reject is None:
            self.observer.decision(d, demand, h.waited_s, totals)

    def _reject(self, h: Handle, d: Decision) -> None:
        assert h.demand is not None
        h.decision, h.waited_s = d, self._waited(h)
        self.observer.decision(d, h.demand, h.waited_s, self.ledger.totals)
        self._end(h, Outcome.REJECTED)

    def _end(self, h: Handle, outcome: Outcome) -> None:
        if h.outcome is not None:
            return
        h.outcome = outcome
        admitted = h._key is not None
        changed = admitted or h._held
        if h._held:
            self._leave_queue(h)  # the client left while held: no decision, the next one may go
        if h._key is not None and outcome is Outcome.UPSTREAM_ERROR:
            # The engine broke this request's connection: it may be dying with what is admitted now.
            self.watch.at_risk(
                self.watch.admitted_set(self.ledger.totals, self.rules, self.snapshot, self.clock.now())
            )
        if h._key is not None:
            key = h._key
            prefilling = key in self._prefilling
            if prefilling:
                self._left_prefill(key)
            self.ledger.release(key)
            if prefilling:
                self._join_moved(joins=False)
            now = self.clock.now()
            self.watch.ended(key, now)
            h._key = None
            self._released_at = now
        self.observer.outcome(outcome)
        if changed and self._queue.live:
            self.pump()  # nothing held: nothing to decide again
        if admitted and self._queue.live:
            self._want_report()  # report_wanted() is False while nothing is held

    def report_wanted(self) -> bool:
        """Should the engine (and the GPU) be read sooner than the poll interval now?

        While a request is held and an admitted request ended less than one engine poll interval ago:
        what it held (KV, Mamba slots, its running slot) shows only in an engine report published after
        its end, and the shell's pollers read sooner (``engine.poll_after_release_s``,
        ``signals.engine.Sooner``) so that the held request goes in at the first read that shows it,
        not at the next poll. After one interval the periodic poll has read the engine anyway."""
        ended = self._released_at
        if not self._queue.live or ended is None:
            return False
        return self.clock.now() - ended < self.rules.engine.poll_interval_s

    def _want_report(self) -> None:
        if self.report_wanted():
            self.on_report_wanted()

    def _prefill_done(self, h: Handle, measured: bool) -> None:
        key = h._key
        if key is None:
            return
        self._left_prefill(key)
        self.watch.prefilled(key)
        if self.ledger.prefill_done(key):
            # A stream's first token: it joins the running batch at the engine's next decode step.
            joins = measured and self.rules.cost.join_bytes(self.ledger.totals.running_requests) > 0
            if joins or self._join_at is not None or self._join_timer is not None:
                self._join_moved(joins=joins)  # else nothing pending and nothing to start (the norm)
            if measured and h.decision is not None:
                self.prefill_rate.prefilled(h.decision.charge.prefill_tokens, self.clock.now())
            if self._queue.live:
                self.pump()  # nothing held: nothing to decide again

    def _join_moved(self, *, joins: bool) -> None:
        """An admitted prefill ended (``joins``: a stream's first token that joins a running batch):
        the instant a pending join is taken to be done moves (``core/decide.join_settles``), timed so
        that the held requests are decided again then."""
        if not joins and self._join_at is None and self._join_timer is None:
            return  # nothing pending and nothing to start: what the lines below would leave (the norm)
        now = self.clock.now()
        at = join_settles(self._join_at, now, self.rules.cost.join_settle_s, joins=joins)
        if self._join_timer is not None:
            self._join_timer.cancel()
        self._join_timer = None
        if at is None or (at <= now and not self.ledger.totals.requests):
            self._join_at = None  # nothing pending, or done at once: no settle time, no prefill ahead
            return
        self._join_at = at
        if at > now:
            self._join_timer = self.clock.call_at(at, self._join_settled)

    def _join_settled(self) -> None:
        """The settle time has passed: the join is done unless a prefill is still ahead of it (its end
        moves the settle time again)."""
        self._join_timer = None
        if not join_pending(self.situation()):
            self._join_at = None
        elif self._join_at is not None and not self.ledger.totals.requests:
            self._join_timer = self.clock.call_at(self._join_at, self._join_settled)  # a timer fired early
        self.pump()

    # -- the in-flight prefill guard (core/overrun.py) -------------------------------------------------

    def _left_prefill(self, key: int) -> None:
        """A prefill ended (its first byte, or the request ended before it): its share of the counter
        is done work, and what it took may show in the next reading (a caching allocator keeps it):
        the monitor expects up to its final peak beside what the prefills still in flight reach.

        O(1): this runs at every gated request's first byte. The counter's shares are kept as prefills
        come and go (``PrefillProgress.left``), and the monitor sums the final peaks of the prefills
        that ended and adds the in-flight ones once, at the next reading (``LaneWatch.left``), instead
        of pricing every prefill still in flight at each end (which made a burst of first bytes
        quadratic in the prefills in flight)."""
        h = self._prefilling.pop(key, None)
        if h is None:
            return
        self.progress.left(key)
        if self.progress.counter is not None:
            # Without the counter the monitor compares with the final peaks of the ledger's prefills
            # anyway (each was expected at its admission): nothing more to expect.
            assert h.demand is not None
            self.watch.left(final_bytes(h.demand, self.watch.priced), last=not self._prefilling)

    @property
    def _guarding(self) -> bool:
        return not self.shadow and self.rules.guard.enabled

    def _guard(self) -> None:
        """Abort the admitted prefills that no longer fit under the rules now in force (the rule is
        ``core/overrun.overruns``; it runs at every new snapshot and rules change, and finds nothing
        while nothing tightened). Held requests are re-decided once, after the aborts.

        The admitted prefills are priced at what the monitor's findings bound the lane's draw by, not
        at the margin new admissions get, which adds the safety on top of it
        (``LaneWatch.in_flight_margin``): one is aborted when the evidence says it will not fit."""
        if not self._guarding or not self._prefilling:
            return
        rules, margin = self.rules, self.watch.in_flight_margin
        if margin < rules.cost.margin:
            rules = replace(rules, cost=replace(rules.cost, margin=margin))
        found = overruns(self.in_flight(), rules, self.snapshot, self.ledger.totals.running_requests)
        if not found:
            return
        was, self._pumping = self._pumping, True  # the caller pumps once after every abort
        try:
            for o in found:
                h = self._prefilling.get(o.key)
                if h is not None:
                    self._overrun(h, o)
        finally:
            self._pumping = was

    def _overrun(self, h: Handle, o: Overrun) -> None:
        assert h.demand is not None and h.decision is not None
        # Its own prefill tokens are still in the ledger: the work ahead of a retry includes them once.
        h.decision = rejection(o, h.decision, retry_after_s(self.situation(), Reason.PREFILL_OVERRUN))
        self.overruns += 1
        self.overruns_unfit += not o.fits_idle
        self.last_overrun = (self.clock.now(), o)
        # The decision log (and the process log's warning) record it with the numbers (observe.py).
        self.observer.decision(h.decision, h.demand, h.waited_s, self.ledger.totals)
        self._end(h, Outcome.PREFILL_OVERRUN)
        if h._on_overrun is not None:
            try:
                h._on_overrun(h)
            except Exception:
                log.exception("the shell failed to abort %s upstream", o.request_id)


def _due_entry(entry: tuple[float, int, Handle]) -> bool:
    """A deadline entry still stands: its handle is held, at that deadline (not priced again since)."""
    deadline, _, h = entry
    return h.held and h.demand is not None and h.demand.deadline == deadline
