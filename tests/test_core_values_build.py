"""``core.values.fast_init`` called on classes made here: what it builds for each kind of field.

``tests/test_core_values.py`` checks the classes decorated when the package is imported; these tests
call :func:`fast_init` themselves, on small frozen slotted dataclasses made inside each test, so that
each promise of the function is exercised by the call it makes (positional and keyword-only fields,
defaults, factories, ``init=False``, inheritance, ``__post_init__``, what it refuses). The per-request
values are built by the ``__init__`` it writes: a field that lands in the wrong slot, a default or a
factory lost, or a refused call that is accepted would make the gate decide on a wrong value, silently.
Each value is compared with the one the dataclass's own ``__init__`` (``ORIGINAL_INIT``) builds.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from sidecar.core.values import ORIGINAL_INIT, fast_init


@pytest.fixture(autouse=True)
def _forget_the_classes_made_here() -> Iterator[None]:
    """``ORIGINAL_INIT`` is global and ``tests/test_core_values.py`` checks every class in it: the
    throwaway classes made here leave it as they found it."""
    before = dict(ORIGINAL_INIT)
    yield
    ORIGINAL_INIT.clear()
    ORIGINAL_INIT.update(before)


def _original(cls: type, *args: Any, **kw: Any) -> Any:
    """The value the dataclass's own ``__init__`` (the one ``fast_init`` replaced) builds."""
    value = object.__new__(cls)
    ORIGINAL_INIT[cls](value, *args, **kw)
    return value


def _state(value: Any) -> dict[str, Any]:
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}


def _params(cls: type, init: Any) -> list[tuple[str, Any, Any]]:
    """Each parameter's name, kind and default; a factory's default differs in form between the two
    ``__init__``s (a sentinel each), so a factory field says only that it has one."""
    factories = {f.name for f in dataclasses.fields(cls) if f.default_factory is not dataclasses.MISSING}
    return [
        (p.name, p.kind, ("factory", p.default is not p.empty) if p.name in factories else p.default)
        for p in inspect.signature(init).parameters.values()
    ]


def _same_signature(cls: type) -> None:
    assert _params(cls, cls.__init__) == _params(cls, ORIGINAL_INIT[cls])


def _refusal(call: Any) -> str:
    with pytest.raises(TypeError) as refused:
        call()
    return str(refused.value)


def test_positional_fields_and_a_default_land_in_their_own_slots() -> None:
    """Values built positionally (``Demand``, ``Situation``) rely on each argument landing in the slot
    of its own field, and a default (``Check.note``) on being the declared one when omitted."""

    @fast_init
    @dataclass(frozen=True, slots=True)
    class Charge:
        pool: str
        tokens: int
        note: str = "none"

    _same_signature(Charge)
    c = Charge("kv", 3)
    assert (c.pool, c.tokens, c.note) == ("kv", 3, "none")
    assert _state(c) == _state(_original(Charge, "kv", 3))
    c = Charge("kv", 3, "held")
    assert (c.pool, c.tokens, c.note) == ("kv", 3, "held")
    assert _state(c) == _state(_original(Charge, "kv", 3, "held"))
    assert Charge(tokens=4, pool="swa", note="x") == Charge("swa", 4, "x")
    # A missing or extra argument is refused as the dataclass refuses it, with its words.
    assert _refusal(lambda: Charge("kv")) == _refusal(lambda: _original(Charge, "kv"))
    assert _refusal(lambda: Charge("kv", 1, "a", 2)) == _refusal(lambda: _original(Charge, "kv", 1, "a", 2))
    assert _refusal(lambda: Charge("kv", 1, pool="x")) == _refusal(
        lambda: _original(Charge, "kv", 1, pool="x")
    )


def test_a_default_factory_gives_a_fresh_value_and_keeps_a_passed_one() -> None:
    """A factory field (``Decision.checks``-like) must get a new object per value when omitted (a
    shared list would carry one request's entries into the next) and keep exactly what was passed,
    even a falsy value or ``None``."""

    @fast_init
    @dataclass(frozen=True, slots=True)
    class Held:
        name: str
        ids: list[int] = field(default_factory=list)
        seen: dict[str, int] = field(default_factory=lambda: {"first": 1})

    _same_signature(Held)
    a, b = Held("a"), Held("b")
    assert (a.ids, a.seen) == ([], {"first": 1})
    assert a.ids is not b.ids and a.seen is not b.seen
    assert _state(a) == _state(_original(Held, "a"))
    given, empty = [1, 2], {}
    kept = Held("c", given, empty)
    assert kept.ids is given and kept.seen is empty
    assert _state(kept) == _state(_original(Held, "c", given, empty))
    assert Held("d", None).ids is None  # type: ignore[arg-type]
    assert Held("e", seen={"x": 2}).ids == [] and Held("e", seen={"x": 2}).seen == {"x": 2}


def test_keyword_only_fields_are_refused_positionally() -> None:
    """``Charge``'s fields are keyword-only: a positional call must be refused as the dataclass
    refuses it, never bind a number to the wrong field."""

    @fast_init
    @dataclass(frozen=True, slots=True)
    class Ask:
        prompt: str
        note: str = ""
        max_new: int = field(kw_only=True)
        priority: int = field(default=0, kw_only=True)

    _same_signature(Ask)
    kinds = {p.name: p.kind for p in inspect.signature(Ask.__init__).parameters.values()}
    assert kinds["max_new"] is kinds["priority"] is inspect.Parameter.KEYWORD_ONLY
    assert kinds["prompt"] is kinds["note"] is inspect.Parameter.POSITIONAL_OR_KEYWORD
    a = Ask("p", max_new=5)
    assert (a.prompt, a.note, a.max_new, a.priority) == ("p", "", 5, 0)
    assert _state(a) == _state(_original(Ask, "p", max_new=5))
    a = Ask("p", "n", priority=2, max_new=7)
    assert (a.prompt, a.note, a.max_new, a.priority) == ("p", "n", 7, 2)
    assert _refusal(lambda: Ask("p", "n", 5)) == _refusal(lambda: _original(Ask, "p", "n", 5))
    assert _refusal(lambda: Ask("p")) == _refusal(lambda: _original(Ask, "p"))

    @fast_init
    @dataclass(frozen=True, slots=True, kw_only=True)
    class Totals:
        held: int
        queued: int = 0

    _same_signature(Totals)
    assert _state(Totals(held=1)) == {"held": 1, "queued": 0}
    assert _refusal(lambda: Totals(1)) == _refusal(lambda: _original(Totals, 1))


def test_fields_outside_init_get_their_default_or_a_fresh_factory_value() -> None:
    """A field with ``init=False`` is not a parameter; it is set to its default, or to a new
    factory value per instance, as the dataclass sets it."""

    @fast_init
    @dataclass(frozen=True, slots=True)
    class Row:
        key: str
        count: int = field(default=7, init=False)
        log: list[str] = field(default_factory=lambda: ["opened"], init=False)

    _same_signature(Row)
    assert [p for p in inspect.signature(Row.__init__).parameters] == ["self", "key"]
    a, b = Row("a"), Row("b")
    assert (a.key, a.count, a.log) == ("a", 7, ["opened"])
    assert a.log is not b.log
    assert _state(a) == _state(_original(Row, "a"))
    assert _refusal(lambda: Row("a", 1)) == _refusal(lambda: _original(Row, "a", 1))
    assert _refusal(lambda: Row("a", count=1)) == _refusal(lambda: _original(Row, "a", count=1))


def test_a_field_outside_init_without_a_default_is_refused_by_name() -> None:
    """Such a field would be left unset (an ``AttributeError`` at the first read, mid-request):
    refused when the class is made, saying which class and field."""

    @dataclass(frozen=True, slots=True)
    class Row:
        key: str
        derived: int = field(init=False)

    with pytest.raises(TypeError) as refused:
        fast_init(Row)
    assert str(refused.value) == "fast_init: Row.derived: init=False without a default"
    assert Row not in ORIGINAL_INIT


def test_an_inherited_field_is_set_through_its_base_slot() -> None:
    """A value extending a slotted base keeps the base's fields in the base's slots (the subclass has
    no slot of that name): each must be written there, in the dataclass's order."""

    @dataclass(frozen=True, slots=True)
    class Base:
        lane: str
        gpus: int

    @fast_init
    @dataclass(frozen=True, slots=True)
    class Lane(Base):
        pool: int = 0

    assert "lane" not in Lane.__dict__ and "lane" in Base.__dict__
    _same_signature(Lane)
    x = Lane("a", 2, 5)
    assert (x.lane, x.gpus, x.pool) == ("a", 2, 5)
    assert _state(x) == _state(_original(Lane, "a", 2, 5))
    assert _state(Lane("b", 1)) == {"lane": "b", "gpus": 1, "pool": 0}

    @fast_init
    @dataclass(frozen=True, slots=True)
    class Deeper(Lane):
        tag: str = "t"

    assert _state(Deeper("c", 3, 4, "u")) == {"lane": "c", "gpus": 3, "pool": 4, "tag": "u"}
    assert _state(Deeper("c", 3)) == _state(_original(Deeper, "c", 3))


def test_post_init_runs_once_after_every_field_is_set() -> None:
    """``GpuSignals`` computes its least free memory in ``__post_init__`` from its fields: it must run
    exactly once, after the fields are written (else it reads nothing, or its result is overwritten)."""
    seen: list[tuple[int, int]] = []

    @fast_init
    @dataclass(frozen=True, slots=True)
    class Reading:
        need: int
        have: int
        slack: int | None = field(default=None, init=False, compare=False)

        def __post_init__(self) -> None:
            seen.append((self.need, self.have))
            object.__setattr__(self, "slack", self.have - self.need)

    r = Reading(3, 10)
    assert seen == [(3, 10)]
    assert r.slack == 7
    assert _state(r) == _state(_original(Reading, 3, 10))
    assert seen == [(3, 10), (3, 10)]
    assert dataclasses.replace(r, need=4).slack == 6


def test_only_a_frozen_slotted_dataclass_is_taken() -> None:
    """Writing through slot descriptors needs slots, and skipping ``__setattr__`` is safe only on a
    frozen value: anything else is refused, by name, and left as it was."""

    @dataclass(slots=True)
    class Loose:
        x: int

    @dataclass(frozen=True)
    class Unslotted:
        x: int

    @dataclass
    class Plain:
        x: int

    for cls in (Loose, Unslotted, Plain):
        own = cls.__init__
        with pytest.raises(TypeError) as refused:
            fast_init(cls)
        assert str(refused.value) == f"fast_init: {cls.__name__} is not a frozen dataclass with slots"
        assert cls.__init__ is own and cls not in ORIGINAL_INIT


def test_a_class_without_fields() -> None:
    """A marker value with no fields builds, compares equal to another and takes no argument."""

    @fast_init
    @dataclass(frozen=True, slots=True)
    class Nothing:
        pass

    _same_signature(Nothing)
    assert Nothing() == Nothing() == _original(Nothing)
    assert _refusal(lambda: Nothing(1)) == _refusal(lambda: _original(Nothing, 1))


def test_the_new_init_is_named_and_documented_as_the_one_it_replaced() -> None:
    """Tracebacks, profiles and ``help()`` show the value's own ``__init__``; ``ORIGINAL_INIT`` holds
    the dataclass's (what every test compares with), and the class itself is returned, not a copy."""

    @dataclass(frozen=True, slots=True)
    class Value:
        a: int
        b: str = "b"

    own = Value.__init__
    own.__doc__ = "Build a value: a, then b."
    assert fast_init(Value) is Value
    assert ORIGINAL_INIT[Value] is own
    assert Value.__init__ is not own
    assert Value.__init__.__qualname__ == own.__qualname__ == f"{Value.__qualname__}.__init__"
    assert Value.__init__.__name__ == "__init__"
    assert Value.__init__.__module__ == own.__module__ == __name__
    assert Value.__init__.__doc__ == "Build a value: a, then b."
    assert inspect.signature(Value.__init__).parameters.keys() == inspect.signature(own).parameters.keys()
    assert _state(Value(1)) == {"a": 1, "b": "b"}


def test_the_value_stays_a_frozen_dataclass() -> None:
    """Equality and hashing (a value used as a key), ``dataclasses.replace`` (a decision rebuilt with
    one field changed) and the refusal of assignment are the dataclass's, on values built either way."""

    @fast_init
    @dataclass(frozen=True, slots=True)
    class Check:
        name: str
        ok: bool
        need: int = 0
        notes: tuple[str, ...] = field(default_factory=tuple)

    fast, slow = Check("kv", True, 3, ("a",)), _original(Check, "kv", True, 3, ("a",))
    assert fast == slow and hash(fast) == hash(slow) and len({fast, slow}) == 1
    assert fast != Check("kv", False, 3, ("a",))
    changed = dataclasses.replace(fast, ok=False)
    assert type(changed) is Check and changed == _original(Check, "kv", False, 3, ("a",))
    assert changed.notes is fast.notes
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.ok = False  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del fast.need
    assert not hasattr(fast, "__dict__")
    assert repr(fast) == repr(slow)
    assert repr(fast).endswith(".<locals>.Check(name='kv', ok=True, need=3, notes=('a',))")
