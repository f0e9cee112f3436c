"""bench/overhead.py's issue #27 table reads the right rows: each figure from its shape and path, its goal
met or not by the number, the sidecar's own floor preferred over the aiohttp one, and the hold-queue
figures taken from ``bench/hold_queue.py`` when it is there (its failure a row, not a lost run)."""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import overhead  # noqa: E402


def _rows() -> list[dict]:
    row = overhead.row
    return [
        row("nginx", "saturation", "small", 64, cpu_s_per_1000_requests=0.020, ttfb_p99_ms=1.7),
        row("sidecar", "saturation", "small", 64, cpu_s_per_1000_requests=0.300, ttfb_p99_ms=40.0),
        row("floor", "saturation", "small", 64, cpu_s_per_1000_requests=0.180),
        row("floor-uvicorn", "saturation", "small", 64, cpu_s_per_1000_requests=0.100),
        row("nginx", "saturation", "small-passthrough", 64, cpu_s_per_1000_requests=0.020),
        row("sidecar", "saturation", "small-passthrough", 64, cpu_s_per_1000_requests=0.070),
        row("nginx", "saturation", "sse", 64, cpu_s_per_1000_events=0.001),
        row("sidecar", "saturation", "sse", 64, cpu_s_per_1000_events=0.0025),
        row("sidecar", "paced", "sse", 64, added_ttfb_p50_ms=1.5, added_ttfb_p99_ms=9.0),
        row("floor-uvicorn", "paced", "sse", 64, added_ttfb_p50_ms=1.0, added_ttfb_p99_ms=4.0),
        row("sidecar", "paced", "sse-staggered", 64, added_ttfb_p50_ms=0.5, added_ttfb_p99_ms=0.9),
    ]


def _by_figure(goals: list[dict]) -> dict[str, dict]:
    return {g["figure"].strip(): g for g in goals}


def test_every_figure_of_the_issue_is_read_from_its_row_with_its_goal() -> None:
    lags = {"paced": {"max_ms": 7.0}}
    goals = _by_figure(overhead.issue27(_rows(), lags, {"sidecar": 12.0}, {"p50_us": 14.0}, []))
    gated = goals["CPU per gated small request / floor"]
    assert gated["value"] == pytest.approx(3.0) and gated["met"] is False  # 300 us / floor-uvicorn's 100
    assert "floor-uvicorn" in gated["note"]
    assert goals["(gated small / floor)"]["value"] == pytest.approx(300 / 180)
    assert goals["CPU per pass-through request / nginx"]["value"] == pytest.approx(3.5)
    assert goals["CPU per pass-through request / nginx"]["met"] is True
    assert goals["gate work per request (gated - pass-through)"]["value"] == pytest.approx(230)
    assert goals["64 streams at once: added TTFB p50"]["met"] is True
    assert goals["64 streams at once: added TTFB p99"]["met"] is False
    assert goals["(the floor under the same bursts: p50)"]["value"] == 1.0
    assert goals["SSE CPU per event / nginx"]["value"] == pytest.approx(2.5)
    assert goals["event-loop stall while signals poll, paced"]["met"] is False
    assert goals["sidecar idle CPU (pollers; the bench's lag probe off)"]["met"] is False
    assert goals["saturation, gated small: p99 TTFB"]["value"] == 40.0
    assert goals["saturation, gated small: p99 TTFB"]["met"] is None  # no number to meet: an operator's limit
    assert "not run" in goals["10,000 arriving clients: answered"]["note"]


def test_the_hold_queue_bench_supplies_its_rows_and_a_failure_is_a_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = argparse.Namespace(quick=True)
    row = {
        "figure": "10,000 arriving clients: answered",
        "value": 1.0,
        "limit": None,
        "unit": "",
        "met": True,
    }
    fake = types.ModuleType("hold_queue")
    fake.issue27_figures = lambda quick: [row]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hold_queue", fake)
    monkeypatch.setattr(overhead.Path, "exists", lambda self: True)
    assert overhead.hold_queue_figures(args) == [row]

    def broken(quick: bool) -> list[dict]:
        raise RuntimeError("no engine")

    fake.issue27_figures = broken  # type: ignore[attr-defined]
    (failed,) = overhead.hold_queue_figures(args)
    assert failed["met"] is None and "RuntimeError: no engine" in failed["note"]


def test_the_hold_queue_bench_s_own_figures_become_the_issue_s_rows() -> None:
    res = {
        "args": {"held": 2000, "arrivals": 10_000, "in_flight": 4},
        "held_reached": 2000,
        "admissions_per_s": 1046.0,
        "healthz_p99_ms": 9.1,
        "arrivals_answered": 9_999,
        "arrivals_statuses": {"503": 5_904, "200": 4_095, "none": 1},
    }
    rate, health, answered = overhead.hold_queue_rows(res)
    assert rate["value"] == 1046.0 and rate["met"] is True
    assert health["value"] == 9.1 and health["met"] is True
    assert answered["value"] == 9_999 and answered["met"] is False  # one client got no answer


def test_each_figure_has_the_floor_s_beside_it_and_says_whether_the_floor_alone_meets_the_goal() -> None:
    """Issue #27's acceptance: where a goal is beyond the stack, the figure that is: the sidecar's own
    floor (uvicorn + its client, no gate) measured in the same run, from the floor's own rows."""
    row = overhead.row
    rows = [
        *_rows(),
        row("floor-uvicorn", "saturation", "small-passthrough", 64, cpu_s_per_1000_requests=0.090),
        row(
            "floor-uvicorn",
            "saturation",
            "sse",
            64,
            cpu_s_per_1000_events=0.0015,
            cpu_s_per_1000_requests=0.150,
        ),
        row("floor-uvicorn", "saturation", "sse-long", 64, cpu_s_per_1000_requests=0.600),
        row("sidecar", "saturation", "sse-long", 64, cpu_s_per_1000_requests=0.700),
        row("floor-uvicorn", "paced", "sse-staggered", 64, added_ttfb_p50_ms=0.2, added_ttfb_p99_ms=0.4),
    ]
    rows[7]["cpu_s_per_1000_requests"] = 0.250  # the sidecar's 100-event SSE request
    lags = {"paced": {"max_ms": 9.0, "busy_max_ms": 6.0}, "idle": {"max_ms": 0.4, "busy_max_ms": 0.5}}
    floor_lags = {"paced": {"samples": 100, "max_ms": 6.5, "p99_ms": 1.0, "over_5ms": 1, "busy_max_ms": 3.0}}
    goals = _by_figure(
        overhead.issue27(rows, lags, {"sidecar": 12.0, "floor-uvicorn": 0.0}, None, [], floor_lags)
    )
    passthrough = goals["CPU per pass-through request / nginx"]
    assert passthrough["floor"] == pytest.approx(4.5) and passthrough["floor_met"] is False  # 90 / 20 us
    assert goals["gate work per request (gated - pass-through)"]["floor"] == pytest.approx(10)  # 100 - 90 us
    burst = goals["64 streams at once: added TTFB p99"]
    assert (burst["value"], burst["floor"], burst["floor_met"]) == (9.0, 4.0, True)
    assert goals["staggered starts: added TTFB p50"]["floor"] == 0.2
    sse = goals["SSE CPU per event / nginx"]
    assert sse["floor"] == pytest.approx(1.5) and sse["floor_met"] is True
    stall = goals["event-loop stall while signals poll, paced"]
    assert (stall["value"], stall["floor"], stall["floor_met"]) == (9.0, 6.5, False)
    assert "6.00 ms paced" in stall["note"] and "3.00" in stall["floor_note"]
    # The relay per event apart from each request's own work: 100 vs 400 events (250 -> 700 us; 150 -> 600).
    slope = goals["SSE relay alone: CPU per event (slope)"]
    assert slope["value"] == pytest.approx(1.5) and slope["floor"] == pytest.approx(1.5)
    intercept = goals["SSE request apart from its events (intercept)"]
    assert intercept["value"] == pytest.approx(100) and intercept["floor"] == pytest.approx(0)
    assert (
        goals["CPU per gated small request / floor"]["floor"] is None
    )  # the floor is what it is measured by


def test_a_saturation_row_keeps_its_cheapest_round_with_the_spread_and_every_round() -> None:
    """Noise only adds CPU: the row is the round that cost least, and says how far the rounds were apart."""
    rounds = [
        {"cpu_s_per_1000_requests": 0.30, "requests_per_s": 3000.0, "errors": 2},
        {"cpu_s_per_1000_requests": 0.20, "requests_per_s": 4500.0, "errors": 0},
        {"cpu_s_per_1000_requests": 0.25, "requests_per_s": 3900.0, "errors": 0},
    ]
    r = overhead._saturation_row("sidecar", "small", rounds)
    assert (r["path"], r["load"], r["kind"]) == ("sidecar", "saturation", "small")
    assert r["cpu_s_per_1000_requests"] == 0.20
    assert r["requests_per_s"] == 4500.0  # the cheapest round's own figures, not a mix of rounds
    assert r["errors"] == 0
    assert r["errors_all_rounds"] == 2
    assert overhead._errors(r) == 2  # the table's err column: a round that failed is not hidden
    assert r["rounds"] == 3
    assert r["cpu_spread"] == pytest.approx(1.5)
    assert r["cpu_s_per_1000_requests_rounds"] == [0.30, 0.20, 0.25]


def test_rounds_below_one_are_refused_with_the_flag_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        overhead.main(["--rounds", "0"])
    assert "--rounds must be 1 or more, got 0" in capsys.readouterr().err


def test_a_misspelt_server_is_refused_with_the_names_there_are(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        overhead.main(["--servers", "sidecar,ngnix", "--floors", "uvicorn"])
    err = capsys.readouterr().err
    assert "--servers: no server named ngnix" in err
    assert "direct, nginx, sidecar, floor, floor-uvicorn" in err


def test_a_misspelt_shape_is_refused_with_the_names_there_are(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        overhead.main(["--shapes", "small,smal", "--floors", "uvicorn"])
    err = capsys.readouterr().err
    assert "--shapes: no shape named smal" in err
    assert "small, small-passthrough, sse, sse-long" in err


def test_saturation_measures_only_the_shapes_asked_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--shapes``: the other shapes get no wrk run and no row."""
    import argparse

    runs: list[str] = []

    def wrk(args, cores, url, script, seconds):  # type: ignore[no-untyped-def]
        runs.append(url)
        return {"duration_us": 1e6, "requests": 10, "p50_us": 1, "p99_us": 2, "errors": 0, "status_errors": 0}

    monkeypatch.setattr(overhead, "wrk", wrk)
    monkeypatch.setattr(overhead, "cpu_seconds", lambda pid: 0.0)
    args = argparse.Namespace(rounds=1, servers=[], shapes=["small-passthrough"], seconds=1.0)
    srv = {"sidecar": overhead.Server("sidecar", "http://s", proc=types.SimpleNamespace(pid=1))}  # type: ignore[arg-type]
    rows = overhead.saturation(args, None, srv, tmp_path)  # type: ignore[arg-type]
    assert {(r["path"], r["kind"]) for r in rows} == {("sidecar", "small-passthrough")}
    assert runs and all(u.endswith("/v1/models") for u in runs)
