"""The admission controller: the decision, the ledger and the hold queue, with no I/O and no asyncio.

A request ``submit``s its cost and gets one of three things back: a :class:`Ticket` (admitted and
charged, in the same synchronous call as the decision - no ``await`` can slip between check and charge),
a :class:`Rejection`, or a :class:`Waiter` parked in the hold queue. Waiters are re-decided in queue
order by :meth:`Admission.pump` whenever something that could let them in changes (new signals, a
ledger release, a policy reload, a waiter leaving), and expired by :meth:`Admission.expire`.

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

from sidecar.cost import RequestCost, repriced
from sidecar.gate import Action, Decision, Reason, decide, kv_tokens_needed, mamba_slots_needed, retry_after_s
from sidecar.ledger import Ledger, LedgerEntry, LedgerTotals
from sidecar.policy import LoadedPolicy, Policy
from sidecar.signals.snapshot import Snapshot

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

    def decision(self, d: Decision, cost: RequestCost, waited_s: float, ledger: LedgerTotals) -> None: ...

    def outcome(self, outcome: Outcome) -> None: ...


class NullObserver:
    def decision(self, d: Decision, cost: RequestCost, waited_s: float, ledger: LedgerTotals) -> None:
        pass

    def outcome(self, outcome: Outcome) -> None:
        pass


class _Guarded:
    """An observer that cannot break the bookkeeping: a failing metrics or log call is logged, never
    raised into ``submit``/``finish`` after the ledger was charged (that would leak the entry)."""

    def __init__(self, inner: Observer) -> None:
        self.inner = inner

    def decision(self, d: Decision, cost: RequestCost, waited_s: float, ledger: LedgerTotals) -> None:
        try:
            self.inner.decision(d, cost, waited_s, ledger)
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
    cost: RequestCost
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
    cost: RequestCost
    enqueued_at: float
    deadline: float
    on_done: Callable[[Ticket | Rejection], None]
    sort_key: tuple[int, int] = (0, 0)
    last: Decision | None = None
    result: Ticket | Rejection | None = None
    done: bool = False

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
        return max((now - w.enqueued_at for w in self._queue.heap if not w.done), default=None)

    def next_deadline(self) -> float | None:
        return min((w.deadline for w in self._queue.heap if not w.done), default=None)

    # -- the request path -------------------------------------------------------------------------

    def evaluate(self, cost: RequestCost) -> Decision:
        """What would happen to this request now, charging nothing (``/admission/explain``)."""
        if self.draining:
            return self._draining()
        return decide(cost, self.snapshot, self.ledger.totals, self.policy, self.clock(), held=self.held)

    def submit(
        self, cost: RequestCost, on_done: Callable[[Ticket | Rejection], None]
    ) -> Ticket | Rejection | Waiter:
        """Decide and, when admitted, charge - in one synchronous step."""
        now = self.clock()
        if self.draining:
            return self._reject(self._draining(), cost, 0.0)
        d = decide(cost, self.snapshot, self.ledger.totals, self.policy, now, held=self.held)
        sort_key = self._sort_key(cost)
        head = self._queue.head()
        if (
            d.action is Action.ADMIT
            and head is not None
            and not self.policy.hold.backfill
            and head.sort_key < sort_key
        ):
            # Strict order: there is room, but an earlier request is waiting for it. Wait behind it.
            behind = head.last.reason if head.last else None
            d = Decision(Action.HOLD, behind, None, d.headroom_bytes, d.checks)
            if self.held >= self.policy.hold.max_held:
                d = Decision(
                    Action.REJECT,
                    Reason.QUEUE_FULL,
                    self.policy.hold.retry_after_max_s,
                    d.headroom_bytes,
                    d.checks,
                )
        if self.shadow and d.action is not Action.ADMIT:
            # Shadow mode: record what enforcement would have done, then forward anyway.
            self.observer.decision(d, cost, 0.0, self.ledger.totals)
            return self._admit(
                Decision(Action.ADMIT, None, None, d.headroom_bytes, d.checks), cost, now, 0.0, d
            )
        if d.action is Action.ADMIT:
            return self._admit(d, cost, now, 0.0)
        if d.action is Action.REJECT:
            return self._reject(d, cost, 0.0)
        self.observer.decision(d, cost, 0.0, self.ledger.totals)
        w = Waiter(cost, now, now + self.policy.hold.max_wait_s, on_done, sort_key, d)
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
        for w in self._queue.heap:
            if not w.done:
                w.cost = repriced(policy.policy, w.cost)
        self.pump()

    def drain(self) -> None:
        """Stop admitting: new requests and everything held get 503 ``draining``."""
        self.draining = True
        self.pump()

    def pump(self) -> None:
        """Re-decide waiters in queue order; in strict order, stop at the first that must keep waiting.

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

    def expire(self) -> None:
        """Reject waiters whose deadline has passed (``hold_timeout``); the shell calls this on a timer."""
        now = self.clock()
        for w in self._queue.ordered():
            if w.done or w.deadline > now:
                continue
            waited = now - w.enqueued_at
            d = decide(
                w.cost, self.snapshot, self.ledger.totals, self.policy, now, held=self.held, queued=True
            )
            if d.action is Action.ADMIT:
                self._finish_waiter(w, self._admit(d, w.cost, now, waited))
                continue
            retry = d.retry_after_s or self._retry_after(w.cost, Reason.HOLD_TIMEOUT)
            d = Decision(Action.REJECT, Reason.HOLD_TIMEOUT, retry, d.headroom_bytes, d.checks)
            self._finish_waiter(w, self._reject(d, w.cost, waited))
        self.pump()

    # -- internals ---------------------------------------------------------------------------------

    def _pump_once(self) -> None:
        if not self._queue.live:
            return
        now = self.clock()
        for w in self._queue.ordered():
            if w.done:
                continue
            waited = now - w.enqueued_at
            if self.draining:
                d = self._draining()
            else:
                d = decide(
                    w.cost,
                    self.snapshot,
                    self.ledger.totals,
                    self.policy,
                    now,
                    held=self.held,
                    queued=True,
                    waited_s=waited,
                )
            w.last = d
            if d.action is Action.ADMIT:
                self._finish_waiter(w, self._admit(d, w.cost, now, waited))
            elif d.action is Action.REJECT:
                self._finish_waiter(w, self._reject(d, w.cost, waited))
            elif not self.policy.hold.backfill:
                break

    def _draining(self) -> Decision:
        return Decision(Action.REJECT, Reason.DRAINING, self.policy.hold.retry_after_min_s)

    def _retry_after(self, cost: RequestCost, reason: Reason) -> int:
        return retry_after_s(self.policy, self.snapshot, self.ledger.totals, cost, reason)

    def _sort_key(self, cost: RequestCost) -> tuple[int, int]:
        prio = cost.priority if self.policy.hold.low_priority_values_first else -cost.priority
        return (prio, next(self._seq))

    def _admit(
        self, d: Decision, cost: RequestCost, now: float, waited: float, shadow_of: Decision | None = None
    ) -> Ticket:
        entry = LedgerEntry(
            prefill_tokens=cost.uncached_tokens,
            kv_tokens=kv_tokens_needed(self.policy, cost),
            projected_bytes=cost.projected_bytes,
            mamba_slots=mamba_slots_needed(self.policy, self.snapshot, cost),
            charged_at=now,
        )
        key = self.ledger.charge(entry)
        if shadow_of is None:
            self.observer.decision(d, cost, waited, self.ledger.totals)
        return Ticket(self, key, cost, d, waited, shadow_of)

    def _reject(self, d: Decision, cost: RequestCost, waited: float) -> Rejection:
        self.observer.decision(d, cost, waited, self.ledger.totals)
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
