"""The admission controller: books and releases charges and orders the hold queue; no I/O, no asyncio.

It decides nothing itself: every rule is in :func:`sidecar.core.decide`. A request ``submit``s its
:class:`~sidecar.core.Demand` and gets one of three things back: a :class:`Ticket` (admitted and
charged with the decision's charge, in the same synchronous call as the decision - no ``await`` can
slip between check and charge), a :class:`Rejection`, or a :class:`Waiter` parked in the hold queue.
Waiters are re-decided in queue order by :meth:`Admission.pump` whenever something that could let them
in or time them out changes (new signals, a ledger release, a policy reload, a waiter leaving, a
deadline), each told whose turn comes first (strict order is the decision's rule too).

Every ticket ends exactly once (``finish``), every waiter ends exactly once (admitted, rejected or
cancelled), and each end is reported to the observer as one outcome. The clock is a parameter
(``now``) so the live proxy (monotonic time) and ``replay`` (virtual time) share this code.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import count
from typing import Protocol

from sidecar.core.decide import Situation, decide
from sidecar.core.decision import Action, Decision, Reason
from sidecar.core.demand import Demand, reprice
from sidecar.core.ledger import Ledger, LedgerTotals
from sidecar.core.rules import Rules
from sidecar.core.snapshot import Snapshot
from sidecar.intake import rules_of
from sidecar.policy import LoadedPolicy, Policy

log = logging.getLogger("sidecar.admission")


class Outcome(StrEnum):
    """How a gated request ended. Exactly one per request; `requests_total{outcome}` counts them."""

    COMPLETED = "completed"  # the upstream's response was relayed to the end (whatever its status)
    REJECTED = "rejected"  # 503 from the sidecar (reason in decisions_total)
    CLIENT_GONE = "client_gone"  # the client left: while held, waiting for headers, or mid-stream
    UPSTREAM_ERROR = "upstream_error"  # the engine could not be reached or broke the response
    BAD_REQUEST = "bad_request"  # 400/413: never reached the engine


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
    raised into ``submit``/``finish`` after the ledger was charged (that would leak the entry)."""

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


@dataclass(slots=True, eq=False)
class Ticket:
    """An admitted request's reservation. End it with ``prefill_done`` (optional) then ``finish``."""

    _owner: Admission
    _key: int
    demand: Demand
    decision: Decision
    waited_s: float
    shadow_reject: Decision | None = None
    _finished: bool = False

    def prefill_done(self) -> None:
        """First token seen: the prefill's transient is gone, its KV now shows in the engine's gauges."""
        self._owner._release(self._key)

    def finish(self, outcome: Outcome) -> None:
        if self._finished:
            return
        self._finished = True
        self._owner._release(self._key)
        self._owner.observer.outcome(outcome)


@dataclass(frozen=True, slots=True)
class Rejection:
    decision: Decision
    waited_s: float

    @property
    def reason(self) -> Reason:
        assert self.decision.reason is not None
        return self.decision.reason


@dataclass(slots=True, eq=False)
class Waiter:
    demand: Demand
    on_done: Callable[[Ticket | Rejection], None]
    sort_key: tuple[int, int] = (0, 0)
    last: Decision | None = None
    result: Ticket | Rejection | None = None
    done: bool = False

    @property
    def deadline(self) -> float:
        return self.demand.deadline

    def __lt__(self, other: Waiter) -> bool:
        return self.sort_key < other.sort_key


@dataclass(slots=True)
class _Queue:
    """Priority then arrival. Removal is lazy (a ``done`` flag) so cancel is O(1)."""

    heap: list[Waiter] = field(default_factory=list)
    live: int = 0

    def push(self, w: Waiter) -> None:
        heapq.heappush(self.heap, w)
        self.live += 1

    def ordered(self) -> list[Waiter]:
        self._compact()
        return sorted(self.heap)

    def _compact(self) -> None:
        if len(self.heap) > 2 * self.live + 16:
            self.heap = [w for w in self.heap if not w.done]
            heapq.heapify(self.heap)

    def head(self) -> Waiter | None:
        while self.heap and self.heap[0].done:
            heapq.heappop(self.heap)
        return self.heap[0] if self.heap else None


class Admission:
    def __init__(
        self,
        policy: LoadedPolicy,
        clock: Callable[[], float],
        *,
        shadow: bool = False,
        observer: Observer | None = None,
    ) -> None:
        self.loaded = policy
        self.rules: Rules = rules_of(policy.policy)
        self.clock = clock
        self.shadow = shadow
        self.observer: Observer = _Guarded(observer or NullObserver())
        self.snapshot = Snapshot()
        self.ledger = Ledger()
        self.draining = False
        self._queue = _Queue()
        self._seq = count()
        self._pumping = False
        self._repump = False

    @property
    def policy(self) -> Policy:
        return self.loaded.policy

    @property
    def held(self) -> int:
        return self._queue.live

    def oldest_wait_s(self) -> float | None:
        now = self.clock()
        return max((now - w.demand.arrived_at for w in self._queue.heap if not w.done), default=None)

    def situation(self, *, queued: bool = False, ahead: Reason | None = None) -> Situation:
        """What the decision reads now, besides the request."""
        return Situation(
            self.rules,
            self.snapshot,
            self.ledger.totals,
            self.clock(),
            held=self.held,
            queued=queued,
            ahead=ahead,
            draining=self.draining,
        )

    # -- the request path -------------------------------------------------------------------------

    def evaluate(self, demand: Demand) -> Decision:
        """What would happen to this request now, charging nothing (``/admission/explain``)."""
        return decide(demand, self.situation(ahead=self._ahead_of(self._sort_key(demand, advance=False))))

    def submit(
        self, demand: Demand, on_done: Callable[[Ticket | Rejection], None]
    ) -> Ticket | Rejection | Waiter:
        """Decide and, when admitted, charge - in one synchronous step."""
        sort_key = self._sort_key(demand)
        d = decide(demand, self.situation(ahead=self._ahead_of(sort_key)))
        if self.shadow and d.action is not Action.ADMIT:
            # Shadow mode: record what enforcement would have done, then forward anyway.
            self.observer.decision(d, demand, 0.0, self.ledger.totals)
            admit = Decision(Action.ADMIT, None, None, d.headroom_bytes, d.checks, d.charge)
            return self._admit(admit, demand, 0.0, d)
        if d.action is Action.ADMIT:
            return self._admit(d, demand, 0.0)
        if d.action is Action.REJECT:
            return self._reject(d, demand, 0.0)
        self.observer.decision(d, demand, 0.0, self.ledger.totals)
        w = Waiter(demand, on_done, sort_key, d)
        self._queue.push(w)
        return w

    def cancel(self, w: Waiter) -> None:
        """The client left while held: drop it without a decision, and let the next one try."""
        if w.done:
            return
        self._finish_waiter(w, None)
        self.observer.outcome(Outcome.CLIENT_GONE)
        self.pump()

    # -- the shell calls these when the world changes --------------------------------------------

    def update_snapshot(self, snap: Snapshot) -> None:
        self.snapshot = snap
        self.pump()

    def reload(self, policy: LoadedPolicy) -> None:
        """A new policy: held requests are priced again under it, then re-decided."""
        self.loaded = policy
        self.rules = rules_of(policy.policy)
        for w in self._queue.heap:
            if not w.done:
                w.demand = reprice(self.rules, w.demand)
        self.pump()

    def drain(self) -> None:
        """Stop admitting: new requests and everything held get 503 ``draining``."""
        self.draining = True
        self.pump()

    def expire(self) -> None:
        """A hold deadline has passed: re-decide the queue (the decision times the request out)."""
        self.pump()

    def pump(self) -> None:
        """Re-decide every waiter in queue order, each told the reason of the first one still waiting
        ahead of it (the decision keeps strict order with it).

        Re-entrant calls (a waiter's callback finishing a ticket, say) are folded into one more pass.
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

    def _pump_once(self) -> None:
        if not self._queue.live:
            return
        ahead: Reason | None = None
        for w in self._queue.ordered():
            if w.done:
                continue
            d = decide(w.demand, self.situation(queued=True, ahead=ahead))
            w.last = d
            waited = self.clock() - w.demand.arrived_at
            if d.action is Action.ADMIT:
                self._finish_waiter(w, self._admit(d, w.demand, waited))
            elif d.action is Action.REJECT:
                self._finish_waiter(w, self._reject(d, w.demand, waited))
            elif ahead is None:
                ahead = d.reason

    def _ahead_of(self, sort_key: tuple[int, int]) -> Reason | None:
        """The reason the first waiter ahead of a request with this key is waiting, if there is one."""
        head = self._queue.head()
        if head is None or not head.sort_key < sort_key or head.last is None:
            return None
        return head.last.reason

    def _sort_key(self, demand: Demand, *, advance: bool = True) -> tuple[int, int]:
        prio = demand.priority if self.rules.hold.low_priority_values_first else -demand.priority
        return (prio, next(self._seq) if advance else 1 << 62)

    def _admit(self, d: Decision, demand: Demand, waited: float, shadow_of: Decision | None = None) -> Ticket:
        key = self.ledger.charge(d.charge)
        if shadow_of is None:
            self.observer.decision(d, demand, waited, self.ledger.totals)
        return Ticket(self, key, demand, d, waited, shadow_of)

    def _reject(self, d: Decision, demand: Demand, waited: float) -> Rejection:
        self.observer.decision(d, demand, waited, self.ledger.totals)
        self.observer.outcome(Outcome.REJECTED)
        return Rejection(d, waited)

    def _finish_waiter(self, w: Waiter, result: Ticket | Rejection | None) -> None:
        w.done = True
        w.result = result
        self._queue.live -= 1
        if result is not None:
            w.on_done(result)

    def _release(self, key: int) -> None:
        if self.ledger.release(key):
            self.pump()
