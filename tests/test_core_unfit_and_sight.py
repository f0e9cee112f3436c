"""The core's never-fits limits on sequences (the decode room, the policy's bound, the engine's running
limit), the checks sight and readiness report, and what the controller compares to re-decide requests
held behind another (``decide.behind_inputs``), with the exact numbers.

Written against the mutants of ``make mutation`` that the rest of the core's tests let through: each
test pins a boundary, a source (the engine's report against the policy's), or the check a client reads
in a refusal's body (``answers.unfit_message`` words it from ``need``, ``have`` and ``limit``). Pure.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.core import demand
from sidecar.core.decide import Situation, behind_inputs, decide, readiness
from sidecar.core.decision import Action, Check, Decision, Reason
from sidecar.core.demand import Demand
from sidecar.core.ledger import LedgerTotals
from sidecar.core.rules import Rules
from sidecar.core.snapshot import Snapshot
from sidecar.policy.in_force import rules_of
from tests.conftest import small_policy, snapshot, with_engine

NOW = 5000.0


def rules(**overrides: object) -> Rules:
    return rules_of(small_policy(**overrides).policy)


def ask(r: Rules, prompt_tokens: int = 10, **kw: object) -> Demand:
    return demand.build(r, prompt_tokens, arrived_at=NOW, **kw)  # type: ignore[arg-type]


def judge(r: Rules, d: Demand, snap: Snapshot | None = None) -> Decision:
    return decide(d, Situation(r, snap or snapshot(NOW), LedgerTotals(), NOW))


def unfit(need: int, have: int, note: str, limit: str) -> tuple[Check, ...]:
    return (Check("unfit_request", False, need, have, note, limit),)


# -- the decode room -------------------------------------------------------------------------------------


def test_the_sequences_decode_room_must_fit_the_pool_less_its_reserve() -> None:
    """An estimated count is never condemned for length, but its decode room is whatever the prompt:
    100 samples of 1,000 new tokens reserve 100,000 KV tokens at a decode reserve fraction of 1, one
    more than the 100,000-token pool less its 1,000 reserved can hold; 99 samples fill it exactly."""
    r = rules(kv__decode_reserve_fraction=1.0, kv__reserve_tokens=1000)
    fits = judge(r, ask(r, exact=False, max_new_tokens=1000, samples=99))
    assert fits.reason is not Reason.UNFIT_REQUEST
    d = judge(r, ask(r, exact=False, max_new_tokens=1000, samples=100))
    assert (d.action, d.reason, d.retry_after_s) == (Action.REJECT, Reason.UNFIT_REQUEST, None)
    assert d.checks == unfit(100_000, 99_000, "sequences' decode room larger than KV pool", "kv_pool")


# -- how many sequences one request may have -------------------------------------------------------------


def test_more_sequences_than_the_policy_allows_is_unfit() -> None:
    r = rules(limits__max_sequences_per_request=4)
    assert judge(r, ask(r, samples=4)).admitted
    d = judge(r, ask(r, samples=5))
    assert (d.action, d.reason, d.retry_after_s) == (Action.REJECT, Reason.UNFIT_REQUEST, None)
    assert d.checks == unfit(5, 4, "more sequences than limits.max_sequences_per_request", "sequences")


def test_more_sequences_than_the_engine_runs_at_once_is_unfit_by_its_report() -> None:
    """The engine's ``max_running_requests`` (its /server_info) bounds the sequences of one request,
    where the policy names no such limit."""
    r = rules()
    snap = with_engine(snapshot(NOW), max_running_requests=8)
    assert judge(r, ask(r, samples=8), snap).admitted
    d = judge(r, ask(r, samples=9), snap)
    assert (d.action, d.reason, d.retry_after_s) == (Action.REJECT, Reason.UNFIT_REQUEST, None)
    note = "more sequences than the engine's max_running_requests"
    assert d.checks == unfit(9, 8, note, "running_requests")


# -- what sight and readiness report ----------------------------------------------------------------------


def test_a_hold_for_a_gpu_reading_after_a_restart_reports_a_failed_staleness_check() -> None:
    r = rules()
    restarted = replace(snapshot(NOW), engine_restarted_at=NOW + 0.01)  # the GPU read at NOW, before it
    d = judge(r, ask(r), restarted)
    assert (d.action, d.reason) == (Action.HOLD, Reason.SIGNALS_STALE)
    assert d.checks == (Check("signals_stale", False, note="gpu not read since the engine restarted"),)


def test_a_draining_lane_is_unready_by_a_failed_draining_check() -> None:
    s = Situation(rules(), snapshot(NOW), LedgerTotals(), NOW, draining=True)
    assert readiness(s) == Check("draining", False, note="draining")


# -- behind_inputs: what re-decides the requests held behind another --------------------------------------


@pytest.mark.parametrize(
    "report",
    [
        {"context_len": 50_000},
        {"max_total_tokens": 50_000},
        {"max_running_requests": 8},
        {"mamba_used_slots": 0, "mamba_available_slots": 4},
    ],
)
def test_a_new_lane_shape_in_the_engine_s_report_changes_what_the_held_were_decided_under(
    report: dict[str, int],
) -> None:
    """A request held behind another may become unfit when the engine reports a smaller context, pool,
    running limit or Mamba pool: the controller re-decides every held request when this key moves,
    and only then (the same report polled again leaves it as it was)."""
    r = rules()
    s = Situation(r, snapshot(NOW), LedgerTotals(), NOW)
    assert behind_inputs(s) == behind_inputs(replace(s, snapshot=snapshot(NOW + 1), now=NOW + 1))
    shrunk = replace(s, snapshot=with_engine(snapshot(NOW), **report))
    assert behind_inputs(shrunk) != behind_inputs(s)
