"""``core.values.fast_init``: every decorated value builds exactly what the dataclass's own ``__init__``
built (same signature, same fields, defaults and factories), and stays frozen.

The per-request values (demand, situation, checks, decision, ledger totals, the parsed request, its
count) are built with it on every gated request: a field set wrongly, a default lost, or a value that
became assignable would change decisions silently."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest

from sidecar.core.decide import Situation
from sidecar.core.decision import Action, Charge, Check, Decision
from sidecar.core.demand import Demand
from sidecar.core.ledger import LedgerTotals
from sidecar.core.values import ORIGINAL_INIT, fast_init
from sidecar.intake.body import GenerationRequest
from sidecar.intake.tokens import TokenCount

PER_REQUEST = (Check, Charge, Decision, Demand, LedgerTotals, Situation, GenerationRequest, TokenCount)


def _marker(name: str) -> object:
    return ("value of", name)


def _shape(sig: inspect.Signature) -> list[tuple[str, object, str]]:
    """Parameters by name and kind, and whether each has a default (a factory's differs in form)."""
    return [
        (p.name, p.kind, "required" if p.default is p.empty else "default") for p in sig.parameters.values()
    ]


def test_the_per_request_values_are_decorated() -> None:
    assert set(PER_REQUEST) <= set(ORIGINAL_INIT)


@pytest.mark.parametrize(
    "cls", sorted(ORIGINAL_INIT, key=lambda c: c.__qualname__), ids=lambda c: c.__qualname__
)
def test_same_signature_fields_and_defaults(cls: type) -> None:
    original = ORIGINAL_INIT[cls]
    assert _shape(inspect.signature(cls.__init__)) == _shape(inspect.signature(original))
    fields = [f for f in dataclasses.fields(cls) if f.init]
    required = [
        f for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]

    def both(**kw: object) -> tuple[object, object]:
        fast = cls(**kw)
        slow = object.__new__(cls)
        original(slow, **kw)
        return fast, slow

    # Every field given: each lands in its own slot.
    fast, slow = both(**{f.name: _marker(f.name) for f in fields})
    for f in dataclasses.fields(cls):
        assert getattr(fast, f.name) == getattr(slow, f.name)
    for f in fields:
        assert getattr(fast, f.name) == _marker(f.name)
    # Only the required ones: the defaults and factories are the dataclass's (a fresh factory value each).
    fast, slow = both(**{f.name: _marker(f.name) for f in required})
    assert fast == slow
    for f in dataclasses.fields(cls):
        assert getattr(fast, f.name) == getattr(slow, f.name)
        if f.default_factory is not dataclasses.MISSING and getattr(fast, f.name) != ():
            assert getattr(fast, f.name) is not getattr(cls(**{r.name: 1 for r in required}), f.name)  # fresh
    # Positional arguments where the dataclass takes them.
    positional = [f for f in required if not f.kw_only]
    kw = {f.name: _marker(f.name) for f in required if f.kw_only}
    assert cls(*[_marker(f.name) for f in positional], **kw) == fast
    # Still frozen, hashable as before, and picklable.
    name = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(fast, name, 1)
    assert pickle.loads(pickle.dumps(fast)) == fast
    assert hash(fast) == hash(slow)


def test_a_missing_argument_is_refused_as_before() -> None:
    with pytest.raises(TypeError):
        Check()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Charge(1)  # type: ignore[misc]  (keyword-only, as declared)


def test_replace_and_real_values() -> None:
    c = Check("kv_pool", True, 3, 4)
    assert (c.name, c.ok, c.need, c.have, c.note, c.limit) == ("kv_pool", True, 3, 4, "", "")
    assert dataclasses.replace(c, ok=False) == Check("kv_pool", False, 3, 4)
    d = Decision(Action.ADMIT, None)
    assert d.checks == () and d.charge == Charge() and d.check is None


def test_only_frozen_slotted_dataclasses() -> None:
    @dataclasses.dataclass(slots=True)
    class Loose:
        x: int

    with pytest.raises(TypeError):
        fast_init(Loose)
