"""What each piece of the gated path costs in situ, by running without it (a one-off kept with its results).

Each variant replaces some of the sidecar's methods with no-ops (or runs without a decision-log writer)
in a fresh child of ``bench/gate_profile.py``'s harness (the real app, called in-process, one request
at a time, the cheapest of 6 chunks of N); variants interleaved, ``--rounds`` times; medians printed.
A variant is not a working sidecar (the watch, the progress counter are the guard's state): only its
CPU means anything. Run from the repository root:

    PYTHONPATH=$PWD .venv/bin/python bench/results/2026-12-07-issue27-deferred-line/ablate.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

W = "sidecar.admission.lane_watch:LaneWatch"
P = "sidecar.core.overrun:PrefillProgress"
R = "sidecar.core.prefill_rate:PrefillRate"
T = "sidecar.ops.telemetry:Telemetry"
VARIANTS = {
    "gated": [],
    "no lane watch": [f"{W}.charged", f"{W}.left", f"{W}.ended", f"{W}.prefilled"],
    "no prefill progress": [f"{P}.started", f"{P}.admitted", f"{P}.left"],
    "no prefill rate": [f"{R}.busy", f"{R}.prefilled"],
    "no telemetry": [f"{T}.decision", f"{T}.outcome"],
    "no decision line": ["writer"],
    "pass-through": ["pass"],
}


def _child(upstream: str, n: int, noops: list[str]) -> float:
    import gate_profile

    kind = "pass" if "pass" in noops else "gated"
    for spec in noops:
        if spec in ("pass", "writer"):
            continue
        mod, _, path = spec.partition(":")
        cls, _, attr = path.rpartition(".")
        owner = getattr(importlib.import_module(mod), cls)
        setattr(owner, attr, lambda *a, **k: None)
    if "writer" in noops:
        from sidecar.ops import telemetry

        init = telemetry.Telemetry.__init__

        def no_writer(self, *a, **k):  # type: ignore[no-untyped-def]
            init(self, *a, **k)
            self._writer = None

        telemetry.Telemetry.__init__ = no_writer  # type: ignore[method-assign]
    os.environ.setdefault("GATE_CHUNKS", "6")
    return asyncio.run(gate_profile._child(upstream, kind, n, False))["cpu_us_per_request"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=3000)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--upstream", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.upstream, args.n, VARIANTS[args.child])))
        return 0
    import gate_profile

    up, url = gate_profile.start_upstream()
    got: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for _ in range(args.rounds):
            for v in VARIANTS:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", v, "--upstream", url, "-n", str(args.n)],
                    capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                )  # fmt: skip
                got[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        up.terminate()
        up.wait(10)
    base = statistics.median(got["gated"])
    print(f"| variant (µs CPU per request, median of {args.rounds}) | µs | less than gated |")
    print("|---|---:|---:|")
    for v, xs in got.items():
        m = statistics.median(xs)
        print(f"| {v} | {m:.1f} | {base - m:.1f} |")
    print("\nraw: " + json.dumps({v: [round(x, 1) for x in xs] for v, xs in got.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
