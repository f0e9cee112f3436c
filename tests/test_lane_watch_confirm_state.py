"""The lane watch's new-build confirmation (``LaneWatch._confirm``), the margin rule's edges
(``raised_margin``), the in-flight guard's margin (``_judge_in_flight``) and the ``crashes`` and
``engine_build`` blocks of ``/admission/state``, pinned to the byte and the character.

After an engine upgrade the lane is priced at its learned margin x1.25 until a reading confirms the
new build's fit; an operator watches that happen through one log line and ``/admission/state``, and
the gate through ``observe``'s answer (rebuild the rules or not). These tests pin each of those
outputs exactly and each comparison that decides them on both sides of its edge, on a bare
``LaneWatch`` (``tests/test_monitor_reports.py``'s lane: the policy's 10 GiB idle figure, tolerance 0,
1 MiB), so that ``make mutation`` finds a test for every line. The behaviour on a real ``Admission``
is in ``tests/test_lane_learning.py``.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from sidecar.admission.lane_watch import AdmittedSet, LaneWatch, raised_margin
from sidecar.core.ledger import LedgerTotals
from sidecar.core.rules import Rules
from sidecar.policy.in_force import rules_in_force
from sidecar.policy.schema import Monitor, Policy
from tests.conftest import MIB
from tests.test_monitor_reports import IDLE, fresh_monitor, lane, reading

GIB = 1024 * MIB
BUILD = "engine build 0.5.23 -> 0.5.24"
ONE = LedgerTotals(requests=1, running_requests=1)


def unconfirmed(**overrides: object) -> tuple[LaneWatch, Policy, list[int]]:
    """``lane``'s watch (with ``overrides``) whose engine reported build 0.5.23 at t=1 and 0.5.24 at
    t=2: the learned margin is priced x1.25 until a reading confirms the new build. The list counts
    the writes of the state file asked for since (``on_learned``)."""
    w, p, rules = lane(**overrides)
    w.observe(reading(1.0, 10 * GIB, version="0.5.23"), IDLE, rules, 1.0)
    assert w.observe(reading(2.0, 10 * GIB, version="0.5.24"), IDLE, rules, 2.0)
    assert w.conservative == BUILD and w.conservative_since == 2.0
    writes: list[int] = []
    w.on_learned = lambda: writes.append(1)
    return w, p, writes


def records(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, Any]]:
    """The lane watch's log lines since the last call: level, message, and the structured fields."""
    out = [
        (r.levelname, r.getMessage(), getattr(r, "fields", None))
        for r in caplog.records
        if r.name == "sidecar.admission.lane_watch"
    ]
    caplog.clear()
    return out


def confirmed(drew: str, upper: str, before: str, after: str, how: str = "fit confirmed") -> str:
    """The confirmation's log line, as an operator reads it (a bound from above: ``upper`` is x...)."""
    return f"{BUILD}: {how} (the lane drew x{drew} of its cost terms, at most {upper}); margin {before} -> {after}"


NOT_CONFIRMED = "margin raised, fit not confirmed (no reading bounds the draw from above within it)"
T = 1000 * MIB  # a prompt's cost terms: priced at the conservative margin 1.2 x 1.25, 1,500 MiB
SLACK = 2 * MIB / T  # the allocator's rounding on one reading of it, as a multiple of its terms


# -- the new-build confirmation: what it logs and answers -----------------------------------------------


def test_a_reading_within_the_learned_margin_bounded_from_above_confirms_the_new_build(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A prompt priced at 1.2 x 1.25 whose readings bound its draw at x1.10 of its cost terms, from
    below and from above: the new build fits the learned margin 1.2. The lane leaves the conservative
    state (the rules change: ``True``), says so in one line with the figures an operator checks, and
    the state file is written. ``/admission/state`` no longer shows the wait. Once confirmed, a later
    reading is the monitor's alone: no second confirmation, nothing more logged here."""
    caplog.set_level(logging.INFO, logger="sidecar.admission.lane_watch")
    w, _, writes = unconfirmed(cost__margin=1.2)
    caplog.clear()  # the build change, logged
    assert w._confirm(1100 * MIB, 1500 * MIB, 1.5, 1, 1.1, SLACK) is True
    assert records(caplog) == [
        (
            "WARNING",
            confirmed("1.100", "x1.100", "1.200", "1.200"),
            {"event": "engine_build_confirmed", "drew": 1.1, "upper": 1.1, "margin": 1.2},
        )
    ]
    assert (w.conservative, w.margin, w.margin_in_force, writes) == (None, 1.2, 1.2, [1])
    assert w.state(5.0)["engine_build"] == {
        "version": "0.5.24",
        "conservative": False,
        "why": None,
        "since_age_s": None,
        "margin_in_force": 1.2,
    }
    # Confirmed: a reading beyond the margin (priced at 1.2 now) is no confirmation's business.
    assert w._confirm(1300 * MIB, 1200 * MIB, 1.2, 1, None, 0.0) is False
    assert (records(caplog), w.margin, writes) == ([], 1.2, [1])


def test_a_new_build_drawing_beyond_its_margin_is_re_measured_at_what_the_readings_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Readings that bound the new build's draw at x1.3 to x1.4 of its cost terms (beyond the learned
    1.2): the margin becomes the upper bound 1.4 (more than x1.3 with the 5 % safety, 1.365: every draw
    the readings allow) and, covering it, the build is confirmed at it ("fit re-measured"). The
    in-flight guard's earlier evidence (x1.25, read on the new build) was of a draw now measured: the
    admitted prefills are judged at the new margin."""
    caplog.set_level(logging.INFO, logger="sidecar.admission.lane_watch")
    w, _, writes = unconfirmed(cost__margin=1.2)
    caplog.clear()  # the build change, logged
    w._judge_in_flight(1.2, 1.25, 1.22)  # an earlier finding, mid-prefill
    assert w.in_flight_margin == 1.25
    assert w._confirm(1300 * MIB, 1500 * MIB, 1.5, 1, 1.4, SLACK) is True
    assert records(caplog) == [
        (
            "WARNING",
            confirmed("1.300", "x1.400", "1.200", "1.400", how="fit re-measured"),
            {"event": "engine_build_confirmed", "drew": 1.3, "upper": 1.4, "margin": 1.4},
        )
    ]
    assert (w.conservative, w.margin, w.margin_in_force, w.in_flight_margin, writes) == (
        None,
        1.4,
        1.4,
        1.4,
        [1],
    )


def test_without_a_bound_from_above_a_new_build_drawing_more_raises_the_margin_but_stays_unconfirmed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two prefills' peaks (nothing bounds the draw from above) show x1.3 of their cost terms: the
    learned margin rises to x1.3 with the safety, 1.365, and the lane stays conservative (priced at
    1.365 x 1.25, capped at max_margin 1.5): a lower bound alone never confirms. Then one prefill's
    readings bound it by x1.6, beyond max_margin: the margin goes to the cap, and a fit no margin
    allowed can cover is not confirmed either; each line says what bounded the draw."""
    caplog.set_level(logging.INFO, logger="sidecar.admission.lane_watch")
    w, _, writes = unconfirmed(cost__margin=1.2)
    caplog.clear()  # the build change, logged
    assert w._confirm(1300 * MIB, 1500 * MIB, 1.5, 2, None, 0.0) is True
    raised = 1300 / 1000 * 1.05
    assert records(caplog) == [
        (
            "WARNING",
            f"{BUILD}: {NOT_CONFIRMED} (the lane drew x1.300 of its cost terms, at most unbounded); "
            "margin 1.200 -> 1.365",
            {
                "event": "engine_build_margin_raised",
                "drew": 1.3,
                "upper": None,
                "margin": pytest.approx(raised),
            },
        )
    ]
    assert w.conservative == BUILD and w.margin == pytest.approx(raised, rel=1e-12)
    assert w.margin_in_force == 1.5 and writes == [1]
    assert w._confirm(1450 * MIB, 1500 * MIB, 1.5, 1, 1.6, SLACK) is True
    assert records(caplog) == [
        (
            "WARNING",
            f"{BUILD}: {NOT_CONFIRMED} (the lane drew x1.450 of its cost terms, at most x1.600); "
            "margin 1.365 -> 1.500",
            {"event": "engine_build_margin_raised", "drew": 1.45, "upper": 1.6, "margin": 1.5},
        )
    ]
    assert (w.conservative, w.margin, w.margin_in_force, writes) == (BUILD, 1.5, 1.5, [1, 1])


def test_a_lower_bound_within_the_margin_says_nothing_about_a_new_build(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 29: a reading at x1.048 of cost terms that priced a full last chunk confirmed a build
    drawing x1.10, and the next batch join crashed the lane. A reading within the learned margin 1.2
    (x1.18) with nothing bounding it from above, or bounded only beyond the margin (x1.25), leaves the
    lane conservative, raises nothing, logs nothing and does not ask for new rules."""
    caplog.set_level(logging.INFO, logger="sidecar.admission.lane_watch")
    w, _, writes = unconfirmed(cost__margin=1.2)
    caplog.clear()  # the build change, logged
    assert w._confirm(1180 * MIB, 1500 * MIB, 1.5, 2, None, 0.0) is False
    assert w._confirm(1180 * MIB, 1500 * MIB, 1.5, 1, 1.25, SLACK) is False
    assert (records(caplog), w.conservative, w.margin, w.margin_in_force, writes) == ([], BUILD, 1.2, 1.5, [])


def test_a_reading_one_allocator_block_above_a_bound_at_the_margin_confirms_without_a_raise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Evidence RE1: an earlier reading pinned the draw at x1.001 from above; this one shows x1.003 from
    below, within the allocator's 2 MiB block of it (two readings of the same draw at the readings'
    resolution). The bound is within the learned margin 1.0 plus that rounding: the new build is
    confirmed at 1.0, not raised to x1.003 x 1.05. A bound beyond the rounding (x1.003) is a draw above
    the margin: re-measured at the draw with the safety."""
    caplog.set_level(logging.INFO, logger="sidecar.admission.lane_watch")
    w, _, _ = unconfirmed(cost__margin=1.0)
    caplog.clear()  # the build change, logged
    assert w._confirm(1003 * MIB, 1250 * MIB, 1.25, 1, 1.001, SLACK) is True
    assert records(caplog) == [
        (
            "WARNING",
            confirmed("1.003", "x1.001", "1.000", "1.000"),
            {"event": "engine_build_confirmed", "drew": 1.003, "upper": 1.001, "margin": 1.0},
        )
    ]
    assert (w.conservative, w.margin) == (None, 1.0)
    w, _, _ = unconfirmed(cost__margin=1.0)
    caplog.clear()  # the build change, logged
    assert w._confirm(1003 * MIB, 1250 * MIB, 1.25, 1, 1.003, SLACK) is True
    assert (w.conservative, w.margin) == (None, pytest.approx(1.003 * 1.05, rel=1e-12))
    assert records(caplog)[0][1] == confirmed("1.003", "x1.003", "1.000", "1.053", how="fit re-measured")


# -- which readings can confirm --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("floor", "overrides", "terms", "requests", "drew", "upper", "after"),
    [
        # One 2 MiB block: an 8 MiB prompt's 25 % is 2 MiB, the allocator's rounding.
        ("allocator_block_bytes", {}, 8 * MIB, 1, 1.0, 1.0, None),
        # min_bytes 32 MiB: a 128 MiB prompt's 25 % is 32 MiB.
        ("min_bytes", {"monitor__min_bytes": "32MiB"}, 128 * MIB, 1, 1.0, 1.0, None),
        # Three peaks, a block each (nothing bounds them from above: a draw of x2 raises to max_margin).
        ("a block per request", {}, 24 * MIB, 3, 2.0, None, 1.5),
    ],
)
def test_only_a_reading_that_can_show_the_new_build_s_safety_confirms_it(
    caplog: pytest.LogCaptureFixture,
    floor: str,
    overrides: dict[str, object],
    terms: int,
    requests: int,
    drew: float,
    upper: float | None,
    after: float | None,
) -> None:
    """A prompt whose 25 % (the new build's safety) is no more than what the monitor excuses anyway
    (the allocator's block per request, ``min_bytes``) cannot show the change the conservative state
    guards against: its reading confirms nothing and asks for no new rules, whatever it shows. Four
    bytes more of cost terms and the same reading is read (confirmed, or the margin raised)."""
    caplog.set_level(logging.INFO, logger="sidecar.admission.lane_watch")
    for t, reads in ((terms, False), (terms + 4, True)):
        w, _, writes = unconfirmed(cost__margin=1.0, **overrides)
        caplog.clear()  # the build change, logged
        projected = round(t * 1.25)  # priced at the conservative margin 1.0 x 1.25
        assert w._confirm(round(t * drew), projected, 1.25, requests, upper, 2 * MIB / t) is reads, floor
        if not reads:
            assert (w.conservative, w.margin, writes, records(caplog)) == (BUILD, 1.0, [], [])
        elif after is None:
            assert (w.conservative, w.margin, writes) == (None, 1.0, [1])
        else:
            assert (w.conservative, w.margin, writes) == (BUILD, after, [1])


def test_a_monitor_tolerating_the_new_build_s_safety_never_confirms_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With ``monitor.tolerance`` at 25 % (the new build's safety) no reading can show the change beyond
    what the monitor tolerates: the lane stays conservative (the safe side) however large the prompt.
    At 24 % a 1,000 MiB prompt drawing its margin confirms it."""
    caplog.set_level(logging.INFO, logger="sidecar.admission.lane_watch")
    w, _, writes = unconfirmed(cost__margin=1.0, monitor__tolerance=0.25)
    caplog.clear()  # the build change, logged
    for terms in (T, 100 * T):
        assert w._confirm(terms, round(terms * 1.25), 1.25, 1, 1.0, 2 * MIB / terms) is False
    assert (w.conservative, writes, records(caplog)) == (BUILD, [], [])
    w, _, writes = unconfirmed(cost__margin=1.0, monitor__tolerance=0.24)
    caplog.clear()  # the build change, logged
    assert w._confirm(T, 1250 * MIB, 1.25, 1, 1.0, SLACK) is True
    assert (w.conservative, writes) == (None, [1])


def test_several_requests_each_rounded_up_by_the_allocator_are_no_overrun_of_a_new_build(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Three prefills' peaks 6 MiB (three 2 MiB blocks) over the learned margin's 1,000 MiB: the
    allocator's rounding, not a draw above the margin; nothing is raised and nothing confirmed (no
    bound from above). One byte more is an overrun: the margin rises to the draw x1.05."""
    caplog.set_level(logging.INFO, logger="sidecar.admission.lane_watch")
    w, _, writes = unconfirmed(cost__margin=1.0)
    caplog.clear()  # the build change, logged
    assert w._confirm(1006 * MIB, 1250 * MIB, 1.25, 3, None, 0.0) is False
    assert (w.margin, writes, records(caplog)) == (1.0, [], [])
    assert w._confirm(1006 * MIB + 1, 1250 * MIB, 1.25, 3, None, 0.0) is True
    assert w.margin == pytest.approx((1006 * MIB + 1) / T * 1.05, rel=1e-12) and w.conservative == BUILD


def test_what_cannot_be_read_as_a_draw_confirms_nothing_and_the_smallest_projection_is_read() -> None:
    """A projection of nothing, or one without the margin it was priced with, says nothing about the
    draw (and must not divide by zero in the sidecar's polling loop): nothing confirmed, no error. A
    projection priced at margin 1.0 (a policy with no safety, charged before the new build was seen)
    is a reading like any other; on an engine that allocates exactly (``allocator_block_bytes`` and
    ``min_bytes`` 0), so is a one-byte projection."""
    w, _, writes = unconfirmed(cost__margin=1.0)
    assert w._confirm(100 * MIB, 0, 1.25, 1, 1.0, 0.0) is False
    assert w._confirm(100 * MIB, 100 * MIB, 0.0, 1, 1.0, 0.0) is False
    assert (w.conservative, w.margin, writes) == (BUILD, 1.0, [])
    assert w._confirm(T, T, 1.0, 1, 1.0, SLACK) is True
    assert (w.conservative, w.margin, writes) == (None, 1.0, [1])
    exact = {"monitor__allocator_block_bytes": 0, "monitor__min_bytes": 0}
    w, _, writes = unconfirmed(cost__margin=1.0, **exact)
    assert w._confirm(1, 1, 1.25, 1, 1.0, 0.0) is True
    assert (w.conservative, w.margin, writes) == (None, 1.0, [1])


# -- the confirmation inside observe ---------------------------------------------------------------------


def test_memory_taken_while_nothing_was_admitted_confirms_nothing_on_a_new_build(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A new low with nothing admitted on an unconfirmed build (another process, the engine itself):
    counted and logged as an unprojected allocation, as on any build; it is no reading of the new
    build's draw, so the lane stays conservative and the rules stay as they are."""
    caplog.set_level(logging.INFO, logger="sidecar.admission.lane_watch")
    w, p, writes = unconfirmed()
    caplog.clear()  # the build change, logged
    snap = reading(3.0, 10 * GIB - 200 * MIB, queue_requests=1, version="0.5.24")
    assert w.observe(snap, IDLE, rules_in_force(p, w.learned), 3.0) is False
    assert records(caplog) == [
        (
            "INFO",
            "GPU memory shows 200 MiB taken beyond idle while nothing was admitted: another process "
            "(the GPU source cannot tell) or the engine outside any request",
            {"event": "unprojected_allocation", "observed_bytes": 200 * MIB},
        )
    ]
    assert (w.unprojected, w.underestimates, w.conservative, writes) == (1, 0, BUILD, [])


def serve(w: LaneWatch, p: Policy, terms: int, observed: int, at: float) -> bool:
    """One prompt of ``terms`` bytes of cost terms admitted alone at the margin in force, its prefill
    done (its first byte: the lane fitted it), and a GPU reading at ``at`` showing ``observed`` beyond
    idle: what ``Admission`` tells the watch. Returns ``observe``'s answer."""
    priced: Rules = rules_in_force(p, w.learned)
    charge = round(terms * priced.cost.margin)
    w.charged(1, "big", ONE, priced.cost, True, charge_bytes=charge)
    w.prefilled(1)
    w.left(charge, last=True)
    snap = reading(at, 10 * GIB - observed, running_requests=1, version="0.5.24")
    return w.observe(snap, ONE, priced, at, in_flight=0)


def test_a_new_build_s_margin_never_rises_so_far_that_the_prompt_it_just_served_is_unfit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first large prompt on a new build (7,800 MiB of cost terms, priced at 1.0 x 1.25 within the
    10 GiB it may take) draws x1.28: with the safety the margin would be 1.344, at which that prompt,
    served a moment ago, would be unfit (7,800 MiB x 1.344 > 10 GiB). The margin goes to 10 GiB /
    7,800 MiB instead, the most at which it still fits, and covering the x1.28 the readings bound, the
    build is confirmed there."""
    caplog.set_level(logging.WARNING, logger="sidecar.admission.lane_watch")
    w, p, _ = unconfirmed(cost__margin=1.0, monitor__max_margin=3.0)
    caplog.clear()  # the build change, logged
    assert serve(w, p, 7800 * MIB, 9984 * MIB, 3.0) is True  # x1.28 of its terms
    ceiling = 10 * GIB / (7800 * MIB)
    assert w.margin == pytest.approx(ceiling, rel=1e-12) and w.conservative is None
    assert round(7800 * MIB * w.margin) <= 10 * GIB
    (line, finding) = records(caplog)
    assert line == (
        "WARNING",
        confirmed("1.280", "x1.280", "1.000", "1.313", how="fit re-measured"),
        {"event": "engine_build_confirmed", "drew": 1.28, "upper": 1.28, "margin": pytest.approx(ceiling)},
    )
    assert finding[2]["event"] == "projection_underestimate" and finding[2]["margin_after"] == 1.3128


# -- the margin rule's edges ---------------------------------------------------------------------------


def test_a_bound_exactly_at_the_margin_raises_nothing_and_a_hair_above_it_does() -> None:
    """A lane whose readings bound its draw at exactly the margin in force (1.25), or at exactly the
    margin plus the allocator's rounding on the reading (1.0 + 2**-9), draws what the margin covers:
    the margin stays. A hair above either is a draw beyond the margin: it rises to the draw seen x1.05."""
    m = Monitor(max_margin=1.5)  # safety 0.05, step 0
    assert raised_margin(1.25, 1.0, 1.0, 1.2, m, upper=1.25) == 1.25
    assert raised_margin(1.25, 1.0, 1.0, 1.2, m, upper=1.25 + 2**-30) == pytest.approx(1.26, rel=1e-12)
    edge = 1.0 + 2**-9
    assert raised_margin(1.0, 1.0, 1.0, edge, m, upper=edge, slack=2**-9) == 1.0
    above = raised_margin(1.0, 1.0, 1.0, edge, m, upper=edge + 2**-30, slack=2**-9)
    assert above == pytest.approx(edge * 1.05, rel=1e-12)


# -- the in-flight guard's margin -----------------------------------------------------------------------


def test_the_in_flight_margin_takes_the_draw_seen_where_it_is_a_hair_above_its_bound() -> None:
    """A reading's draw is a lower bound that the allocator's rounding may put a hair above the bound
    from above: the in-flight guard judges the admitted prefills at the larger of the two (x1.0825
    seen, bounded by x1.08), never below what a reading showed them drawing."""
    w, _, _ = lane(cost__margin=1.05)
    w.margin = 1.2  # the finding raised the margin in force to 1.2
    w._judge_in_flight(1.05, 1.08, 1.0825)
    assert w.in_flight_margin == 1.0825


def test_a_later_lower_bound_never_lowers_the_in_flight_margin() -> None:
    """A first finding bounded the draw by x1.3; a later one (another prompt's readings, the draw
    possibly changed in between) by x1.2: the in-flight guard keeps judging at x1.3, the evidence a
    reading gave does not go away. Only what resets it (a policy load, a restart, a new build's fit)
    does."""
    w, _, _ = lane(cost__margin=1.05)
    w.margin = 1.5
    w._judge_in_flight(1.05, 1.3, 1.25)
    w._judge_in_flight(1.1, 1.2, 1.15)
    assert w.in_flight_margin == 1.3


# -- /admission/state: the crashes and the engine build --------------------------------------------------


def state_without_facts(w: LaneWatch, now: float) -> dict[str, Any]:
    s = w.state(now)
    assert list(s) == ["lane_facts", "crashes", "engine_build", "idle_free", "monitor"]
    return {k: v for k, v in s.items() if k != "lane_facts"}


def test_the_state_shows_the_set_at_risk_the_crash_it_became_and_an_upgrade_under_load() -> None:
    """What an on-call engineer reads after an engine died under load: the set admitted when it was
    seen failing, then the crash read from it (its set, the margin before and after, how long ago),
    the crash margin in force; then a restart onto another build with work admitted, counted as an
    upgrade and not as a crash."""
    w, _, rules = lane()
    w.observe(reading(1.0, 10 * GIB, version="0.5.23"), IDLE, rules, 1.0)
    nothing = {"count": 0, "margin": None, "last": None, "at_risk": None, "upgrades_under_load": 0}
    assert w.state(1.0)["crashes"] == nothing
    s = AdmittedSet(1.5, ("r1", "r2"), 3000 * MIB, 1.0123456, 4 * GIB, 16 * MIB)
    fields = {
        "request_ids": ["r1", "r2"],
        "requests": 2,
        "projected_bytes": 3000 * MIB,
        "priced_margin": 1.0123,
        "budget_bytes": 4 * GIB,
        "reserve_bytes": 16 * MIB,
    }
    w.at_risk(s)
    assert w.state(2.0)["crashes"] == nothing | {"at_risk": fields}
    w.engine_restarted(3.0, "scheduler pid [1] -> [2]")
    w.observe(reading(3.5, 10 * GIB, version="0.5.23"), IDLE, rules, 3.5)  # the same build: a crash
    crash = (4096 + 16) / 3000 * 1.0123456 * 1.05  # the set's cost terms took budget and reserve
    last = fields | {
        "why": "scheduler pid [1] -> [2]",
        "margin_before": 1.0123,
        "margin_after": round(crash, 4),
        "age_s": 2.432,
    }
    assert w.state(5.4321)["crashes"] == {
        "count": 1,
        "margin": pytest.approx(crash, rel=1e-12),
        "last": last,
        "at_risk": None,
        "upgrades_under_load": 0,
    }
    w.at_risk(s)
    w.engine_restarted(6.0, "scheduler pid [2] -> [3]")
    w.observe(reading(6.5, 10 * GIB, version="0.5.24"), IDLE, rules, 6.5)  # another build: an upgrade
    after = state_without_facts(w, 8.7654321)
    assert after["crashes"] == {
        "count": 1,
        "margin": pytest.approx(crash, rel=1e-12),
        "last": last | {"age_s": 5.765},
        "at_risk": None,
        "upgrades_under_load": 1,
    }
    assert after["engine_build"] == {
        "version": "0.5.24",
        "conservative": True,
        "why": BUILD,
        "since_age_s": 2.265,
        "margin_in_force": 1.5,  # the crash margin x1.25, at max_margin
    }


def test_the_state_of_a_new_build_before_and_after_a_reading_confirms_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``/admission/state`` through an upgrade: the build, whether it is unconfirmed, why and since
    when, and the margin in force (x1.25 of 1.0123456, to four places); then a prompt alone whose
    readings bound its draw at x0.990 to x0.992 of its cost terms confirms it, in one line with the
    draw to four places: the wait is gone from the state, the margin in force is the learned one
    again, and the monitor shows the draw the readings bound."""
    w, p, rules = lane()
    w.observe(reading(1.0, 10 * GIB, version="0.5.23"), IDLE, rules, 1.0)
    before = state_without_facts(w, 1.5)
    monitor = fresh_monitor()
    margin = monitor["margin"]
    device = {"ident": "GPU-0", "free_bytes": 10 * GIB, "other_process_bytes": None}
    idle = {
        "policy": 10 * GIB,
        "measured_bytes": 10 * GIB,
        "measured_other_process_bytes": None,
        "measured_age_s": 0.5,
        "measured_devices": [device],
        "after_traffic": False,
        "engine_restarts": 0,
        "note": "measured",
    }
    build = {
        "version": "0.5.23",
        "conservative": False,
        "why": None,
        "since_age_s": None,
        "margin_in_force": 1.0123,
    }
    nothing = {"count": 0, "margin": None, "last": None, "at_risk": None, "upgrades_under_load": 0}
    assert before == {"crashes": nothing, "engine_build": build, "idle_free": idle, "monitor": monitor}

    w.observe(reading(2.0, 10 * GIB, version="0.5.24"), IDLE, rules, 2.0)
    conservative = {"effective": 1.2654, "in_flight": 1.2654}
    assert state_without_facts(w, 3.2345678) == {
        "crashes": nothing,
        "engine_build": build
        | {"version": "0.5.24", "conservative": True, "why": BUILD, "since_age_s": 1.235}
        | {"margin_in_force": 1.2654},
        "idle_free": idle | {"measured_age_s": 2.235},
        "monitor": monitor | {"margin": margin | conservative},
    }

    caplog.clear()
    assert serve(w, p, T, 1_040_000_000, 3.0) is True  # x0.99182 of its terms
    assert records(caplog) == [
        (
            "WARNING",
            confirmed("0.992", "x0.992", "1.012", "1.012"),
            {"event": "engine_build_confirmed", "drew": 0.9918, "upper": 0.9918, "margin": 1.0123456},
        )
    ]
    assert state_without_facts(w, 4.2345678) == {
        "crashes": nothing,
        "engine_build": build | {"version": "0.5.24"},
        "idle_free": idle | {"measured_age_s": 3.235},
        # (1.04e9 - 2 MiB) / 1,000 MiB and 1.04e9 / 1,000 MiB: 0.98982..., 0.99182...
        "monitor": monitor | {"draw_bracket": [0.9898, 0.9918]},
    }
