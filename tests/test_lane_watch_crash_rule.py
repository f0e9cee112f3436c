"""The lane watch's crash rule and what a restart of the sidecar or the engine keeps, pinned exactly
(issue 29, docs/robustness.md): what ``crash_margin`` reads from an admitted set, the set the gate
keeps as evidence (``admitted_set``), the crash's record and log line (``_crash``), what a policy
reload and an engine restart forget, and what the state file restores. Fast unit tests on a bare
``LaneWatch`` (no servers, no clock but the numbers passed in): the lane of ``test_monitor_reports``
(a 10 GiB policy idle figure, the margin 1.0123456 so that every rounding shows, ``max_margin`` 1.5,
``safety`` 0.05)."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from sidecar.admission.lane_watch import (
    AdmittedSet,
    Crash,
    IdleFree,
    LaneWatch,
    _age,
    cost_fingerprint,
    crash_margin,
)
from sidecar.core.ledger import LedgerTotals
from sidecar.core.rules import HeadroomSource, Rules
from sidecar.core.snapshot import DeviceMemory, GpuSignals
from sidecar.policy.schema import Monitor
from tests.conftest import MIB, snapshot
from tests.test_monitor import _watch_with_progress, gpu
from tests.test_monitor_reports import GIB, lane, records

# The number of the set a crash is read against (``crashed``): 3,000 MiB projected at the policy's
# margin, 3,221 MiB of budget and a 16 MiB reserve. Its cost terms are 3,000 / 1.0123456 MiB; the lane
# ran out beyond budget plus reserve, so it drew at least 3,237 MiB / terms = x1.09232; with the
# monitor's 5 % safety the crash margin is x1.14694 (four places: 1.1469; five: 1.14694).
CRASH_TARGET = (3221 + 16) / (3000 / 1.0123456) * 1.05


# What a record of ``admitted("a", "b")`` shows (``AdmittedSet.fields``), and the crash read from it.
SET_AB = {
    "request_ids": ["a", "b"],
    "requests": 2,
    "projected_bytes": 3000 * MIB,
    "priced_margin": 1.0123,
    "budget_bytes": 3221 * MIB,
    "reserve_bytes": 16 * MIB,
}
CRASH_AB = {"why": "scheduler pid [1] -> [2]", **SET_AB, "margin_before": 1.0123, "margin_after": 1.1469}


def admitted(*ids: str, budget: int | None = 3221 * MIB, projected: int = 3000 * MIB) -> AdmittedSet:
    return AdmittedSet(5.0, ids, projected, 1.0123456, budget, 16 * MIB)


def crashed(w: LaneWatch, s: AdmittedSet, why: str = "scheduler pid [1] -> [2]") -> bool:
    """An engine restart with ``s`` admitted, then another before the new process ever reported: the
    first is read as a crash (no build to tell an upgrade by). What the second restart returned."""
    before = w.crashes
    w.engine_restarted(10.0, why, admitted=s)
    assert w.crashes == before  # read when the new process reports (or at the next restart)
    return w.engine_restarted(20.0, "it never answered")


# -- what a crash reads from the admitted set --------------------------------------------------------


def test_crash_margin_counts_the_reserve_the_engine_also_ran_through() -> None:
    """An engine that ran out of memory took more than the budget AND the reserve: the margin that
    would have kept the set out is (budget + reserve) / terms with the safety on top. Reading the
    reserve the other way (budget - reserve) under-prices the lane after every crash."""
    m = Monitor(max_margin=3.0, safety=0.05)
    s = AdmittedSet(0.0, ("a",), 2000 * MIB, 1.0, 2000 * MIB, 400 * MIB)
    assert crash_margin(s, m, 1.0) == pytest.approx(2400 / 2000 * 1.05, rel=1e-12)
    assert crash_margin(replace(s, reserve_bytes=0), m, 1.0) == pytest.approx(1.05, rel=1e-12)


def test_crash_margin_reads_any_positive_cost_terms_and_none_without_a_priced_margin() -> None:
    """A set whose cost terms are tiny (one byte, or half of one) is still evidence: it explains no
    crash, so the margin goes to the cap (logged as unexplained) rather than being ignored. A set
    priced at no margin (0) has no cost terms to read: None, never a division by zero in the
    restart path (which would lose the crash)."""
    m = Monitor(max_margin=3.0, safety=0.05)
    one = AdmittedSet(0.0, ("a",), 1, 1.0, 2000 * MIB, 0)
    assert crash_margin(one, m, 1.0) == 3.0
    assert crash_margin(replace(one, margin=2.0), m, 1.0) == 3.0  # half a byte of terms
    assert crash_margin(replace(one, margin=0.0), m, 1.0) is None
    assert crash_margin(replace(one, margin=0.0, projected_bytes=2000 * MIB), m, 1.0) is None
    assert crash_margin(replace(one, margin=-1.0), m, 1.0) is None


# -- the records: /admission/state and the crash's log line --------------------------------------------


def test_an_admitted_sets_fields_are_the_first_ids_and_four_places_of_its_margin() -> None:
    """What ``/admission/state`` (``crashes.at_risk`` and ``crashes.last``) and the ``engine_crash``
    and ``engine_upgraded_under_load`` log lines show of the evidence: the operator matches the ids
    with the proxy's log, and the margin the set was priced at with the policy's."""
    ids = tuple(f"r{i}" for i in range(17))
    s = AdmittedSet(5.0, ids, 3000 * MIB, 1.0123456, None, 16 * MIB)
    assert s.fields() == {
        "request_ids": [f"r{i}" for i in range(16)],
        "requests": 17,
        "projected_bytes": 3000 * MIB,
        "priced_margin": 1.0123,
        "budget_bytes": None,
        "reserve_bytes": 16 * MIB,
    }
    assert replace(s, budget_bytes=3221 * MIB, margin=1.00005).fields()["budget_bytes"] == 3221 * MIB


def test_a_crashs_fields_are_the_set_and_the_margins_at_four_places() -> None:
    """The ``crashes.last`` record of ``/admission/state`` and the ``engine_crash`` log line's fields:
    why the engine went, the set, and the margin before and after at four places."""
    s = admitted("a", "b")
    c = Crash(7.0, "scheduler pid [1] -> [2]", s, 1.0123456, CRASH_TARGET)
    assert c.fields() == CRASH_AB


# -- the crash rule ----------------------------------------------------------------------------------


def test_a_crash_raises_the_margin_logs_the_set_and_is_kept(caplog: pytest.LogCaptureFixture) -> None:
    """A restart with work admitted on the same build is an under-prediction: the margin rises so the
    set would not have fitted, the state and the state file keep it, and one warning names the set,
    the budget and the margins so the operator can recalibrate."""
    w, _, _ = lane()
    learned: list[float] = []
    w.on_learned = lambda: learned.append(w.margin)
    with caplog.at_level(logging.INFO, logger="sidecar.admission.lane_watch"):
        assert crashed(w, admitted("a", "b")) is True
    assert w.margin == pytest.approx(CRASH_TARGET, rel=1e-12) and w.crash_margin == w.margin
    # Written twice: the pending restart (its evidence, before the margin moved), then the crash.
    assert learned == [1.0123456, w.margin]
    fields = CRASH_AB
    assert [r for r in records(caplog) if r[2]["event"] == "engine_crash"] == [
        (
            "WARNING",
            "engine restarted (scheduler pid [1] -> [2]) while the gate had admitted 2 request(s) projected "
            "at 3000 MiB of a 3,221 MiB budget: read as an under-prediction, margin 1.012 -> 1.147; "
            "admitted: a, b",
            {"event": "engine_crash", **fields},
        )
    ]
    crashes = w.state(27.5)["crashes"]
    assert crashes == {
        "count": 1,
        "margin": w.margin,
        "last": fields | {"age_s": 17.5},
        "at_risk": None,
        "upgrades_under_load": 0,
    }
    assert w.kept()["crash_margin"] == w.margin and w.kept()["crashes"] == 1


def test_a_crash_the_admitted_set_does_not_explain_is_capped_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A set far inside its budget that still crashed the engine is not explained by its prefills:
    the margin goes to ``max_margin`` and the warning says to check the lane (a leak, another
    process), not merely to recalibrate."""
    w, _, _ = lane()
    with caplog.at_level(logging.WARNING, logger="sidecar.admission.lane_watch"):
        assert crashed(w, admitted("a", projected=100 * MIB)) is True
    assert w.margin == 1.5 and w.crash_margin == 1.5
    ((level, message, fields),) = records(caplog)
    assert (level, fields["margin_after"], fields["budget_bytes"]) == ("WARNING", 1.5, 3221 * MIB)
    assert message == (
        "engine restarted (scheduler pid [1] -> [2]) while the gate had admitted 1 request(s) projected at "
        "100 MiB of a 3,221 MiB budget: read as an under-prediction, margin 1.012 -> 1.500 (capped at "
        "monitor.max_margin: the admitted prefills alone do not explain it; check the lane); admitted: a"
    )


def test_a_crash_with_no_budget_known_is_counted_and_changes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before any idle figure is known there is no budget to read the set against: the crash is
    counted and logged (budget unknown, no ids: none), and the margin, the crash margin and what the
    restart reports as changed stay as they were."""
    w, _, _ = lane()
    with caplog.at_level(logging.WARNING, logger="sidecar.admission.lane_watch"):
        assert crashed(w, admitted(budget=None)) is False
    assert w.crashes == 1 and w.margin == 1.0123456 and w.crash_margin is None
    ((level, message, fields),) = records(caplog)
    assert level == "WARNING" and fields == {
        "event": "engine_crash",
        "why": "scheduler pid [1] -> [2]",
        "request_ids": [],
        "requests": 0,
        "projected_bytes": 3000 * MIB,
        "priced_margin": 1.0123,
        "budget_bytes": None,
        "reserve_bytes": 16 * MIB,
        "margin_before": 1.0123,
        "margin_after": 1.0123,
    }
    assert message == (
        "engine restarted (scheduler pid [1] -> [2]) while the gate had admitted 0 request(s) projected at "
        "3000 MiB of a unknown budget: read as an under-prediction, margin 1.012 -> 1.012; admitted: none"
    )


def test_a_crash_within_the_margin_in_force_learns_no_crash_margin(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A policy whose own margin (1.6) is above ``max_margin`` (1.5): the cap is the policy's margin,
    and a crash that needs more reaches exactly the margin in force. Nothing is learnt (no crash
    margin kept, nothing changed); the warning still says the set does not explain it."""
    w, _, _ = lane(cost__margin=1.6)
    with caplog.at_level(logging.WARNING, logger="sidecar.admission.lane_watch"):
        assert crashed(w, admitted("a", projected=100 * MIB)) is False
    assert w.crashes == 1 and w.margin == 1.6 and w.crash_margin is None
    assert w.state(30.0)["crashes"]["margin"] is None and w.kept()["crash_margin"] is None
    ((_, message, fields),) = records(caplog)
    assert fields["margin_before"] == fields["margin_after"] == 1.6
    assert message.endswith(
        "margin 1.600 -> 1.600 (capped at monitor.max_margin: the admitted prefills alone do not "
        "explain it; check the lane); admitted: a"
    )


def test_crashes_are_counted_one_by_one() -> None:
    """Each crash counts (``/admission/state``'s ``crashes.count`` and the state file's ``crashes``):
    a lane that keeps crashing must show it."""
    w, _, _ = lane()
    crashed(w, admitted("a", budget=None))
    crashed(w, admitted("b", budget=None))
    assert w.crashes == 2 and w.state(30.0)["crashes"]["count"] == 2 and w.kept()["crashes"] == 2


# -- the evidence the gate keeps ------------------------------------------------------------------


def _gpu_rules(rules: Rules) -> Rules:
    """The same lane with live GPU free memory as its headroom (``nvml_free``)."""
    return replace(rules, vram=replace(rules.vram, headroom=HeadroomSource.NVML_FREE))


def test_the_admitted_set_carries_the_budget_the_gate_handed_out() -> None:
    """The budget a crash is read against is what the gate could hand out: with a policy idle figure,
    its idle budget on the GPUs now (a neighbour that grew by 100 MiB is not the engine's) less the
    reserve; on live free memory, the measured idle figure less the reserve; with neither, none (the
    crash is then counted but read against nothing)."""
    w, _, rules = lane(vram__reserve_bytes="16MiB", vram__other_processes_bytes="0")
    totals = LedgerTotals(requests=2, running_requests=2, projected_bytes=3000 * MIB)
    w.charged(1, "a", totals, rules.cost, False)
    w.charged(2, "b", totals, rules.cost, False)
    snap = replace(
        snapshot(1.0),
        gpu=GpuSignals(1.0, "test", (DeviceMemory("GPU-0", 6 * GIB, 80 * GIB, 100 * MIB),)),
    )
    expected = AdmittedSet(3.0, ("a", "b"), 3000 * MIB, 1.0123456, 10 * GIB - 116 * MIB, 16 * MIB)
    assert w.admitted_set(totals, rules, snap, 3.0) == expected
    # Live free memory as the headroom, nothing measured: no budget, whatever the figure says.
    live = _gpu_rules(rules)
    assert live.vram.idle_free_bytes == 10 * GIB
    assert w.admitted_set(totals, live, snap, 3.0) == replace(expected, budget_bytes=None)
    without = replace(live, vram=replace(live.vram, idle_free_bytes=None))
    assert w.admitted_set(totals, without, snap, 3.0) == replace(expected, budget_bytes=None)
    assert w.admitted_set(totals, without, snap, 3.0).fields()["budget_bytes"] is None
    # Measured at idle (9 GiB free): that figure less the reserve.
    w.idle = IdleFree(9 * GIB, None, 0.5, False)
    assert w.admitted_set(totals, live, snap, 3.0) == replace(expected, budget_bytes=9 * GIB - 16 * MIB)
    assert w.admitted_set(totals, without, snap, 3.0) == replace(expected, budget_bytes=9 * GIB - 16 * MIB)


# -- what a reload and an engine restart forget -------------------------------------------------------


def _bracketed() -> tuple[LaneWatch, Rules]:
    """A watch whose readings of one prefill alone bracket the lane's draw (``draw_bracket``)."""
    w, rules = _watch_with_progress()
    busy = LedgerTotals(requests=1, running_requests=1)
    w.observe(gpu(snapshot(0.0, running_requests=1), 0.1, 10 * GIB - 900 * MIB), busy, rules, 0.1, 1000 * MIB)
    assert w.state(0.2)["monitor"]["draw_bracket"] == [0.898, 0.9]
    return w, rules


def test_a_reload_forgets_the_bracket_and_an_engine_restart_too() -> None:
    """A policy load is a new calibration and a new engine process may draw otherwise: what the
    readings bounded the draw by before is no evidence after either (``draw_bracket`` shows null)."""
    w, rules = _bracketed()
    w.reload(rules)
    assert w.bracket is None and w.state(1.0)["monitor"]["draw_bracket"] is None
    w, rules = _bracketed()
    w.engine_restarted(1.0)
    assert w.bracket is None and w.state(1.0)["monitor"]["draw_bracket"] is None


def test_a_reload_of_the_same_costs_keeps_the_crash_margin_and_other_costs_forget_it() -> None:
    """A crash's margin stays across reloads of the same costs (however many: the fingerprint it is
    kept against is the reloaded policy's), and a policy with other costs (a new calibration) starts
    from its own margin, with no crash margin shown or kept."""
    w, _, rules = lane()
    crashed(w, admitted("a", "b"))
    for _ in range(2):
        w.reload(rules)
        assert w.margin == pytest.approx(CRASH_TARGET, rel=1e-12) and w.crash_margin == w.margin
        assert w.kept()["cost_fingerprint"] == cost_fingerprint(rules)
    other = replace(rules, cost=replace(rules.cost, margin=1.05))
    w.reload(other)
    assert w.margin == 1.05 and w.crash_margin is None
    assert w.kept()["cost_fingerprint"] == cost_fingerprint(other) and w.kept()["crash_margin"] is None
    assert w.state(30.0)["crashes"]["margin"] is None
    w.reload(other)
    assert w.kept()["cost_fingerprint"] == cost_fingerprint(other)


# -- what the state file restores -------------------------------------------------------------------


def saved(w: LaneWatch, **changes: object) -> dict[str, object]:
    """A state file's content for ``w``'s costs (``kept``'s layout) with ``changes``."""
    base = {
        "version": 1,
        "cost_fingerprint": w.kept()["cost_fingerprint"],
        "margin": 1.3,
        "crash_margin": 1.2,
        "crashes": 3,
        "engine_build": "0.5.24",
        "conservative": "engine build 0.5.23 -> 0.5.24",
        "conservative_since": 400.0,
        "margin_in_force": 1.5,
    }
    return base | changes


def test_a_restore_takes_the_build_the_unconfirmed_state_the_margins_and_the_crashes() -> None:
    """A sidecar restarted while a new build is unconfirmed stays conservative from the same instant,
    with the margins and the crash count it had; the line it logs says all of it."""
    w, _, _ = lane()
    said = w.restore(saved(w), now=1000.0)
    assert said == (
        "margin 1.3000 (in force 1.5000), engine build 0.5.24 unconfirmed (engine build 0.5.23 -> 0.5.24), "
        "3 crash(es) before"
    )
    assert (w.build, w.conservative, w.conservative_since) == (
        "0.5.24",
        "engine build 0.5.23 -> 0.5.24",
        400.0,
    )
    assert (w.margin, w.crash_margin, w.crashes) == (1.3, 1.2, 3)
    assert w.state(1000.0)["engine_build"] == {
        "version": "0.5.24",
        "conservative": True,
        "why": "engine build 0.5.23 -> 0.5.24",
        "since_age_s": 600.0,
        "margin_in_force": 1.5,
    }
    # Margins beyond the cap (a policy that lowered max_margin since) are taken at the cap.
    w, _, _ = lane()
    w.restore(saved(w, margin=2.0, crash_margin=2.0), now=1000.0)
    assert w.margin == w.crash_margin == 1.5


def test_a_restore_of_a_confirmed_build_without_crashes_or_since() -> None:
    """A confirmed build: no conservative state and no instant for it; a file that names no crash count
    or crash margin restores none (0 crashes, no crash margin): nothing a restart invents."""
    w, _, _ = lane()
    kept = saved(w, conservative=None, conservative_since=None)
    del kept["crashes"], kept["crash_margin"]
    assert (
        w.restore(kept, now=1000.0)
        == "margin 1.3000 (in force 1.3000), engine build 0.5.24, 0 crash(es) before"
    )
    assert (w.build, w.conservative, w.conservative_since, w.crashes) == ("0.5.24", None, None, 0)
    assert w.crash_margin is None and w.state(1000.0)["engine_build"]["since_age_s"] is None


def test_an_unconfirmed_build_with_no_instant_counts_from_the_restore() -> None:
    """A file that says the build is unconfirmed but not since when: the wait starts at the restore
    (``now``), shown as an age of 0 then and counting on."""
    w, _, _ = lane()
    w.restore(saved(w, conservative_since=None), now=1000.0)
    assert w.conservative_since == 1000.0
    assert w.state(1000.0)["engine_build"]["since_age_s"] == 0.0
    assert w.state(1012.5)["engine_build"]["since_age_s"] == 12.5


def test_a_restore_under_other_costs_takes_the_build_but_no_margin() -> None:
    """Another calibration: the margins learned against the old costs are ignored (and the line says
    so), the build and its unconfirmed state are still taken (the old margin is no evidence either
    way)."""
    w, _, _ = lane()
    said = w.restore(saved(w, cost_fingerprint="0000000000000000"), now=1000.0)
    assert said == (
        "engine build 0.5.24 unconfirmed (engine build 0.5.23 -> 0.5.24); margins ignored (the policy's "
        "costs changed)"
    )
    assert (w.build, w.margin, w.crash_margin, w.crashes) == ("0.5.24", 1.0123456, None, 3)


def test_ages_are_seconds_at_three_places() -> None:
    """``/admission/state``'s ages (``since_age_s``): seconds to the millisecond, none without an
    instant."""
    w, _, _ = lane()
    w.restore(saved(w, conservative_since=399.87655), now=1000.0)
    assert w.state(1000.0)["engine_build"]["since_age_s"] == 600.123
    assert _age(1000.0, 399.87655) == 600.123
    assert _age(1000.0, None) is None


def test_a_restart_whose_process_never_reported_is_read_at_the_next_restart() -> None:
    """Two restarts in a row with work admitted at the first: the first process's successor never
    reported its build, so nothing tells a planned upgrade; the first is read as a crash when the
    second is noticed, and that restart says the margin changed."""
    w, _, _ = lane()
    w.engine_restarted(10.0, "scheduler pid [1] -> [2]", admitted=admitted("a", "b"))
    assert w.crashes == 0 and w.margin == 1.0123456
    assert w.engine_restarted(20.0, "scheduler pid [2] -> [3]") is True
    assert w.crashes == 1 and w.margin == pytest.approx(CRASH_TARGET, rel=1e-12)
    assert w.last_crash is not None and w.last_crash.why == "scheduler pid [1] -> [2]"
    assert w.engine_restarted(30.0, "scheduler pid [3] -> [4]") is False
    assert w.crashes == 1


def test_an_engine_restart_forgets_the_prompts_its_predecessor_served() -> None:
    """The ceiling on a raised margin (``raised_margin``: never so high that a prompt this engine
    served becomes unfit) is the new process's: until it has served a prompt there is none, and the
    first finding raises the margin in proportion to what it showed. Here the lane's transient cap is
    one byte, so any prompt counted as served would hold the margin at what the reading showed."""
    w, _, rules = lane()
    tiny = replace(rules, vram=replace(rules.vram, max_transient_bytes=1))
    busy = LedgerTotals(requests=1, running_requests=1, projected_bytes=1000 * MIB)
    w.charged(1, "r0", busy, rules.cost, False, charge_bytes=500 * MIB)
    w.prefilled(1)
    w.ended(1, 0.5)
    w.engine_restarted(1.0)
    w.charged(2, "r1", busy, rules.cost, False, charge_bytes=1000 * MIB)
    snap = snapshot(2.0, running_requests=1, free_bytes=10 * GIB - 1_300_000_000, total_bytes=80 * GIB)
    assert w.observe(snap, busy, tiny, 2.0) is True
    seen = 1_300_000_000 / (1000 * MIB) * 1.0123456
    assert w.margin == pytest.approx(seen * 1.05, rel=1e-12)


def test_a_finding_after_an_engine_restart_names_only_the_new_process_requests() -> None:
    """The old process's requests went with it: a finding on the new process names what the new one
    runs (an operator reads the ids to find the prompt that drew more than priced), and counts only
    those requests for the allocator's rounding and for whether a prefill ran alone."""
    w, _, rules = lane()
    busy = LedgerTotals(requests=1, running_requests=1, projected_bytes=1000 * MIB)
    w.charged(1, "old", busy, rules.cost, False, charge_bytes=500 * MIB)
    w.engine_restarted(1.0)
    w.charged(2, "new", busy, rules.cost, False, charge_bytes=1000 * MIB)
    snap = snapshot(2.0, running_requests=1, free_bytes=10 * GIB - 1_300_000_000, total_bytes=80 * GIB)
    assert w.observe(snap, busy, rules, 2.0) is True
    assert w.last is not None and w.last.request_ids == ("new",)
