"""The admission decision: one pure function, ``decide(demand, situation) -> Decision``.

No I/O, no clock reads, no awaits: the live proxy, ``replay``, ``explain`` and the benchmarks all call it.
The rules, in the order applied: draining, unfit_request (more sequences than the
policy, the engine queue or its running limit allow included), engine_unavailable / signals_stale, the
constraints (``constraints.CONSTRAINTS``), strict order, the hold queue's bounds (a newcomer whose
expected wait already outlasts its deadline is ``hold_timeout`` at once); ``docs/design.md`` says why
each is where it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sidecar.core.constraints import CONSTRAINTS, Reading, applicable
from sidecar.core.decision import STRICT_ORDER, Action, Charge, Check, Decision, Reason
from sidecar.core.demand import Demand
from sidecar.core.ledger import LedgerTotals
from sidecar.core.rules import ExceedAction, Rules, SignalRules, VramRules
from sidecar.core.snapshot import GpuSignals, Snapshot
from sidecar.core.values import fast_init, positional


@fast_init
@dataclass(frozen=True, slots=True)
class Situation:
    """Everything but the request: the policy, the signals, the ledger, the clock and the queue."""

    rules: Rules
    snapshot: Snapshot
    ledger: LedgerTotals
    now: float
    # Requests in the hold queue; whether this one is among them (it is then never ``queue_full``).
    held: int = 0
    queued: bool = False
    # The reason of the earliest request waiting ahead of this one (None: nobody waits ahead).
    ahead: Reason | None = None
    draining: bool = False
    # For Retry-After: uncached prompt tokens of the requests held (they go first), and the prefill
    # rate the lane has been measured at (None: the policy's ``hold.prefill_tokens_per_s``).
    held_tokens: int = 0
    prefill_tokens_per_s: float | None = None
    # A request past its first token may not have joined the running batch yet: the earliest instant
    # it is taken to have, once no admitted prefill is ahead of it (None: no join pending).
    join_settles_at: float | None = None
    # The shell sees a prefill's first batch and its cache hit (the engine's prefill counters) and the
    # in-flight guard is on: a request that starts its own prefill batch may then be priced by its own
    # chunk schedule, the guard aborting it if the engine's hit turns out to move its chunks.
    verifies_hits: bool = False


# A Situation from its twelve fields in declaration order: what the controller builds for every
# decision (``values.positional``: 3.5k instructions against 10.4k through ``Situation(...)``, QL1).
make_situation = positional(Situation)


def join_pending(s: Situation) -> bool:
    """Whether a streaming request's batch join may still be to come (``constraints.JoinPending``).

    The engine runs every prefill it has before the decode step that makes the join, so the join is
    pending while any admitted prefill has not finished (the ledger's), and for the settle time after
    the last one (the shell moves ``join_settles_at`` to one settle time after each prefill that ends
    while a join is pending)."""
    return s.join_settles_at is not None and (s.ledger.requests > 0 or s.now < s.join_settles_at)


def join_settles(at: float | None, now: float, settle_s: float, *, joins: bool) -> float | None:
    """``Situation.join_settles_at`` after an admitted prefill ended at ``now`` (its first token, an
    abort, a failure). ``joins``: a streamed first token of a request that joins a running batch of
    others (``CostModel.join_bytes`` of it is not 0). A join pending before stays pending one settle
    time past every prefill that ends ahead of it: the engine's decode step comes after them."""
    if not joins and at is None:
        return None
    return max(now + settle_s, now if at is None else at)


def decide(demand: Demand, s: Situation) -> Decision:
    """Admit, hold or reject one request (steps 1-6 of the module docstring)."""
    rules = s.rules
    if s.draining:
        return Decision(Action.REJECT, Reason.DRAINING, retry_after_s(s, Reason.DRAINING), check="draining")
    lane = _lane_view(rules, s.snapshot)
    # ``charge_of`` and ``headroom_bytes``, from the figures they read of the rules and the snapshot.
    charge = _charge(
        demand.uncached_tokens,  # prefill_tokens
        demand.kv_tokens,
        demand.projected_bytes,
        demand.mamba_slots if lane.has_pool else 0,  # mamba_slots
        0,  # own_prefills
        demand.sequences,
    )
    headroom = None if lane.free is None else lane.free - s.ledger.projected_bytes
    action, reason, checks, by = _judge(demand, s, lane, charge, headroom)
    if action is not Action.ADMIT and _starts_own_batch(demand, s):
        own = replace(charge, projected_bytes=demand.own_bytes(rules), own_prefills=1)
        verdict = _judge(demand, s, lane, own, headroom)
        if verdict[0] is Action.ADMIT:
            (action, reason, checks, by), charge = verdict, own
    if action is Action.ADMIT:
        if s.queued and rules.experimental.gpu_reading_after_wait:
            old = _gpu_predates_wait(demand, s)
            if old is not None:
                action, reason, checks, by = Action.HOLD, Reason.SIGNALS_STALE, (*checks, old), old.name
        if action is Action.ADMIT and s.ahead is not None and not rules.hold.backfill:
            action, reason, by = Action.HOLD, s.ahead, STRICT_ORDER
        if action is Action.ADMIT:  # the norm: nothing below applies to an admission
            return _decision(action, None, None, headroom, checks, charge, by)
    if action is Action.HOLD and s.now >= demand.deadline:
        action, reason = Action.REJECT, Reason.HOLD_TIMEOUT
    elif action is Action.HOLD and not s.queued and s.held >= rules.hold.max_held:
        action, reason = Action.REJECT, Reason.QUEUE_FULL
    elif action is Action.HOLD and not s.queued:
        late = _expected_late(demand, s)
        if late is not None:
            action, reason, checks = Action.REJECT, Reason.HOLD_TIMEOUT, (*checks, late)
    if reason in (Reason.HOLD_TIMEOUT, Reason.QUEUE_FULL):
        by = reason.value
    retry = retry_after_s(s, reason, demand.uncached_tokens) if action is Action.REJECT else None
    return Decision(action, reason, retry, headroom, checks, charge, by)


# A Charge and an admission's Decision from their fields in declaration order (``values.positional``:
# through a twin class, ~2x cheaper than their ``__init__``, per gated request; evidence QL1).
_charge = positional(Charge)
_decision = positional(Decision)


class _LaneView:
    """What ``decide`` reads of one (rules, snapshot) pair, apart from the clock, the ledger and the
    request: taken once per pair (``_lane_view``), not per request (issue #27). A snapshot changes only
    when a poller reads, the rules on a reload or a lesson; a lane decides many requests in between.

    Each figure is what the function named beside it computes from the pair. Where a figure could
    change the decision's course (an unfit request, a blind signal) ``decide`` calls that function
    itself, so every check and its numbers stay that function's: the view only says when it need not.
    """

    __slots__ = (
        "cap",
        "constraints",
        "context_len",
        "engine",
        "engine_blinds",
        "engine_max_age",
        "engine_read_at",
        "free",
        "gpu_blinds",
        "gpu_max_age",
        "gpu_read_at",
        "gpu_signal",
        "has_pool",
        "kv_have",
        "mamba_have",
        "rules",
        "sequences",
        "snapshot",
        "unsighted",
    )

    def __init__(self, rules: Rules, snap: Snapshot) -> None:
        self.rules, self.snapshot = rules, snap
        e, m, v = snap.engine, rules.mamba, rules.vram
        self.engine = e
        # charge_of: Mamba slots only where the lane has a Mamba pool.
        self.has_pool = rules.lane.mamba_slots is not None or (e is not None and bool(e.mamba_total_slots))
        # headroom_bytes before the ledger's share (None: no usable GPU signal).
        if not v.uses_gpu_signal:
            self.free: int | None = idle_budget(v, snap.gpu) - v.reserve_bytes
        elif snap.gpu is None or snap.gpu.free_bytes is None:
            self.free = None
        else:
            self.free = snap.gpu.free_bytes - v.reserve_bytes
        self.gpu_signal = v.uses_gpu_signal
        # _fresh(engine_age / gpu_age): max(0, now - read) <= max_age is now - read <= max_age for a
        # max_age >= 0; a negative one is never fresh (-inf).
        self.engine_read_at = None if e is None else e.observed_at
        self.engine_max_age = _fresh_bound(rules.engine)
        self.gpu_read_at = None if snap.gpu is None else snap.gpu.observed_at
        self.gpu_max_age = _fresh_bound(rules.gpu)
        # _blindness: what does not depend on the clock (an unavailable engine, the wait for a GPU
        # reading after a restart), and which stale signal blinds (the policy does not admit on it).
        self.unsighted = _sightless(rules, snap) is not None
        self.engine_blinds = rules.engine.on_stale is not Action.ADMIT
        self.gpu_blinds = rules.gpu.required and v.uses_gpu_signal and rules.gpu.on_stale is not Action.ADMIT
        # _unfit: the limits each judge compares with (inf: no such limit). A request over none of
        # them is fit; one over any is judged by ``_unfit`` itself.
        running = (e.max_running_requests if e else None) or rules.lane.max_running_requests
        limits = [x for x in (rules.max_sequences_per_request, running) if x is not None]
        self.sequences = min(limits, default=math.inf)
        self.context_len = (e.context_len if e else None) or rules.lane.context_len
        pool = (e.max_total_tokens if e else None) or rules.lane.kv_pool_tokens
        self.kv_have = math.inf if pool is None else pool - rules.kv.reserve_tokens
        slots = (e.mamba_total_slots if e else None) or rules.lane.mamba_slots
        self.mamba_have = math.inf if slots is None or m is None else slots - m.reserve_slots
        cap = v.transient_cap()
        self.cap = math.inf if cap is None else cap
        # The constraints that can give a check under these rules, in order (``constraints.applicable``).
        self.constraints = applicable(rules, CONSTRAINTS)

    def maybe_unfit(self, demand: Demand, charge: Charge) -> bool:
        """False where ``_unfit`` finds nothing for sure: the request is within every limit it reads."""
        seq, have = demand.sequences, self.kv_have
        return (
            seq > self.sequences
            or seq > have
            or charge.kv_tokens > have
            or demand.kv_tokens - demand.uncached_tokens > have
            or (
                demand.exact
                and (
                    demand.prompt_tokens >= self.context_len
                    or demand.prompt_tokens + demand.max_new_tokens > self.context_len
                )
            )
            or charge.mamba_slots > self.mamba_have
            or charge.projected_bytes > self.cap
        )


def _fresh_bound(sr: SignalRules) -> float:
    return sr.max_age_s if sr.max_age_s >= 0 else -math.inf


# The view of the last (rules, snapshot) pair decided on (one entry: the live lane's pair changes
# seldom; another caller's pair only takes the entry over). Replaced whole, never changed in place.
_last_view: _LaneView | None = None


def _lane_view(rules: Rules, snap: Snapshot) -> _LaneView:
    global _last_view
    view = _last_view
    if view is None or view.rules is not rules or view.snapshot is not snap:
        view = _last_view = _LaneView(rules, snap)
    return view


def expected_wait_s(s: Situation) -> float | None:
    """The least a newcomer held now waits: the prefill work ahead of it (the tokens forwarded to the
    engine, the engine's count or the ledger's, and under strict order those of the requests held in
    front) at the lane's MEASURED prefill rate. None until the rate is measured: the policy's
    ``hold.prefill_tokens_per_s`` is another lane's assumption, fine for a Retry-After hint, not for
    refusing a request."""
    rate = s.prefill_tokens_per_s
    if not rate or rate <= 0:
        return None
    e = s.snapshot.engine
    forwarded = max((e.pending_prefill_tokens or 0) if e else 0, s.ledger.prefill_tokens)
    ahead = 0 if s.rules.hold.backfill else s.held_tokens
    return (forwarded + ahead) / rate


def _expected_late(demand: Demand, s: Situation) -> Check | None:
    """The check that refuses a newcomer at once (``hold_timeout`` with Retry-After) when the work
    ahead of it at the measured rate already outlasts its deadline: parked, it would only time out."""
    wait = expected_wait_s(s)
    if wait is None or s.now + wait <= demand.deadline:
        return None
    note = "expected wait (work ahead at the measured prefill rate) exceeds hold.max_wait_s"
    return Check("expected_wait", False, round(wait, 3), round(demand.deadline - s.now, 3), note)


def _starts_own_batch(demand: Demand, s: Situation) -> bool:
    """Whether this request, admitted now, starts its own prefill batch, so that its chunks run in full
    steps from its cache hit (``cost.project_own``): a single prompt, nothing admitted still
    prefilling (the ledger), nothing waiting or prefilling in the engine's fresh report, and a shell
    that sees its first batch and its cache hit (``Situation.verifies_hits``). Nothing can start ahead
    of it afterwards: ``constraints.OwnBatch`` holds newcomers until its prefill ends."""
    e = s.snapshot.engine
    return (
        s.verifies_hits
        and demand.prompts == 1
        and not s.ledger.requests
        and e is not None
        and _fresh(s.snapshot.engine_age(s.now), s.rules.engine)
        and e.queue_requests == 0
        and e.pending_prefill_tokens == 0
    )


def charge_of(demand: Demand, rules: Rules, snap: Snapshot) -> Charge:
    """What admitting the request books: Mamba slots only where the lane has a Mamba pool."""
    e = snap.engine
    has_pool = rules.lane.mamba_slots is not None or (e is not None and bool(e.mamba_total_slots))
    return Charge(
        prefill_tokens=demand.uncached_tokens,
        kv_tokens=demand.kv_tokens,
        projected_bytes=demand.projected_bytes,
        mamba_slots=demand.mamba_slots if has_pool else 0,
        sequences=demand.sequences,
    )


def headroom_bytes(rules: Rules, snap: Snapshot, ledger: LedgerTotals) -> int | None:
    """Free VRAM (live, or the lane's idle budget) minus the reserve minus what admitted prefills will
    still allocate (``rules.HeadroomSource`` says which free memory and why).

    With live NVML free, a prefill already running is charged both in NVML (its live transient) and in
    the ledger until its first token, which errs on the safe side for the length of one prefill.
    """
    v = rules.vram
    if not v.uses_gpu_signal:
        free = idle_budget(v, snap.gpu)
    elif snap.gpu is None or snap.gpu.free_bytes is None:
        return None
    else:
        free = snap.gpu.free_bytes
    return free - v.reserve_bytes - ledger.projected_bytes


def idle_budget(v: VramRules, gpu: GpuSignals | None) -> int:
    """The idle budget (``idle_budget`` headroom) before the reserve and the ledger: the minimum over the
    GPUs of each one's idle free memory less what THAT GPU's other processes grew by since, never more
    than the figure in force (``v.idle_free_bytes``). The ledger's share is the same on every GPU of a
    tensor-parallel group (each holds its shard of every transient), so taking it off after the minimum
    is taking it off each. A GPU measured at idle (``v.idle_devices``) is compared with its own
    baseline; any other with the policy's ``other_processes_bytes``. A neighbour that was on GPU 0 from
    the start and one that grows on GPU 1 are then told apart (one maximum over all GPUs was not)."""
    assert v.idle_free_bytes is not None
    free = v.idle_free_bytes
    if gpu is None:
        return free
    base = {b.ident: b for b in v.idle_devices}
    for d in gpu.devices:
        b = base.get(d.ident)
        if b is not None:
            idle, before = b.free_bytes, b.other_process_bytes
        else:
            idle, before = v.idle_free_bytes, v.other_processes_bytes
        grown = (
            0 if d.other_process_bytes is None or before is None else max(0, d.other_process_bytes - before)
        )
        free = min(free, idle - grown)  # a neighbour grew on this GPU: it is not the engine's
    return free


def _judge(
    demand: Demand, s: Situation, lane: _LaneView, charge: Charge, headroom: int | None
) -> tuple[Action, Reason | None, tuple[Check, ...], str | None]:
    """Steps 2-4: fit, sight, then the constraints; with the name of the check that decided."""
    if lane.maybe_unfit(demand, charge):
        unfit = _unfit(demand, s, charge)
        if unfit is not None:
            return Action.REJECT, Reason.UNFIT_REQUEST, (unfit,), unfit.name
    now = s.now
    read_at = lane.engine_read_at
    engine_fresh = read_at is not None and now - read_at <= lane.engine_max_age
    read_at = lane.gpu_read_at
    gpu_fresh = read_at is not None and now - read_at <= lane.gpu_max_age
    if lane.unsighted or (lane.engine_blinds and not engine_fresh) or (lane.gpu_blinds and not gpu_fresh):
        blind = _blindness(s)
        if blind is not None:
            action, reason, check = blind
            return action, reason, (check,), check.name
    rules, ledger, settles = s.rules, s.ledger, s.join_settles_at
    # Positional, in ``Reading``'s field order (built per decision: issue #27).
    reading = Reading(
        rules,
        lane.engine if engine_fresh else None,  # engine
        headroom if gpu_fresh or not lane.gpu_signal else None,  # headroom
        ledger,
        charge,
        settles is not None and (ledger.requests > 0 or now < settles),  # join_pending(s)
    )
    checks: list[Check] = []
    failed: tuple[Reason, ExceedAction, str] | None = None
    for c in lane.constraints:  # CONSTRAINTS less those that never apply under these rules
        check = c.check(demand, reading)
        if check is None:
            continue
        checks.append(check)
        if failed is None and not check.ok:
            failed = (c.reason, c.on_exceed(rules), check.name)
    if failed is None:
        return Action.ADMIT, None, tuple(checks), None
    reason, on_exceed, by = failed
    action = Action.HOLD if on_exceed is ExceedAction.HOLD else Action.REJECT
    return action, reason, tuple(checks), by


def _unfit(demand: Demand, s: Situation, charge: Charge) -> Check | None:
    """The first limit of this lane the request can never fit (step 2), or None."""
    for judge in (_too_many_sequences, _too_long_or_too_large, _decode_room, _too_many_mamba_slots, _too_hot):
        check = judge(demand, s, charge)
        if check is not None:
            return check
    return None


def _pool_tokens(s: Situation) -> int | None:
    e = s.snapshot.engine
    return (e.max_total_tokens if e else None) or s.rules.lane.kv_pool_tokens


def _too_long_or_too_large(demand: Demand, s: Situation, charge: Charge) -> Check | None:
    """Longer than the context, or larger than the KV pool. An estimated count over-counts on purpose;
    only an exact count may condemn a request for length."""
    if not demand.exact:
        return None
    rules, e, name = s.rules, s.snapshot.engine, Reason.UNFIT_REQUEST.value
    context_len = (e.context_len if e else None) or rules.lane.context_len
    total = demand.prompt_tokens + demand.max_new_tokens
    if demand.prompt_tokens >= context_len or total > context_len:
        return Check(name, False, total, context_len, "prompt + max_new_tokens > context", "context")
    pool = _pool_tokens(s)
    have = None if pool is None else pool - rules.kv.reserve_tokens
    if have is not None and charge.kv_tokens > have:
        return Check(name, False, charge.kv_tokens, have, "larger than KV pool", "kv_pool")
    return None


def _too_many_mamba_slots(demand: Demand, s: Situation, charge: Charge) -> Check | None:
    e, m, needs = s.snapshot.engine, s.rules.mamba, charge.mamba_slots
    pool_slots = (e.mamba_total_slots if e else None) or s.rules.lane.mamba_slots
    if needs and pool_slots is not None and m is not None and needs > pool_slots - m.reserve_slots:
        have = pool_slots - m.reserve_slots
        note = "more Mamba slots than the pool has"
        return Check(Reason.UNFIT_REQUEST.value, False, needs, have, note, "mamba_slots")
    return None


def _too_hot(demand: Demand, s: Situation, charge: Charge) -> Check | None:
    cap = s.rules.vram.transient_cap()
    if cap is not None and charge.projected_bytes > cap and _smallest(demand, s, charge) > cap:
        note = "transient larger than the lane frees"
        return Check(Reason.UNFIT_REQUEST.value, False, charge.projected_bytes, cap, note, "transient")
    return None


def _decode_room(demand: Demand, s: Situation, charge: Charge) -> Check | None:
    """The decode room, whatever the prompt's count: every sequence writes at least one output token
    into the pool, and the decode reserve of all of them (``Demand.kv_tokens`` less the prompt) must
    fit. Not "alone always passes": a request the pool cannot hold is refused at once."""
    pool = _pool_tokens(s)
    if pool is None:
        return None
    have = pool - s.rules.kv.reserve_tokens
    decode = max(demand.sequences, demand.kv_tokens - demand.uncached_tokens)
    if decode <= have:
        return None
    note = "sequences' decode room larger than KV pool"
    return Check(Reason.UNFIT_REQUEST.value, False, decode, have, note, "kv_pool")


def _too_many_sequences(demand: Demand, s: Situation, charge: Charge) -> Check | None:
    """More sequences (prompts x samples: ``n``, ``best_of``, a batch) than one request may have: the
    policy's bound and the engine's running-request limit (each sequence runs as a request there, so a
    request over it can never be taken whole; letting it in alone handed SGLang a million). The
    policy's ``engine_queue.max_requests`` is a throttle, not the engine's limit: a request alone still
    passes it (SGLang prefills the ``n`` copies of a cached prompt as one batch)."""
    rules, e = s.rules, s.snapshot.engine
    running = (e.max_running_requests if e else None) or rules.lane.max_running_requests
    for limit, have, note in (
        (
            "sequences",
            rules.max_sequences_per_request,
            "more sequences than limits.max_sequences_per_request",
        ),
        ("running_requests", running, "more sequences than the engine's max_running_requests"),
    ):
        if have is not None and demand.sequences > have:
            return Check(Reason.UNFIT_REQUEST.value, False, demand.sequences, have, note, limit)
    return None


def _smallest(demand: Demand, s: Situation, charge: Charge) -> int:
    """The least this request's transient can be priced at on this lane: by its own chunk schedule
    where a lane that sees prefills' cache hits may price it so (when it starts its own batch)."""
    if not s.verifies_hits or demand.prompts != 1:
        return charge.projected_bytes
    return demand.own_bytes(s.rules)


def _gpu_predates_wait(demand: Demand, s: Situation) -> Check | None:
    """The check that holds a waiting request whose GPU reading is older than its wait (step 4)."""
    v, gpu = s.rules.vram, s.snapshot.gpu
    reads_gpu = v.uses_gpu_signal or v.other_processes_bytes is not None
    if not reads_gpu or gpu is None:
        return None
    # A source that reports when its figure last changed (a file) is confirmed by every good poll.
    read_at = max(gpu.observed_at, s.snapshot.gpu_health.last_ok_at or gpu.observed_at)
    if read_at >= demand.arrived_at:
        return None
    note = "gpu reading predates the wait: admitted on the next one"
    return Check(Reason.SIGNALS_STALE.value, False, demand.arrived_at, read_at, note)


def _blindness(s: Situation) -> tuple[Action, Reason, Check] | None:
    """Engine and GPU signals: unavailable, stale, or fine. The policy's choice is applied per signal."""
    blind = _sightless(s.rules, s.snapshot)
    if blind is not None:
        return blind
    rules, snap = s.rules, s.snapshot
    gpu_rules = rules.gpu if rules.gpu.required and rules.vram.uses_gpu_signal else None
    for name, age, sr in (
        ("engine", snap.engine_age(s.now), rules.engine),
        ("gpu", snap.gpu_age(s.now), gpu_rules),
    ):
        if sr is None or _fresh(age, sr) or sr.on_stale is Action.ADMIT:
            continue  # fresh, or the policy admits blind on this signal (its constraints then pass)
        age_text = "never read" if age is None else f"{age:.1f}s old"
        check = Check(Reason.SIGNALS_STALE.value, False, sr.max_age_s, age, f"{name} signals {age_text}")
        return sr.on_stale, Reason.SIGNALS_STALE, check
    return None


def _sightless(rules: Rules, snap: Snapshot) -> tuple[Action, Reason, Check] | None:
    """The blindness that does not depend on the clock (so ``_LaneView`` takes it once per snapshot):
    an unavailable engine, or the wait for a GPU reading after an engine restart."""
    health = snap.engine_health
    if health.consecutive_failures >= rules.engine.unavailable_after_failures:
        note = health.last_error or "engine unreachable"
        # ``engine.on_stale: hold`` rides a restart through: a request waits within the hold bounds
        # (``max_wait_s``, ``max_held``) for the engine to answer again, and is refused with
        # Retry-After beyond them. Otherwise (reject, or admit: nothing to admit into) 503 at once.
        action = Action.HOLD if rules.engine.on_stale is Action.HOLD else Action.REJECT
        return action, Reason.ENGINE_UNAVAILABLE, Check(Reason.ENGINE_UNAVAILABLE.value, False, note=note)
    # After an engine restart, whatever the headroom, a policy that holds when blind waits for the new
    # process's first GPU reading (one poll), which measures its idle figure before anything is let
    # in (``LaneWatch._measure_idle``), not the old process's memory. One that rejects does not turn
    # that sub-second gap into refusals: the reading it has is at most one poll old.
    restart, gpu = snap.engine_restarted_at, snap.gpu
    # A source that reports when its figure last changed (a file) is confirmed by every good poll.
    read_at = None if gpu is None else max(gpu.observed_at, snap.gpu_health.last_ok_at or gpu.observed_at)
    if (
        restart is not None
        and rules.gpu.required
        and rules.gpu.on_stale is Action.HOLD
        and (read_at is None or read_at < restart)
    ):
        note = "gpu not read since the engine restarted"
        return rules.gpu.on_stale, Reason.SIGNALS_STALE, Check(Reason.SIGNALS_STALE.value, False, note=note)
    return None


def readiness(s: Situation) -> Check | None:
    """What keeps every request from being admitted now, by the decision's own rules (``/readyz``
    asks this): draining, an unavailable engine, or a signal the decision reads too old to admit on
    (the same thresholds as ``decide``). None: the lane serves, though a request may still wait."""
    if s.draining:
        return Check(Reason.DRAINING.value, False, note="draining")
    blind = _blindness(s)
    return None if blind is None else blind[2]


def _fresh(age: float | None, sr: SignalRules) -> bool:
    return age is not None and age <= sr.max_age_s


def retry_after_s(s: Situation, reason: Reason | None, own_tokens: int = 0) -> int | None:
    """Seconds until the work ahead drains, bounded and never 0; ``None`` for an unfit request.

    The work is the prefill tokens already forwarded (the engine's pending count or the ledger's,
    whichever is larger), those of the requests held in front (strict order lets them in first) and
    the request's own ``own_tokens`` (it must fit in the budgets behind them), at the lane's measured
    prefill rate, else the policy's figure. Replay measures it: ``bench/retry_after.py`` (counting its
    own tokens took "a retry at that time is let in" from 78 % to 88 % of 43-49 rejections). A request
    that can never fit gets no Retry-After: no wait will help.
    """
    h = s.rules.hold
    if reason is Reason.UNFIT_REQUEST:
        return None
    if reason is Reason.DRAINING:
        return h.retry_after_min_s
    e = s.snapshot.engine
    forwarded = max((e.pending_prefill_tokens or 0) if e else 0, s.ledger.prefill_tokens)
    rate = s.prefill_tokens_per_s or h.prefill_tokens_per_s
    # ``held_tokens`` never includes the request deciding (the shell leaves its own out): count it
    # once, as ``own_tokens``.
    estimate = (forwarded + s.held_tokens + own_tokens) / rate
    if reason in (Reason.SIGNALS_STALE, Reason.ENGINE_UNAVAILABLE):
        # Nothing to measure while blind: one staleness period is the soonest signals can recover.
        estimate = max(estimate, s.rules.engine.max_age_s)
    return int(min(h.retry_after_max_s, max(h.retry_after_min_s, math.ceil(estimate))))


def holds_behind(rules: Rules) -> bool:
    """Whether a request held behind another held one stays held, under these rules, whatever the
    ledger and the signals do, until its deadline or a change of :func:`behind_inputs`: strict order
    (no backfill) and every constraint holding on exceed. Then the admission controller re-decides the
    queue only up to its first held request at each event (and those whose deadline came), not all of
    it; a policy that backfills or rejects on exceed has every held request decided at every event."""
    return not rules.hold.backfill and all(c.on_exceed(rules) is ExceedAction.HOLD for c in CONSTRAINTS)


def behind_inputs(s: Situation) -> tuple[object, ...]:
    """What can turn a request held behind another (``holds_behind``) into a rejection before its
    deadline, besides its own demand: draining, the rules (a reload, what the lane watch learnt), and
    what ``_unfit`` reads of the engine's report and the shell (its lane's shape, ``verifies_hits``).
    Blindness needs no place here: it is the same for every request, so the first held one is refused
    for it too and the walk goes on. A new unfit rule that reads something else must add it here."""
    e = s.snapshot.engine
    shape = (
        None
        if e is None
        else (e.context_len, e.max_total_tokens, e.mamba_total_slots, e.max_running_requests)
    )
    return (s.draining, s.rules, shape, s.verifies_hits)
