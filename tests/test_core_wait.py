"""A request that waited is admitted only on a GPU reading taken since it began waiting (decide, step 4).

The benchmark's slow-signals setting (``bench/admission.py``, noisy-neighbour, second seed) crashed the
lane without this rule: a turn held on the KV pool was released by an engine report at the instant a
neighbour grew by 2.2 GiB, on a GPU reading 5 s old that still showed the neighbour small.
"""

from __future__ import annotations

from dataclasses import replace

from sidecar.core import demand
from sidecar.core.decide import Situation, decide
from sidecar.core.decision import Action, Check, Decision, Reason
from sidecar.core.ledger import LedgerTotals
from sidecar.core.rules import Rules
from sidecar.core.snapshot import Snapshot, SourceHealth
from sidecar.policy.in_force import rules_of
from tests.conftest import MIB, small_policy, snapshot

NOW = 5000.0
NOTE = "gpu reading predates the wait: admitted on the next one"


def rules(**overrides: object) -> Rules:
    # The rule is off by default (its evidence is one benchmark seed, docs/evidence.md G6): on here.
    return rules_of(small_policy(experimental__gpu_reading_after_wait=True, **overrides).policy)


def test_the_rule_is_off_by_default() -> None:
    r = rules_of(small_policy().policy)
    assert waiting(r, gpu_read_at(NOW - 1.0)).admitted


def gpu_read_at(t: float | None, **engine: object) -> Snapshot:
    """The engine read now, the GPU last read (and its figure taken) at ``t`` (None: no GPU source)."""
    snap = snapshot(NOW, **engine)
    assert snap.gpu is not None
    if t is None:
        return replace(snap, gpu=None)
    return replace(snap, gpu=replace(snap.gpu, observed_at=t), gpu_health=SourceHealth(last_ok_at=t))


def waiting(r: Rules, snap: Snapshot, *, arrived_at: float = NOW - 0.5, queued: bool = True) -> Decision:
    d = demand.build(r, 1000, arrived_at=arrived_at)
    return decide(d, Situation(r, snap, LedgerTotals(), NOW, held=1 if queued else 0, queued=queued))


def test_a_waiting_request_needs_a_gpu_reading_from_after_it_arrived() -> None:
    r = rules()  # live GPU free memory: the headroom reads the GPU
    d = waiting(r, gpu_read_at(NOW - 1.0))
    assert (d.action, d.reason) == (Action.HOLD, Reason.SIGNALS_STALE)
    # Every constraint passed and is still shown; the reason is the last check, with both times.
    assert [c.ok for c in d.checks[:-1]] == [True] * (len(d.checks) - 1)
    assert d.checks[-1] == Check("signals_stale", False, NOW - 0.5, NOW - 1.0, NOTE)
    assert d.retry_after_s is None  # a hold, not a rejection
    # A reading taken the instant it arrived, or later, is one it may be admitted on.
    assert waiting(r, gpu_read_at(NOW - 0.5)).admitted
    assert waiting(r, gpu_read_at(NOW)).admitted


def test_a_newcomer_is_decided_on_the_reading_there_is() -> None:
    r = rules()
    assert waiting(r, gpu_read_at(NOW - 1.0), queued=False).admitted


def test_only_where_the_headroom_reads_the_gpu() -> None:
    budget = {"vram__headroom": "idle_budget", "vram__idle_free_bytes": 10 * MIB}
    # The idle budget with a neighbour figure reads the GPU for the neighbour's growth.
    d = waiting(rules(**budget, vram__other_processes_bytes=MIB), gpu_read_at(NOW - 1.0))
    assert (d.action, d.reason) == (Action.HOLD, Reason.SIGNALS_STALE)
    # Without one it never reads the GPU: an old reading changes nothing; no GPU source either.
    assert waiting(rules(**budget), gpu_read_at(NOW - 1.0)).admitted
    assert waiting(rules(**budget, vram__other_processes_bytes=MIB), gpu_read_at(None)).admitted


def test_a_request_held_for_another_reason_keeps_that_reason() -> None:
    r = rules()
    d = waiting(r, gpu_read_at(NOW - 1.0, kv_available_tokens=10))
    assert (d.action, d.reason) == (Action.HOLD, Reason.KV_POOL)
    assert all(c.name != "signals_stale" for c in d.checks)


def test_a_figure_that_has_not_changed_is_confirmed_by_a_later_poll() -> None:
    """A file source dates its figure by when the file last changed; a good poll since the request
    arrived says the figure still holds."""
    r = rules()
    old = gpu_read_at(NOW - 1.0)
    confirmed = replace(old, gpu_health=SourceHealth(last_ok_at=NOW - 0.5))
    assert waiting(r, confirmed).admitted
    d = waiting(r, replace(old, gpu_health=SourceHealth(last_ok_at=NOW - 0.6)))
    assert d.checks[-1] == Check("signals_stale", False, NOW - 0.5, NOW - 0.6, NOTE)
    # Never polled at all (no health yet): the figure's own time decides.
    assert not waiting(r, replace(old, gpu_health=SourceHealth())).admitted
