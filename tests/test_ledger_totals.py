"""The ledger's totals, kept by one construction per change (``ledger._added``), against the generic
sum by field name they replaced: the same totals after every charge, prefill end and release, for every
field of ``Booked`` and ``Charge`` (a field added to either and missed by ``_added`` fails here)."""

from __future__ import annotations

from dataclasses import fields, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.core.decision import Booked, Charge
from sidecar.core.ledger import Ledger, LedgerTotals

_BOOKED = fields(Booked)


def _prefill(t: LedgerTotals, c: Charge, sign: int) -> LedgerTotals:
    booked = {f.name: getattr(t, f.name) + sign * getattr(c, f.name) for f in _BOOKED}
    return replace(t, requests=t.requests + sign, sequences=t.sequences + sign * c.sequences, **booked)


def _running(t: LedgerTotals, c: Charge, sign: int) -> LedgerTotals:
    return replace(
        t,
        running_requests=t.running_requests + sign,
        running_mamba_slots=t.running_mamba_slots + sign * c.mamba_slots,
    )


charges = st.builds(
    lambda values: Charge(**dict(zip([f.name for f in fields(Charge)], values, strict=True))),
    st.tuples(*[st.integers(min_value=0, max_value=10**12) for _ in fields(Charge)]),
)
# (op, which): 0 charge a new request, 1 its prefill ends, 2 it is released; `which` picks an entry.
ops = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 50), charges), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_totals_match_the_generic_sum(steps: list[tuple[int, int, Charge]]) -> None:
    ledger = Ledger()
    expected = LedgerTotals()
    entries: dict[int, tuple[Charge, bool]] = {}  # key -> (charge, still prefilling)
    for op, which, charge in steps:
        keys = sorted(entries)
        if op == 0 or not keys:
            key = ledger.charge(charge)
            entries[key] = (charge, True)
            expected = _running(_prefill(expected, charge, 1), charge, 1)
        elif op == 1:
            key = keys[which % len(keys)]
            c, prefilling = entries[key]
            assert ledger.prefill_done(key) is prefilling
            if prefilling:
                entries[key] = (c, False)
                expected = _prefill(expected, c, -1)
        else:
            key = keys[which % len(keys)]
            c, prefilling = entries.pop(key)
            assert ledger.release(key)
            assert not ledger.release(key)
            expected = _running(_prefill(expected, c, -1) if prefilling else expected, c, -1)
        assert ledger.totals == expected
        assert len(ledger) == len(entries)
    for key in list(entries):
        ledger.release(key)
    assert ledger.totals == LedgerTotals()


def test_every_field_moves() -> None:
    """Each field of the totals follows its own quantity of the charge (none is left at its default)."""
    names = [f.name for f in fields(Charge)]
    for i, name in enumerate(names):
        charge = Charge(**{n: (7 if n == name else 0) for n in names})
        ledger = Ledger()
        key = ledger.charge(charge)
        expected = _running(_prefill(LedgerTotals(), charge, 1), charge, 1)
        assert ledger.totals == expected, name
        ledger.prefill_done(key)
        assert ledger.totals == _prefill(expected, charge, -1), name
        ledger.release(key)
        assert ledger.totals == LedgerTotals(), (i, name)
