"""A streaming request's batch join still to come: no new prefill goes in front of it.

SGLang merges a finished prefill into the running batch and then runs any prefill it can form before
the decode step in which the running batch allocates the join (evidence S25). A request past its
first token can no longer be refused or aborted, so a prefill admitted in that window stretches the
time an unabortable allocation is pending from one decode step to a whole prefill; on the outage
burst under the neighbour setting that is the crash (docs/benchmarks.md, "Admission quality").
"""

from __future__ import annotations

import sys

import pytest

from sidecar.admission.controller import Outcome
from sidecar.core import constraints
from sidecar.core.decide import Situation, decide, join_pending, join_settles
from sidecar.core.decision import Action, Reason
from sidecar.core.ledger import LedgerTotals
from sidecar.policy.in_force import rules_of
from sidecar_emulator import baselines as bl
from sidecar_emulator.profiles import MiB, get_profile
from sidecar_emulator.scenario import load_scenario
from tests.conftest import ROOT, ManualClock, ask, maxq, small_policy, snapshot, submit

NOW = 1000.0


def _situation(
    at: float | None, *, now: float = NOW, prefilling: int = 0, on_exceed: str = "hold"
) -> Situation:
    rules = rules_of(small_policy(vram__on_exceed=on_exceed, cost__batch_join_bytes="1KiB").policy)
    ledger = LedgerTotals(requests=prefilling, running_requests=2 + prefilling)
    return Situation(rules, snapshot(now), ledger, now, join_settles_at=at)


def _decide(s: Situation):  # type: ignore[no-untyped-def]
    return decide(ask(small_policy().policy, 1500, now=s.now), s)  # two 1,000-token chunks


def test_a_pending_join_holds_a_newcomer_until_it_settles() -> None:
    held = _decide(_situation(NOW + 0.05))
    assert held.action is Action.HOLD and held.reason is Reason.VRAM_HEADROOM
    assert [c.name for c in held.checks if not c.ok] == ["join_pending"]
    # At the settle instant, with no prefill ahead of the join, the newcomer goes in.
    assert _decide(_situation(NOW + 0.05, now=NOW + 0.05)).admitted
    assert _decide(_situation(None)).admitted
    assert "join_pending" not in {c.name for c in _decide(_situation(None)).checks}


def test_a_prefill_ahead_of_the_join_keeps_it_pending_past_the_settle_time() -> None:
    """The engine runs every prefill it has before the decode step that joins: settled only after them."""
    s = _situation(NOW - 10.0, prefilling=1)
    assert join_pending(s)
    assert _decide(s).action is Action.HOLD
    assert not join_pending(_situation(NOW - 10.0))


def test_a_pending_join_is_a_hold_even_where_the_vram_section_rejects() -> None:
    """The window closes within a decode step: a 503 would only send the client away for nothing."""
    s = _situation(NOW + 0.05, on_exceed="reject")
    assert constraints.JoinPending().on_exceed(s.rules).value == "hold"
    d = _decide(s)
    assert d.action is Action.HOLD and d.retry_after_s is None


@pytest.mark.parametrize(
    ("at", "joins", "want"),
    [
        (None, False, None),  # nothing pending, a prefill without a join ended: still nothing
        (None, True, NOW + 0.05),  # a stream's first token that joins a running batch
        (NOW + 1.0, False, NOW + 1.0),  # a prefill ahead ended earlier than the settle: kept
        (NOW - 1.0, False, NOW + 0.05),  # ... or later: one settle time after it
        (NOW - 1.0, True, NOW + 0.05),
    ],
)
def test_join_settles(at: float | None, joins: bool, want: float | None) -> None:
    assert join_settles(at, NOW, 0.05, joins=joins) == want


def _lane(clock: ManualClock, settle: float = 0.05):  # type: ignore[no-untyped-def]
    from sidecar.admission.controller import Admission

    policy = small_policy(cost__batch_join_bytes="1KiB", cost__join_settle_s=settle)
    a = Admission(policy, clock)
    a.update_snapshot(snapshot(clock(), free_bytes=100 * MiB))
    return a


def test_the_gate_holds_a_newcomer_from_a_stream_s_first_token_to_its_settle(clock: ManualClock) -> None:
    a = _lane(clock)
    first, second = submit(a, ask(a, 1000)), submit(a, ask(a, 1000))
    assert first.admitted and second.admitted
    second.prefill_done()  # first byte of a stream that joins the running batch of two
    answered: list = []
    third = submit(a, ask(a, 1500), answered)
    assert third.held
    assert third.decision is not None and [c.name for c in third.decision.checks if not c.ok] == [
        "join_pending"
    ]
    clock.advance(0.049)
    assert third.held
    # The first one still prefills: the engine runs it before the decode step, the join waits.
    clock.advance(1.0)
    assert third.held
    first.prefill_done(measured=False)  # a non-streamed first byte: it joins nothing the gate sees
    clock.advance(0.049)
    assert third.held
    clock.advance(0.002)
    assert answered == [third] and third.admitted


def test_a_request_alone_or_a_non_streamed_answer_holds_nobody(clock: ManualClock) -> None:
    a = _lane(clock)
    alone = submit(a, ask(a, 1000))
    alone.prefill_done()  # alone in the running batch: no join
    assert submit(a, ask(a, 1500)).admitted
    other = submit(a, ask(a, 1000))
    other.prefill_done(measured=False)
    assert submit(a, ask(a, 1500)).admitted


def test_a_prompt_of_one_chunk_is_not_held(clock: ManualClock) -> None:
    """It adds one prefill batch at most: the unit SGLang interleaves prefills and decode steps at."""
    a = _lane(clock)
    first, second = submit(a, ask(a, 1000)), submit(a, ask(a, 1000))
    second.prefill_done()
    assert first.admitted and submit(a, ask(a, 1000)).admitted
    assert submit(a, ask(a, 1001)).held


def test_an_aborted_prefill_ahead_of_the_join_restarts_the_settle(clock: ManualClock) -> None:
    a = _lane(clock)
    first, second = submit(a, ask(a, 1000)), submit(a, ask(a, 1000))
    first.prefill_done()
    answered: list = []
    third = submit(a, ask(a, 1500), answered)
    clock.advance(1.0)
    assert third.held
    second.end(Outcome.CLIENT_GONE)  # the prefill ahead of the join left: the decode step comes next
    assert third.held
    clock.advance(0.051)
    assert answered == [third] and third.admitted


def _outage_neighbour(seed_index: int = 0):  # type: ignore[no-untyped-def]
    sc = load_scenario(ROOT / "scenarios" / "maxq-outage-burst.yaml")
    d = bl.SidecarDriver(sc, get_profile(sc.profile), maxq(), sc.seed)
    d.neighbour = bl.Neighbour(256 * MiB)
    return d.run()


def test_the_outage_burst_survives_a_neighbour_that_grows_as_a_held_request_goes_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/benchmarks.md, "Admission quality": burst-1's first token, the admission of a held request and the
    neighbour's 256 MiB growth in one instant; without the rule the newcomer's prefill runs before
    burst-1's first decode step, whose 1,248 MiB join then finds 1,116 MiB free."""
    r = _outage_neighbour()
    assert r["crashes"] == [] and r["completed"] == r["requests"] - r["rejected"]
    without = tuple(c for c in constraints.CONSTRAINTS if not isinstance(c, constraints.JoinPending))
    monkeypatch.setattr(sys.modules["sidecar.core.decide"], "CONSTRAINTS", without)
    crashed = _outage_neighbour()["crashes"]
    assert len(crashed) == 1 and crashed[0]["requested_bytes"] == 1248 * MiB


class _EarlyClock(ManualClock):
    """An event loop's timer may fire a hair before its time on the clock it was measured on (here
    the first one, by a millisecond)."""

    early = 0.001

    def call_at(self, when: float, fn):  # type: ignore[no-untyped-def, override]
        when, self.early = when - self.early, 0.0
        return super().call_at(when, fn)


def test_a_settle_timer_that_fires_early_is_set_again() -> None:
    clock = _EarlyClock()
    a = _lane(clock)
    first, second = submit(a, ask(a, 1000)), submit(a, ask(a, 1000))
    first.prefill_done(measured=False)
    second.prefill_done()
    answered: list = []
    third = submit(a, ask(a, 1500), answered)
    clock.advance(0.0495)  # the timer fired at 0.049, before the settle instant
    assert third.held
    clock.advance(0.001)
    assert answered == [third] and third.admitted


def test_even_a_one_byte_join_is_waited_for(clock: ManualClock) -> None:
    from sidecar.admission.controller import Admission

    a = Admission(small_policy(cost__batch_join_bytes=1), clock)
    a.update_snapshot(snapshot(clock(), free_bytes=100 * MiB))
    first, second = submit(a, ask(a, 1000)), submit(a, ask(a, 1000))
    second.prefill_done()
    assert first.admitted and submit(a, ask(a, 1500)).held


def test_with_no_settle_time_the_join_is_done_at_the_first_token_unless_a_prefill_is_ahead(
    clock: ManualClock,
) -> None:
    """The default (SGLang launches its next batch before it sends the last one's tokens, evidence
    S25): a first token with no admitted prefill ahead holds nobody and arms no timer; with one ahead,
    newcomers wait for its end, then go in at once."""
    a = _lane(clock, settle=0.0)
    first, second = submit(a, ask(a, 1000)), submit(a, ask(a, 1000))
    first.prefill_done(measured=False)
    timers = clock.pending
    second.prefill_done()
    newcomer = submit(a, ask(a, 1500))
    assert clock.pending == timers and newcomer.admitted
    another = submit(a, ask(a, 1500))
    assert another.admitted  # the join was done at once: nothing pends behind a newcomer
    newcomer.end(Outcome.COMPLETED)
    another.end(Outcome.COMPLETED)
    third, fourth = submit(a, ask(a, 1000)), submit(a, ask(a, 1000))
    third.prefill_done()  # fourth still prefills: the engine runs it before the join
    answered: list = []
    fifth = submit(a, ask(a, 1500), answered)
    assert fifth.held and clock.pending == timers + 1  # its hold deadline only
    fourth.prefill_done()  # the prefill ahead ended, and fourth joins too: both at the next step
    assert answered == [fifth] and fifth.admitted


def test_a_prefill_that_ends_before_its_first_token_joins_nothing(clock: ManualClock) -> None:
    a = _lane(clock, settle=0.0)
    first, second = submit(a, ask(a, 1000)), submit(a, ask(a, 1000))
    first.end(Outcome.CLIENT_GONE)  # no join came of it; the other one still prefills
    assert second.admitted and submit(a, ask(a, 1500)).admitted
