"""Engine values that cannot be true, found before they reach the gate.

Why: the gate trusts what the engine reports. An empty, all-NaN or all-Inf ``/metrics`` answer used
to leave every gauge unknown while the read counted as a success (``/readyz`` 200, the gate admitting
blind), and a negative or astronomically large pool would open it wide. Such a reading is treated as
a failed read of the engine signal: the snapshot goes stale and the policy's ``engine.on_stale``
applies, the message names the series, and the scraper counts it.

Pure: field values in, problems out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# No engine has more than 2**40 KV slots, requests or Mamba slots: a larger figure is a broken
# exporter (1e300 of free KV would admit anything).
MAX_COUNT = 1 << 40
# Usages are ratios; a little over 1 is rounding, more is not a usage.
MAX_USAGE = 1.05

_USAGES = frozenset({"full_token_usage", "swa_token_usage", "mamba_usage"})
# Fields SGLang reports as -1 for "off" (chunked prefill disabled).
_MINUS_ONE_MEANS_OFF = frozenset({"chunked_prefill_size"})


@dataclass(frozen=True, slots=True)
class Implausible:
    """One value that cannot be true: which series (the engine's name for it), the value, and why."""

    series: str
    value: object
    why: str

    def __str__(self) -> str:
        v = self.value
        shown = f"{v:.6g}" if isinstance(v, int | float) and abs(v) >= 1e15 else repr(v)
        return f"{self.series}={shown} ({self.why})"


def check_engine_fields(
    fields: Mapping[str, object], series: Mapping[str, str] | None = None
) -> list[Implausible]:
    """Problems with one merged engine reading; ``series`` maps a field to the name it came from."""
    names = series or {}
    problems = []
    for field, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        name = names.get(field, field)
        if not math.isfinite(value):
            problems.append(Implausible(name, value, "not a finite number"))
        elif field in _USAGES:
            if not 0.0 <= value <= MAX_USAGE:
                problems.append(Implausible(name, value, "a usage must be between 0 and 1"))
        elif value < 0 and not (field in _MINUS_ONE_MEANS_OFF and value == -1):
            problems.append(Implausible(name, value, "a count or size cannot be negative"))
        elif value > MAX_COUNT:
            problems.append(Implausible(name, value, f"more than {MAX_COUNT:,} cannot be a real count"))
    return problems


def nonfinite_series(pairs: Iterable[tuple[str, float]]) -> list[Implausible]:
    """NaN or Inf samples of the series the gate reads (other series may be NaN by design)."""
    return [
        Implausible(name, value, "not a finite number") for name, value in pairs if not math.isfinite(value)
    ]


def describe(problems: list[Implausible]) -> str:
    shown = "; ".join(str(p) for p in problems[:5])
    more = f" and {len(problems) - 5} more" if len(problems) > 5 else ""
    return f"impossible engine values, reading refused: {shown}{more}"
