"""The monitor in proportion (issue 29, item 3): a lane drawing within the lane policy's stated safety
keeps what it admitted; beyond it the in-flight guard still stops the prompt that would kill it.

The pure rules (``draw_bracket``, ``raised_margin``, ``LaneWatch.in_flight_margin``), then the old
Max-Q lane policy (``policies/maxq-qwen3next-old.yaml``: margin 1.05, 16 MiB reserve) in replay (virtual
time) on the emulated lane with its transients scaled, as the robustness block runs it. Evidence RE1.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from sidecar.admission.lane_watch import LaneWatch, draw_bracket, raised_margin
from sidecar.core import demand
from sidecar.core.cost import project_at_progress, project_bytes, shape
from sidecar.core.overrun import Prefill, done_bytes
from sidecar.policy.in_force import rules_of
from sidecar.policy.schema import LoadedPolicy, Monitor, load_policy_file
from sidecar_emulator.profiles import MiB, get_profile
from sidecar_emulator.replay import Driver
from sidecar_emulator.scenario import Request, Requests, Scenario
from tests.conftest import POLICIES

# -- the pure rules ----------------------------------------------------------------------------------


def test_two_readings_that_pin_the_same_draw_keep_the_bracket_narrow() -> None:
    # One reading between chunks pins the draw from above (observed / (terms - growth) = x1.05); the
    # next pins it from below at x1.05 too, a few KiB of arithmetic apart (the fit's coefficients are
    # rounded). That is no change of the draw: the bracket stays narrow instead of starting again a
    # chunk wide (x1.05 .. x1.11), which raised the margin on a lane drawing its margin (RE1).
    terms, growth = 400 * MiB, 40 * MiB
    b = draw_bracket(round(1.05 * (terms - growth)), terms, growth, None, rounding=2 * MiB)
    assert b is not None and b[1] == pytest.approx(1.05)
    after = draw_bracket(round(1.05 * terms) + 4096, terms, growth, b, rounding=2 * MiB)
    assert after is not None and after[1] == pytest.approx(1.05)
    # Without the allocator's rounding a reading a few KiB above the bound reads as a changed draw.
    alone = draw_bracket(round(1.05 * terms) + 4096, terms, growth, b)
    assert alone is not None and alone[1] > 1.1
    # A real change (x1.10) is beyond any rounding: the bracket starts again from it.
    changed = draw_bracket(round(1.10 * terms), terms, growth, b, rounding=2 * MiB)
    assert changed is not None and changed[0] > 1.09


def test_what_the_engine_surely_holds_bounds_the_draw_from_above() -> None:
    # 532 MiB shown; the engine holds at least the 507 MiB of the chunk after those counted done: the
    # draw is at most x1.05, wherever the projection (545 MiB, the allowance's reach) ran ahead to.
    b = draw_bracket(round(1.05 * 507 * MiB), 545 * MiB, 37 * MiB, None, rounding=2 * MiB, below=507 * MiB)
    assert b is not None and b[1] == pytest.approx(1.05) and b[0] < 1.0
    # Nothing surely held (before the counter shows its first batch): no bound.
    assert draw_bracket(100 * MiB, 545 * MiB, 37 * MiB, None, below=0) is None


def test_the_least_a_lone_prefill_holds_is_the_chunk_after_those_counted() -> None:
    r = rules_of(lane_policy().policy)
    d = demand.build(r, 100_000, arrived_at=0.0, request_id="r1")
    c = r.cost
    # Counted 16,384 tokens done: the engine runs (or ran) the chunk ending at 24,576.
    p = Prefill(1, d, done_tokens=30_000, started=True, counted_tokens=16_384)
    assert done_bytes([p], c) == project_at_progress(c, 100_000, 100_000, 8192, 16_384, 0)
    assert done_bytes([p], c) == project_bytes(c, shape(24_576, 100_000, 8192))
    assert done_bytes([replace(p, started=False, counted_tokens=0)], c) == 0  # not run yet: nothing sure
    assert done_bytes([replace(p, counted_tokens=None)], c) is None  # no counter
    assert done_bytes([p, replace(p, key=2)], c) is None  # several: whose chunk runs is not known


def test_a_bound_at_the_margin_within_the_allocator_s_rounding_raises_nothing() -> None:
    m = Monitor(max_margin=1.5)  # safety 0.05, step 0
    # A lane drawing its margin, bounded a few KiB above it on ~650 MiB of terms: nothing to raise.
    slack = 2 * MiB / (650 * MiB)
    assert raised_margin(1.05, 1.0, 1.05, 1.05, m, upper=1.05 + 1e-5, slack=slack) == 1.05
    assert raised_margin(1.05, 1.0, 1.05, 1.05, m, upper=1.05 + 1e-5) == pytest.approx(1.1025)
    # Beyond the rounding it is a draw above the margin: the rule as before.
    assert raised_margin(1.05, 1.0, 1.05, 1.06, m, upper=1.07, slack=slack) == pytest.approx(1.113)


def test_the_in_flight_margin_is_the_evidence_without_the_safety() -> None:
    w = LaneWatch(rules_of(lane_policy().policy))
    assert w.in_flight_margin == w.margin == 1.05
    w.margin = 1.134  # a finding bounded the draw by x1.08 and raised the margin to 1.08 x 1.05
    w._judge_in_flight(1.05, 1.08, 1.046)
    assert w.in_flight_margin == pytest.approx(1.08)
    w._judge_in_flight(1.134, 1.06, 1.05)  # a later bound within it: never below the margin in force then
    assert w.in_flight_margin == pytest.approx(1.134)
    w._judge_in_flight(1.134, None, 1.05)  # a finding that bounds nothing: the margin in force
    assert w.in_flight_margin == w.margin
    w._judge_in_flight(1.05, 1.08, 1.046)
    w.engine_restarted(10.0)  # a new process: nothing of it in flight
    assert w.in_flight_margin == w.margin


# -- the lane policy on a lane drawing more than its fit (replay, virtual time) ----------------------


def lane_policy() -> LoadedPolicy:
    return load_policy_file(POLICIES / "maxq-qwen3next-old.yaml")


def tokens_for(terms_mib: float) -> int:
    """A cold prompt whose cost terms at its last (full) chunk are ``terms_mib`` on the lane policy."""
    cost = rules_of(lane_policy().policy).cost
    per_token = cost.context_bytes_per_token
    return round((terms_mib * MiB - cost.activation_bytes_per_chunk_token * 8192) / per_token)


def terms_of(tokens: int) -> float:
    cost = rules_of(lane_policy().policy).cost
    return project_bytes(cost, shape(tokens, tokens, 8192)) / cost.margin / MiB


def run(prompt_tokens: int, scale: float, guard: bool = True) -> tuple[Driver, dict[str, Any]]:
    sc = Scenario(
        name="proportion",
        profile="maxq-old",
        policy="policies/maxq-qwen3next-old.yaml",
        duration_s=600,
        workload=[
            Requests(kind="requests", requests=[Request(t=0, prompt_tokens=prompt_tokens, max_new_tokens=64)])
        ],
    )
    profile = get_profile("maxq-old").replace(transient_scale=scale)
    d = Driver(sc, profile, lane_policy().with_section("guard", enabled=guard), sc.seed)
    return d, d.run()


def outcome(r: dict[str, Any]) -> str:
    (q,) = r["requests_detail"]
    return q["outcome"]


EDGE = 259_420  # the band's first prompt on seed 0: 1,279 MiB of terms, x1.05 of it fits 1,356 MiB


def test_a_prompt_admitted_at_the_margin_on_a_lane_drawing_it_is_served() -> None:
    assert 1.05 * terms_of(EDGE) < 1356 < 1.1025 * terms_of(EDGE)  # the safety on top would not fit
    d, r = run(EDGE, 1.05)
    assert outcome(r) == "completed" and r["crashes"] == []
    assert r["guard"]["aborted"] == 0
    w = d.admission.watch  # type: ignore[union-attr]
    # It was seen (x1.05 over a fit calibrated at x1.0: the monitor counts it) and raised nothing.
    assert w.underestimates >= 1 and w.margin == 1.05
    assert w.bracket is not None and w.bracket[1] <= 1.05 + 2 * MiB / (600 * MiB)


def test_beyond_the_safety_the_prompt_that_would_kill_the_lane_is_still_aborted() -> None:
    _, rb = run(EDGE, 1.10, guard=False)
    assert rb["crashes"], "without the guard x1.10 must kill the engine (else no test)"
    d, r = run(EDGE, 1.10)
    assert r["crashes"] == [] and outcome(r) == "rejected:prefill_overrun"
    assert r["guard"]["aborted"] == 1
    assert d.admission.watch.margin > 1.10  # type: ignore[union-attr]


def test_beyond_the_safety_a_prompt_that_fits_the_evidence_runs_while_new_ones_pay_the_safety() -> None:
    # x1.08: beyond the stated safety. A prompt of ~1,200 MiB of terms fits at x1.08 (1,296 MiB and a
    # chunk's uncertainty, on 1,356), not at the raised margin x1.08 x 1.05 (1,361 MiB): it is run.
    tokens = tokens_for(1200)
    assert 1.08 * 1.03 * terms_of(tokens) < 1356 < 1.08 * 1.05 * terms_of(tokens)
    d, r = run(tokens, 1.08)
    assert r["crashes"] == [] and outcome(r) == "completed" and r["guard"]["aborted"] == 0
    w = d.admission.watch  # type: ignore[union-attr]
    assert w.margin >= 1.08 * 1.05 - 1e-3  # new admissions: the draw with the safety
    assert w.in_flight_margin < w.margin
