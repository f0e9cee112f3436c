"""The least the gate's parts cost: each step of a gated request timed alone, back to back, on the real
app's objects (issue #27's "where a goal is not reachable on this stack, the profile that shows why").

``bench/gate_profile.py`` measures the gate's work in situ (a gated request less a pass-through one,
both through the real app). This script asks a narrower question: how much of that would remain if
every part ran at its best, warm, with nothing between its calls? It builds the app as
``gate_profile`` does (the overhead benchmark's policy, a decision log to ``/dev/null``, the engine
read from ``bench/upstream.py``), then times each step N times in a row with ``time.process_time``
(both threads: the writer's thread writes the lines) and keeps the cheapest of
``--repeats`` runs:

- ``parse``: the body to a ``GenerationRequest`` (``parse_generation``, orjson inside);
- ``count``: the prompt's token count where no tokenizer is needed (``PromptCounter.count_now``);
- ``demand``: its cost under the lane's model (``demand_of``: the projection, memoised by shape);
- ``decide``: the pure decision (``core.decide.decide``) on the situation of the instant;
- ``situation + decide``: what ``Admission.evaluate`` does (the situation built per decision);
- ``handle``: a whole admission's bookkeeping: open, submit (decide, charge the ledger, the monitor,
  the counters, the decision log's line queued and rendered), first byte, end (release), with the
  decision log;
- ``handle, no decision log``: the same without a decision-log writer (what the line costs);
- ``request id``, ``admit headers``: the id a request gets and the three headers an admitted answer
  carries.

The sum of these is a lower bound of the gate's work per request in CPython: each part's code and data
stay in the caches between its calls, which a real request's interleaving does not allow (the decision
line cost ~3x in situ what it cost back to back, issue #27's deferred-line write-up). A goal that needs
the gate's work below this sum cannot be met by making these parts cheaper one at a time; it needs
fewer parts or another runtime for them.

    PYTHONPATH=$PWD python bench/gate_parts.py [-n 20000] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gate_profile  # noqa: E402  (bench/ is not a package: imported from beside this file)
import host_speed  # noqa: E402


def _cheapest(step: Callable[[], Any], n: int, repeats: int) -> float:
    """µs of process CPU per call: the cheapest of ``repeats`` runs of ``n`` calls in a row."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(n):
            step()
        best = min(best, (time.process_time() - t0) / n)
    return best * 1e6


async def _measure(upstream: str, n: int, repeats: int) -> dict[str, float]:
    """Each part's cost, on an app with a decision log, then ``handle`` again on one without. Start-up
    is not frozen here (``serve`` freezes it): the collector's passes over the lines waiting for the
    writer show in ``handle``'s figure (evidence QS3 measured them)."""
    out: dict[str, float] = {}
    for with_log in (True, False):
        async with gate_profile.running_app(upstream, decision_log=with_log) as app:
            for _ in range(300):  # warm, as gate_profile does: connections, caches, the memo tables
                assert await gate_profile._one(app, "gated") == 200
            steps = _steps(app)
            if not with_log:
                steps = {"handle, no decision log": steps["handle"]}
            for name, step in steps.items():
                out[name] = _cheapest(step, n, repeats)
            assert app.admission.ledger.totals.requests == 0, "every admission was released"
            writer = app.telemetry._writer
            # Every line the steps made was rendered within their timed calls (none left for the loop).
            assert writer is None or not writer._unrendered, "decision lines left unrendered"
            assert app.telemetry.dropped_log_lines == 0, "a decision line was dropped"
    return out


def _steps(app: Any) -> dict[str, Callable[[], Any]]:
    """The parts of a gated small request, each a call on ``app``'s own objects."""
    from sidecar.core.decide import decide
    from sidecar.http import proxy as proxy_mod
    from sidecar.intake.body import parse_generation
    from sidecar.intake.demand import demand_of

    a, counter, intake = app.admission, app.counter, app.proxy._intake
    body = gate_profile.SMALL_BODY

    def parse() -> Any:
        return parse_generation(
            "/generate", body, None, max_body_bytes=intake.max_body_bytes, accept_emulator=False,
            priority=intake.bounds, shape=None,
        )  # fmt: skip

    req = parse()
    count = counter.count_now(req, admits=None)
    assert count is not None, "the bench policy counts without a tokenizer"
    demand = demand_of(a.rules, a.snapshot, req, count, now=a.clock.now(), request_id="r")
    situation = a.situation()

    writer = app.telemetry._writer  # None: no decision log

    def handle() -> None:
        with a.open() as h:
            h.submit(demand, lambda h: None)
            h.prefill_done(False)
            h.relayed()
        if writer is not None:
            # The loop renders a turn's lines after the turn; this loop gives it none: render the line
            # here, so that it is in the figure (back to back, as every part here) and none waits.
            writer.render_waiting()

    return {
        "parse": parse,
        "count": lambda: counter.count_now(req, admits=None),
        "demand": lambda: demand_of(a.rules, a.snapshot, req, count, now=a.clock.now(), request_id="r"),
        "decide": lambda: decide(demand, situation),
        "situation + decide": lambda: decide(demand, a.situation()),
        "handle": handle,
        "request id": proxy_mod.new_request_id,
        "admit headers": lambda: [
            (b"x-request-id", b"0123456789abcdef0123456789abcdef"),
            proxy_mod._ADMITTED,
            proxy_mod._wait_header(0.0),
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=20_000, help="calls per run of a step")
    ap.add_argument("--repeats", type=int, default=5, help="runs per step (the cheapest is kept)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    speed = host_speed.probe()
    up, url = gate_profile.start_upstream()
    try:
        parts = asyncio.run(_measure(url, args.n, args.repeats))
    finally:
        up.terminate()
        up.wait(10)
    speed_end = host_speed.probe()
    whole = [k for k in parts if k not in ("decide", "situation + decide", "handle, no decision log")]
    rows = [(k, parts[k]) for k in parts]
    print(f"the gate's parts alone, back to back (µs CPU per call, cheapest of {args.repeats} x {args.n});"
          f" {host_speed.interpreter()}, {os.cpu_count()} cores")  # fmt: skip
    for k, v in rows:
        print(f"  {k:<28} {v:7.2f}")
    # ``handle`` holds the decision (situation + decide); the pieces outside it are summed with it.
    total = sum(parts[k] for k in whole)
    print(
        f"  {'sum (parse .. admit headers)':<28} {total:7.2f}   a lower bound of the gate's work per request"
    )
    print(
        f"  {'the decision log line':<28} {parts['handle'] - parts['handle, no decision log']:7.2f}"
        "   handle less handle without a writer"
    )
    print(f"host speed probe: {speed:.3f} s at the start, {speed_end:.3f} s at the end")
    if args.json:
        args.json.write_text(
            json.dumps({"parts_us": parts, "sum_us": total, "host_speed": [speed, speed_end]})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
