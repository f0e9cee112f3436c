"""Requests the sidecar has forwarded whose prefill has not finished.

The engine's gauges lag (they are written at batch boundaries); the ledger does not. A request is
charged at the instant it is admitted and released at its first streamed byte (prefill done), at the
end of its response, or on any failure. Totals are kept incrementally so the decision reads them in
O(1); release is idempotent so no path can release twice or leak.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count

from sidecar.core.decision import Charge


@dataclass(frozen=True, slots=True)
class LedgerTotals:
    requests: int = 0
    # Sequences those requests put in the engine's queue (a batch or `n` > 1 is several).
    sequences: int = 0
    prefill_tokens: int = 0
    kv_tokens: int = 0
    projected_bytes: int = 0
    mamba_slots: int = 0


class Ledger:
    def __init__(self) -> None:
        self._entries: dict[int, Charge] = {}
        self._ids = count(1)
        self._totals = LedgerTotals()

    @property
    def totals(self) -> LedgerTotals:
        return self._totals

    def __len__(self) -> int:
        return len(self._entries)

    def charge(self, charge: Charge) -> int:
        key = next(self._ids)
        self._entries[key] = charge
        self._totals = _add(self._totals, charge, 1)
        return key

    def release(self, key: int) -> bool:
        """Remove an entry; False when it was already released (harmless, by design)."""
        charge = self._entries.pop(key, None)
        if charge is None:
            return False
        self._totals = _add(self._totals, charge, -1)
        return True


def _add(t: LedgerTotals, c: Charge, sign: int) -> LedgerTotals:
    return LedgerTotals(
        requests=t.requests + sign,
        sequences=t.sequences + sign * c.sequences,
        prefill_tokens=t.prefill_tokens + sign * c.prefill_tokens,
        kv_tokens=t.kv_tokens + sign * c.kv_tokens,
        projected_bytes=t.projected_bytes + sign * c.projected_bytes,
        mamba_slots=t.mamba_slots + sign * c.mamba_slots,
    )
