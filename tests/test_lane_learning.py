"""What the lane watch learns beyond the monitor's findings (issue 29, docs/robustness.md), on a real
``Admission`` fed snapshots on a manual clock: a crash with admitted work raises the margin so that
the set would not have fitted; a new engine build is priced conservatively until a reading confirms
the fit; benign differences (the allocator's 2 MiB rounding, a few per cent) never make a prompt the
lane served unfit; each GPU keeps its own idle baseline; the state file keeps what was learnt."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from sidecar.admission.controller import Admission, Outcome
from sidecar.admission.lane_watch import NEW_BUILD_SAFETY, AdmittedSet, crash_margin, excess
from sidecar.core.decide import headroom_bytes
from sidecar.core.decision import Action, Reason
from sidecar.core.ledger import LedgerTotals
from sidecar.core.snapshot import DeviceMemory, EngineSignals, GpuSignals, Snapshot, SourceHealth
from sidecar.ops import learned_file
from sidecar.policy.in_force import rules_of
from sidecar.policy.schema import Monitor
from tests.conftest import MIB, ManualClock, ask, small_policy, snapshot, submit

GIB = 1024 * MIB


# 1 MiB per chunk token at margin 1.0, the idle budget measured at start (``auto``), a strict monitor.
LANE: dict[str, object] = dict(
    cost__activation_bytes_per_chunk_token="1MiB",
    cost__margin=1.0,
    vram__headroom="idle_budget",
    vram__idle_free_bytes="auto",
    monitor__tolerance=0.0,
    monitor__min_bytes="1MiB",
    monitor__max_margin=3.0,
    lane__chunked_prefill_size=100_000,
)


def lane(clock: ManualClock, **overrides: object) -> Admission:
    """1 MiB per chunk token at margin 1.0, a 4 GiB idle budget measured at start (``auto``)."""
    a = Admission(small_policy(**(LANE | overrides)), clock)
    a.update_snapshot(gpu(snapshot(clock.t, version="0.5.23"), clock.t, 4 * GIB))
    assert a.watch.idle is not None and a.rules.vram.idle_free_bytes == 4 * GIB
    return a


def gpu(snap: Snapshot, at: float, free: int) -> Snapshot:
    return replace(snap, gpu=GpuSignals(at, "test", (DeviceMemory("GPU-0", free, 80 * GIB),)))


def failing(snap: Snapshot, failures: int = 1) -> Snapshot:
    return replace(snap, engine_health=SourceHealth(None, "connection refused", failures))


# -- a crash is evidence -------------------------------------------------------------------------------


def test_crash_margin_prices_the_admitted_set_beyond_what_it_was_admitted_into() -> None:
    m = Monitor(max_margin=3.0, safety=0.05)
    s = AdmittedSet(
        0.0, ("a",), projected_bytes=2000 * MIB, margin=1.0, budget_bytes=2400 * MIB, reserve_bytes=0
    )
    new = crash_margin(s, m, 1.0)
    assert new == pytest.approx(1.2 * 1.05)
    assert 2000 * MIB * new > s.budget_bytes  # the set no longer fits its budget
    # Priced at a raised margin already: its cost terms are the projection over that margin.
    assert crash_margin(replace(s, margin=1.25, projected_bytes=2500 * MIB), m, 1.0) == pytest.approx(1.26)
    # Bounded by max_margin; nothing to read against without a budget or a projection.
    assert crash_margin(replace(s, projected_bytes=100 * MIB), m, 1.0) == 3.0
    assert crash_margin(replace(s, budget_bytes=None), m, 1.0) is None
    assert crash_margin(replace(s, projected_bytes=0), m, 1.0) is None


def test_a_restart_after_admitted_requests_failed_raises_the_margin_and_logs_the_set(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    a = lane(clock)
    big = submit(a, ask(a, 3000, request_id="big"))  # 3,000 MiB of a 4,096 MiB budget
    small = submit(a, ask(a, 500, request_id="small"))
    assert big.admitted and small.admitted
    # The engine dies: the first failed request names the set as it was (both still charged) ...
    big.end(Outcome.UPSTREAM_ERROR)
    small.end(Outcome.UPSTREAM_ERROR)
    clock.advance(1.0)
    a.update_snapshot(failing(a.snapshot))
    assert a.ledger.totals.requests == 0
    # ... and when it is back as a new process, that set is the evidence.
    with caplog.at_level(logging.WARNING, logger="sidecar.admission.lane_watch"):
        a.engine_restarted("scheduler pid [1] -> [2]")
        assert a.watch.crashes == 0  # read at the new process's first report: its build decides
        clock.advance(0.5)
        a.update_snapshot(gpu(snapshot(clock.t, version="0.5.23"), clock.t, 4 * GIB))
    crash = a.watch.last_crash
    assert a.watch.crashes == 1 and crash is not None and crash.admitted.request_ids == ("big", "small")
    assert crash.admitted.projected_bytes == 3500 * MIB and crash.admitted.budget_bytes == 4 * GIB
    assert a.rules.cost.margin == pytest.approx(4096 / 3500 * 1.05)
    # The same set would not be admitted now.
    assert ask(a, 3000).projected_bytes + ask(a, 500).projected_bytes > 4 * GIB
    (line,) = [r for r in caplog.records if getattr(r, "fields", {}).get("event") == "engine_crash"]
    assert "big, small" in line.getMessage() and line.fields["requests"] == 2  # type: ignore[attr-defined]
    # Kept across the next restart (nothing admitted then: no crash, no change) and a reload of the same costs.
    a.engine_restarted("it answered again after a failed scrape")
    assert a.watch.crashes == 1 and a.rules.cost.margin == pytest.approx(4096 / 3500 * 1.05)
    a.reload(a.loaded)
    assert a.rules.cost.margin == pytest.approx(4096 / 3500 * 1.05)


def test_a_lost_scrape_of_the_same_process_is_no_crash(clock: ManualClock) -> None:
    a = lane(clock)
    h = submit(a, ask(a, 3000, request_id="big"))
    clock.advance(0.1)
    a.update_snapshot(failing(a.snapshot))  # one scrape failed with work admitted
    clock.advance(1.0)
    a.update_snapshot(gpu(snapshot(clock.t), clock.t, 4 * GIB - 3000 * MIB))  # the same engine answers
    h.end(Outcome.COMPLETED)
    a.engine_restarted("scheduler pid [1] -> [2]")  # later, idle: a restart, not a crash
    assert a.watch.crashes == 0 and a.rules.cost.margin == 1.0


def test_the_state_file_keeps_the_margin_across_a_sidecar_restart_atomically(
    clock: ManualClock, tmp_path: Path
) -> None:
    path = tmp_path / "lane.json"
    a = lane(clock)
    learned_file.keep(path, a.watch)
    h = submit(a, ask(a, 3000, request_id="big"))
    h.end(Outcome.UPSTREAM_ERROR)
    a.engine_restarted("scheduler pid [1] -> [2]")
    clock.advance(0.5)
    a.update_snapshot(gpu(snapshot(clock.t, version="0.5.23"), clock.t, 4 * GIB))
    saved = json.loads(path.read_text())
    assert saved["margin"] == pytest.approx(4096 / 3000 * 1.05) and saved["crashes"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["lane.json"]  # no temporary file left

    b = lane(clock)
    assert learned_file.restore(path, b.watch) is not None
    b.refresh_rules()
    assert b.rules.cost.margin == pytest.approx(4096 / 3000 * 1.05)
    # Another calibration (other costs) starts from its own margin.
    c = lane(clock, cost__activation_bytes_per_chunk_token="2MiB")
    said = learned_file.restore(path, c.watch)
    c.refresh_rules()
    assert said is not None and "margins ignored" in said and c.rules.cost.margin == 1.0
    # A broken file stops the start (the margin it kept is not forgotten silently).
    path.write_text("{not json")
    d = lane(clock)
    with pytest.raises(learned_file.StateFileError, match=f"{path}:1: not JSON"):
        learned_file.restore(path, d.watch)


def started(clock: ManualClock, path: Path, **overrides: object) -> Admission:
    """A sidecar started with ``path`` as its state file, before any snapshot."""
    a = Admission(small_policy(**(LANE | overrides)), clock)
    learned_file.keep(path, a.watch, clock, wall=lambda: EPOCH + clock.t)
    a.refresh_rules()
    return a


def fresh(
    clock: ManualClock, path: Path, version: str, pids: tuple[str, ...] = (), **overrides: object
) -> Admission:
    """A sidecar started with ``path`` as its state file, then its first snapshot (``lane``'s figures)."""
    a = started(clock, path, **overrides)
    a.update_snapshot(gpu(snapshot(clock.t, version=version, pids=pids), clock.t, 4 * GIB))
    return a


EPOCH = 1_790_000_000.0  # the wall clock's Unix seconds at ManualClock 0


def test_a_sidecar_restarted_before_a_new_build_is_confirmed_stays_conservative_until_a_reading_confirms(
    clock: ManualClock, tmp_path: Path
) -> None:
    """Issue 29 item 2: a sidecar restarted between an engine upgrade and the reading that confirms the
    new build must not trust the old build's margin on it; and the wait is not started again."""
    path = tmp_path / "lane.json"
    a = fresh(clock, path, "0.5.23")
    clock.advance(1.0)
    a.update_snapshot(gpu(snapshot(clock.t, version="0.5.24"), clock.t, 4 * GIB))  # the upgrade
    upgraded_at = clock.t
    assert a.watch.conservative is not None and a.rules.cost.margin == pytest.approx(1.0 + NEW_BUILD_SAFETY)
    saved = json.loads(path.read_text())
    assert saved["engine_build"] == "0.5.24" and saved["conservative"] == "engine build 0.5.23 -> 0.5.24"
    assert saved["conservative_since"] == pytest.approx(EPOCH + upgraded_at)
    assert saved["margin_in_force"] == pytest.approx(1.0 + NEW_BUILD_SAFETY)

    # The sidecar restarts 600 s later (the engine, 0.5.24, runs on): still conservative, since then.
    clock.advance(600.0)
    b = fresh(clock, path, "0.5.24")
    assert b.watch.conservative == "engine build 0.5.23 -> 0.5.24"
    assert b.rules.cost.margin == pytest.approx(1.0 + NEW_BUILD_SAFETY)
    assert b.watch.state(clock.t)["engine_build"]["since_age_s"] == pytest.approx(600.0)
    # A prompt priced at the old margin that fits only there is not admitted on the unconfirmed build.
    unfit = b.evaluate(ask(b, 3500, request_id="edge"))
    assert unfit.reason is Reason.UNFIT_REQUEST, "the restarted sidecar trusted the old margin"
    assert a.evaluate(ask(a, 3500, request_id="edge")).reason is Reason.UNFIT_REQUEST
    forgot = fresh(clock, tmp_path / "none.json", "0.5.24")  # what forgetting the state would do
    assert forgot.evaluate(ask(forgot, 3500)).action is Action.ADMIT
    # A reading that confirms the fit (as in the test above): the learned margin again, and kept so.
    h = submit(b, ask(b, 1000, request_id="r1"))
    h.prefill_done()
    clock.advance(0.1)
    b.update_snapshot(gpu(b.snapshot, clock.t, 4 * GIB - 1000 * MIB))
    assert b.watch.conservative is None and b.rules.cost.margin == 1.0
    h.end(Outcome.COMPLETED)
    saved = json.loads(path.read_text())
    assert saved["conservative"] is None and saved["conservative_since"] is None
    assert saved["margin_in_force"] == 1.0
    # A third start after confirmation: the learned margin from the first request.
    assert fresh(clock, path, "0.5.24").rules.cost.margin == 1.0


@pytest.mark.parametrize("version", ["0.5.23", "0.5.24"])
def test_a_sidecar_restarted_while_the_engine_restarts_still_reads_the_crash(
    clock: ManualClock, tmp_path: Path, version: str
) -> None:
    """Issue 29 item 2: the engine dies with work admitted and the sidecar restarts before the engine
    is back (a big model loads for minutes). The set the gate had admitted is in the state file; the
    restarted sidecar reads it at the new process's first report as the old one would have: the same
    build, a crash (the margin rises so the set would not fit); another, a planned upgrade (priced
    conservatively until a reading confirms the fit)."""
    path = tmp_path / "lane.json"
    a = fresh(clock, path, "0.5.23", pids=("101",))
    big = submit(a, ask(a, 3000, request_id="big"))  # 3,000 MiB of a 4,096 MiB budget
    big.end(Outcome.UPSTREAM_ERROR)  # the engine broke its connection: it may be dying with it
    clock.advance(1.0)
    a.update_snapshot(failing(a.snapshot))
    saved = json.loads(path.read_text())["at_risk"]
    assert saved["request_ids"] == ["big"] and saved["engine_pids"] == ["101"]
    assert saved["at"] == pytest.approx(EPOCH + clock.t - 1.0) and saved["budget_bytes"] == 4 * GIB

    # The sidecar restarts 30 s later; the engine is still loading, then answers as a new process
    # (the scraper saw it fail, then answer: a restart, read at the report that follows).
    clock.advance(30.0)
    b = started(clock, path)
    b.update_snapshot(failing(Snapshot(), failures=3))
    clock.advance(60.0)
    b.engine_restarted("it answered again after a failed scrape")
    b.update_snapshot(gpu(snapshot(clock.t, version=version, pids=("202",)), clock.t, 4 * GIB))
    kept = json.loads(path.read_text())
    assert {"at_risk", "pending_restart"}.isdisjoint(kept)
    forgot = fresh(clock, tmp_path / "none.json", version)  # what forgetting the evidence would do
    assert forgot.evaluate(ask(forgot, 3000)).action is Action.ADMIT
    if version == "0.5.23":
        crash = b.watch.last_crash
        assert b.watch.crashes == 1 and crash is not None and crash.admitted.request_ids == ("big",)
        assert b.rules.cost.margin == pytest.approx(4096 / 3000 * 1.05) and kept["crashes"] == 1
        assert b.evaluate(ask(b, 3000)).reason is Reason.UNFIT_REQUEST
    else:
        assert (b.watch.crashes, b.watch.upgrades) == (0, 1) and kept["crashes"] == 0
        assert b.watch.conservative == "engine build 0.5.23 -> 0.5.24" and kept["conservative"] is not None
        assert b.rules.cost.margin == pytest.approx(1.0 + NEW_BUILD_SAFETY)
        assert b.evaluate(ask(b, 3500)).reason is Reason.UNFIT_REQUEST
        assert forgot.evaluate(ask(forgot, 3500)).action is Action.ADMIT


def test_a_sidecar_restarted_while_the_same_engine_process_was_unreachable_reads_no_crash(
    clock: ManualClock, tmp_path: Path
) -> None:
    """The engine was seen failing with work admitted (a network blip) and the sidecar restarted: the
    same scheduler pids answer, the same process; no crash, and the file forgets the set."""
    path = tmp_path / "lane.json"
    a = fresh(clock, path, "0.5.23", pids=("101",))
    submit(a, ask(a, 3000, request_id="big"))
    clock.advance(1.0)
    a.update_snapshot(failing(a.snapshot))  # a failed scrape with "big" admitted
    assert json.loads(path.read_text())["at_risk"]["request_ids"] == ["big"]
    clock.advance(5.0)
    b = fresh(clock, path, "0.5.23", pids=("101",))
    assert b.watch.crashes == 0 and b.rules.cost.margin == 1.0
    assert "at_risk" not in json.loads(path.read_text())


GOOD = {
    "version": 1,
    "cost_fingerprint": "0123456789abcdef",
    "margin": 1.2,
    "crash_margin": None,
    "crashes": 0,
    "engine_build": "0.5.24",
    "conservative": "engine build 0.5.23 -> 0.5.24",
    "conservative_since": EPOCH,
    "margin_in_force": 1.5,
}
# The crash evidence not read yet (``LaneWatch.kept``): a set seen failing, a restart not read.
GOOD_SET = {
    "at": EPOCH,
    "request_ids": ["a", "b"],
    "requests": 2,
    "projected_bytes": 3000 * MIB,
    "priced_margin": 1.2,
    "budget_bytes": 4 * GIB,
    "reserve_bytes": 0,
    "engine_pids": ["101"],
}
PENDING = {"at": EPOCH + 1.0, "why": "scheduler pid ['101'] -> ['202']", "admitted": GOOD_SET}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[1, 2]", ": (top level): expected a JSON object, got list"),
        ('{"free_bytes": 1, "total_bytes": 2}', ": version: None: not a state file of this sidecar"),
        (json.dumps(GOOD | {"version": 2}), ": version: 2: not a state file of this sidecar"),
        (json.dumps(GOOD | {"conservative": True}), ": conservative: Input should be a valid string"),
        (json.dumps(GOOD | {"margin": "1.2"}), ": margin: Input should be a valid number"),
        (json.dumps(GOOD | {"crashes": -1}), ": crashes: Input should be greater than or equal to 0"),
        (
            json.dumps(GOOD | {"engine_build": None}),
            ": conservative: an unconfirmed build with no engine_build",
        ),
        (json.dumps(GOOD | {"margin_in_force": 1.1}), ": margin_in_force: 1.1 is below margin 1.2"),
        (json.dumps(GOOD | {"crash_margin": 1.25}), ": crash_margin: 1.25 is above margin 1.2"),
        (json.dumps(GOOD | {"idle_free_bytes": 1}), ": idle_free_bytes: Extra inputs are not permitted"),
        (
            json.dumps(GOOD | {"at_risk": GOOD_SET | {"projected_bytes": -1}}),
            ": at_risk.projected_bytes: Input should be greater than or equal to 0",
        ),
        (
            json.dumps(GOOD | {"at_risk": GOOD_SET | {"request_ids": ["r"] * 17, "requests": 17}}),
            ": at_risk.request_ids: List should have at most 16 items after validation, not 17",
        ),
        (
            json.dumps(GOOD | {"at_risk": GOOD_SET | {"engine_pids": [101]}}),
            ": at_risk.engine_pids.0: Input should be a valid string",
        ),
        (
            json.dumps(GOOD | {"at_risk": GOOD_SET | {"at": 0}}),
            ": at_risk.at: Input should be greater than 0",
        ),
        (
            json.dumps(GOOD | {"pending_restart": PENDING | {"admitted": GOOD_SET | {"requests": 1}}}),
            ": pending_restart.admitted.requests: 1 is below the 2 request_ids",
        ),
        (
            json.dumps(GOOD | {"pending_restart": {k: v for k, v in PENDING.items() if k != "why"}}),
            ": pending_restart.why: Field required",
        ),
        (json.dumps({k: v for k, v in GOOD.items() if k != "crashes"}), ": crashes: Field required"),
        ('{\n  "version": 1,\n  oops\n}', ":3: not JSON: Expecting property name"),
    ],
)
def test_a_corrupt_or_foreign_state_file_is_refused_naming_the_file_and_the_field(
    clock: ManualClock, tmp_path: Path, text: str, says: str
) -> None:
    path = tmp_path / "lane.json"
    path.write_text(text)
    with pytest.raises(learned_file.StateFileError) as e:
        fresh(clock, path, "0.5.24")
    assert f"{path}{says}" in str(e.value) and "delete the file to start from the policy alone" in str(
        e.value
    )
    # The file as this sidecar writes it loads (one written before the crash evidence was kept, too).
    path.write_text(json.dumps(GOOD))
    assert fresh(clock, path, "0.5.24").watch.conservative == GOOD["conservative"]
    path.write_text(json.dumps(GOOD | {"at_risk": GOOD_SET, "pending_restart": PENDING}))
    assert fresh(clock, path, "0.5.24").watch.conservative == GOOD["conservative"]


# -- a new engine build ----------------------------------------------------------------------------------


def test_a_new_build_is_conservative_until_a_reading_confirms_the_fit(clock: ManualClock) -> None:
    a = lane(clock)
    clock.advance(1.0)
    a.update_snapshot(gpu(snapshot(clock.t, version="0.5.24"), clock.t, 4 * GIB))
    assert a.watch.conservative == "engine build 0.5.23 -> 0.5.24"
    assert a.rules.cost.margin == pytest.approx(1.0 + NEW_BUILD_SAFETY)
    # A small prompt cannot show a 25 % change beyond the monitor's floor: it confirms nothing.
    tiny = submit(a, ask(a, 2, request_id="tiny"))
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 4 * GIB - 2 * MIB))
    assert a.watch.conservative is not None
    tiny.end(Outcome.COMPLETED)
    # A prompt large enough: a reading mid-prefill shows part of its peak, which confirms nothing ...
    h = submit(a, ask(a, 1000, request_id="r1"))
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 4 * GIB - 500 * MIB))
    assert a.watch.conservative is not None
    # ... its prefill done, a reading that shows the peak (what its cost terms say): confirmed.
    h.prefill_done()
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 4 * GIB - 1000 * MIB))
    assert a.watch.conservative is None and a.rules.cost.margin == 1.0
    h.end(Outcome.COMPLETED)


def test_a_new_build_that_draws_more_sets_the_margin_from_what_it_drew(clock: ManualClock) -> None:
    a = lane(clock)
    a.update_snapshot(gpu(snapshot(clock.t, version="0.5.24"), clock.t, 4 * GIB))
    h = submit(a, ask(a, 1000, request_id="r1"))  # priced at 1.25: 1,250 MiB
    h.prefill_done()
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 4 * GIB - 1100 * MIB))  # drew x1.10 of its terms
    assert a.watch.conservative is None
    assert a.rules.cost.margin == pytest.approx(1.1 * 1.05)
    h.end(Outcome.COMPLETED)


def test_a_reading_that_bounds_the_draw_only_from_below_does_not_confirm_a_new_build(
    clock: ManualClock,
) -> None:
    """Issue 29: a 88,108-token prompt's final peak was priced as a full 8,192-token chunk at its whole
    context, while its last chunk was 6,188 tokens: the reading showed x1.048 of those terms on a build
    drawing x1.10, confirmed the learned margin 1.05, and the next batch join (x1.10) crashed the lane.
    Such a reading bounds the draw from below only; the one that confirms bounds it from above."""
    # 1 MiB per chunk token, 100 KiB per context token, chunks of 1,000 tokens: a prompt's final peak
    # may run a chunk's context (97.7 MiB) ahead of what the engine drew (``chunk_growth``).
    a = lane(clock, cost__context_bytes_per_token="100KiB", lane__chunked_prefill_size=1000)
    clock.advance(1.0)
    a.update_snapshot(gpu(snapshot(clock.t, version="0.5.24"), clock.t, 4 * GIB))
    assert a.watch.conservative is not None
    # 2,500 tokens: priced as a full chunk at the whole context, 1,000 + 244 MiB of terms; the engine's
    # peak may be the full chunk before the last one, at 2,000 tokens of context (1,195 MiB).
    h = submit(a, ask(a, 2500, request_id="r1"))
    h.prefill_done()
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 4 * GIB - 1230 * MIB))  # x0.989 of the terms, x1.073 at most
    lo, hi = a.watch.bracket or (0.0, 0.0)
    assert lo < 1.0 < hi
    assert a.watch.conservative is not None, "a lower bound within the margin confirmed the new build"
    assert a.rules.cost.margin == pytest.approx(1.0 + NEW_BUILD_SAFETY)
    h.end(Outcome.COMPLETED)
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 4 * GIB - 1230 * MIB))  # r1 gone: the next one alone
    # A larger prompt that draws well under its terms: bounded from above within the margin, confirmed.
    h = submit(a, ask(a, 3500, request_id="r2"))  # 1,000 + 342 MiB of terms
    h.prefill_done()
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 4 * GIB - 1240 * MIB))  # a new low, x0.997 at most
    assert a.watch.conservative is None and a.rules.cost.margin == 1.0
    h.end(Outcome.COMPLETED)


# -- the monitor in proportion ---------------------------------------------------------------------------


def test_the_allocator_s_rounding_is_no_finding() -> None:
    m = Monitor(tolerance=0.0, min_bytes=MIB)  # the outage lane's: every byte past 1 MiB counts
    assert excess(1000 * MIB + 2 * MIB, 1000 * MIB, m) is None  # one 2 MiB block for one request
    assert excess(1000 * MIB + 6 * MIB, 1000 * MIB, m, requests=3) is None
    assert excess(1000 * MIB + 7 * MIB, 1000 * MIB, m, requests=3) == pytest.approx(1.007)
    assert excess(
        1000 * MIB + 2 * MIB, 1000 * MIB, Monitor(min_bytes=0, allocator_block_bytes=0, tolerance=0)
    ) == (pytest.approx(1.002))


def test_a_small_overrun_never_makes_a_prompt_the_lane_served_unfit(clock: ManualClock) -> None:
    """Issue 29: at tolerance 0 a 0.56 % overrun raised the margin by a fixed 0.1 and the band of
    prompts just below the lane's limit became unfit_request. Now the margin follows the ratio seen
    (x 1.05), and never so far that a prompt served on this engine becomes unfit."""
    a = lane(clock)
    edge = submit(a, ask(a, 4000, request_id="edge"))  # 4,000 MiB of the 4,096 MiB the lane frees
    assert edge.admitted
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 4 * GIB - 4000 * MIB))  # as priced
    edge.prefill_done()
    edge.end(Outcome.COMPLETED)
    clock.advance(0.1)
    # A later, smaller prompt draws 3 % over its terms (beyond the allocator's block).
    r = submit(a, ask(a, 2000, request_id="r"))
    clock.advance(0.1)
    a.update_snapshot(gpu(a.snapshot, clock.t, 4 * GIB - 4000 * MIB - 60 * MIB))
    assert a.watch.underestimates == 1
    # 1.0 x 1.03 x 1.05 would make the served 4,000-token prompt unfit: held at what keeps it fit.
    assert a.rules.cost.margin == pytest.approx(4096 / 4000, rel=1e-3)
    r.end(Outcome.COMPLETED)
    d = a.evaluate(ask(a, 4000, request_id="again"))
    assert d.reason is not Reason.UNFIT_REQUEST and d.action is Action.ADMIT


# -- per-GPU idle baselines ------------------------------------------------------------------------------


def test_each_gpu_s_idle_baseline_is_measured_and_its_own_neighbour_counts(clock: ManualClock) -> None:
    """Issue 29: a 3 GiB neighbour on GPU 0 from the start and one growing 0 -> 2 GiB on GPU 1 left
    the headroom unchanged. Measured per GPU at idle, GPU 1's growth is GPU 1's."""
    a = Admission(
        small_policy(vram__headroom="idle_budget", vram__idle_free_bytes="auto", cost__fixed_bytes=0), clock
    )

    def two(other1: int) -> Snapshot:
        devices = (
            DeviceMemory("GPU-0", 10 * GIB, 80 * GIB, 3 * GIB),
            DeviceMemory("GPU-1", 10 * GIB + 3 * GIB - other1, 80 * GIB, other1),
        )
        return replace(snapshot(clock.t), gpu=GpuSignals(clock.t, "test", devices))

    a.update_snapshot(two(0))
    assert a.rules.vram.idle_free_bytes == 10 * GIB and len(a.rules.vram.idle_devices) == 2
    assert a.evaluate(ask(a, 1)).headroom_bytes == 10 * GIB
    clock.advance(1.0)
    a.update_snapshot(two(2 * GIB))  # GPU 1: 11 GiB of budget left; GPU 0 still 10
    assert a.evaluate(ask(a, 1)).headroom_bytes == 10 * GIB
    clock.advance(1.0)
    a.update_snapshot(two(4 * GIB))  # GPU 1: 9 GiB left, the tighter one
    assert a.evaluate(ask(a, 1)).headroom_bytes == 9 * GIB
    assert [d["ident"] for d in a.watch.state(clock.t)["idle_free"]["measured_devices"]] == ["GPU-0", "GPU-1"]


def test_the_engine_s_own_facts_disagreeing_are_warned_of_once_and_in_force(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    a = lane(clock)  # the policy: pool 100,000 tokens, context 100,000
    with caplog.at_level(logging.WARNING, logger="sidecar.admission.lane_watch"):
        for _ in range(3):
            clock.advance(0.5)
            a.update_snapshot(gpu(snapshot(clock.t, max_total_tokens=33_000), clock.t, 4 * GIB))
    warned = [r for r in caplog.records if getattr(r, "fields", {}).get("event") == "lane_fact_disagrees"]
    assert len(warned) == 1 and warned[0].fields["fact"] == "kv_pool_tokens"  # type: ignore[attr-defined]
    assert a.rules.lane.kv_pool_tokens == 33_000
    assert a.watch.state(clock.t)["lane_facts"]["kv_pool_tokens"]["in_force"] == 33_000
    assert rules_of(a.policy).lane.kv_pool_tokens == 100_000  # the policy's own, unchanged
    assert isinstance(a.snapshot.engine, EngineSignals)
    _ = LedgerTotals


def test_an_over_claim_within_the_tolerance_is_quiet_but_never_believed(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A policy claiming 40 MiB more idle free memory than the lane measures (below the 64 MiB the
    warning waits for): no warning, no disagreement shown, but the headroom is the measured one."""
    a = Admission(
        small_policy(
            cost__activation_bytes_per_chunk_token="1MiB",
            vram__headroom="idle_budget",
            vram__idle_free_bytes="4GiB",
        ),
        clock,
    )
    snap = gpu(snapshot(clock.t, version="0.5.23"), clock.t, 4 * GIB - 40 * MIB)
    believed = headroom_bytes(rules_of(a.policy), snap, LedgerTotals())  # the policy's figure
    with caplog.at_level(logging.WARNING, logger="sidecar.admission.lane_watch"):
        a.update_snapshot(snap)
    fact = a.watch.state(clock.t)["lane_facts"]["idle_free_bytes"]
    assert (fact["in_force"], fact["disagrees"], fact["unsafe"]) == (4 * GIB - 40 * MIB, False, False)
    assert a.rules.vram.idle_free_bytes == 4 * GIB - 40 * MIB
    assert believed - a.evaluate(ask(a, 1)).headroom_bytes == 40 * MIB
    assert not [r for r in caplog.records if getattr(r, "fields", {}).get("event") == "lane_fact_disagrees"]
