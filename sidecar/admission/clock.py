"""The clock the hold queue reads and schedules its deadlines with: one object, so the two never
disagree (a deadline measured on one clock and scheduled on another fires early or late)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float: ...

    def call_at(self, when: float, fn: Callable[[], None]) -> Timer:
        """Run ``fn`` once ``now()`` has reached ``when``."""
        ...


class LoopClock:
    """Time from ``now`` (monotonic by default, or the app's injected clock); deadlines kept by the
    running asyncio loop, as a delay measured on ``now`` itself, so the loop's own time base (uvloop's
    differs from ``time.monotonic``) never mixes in."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self.now = now

    def call_at(self, when: float, fn: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(max(0.0, when - self.now()), fn)
