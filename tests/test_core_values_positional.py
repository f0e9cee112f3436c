"""``core.values.positional``: the per-request values built through it (the demand, the parsed request,
its count) are the very values ``cls(...)`` builds: same type, fields, equality, hash, frozen, picklable.
A class it cannot build exactly (no slots of its own, a base's fields, a ``__post_init__``) is refused
where it is declared, not mis-built per request."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from sidecar.core import demand
from sidecar.core.demand import Demand
from sidecar.core.values import fast_init, positional
from sidecar.intake import body, tokens
from sidecar.intake.body import GenerationRequest
from sidecar.intake.tokens import TokenCount

BUILT = [
    (Demand, demand._make_demand),
    (GenerationRequest, body._make_request),
    (TokenCount, tokens._make_count),
]


@pytest.mark.parametrize(("cls", "make"), BUILT, ids=lambda v: getattr(v, "__name__", ""))
def test_the_same_value_as_the_class_builds(cls: type, make: object) -> None:
    fields = dataclasses.fields(cls)
    values = [("value of", f.name) for f in fields]
    built = make(*values)  # type: ignore[operator]
    assert type(built) is cls
    assert built == cls(*values)
    assert [getattr(built, f.name) for f in fields] == values
    assert hash(built) == hash(cls(*values)) if cls.__hash__ is not None else True
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(built, fields[0].name, 1)
    assert pickle.loads(pickle.dumps(built)) == built
    with pytest.raises(TypeError):
        make(*values[:-1])  # type: ignore[operator]  # every field, no defaults


def test_a_class_it_cannot_build_exactly_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Base:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Derived(Base):
        b: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclasses.dataclass(slots=True)
    class Mutable:
        a: int

    for cls in (NoSlots, Checked, Mutable):
        with pytest.raises(TypeError):
            positional(cls)

    # Base fields: its layout spans two classes, so it is filled through the slots' descriptors.
    built = positional(Derived)(1, 2)
    assert built == Derived(a=1, b=2) and type(built) is Derived
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.a = 3  # type: ignore[misc]

    @fast_init
    @dataclasses.dataclass(frozen=True, slots=True)
    class Fine:
        a: int
        b: str = "x"

    assert positional(Fine)(1, "y") == Fine(1, "y")
