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
    assert goals["sidecar idle CPU (pollers, lag probe)"]["met"] is False
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
