"""Requests the sidecar has forwarded whose prefill has not finished.

The engine's gauges lag (they are written at batch boundaries); the ledger does not. A request is
charged at the instant it is admitted and released at its first streamed byte (prefill done), at the
end of its response, or on any failure. Totals are kept incrementally so the decision reads them in
O(1); release is idempotent so no path can release twice or leak.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    prefill_tokens: int
    kv_tokens: int
    projected_bytes: int
    mamba_slots: int
    charged_at: float


@dataclass(frozen=True, slots=True)
class LedgerTotals:
    requests: int = 0
    prefill_tokens: int = 0
    kv_tokens: int = 0
    projected_bytes: int = 0
    mamba_slots: int = 0


class Ledger:
    def __init__(self) -> None:
        self._entries: dict[int, LedgerEntry] = {}
        self._ids = count(1)
        self._totals = LedgerTotals()

    @property
    def totals(self) -> LedgerTotals:
        return self._totals

    def __len__(self) -> int:
        return len(self._entries)

    def charge(self, entry: LedgerEntry) -> int:
        key = next(self._ids)
        self._entries[key] = entry
        self._totals = _add(self._totals, entry, 1)
        return key

    def release(self, key: int) -> bool:
        """Remove an entry; False when it was already released (harmless, by design)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._totals = _add(self._totals, entry, -1)
        return True

    def oldest_charged_at(self) -> float | None:
        return min((e.charged_at for e in self._entries.values()), default=None)


def _add(t: LedgerTotals, e: LedgerEntry, sign: int) -> LedgerTotals:
    return LedgerTotals(
        requests=t.requests + sign,
        prefill_tokens=t.prefill_tokens + sign * e.prefill_tokens,
        kv_tokens=t.kv_tokens + sign * e.kv_tokens,
        projected_bytes=t.projected_bytes + sign * e.projected_bytes,
        mamba_slots=t.mamba_slots + sign * e.mamba_slots,
    )
