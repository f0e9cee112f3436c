"""What the sidecar has admitted and the engine still holds because of it, in two parts.

A request's *prefill* part is released at its first streamed byte, its *running* part when it ends;
totals are kept incrementally (O(1) reads) and every release is idempotent. Why the transients are
summed, not the largest batch's: ``docs/design.md`` (the ledger).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count

from sidecar.core.decision import Booked, Charge
from sidecar.core.values import fast_init, positional


@fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class LedgerTotals(Booked):
    """The sums over the requests still prefilling (the booked quantities, ``decision.Booked``), and
    what the running batch holds until each request ends."""

    requests: int = 0
    # Sequences those requests put in the engine's queue (a batch or `n` > 1 is several).
    sequences: int = 0
    # Admitted and not ended (prefilling or decoding): the running batch a newcomer would join.
    running_requests: int = 0
    # Mamba slots those requests keep until they end (working state and prefill checkpoints).
    running_mamba_slots: int = 0


class Ledger:
    def __init__(self) -> None:
        # key -> [charge, still prefilling]: a list changed in place at the prefill's end (a frozen
        # entry rebuilt there cost a construction per first byte; issue #27).
        self._entries: dict[int, list] = {}
        self._ids = count(1)
        # The sums over the entries: read it, never assign it (a plain attribute, not a property: it is
        # read several times per gated request; issue #27).
        self.totals = LedgerTotals()

    def __len__(self) -> int:
        return len(self._entries)

    def charge(self, charge: Charge) -> int:
        key = next(self._ids)
        self._entries[key] = [charge, True]
        t, c = self.totals, charge
        # ``_added(t, c, prefill=1, running=1)`` spelt out: no keyword call, no products (every
        # admission; issue #27). ``tests/test_ledger_totals.py`` compares it with the generic sum.
        self.totals = _totals(
            t.prefill_tokens + c.prefill_tokens,
            t.kv_tokens + c.kv_tokens,
            t.projected_bytes + c.projected_bytes,
            t.mamba_slots + c.mamba_slots,
            t.own_prefills + c.own_prefills,
            t.requests + 1,
            t.sequences + c.sequences,
            t.running_requests + 1,
            t.running_mamba_slots + c.mamba_slots,
        )
        return key

    def prefill_done(self, key: int) -> bool:
        """Release the prefill part; the running part stays until :meth:`release`. False when there
        was no prefill part left (harmless, by design)."""
        entry = self._entries.get(key)
        if entry is None or not entry[1]:
            return False
        entry[1] = False
        t, c = self.totals, entry[0]
        # ``_added(t, c, prefill=-1, running=0)`` spelt out, as in ``charge`` (every first byte).
        self.totals = _totals(
            t.prefill_tokens - c.prefill_tokens,
            t.kv_tokens - c.kv_tokens,
            t.projected_bytes - c.projected_bytes,
            t.mamba_slots - c.mamba_slots,
            t.own_prefills - c.own_prefills,
            t.requests - 1,
            t.sequences - c.sequences,
            t.running_requests,
            t.running_mamba_slots,
        )
        return True

    def release(self, key: int) -> bool:
        """Remove what is left of an entry; False when it was already released."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.totals = _added(self.totals, entry[0], prefill=-1 if entry[1] else 0, running=-1)
        return True


def _added(t: LedgerTotals, c: Charge, *, prefill: int, running: int) -> LedgerTotals:
    """``t`` with ``c``'s prefill part (the booked quantities, the request and its sequences) added
    ``prefill`` times and its running part (the running request and its Mamba slots) ``running`` times
    (each -1, 0 or 1).

    One construction, every field given positionally (``values.positional``): this runs three times
    per gated request (charge, prefill end, release), where ``dataclasses.replace`` over the fields by
    name made that cycle ~12 µs, keywords ~7.5 (2 cores). ``tests/test_ledger_totals.py`` checks it
    against that generic sum field by field, so a field added to ``Booked`` and missed here fails there
    (and the builder refuses a call with a field short).
    """
    return _totals(
        t.prefill_tokens + prefill * c.prefill_tokens,
        t.kv_tokens + prefill * c.kv_tokens,
        t.projected_bytes + prefill * c.projected_bytes,
        t.mamba_slots + prefill * c.mamba_slots,
        t.own_prefills + prefill * c.own_prefills,
        t.requests + prefill,
        t.sequences + prefill * c.sequences,
        t.running_requests + running,
        t.running_mamba_slots + running * c.mamba_slots,
    )


# LedgerTotals from its fields in declaration order: Booked's (prefill_tokens, kv_tokens,
# projected_bytes, mamba_slots, own_prefills), then requests, sequences, running_requests,
# running_mamba_slots.
_totals = positional(LedgerTotals)
