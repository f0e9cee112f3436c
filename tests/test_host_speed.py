"""bench/host_speed.py: the benchmarks' reading of how fast the host runs a fixed loop, so that a table
taken while a shared host slowed down says so beside its figures."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import host_speed  # noqa: E402


def test_a_host_that_slowed_during_the_run_is_named_in_the_line() -> None:
    # The lent host of 2026-12-07 09:53 UTC: 0.127 s at the start, 0.271 s at the end.
    readings = [("start", 0.127), ("round 1", 0.130), ("end", 0.271)]
    line = host_speed.summary(readings)
    assert "start 0.127, round 1 0.130, end 0.271" in line
    assert "spread 2.13x" in line and "THE HOST CHANGED SPEED" in line


def test_a_steady_host_is_said_steady_up_to_the_bound() -> None:
    at_bound = [("start", 0.100), ("end", 0.100 * host_speed.STEADY_SPREAD)]
    assert host_speed.summary(at_bound).endswith("steady")
    past = [("start", 0.100), ("end", 0.100 * host_speed.STEADY_SPREAD + 0.001)]
    assert "CHANGED SPEED" in host_speed.summary(past)


def test_one_reading_has_no_spread_and_none_says_so() -> None:
    assert host_speed.spread([("start", 0.1)]) is None
    assert host_speed.spread([("start", 0.0), ("end", 0.1)]) is None
    assert host_speed.summary([("start", 0.1)]).endswith("start 0.100")
    assert host_speed.summary([]) == "host speed probe: not taken"


def test_readings_are_taken_and_kept_for_the_json(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(host_speed, "PROBE_N", 1000)  # the real workload, smaller
    r = host_speed.Readings()
    first = r.take("start")
    r.take("end")
    assert first > 0
    doc = r.as_json()
    assert list(doc["seconds"]) == ["start", "end"] and doc["spread"] >= 1.0
    assert r.line().startswith("host speed probe (CPU s of a fixed Python loop): start ")


def test_the_goals_table_opens_with_the_warning_only_when_the_host_changed_speed(capsys) -> None:  # type: ignore[no-untyped-def]
    """A reader of issue 27's table sees under its heading, before any verdict, that the host changed
    speed (bench/overhead.py prints ``host_speed.warning`` there); a steady host adds no line."""
    import overhead

    goal = {"figure": "gate work per request", "value": 96.6, "unit": "us", "limit": 60, "met": False,
            "note": "", "floor": None}  # fmt: skip
    unsteady = [("start", 0.135), ("end", 0.261)]
    assert host_speed.warning([("start", 0.13), ("end", 0.14)]) is None
    assert host_speed.warning([("start", 0.13)]) is None
    overhead.print_issue27([goal], host_speed.warning(unsteady))
    lines = capsys.readouterr().out.splitlines()
    heading = next(i for i, ln in enumerate(lines) if ln.startswith("issue #27"))
    assert "host changed speed" in lines[heading + 1] and "1.93x" in lines[heading + 1]
    assert "NOT MET" in lines[heading + 2]
    overhead.print_issue27([goal], host_speed.warning([("start", 0.13), ("end", 0.14)]))
    lines = capsys.readouterr().out.splitlines()
    heading = next(i for i, ln in enumerate(lines) if ln.startswith("issue #27"))
    assert "NOT MET" in lines[heading + 1]


def test_the_interpreter_is_named_with_how_libpython_is_linked(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A table says which CPython ran it: a request's CPU moves 5-18 µs between builds of 3.11 (evidence
    QW2-QW3). Whether libpython is a shared library is read from the process's own mappings."""
    import platform

    shared = tmp_path / "maps-shared"
    shared.write_text("7f00-7f01 r-xp 00000000 08:01 42 /usr/local/lib/libpython3.12.so.1.0\n")
    linked = tmp_path / "maps-linked"
    linked.write_text("5500-5501 r-xp 00000000 08:01 43 /usr/bin/python3.12\n")
    monkeypatch.setattr(
        host_speed.sysconfig, "get_config_var", lambda name: "'--enable-shared' '--enable-optimizations'"
    )
    v = platform.python_version()
    assert host_speed.interpreter(shared) == f"CPython {v} (libpython shared, --enable-optimizations)"
    monkeypatch.setattr(host_speed.sysconfig, "get_config_var", lambda name: None)
    assert host_speed.interpreter(linked) == f"CPython {v} (libpython linked in, no --enable-optimizations)"
    assert (
        host_speed.interpreter(tmp_path / "absent") == f"CPython {v} (libpython ?, no --enable-optimizations)"
    )


def test_this_process_is_named_from_its_own_mappings() -> None:
    """The default reads /proc/self/maps of the process running the suite: on Linux it knows whether
    libpython is mapped (never "?"), and says so the way the mappings do."""
    if not Path("/proc/self/maps").exists():
        return
    mapped = "libpython" in Path("/proc/self/maps").read_text()
    name = host_speed.interpreter()
    assert ("(libpython shared," if mapped else "(libpython linked in,") in name
