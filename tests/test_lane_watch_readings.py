"""The lane watch's reading check, idle measurement and lane-fact comparison, pinned exactly
(docs/robustness.md): which engine report counts as the new process's after a restart, which GPU
reading may measure or raise the idle figure, how a lane fact's disagreement is warned of (the line,
its fields, once per change), how a new build's fit is confirmed only on readings that show the
peaks, the allocator's rounding per request and on a bracketed draw, and what the in-flight guard is
told. ``tests/test_monitor_reports.py`` and ``tests/test_lane_watch_bracket.py`` build the lanes and
readings; each figure here is computed from the same integers the watch divides.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, make_dataclass, replace
from types import SimpleNamespace
from typing import Any

import pytest

from sidecar.admission.lane_watch import AdmittedSet, LaneWatch, cost_fingerprint
from sidecar.core.ledger import LedgerTotals
from sidecar.core.rules import Rules
from sidecar.core.snapshot import Snapshot, SourceHealth
from tests.conftest import MIB
from tests.test_lane_watch_bracket import BLOCK, charge, see
from tests.test_lane_watch_bracket import lane as bracket_lane
from tests.test_monitor_reports import IDLE, reading, records
from tests.test_monitor_reports import lane as reports_lane

GIB = 1024 * MIB
LOG = "sidecar.admission.lane_watch"


def engine_at(snap: Snapshot, at: float) -> Snapshot:
    """``snap`` with its engine report taken at ``at`` (its GPU reading unchanged)."""
    assert snap.engine is not None
    return replace(snap, engine=replace(snap.engine, observed_at=at))


def gpu_at(snap: Snapshot, at: float, last_ok_at: float | None) -> Snapshot:
    """``snap`` with its GPU figure dated ``at`` and the GPU source's last good poll at ``last_ok_at``."""
    assert snap.gpu is not None
    return replace(
        snap, gpu=replace(snap.gpu, observed_at=at), gpu_health=SourceHealth(last_ok_at=last_ok_at)
    )


# -- which report is the new process's ------------------------------------------------------------------


def test_the_old_process_s_last_report_never_measures_the_new_process_s_idle_figure() -> None:
    """The engine's last report before a restart can still sit in the snapshot next to a fresh GPU
    reading taken while the engine was down (its memory released): measuring that as the idle figure
    would hand out memory the new process takes back when it loads. Only a report newer than the old
    process's last one (by any amount, even one read a hair before the restart was noticed) counts."""
    w, _, rules = reports_lane(vram__idle_free_bytes="auto")
    assert w.observe(reading(1.0, 10 * GIB), IDLE, rules, 1.0)
    w.engine_restarted(2.0)
    down = engine_at(reading(2.5, 12 * GIB), 1.0)  # the old process's report, a GPU read after the restart
    assert not w.observe(down, IDLE, rules, 2.5)
    assert w.idle is None
    assert w.state(2.5)["idle_free"]["measured_bytes"] is None
    newer = engine_at(reading(3.0, 9 * GIB), 1.0 + 1 / 1024)
    assert w.observe(newer, IDLE, rules, 3.0)
    assert w.idle is not None and (w.idle.free_bytes, w.idle.measured_at) == (9 * GIB, 3.0)


def test_a_restart_with_work_admitted_is_read_at_the_new_process_s_report_where_its_build_shows() -> None:
    """The engine went from build 0.5.1 with r1 admitted; the old process's report says nothing yet;
    the new process reports 0.5.2: a planned upgrade (counted as such, the lane priced conservatively),
    not a crash. Read without the report, every rolling upgrade would count as an out-of-memory crash
    and raise the margin a whole lane then pays for."""
    w, _, rules = reports_lane()
    w.observe(reading(1.0, 10 * GIB, version="0.5.1"), IDLE, rules, 1.0)
    w.at_risk(AdmittedSet(1.5, ("r1",), 1000 * MIB, 1.0123456, 10 * GIB, 0))
    w.engine_restarted(2.0)
    w.observe(engine_at(reading(2.5, 10 * GIB, version="0.5.1"), 1.0), IDLE, rules, 2.5)
    assert (w.crashes, w.upgrades, w.conservative) == (0, 0, None)
    assert w.observe(reading(3.0, 10 * GIB, version="0.5.2"), IDLE, rules, 3.0)
    assert (w.crashes, w.upgrades, w.conservative) == (0, 1, "engine build 0.5.1 -> 0.5.2")
    assert w.margin == 1.0123456 and w.state(3.0)["crashes"]["upgrades_under_load"] == 1


# -- which GPU reading measures the idle figure ----------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu_figure_at", "last_ok_at", "measured"),
    [
        (1.5, 3.0, True),  # a figure dated before the restart, confirmed by a good poll after it
        (2.0, 2.0, True),  # read exactly when the restart was noticed
        (2.0 - 1 / 1024, 2.0 - 1 / 1024, False),  # read before it: the engine may have been down
        (2.5, None, True),  # no poll recorded: the figure's own date
    ],
)
def test_after_a_restart_only_a_gpu_reading_confirmed_since_it_measures_the_idle_figure(
    gpu_figure_at: float, last_ok_at: float | None, measured: bool
) -> None:
    """A GPU source that dates its figure when it last changed (a file) is confirmed by every good
    poll: a figure unchanged since before the restart but polled after it is the new process's idle
    (waiting for it to change would never measure a steady lane). A figure read before the restart
    was noticed may show the engine down, its memory released: taken as idle, the gate would hand out
    what the new process loads into."""
    w, _, rules = reports_lane(vram__idle_free_bytes="auto")
    w.engine_restarted(2.0)
    snap = gpu_at(reading(3.0, 9 * GIB), gpu_figure_at, last_ok_at)
    assert w.observe(snap, IDLE, rules, 3.0) is measured
    assert (w.idle.free_bytes if w.idle else None) == (9 * GIB if measured else None)


def test_a_higher_idle_figure_before_traffic_needs_an_engine_report_as_new_as_the_gpu_reading() -> None:
    """Before any traffic a higher idle reading is warm-up settling and raises the figure, but only
    on a GPU reading the engine answered at or after: one newer than the engine's report may show an
    engine that just went away. That reading changes nothing, and ``observe`` says so (the gate does
    not rebuild its rules for nothing)."""
    w, _, rules = reports_lane(vram__idle_free_bytes="auto")
    assert w.observe(reading(1.0, 10 * GIB), IDLE, rules, 1.0)
    assert not w.observe(engine_at(reading(2.0, 11 * GIB), 1.9), IDLE, rules, 2.0)
    assert w.idle is not None and (w.idle.free_bytes, w.idle.measured_at) == (10 * GIB, 1.0)
    assert w.observe(reading(3.0, 11 * GIB), IDLE, rules, 3.0)  # engine and GPU read together
    assert (w.idle.free_bytes, w.idle.measured_at) == (11 * GIB, 3.0)


# -- lane facts ----------------------------------------------------------------------------------------


KV_FIELDS = {"policy": 100_000, "measured": 33_000, "in_force": 33_000, "disagrees": True, "unsafe": True}
GPU_FIELDS = {"policy": 2, "measured": 1, "in_force": None, "disagrees": True, "unsafe": True}


def test_a_disagreeing_lane_fact_is_warned_of_with_both_figures_and_the_one_in_force(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The engine's pool is 33,000 tokens where the policy says 100,000 (the engine's figure is put in
    force), and the engine runs on 2 GPUs where the GPU source reads 1 (nothing to put in force: the
    source reads the wrong cards, only the operator can fix it). Each line names the fact, both
    figures and what the operator should know; ``/admission/state`` shows the same fields."""
    caplog.set_level(logging.WARNING, logger=LOG)
    w, _, rules = reports_lane()
    assert w.observe(reading(1.0, 10 * GIB, max_total_tokens=33_000, gpus=2), IDLE, rules, 1.0)
    assert records(caplog) == [
        (
            "WARNING",
            "lane fact kv_pool_tokens: the policy says 100000, the lane measures 33000; "
            "in force: 33000 (the safer figure)",
            {"event": "lane_fact_disagrees", "fact": "kv_pool_tokens"} | KV_FIELDS,
        ),
        (
            "WARNING",
            "lane fact gpus: the policy says 2, the lane measures 1; check the lane",
            {"event": "lane_fact_disagrees", "fact": "gpus"} | GPU_FIELDS,
        ),
    ]
    facts = w.state(1.0)["lane_facts"]
    assert (facts["kv_pool_tokens"], facts["gpus"]) == (KV_FIELDS, GPU_FIELDS)
    assert w.learned.facts == (("kv_pool_tokens", 33_000),)


def test_the_gpu_count_is_compared_only_where_the_gpu_source_reads_devices() -> None:
    """The engine's GPUs are compared with the devices the GPU source reads; with no GPU reading there
    is nothing measured (not a disagreement: a lane without a GPU source is not alerted on)."""
    w, _, rules = reports_lane()
    w.observe(reading(1.0, 10 * GIB, gpus=1), IDLE, rules, 1.0)
    assert w.state(1.0)["lane_facts"]["gpus"] == {
        "policy": 1,
        "measured": 1,
        "in_force": None,
        "disagrees": False,
        "unsafe": False,
    }
    w, _, rules = reports_lane()
    snap = reading(1.0, 10 * GIB, gpus=2)
    w.observe(replace(snap, gpu=None), IDLE, rules, 1.0)
    assert w.state(1.0)["lane_facts"]["gpus"]["measured"] is None


def test_a_lane_fact_is_warned_of_once_per_change_and_again_after_it_agreed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A disagreement already warned of stays quiet while another fact starts to disagree (which is
    warned of); nothing changes, nothing is said; once a fact agrees again, its next disagreement is
    news and warned of again. A warning at every snapshot would bury the on-call in one line repeated
    twice a second; one that never came back would hide a lane that drifted again."""
    caplog.set_level(logging.WARNING, logger=LOG)
    w, _, rules = reports_lane()

    def see_facts(at: float, kv: int, context: int) -> tuple[bool, list[str]]:
        snap = reading(at, 10 * GIB, max_total_tokens=kv, context_len=context)
        changed = w.observe(snap, IDLE, rules, at)
        return changed, [r[1] for r in records(caplog)]

    kv = (
        "lane fact kv_pool_tokens: the policy says 100000, the lane measures 33000; in force: 33000 "
        "(the safer figure)"
    )
    context = (
        "lane fact context_len: the policy says 100000, the lane measures 50000; in force: 50000 "
        "(the safer figure)"
    )
    assert see_facts(1.0, 33_000, 100_000) == (True, [kv])
    assert see_facts(2.0, 33_000, 50_000) == (True, [context])
    assert see_facts(3.0, 33_000, 50_000) == (False, [])
    assert see_facts(4.0, 100_000, 50_000) == (True, [])
    assert see_facts(5.0, 33_000, 50_000) == (True, [kv])
    assert w.learned.facts == (("kv_pool_tokens", 33_000), ("context_len", 50_000))


# -- the reading check -----------------------------------------------------------------------------------


def test_a_new_build_s_fit_is_confirmed_only_by_a_new_low_with_no_prefill_in_flight() -> None:
    """A new build (0.5.1 -> 0.5.2) is priced conservatively until a reading shows the peaks: a new
    low of free memory once no prefill is in flight (those that ran are in the allocator's cache). A
    reading back at the low, or a drop that is not a new one, shows what is left of earlier peaks, not
    this build's: confirming on it would end the conservative pricing on no evidence (a lane whose new
    build draws more, served at the old margin). The next new low confirms (r1's draw is bounded
    within the margin: x1.028 .. x1.073 of its terms, 1.25 learned)."""
    w, rules = bracket_lane()
    w.observe(reading(0.1, 10 * GIB, version="0.5.1"), IDLE, rules, 0.1)
    w.observe(reading(0.2, 10 * GIB, version="0.5.2"), IDLE, rules, 0.2)
    assert w.conservative == "engine build 0.5.1 -> 0.5.2" and w.margin_in_force == 1.5625
    charge(w, rules, charge_bytes=1250 * MIB)
    see(w, rules, 1.0, 1030 * MIB, in_flight=1250 * MIB)  # a new low mid-prefill: part of a peak
    assert w.conservative is not None
    see(w, rules, 2.0, 500 * MIB, in_flight=1250 * MIB)  # memory given back
    w.prefilled(1)  # r1's prefill ran: nothing in flight
    see(w, rules, 3.0, 1030 * MIB, in_flight=1250 * MIB)  # back at the low: not a new one
    assert w.conservative == "engine build 0.5.1 -> 0.5.2"
    assert w.state(3.0)["engine_build"]["margin_in_force"] == 1.5625
    see(w, rules, 4.0, 1040 * MIB, in_flight=1250 * MIB)  # a new low, nothing in flight
    assert w.conservative is None and w.margin_in_force == 1.25


def test_two_requests_are_allowed_two_blocks_of_the_allocator_s_rounding() -> None:
    """Each request in a reading may round up by one 2 MiB block: 4 MiB over a projection for two is
    rounding (no finding, no margin raised), 5 MiB is a finding. Allowing one block whatever the count
    would raise the margin of a busy lane for the allocator's granularity alone."""
    two = LedgerTotals(requests=2, running_requests=2, projected_bytes=1000 * MIB)

    def seen(observed: int) -> LaneWatch:
        w, _, rules = reports_lane(monitor__max_margin=3.0)
        w.charged(1, "r1", two, rules.cost, False)
        w.charged(2, "r2", two, rules.cost, False)
        w.observe(reading(1.0, 10 * GIB - observed, running_requests=2), two, rules, 1.0)
        return w

    w = seen(1004 * MIB)
    assert (w.last, w.underestimates, w.margin) == (None, 0, 1.0123456)
    w = seen(1005 * MIB)
    assert w.last is not None and w.last.ratio == 1005 / 1000 and w.last.request_ids == ("r1", "r2")
    assert w.underestimates == 1 and w.margin == pytest.approx(1.0123456 * 1.005 * 1.05, rel=1e-12)


def lone_calibrated(observed: int) -> LaneWatch:
    """r1 alone (1,000 MiB of terms, all of it surely held: its counter shows every chunk done) on a
    lane calibrated at x1.0 with the margin 1.25, ``observed`` bytes shown."""
    w, rules = bracket_lane(cost__calibrated_ratio=1.0)
    charge(w, rules)
    see(w, rules, 1.0, observed, in_flight=1250 * MIB, done=1250 * MIB)
    return w


def test_a_bracketed_draw_within_the_margin_plus_a_block_raises_nothing() -> None:
    """A lone prefill's draw bounded at x1.251 of its terms (1,251 MiB shown over 1,000 MiB surely
    held): beyond the calibration's x1.0, a finding, but within the margin 1.25 plus one allocator
    block (2 MiB of 1,000 MiB: x0.002) it is a lane drawing its margin, seen at the readings'
    resolution. Raising there would abort prompts admitted at the margin for the allocator's rounding.
    At x1.253 the bound is past it: the margin covers the draw with the safety on top."""
    w = lone_calibrated(1251 * MIB)
    assert w.bracket == ((1251 * MIB - BLOCK) / (1000 * MIB), 1251 * MIB / (1000 * MIB))
    assert w.last is not None and w.last.ratio == 1251 / 1000 and w.last.covered == 1.0
    assert (w.last.margin_before, w.last.margin_after, w.margin) == (1.25, 1.25, 1.25)
    assert w.in_flight_margin == 1.25 and w.covered == 1.251
    assert w.state(1.0)["monitor"]["margin"]["raised"] is False
    w = lone_calibrated(1253 * MIB)
    assert w.margin == pytest.approx(1.253 * 1.05, rel=1e-12) and w.margin_finding is w.last
    assert w.in_flight_margin == 1.253


def test_the_in_flight_guard_is_told_the_draw_seen_where_rounding_puts_it_above_the_bracket() -> None:
    """r1 at 1,250 MiB and one byte (1,000 MiB and 0.8 byte of terms; the bracket divides by whole
    bytes) shows 1,300 MiB: the draw seen, 1.25 x 1,300 / 1,250.000001, is a hair above the bracket's
    top. The in-flight guard judges admitted prefills at the larger of the two: the bound alone would
    price them a hair under what the reading itself showed."""
    w, rules = bracket_lane()
    charge(w, rules)
    in_flight = 1250 * MIB + 1
    see(w, rules, 1.0, 1300 * MIB, in_flight=in_flight, done=in_flight)
    seen = 1.25 * (1300 * MIB / in_flight)
    upper = 1300 * MIB / (1000 * MIB + 1)
    assert w.bracket is not None and w.bracket[1] == upper < seen
    assert w.last is not None and w.last.ratio == 1300 * MIB / in_flight
    assert w.margin == pytest.approx(seen * 1.05, rel=1e-12)
    assert w.in_flight_margin == seen
    assert w.state(1.0)["monitor"]["margin"]["in_flight"] == round(seen, 4)


# -- what a fresh watch says, and what its learning is keyed by ------------------------------------------


def test_a_fresh_watch_has_counted_nothing_and_is_in_no_conservative_state() -> None:
    """Before any reading: no upgrade counted, no build, no conservative state nor a time it began (the
    state file and ``/admission/state`` show exactly that, not a placeholder)."""
    w, _, rules = reports_lane()
    assert (w.upgrades, w.crashes, w.build, w.conservative, w.conservative_since) == (0, 0, None, None, None)
    assert w.state(0.0)["crashes"]["upgrades_under_load"] == 0
    assert w.state(0.0)["engine_build"] == {
        "version": None,
        "conservative": False,
        "why": None,
        "since_age_s": None,
        "margin_in_force": 1.0123,
    }
    assert w.kept()["conservative_since"] is None and w.kept()["cost_fingerprint"] == cost_fingerprint(rules)


def test_the_cost_fingerprint_does_not_depend_on_the_order_the_cost_fields_are_declared_in() -> None:
    """A learned margin is kept for the same costs (``kept``/``restore``): the fingerprint reads the
    cost section's fields by name, so a release that only reorders them in the code keeps every
    lane's learned margin; one that hashed them in declaration order would silently start every lane
    again from the policy's margin. Another figure is another fingerprint."""
    _, _, rules = reports_lane()
    fields: dict[str, Any] = asdict(rules.cost)
    reordered = make_dataclass("CostModel", [(name, object) for name in reversed(fields)])(**fields)
    assert list(asdict(reordered)) != list(fields)
    same: Any = SimpleNamespace(cost=reordered)
    assert cost_fingerprint(same) == cost_fingerprint(rules)
    other: Rules = replace(rules, cost=replace(rules.cost, margin=1.5))
    assert cost_fingerprint(other) != cost_fingerprint(rules)
    assert len(cost_fingerprint(rules)) == 16


def test_a_new_build_drawing_its_margin_to_a_block_is_confirmed_without_a_raise() -> None:
    """A new build (0.5.1 -> 0.5.2) on a lane whose margin is 3.0: r1's prefill ran (1,024 MiB of
    terms, less a third of a byte: charged 3,072 MiB less a byte, all of it surely held), and the new
    low shows 3,072 MiB plus one 2 MiB block. Its draw is bounded at x3 plus a block over its terms:
    the learned margin seen at the readings' resolution, so the fit is confirmed and the margin stays
    3.0 (the finding on that reading raises nothing either). Judged without the block, the bound is
    past the margin and the new build's first prompts pay x3.15 for the allocator's rounding."""
    w, rules = bracket_lane(cost__margin=3.0, monitor__max_margin=4.0)
    w.observe(reading(0.1, 10 * GIB, version="0.5.1"), IDLE, rules, 0.1)
    w.observe(reading(0.2, 10 * GIB, version="0.5.2"), IDLE, rules, 0.2)
    assert w.margin_in_force == 3.75
    charge(w, rules)
    w.prefilled(1)
    in_flight = 3 * GIB - 1
    see(w, rules, 1.0, 3 * GIB + BLOCK, in_flight=in_flight, done=in_flight)
    assert w.bracket == (3.0, 3.0 + BLOCK / GIB)
    assert (w.conservative, w.margin, w.margin_in_force) == (None, 3.0, 3.0)
    assert w.last is not None and (w.last.margin_before, w.last.margin_after) == (3.0, 3.0)
    assert w.last.ratio == (3 * GIB + BLOCK) / in_flight
