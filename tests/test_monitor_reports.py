"""What the lane watch (sidecar/admission/lane_watch.py) tells people and the gate, to the character and the byte.

An on-call engineer reads the monitor through its log lines and ``/admission/state``; the gate reads
it through ``observe``'s answer (rebuild the rules or not) and ``effective``. These tests pin each
of those outputs exactly, and the edges of the comparisons that decide them (equal readings, ages at
their limit, a neighbour's figure on one side only), so that ``make mutation`` (which mutates
``monitor.py``) finds a test for every line. The behaviour itself, on a real ``Admission``, is in
``tests/test_monitor.py``.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import pytest

from sidecar.admission.lane_watch import Finding, LaneWatch, _why, excess
from sidecar.core.ledger import LedgerTotals
from sidecar.core.rules import Learned, Rules
from sidecar.core.snapshot import DeviceMemory, GpuSignals, Snapshot
from sidecar.policy.in_force import rules_in_force, rules_of
from sidecar.policy.schema import Monitor, Policy
from tests.conftest import MIB, small_policy, snapshot

GIB = 1024 * MIB


def lane(**overrides: object) -> tuple[LaneWatch, Policy, Rules]:
    """A watch on a lane whose idle figure is the policy's 10 GiB, judging every byte (tolerance 0,
    1 MiB), with the margin 1.0123456 so that every rounding in its reports shows."""
    settings: dict[str, object] = dict(
        cost__margin=1.0123456,
        vram__headroom="idle_budget",
        vram__idle_free_bytes="10GiB",
        monitor__tolerance=0.0,
        monitor__min_bytes="1MiB",
    )
    p = small_policy(**(settings | overrides)).policy
    return LaneWatch(rules_of(p)), p, rules_of(p)


def reading(at: float, free: int, other: int | None = None, **engine: object) -> Snapshot:
    """A snapshot at ``at`` whose GPU reading (a new object each time: a new reading) shows ``free``."""
    snap = snapshot(at, **engine)
    return replace(snap, gpu=GpuSignals(at, "test", (DeviceMemory("GPU-0", free, 80 * GIB, other),)))


def records(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, dict[str, Any]]]:
    out = [
        (r.levelname, r.getMessage(), r.fields)
        for r in caplog.records
        if r.name == "sidecar.admission.lane_watch"
    ]  # type: ignore[attr-defined]
    caplog.clear()
    return out


BUSY = LedgerTotals(requests=1, running_requests=1, projected_bytes=1000 * MIB)
IDLE = LedgerTotals()


# -- the pure rule's edges ---------------------------------------------------------------------------


def test_excess_at_its_edges() -> None:
    m = Monitor(tolerance=0.0, min_bytes=32 * MIB)
    assert excess(1032 * MIB, 1000 * MIB, m) == pytest.approx(1.032)  # exactly min_bytes over: counted
    assert excess(40 * MIB, 20 * MIB, m) is None  # twice the projection, but 20 MiB is rounding
    assert excess(40 * MIB, 1, m) == 40 * MIB  # a one-byte projection is still a projection


# -- a finding, as logged and as shown ---------------------------------------------------------------

FINDING = Finding(
    at=1.0,
    observed_bytes=1536 * MIB,
    projected_bytes=1280 * MIB,
    ratio=1.2345678,
    free_bytes=8 * GIB,
    idle_free_bytes=10 * GIB - 1,
    request_ids=("r1", "r2"),
    margin_before=1.0123456,
    margin_after=1.2876543,
    covered=1.0234567,
)


def test_a_findings_fields_are_rounded_to_four_places() -> None:
    assert FINDING.fields() == {
        "observed_bytes": 1536 * MIB,
        "projected_bytes": 1280 * MIB,
        "covered": 1.0235,
        "ratio": 1.2346,
        "free_bytes": 8 * GIB,
        "idle_free_bytes": 10 * GIB - 1,
        "request_ids": ["r1", "r2"],
        "margin_before": 1.0123,
        "margin_after": 1.2877,
    }
    assert replace(FINDING, covered=None).fields()["covered"] is None


def test_a_finding_reads_as_one_sentence() -> None:
    assert _why(FINDING) == (
        "GPU memory showed 1,536 MiB allocated beyond idle, the ledger projected 1,280 MiB (its cost "
        "terms x1.023: what the lane was seen to allocate, without the margin's safety) (x1.235) for "
        "r1, r2; margin 1.012 -> 1.288"
    )
    plain = replace(FINDING, covered=None, request_ids=(), margin_after=FINDING.margin_before)
    assert _why(plain) == (
        "GPU memory showed 1,536 MiB allocated beyond idle, the ledger projected 1,280 MiB (x1.235) "
        "for no request running; margin stays 1.012"
    )


# -- /admission/state ----------------------------------------------------------------------------------


def fresh_monitor() -> dict:
    """``/admission/state``'s ``monitor`` block of :func:`lane` before it has found or learnt anything."""
    return {
        "underestimates": 0,
        "unprojected_allocations": 0,
        "worst_ratio": None,
        "last": None,
        "covered_ratio": None,
        "draw_bracket": None,
        "raise_margin": True,
        "max_margin": 1.5,
        "margin": {
            "policy": 1.0123456,
            "effective": 1.0123,
            "in_flight": 1.0123,
            "raised": False,
            "since_age_s": None,
            "why": None,
        },
    }


def test_the_state_before_and_after_measuring_and_after_a_finding() -> None:
    w, p, rules = lane(vram__idle_free_bytes="auto")
    monitor = fresh_monitor()
    margin = monitor["margin"]
    idle = {
        "policy": p.vram.idle_free_bytes,
        "measured_bytes": None,
        "measured_other_process_bytes": None,
        "measured_age_s": None,
        "after_traffic": None,
        "engine_restarts": 0,
        "note": "not measured yet (waiting for an idle engine): headroom is live GPU free memory",
    }
    assert _core(w.state(0.0)) == {"idle_free": idle, "monitor": monitor}

    w.observe(reading(1.0, 10 * GIB, other=300 * MIB), IDLE, rules, 1.0)
    idle |= {
        "measured_bytes": 10 * GIB,
        "measured_other_process_bytes": 300 * MIB,
        "measured_age_s": 1.235,
        "after_traffic": False,
        "note": "measured",
    }
    assert _core(w.state(2.2345678)) == {"idle_free": idle, "monitor": monitor}

    # r1's cost terms are 1,000 MiB; 1.3e9 bytes show: x1.23978, margin 1.0123456 x that x 1.05.
    w.charged(1, "r1", BUSY, rules.cost, False)
    w.observe(reading(3.0, 10 * GIB - 1_300_000_000, other=300 * MIB, running_requests=1), BUSY, rules, 3.0)
    last = w.last
    assert last is not None
    state = w.state(4.2345678)
    assert state["monitor"] == monitor | {
        "underestimates": 1,
        "worst_ratio": 1.2398,
        "last": last.fields() | {"age_s": 1.235},
        "margin": {
            "policy": 1.0123456,
            "effective": 1.3178,
            # No bracket (progress unknown): the in-flight guard judges at the margin in force too.
            "in_flight": 1.3178,
            "raised": True,
            "since_age_s": 1.235,
            "why": _why(last),
        },
    }
    assert last.free_bytes == 10 * GIB - 1_300_000_000 and last.idle_free_bytes == 10 * GIB
    # A policy load is a new calibration: nothing raised any more, though the count stays.
    w.reload(rules)
    assert w.state(5.0)["monitor"]["margin"] == margin and w.state(5.0)["monitor"]["underestimates"] == 1


def _core(state: dict[str, object]) -> dict[str, object]:
    """The idle figure and the monitor of a state (without the per-GPU baselines: none measured here)."""
    idle = dict(state["idle_free"])  # type: ignore[call-overload]
    assert idle.pop("measured_devices") in (
        [],
        [
            {
                "ident": "GPU-0",
                "free_bytes": idle["measured_bytes"],
                "other_process_bytes": idle["measured_other_process_bytes"],
            }
        ],
    )
    return {"idle_free": idle, "monitor": state["monitor"]}


def test_the_state_with_a_policy_figure_and_with_a_calibrated_ratio() -> None:
    w, _, rules = lane(cost__calibrated_ratio=1.0)
    note = w.state(0.0)["idle_free"]["note"]
    assert note == "not measured yet (the policy's figure is in force)"
    w.charged(1, "r1", BUSY, rules.cost, False)
    w.observe(reading(1.0, 10 * GIB - 1_300_000_000, running_requests=1), BUSY, rules, 1.0)
    # Judged against the cost terms x1.0, not the charge: the ledger's 1,000 MiB were priced at margin
    # 1.0123456, so the terms are 987.8 MiB and 1.3e9 bytes are x1.25508 of them, covered from now on.
    assert w.last is not None and w.last.projected_bytes == round(1000 * MIB / 1.0123456)
    assert w.state(1.0)["monitor"]["covered_ratio"] == 1.2551


def test_after_traffic_the_note_says_the_figure_is_a_low_water_mark() -> None:
    w, _, rules = lane(vram__idle_free_bytes="auto")
    w.charged(1, "r1", BUSY, rules.cost, False)
    w.ended(1, 1.0)
    w.observe(reading(1.0, 10 * GIB), IDLE, rules, 1.0)
    assert w.state(1.0)["idle_free"]["note"] == "measured after traffic (a low-water mark: conservative)"
    assert w.state(1.0)["idle_free"]["after_traffic"] is True


def test_an_engine_restart_is_counted_and_forgets_the_traffic() -> None:
    w, _, rules = lane(vram__idle_free_bytes="auto")
    w.charged(1, "r1", BUSY, rules.cost, False)
    w.ended(1, 1.0)
    w.engine_restarted(2.0)
    w.engine_restarted(2.0)
    w.observe(reading(3.0, 10 * GIB), IDLE, rules, 3.0)
    idle = w.state(3.0)["idle_free"]
    assert idle["engine_restarts"] == 2 and idle["after_traffic"] is False and idle["note"] == "measured"


# -- the log lines ---------------------------------------------------------------------------------------


def test_the_idle_figure_is_logged_once_per_engine_process(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.admission.lane_watch")
    w, _, rules = lane(vram__idle_free_bytes="auto")
    w.observe(reading(1.0, 10 * GIB), IDLE, rules, 1.0)
    assert records(caplog) == [
        (
            "INFO",
            "idle GPU free memory measured: 10240 MiB",
            {"event": "idle_free_measured", "free_bytes": 10 * GIB},
        )
    ]
    w.observe(reading(2.0, 10 * GIB + 512 * MIB), IDLE, rules, 2.0)  # warm-up settling: taken, not logged
    assert w.idle is not None and w.idle.free_bytes == 10 * GIB + 512 * MIB and records(caplog) == []
    w.engine_restarted(3.0)
    assert records(caplog) == [
        (
            "INFO",
            "engine changed (restarted): idle free memory will be measured again when it is idle",
            {"event": "idle_free_reset", "why": "restarted"},
        )
    ]
    w.charged(1, "r1", BUSY, rules.cost, False)
    w.ended(1, 4.0)
    w.observe(reading(4.0, 9 * GIB), IDLE, rules, 4.0)
    assert records(caplog) == [
        (
            "INFO",
            "idle GPU free memory measured: 9216 MiB (after traffic: a low-water mark)",
            {"event": "idle_free_measured", "free_bytes": 9 * GIB},
        )
    ]


def test_a_restart_is_logged_when_an_idle_figure_is_forgotten_or_will_be_measured(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.admission.lane_watch")
    w, _, rules = lane()  # the policy's figure, nothing measured: nothing to forget, nothing to say
    w.engine_restarted(1.0, "scheduler pid changed")
    assert records(caplog) == []
    w.observe(reading(2.0, 10 * GIB), IDLE, rules, 2.0)  # measured (the monitor's baseline)
    assert [r[2]["event"] for r in records(caplog)] == ["idle_free_measured"]
    w.engine_restarted(3.0, "scheduler pid changed")
    assert records(caplog) == [
        (
            "INFO",
            "engine changed (scheduler pid changed): idle free memory will be measured again when it is idle",
            {"event": "idle_free_reset", "why": "scheduler pid changed"},
        )
    ]


def test_memory_taken_while_nothing_was_admitted_is_logged_and_counted_each_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.admission.lane_watch")
    w, _, rules = lane()
    assert not w.observe(reading(1.0, 10 * GIB - 200 * MIB, queue_requests=1), IDLE, rules, 1.0)
    assert records(caplog) == [
        (
            "INFO",
            "GPU memory shows 200 MiB taken beyond idle while nothing was admitted: another process "
            "(the GPU source cannot tell) or the engine outside any request",
            {"event": "unprojected_allocation", "observed_bytes": 200 * MIB},
        )
    ]
    w.observe(reading(2.0, 10 * GIB - 300 * MIB, queue_requests=1), IDLE, rules, 2.0)
    assert w.unprojected == 2 and w.underestimates == 0


def test_a_new_finding_is_logged_even_when_it_raises_nothing_and_a_worse_one_of_the_same_is_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.admission.lane_watch")
    w, _, rules = lane(monitor__raise_margin=False)
    w.charged(1, "r1", BUSY, rules.cost, False)
    assert not w.observe(reading(1.0, 10 * GIB - 1100 * MIB, running_requests=1), BUSY, rules, 1.0)
    first = w.last
    assert first is not None and first.margin_after == first.margin_before
    assert records(caplog) == [
        (
            "WARNING",
            f"projection under-estimate: {_why(first)}; recalibrate this lane (sglang-sidecar calibrate)",
            {"event": "projection_underestimate"} | first.fields(),
        )
    ]
    w.observe(reading(2.0, 10 * GIB - 1200 * MIB, running_requests=1), BUSY, rules, 2.0)
    assert w.underestimates == 1 and w.last is not first and records(caplog) == []  # the same, worse
    w.charged(2, "r2", BUSY, rules.cost, False)
    w.observe(reading(3.0, 10 * GIB - 1300 * MIB, running_requests=2), BUSY, rules, 3.0)
    assert w.underestimates == 2 and [r[2]["request_ids"] for r in records(caplog)] == [["r1", "r2"]]
    # A milder finding later: counted and logged, the worst ratio seen stays the worst.
    more = replace(BUSY, requests=3, running_requests=3, projected_bytes=2000 * MIB)
    w.charged(3, "r3", more, rules.cost, False)
    w.observe(reading(4.0, 10 * GIB - 2100 * MIB, running_requests=3), more, rules, 4.0)
    assert w.last is not None and w.last.ratio == pytest.approx(1.05)
    assert w.underestimates == 3 and w.worst_ratio == pytest.approx(1.3)


# -- what observe answers: rebuild the rules or not ------------------------------------------------------


def test_observe_says_the_rules_changed_only_when_they_did() -> None:
    w, _, rules = lane(vram__idle_free_bytes="auto")
    assert not w.observe(snapshot(0.5, free_bytes=None), IDLE, rules, 0.5)  # no GPU reading
    assert not w.observe(reading(0.6, 10 * GIB, running_requests=1), IDLE, rules, 0.6)  # busy, no baseline
    assert w.observe(reading(1.0, 10 * GIB), IDLE, rules, 1.0)  # the idle figure: new rules
    assert not w.observe(reading(2.0, 10 * GIB), IDLE, rules, 2.0)  # the same figure again: nothing new
    assert w.idle is not None and w.idle.measured_at == 1.0
    assert not w.observe(reading(2.5, 10 * GIB - 10 * MIB, queue_requests=1), IDLE, rules, 2.5)  # not idle
    assert not w.observe(reading(2.6, 10 * GIB - 5 * MIB, queue_requests=1), IDLE, rules, 2.6)  # memory back
    w.charged(1, "r1", BUSY, rules.cost, False)
    assert not w.observe(reading(3.0, 10 * GIB - 900 * MIB, running_requests=1), BUSY, rules, 3.0)  # within
    w.ended(1, 3.5)
    assert not w.observe(reading(4.0, 11 * GIB), IDLE, rules, 4.0)  # after traffic the figure stays
    assert w.idle.free_bytes == 10 * GIB
    # A policy figure is in force whatever the sidecar measures: no new rules from measuring it.
    w2, _, rules2 = lane()
    assert not w2.observe(reading(1.0, 10 * GIB), IDLE, rules2, 1.0) and w2.idle is not None


def test_a_figure_measured_before_traffic_is_not_raised_after_it() -> None:
    """Before any traffic a larger idle reading is warm-up settling; after traffic, a larger one may be
    a caching allocator that let go, and the lower figure is the safe one."""
    w, _, rules = lane(vram__idle_free_bytes="auto")
    w.observe(reading(1.0, 10 * GIB), IDLE, rules, 1.0)
    w.charged(1, "r1", BUSY, rules.cost, False)
    w.ended(1, 2.0)
    w.observe(reading(3.0, 12 * GIB), IDLE, rules, 3.0)
    assert w.idle is not None and w.idle.free_bytes == 10 * GIB and not w.idle.after_traffic


@pytest.mark.parametrize(
    ("engine_at", "gpu_at", "now"),
    [(0.0, 4.0, 5.0), (4.0, 3.0, 5.0)],
    ids=["engine-report-5s-old", "gpu-reading-2s-old"],
)
def test_readings_exactly_as_old_as_allowed_still_measure_the_idle_figure(
    engine_at: float, gpu_at: float, now: float
) -> None:
    w, _, rules = lane(vram__idle_free_bytes="auto")
    assert (rules.engine.max_age_s, rules.gpu.max_age_s) == (5, 2)
    snap = reading(engine_at, 10 * GIB)
    snap = replace(snap, gpu=replace(snap.gpu, observed_at=gpu_at))  # type: ignore[arg-type]
    w.observe(snap, IDLE, rules, now)
    assert w.idle is not None and w.idle.free_bytes == 10 * GIB


# -- the comparison's edges ------------------------------------------------------------------------------


def test_a_repeated_reading_is_no_new_allocation() -> None:
    """The same free figure again (a new low, then the same; a rise, then the same) shows nothing
    allocated since: it is judged with nothing, not counted again."""
    w, _, rules = lane()
    w.observe(reading(1.0, 10 * GIB - 200 * MIB, queue_requests=1), IDLE, rules, 1.0)
    w.observe(reading(2.0, 10 * GIB - 200 * MIB, queue_requests=1), IDLE, rules, 2.0)
    w.observe(reading(3.0, 10 * GIB - 100 * MIB, queue_requests=1), IDLE, rules, 3.0)
    w.observe(reading(4.0, 10 * GIB - 100 * MIB, queue_requests=1), IDLE, rules, 4.0)
    assert w.unprojected == 1


def test_a_neighbours_growth_is_subtracted_only_against_a_figure_that_has_one() -> None:
    # The policy says another process held 500 MiB at idle; it still does: all 1,300 MiB are the engine's.
    w, _, rules = lane(vram__other_processes_bytes="500MiB")
    w.charged(1, "r1", BUSY, rules.cost, False)
    w.observe(reading(1.0, 10 * GIB - 1300 * MIB, other=500 * MIB, running_requests=1), BUSY, rules, 1.0)
    assert w.last is not None and w.last.observed_bytes == 1300 * MIB
    # The idle figure says nothing of other processes: a reading's per-process figure has no baseline.
    w, _, rules = lane()
    w.charged(1, "r1", BUSY, rules.cost, False)
    w.observe(reading(1.0, 10 * GIB - 1300 * MIB, other=500 * MIB, running_requests=1), BUSY, rules, 1.0)
    assert w.last is not None and w.last.observed_bytes == 1300 * MIB


def test_a_one_byte_projection_is_judged_against_its_cost_terms_too() -> None:
    w, _, rules = lane(cost__calibrated_ratio=1.0)
    one = LedgerTotals(requests=1, running_requests=1, projected_bytes=1)
    w.charged(1, "r1", one, rules.cost, False)
    w.observe(reading(1.0, 10 * GIB - 100 * MIB, running_requests=1), one, rules, 1.0)
    assert w.last is not None and w.last.ratio == 100 * MIB  # one byte: the cost terms round to it
    assert w.covered == 100 * MIB  # x1.0 times what it showed, not the margin's 1.012 times it


def test_prefills_that_ended_between_readings_are_expected_at_their_peaks_exactly() -> None:
    """``left`` sums the final peaks; the next reading is judged against exactly that sum (3 MiB over
    it: beyond the allocator's 2 MiB block)."""
    w, _, rules = lane()
    w.charged(1, "r1", LedgerTotals(requests=1, running_requests=1), rules.cost, True)
    w.left(1000 * MIB, last=False)
    w.observe(reading(1.0, 10 * GIB - 1003 * MIB, running_requests=1), IDLE, rules, 1.0)
    assert w.last is not None and w.last.projected_bytes == 1000 * MIB
    # After a restart the sums start from nothing, and count again.
    w.engine_restarted(2.0)
    w.left(1000 * MIB, last=True)
    w.observe(reading(4.0, 10 * GIB - 1003 * MIB, running_requests=1), IDLE, rules, 4.0, in_flight=0)
    assert w.last.at == 4.0 and w.last.projected_bytes == 1000 * MIB


def test_after_a_restart_memory_taken_with_nothing_admitted_is_no_finding() -> None:
    w, _, rules = lane()
    w.charged(1, "r1", BUSY, rules.cost, False)
    w.observe(reading(1.0, 10 * GIB - 900 * MIB, running_requests=1), BUSY, rules, 1.0)
    w.ended(1, 1.5)
    w.engine_restarted(2.0)
    w.observe(reading(3.0, 10 * GIB - 200 * MIB, queue_requests=1), IDLE, rules, 3.0)
    assert (w.underestimates, w.unprojected) == (0, 1)


def test_before_any_request_memory_taken_is_no_finding() -> None:
    w, _, rules = lane()
    w.observe(reading(1.0, 10 * GIB - 200 * MIB, queue_requests=1), IDLE, rules, 1.0)
    assert (w.underestimates, w.unprojected) == (0, 1)


def test_a_snapshot_without_a_new_gpu_reading_changes_nothing_the_next_reading_is_judged_by() -> None:
    """An engine report refreshes the snapshot while the GPU reading in it is the one already judged:
    the peaks of the prefills that ended since are still owed to the next GPU reading."""
    w, _, rules = lane()
    w.charged(1, "r1", LedgerTotals(requests=1, running_requests=1), rules.cost, True)
    w.observe(reading(1.0, 10 * GIB - 1200 * MIB, running_requests=1), IDLE, rules, 1.0, in_flight=1200 * MIB)
    seen = reading(2.0, 10 * GIB - 500 * MIB, running_requests=1)
    w.observe(seen, IDLE, rules, 2.0, in_flight=500 * MIB)
    w.left(1000 * MIB, last=True)
    w.observe(replace(seen, engine=replace(seen.engine, observed_at=2.5)), IDLE, rules, 2.5, in_flight=0)  # type: ignore[arg-type]
    w.observe(reading(3.0, 10 * GIB - 1000 * MIB, running_requests=1), IDLE, rules, 3.0, in_flight=0)
    assert (w.underestimates, w.unprojected) == (0, 0)


def test_ending_a_request_it_never_saw_is_a_no_op() -> None:
    w, _, rules = lane(vram__idle_free_bytes="auto")
    w.ended(7, 5.0)
    w.observe(reading(1.0, 10 * GIB), IDLE, rules, 1.0)  # no activity recorded at 5.0: this is idle
    assert w.idle is not None


# -- what the gate reads ---------------------------------------------------------------------------------


def test_the_rules_in_force_take_the_measured_neighbour_unless_the_policy_names_one() -> None:
    w, p, rules = lane(vram__idle_free_bytes="auto")
    w.observe(reading(1.0, 10 * GIB, other=300 * MIB), IDLE, rules, 1.0)
    assert rules_in_force(p, w.learned).vram.other_processes_bytes == 300 * MIB
    w, p, rules = lane(vram__idle_free_bytes="auto", vram__other_processes_bytes="676MiB")
    w.observe(reading(1.0, 10 * GIB, other=300 * MIB), IDLE, rules, 1.0)
    assert rules_in_force(p, w.learned).vram.other_processes_bytes == 676 * MIB
    assert rules_in_force(p, w.learned).vram.idle_free_bytes == 10 * GIB
    assert rules_in_force(p, w.learned).vram.headroom.value == "idle_budget"


def test_until_measured_auto_reads_live_free_memory_and_a_measurement_only_replaces_auto() -> None:
    """``idle_free_bytes: auto`` is resolved in one place: nothing learned, live GPU free memory and no
    transient cap; a learned figure applies to ``auto`` only, never over a policy's own figure."""
    auto = small_policy(vram__headroom="idle_budget", vram__idle_free_bytes="auto").policy
    blind = rules_in_force(auto, Learned())
    assert (blind.vram.headroom.value, blind.vram.idle_free_bytes, blind.vram.idle_free_auto) == (
        "nvml_free",
        None,
        True,
    )
    assert blind.vram.transient_cap() is None
    fixed = small_policy(vram__headroom="idle_budget", vram__idle_free_bytes="10GiB").policy
    taught = Learned(idle_free_bytes=3 * GIB, idle_other_process_bytes=5, margin=1.7)
    r = rules_in_force(fixed, taught)
    assert (r.vram.idle_free_bytes, r.vram.idle_free_auto, r.cost.margin) == (10 * GIB, False, 1.7)
    assert rules_in_force(fixed, Learned()).cost.margin == fixed.cost.margin


def test_the_tolerance_alone_excuses_a_small_relative_excess() -> None:
    """``tolerance`` and ``min_bytes`` each excuse an excess on their own (no ``min_bytes`` here)."""
    m = rules_of(small_policy(monitor__tolerance=0.1, monitor__min_bytes=0).policy).monitor
    assert excess(1100 * MIB, 1000 * MIB, m) is None  # exactly 10 % over: within the tolerance
    assert excess(1101 * MIB, 1000 * MIB, m) == pytest.approx(1.101)
    strict = rules_of(small_policy(monitor__tolerance=0.0, monitor__min_bytes=0).policy).monitor
    assert excess(1010 * MIB, 1000 * MIB, strict) == pytest.approx(1.01)
