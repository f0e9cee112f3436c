"""The lane watch's draw bracket and what feeds it, pinned exactly (docs/robustness.md "The monitor in
proportion", evidence RE1 and RA3): ``draw_bracket``'s edges, one chunk's growth, a lone prefill's
bound from its own progress and from the chunks its counter showed done, a reading with no new peak
that still bounds the draw, the served prompt's ceiling, and the set a crash is read against.

A ``LaneWatch`` on a lane of round numbers (margin 1.25, 40 MiB of context terms per 1,024-token
chunk, a 10 GiB idle figure) fed readings by hand, as ``tests/test_monitor_reports.py`` does: each
bound is computed here from the same integers the watch divides, so the comparisons are exact.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.admission.lane_watch import AdmittedSet, LaneWatch, chunk_growth, draw_bracket, excess
from sidecar.core.ledger import LedgerTotals
from sidecar.core.rules import Rules
from sidecar.policy.in_force import rules_of
from sidecar.policy.schema import Monitor
from tests.conftest import MIB, small_policy
from tests.test_monitor_reports import BUSY, IDLE, reading

GIB = 1024 * MIB
BLOCK = 2 * MIB  # the allocator's block (``monitor.allocator_block_bytes``' default): a reading's rounding
GROWTH = 40 * MIB  # 1,024 tokens of context at 40 KiB each: what a projection at progress may run ahead
ONE = LedgerTotals(requests=1, running_requests=1)

LANE: dict[str, object] = dict(
    cost__margin=1.25,
    cost__context_bytes_per_token=40 * 1024,
    lane__chunked_prefill_size=1024,
    vram__headroom="idle_budget",
    vram__idle_free_bytes="10GiB",
    monitor__tolerance=0.0,
    monitor__min_bytes="1MiB",
    monitor__max_margin=3.0,
)


def lane(**overrides: object) -> tuple[LaneWatch, Rules]:
    rules = rules_of(small_policy(**(LANE | overrides)).policy)
    return LaneWatch(rules), rules


def charge(w: LaneWatch, rules: Rules, key: int = 1, rid: str = "r1", charge_bytes: int = 0) -> None:
    """One prefill admitted with its progress known (the readings are judged at its progress)."""
    w.charged(key, rid, ONE, rules.cost, progress=True, charge_bytes=charge_bytes)


def see(
    w: LaneWatch, rules: Rules, at: float, observed: int, in_flight: int | None, done: int | None = None
) -> None:
    """A GPU reading at ``at`` showing ``observed`` bytes beyond the 10 GiB idle figure."""
    w.observe(
        reading(at, 10 * GIB - observed, running_requests=1), ONE, rules, at, in_flight=in_flight, done=done
    )


def lone_at_1030(**overrides: object) -> tuple[LaneWatch, Rules]:
    """r1 alone, priced at 1,250 MiB at its progress (1,000 MiB of terms at 1.25), 1,030 MiB shown."""
    w, rules = lane(**overrides)
    charge(w, rules)
    see(w, rules, 1.0, 1030 * MIB, in_flight=1250 * MIB)
    return w, rules


LO_1030 = (1030 * MIB - BLOCK) / (1000 * MIB)  # its terms: less the allocator's rounding
HI_1030 = 1030 * MIB / (1000 * MIB - GROWTH)  # its terms less a chunk: the projection may run ahead


# -- the pure rules ----------------------------------------------------------------------------------


def test_a_reading_bounds_the_draw_from_its_own_bytes_without_rounding_unless_told() -> None:
    """With no rounding named the lower bound is the reading over its terms, not a byte less: the
    bracket's floor is what a finding is weighed against, and a silent allowance would hide a draw
    just over the margin (an under-raised margin)."""
    assert draw_bracket(103, 100, 4, None) == (103 / 100, 103 / 96)
    assert draw_bracket(103, 100, 4, None, rounding=1) == (102 / 100, 103 / 96)
    # Rounding beyond the whole reading: the draw is at least 0, never a byte's worth above it.
    assert draw_bracket(2, 100, 4, None, rounding=5) == (0.0, 2 / 96)


def test_draw_bracket_bounds_from_one_byte_surely_held_and_one_byte_shown() -> None:
    """The edges of "nothing to bound by": terms within a chunk of zero, or a reading showing nothing
    beyond idle, bound nothing (None: the finding pays the safety on its draw); one byte surely held
    or one byte shown is a bound. A bound invented from nothing would let a finding raise nothing (an
    under-raised margin); a bound dropped at one byte widens a draw the readings pinned."""
    assert draw_bracket(5, 10, 10, None) is None  # nothing surely allocated
    assert draw_bracket(5, 10, 9, None) == (0.5, 5.0)  # one byte surely allocated
    assert draw_bracket(0, 100, 4, None) is None  # nothing shown
    assert draw_bracket(1, 100, 4, None) == (1 / 100, 1 / 96)  # one byte shown


def test_a_reading_that_meets_the_bracket_s_edge_narrows_it_and_one_beyond_starts_it_again() -> None:
    """A reading whose lower bound is exactly the bracket's top pins the draw there (a steady draw
    seen from below and above, RE1); read as a change, the bracket would start again a chunk wide
    (x1.05 .. x1.094) and raise the margin of a lane drawing its margin. Its upper bound exactly at
    the bracket's bottom pins it too. One byte beyond either: the draw changed, it starts again."""
    before = (1.0, 1.05)
    assert draw_bracket(105, 100, 4, before) == (1.05, 1.05)
    assert draw_bracket(106, 100, 4, before) == (1.06, 106 / 96)
    assert draw_bracket(96, 100, 4, before) == (1.0, 1.0)
    assert draw_bracket(95, 100, 4, before) == (0.95, 95 / 96)


def test_one_chunk_grows_a_prefill_s_terms_by_its_context_gather_and_chunk_by_context_bytes() -> None:
    """A projection at progress may run a chunk ahead of the engine by every per-context-token term
    (context and gather) and the chunk-by-context buffers, rounded up: a growth understated lifts the
    floor the reading is divided by, and the upper bound on the draw comes out low (an under-raised
    margin, RA3)."""
    cost = replace(
        rules_of(small_policy().policy).cost,
        context_bytes_per_token=1000,
        gather_bytes_per_context_token=200,
        chunk_context_bytes=0.5,
    )
    assert chunk_growth(cost, 100) == 100 * (1000 + 200 + 0.5 * 100)
    assert chunk_growth(replace(cost, chunk_context_bytes=0.001), 3) == 3601  # 3,600.009 rounded up


def test_excess_allows_one_block_of_rounding_for_one_request_by_default() -> None:
    """A reading of one request is allowed the allocator's rounding once (2 MiB): 3 MiB over a
    projection is a finding; allowing two blocks by default would hide it (an overrun unseen, a prompt
    at the edge crashing the lane). Two requests, two blocks."""
    m = Monitor(tolerance=0.0, min_bytes=MIB)
    assert excess(1003 * MIB, 1000 * MIB, m) == 1003 / 1000
    assert excess(1004 * MIB, 1000 * MIB, m, requests=2) is None
    assert excess(1005 * MIB, 1000 * MIB, m, requests=2) == 1005 / 1000


# -- a lone prefill's bracket in the watch -----------------------------------------------------------


@pytest.mark.parametrize(("margin", "in_flight"), [(1.0, 1000 * MIB), (1.25, 1250 * MIB)])
def test_a_lone_prefill_s_reading_brackets_its_draw_from_its_terms_at_progress(
    margin: float, in_flight: int
) -> None:
    """1,000 MiB of terms at progress (its projection over the margin it was charged at, 1.0 or 1.25),
    1,030 MiB shown: the draw is at least (1,030 - 2) / 1,000 and at most 1,030 / (1,000 - 40), what
    ``/admission/state`` shows and a finding's raise is bounded by. Terms taken at the projection
    itself, or the rounding taken for the chunk, would set the bound where no reading put it."""
    w, rules = lane(cost__margin=margin)
    charge(w, rules)
    see(w, rules, 1.0, 1030 * MIB, in_flight=in_flight)
    assert w.bracket == (LO_1030, HI_1030)
    assert w.state(1.0)["monitor"]["draw_bracket"] == [round(LO_1030, 4), round(HI_1030, 4)]


@pytest.mark.parametrize(
    ("done", "floor"),
    [
        (None, 1000 * MIB - GROWTH),  # nothing counted: its projection less a chunk
        (1237 * MIB + MIB // 2, 990 * MIB),  # the counter says 990 MiB of terms are surely held
        (1300 * MIB, 1000 * MIB),  # never more than the terms the reading is compared with
        (0, None),  # its counter shows no batch yet: nothing is sure, no bound
    ],
)
def test_what_the_counter_says_is_held_bounds_a_lone_prefill_s_draw(
    done: int | None, floor: int | None
) -> None:
    """The chunks the counter showed done (``done``, priced at the margin charged) are surely held:
    where that is more than the projection less a chunk, the upper bound is the reading over it (RE1:
    a bound a chunk loose raised the margin of a lane drawing within it and aborted its prompt).
    Before the counter shows its first batch nothing is sure: no bound, the finding pays the safety."""
    w, rules = lane()
    charge(w, rules)
    see(w, rules, 1.0, 1030 * MIB, in_flight=1250 * MIB, done=done)
    assert w.bracket == (None if floor is None else (LO_1030, 1030 * MIB / floor))


def test_a_lone_prefill_is_bounded_by_its_own_progress_not_by_the_peak_it_is_compared_with() -> None:
    """r0 (2,000 MiB of terms) ended; r1 alone at 1,960 MiB of terms when a new low (2,600 MiB) is
    compared with r0's peak. What r1 surely holds is its own progress less a chunk (1,920 MiB), not
    r0's peak less a chunk (1,960): the upper bound is 2,600 / 1,920, and the in-flight guard judges r1
    at it. Taken from the other prompt's terms (RE1, ``req-7`` at 178 s) the bound comes out low, and
    the guard keeps a prompt the lane's draw may not fit (a crash)."""
    w, rules = lane()
    charge(w, rules, 0, "r0", charge_bytes=2500 * MIB)
    see(w, rules, 1.0, 2500 * MIB, in_flight=2500 * MIB)
    w.left(2500 * MIB, last=True)
    w.prefilled(0)
    w.ended(0, 1.5)
    charge(w, rules, 1, "r1", charge_bytes=2500 * MIB)
    see(w, rules, 2.0, 2500 * MIB, in_flight=2400 * MIB)  # r0 and r1 since the last reading: no bound
    see(w, rules, 3.0, 2600 * MIB, in_flight=2450 * MIB)
    hi = 2600 * MIB / (1960 * MIB - GROWTH)
    assert w.bracket == ((2600 * MIB - BLOCK) / (2000 * MIB), hi)
    assert w.last is not None and w.last.ratio == 2600 / 2500
    assert w.margin == pytest.approx(1.25 * 2600 / 2500 * 1.05, rel=1e-12)  # the draw seen x 1.05
    assert w.in_flight_margin == hi  # the evidence, without the safety


def test_a_prefill_s_readings_narrow_its_own_bracket_and_the_next_prompt_starts_its_own() -> None:
    """A bracket is one prefill's: r1's readings narrow it; r2 starts again from its own reading, as
    the draw may have changed unseen in between (RE1). Carrying r1's bracket into r2 would bound r2's
    draw by r1's readings (an under-raised margin); resetting it at each reading of r1 would keep a
    chunk-wide bound on a lane drawing its margin (a margin raised for nothing)."""
    w, rules = lone_at_1030()
    see(w, rules, 2.0, 1040 * MIB, in_flight=1300 * MIB)  # a new low: x0.998 .. x1.04 alone
    assert w.bracket == (LO_1030, 1040 * MIB / (1040 * MIB - GROWTH))
    w.left(1300 * MIB, last=True)
    w.prefilled(1)
    w.ended(1, 2.5)
    charge(w, rules, 2, "r2")
    see(w, rules, 3.0, 1040 * MIB, in_flight=1250 * MIB)  # r1 and r2 since the last reading
    # r2 alone, a new low overlapping r1's bracket, compared with r1's final peak (1,040 MiB of terms)
    # while r2 surely holds its own progress less a chunk (960 MiB).
    see(w, rules, 4.0, 1050 * MIB, in_flight=1250 * MIB)
    assert w.bracket == ((1050 * MIB - BLOCK) / (1040 * MIB), 1050 * MIB / (1000 * MIB - GROWTH))


# -- a reading with nothing new still bounds from above -------------------------------------------------


def test_a_reading_with_no_new_peak_narrows_the_bracket_from_what_the_counter_says_is_held() -> None:
    """1,020 MiB shown (below the low-water mark: nothing new) while the counter says r1 holds 990 MiB
    of terms (1,237.5 MiB at 1.25): the draw is at most 1,020 / 990, whatever earlier peaks show. The
    bound the in-flight guard and the next finding use; without it a chunk-wide bound stays (RE1)."""
    w, rules = lone_at_1030()
    see(w, rules, 2.0, 1020 * MIB, in_flight=1260 * MIB, done=1237 * MIB + MIB // 2)
    assert w.bracket == (LO_1030, 1020 * MIB / (990 * MIB))


def test_a_bound_from_above_at_the_bracket_s_bottom_pins_it_and_one_below_it_says_nothing() -> None:
    """An upper bound exactly at the bracket's lower bound pins the draw there; one a byte below it
    says the draw fell (a reading that confirms nothing: the bracket stays, never inverted)."""
    w, rules = lone_at_1030()
    see(w, rules, 2.0, 1028 * MIB, in_flight=1260 * MIB, done=1250 * MIB)
    assert w.bracket == (LO_1030, LO_1030)
    w, rules = lone_at_1030()
    see(w, rules, 2.0, 1028 * MIB - 1, in_flight=1260 * MIB, done=1250 * MIB)
    assert w.bracket == (LO_1030, HI_1030)


def test_another_prompt_s_reading_never_narrows_a_bracket() -> None:
    """r1's bracket, then r2 alone with a reading that shows nothing new: r2's counter says nothing of
    r1's draw. Narrowing r1's bracket by r2's bytes would bound a draw by another prompt's (RE1)."""
    w, rules = lone_at_1030()
    w.ended(1, 1.5)
    charge(w, rules, 2, "r2")
    see(w, rules, 2.0, 1030 * MIB, in_flight=1250 * MIB)  # r1 and r2 since the last reading
    see(w, rules, 3.0, 1030 * MIB, in_flight=1260 * MIB, done=1250 * MIB)  # r2 alone: x1.03 at most
    assert w.bracket == (LO_1030, HI_1030)


def test_a_reading_of_nothing_beyond_idle_bounds_nothing_and_one_byte_does() -> None:
    """A bracket whose lower bound is 0 (1 MiB shown, under the allocator's block), then readings with
    nothing new: one byte shown bounds the draw at one byte over the held terms; nothing shown bounds
    nothing. A bound of 0 would make every later finding look covered by the margin (``raised_margin``
    raises nothing under an upper bound within it): an under-raised margin."""
    w, rules = lane()
    charge(w, rules)
    see(w, rules, 1.0, MIB, in_flight=1250 * MIB)
    assert w.bracket == (0.0, MIB / (1000 * MIB - GROWTH))
    see(w, rules, 2.0, 1, in_flight=1260 * MIB, done=1250 * MIB)
    assert w.bracket == (0.0, 1 / (1000 * MIB))
    see(w, rules, 3.0, 0, in_flight=1260 * MIB, done=1250 * MIB)
    assert w.bracket == (0.0, 1 / (1000 * MIB))


# -- the edges of "a lone prefill's reading" ------------------------------------------------------------


def test_a_one_byte_projection_brackets_and_nothing_projected_does_not() -> None:
    """A projection of one byte is still a projection (as ``excess`` judges it): on a lane with no
    context terms (no chunk of growth) the lone prefill's reading bounds the draw from it; nothing
    projected bounds nothing (the reading is memory taken outside any request)."""
    w, rules = lane(cost__margin=1.0, cost__context_bytes_per_token=0)
    charge(w, rules)
    see(w, rules, 1.0, 3 * MIB, in_flight=1)
    assert w.bracket == (float(MIB), float(3 * MIB))
    w, rules = lane(cost__margin=1.0, cost__context_bytes_per_token=0)
    charge(w, rules)
    see(w, rules, 1.0, 3 * MIB, in_flight=0)
    assert w.bracket is None and w.unprojected == 1


def test_a_chunk_of_one_token_is_a_chunk_and_no_chunk_bounds_nothing() -> None:
    """A lane chunking by one token runs at most one token ahead: its reading is bracketed. Rules with
    no chunk (0: built in code, the schema asks for one) give no step to bound a projection's lead by:
    no bracket, rather than one that assumes the projection exact (an under-raised margin)."""
    w, rules = lone_at_1030(lane__chunked_prefill_size=1)
    assert w.bracket == (LO_1030, 1030 * MIB / (1000 * MIB - 40 * 1024))
    w, rules = lane()
    charge(w, rules)
    none = replace(rules, lane=replace(rules.lane, chunked_prefill_size=0))
    w.observe(reading(1.0, 10 * GIB - 1030 * MIB, running_requests=1), ONE, none, 1.0, in_flight=1250 * MIB)
    assert w.bracket is None


def test_a_cost_model_with_no_margin_is_read_as_its_own_terms_and_never_divided_by() -> None:
    """A ``CostModel`` built in code with margin 0 (the dataclass allows it; the schema asks for 1 or
    more): its charge is its own terms, and its readings bound no draw (no terms to divide by). A
    division by zero here would fail the snapshot update that feeds every decision."""
    w, rules = lane()
    cost = replace(rules.cost, margin=0.0)
    w.charged(1, "r1", ONE, cost, progress=True, charge_bytes=500 * MIB)
    see(w, rules, 1.0, 1030 * MIB, in_flight=1250 * MIB)
    assert w.bracket is None and w.last is None
    w.prefilled(1)
    assert w._ceiling() == 10 * GIB / (500 * MIB)


# -- the served prompt's ceiling -----------------------------------------------------------------------


def test_a_raise_stops_at_the_margin_that_keeps_the_largest_served_prompt_fit() -> None:
    """r0 was charged 1,250 MiB at 1.25 (1,000 MiB of terms) and reached its first byte on a lane with a
    1,300 MiB transient cap: a margin up to 1.3 keeps it fit. A finding that saw x1.28 raises to 1.3
    (not x1.28 x 1.05 = 1.344, which would make r0 unfit, nor less: the safety as far as it goes).
    The served prompt's terms taken as its charge, or as its charge times the margin, put the ceiling
    a margin's worth low: the raise stops at the draw seen (an under-raised margin)."""
    w, rules = lane(vram__reserve_bytes=f"{10 * 1024 - 1300}MiB")
    charge(w, rules, 0, "r0", charge_bytes=1250 * MIB)
    w.prefilled(0)
    charge(w, rules, 1, "r1", charge_bytes=1250 * MIB)
    see(w, rules, 1.0, 1280 * MIB, in_flight=1250 * MIB)  # r0 and r1: no bracket
    assert w.last is not None and w.last.ratio == 1280 / 1250
    assert w.margin == 1300 * MIB / (1000 * MIB)


def test_a_charge_below_its_terms_counts_its_terms() -> None:
    """A margin below 1 (a ``CostModel`` built in code, as ``tests/test_core_overrun.py`` prices one):
    the served prompt's terms are still its charge over the margin (500 MiB at 0.5 is 1,000 MiB of
    terms), so the ceiling is the cap over those. Its charge taken as the terms would double the
    ceiling (a raise past what keeps a served prompt fit: it becomes unfit_request)."""
    w, rules = lane()
    w.charged(1, "r1", ONE, replace(rules.cost, margin=0.5), progress=True, charge_bytes=500 * MIB)
    w.prefilled(1)
    see(w, rules, 1.0, 0, in_flight=None)
    assert w._ceiling() == 10 * GIB / (1000 * MIB)


def test_only_a_prompt_charged_with_its_bytes_and_served_is_evidence_of_what_the_lane_fits() -> None:
    """A charge that names no bytes, a first byte seen twice, one for a request never charged: none is a
    served prompt (and none fails: a repeated first byte must not break the proxy). Taken as a one-byte
    prompt served, each would set a ceiling, and on a lane whose transient cap is that small (1 byte:
    a hand-picked edge, at any real cap such a ceiling is out of reach) cap the raise at the draw seen,
    without the safety: an under-raised margin. Here nothing was served: the draw times 1.05."""
    w, rules = lane(cost__margin=1.0, vram__max_transient_bytes=1)
    w.charged(1, "r1", BUSY, rules.cost, progress=False)
    w.prefilled(1)
    w.prefilled(1)
    w.prefilled(99)
    w.observe(reading(1.0, 10 * GIB - 1100 * MIB, running_requests=1), BUSY, rules, 1.0)
    assert w._ceiling() is None
    assert w.last is not None and w.last.ratio == 1100 / 1000
    assert w.margin == pytest.approx(1100 / 1000 * 1.05, rel=1e-12)


# -- the set a crash is read against -------------------------------------------------------------------


def test_an_engine_that_answered_clears_the_set_and_a_later_failure_keeps_its_own() -> None:
    """The engine failed with r1 admitted (the set kept at 5.0); a report read at 5.0 exactly (as late
    as the set) says the same process answered: the set is no evidence. One read before it does not
    clear it. A later failure with r2 admitted keeps r2's set, and a restart then is read against it
    (a crash: the margin rises so r2's set would not have fitted)."""
    w, rules = lane()
    s = AdmittedSet(5.0, ("r1",), 1250 * MIB, 1.25, 10 * GIB, 0)
    w.at_risk(s)
    w.engine_ok(6.0, 4.999)
    assert w.state(6.0)["crashes"]["at_risk"] == s.fields()
    w.engine_ok(6.0, 5.0)
    assert w.state(6.0)["crashes"]["at_risk"] is None
    later = replace(s, at=7.0, request_ids=("r2",))
    w.at_risk(later)
    assert w.state(7.0)["crashes"]["at_risk"] == later.fields()
    w.engine_restarted(8.0)
    w.observe(reading(9.0, 10 * GIB), IDLE, rules, 9.0)  # the new process's first report
    assert w.crashes == 1 and w.last_crash is not None and w.last_crash.admitted is later
    assert w.margin == 3.0  # 10 GiB over 1,000 MiB of terms x 1.05, capped at max_margin
