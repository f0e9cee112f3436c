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
from sidecar.core.values import ORIGINAL_INIT, fast_init, positional
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


def test_a_gpu_readings_least_free_is_taken_once_and_follows_its_devices() -> None:
    """``GpuSignals.free_bytes`` is computed at construction (every decision reads it): it must be the
    least free over the devices, follow a ``replace``, and not enter equality."""
    from sidecar.core.snapshot import DeviceMemory, GpuSignals

    a, b = DeviceMemory("0", 5, 10), DeviceMemory("1", 3, 10)
    g = GpuSignals(1.0, "file:x", (a, b))
    assert g.free_bytes == 3
    assert dataclasses.replace(g, devices=(a,)).free_bytes == 5
    assert GpuSignals(1.0, "file:x").free_bytes is None
    assert g == GpuSignals(1.0, "file:x", (a, b)) and hash(g) == hash(GpuSignals(1.0, "file:x", (a, b)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.free_bytes = 1  # type: ignore[misc]


def test_a_projection_by_its_arguments_is_the_projection_of_its_shape() -> None:
    """``cost.project_shape`` (memoised by its arguments) against ``project_bytes(shape(...))``."""
    from sidecar.core.cost import project_bytes, project_shape, shape
    from sidecar.core.rules import CostModel

    c = CostModel(1 << 20, 1024, 3, 2, 1 << 30, 1.25, chunk_context_bytes=0.5, logprob_bytes_per_token=7)
    for args in [(1, 1, 8192), (0, 0, 8192), (50_000, 12_000, 8192, 4, 900), (9, 0, 4), (9, 9, 4, 1, 9)]:
        for _ in range(2):  # the second from the memo
            assert project_shape(c, *args) == project_bytes(c, shape(*args))


@pytest.mark.parametrize(
    ("cls", "where", "order"),
    [
        (
            Situation,
            "admission/controller.py: Admission.situation",
            "rules snapshot ledger now held queued ahead draining held_tokens prefill_tokens_per_s "
            "join_settles_at verifies_hits",
        ),
        (
            Demand,
            "core/demand.py: build",
            "request_id prompts sequences prompt_tokens exact cached_tokens uncached_tokens max_new_tokens "
            "kv_tokens mamba_slots projected_bytes chunk_size priority arrived_at deadline own_schedule "
            "logprob_start",
        ),
    ],
)
def test_values_built_positionally_keep_their_field_order(cls: type, where: str, order: str) -> None:
    """These are built positionally on every gated request (cheaper than by keyword): a field added
    or moved must be added or moved there too, or every later field takes its neighbour's value."""
    assert [f.name for f in dataclasses.fields(cls)] == order.split(), f"update {where} (positional)"


@pytest.mark.parametrize("cls", [Charge, LedgerTotals], ids=lambda c: c.__qualname__)
def test_the_positional_builder_builds_what_the_keywords_build(cls: type) -> None:
    """``values.positional``: every field, in declaration order, lands in its own slot; the value is
    the one ``cls(**fields)`` builds (equal, frozen, hashable alike, picklable); a field short fails."""
    names = [f.name for f in dataclasses.fields(cls)]
    build = positional(cls)
    values = [_marker(n) for n in names]
    fast = build(*values)
    assert type(fast) is cls
    assert fast == cls(**dict(zip(names, values, strict=True)))
    assert [getattr(fast, n) for n in names] == values
    assert hash(fast) == hash(cls(**dict(zip(names, values, strict=True))))
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(fast, names[0], 1)
    assert pickle.loads(pickle.dumps(fast)) == fast
    with pytest.raises(TypeError):
        build(*values[:-1])


def test_the_positional_builder_refuses_a_value_set_after_init() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Later:
        a: int
        b: int = dataclasses.field(default=0, init=False)

    with pytest.raises(TypeError, match="Later"):
        positional(Later)
