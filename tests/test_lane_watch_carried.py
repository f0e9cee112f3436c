"""Crash evidence carried across a sidecar restart (issue 29 item 2, docs/robustness.md "The state
file"): the set admitted when the engine was seen failing and a restart whose new process has not
reported are kept (``LaneWatch.kept``) and come back armed (``restore``); the restarted sidecar's first
engine report reads them. A set seen failing is a crash when another process answers (other scheduler
pids, none yet, or none to tell by), no evidence when the same one does; a restart the previous
sidecar noticed is read as at its first report (the same build a crash, another an upgrade). Fast unit
tests on bare ``LaneWatch`` objects (one before the sidecar restart, one after), the lane of
``test_monitor_reports``: the crash margin of ``admitted("a", "b")`` is ``CRASH_TARGET``."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from sidecar.admission.lane_watch import MAX_IDS, NEW_BUILD_SAFETY, AdmittedSet, LaneWatch
from sidecar.core.rules import Rules
from sidecar.core.snapshot import Snapshot, SourceHealth
from tests.conftest import MIB, snapshot
from tests.test_lane_watch_crash_rule import CRASH_TARGET, SET_AB, admitted
from tests.test_monitor_reports import IDLE, lane, records

LOGGER = "sidecar.admission.lane_watch"
BUILD = "0.5.23"


def report(at: float, version: str | None = BUILD, pids: tuple[str, ...] = (), failures: int = 0) -> Snapshot:
    """An engine report observed at ``at`` (no GPU reading) naming ``version`` and scheduler ``pids``;
    ``failures``: the scrape's consecutive failures (then it is the last good report, not a new one)."""
    snap = snapshot(at, free_bytes=None, version=version, pids=pids)
    if failures:
        snap = replace(snap, engine_health=SourceHealth(None, "connection refused", failures))
    return snap


def failing_with(s: AdmittedSet) -> LaneWatch:
    """The sidecar before its restart: its engine reported ``BUILD``, then was seen failing with ``s``."""
    w, _, rules = lane()
    w.observe(report(5.0, pids=s.pids), IDLE, rules, 5.0)
    w.at_risk(s)
    return w


def restarted(before: LaneWatch) -> tuple[LaneWatch, Rules, list[int]]:
    """The sidecar after its restart: a new watch with what ``before`` kept, and its writes since."""
    w, _, rules = lane()
    w.restore(before.kept(), now=50.0)
    writes: list[int] = []
    w.on_learned = lambda: writes.append(w.crashes)
    return w, rules, writes


def set_ab(pids: tuple[str, ...] = ("101",)) -> AdmittedSet:
    return replace(admitted("a", "b"), pids=pids)


# -- what is kept, and what comes back -----------------------------------------------------------------


def test_a_set_at_risk_and_a_pending_restart_are_kept_as_crash_margin_reads_them_and_come_back() -> None:
    """``kept`` writes each field ``crash_margin`` reads (the priced margin at full precision), the first
    ``MAX_IDS`` ids with the count, and the pids; a restore gives the same set back, and a crash read
    from it later names how many were admitted, not how many ids were kept."""
    ids = tuple(f"r{i}" for i in range(MAX_IDS + 4))
    s = replace(admitted(*ids), pids=("101", "102"))
    w = failing_with(s)
    expected = {
        "at": 5.0,
        "request_ids": list(ids[:MAX_IDS]),
        "requests": MAX_IDS + 4,
        "projected_bytes": 3000 * MIB,
        "priced_margin": 1.0123456,
        "budget_bytes": 3221 * MIB,
        "reserve_bytes": 16 * MIB,
        "engine_pids": ["101", "102"],
    }
    assert w.kept()["at_risk"] == expected and "pending_restart" not in w.kept()
    after, _, _ = restarted(w)
    assert after.kept()["at_risk"] == expected
    assert after.state(50.0)["crashes"]["at_risk"] == s.fields() | {"requests": MAX_IDS + 4}

    # The engine's restart noticed: the set becomes the restart's evidence, pending its first report.
    w.engine_restarted(10.0, "scheduler pid ['101', '102'] -> ['103']")
    pending = {"at": 10.0, "why": "scheduler pid ['101', '102'] -> ['103']", "admitted": expected}
    assert "at_risk" not in w.kept() and w.kept()["pending_restart"] == pending
    after, rules, _ = restarted(w)
    assert after.kept()["pending_restart"] == pending
    after.observe(report(60.0, pids=("103",)), IDLE, rules, 60.0)
    assert after.last_crash is not None and after.last_crash.admitted.count == MAX_IDS + 4
    assert after.state(60.0)["crashes"]["last"]["requests"] == MAX_IDS + 4


def test_with_nothing_pending_the_file_has_the_layout_an_older_sidecar_reads() -> None:
    """The evidence is written only while there is some: a sidecar rolled back to a release before it
    refuses its state file only if it is restarted in that moment (``extra="forbid"``)."""
    w, _, _ = lane()
    older = {"version", "cost_fingerprint", "margin", "crash_margin", "crashes", "engine_build"}
    assert set(w.kept()) == older | {"conservative", "conservative_since", "margin_in_force"}


def test_the_restore_says_what_evidence_is_pending() -> None:
    w = failing_with(set_ab())
    fresh, _, _ = lane()
    said = fresh.restore(w.kept(), now=50.0)
    assert said.endswith(
        "0 crash(es) before; engine seen failing with 2 request(s) admitted: read at the engine's first report"
    )
    w.engine_restarted(10.0, "it answered again after a failed scrape")
    fresh, _, _ = lane()
    said = fresh.restore(w.kept(), now=50.0)
    assert said.endswith(
        "0 crash(es) before; engine restarted (it answered again after a failed scrape) with 2 request(s) "
        "admitted: read at the engine's first report"
    )


def test_evidence_kept_under_other_costs_is_not_restored() -> None:
    """Its projection is priced in the costs it was kept under: another calibration starts afresh, as its
    margins do."""
    w = failing_with(set_ab())
    kept = w.kept() | {"cost_fingerprint": "0000000000000000"}
    after, _, rules = lane()
    said = after.restore(kept, now=50.0)
    assert "margins ignored" in said and "pending" not in said and "at_risk" not in after.kept()
    after.observe(report(60.0, pids=("202",)), IDLE, rules, 60.0)
    assert after.crashes == 0 and after.margin == 1.0123456


# -- a set seen failing, read at the restarted sidecar's first report ------------------------------------


@pytest.mark.parametrize(
    ("pids", "said"),
    [
        (("202",), "scheduler pid ['101'] -> ['202']"),
        # A fresh process publishes no pid-labelled gauge before its first load report.
        ((), "scheduler pid ['101'] -> []"),
    ],
)
def test_a_set_seen_failing_is_a_crash_when_another_process_first_reports(
    pids: tuple[str, ...], said: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine died with work admitted and the sidecar restarted before it was back: the new
    process's first report is read as if the old sidecar had seen the restart. The margin rises as it
    would have (``CRASH_TARGET``), the state file is written, and the crash says how it was told."""
    before = failing_with(set_ab())
    after, rules, writes = restarted(before)
    # Not while the engine still fails; not dropped by a report the controller calls good (``engine_ok``:
    # this sidecar cannot tell the process by when it reported).
    assert after.observe(report(55.0, pids=pids, failures=3), IDLE, rules, 55.0) is False
    after.engine_ok(60.0, since=59.5)
    assert after.crashes == 0 and "at_risk" in after.kept()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert after.observe(report(60.0, pids=pids), IDLE, rules, 60.0) is True
    assert after.crashes == 1 and after.margin == pytest.approx(CRASH_TARGET, rel=1e-12)
    assert after.last_crash is not None and after.last_crash.at == 60.0
    why = f"failing when the sidecar restarted; {said}"
    ((_, _, fields),) = records(caplog)
    assert fields == {
        "event": "engine_crash",
        "why": why,
        **SET_AB,
        "margin_before": 1.0123,
        "margin_after": round(CRASH_TARGET, 4),
    }
    assert writes == [1] and {"at_risk", "pending_restart"}.isdisjoint(after.kept())
    # Read once: the next report is the same process's.
    assert after.observe(report(61.0, pids=pids), IDLE, rules, 61.0) is False and after.crashes == 1


def test_a_set_seen_failing_with_no_pid_on_either_side_is_read_as_a_crash() -> None:
    """An engine that names no scheduler pid: nothing tells its process; a restart not ruled out is read
    as one (the safe side: the set was admitted when it was seen failing)."""
    after, rules, _ = restarted(failing_with(set_ab(pids=())))
    after.observe(report(60.0), IDLE, rules, 60.0)
    assert after.crashes == 1 and after.last_crash is not None
    assert (
        after.last_crash.why == "failing when the sidecar restarted; no scheduler pid to tell the process by"
    )


def test_a_set_seen_failing_is_a_new_build_s_upgrade_when_another_build_first_reports() -> None:
    """A deploy that replaced the engine (another build) while the sidecar restarted: a planned upgrade,
    no crash; the new build is conservative until a reading confirms its fit."""
    after, rules, _ = restarted(failing_with(set_ab()))
    assert after.observe(report(60.0, "0.5.24", pids=("202",)), IDLE, rules, 60.0) is True
    assert (after.crashes, after.upgrades, after.margin) == (0, 1, 1.0123456)
    assert after.conservative == "engine build 0.5.23 -> 0.5.24"
    assert after.margin_in_force == pytest.approx(1.0123456 * (1.0 + NEW_BUILD_SAFETY), rel=1e-12)
    assert "at_risk" not in after.kept() and after.kept()["engine_build"] == "0.5.24"


def test_the_same_process_answering_after_a_sidecar_restart_is_no_crash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The process that was failing answers with the same scheduler pids (a lost scrape, a network blip
    while the sidecar restarted): it did not die, the set is no evidence (``engine_ok``), and the file
    forgets it."""
    after, rules, writes = restarted(failing_with(set_ab(("101", "102"))))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert after.observe(report(60.0, pids=("101", "102")), IDLE, rules, 60.0) is False
    assert records(caplog) == [
        (
            "INFO",
            "the engine that was failing when the sidecar restarted answers with the same scheduler pids "
            "['101', '102']: the same process, no restart; the 2 request(s) then admitted are no evidence",
            {"event": "engine_same_process", "pids": ["101", "102"]},
        )
    ]
    assert (after.crashes, after.margin, writes) == (0, 1.0123456, [0])
    assert {"at_risk", "pending_restart"}.isdisjoint(after.kept())


@pytest.mark.parametrize(("pids", "crashes"), [(("101",), 0), (("202",), 1)])
def test_a_restart_the_new_sidecar_notices_before_any_report_is_the_one_the_set_awaits(
    pids: tuple[str, ...], crashes: int
) -> None:
    """A sidecar started while the engine was down sees it fail, then answer: its scraper (no pids known
    yet) calls that a restart, and the set is read at the report that follows, by its pids as above.
    The restart noticed is no second one (nothing read as a crash without a build)."""
    after, rules, _ = restarted(failing_with(set_ab()))
    assert after.engine_restarted(58.0, "it answered again after a failed scrape") is False
    assert after.crashes == 0
    after.observe(report(60.0, pids=pids), IDLE, rules, 60.0)
    assert after.crashes == crashes
    assert {"at_risk", "pending_restart"}.isdisjoint(after.kept())


# -- a restart the previous sidecar noticed, read at the new one's first report ---------------------------


@pytest.mark.parametrize(
    ("version", "crashes", "upgrades"),
    [(BUILD, 1, 0), (None, 1, 0), ("0.5.24", 0, 1)],
)
def test_a_pending_restart_is_read_at_the_first_report_by_its_build(
    version: str | None, crashes: int, upgrades: int
) -> None:
    """The previous sidecar noticed the restart but not the new process's first report: the restarted
    sidecar's first report is that process's (the old one is gone, whatever pids it reuses): the same
    build or none, a crash; another, an upgrade. A restart noticed before it (the engine failed again
    between the sidecars) does not read it without a build."""
    before = failing_with(set_ab())
    before.engine_restarted(10.0, "scheduler pid ['101'] -> ['202']")
    after, rules, _ = restarted(before)
    assert after.engine_restarted(58.0, "it answered again after a failed scrape") is False
    assert after.crashes == 0
    after.observe(report(60.0, version, pids=("101",)), IDLE, rules, 60.0)
    assert (after.crashes, after.upgrades) == (crashes, upgrades)
    if crashes:
        assert after.last_crash is not None and after.last_crash.why == "scheduler pid ['101'] -> ['202']"
        assert after.last_crash.at == 10.0 and after.margin == pytest.approx(CRASH_TARGET, rel=1e-12)
    assert "pending_restart" not in after.kept()


def test_the_live_sidecar_writes_its_file_when_the_evidence_changes() -> None:
    """Seen failing: written (a sidecar restart now keeps it); the same process answering: written
    again (nothing pending); a second failure is kept as its own set."""
    w, _, rules = lane()
    w.observe(report(5.0, pids=("101",)), IDLE, rules, 5.0)
    writes: list[object] = []
    w.on_learned = lambda: writes.append(w.kept().get("at_risk"))
    w.at_risk(set_ab())
    w.at_risk(replace(set_ab(), at=6.0))  # the first sign wins: nothing to write
    assert writes == [set_ab().kept()]
    w.engine_ok(7.0, since=4.0)  # read before the set was kept: says nothing
    w.engine_ok(7.0, since=6.5)
    assert writes == [set_ab().kept(), None]
