"""The constraints: one small piece per limit, each with its policy section, its check and its reason.

``CONSTRAINTS`` is the order they are evaluated and reported in; the first that fails names the
reason. Every one is evaluated, so ``explain`` and the decision log show all of them. Each reads the
engine's last *fresh* report plus the ledger, because the gauges lag and the ledger does not; a
constraint whose signal is unknown (or stale, where the policy admits blind) passes with a note.

To add a constraint: a class with ``reason``, ``on_exceed`` and ``check`` below, its place in
``CONSTRAINTS``, its reason in ``decision.Reason``, its section in ``rules.Rules`` and in the policy
file (``policy.py``, ``policy.in_force.rules_of``). ``decide`` does not change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Protocol

from sidecar.core.decision import Charge, Check, Reason
from sidecar.core.demand import Demand
from sidecar.core.ledger import LedgerTotals
from sidecar.core.rules import ExceedAction, LimitRules, Rules
from sidecar.core.snapshot import EngineSignals
from sidecar.core.values import positional

# A Check from all six fields in order (name, ok, need, have, note, limit), for the verdicts built on
# every decision: ``Check(...)`` through its slots' descriptors cost ~6.0k instructions, this ~2.6k,
# four times per admission (issue #27, evidence QL1).
_check = positional(Check)


class Reading:
    """What the constraints read, assembled once per decision by ``decide``.

    A plain slotted class, not a frozen dataclass: it lives for one decision, is read only by the
    constraints and kept by nothing, and a frozen value's construction cost ~2.5x as much, per gated
    request (issue #27). Nothing may assign to it after ``__init__``.
    """

    __slots__ = ("charge", "engine", "headroom", "join_pending", "ledger", "rules")

    def __init__(
        self,
        rules: Rules,
        # The engine's report when fresh; None when never read or stale (and the policy admits blind).
        engine: EngineSignals | None,
        # Free VRAM not yet promised; None when there is no usable GPU signal.
        headroom: int | None,
        ledger: LedgerTotals,
        # What admitting the request books: the KV and Mamba figures the checks compare.
        charge: Charge,
        # A request past its first token has not joined the running batch yet (``decide.join_pending``).
        join_pending: bool = False,
    ) -> None:
        self.rules = rules
        self.engine = engine
        self.headroom = headroom
        self.ledger = ledger
        self.charge = charge
        self.join_pending = join_pending


class Constraint(Protocol):
    reason: Reason

    def on_exceed(self, rules: Rules) -> ExceedAction: ...

    def check(self, demand: Demand, r: Reading) -> Check | None:
        """The verdict, or None where the constraint does not apply to this lane."""
        ...

    # Optional: ``applies(rules) -> bool``, False where ``check`` returns None under ``rules`` whatever
    # the reading (``applicable``).


def _usage_below(usage: float | None, limit: float) -> bool:
    return usage is None or usage < limit


class VramHeadroom:
    """The projected transient must fit in what is free and not yet promised to admitted prefills."""

    reason = Reason.VRAM_HEADROOM

    def on_exceed(self, rules: Rules) -> ExceedAction:
        return rules.vram.on_exceed

    def check(self, demand: Demand, r: Reading) -> Check:
        need = r.charge.projected_bytes
        if r.headroom is None:
            return Check(self.reason._value_, True, need, None, "no GPU signal")
        return _check(self.reason._value_, need <= r.headroom, need, r.headroom, "", "")


class BatchJoin:
    """A request that will run beside others: the allocation the running batch makes when it joins.

    The join never coexists with a prefill transient (``CostModel.at_once``): it is checked against
    the free memory before the ledger's prefills (``headroom + projected``), while ``VramHeadroom``
    checks the transients; the running count is the ledger's (admitted, not ended). Reason:
    ``vram_headroom``, check ``batch_join``. Absent when the policy has no join term.
    """

    reason = Reason.VRAM_HEADROOM

    def on_exceed(self, rules: Rules) -> ExceedAction:
        return rules.vram.on_exceed

    def applies(self, rules: Rules) -> bool:
        """A policy without a join term never gets this check (``join_bytes`` is 0 at any count)."""
        cost = rules.cost
        return bool(cost.batch_join_bytes or cost.batch_join_bytes_per_running_request)

    def check(self, demand: Demand, r: Reading) -> Check | None:
        running = r.ledger.running_requests + 1
        need = r.rules.cost.join_bytes(running)
        if not need:
            return None
        if r.headroom is None:
            return Check("batch_join", True, need, None, "no GPU signal")
        have = r.headroom + r.ledger.projected_bytes
        return _check("batch_join", need <= have, need, have, f"joining {running - 1} running", "")


class JoinPending:
    """No new prefill while a request that has finished its prefill has not joined the running batch.

    The join is made in SGLang's next decode step, after any prefill it can form, and nothing can abort it
    then; a prefill admitted in that window stretches it (``docs/design.md``, a join still pending). A
    prompt of at most one chunk is not held. Always a hold; reason ``vram_headroom``, check
    ``join_pending``; absent while no join is pending.
    """

    reason = Reason.VRAM_HEADROOM

    def on_exceed(self, rules: Rules) -> ExceedAction:
        return ExceedAction.HOLD

    def check(self, demand: Demand, r: Reading) -> Check | None:
        if not r.join_pending or demand.uncached_tokens <= demand.chunk_size:
            return None
        return Check("join_pending", False, note="a streaming request has not joined the running batch yet")


class OwnBatch:
    """No new prefill while one priced by its own chunk schedule is prefilling (``decide``).

    Why: such a request was admitted only because it starts its own prefill batch, so its last chunk
    is its own remainder, not a full chunk at the whole context. A request that reached the engine
    before its first batch (a short prompt tokenized faster, a higher priority) would take the head of
    that batch and shift every chunk boundary after it, up to a full last chunk: the peak the price
    left out. Held until its first token (or its end); once it runs, SGLang's chunked request goes
    first in every batch and a newcomer only shares its last chunk's batch, which the ledger's sum
    covers, but the gate cannot see its first batch without the engine's counters. Always a hold.
    Reason ``vram_headroom``, check ``own_schedule``; absent while no such prefill is in flight.
    """

    reason = Reason.VRAM_HEADROOM

    def on_exceed(self, rules: Rules) -> ExceedAction:
        return ExceedAction.HOLD

    def check(self, demand: Demand, r: Reading) -> Check | None:
        if not r.ledger.own_prefills:
            return None
        return Check("own_schedule", False, note="a prefill priced by its own chunk schedule is in flight")


class KvPool:
    """The uncached prompts (plus decode reserves) against free (+evictable) slots and the ledger."""

    reason = Reason.KV_POOL

    def on_exceed(self, rules: Rules) -> ExceedAction:
        return rules.kv.on_exceed

    def check(self, demand: Demand, r: Reading) -> Check:
        kv, e = r.rules.kv, r.engine
        if e is None or e.kv_available_tokens is None:
            usage = e.full_token_usage if e else None
            return Check(
                self.reason._value_, _usage_below(usage, kv.max_usage), kv.max_usage, usage, "usage only"
            )
        free = e.kv_available_tokens + (e.kv_evictable_tokens or 0) * kv.count_evictable_as_free
        have = free - r.ledger.kv_tokens - kv.reserve_tokens
        need = r.charge.kv_tokens
        ok = need <= have and _usage_below(e.full_token_usage, kv.max_usage)
        return _check(self.reason._value_, ok, need, have, "", "")


class MambaSlots:
    """Mamba state slots: a pool apart from KV tokens; it ran out at 2 running requests on lane 2."""

    reason = Reason.MAMBA_SLOTS

    def on_exceed(self, rules: Rules) -> ExceedAction:
        return rules.mamba.on_exceed if rules.mamba is not None else ExceedAction.HOLD

    def applies(self, rules: Rules) -> bool:
        """A lane without a Mamba pool in its policy never gets this check."""
        return rules.mamba is not None

    def check(self, demand: Demand, r: Reading) -> Check | None:
        m, e, need = r.rules.mamba, r.engine, r.charge.mamba_slots
        if m is None or not need:
            return None
        if e is None or e.mamba_available_slots is None:
            usage = e.mamba_usage if e else None
            return Check(
                self.reason._value_, _usage_below(usage, m.max_usage), m.max_usage, usage, "usage only"
            )
        have = e.mamba_available_slots + (e.mamba_evictable_slots or 0) - _mamba_claim(r) - m.reserve_slots
        ok = need <= have and _usage_below(e.mamba_usage, m.max_usage)
        return _check(self.reason._value_, ok, need, have, "", "")


def _mamba_claim(r: Reading) -> int:
    """Slots admitted requests will still take that the engine may not show as used yet.

    A request keeps its Mamba slots (working state plus prefill checkpoints) until it ends, and the
    engine reports in-flight checkpoints as *evictable* although eviction cannot take them (evidence
    I10, D13): so every admitted request is charged until its end (``running_mamba_slots``), less the
    working slots of those past their first token, which the engine shows as used by then (one
    sequence each is assumed: the smaller deduction). An engine that reports checkpoints as used is
    charged them twice: the safe side.
    """
    m, t = r.rules.mamba, r.ledger
    assert m is not None
    decoding = t.running_requests - t.requests  # never negative: a prefilling request is running too
    return max(t.mamba_slots, t.running_mamba_slots - m.slots_per_request * decoding)


@dataclass(frozen=True, slots=True)
class WorkAhead:
    """Work waiting in the engine ahead of this request (the larger of the engine's gauge and the
    ledger: the gauge lags, the ledger does not) plus this request's own, within a limit. A request
    alone passes: pending prefill tokens of one long prompt, or the ``n`` copies of one sampled prompt,
    are no reason to wait for ever. A request over the engine's own limits never gets here
    (``decide._unfit``: the sequence bound, the running-request limit, the pool's decode room).

    Two constraints have this shape: the engine queue (sequences not yet prefilled; a request waiting
    *inside* SGLang is beyond the gate's reach) and pending prefill tokens.
    """

    reason: Reason
    # Its policy section (a ``limit`` and an ``on_exceed``), the engine's report of the work ahead, and
    # the share of it one request has (the same field of the ledger's totals and of a charge).
    section: Callable[[Rules], LimitRules]
    reported: Callable[[EngineSignals], int | None]
    share: Callable[[LedgerTotals | Charge], int]

    def on_exceed(self, rules: Rules) -> ExceedAction:
        return self.section(rules).on_exceed

    def check(self, demand: Demand, r: Reading) -> Check:
        reported = (self.reported(r.engine) if r.engine else None) or 0
        booked = self.share(r.ledger)
        ahead = booked if booked > reported else reported  # max(reported, booked): no builtin call
        need = ahead + self.share(r.charge)
        limit = self.section(r.rules).limit
        return _check(self.reason._value_, ahead == 0 or need <= limit, need, limit, "", "")


# Attribute getters (C calls, not lambdas: each check reads four of them per decision).
# fmt: off
ENGINE_QUEUE = WorkAhead(Reason.ENGINE_QUEUE, attrgetter("engine_queue"), attrgetter("queue_requests"), attrgetter("sequences"))
PENDING_PREFILL = WorkAhead(Reason.PENDING_PREFILL_TOKENS, attrgetter("pending_prefill"), attrgetter("pending_prefill_tokens"), attrgetter("prefill_tokens"))
# fmt: on

CONSTRAINTS: tuple[Constraint, ...] = (
    VramHeadroom(),
    BatchJoin(),
    JoinPending(),
    OwnBatch(),
    KvPool(),
    MambaSlots(),
    ENGINE_QUEUE,
    PENDING_PREFILL,
)


def applicable(rules: Rules, among: tuple[Constraint, ...] = CONSTRAINTS) -> tuple[Constraint, ...]:
    """``among`` less those that never apply under ``rules`` (their ``applies``: no join term, no
    Mamba pool), in the same order: what ``decide`` asks, once per rules (``decide._LaneView``), not
    two calls per decision that return None (issue #27). The checks and their order are unchanged
    (``tests/test_core_lane_view.py`` compares decisions with every constraint asked)."""
    return tuple(c for c in among if getattr(c, "applies", None) is None or c.applies(rules))  # type: ignore[attr-defined]
