"""The admission decision: one pure function of (request cost, signals, ledger, policy, now).

No I/O, no clock reads, no awaits. The live proxy, ``replay``, ``explain`` and the benchmarks all
call :func:`decide`; what differs between them is only where the snapshot comes from.

Order of evaluation, and why:

1. **unfit_request** - a request that could never fit this lane (longer than the context, larger than
   the KV pool, a transient larger than the lane can ever free). Holding it would only delay the 503.
2. **engine_unavailable / signals_stale** - without fresh signals the gate is blind; the policy says,
   per signal, whether blind means hold, reject or admit.
3. **the constraints** - VRAM headroom, KV pool, Mamba slots, engine queue, pending prefill tokens.
   Each is evaluated (so ``explain`` and the decision log show every one), the first failure in this
   order names the reason. Each reads the engine's last report *plus the ledger*, because the gauges
   lag and the ledger does not.
4. **the hold queue's bounds** - a request that must wait is rejected with ``queue_full`` when the
   queue is full, and with ``hold_timeout`` once it has waited ``hold.max_wait_s``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from sidecar.cost import RequestCost
from sidecar.ledger import LedgerTotals
from sidecar.policy import ExceedAction, Policy, SignalPolicy, StaleAction
from sidecar.signals.snapshot import Snapshot


class Action(StrEnum):
    ADMIT = "admit"
    HOLD = "hold"
    REJECT = "reject"


class Reason(StrEnum):
    """Stable reason codes: headers, metrics labels and dashboards depend on these strings."""

    VRAM_HEADROOM = "vram_headroom"
    KV_POOL = "kv_pool"
    MAMBA_SLOTS = "mamba_slots"
    ENGINE_QUEUE = "engine_queue"
    PENDING_PREFILL_TOKENS = "pending_prefill_tokens"
    UNFIT_REQUEST = "unfit_request"
    SIGNALS_STALE = "signals_stale"
    QUEUE_FULL = "queue_full"
    HOLD_TIMEOUT = "hold_timeout"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    DRAINING = "draining"


@dataclass(frozen=True, slots=True)
class Check:
    """One constraint's verdict with the numbers that decided it (for explain and the decision log)."""

    name: str
    ok: bool
    need: float | None = None
    have: float | None = None
    note: str = ""


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: Reason | None
    retry_after_s: int | None = None
    headroom_bytes: int | None = None
    checks: tuple[Check, ...] = field(default_factory=tuple)

    @property
    def admitted(self) -> bool:
        return self.action is Action.ADMIT


def mamba_slots_needed(policy: Policy, snap: Snapshot, cost: RequestCost) -> int:
    """Slots a new request will hold (working state plus its prefill checkpoints), on lanes with a pool."""
    m = policy.mamba
    if m is None:
        return 0
    e = snap.engine
    if policy.lane.mamba_slots is None and not (e is not None and e.mamba_total_slots):
        return 0
    checkpoints = (
        math.ceil(cost.prompt_tokens / m.checkpoint_interval_tokens) if m.checkpoint_interval_tokens else 0
    )
    return m.slots_per_request + checkpoints


def kv_tokens_needed(policy: Policy, cost: RequestCost) -> int:
    return cost.uncached_tokens + math.ceil(policy.kv.decode_reserve_fraction * cost.max_new_tokens)


def headroom_bytes(policy: Policy, snap: Snapshot, ledger: LedgerTotals) -> int | None:
    """Free VRAM (live, or the lane's idle budget) minus the reserve minus what admitted prefills will
    still allocate (see ``policy.HeadroomSource`` for which free memory and why).

    With live NVML free, a prefill already running is charged both in NVML (its live transient) and in
    the ledger until its first token, which errs on the safe side for the length of one prefill.
    """
    v = policy.vram
    if not v.uses_gpu_signal:
        assert v.idle_free_bytes is not None
        free = v.idle_free_bytes
        other = snap.gpu.other_process_bytes if snap.gpu is not None else None
        if other is not None and v.other_processes_bytes is not None:
            free -= max(0, other - v.other_processes_bytes)  # a neighbour grew: it is not the engine's
    elif snap.gpu is None or snap.gpu.free_bytes is None:
        return None
    else:
        free = snap.gpu.free_bytes
    return free - v.reserve_bytes - ledger.projected_bytes


def decide(
    cost: RequestCost,
    snap: Snapshot,
    ledger: LedgerTotals,
    policy: Policy,
    now: float,
    *,
    held: int = 0,
    queued: bool = False,
    waited_s: float = 0.0,
) -> Decision:
    """Admit, hold or reject one request.

    ``held`` is the number of requests in the hold queue, ``queued`` whether this request is one of
    them (a queued request is never rejected for ``queue_full``), ``waited_s`` how long it has waited.
    """
    headroom = headroom_bytes(policy, snap, ledger)
    action, reason, checks = _judge(cost, snap, ledger, policy, now, headroom)
    # The hold queue's own bounds turn a hold into a rejection.
    if action is Action.HOLD and waited_s >= policy.hold.max_wait_s:
        action, reason = Action.REJECT, Reason.HOLD_TIMEOUT
    elif action is Action.HOLD and not queued and held >= policy.hold.max_held:
        action, reason = Action.REJECT, Reason.QUEUE_FULL
    retry = retry_after_s(policy, snap, ledger, cost, reason) if action is Action.REJECT else None
    return Decision(action, reason, retry, headroom, checks)


def _judge(
    cost: RequestCost,
    snap: Snapshot,
    ledger: LedgerTotals,
    policy: Policy,
    now: float,
    headroom: int | None,
) -> tuple[Action, Reason | None, tuple[Check, ...]]:
    """Steps 1-3 of the module docstring: fit, sight, then the constraints."""
    unfit = _unfit(cost, snap, policy)
    if unfit is not None:
        return Action.REJECT, Reason.UNFIT_REQUEST, (unfit,)
    blind = _blindness(snap, policy, now)
    if blind is not None:
        action, reason, check = blind
        return action, reason, (check,)
    checks = _constraints(cost, snap, ledger, policy, now, headroom)
    failed = next((c for c in checks if not c.ok), None)
    if failed is None:
        return Action.ADMIT, None, checks
    hold = _on_exceed(policy, failed.name) is ExceedAction.HOLD
    return (Action.HOLD if hold else Action.REJECT), Reason(failed.name), checks


def _unfit(cost: RequestCost, snap: Snapshot, policy: Policy) -> Check | None:
    e = snap.engine
    context_len = (e.context_len if e else None) or policy.lane.context_len
    pool = (e.max_total_tokens if e else None) or policy.lane.kv_pool_tokens
    # An estimated count over-counts on purpose; only an exact count may condemn a request for length.
    if cost.exact:
        total = cost.prompt_tokens + cost.max_new_tokens
        if cost.prompt_tokens >= context_len or total > context_len:
            return Check("unfit_request", False, total, context_len, "prompt + max_new_tokens > context")
        if pool is not None and kv_tokens_needed(policy, cost) > pool - policy.kv.reserve_tokens:
            return Check("unfit_request", False, kv_tokens_needed(policy, cost), pool, "larger than KV pool")
    slots = mamba_slots_needed(policy, snap, cost)
    pool_slots = (e.mamba_total_slots if e else None) or policy.lane.mamba_slots
    if (
        slots
        and pool_slots is not None
        and policy.mamba is not None
        and slots > pool_slots - policy.mamba.reserve_slots
    ):
        return Check("unfit_request", False, slots, pool_slots, "more Mamba slots than the pool has")
    cap = policy.vram.transient_cap()
    if cap is not None and cost.projected_bytes > cap:
        return Check(
            "unfit_request", False, cost.projected_bytes, cap, "transient larger than the lane frees"
        )
    return None


def _blindness(snap: Snapshot, policy: Policy, now: float) -> tuple[Action, Reason, Check] | None:
    """Engine and GPU signals: unavailable, stale, or fine. The policy's choice is applied per signal."""
    health = snap.engine_health
    if health.consecutive_failures >= policy.engine.unavailable_after_failures:
        note = health.last_error or "engine unreachable"
        return Action.REJECT, Reason.ENGINE_UNAVAILABLE, Check("engine_unavailable", False, note=note)
    for name, age, sp in (
        ("engine", snap.engine_age(now), policy.engine),
        (
            "gpu",
            snap.gpu_age(now),
            policy.gpu if policy.gpu.required and policy.vram.uses_gpu_signal else None,
        ),
    ):
        if sp is None or (age is not None and age <= sp.max_age_s) or sp.on_stale is StaleAction.ADMIT:
            continue  # fresh, or the policy admits blind on this signal (its constraints then pass)
        check = Check("signals_stale", False, sp.max_age_s, age, f"{name} signals " + _age_text(age))
        return _stale_action(sp), Reason.SIGNALS_STALE, check
    return None


def _age_text(age: float | None) -> str:
    return "never read" if age is None else f"{age:.1f}s old"


def _stale_action(sp: SignalPolicy) -> Action:
    return Action.REJECT if sp.on_stale is StaleAction.REJECT else Action.HOLD


def _fresh(snap_age: float | None, sp: SignalPolicy) -> bool:
    return snap_age is not None and snap_age <= sp.max_age_s


def _constraints(
    cost: RequestCost,
    snap: Snapshot,
    ledger: LedgerTotals,
    policy: Policy,
    now: float,
    headroom: int | None,
) -> tuple[Check, ...]:
    """Every constraint, in reason order. A constraint whose signal is unknown or stale-but-admitted
    passes with a note: the policy chose to admit blind, and the log says so."""
    e = snap.engine if _fresh(snap.engine_age(now), policy.engine) else None
    checks: list[Check] = []

    # VRAM headroom: the projected transient must fit in what is free and not yet promised.
    live_ok = not policy.vram.uses_gpu_signal or _fresh(snap.gpu_age(now), policy.gpu)
    if headroom is None or not live_ok:
        checks.append(Check("vram_headroom", True, cost.projected_bytes, None, "no GPU signal"))
    else:
        checks.append(
            Check("vram_headroom", cost.projected_bytes <= headroom, cost.projected_bytes, headroom)
        )

    # KV pool: uncached prompt (plus decode reserve) against free (+evictable) slots and the ledger.
    need_kv = kv_tokens_needed(policy, cost)
    if e is None or e.kv_available_tokens is None:
        usage = e.full_token_usage if e else None
        ok = usage is None or usage < policy.kv.max_usage
        checks.append(Check("kv_pool", ok, policy.kv.max_usage, usage, "usage only"))
    else:
        free = e.kv_available_tokens + (e.kv_evictable_tokens or 0) * policy.kv.count_evictable_as_free
        have = free - ledger.kv_tokens - policy.kv.reserve_tokens
        usage_ok = e.full_token_usage is None or e.full_token_usage < policy.kv.max_usage
        checks.append(Check("kv_pool", need_kv <= have and usage_ok, need_kv, have))

    # Mamba state slots: a separate pool; it ran out at 2 running requests on lane 2.
    slots = mamba_slots_needed(policy, snap, cost)
    if policy.mamba is not None and slots:
        m = policy.mamba
        if e is None or e.mamba_available_slots is None:
            usage = e.mamba_usage if e else None
            ok = usage is None or usage < m.max_usage
            checks.append(Check("mamba_slots", ok, m.max_usage, usage, "usage only"))
        else:
            free = e.mamba_available_slots + (e.mamba_evictable_slots or 0)
            have = free - ledger.mamba_slots - m.reserve_slots
            usage_ok = e.mamba_usage is None or e.mamba_usage < m.max_usage
            checks.append(Check("mamba_slots", slots <= have and usage_ok, slots, have))

    # Engine queue: requests inside SGLang not yet prefilled. The gauge lags, the ledger does not.
    waiting = max((e.queue_requests or 0) if e else 0, ledger.requests)
    limit = policy.engine_queue.max_requests
    checks.append(Check("engine_queue", waiting + 1 <= limit, waiting + 1, limit))

    # Pending prefill tokens ahead of this request; a request alone always passes this one.
    ahead = max((e.pending_prefill_tokens or 0) if e else 0, ledger.prefill_tokens)
    cap = policy.pending_prefill.max_tokens
    ok = ahead == 0 or ahead + cost.uncached_tokens <= cap
    checks.append(Check("pending_prefill_tokens", ok, ahead + cost.uncached_tokens, cap))
    return tuple(checks)


def _on_exceed(policy: Policy, name: str) -> ExceedAction:
    section = {
        "vram_headroom": policy.vram,
        "kv_pool": policy.kv,
        "mamba_slots": policy.mamba,
        "engine_queue": policy.engine_queue,
        "pending_prefill_tokens": policy.pending_prefill,
    }[name]
    return section.on_exceed if section is not None else ExceedAction.HOLD


def retry_after_s(
    policy: Policy,
    snap: Snapshot,
    ledger: LedgerTotals,
    cost: RequestCost,
    reason: Reason | None,
) -> int:
    """A bounded estimate, never 0: how long until the prefill work ahead of this request drains.

    Unfit requests get the maximum: retrying them will not help, but clients that honour Retry-After
    should not hammer the lane.
    """
    h = policy.hold
    if reason is Reason.UNFIT_REQUEST:
        return h.retry_after_max_s
    e = snap.engine
    ahead = max((e.pending_prefill_tokens or 0) if e else 0, ledger.prefill_tokens)
    estimate = (ahead + cost.uncached_tokens) / h.prefill_tokens_per_s
    if reason in (Reason.SIGNALS_STALE, Reason.ENGINE_UNAVAILABLE):
        estimate = max(estimate, policy.engine.max_age_s)
    return int(min(h.retry_after_max_s, max(h.retry_after_min_s, math.ceil(estimate))))
