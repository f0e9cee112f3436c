"""An event-loop lag probe for an ASGI app, for the benchmarks only (the sidecar's and the floor's).

A task sleeps 1 ms in a loop and records how late it wakes, i.e. how long the loop was blocked, and how
much CPU the loop's thread spent in that tick (``busy_*``: the stall's own work, apart from time the
thread was off the CPU: on a shared machine most of the wall-clock lag is the scheduler's); a
``gc.callbacks`` hook records the garbage collector's pauses (a collection holds the GIL: a stall as long
as one of them is the collector's). ``GET /__bench/lag`` returns the figures since the last read and
resets them, so a stall can be attributed to the shape that ran; ``?probe=off`` stops the ticking after
the read and ``?probe=on`` (re)starts it, so a probe that is only wanted for one phase costs nothing in
the others (``bench/overhead.py`` probes the floor in the paced phase only).

``BENCH_STALL_STACKS=MS`` (diagnosis, not for figures: it perturbs them): a watchdog thread samples the
loop thread's stack every ~0.5 ms while the probe's tick is more than MS late, and the read returns the
longest stalls with where the loop was in them (``stalls``): what a stall is made of, without a
profiler that cannot see inside uvloop's callbacks.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import os
import sys
import threading
import time
import traceback
from typing import Any

TICK_S = 0.001
HEAVY_S = 0.002  # a tick with more loop CPU than this is kept, with its collections, for the read
# The frames that say whose work a sample is: the innermost of these files (the rest is the stdlib's).
OWN = (
    "/sidecar/",
    "/uvicorn/",
    "/httpx/",
    "/httpcore/",
    "/h11/",
    "/prometheus_client/",
    "/bench/",
    "/aiohttp/",
)


class LagProbe:
    def __init__(self, frozen: int = 0) -> None:
        self.lags: list[float] = []
        # The loop thread's own CPU in each late tick: the work the loop did while the timer waited,
        # apart from time the thread was off the CPU (another process ran, or it waited for the GIL).
        # On a shared machine the wall-clock lag is mostly the scheduler's; this one is the loop's.
        self.busy: list[float] = []
        # The garbage collector's pauses (any thread's; a collection holds the GIL, so it stalls the loop
        # too): a stall as long as one of them is the collector's, not the request path's.
        self.gc_pauses: list[tuple[int, float]] = []
        self._gc_started = 0.0
        self._gc_log: list[tuple[float, int, float]] = []  # (ended at, generation, s) since the last read
        # The ticks whose loop CPU was over 2 ms: (CPU s, lag s, ended at), to match with the collector's.
        self.heavy: list[tuple[float, float, float]] = []
        # The tick in flight while ``take`` ran is the probe's own (sorting the last phase's samples:
        # ~30 ms after a saturation phase's ~56,000 on 2 cores), not the app's: dropped, so it does
        # not land in the next phase's figures as their longest "stall".
        self._drop_next = False
        self.frozen = frozen  # objects start-up moved out of the collector's sight (counted once)
        self.task: asyncio.Task[None] | None = None
        self.last_tick = time.perf_counter()
        self.stall_ms = float(os.environ.get("BENCH_STALL_STACKS", "0") or 0)
        self.stalls: list[dict[str, Any]] = []
        self._watcher: int | None = None
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            now = time.perf_counter()
            self.gc_pauses.append((info["generation"], now - self._gc_started))
            self._gc_log.append((now, info["generation"], now - self._gc_started))

    def start(self) -> None:
        if self.task is None or self.task.done():
            self.lags = []
            self.task = asyncio.get_running_loop().create_task(self.run())
            if self.stall_ms and self._watcher is None:
                tid = threading.get_ident()
                self._watcher = tid
                threading.Thread(target=self._watch, args=(tid,), daemon=True, name="bench-stalls").start()

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None

    async def run(self) -> None:
        # perf_counter, not loop.time(): uvloop's clock is libuv's, cached per iteration in whole
        # milliseconds, which rounds every lag to a multiple of 1 ms (a 4.2 ms stall read as 5.00).
        clock, cpu = time.perf_counter, time.thread_time
        while True:
            t0, c0 = clock(), cpu()
            self.last_tick = t0
            await asyncio.sleep(TICK_S)
            t1, used = clock(), cpu() - c0
            if self._drop_next:
                self._drop_next = False
                continue
            self.lags.append(t1 - t0 - TICK_S)
            self.busy.append(used)
            if used > HEAVY_S:
                self.heavy.append((used, t1 - t0 - TICK_S, t1))

    def _watch(self, loop_tid: int) -> None:
        """Sample the loop thread's stack while its tick is late (``BENCH_STALL_STACKS``)."""
        late_s = self.stall_ms / 1000
        current: dict[str, Any] | None = None
        while True:
            time.sleep(0.0005)
            if self.task is None:
                current = None
                continue
            now = time.perf_counter()
            behind = now - self.last_tick - TICK_S
            if current is not None and current["tick"] != self.last_tick:
                self.stalls.append(current)
                current = None
            if behind < late_s:
                continue
            frame = sys._current_frames().get(loop_tid)
            if frame is None:
                continue
            if current is None:
                current = {"tick": self.last_tick, "at": self.last_tick, "samples": collections.Counter()}
            current["samples"][_where(frame)] += 1
            current["ms"] = 1000 * behind

    def take(self) -> dict[str, Any]:
        self._drop_next = True
        lags, self.lags = sorted(self.lags), []
        busy, self.busy = sorted(self.busy), []
        pauses, self.gc_pauses = self.gc_pauses, []
        stalls, self.stalls = self.stalls, []
        heavy, self.heavy = sorted(self.heavy, reverse=True), []
        gc_log, self._gc_log = self._gc_log, []
        if not lags:
            return {"samples": 0}
        out = {
            "samples": len(lags),
            "max_ms": 1000 * lags[-1],
            "p99_ms": 1000 * lags[int(0.99 * (len(lags) - 1))],
            "over_5ms": sum(1 for v in lags if v > 0.005),
            # The loop thread's CPU within one tick (the stall's own work, scheduler noise excluded).
            "busy_max_ms": 1000 * busy[-1] if busy else None,
            "busy_p99_ms": 1000 * busy[int(0.99 * (len(busy) - 1))] if busy else None,
            "busy_over_5ms": sum(1 for v in busy if v > 0.005),
            # The heaviest ticks, each with the collections that ended inside it: a stall that is
            # the collector's says so (generation, ms).
            "busy_top": [
                {
                    "cpu_ms": round(1000 * used, 2),
                    "lag_ms": round(1000 * late, 2),
                    "gc": [
                        (g, round(1000 * d, 2)) for at, g, d in gc_log if end - late - TICK_S <= at <= end
                    ],
                }
                for used, late, end in heavy[:8]
            ],
            "gc_collections": len(pauses),
            "gc_full_collections": sum(1 for g, _ in pauses if g == 2),
            "gc_max_ms": 1000 * max((d for _, d in pauses), default=0.0),
            "gc_frozen": self.frozen,
            # ``cli._prefer_the_loop``: how soon the loop's thread gets the GIL back from a poller's.
            "switch_interval_s": sys.getswitchinterval(),
        }
        if self.stall_ms:
            stalls.sort(key=lambda s: -s.get("ms", 0))
            out["stalls"] = [
                {"ms": round(s.get("ms", 0), 2), "where": s["samples"].most_common(8)} for s in stalls[:40]
            ]
        return out


def _where(frame: Any) -> str:
    """The innermost two frames of the loop thread's stack that are not the stdlib's, as file:function."""
    own = []
    for fs in reversed(traceback.extract_stack(frame, limit=40)):
        if any(o in fs.filename for o in OWN):
            own.append(f"{fs.filename.rsplit('/', 2)[-2]}/{fs.filename.rsplit('/', 1)[-1]}:{fs.name}")
            if len(own) == 4:
                break
    leaf = traceback.extract_stack(frame, limit=1)
    inner = f"{leaf[-1].filename.rsplit('/', 1)[-1]}:{leaf[-1].name}" if leaf else "?"
    return " < ".join([inner, *own])


def probed(app: Any, probe: LagProbe | None = None, *, run_at_start: bool = True) -> Any:
    """``app`` with ``GET /__bench/lag`` answered by the probe, which starts ticking at lifespan
    start-up (``run_at_start``) or at the first ``?probe=on``."""
    probe = probe or LagProbe()

    async def wrapper(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan" and run_at_start:
            probe.start()
        if scope["type"] == "http" and scope["path"] == "/__bench/lag":
            query = scope.get("query_string", b"")
            body = json.dumps(probe.take()).encode()
            if query == b"probe=on":
                probe.start()
            elif query == b"probe=off":
                probe.stop()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})  # fmt: skip
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)

    if hasattr(app, "admission"):
        wrapper.admission = app.admission  # type: ignore[attr-defined]  # the CLI's drain hook looks for it
    return wrapper
