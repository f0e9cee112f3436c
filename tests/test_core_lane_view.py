"""``decide``'s per-(rules, snapshot) view (``decide._LaneView``) against the functions it stands for.

The view only says when ``_unfit`` and ``_blindness`` need not be called (issue #27: their figures are
taken once per snapshot, not per request); the checks and their numbers stay theirs. So the property
to hold is one-sided: wherever ``_unfit`` or ``_blindness`` finds something, the view must send the
decision to it. Generated lanes, engine reports, signal ages and requests around every limit. Pure.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.core import demand
from sidecar.core.constraints import CONSTRAINTS, Reading
from sidecar.core.decide import (
    Situation,
    _blindness,
    _judge,
    _lane_view,
    _LaneView,
    _unfit,
    charge_of,
    decide,
)
from sidecar.core.decision import Action, Charge
from sidecar.core.ledger import LedgerTotals
from sidecar.core.rules import MambaRules
from sidecar.core.snapshot import SourceHealth
from sidecar.policy.in_force import rules_of
from tests.conftest import small_policy, snapshot, with_engine

NOW = 5000.0
BASE = rules_of(small_policy().policy)
MAMBA = rules_of(small_policy(mamba={"slots_per_request": 1, "reserve_slots": 1}).policy)
maybe = st.one_of(st.none(), st.integers(0, 300))
small = st.integers(0, 300)


@settings(max_examples=400, deadline=None)
@given(
    mamba=st.booleans(),
    lane=st.tuples(st.integers(1, 300), maybe, maybe, maybe, st.integers(0, 50), maybe),
    engine=st.tuples(maybe, maybe, maybe, maybe, maybe, maybe),
    ask=st.tuples(small, small, small, small, small, small, small, st.booleans(), small, st.booleans()),
)
def test_the_view_sends_every_unfit_request_to_the_unfit_judges(mamba, lane, engine, ask) -> None:
    context, pool, slots, running, kv_reserve, max_sequences = lane
    r = MAMBA if mamba else BASE
    r = replace(
        r,
        lane=replace(
            r.lane, context_len=context, kv_pool_tokens=pool, mamba_slots=slots, max_running_requests=running
        ),
        kv=replace(r.kv, reserve_tokens=kv_reserve),
        vram=replace(r.vram, max_transient_bytes=ask[8] * 1024),
        max_sequences_per_request=max_sequences if max_sequences is not None else 256,
    )
    if r.mamba is not None:
        r = replace(r, mamba=MambaRules(1, None, kv_reserve % 3, 1.0, r.mamba.on_exceed))
    e_context, e_pool, e_running, used, available, evictable = engine
    snap = with_engine(
        snapshot(NOW),
        context_len=e_context,
        max_total_tokens=e_pool,
        max_running_requests=e_running,
        mamba_used_slots=used,
        mamba_available_slots=available,
        mamba_evictable_slots=evictable,
    )
    prompt, new, sequences, kv, uncached, slots_needed, projected, exact, _, hits = ask
    d = replace(
        demand.build(r, 10, arrived_at=NOW),
        prompt_tokens=prompt,
        max_new_tokens=new,
        sequences=sequences,
        kv_tokens=kv,
        uncached_tokens=uncached,
        mamba_slots=slots_needed,
        projected_bytes=projected * 1024,
        exact=exact,
    )
    s = Situation(r, snap, LedgerTotals(), NOW, verifies_hits=hits)
    charge = charge_of(d, r, snap)
    view = _LaneView(r, snap)
    if _unfit(d, s, charge) is not None:
        assert view.maybe_unfit(d, charge)
    assert decide(d, s).action is not Action.ADMIT or _unfit(d, s, charge) is None


@settings(max_examples=300, deadline=None)
@given(
    engine_age=st.one_of(st.none(), st.floats(-1, 20)),
    gpu_age=st.one_of(st.none(), st.floats(-1, 20)),
    failures=st.integers(0, 4),
    restart=st.one_of(st.none(), st.floats(-5, 5)),
    stale=st.sampled_from(["hold", "reject", "admit"]),
    required=st.booleans(),
)
def test_the_view_sends_every_blind_decision_to_the_blindness_rules(
    engine_age, gpu_age, failures, restart, stale, required
) -> None:
    r = rules_of(small_policy(engine__on_stale=stale, gpu__on_stale=stale, gpu__required=required).policy)
    snap = snapshot(NOW)
    snap = replace(
        snap,
        engine=None if engine_age is None else replace(snap.engine, observed_at=NOW - engine_age),
        gpu=None if gpu_age is None else replace(snap.gpu, observed_at=NOW - gpu_age),
        engine_health=SourceHealth(last_ok_at=NOW, consecutive_failures=failures),
        gpu_health=SourceHealth(),
        engine_restarted_at=None if restart is None else NOW + restart,
    )
    s = Situation(r, snap, LedgerTotals(), NOW)
    d = demand.build(r, 10, arrived_at=NOW)
    blind = _blindness(s)
    decision = decide(d, s)
    if blind is not None:
        assert decision.checks == (blind[2],)
        assert decision.reason is blind[1]
    else:
        assert all(c.name != "signals_stale" for c in decision.checks)


def test_the_view_is_taken_once_per_rules_and_snapshot() -> None:
    """The same pair reuses its view; a new snapshot (a poll) or new rules (a reload) take a new one."""
    snap = snapshot(NOW)
    view = _lane_view(BASE, snap)
    assert _lane_view(BASE, snap) is view
    assert _lane_view(BASE, snapshot(NOW)) is not view
    assert _lane_view(MAMBA, snap) is not view
    assert isinstance(charge_of(demand.build(BASE, 10, arrived_at=NOW), BASE, snap), Charge)


JOIN = replace(BASE, cost=replace(BASE.cost, batch_join_bytes=4096, batch_join_bytes_per_running_request=512))


@settings(max_examples=300, deadline=None)
@given(
    join=st.booleans(),
    mamba=st.booleans(),
    ledger=st.tuples(small, small, small, small, small, small),
    engine=st.tuples(maybe, maybe, maybe, st.booleans()),
    ask=st.tuples(small, small, small, small, st.booleans()),
    headroom=maybe,
)
def test_the_constraints_the_view_leaves_out_never_give_a_check(
    join, mamba, ledger, engine, ask, headroom
) -> None:
    """``_LaneView.constraints`` (``constraints.applicable``) leaves out a constraint only where its
    ``check`` gives nothing under the rules, whatever the reading: ``_judge`` over it decides as over
    every constraint, with the same checks in the same order."""
    r = MAMBA if mamba else BASE
    # A lane with Mamba slots either way: the charge asks for them, whether the policy checks them or not.
    r = replace(r, lane=replace(r.lane, mamba_slots=16))
    if join:
        r = replace(r, cost=JOIN.cost)
    requests, running, slots, running_slots, own, projected = ledger
    totals = LedgerTotals(
        requests=requests,
        running_requests=requests + running,
        mamba_slots=slots,
        running_mamba_slots=slots + running_slots,
        own_prefills=own % 2,
        projected_bytes=projected * 1024,
    )
    available, evictable, queue, fresh = engine
    snap = with_engine(
        snapshot(NOW if fresh else NOW - 10_000),
        mamba_available_slots=available,
        mamba_evictable_slots=evictable,
        queue_requests=queue,
    )
    uncached, slots_needed, sequences, projected_ask, settling = ask
    d = replace(
        demand.build(r, 10, arrived_at=NOW),
        uncached_tokens=uncached,
        kv_tokens=uncached + 1,
        mamba_slots=slots_needed,
        sequences=sequences,
        projected_bytes=projected_ask * 1024,
    )
    s = Situation(r, snap, totals, NOW, join_settles_at=NOW + 1 if settling else None)
    view = _LaneView(r, snap)
    every = _LaneView(r, snap)
    every.constraints = CONSTRAINTS
    assert view.constraints == tuple(c for c in CONSTRAINTS if c in view.constraints)  # the same order
    reading = Reading(
        r, snap.engine, None if headroom is None else headroom * 1024, totals, charge_of(d, r, snap)
    )
    for c in CONSTRAINTS:
        if c not in view.constraints:
            assert c.check(d, reading) is None
    charge = charge_of(d, r, snap)
    h = None if headroom is None else headroom * 1024
    assert _judge(d, s, view, charge, h) == _judge(d, s, every, charge, h)
    assert (join or mamba) or len(view.constraints) == len(CONSTRAINTS) - 2  # the shortcut is taken
