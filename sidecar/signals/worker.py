"""The signal pollers' own worker threads, so no request can queue ahead of a poll.

``asyncio.to_thread`` runs on the loop's default executor (``min(32, cores + 4)`` threads), which the
request path also uses: a multi-MB body is parsed there, a long prompt tokenized there (up to about a
second each for a 500K-token prompt). A burst of such requests fills every thread, and a ``/metrics``
page, an NVML read or a GPU file read queued behind them waits until the burst is through: the gate
then decides on signals that grow stale for exactly as long as the load is highest (issue #12). The
pollers' blocking work runs here instead, on two threads nothing else submits to (the engine scraper
and the GPU poller each use at most one at a time).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["THREAD_NAME_PREFIX", "run_in_signal_thread"]

T = TypeVar("T")
THREAD_NAME_PREFIX = "sidecar-signals"
_executor: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        with _lock:
            if _executor is None:
                _executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix=THREAD_NAME_PREFIX)
    return _executor


async def run_in_signal_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``asyncio.to_thread``, on the pollers' own threads instead of the shared default executor."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool(), functools.partial(fn, *args, **kwargs))
