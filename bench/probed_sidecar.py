"""``sglang-sidecar serve`` with an event-loop lag probe, for the overhead benchmark only.

Runs the real CLI (same policy, same pollers, same uvicorn settings) and wraps the ASGI app it builds:
a task sleeps 1 ms in a loop and records how late it wakes, i.e. how long the loop was blocked. The
benchmark reads and resets the figures at ``GET /__bench/lag`` between phases, so a stall can be
attributed to the shape that ran (the target: none over 5 ms while the signals are polled).

    python bench/probed_sidecar.py serve --upstream ... (the arguments of ``sglang-sidecar serve``)
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import sidecar.cli

TICK_S = 0.001


class LagProbe:
    def __init__(self) -> None:
        self.lags: list[float] = []

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(TICK_S)
            self.lags.append(loop.time() - t0 - TICK_S)

    def take(self) -> dict[str, Any]:
        lags, self.lags = sorted(self.lags), []
        if not lags:
            return {"samples": 0}
        return {
            "samples": len(lags),
            "max_ms": 1000 * lags[-1],
            "p99_ms": 1000 * lags[int(0.99 * (len(lags) - 1))],
            "over_5ms": sum(1 for v in lags if v > 0.005),
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
    sidecar.cli.run_uvicorn = lambda app, *a, **kw: run(probed(app), *a, **kw)  # type: ignore[assignment]
    return sidecar.cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
