"""The prefill rate a lane has delivered, measured from the ledger's releases (for Retry-After).

Pure: time is a parameter, so the proxy (monotonic seconds) and ``replay`` (virtual seconds) measure
the same way, and an emulator run at ``--speed N`` is measured at its speed.
"""

from __future__ import annotations


class PrefillRate:
    """Prefill tokens per second the lane delivered while it had prefills in flight.

    ``busy(now)`` marks the instant the ledger goes from empty to charged; each ``prefilled(tokens,
    now)`` (a streamed request's first byte) adds its tokens, and the time since the last mark, to two
    decayed sums; the rate is their ratio. A ratio of sums, not an average of ratios: two prefills that
    end in the same instant add their tokens and no time, instead of one infinite sample. The decay
    (``keep`` per sample) lets the rate follow the lane's recent work. A request whose first byte is not
    its prefill's end (a non-streaming response: the first byte is the whole answer) must not be fed.
    """

    def __init__(self, keep: float = 0.8) -> None:
        self.keep = keep
        self._tokens = 0.0
        self._seconds = 0.0
        self._mark: float | None = None
        # The ratio of the two sums, None before any time was summed: a plain attribute, set whenever
        # they change (every decision reads it; issue #27).
        self.tokens_per_s: float | None = None

    def busy(self, now: float) -> None:
        self._mark = now

    def prefilled(self, tokens: int, now: float) -> None:
        if self._mark is None or tokens <= 0:
            return
        dt = now - self._mark
        dt = dt if dt > 0.0 else 0.0  # max(0.0, dt) without a builtin call (every first byte)
        self._mark = now
        self._tokens = self.keep * self._tokens + tokens
        self._seconds = self.keep * self._seconds + dt
        self.tokens_per_s = self._tokens / self._seconds if self._seconds > 0 else None
