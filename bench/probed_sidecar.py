"""``sglang-sidecar serve`` with an event-loop lag probe, for the overhead benchmark only.

Runs the real CLI (same policy, same pollers, same uvicorn settings) and wraps the ASGI app it builds
with ``bench/lag_probe.py``: a 1 ms tick that records how late it wakes (how long the loop was blocked)
and the garbage collector's pauses. The benchmark reads and resets the figures at ``GET /__bench/lag``
between phases, so a stall can be attributed to the shape that ran (the target: none over 5 ms while
the signals are polled). ``BENCH_STALL_STACKS=MS`` adds where the loop was in each stall (diagnosis).

    python bench/probed_sidecar.py serve --upstream ... (the arguments of ``sglang-sidecar serve``)
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import sidecar.cli

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lag_probe import TICK_S, LagProbe, probed  # bench/ is not a package

__all__ = ["TICK_S", "LagProbe", "main", "probed"]


def _turns_from_env() -> None:
    """``BENCH_TURNS_MIN=N`` (experiments only): the gate turns' least gates per turn
    (``proxy._Turns.min_per_turn``, 16 as shipped), to measure what it does to the paced stall."""
    import os

    if os.environ.get("BENCH_TURNS_MIN"):
        from sidecar.http import proxy

        budget, clock, _ = proxy._Turns.__init__.__defaults__  # type: ignore[misc]
        proxy._Turns.__init__.__defaults__ = (budget, clock, int(os.environ["BENCH_TURNS_MIN"]))


def _log_sink_from_env() -> None:
    """``BENCH_LOG_SINK=1`` (experiments only): the decision log's lines are built as usual (the
    writer's ``render``, here on the loop's thread as each is put) and kept, the last few, by a writer
    that writes nothing (no thread, no syscall): with ``--decision-log`` on, the difference from a normal
    run is what the writer thread costs, apart from building the lines."""
    import collections
    import os

    if os.environ.get("BENCH_LOG_SINK"):
        from sidecar.ops import telemetry

        class Sink:
            dropped = 0

            def __init__(self, stream: object, *a: object, render: Any = None, **k: object) -> None:
                self.stream = stream
                self._render = render
                self._lines: collections.deque[bytes] = collections.deque(maxlen=64)

            def put(self, line: Any) -> None:
                render = self._render
                self._lines.append(line if render is None or type(line) is bytes else render(line))

            def close(self, timeout_s: float = 5.0) -> None:
                pass

        telemetry.LineWriter = Sink  # type: ignore[misc,assignment]


def main() -> int:
    _turns_from_env()
    _log_sink_from_env()
    run = sidecar.cli.run_uvicorn
    freeze = sidecar.cli._freeze_startup_objects
    probe = LagProbe()

    def freeze_and_count() -> None:
        freeze()
        # Counted once, right after start-up froze them: ``gc.get_freeze_count()`` walks the whole
        # permanent generation (~95,000 objects, ~10 ms), so calling it at every read stalled the loop
        # once per read, and that stall landed in the next phase's figures.
        probe.frozen = gc.get_freeze_count()

    sidecar.cli._freeze_startup_objects = freeze_and_count  # type: ignore[assignment]
    sidecar.cli.run_uvicorn = lambda app, *a, **kw: run(probed(app, probe), *a, **kw)  # type: ignore[assignment]
    return sidecar.cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
