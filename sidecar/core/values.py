"""Frozen values built per request, made cheaper to build: :func:`fast_init`.

A frozen dataclass's generated ``__init__`` sets each field through ``object.__setattr__`` (a global
lookup, an attribute lookup and a call per field), because its own ``__setattr__`` refuses. A gated
request builds ~20 of them (~140 fields: the demand, the situation, the checks, the decision, the
ledger's totals), at ~0.2 µs a field on the 2-core machine: a tenth of the gate's work (issue #27).
:func:`fast_init` replaces that ``__init__`` with one of the same signature that writes each field
through its slot's own descriptor (bound once per class): the class stays a frozen dataclass (equality,
hashing, ``replace``, ``FrozenInstanceError`` on assignment, pickling), only its construction is
cheaper (~2x for a 9-field value). ``tests/test_core_values.py`` checks every decorated class against
the dataclass's own ``__init__``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")

_NO_DEFAULT = object()
# Each decorated class and the dataclass's own ``__init__`` it replaced (what the tests compare with).
ORIGINAL_INIT: dict[type, Any] = {}


def fast_init(cls: type[T]) -> type[T]:
    """``cls`` (a frozen dataclass with ``slots=True``) with a cheaper ``__init__`` of the same
    signature. Apply it above ``@dataclass(...)``: slots make a new class, this must see that one."""
    params = dataclasses.fields(cls)  # type: ignore[arg-type]
    if not cls.__dataclass_params__.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"fast_init: {cls.__name__} is not a frozen dataclass with slots")
    ns: dict[str, Any] = {"_NO_DEFAULT": _NO_DEFAULT}
    positional: list[str] = []
    keyword: list[str] = []
    body: list[str] = []
    for f in params:
        # The slot's member descriptor (a base class's, for an inherited field).
        ns[f"_set_{f.name}"] = next(k.__dict__[f.name] for k in cls.__mro__ if f.name in k.__dict__).__set__
        if f.default is not dataclasses.MISSING:
            ns[f"_dflt_{f.name}"] = f.default
            value, default = f.name, f"=_dflt_{f.name}"
        elif f.default_factory is not dataclasses.MISSING:
            ns[f"_factory_{f.name}"] = f.default_factory
            value = f"_factory_{f.name}() if {f.name} is _NO_DEFAULT else {f.name}"
            default = "=_NO_DEFAULT"
        else:
            value, default = f.name, ""
        if not f.init:
            if default == "":
                raise TypeError(f"fast_init: {cls.__name__}.{f.name}: init=False without a default")
            value = f"_factory_{f.name}()" if default == "=_NO_DEFAULT" else f"_dflt_{f.name}"
        else:
            (keyword if f.kw_only else positional).append(f.name + default)
        body.append(f"    _set_{f.name}(self, {value})")
    if hasattr(cls, "__post_init__"):
        body.append("    self.__post_init__()")
    args = ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])
    exec(f"def __init__({args}):\n" + ("\n".join(body) or "    pass") + "\n", ns)
    init = ns["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    ORIGINAL_INIT[cls] = cls.__init__
    cls.__init__ = init  # type: ignore[misc]
    return cls


def _layout_free(base: type) -> bool:
    """A base a twin class may share with ``cls``: no slots of its own (``cls`` holds every field) and
    no ``__setattr__`` of its own (the twin's plain stores would go through it: ``decision.Booked``)."""
    return base.__dict__.get("__slots__") == () and "__setattr__" not in base.__dict__


def positional(cls: type[T]) -> Any:
    """A function that builds a ``cls`` (a frozen dataclass with ``slots=True``, every field set by
    ``__init__``, no ``__post_init__``) from every field's value, positionally in the fields' order,
    for the few values built on every gated request whose every field the caller has at hand
    (issue #27). It builds what ``cls(**fields)`` builds; a field added to ``cls`` makes every call
    that does not pass it fail loudly (too few arguments).

    Why it is cheaper: a frozen class refuses ``self.x = v``, so its ``__init__`` must call each
    slot's descriptor. Where ``cls`` declares every field in its own ``__slots__`` (no base fields),
    this fills an instance of a twin class with the same slots and no ``__setattr__`` of its own (a
    plain slot store per field), then makes it a ``cls`` by ``__class__`` assignment, which CPython
    allows between classes of identical layout: a 17-field value in 4.4k instructions against 13.9k
    through the descriptors (evidence QK1), a 6-field ``Check`` in 2.6k against 6.0k (QL1). A base
    that declares fields but holds none of their slots (``__slots__ = ()``, no ``__setattr__`` of its
    own: ``decision.Booked``) is the twin's base too, so the layouts still match. A class with base
    fields in a base's slots (its layout spans two classes, which a twin cannot copy) is filled
    through each slot's descriptor, bound once, which still saves the keyword call (~4k
    instructions for nine fields, QI3). Either way the result is an ordinary ``cls``: equal, hashable, frozen and picklable
    (``tests/test_core_values_positional.py``, ``tests/test_core_values.py``)."""
    params = dataclasses.fields(cls)  # type: ignore[arg-type]
    names = [f.name for f in params]
    if not cls.__dataclass_params__.frozen or "__slots__" not in cls.__dict__:  # type: ignore[attr-defined]
        raise TypeError(f"positional: {cls.__name__} is not a frozen dataclass with slots")
    if hasattr(cls, "__post_init__") or not all(f.init for f in params):
        raise TypeError(f"positional: {cls.__name__} sets a field after __init__")
    args = ", ".join(names)
    ns: dict[str, Any] = {"_cls": cls}
    if tuple(cls.__dict__["__slots__"]) == tuple(names) and all(map(_layout_free, cls.__mro__[1:-1])):
        # The twin has cls's bases, for ``__class__`` assignment (their layout must be the same).
        ns["_twin"] = type(
            f"_{cls.__name__}Fill",
            cls.__bases__,
            {"__slots__": tuple(names), "__module__": cls.__module__, "__init__": object.__init__},
        )
        body = "".join(f"    o.{n} = {n}\n" for n in names)
        exec(f"def make({args}):\n    o = _twin()\n{body}    o.__class__ = _cls\n    return o\n", ns)
    else:
        ns["_new"] = object.__new__
        for n in names:
            ns[f"_set_{n}"] = next(k.__dict__[n] for k in cls.__mro__ if n in k.__dict__).__set__
        body = "".join(f"    _set_{n}(o, {n})\n" for n in names)
        exec(f"def make({args}):\n    o = _new(_cls)\n{body}    return o\n", ns)
    make = ns["make"]
    make.__qualname__ = make.__name__ = f"make_{cls.__name__}"
    make.__module__ = cls.__module__
    make.__doc__ = (
        f"A {cls.__name__} from every field's value, in the fields' order (core.values.positional)."
    )
    return make
