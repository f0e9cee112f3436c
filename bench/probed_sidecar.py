"""``sglang-sidecar serve`` with an event-loop lag probe, for the overhead benchmark only.

Runs the real CLI (same policy, same pollers, same uvicorn settings) and wraps the ASGI app it builds:
a task sleeps 1 ms in a loop and records how late it wakes, i.e. how long the loop was blocked, and a
``gc.callbacks`` hook records the garbage collector's pauses (a collection holds the GIL: a stall as long
as one of them is the collector's). The benchmark reads and resets the figures at ``GET /__bench/lag``
between phases, so a stall can be attributed to the shape that ran (the target: none over 5 ms while
the signals are polled).

    python bench/probed_sidecar.py serve --upstream ... (the arguments of ``sglang-sidecar serve``)
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
from typing import Any

import sidecar.cli

TICK_S = 0.001
# Counted once, right after start-up froze them: ``gc.get_freeze_count()`` walks the whole permanent
# generation (~95,000 objects, ~10 ms), so calling it in ``take`` stalled the loop once per read, and
# that stall landed in the next phase's figures (every phase showed one 10 ms "stall": the probe's own).
FROZEN = [0]


class LagProbe:
    def __init__(self) -> None:
        self.lags: list[float] = []
        # The garbage collector's pauses (any thread's; a collection holds the GIL, so it stalls the loop
        # too): a stall as long as one of them is the collector's, not the request path's.
        self.gc_pauses: list[tuple[int, float]] = []
        self._gc_started = 0.0
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_pauses.append((info["generation"], time.perf_counter() - self._gc_started))

    async def run(self) -> None:
        # perf_counter, not loop.time(): uvloop's clock is libuv's, cached per iteration in whole
        # milliseconds, which rounds every lag to a multiple of 1 ms (a 4.2 ms stall read as 5.00).
        clock = time.perf_counter
        while True:
            t0 = clock()
            await asyncio.sleep(TICK_S)
            self.lags.append(clock() - t0 - TICK_S)

    def take(self) -> dict[str, Any]:
        lags, self.lags = sorted(self.lags), []
        pauses, self.gc_pauses = self.gc_pauses, []
        if not lags:
            return {"samples": 0}
        return {
            "samples": len(lags),
            "max_ms": 1000 * lags[-1],
            "p99_ms": 1000 * lags[int(0.99 * (len(lags) - 1))],
            "over_5ms": sum(1 for v in lags if v > 0.005),
            "gc_collections": len(pauses),
            "gc_full_collections": sum(1 for g, _ in pauses if g == 2),
            "gc_max_ms": 1000 * max((d for _, d in pauses), default=0.0),
            # Objects start-up moved out of the collector's sight (``cli._freeze_startup_objects``).
            "gc_frozen": FROZEN[0],
            # ``cli._prefer_the_loop``: how soon the loop's thread gets the GIL back from a poller's.
            "switch_interval_s": sys.getswitchinterval(),
        }


def probed(app: Any) -> Any:
    probe = LagProbe()
    tasks: list[asyncio.Task[None]] = []

    async def wrapper(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan" and not tasks:
            tasks.append(asyncio.create_task(probe.run()))
        if scope["type"] == "http" and scope["path"] == "/__bench/lag":
            body = json.dumps(probe.take()).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)

    wrapper.admission = app.admission  # type: ignore[attr-defined]  # the CLI's drain hook looks for it
    return wrapper


def main() -> int:
    run = sidecar.cli.run_uvicorn
    freeze = sidecar.cli._freeze_startup_objects

    def freeze_and_count() -> None:
        freeze()
        FROZEN[0] = gc.get_freeze_count()

    sidecar.cli._freeze_startup_objects = freeze_and_count  # type: ignore[assignment]
    sidecar.cli.run_uvicorn = lambda app, *a, **kw: run(probed(app), *a, **kw)  # type: ignore[assignment]
    return sidecar.cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
