"""How the lane watch reads an engine restart and a new engine build, pinned exactly (issue 29,
docs/robustness.md "A crash is evidence" and "A new engine build"): a restart with work admitted is
read at the new process's first report, its build telling a planned upgrade (no crash, the new build
priced conservatively) from a crash (the same build, none reported, or no build known to compare);
a report that is not yet the new process's is not read; a changed build puts the lane in the
conservative state with one warning. Fast unit tests on a bare ``LaneWatch`` fed engine reports with
no GPU reading (no servers, no clock but the numbers passed in): the lane of ``test_monitor_reports``
(the margin 1.0123456 so that every rounding shows, ``max_margin`` 1.5, ``safety`` 0.05)."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from sidecar.admission.lane_watch import NEW_BUILD_SAFETY, LaneWatch
from sidecar.core.rules import Rules
from sidecar.core.snapshot import Snapshot, SourceHealth
from tests.conftest import snapshot
from tests.test_lane_watch_crash_rule import CRASH_TARGET, SET_AB, admitted
from tests.test_monitor_reports import IDLE, lane, records

LOGGER = "sidecar.admission.lane_watch"
WHY = "scheduler pid [1] -> [2]"


def report(at: float, version: str | None, failures: int = 0) -> Snapshot:
    """An engine report observed at ``at`` naming ``version`` (no GPU reading: nothing but the engine's
    report is read); ``failures``: the scrape's consecutive failures (the report is then the last good
    one, not a new one)."""
    snap = snapshot(at, free_bytes=None, version=version)
    if failures:
        snap = replace(snap, engine_health=SourceHealth(None, "connection refused", failures))
    return snap


def on_build(version: str | None = "0.5.23", at: float = 5.0) -> tuple[LaneWatch, Rules]:
    """A watch whose engine reported ``version`` at ``at`` (the build the lane is learned on)."""
    w, _, rules = lane()
    assert w.observe(report(at, version), IDLE, rules, at) is False
    assert w.build == version and w.conservative is None
    return w, rules


def upgrade_line(n: int, to: str, frm: str = "0.5.23") -> str:
    return (
        f"engine restarted ({WHY}) onto a new build {frm} -> {to} while the gate had admitted {n} "
        "request(s): read as a planned upgrade, not a crash (drain the lane before an upgrade to spare "
        "them); the new build is priced conservatively until its fit is confirmed"
    )


# -- a planned upgrade -----------------------------------------------------------------------------------


def test_a_restart_onto_another_build_with_work_admitted_is_an_upgrade_not_a_crash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A deploy that replaces the engine under load killed requests that did not run out of memory:
    raising the margin for them would under-use the lane for good. The operator gets one warning per
    upgrade naming the builds and the requests it killed (to drain next time), counted in
    ``upgrades_under_load``, and the new build is priced x1.25 until a reading confirms its fit."""
    w, rules = on_build()
    learned: list[str | None] = []
    w.on_learned = lambda: learned.append(w.build)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        w.engine_restarted(10.0, WHY, admitted=admitted("a", "b"))
        records(caplog)
        assert w.observe(report(11.0, "0.5.24"), IDLE, rules, 11.0) is True  # the margin in force rose
        assert records(caplog) == [
            (
                "WARNING",
                upgrade_line(2, "0.5.24"),
                {"event": "engine_upgraded_under_load", "from": "0.5.23", "to": "0.5.24", **SET_AB},
            ),
            (
                "WARNING",
                "engine build 0.5.23 -> 0.5.24: the lane's learned margin 1.012 is priced x1.25 (1.265) "
                "until a reading confirms the fit",
                {"event": "engine_build_changed", "from": "0.5.23", "to": "0.5.24"},
            ),
        ]
    assert (w.crashes, w.upgrades, w.last_crash, w.crash_margin) == (0, 1, None, None)
    # Written when the restart was noticed (its evidence pending, on the old build), then the new build.
    assert w.margin == 1.0123456 and w.build == "0.5.24" and learned == ["0.5.23", "0.5.24"]
    assert w.conservative == "engine build 0.5.23 -> 0.5.24" and w.conservative_since == 11.0
    assert w.margin_in_force == pytest.approx(1.0123456 * (1.0 + NEW_BUILD_SAFETY), rel=1e-12)
    assert w.state(11.0)["crashes"]["upgrades_under_load"] == 1

    # A second upgrade before the first was confirmed: counted again, the wait starts again, but the
    # margin in force is what it was (no change to the rules to report).
    with caplog.at_level(logging.INFO, logger=LOGGER):
        w.engine_restarted(20.0, WHY, admitted=admitted("c"))
        records(caplog)
        assert w.observe(report(21.0, "0.5.25"), IDLE, rules, 21.0) is False
        (upgraded, changed) = records(caplog)
    assert upgraded[1] == upgrade_line(1, "0.5.25", frm="0.5.24")
    assert upgraded[2]["requests"] == 1 and upgraded[2]["request_ids"] == ["c"]
    assert changed[1] == (
        "engine build 0.5.24 -> 0.5.25: the lane's learned margin 1.012 is priced x1.25 (1.265) "
        "until a reading confirms the fit"
    )
    assert (w.crashes, w.upgrades, w.margin) == (0, 2, 1.0123456)
    assert w.conservative == "engine build 0.5.24 -> 0.5.25" and w.conservative_since == 21.0


def test_an_upgrade_on_a_lane_already_at_its_cap_changes_no_rule() -> None:
    """A lane whose margin already sits at ``max_margin`` cannot be priced higher on a new build: the
    upgrade is still counted and the build still marked unconfirmed, but nothing says the rules
    changed, so the gate does not rebuild them for nothing."""
    w, _, rules = lane(cost__margin=1.5)
    assert w.observe(report(5.0, "0.5.23"), IDLE, rules, 5.0) is False
    w.engine_restarted(10.0, WHY, admitted=admitted("a"))
    assert w.observe(report(11.0, "0.5.24"), IDLE, rules, 11.0) is False
    assert (w.crashes, w.upgrades, w.margin, w.margin_in_force) == (0, 1, 1.5, 1.5)
    assert w.conservative == "engine build 0.5.23 -> 0.5.24"


# -- a crash ---------------------------------------------------------------------------------------------


def test_a_restart_on_the_same_build_with_work_admitted_is_a_crash_at_the_new_process_first_report() -> None:
    """The same build came back: nothing was deployed, the admitted set ran the engine out of memory,
    and the margin rises so that it would not have fitted. Read once, at the new process's first
    report, not when the restart is noticed."""
    w, rules = on_build()
    assert w.engine_restarted(10.0, WHY, admitted=admitted("a", "b")) is False
    assert w.crashes == 0
    assert w.observe(report(11.0, "0.5.23"), IDLE, rules, 11.0) is True
    assert (w.crashes, w.upgrades, w.conservative) == (1, 0, None)
    assert w.margin == pytest.approx(CRASH_TARGET, rel=1e-12)
    assert w.last_crash is not None and (w.last_crash.at, w.last_crash.why) == (10.0, WHY)
    assert w.observe(report(12.0, "0.5.23"), IDLE, rules, 12.0) is False and w.crashes == 1


def test_a_new_process_that_reports_no_build_is_read_as_a_crash() -> None:
    """An engine that stops reporting its version after a restart gives nothing to tell an upgrade by:
    the restart with work admitted is a crash (the conservative reading), and the build the lane was
    learned on stays."""
    w, rules = on_build()
    w.engine_restarted(10.0, WHY, admitted=admitted("a", "b"))
    assert w.observe(report(11.0, None), IDLE, rules, 11.0) is True
    assert (w.crashes, w.upgrades, w.build, w.conservative) == (1, 0, "0.5.23", None)
    assert w.margin == pytest.approx(CRASH_TARGET, rel=1e-12)


def test_a_restart_whose_successor_never_reported_is_a_crash_though_a_build_is_known() -> None:
    """The new process went before it ever reported (a crash loop): its build is unknown, so the first
    restart is read as a crash when the next is noticed, never as an upgrade away from the known
    build; the second restart says the margin changed."""
    w, _ = on_build()
    w.engine_restarted(10.0, WHY, admitted=admitted("a", "b"))
    assert w.engine_restarted(20.0, "scheduler pid [2] -> [3]") is True
    assert (w.crashes, w.upgrades, w.build, w.conservative) == (1, 0, "0.5.23", None)
    assert w.margin == pytest.approx(CRASH_TARGET, rel=1e-12)


def test_a_restart_before_any_build_was_known_is_a_crash_and_its_build_is_learnt_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A sidecar that never saw the old process's build cannot call the restart an upgrade: a crash.
    The build the new process reports is the one the lane is learned on from then, not a new build to
    be conservative about."""
    w, _, rules = lane()
    w.engine_restarted(10.0, WHY, admitted=admitted("a", "b"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert w.observe(report(11.0, "0.5.24"), IDLE, rules, 11.0) is True
    assert (w.crashes, w.upgrades, w.build, w.conservative) == (1, 0, "0.5.24", None)
    assert [r[2]["event"] for r in records(caplog)] == ["engine_crash"]


# -- which report is the new process's ---------------------------------------------------------------------


def test_only_the_new_process_report_is_read(caplog: pytest.LogCaptureFixture) -> None:
    """After a restart the snapshot may still carry the old process's last report, a report from a
    failing scrape or no engine report at all: none of these says what the new process runs, and reading one would call
    an upgrade a crash (or the reverse). They leave the restart pending and change nothing; the first
    good report newer than the old process's last one is read, even one that came a hair before the
    restart was noticed."""
    w, rules = on_build(at=5.0)
    w.engine_restarted(10.0, WHY, admitted=admitted("a", "b"))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        records(caplog)
        assert w.observe(report(5.0, "0.5.23"), IDLE, rules, 10.1) is False  # the old process's last
        assert w.observe(report(11.0, "0.5.23", failures=1), IDLE, rules, 10.2) is False
        assert w.observe(replace(report(11.0, "0.5.24"), engine=None), IDLE, rules, 10.3) is False
        assert records(caplog) == []
    assert (w.crashes, w.upgrades, w.build, w.margin) == (0, 0, "0.5.23", 1.0123456)
    assert w.observe(report(5.5, "0.5.23"), IDLE, rules, 10.4) is True
    assert (w.crashes, w.upgrades) == (1, 0)
    assert w.last_crash is not None and w.last_crash.at == 10.0


# -- a new build without a restart being read -----------------------------------------------------------


def test_the_first_build_seen_is_learnt_quietly(caplog: pytest.LogCaptureFixture) -> None:
    """The first version an engine reports is the build the lane is learned on: kept in the state file
    (``on_learned``), no warning, no conservative state and no change to the rules."""
    w, _, rules = lane()
    learned: list[str | None] = []
    w.on_learned = lambda: learned.append(w.build)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert w.observe(report(1.0, "0.5.23"), IDLE, rules, 1.0) is False
        assert w.observe(report(2.0, "0.5.23"), IDLE, rules, 2.0) is False
        assert records(caplog) == []
    assert (w.build, w.conservative, w.conservative_since, learned) == ("0.5.23", None, None, ["0.5.23"])
    assert w.margin_in_force == 1.0123456
