"""How fast the host runs a fixed piece of Python now: to tell a slow host from a slow tree.

A lent host is a virtual machine on a shared box. Its load average says nothing of its neighbours, yet
on 2026-12-07 four such hosts ran everything 1.1-1.9x dearer than a quiet one had that morning, and
one slowed twofold within one run (``bench/results/2026-12-07-issue27-deferred-line.md``). A CPU
figure from a stretch the host ran slowly is not comparable with one from a stretch it did not. The
benchmarks time the same work (a generator sum: 0.12-0.13 s of one core on those hosts and on the
2-core development machine at their quickest) at the
start, between rounds and at the end, and print the readings' spread beside their tables.
"""

from __future__ import annotations

import platform
import sysconfig
import time
from pathlib import Path
from typing import Any

# The workload: pure-Python integer arithmetic and a generator, no allocation that grows, no I/O.
PROBE_N = 3_000_000
# A spread (slowest / fastest reading) past this, and the readings are reported as a host that
# changed speed during the run: its figures are then comparable only within one stretch. Between what
# was seen steady (the 2-core machine's runs, 1.06-1.11x) and what was seen not (the lent hosts of
# 2026-12-07 09:53-10:17 UTC, 1.59-2.13x); a bound for reading a table, not a measured threshold.
STEADY_SPREAD = 1.2


def probe() -> float:
    """CPU seconds (this process) of the fixed workload; the least of two tries (a preemption or a page
    fault only adds)."""
    best = float("inf")
    for _ in range(2):
        t0 = time.process_time()
        sum(i * i for i in range(PROBE_N))
        best = min(best, time.process_time() - t0)
    return best


class Readings:
    """The probe's readings over a run, by label (``start``, ``round 1``, ``end``...)."""

    def __init__(self) -> None:
        self.readings: list[tuple[str, float]] = []

    def take(self, label: str) -> float:
        s = probe()
        self.readings.append((label, s))
        return s

    def as_json(self) -> dict[str, Any]:
        return {"seconds": dict(self.readings), "spread": spread(self.readings)}

    def line(self) -> str:
        return summary(self.readings)

    def warning(self) -> str | None:
        return warning(self.readings)


def spread(readings: list[tuple[str, float]]) -> float | None:
    """Slowest / fastest reading (None with fewer than two, or a zero)."""
    values = [s for _, s in readings]
    if len(values) < 2 or min(values) <= 0:
        return None
    return max(values) / min(values)


def warning(readings: list[tuple[str, float]]) -> str | None:
    """One line for the top of a table of goals when the host changed speed (else None): its verdicts
    then come from stretches the host ran at different speeds."""
    sp = spread(readings)
    if sp is None or sp <= STEADY_SPREAD:
        return None
    return (
        f"! the host changed speed during this run (a fixed loop's spread {sp:.2f}x, bench/host_speed.py): "
        "judge no goal by this table"
    )


def summary(readings: list[tuple[str, float]]) -> str:
    """One line: every reading, the spread, and what it means for the figures beside it."""
    if not readings:
        return "host speed probe: not taken"
    each = ", ".join(f"{label} {s:.3f}" for label, s in readings)
    head = f"host speed probe (CPU s of a fixed Python loop): {each}"
    sp = spread(readings)
    if sp is None:
        return head
    if sp > STEADY_SPREAD:
        return (
            f"{head}; spread {sp:.2f}x: THE HOST CHANGED SPEED during the run, so its figures are "
            "comparable only within one stretch: run again for a table to judge goals by"
        )
    return f"{head}; spread {sp:.2f}x: steady"


def interpreter(maps: Path = Path("/proc/self/maps")) -> str:
    """Which CPython runs the benchmark, as far as this process can tell: its version; whether libpython is
    a shared library mapped into it; whether configure was given ``--enable-optimizations`` (PGO). A
    request's CPU, gated or not, moves by 5-18 µs between two builds of 3.11 and the gate's work by ~10 µs
    between 3.11 and 3.14 (evidence QW2-QW3), and probe readings (``probe``) compare only under one
    interpreter, so a table names its interpreter. The mappings, not ``Py_ENABLE_SHARED``: Debian's
    ``/usr/bin/python3`` reports 1 there (it builds the shared library too) yet has libpython linked in. A
    distribution's PGO build (Debian's, Ubuntu's) does not pass the flag and reads "no
    --enable-optimizations"; ``maps`` missing (not Linux): "libpython ?"."""
    config = str(sysconfig.get_config_var("CONFIG_ARGS") or "")
    try:
        shared = "libpython" in maps.read_text()
    except OSError:
        linked = "libpython ?"
    else:
        linked = "libpython shared" if shared else "libpython linked in"
    pgo = "--enable-optimizations" if "--enable-optimizations" in config else "no --enable-optimizations"
    return f"{platform.python_implementation()} {platform.python_version()} ({linked}, {pgo})"
