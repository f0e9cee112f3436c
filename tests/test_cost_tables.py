"""The projection's memo (``cost._tables``, issue #27): a shape projected before is one lookup, a
projection with other terms never reads or fills it, and its tables stay bounded.

A gated request projects its shape two to three times (demand, the guard's final peak, a
re-decision); the sum of the terms was ~5 % of its CPU. These tests count the sums and the shapes
built (``monkeypatch`` wraps the module's own functions), and read the tables' sizes: the memo's
whole promise is what it spares and that it does not grow without bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from sidecar.core import cost
from sidecar.core.cost import Shape, activations, fixed, project_bytes, project_shape, shape
from sidecar.core.rules import CostModel

MiB = 1 << 20


@pytest.fixture(autouse=True)
def empty_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from an empty memo (other tests' cost models fill the shared one)."""
    monkeypatch.setattr(cost, "_MEMO", {})


def fresh(activation: int = 1_000) -> CostModel:
    """A cost model of its own (the memo is keyed by the model itself)."""
    return CostModel(8 * MiB, activation, 300, 2, 1 << 30, 1.5, chunk_context_bytes=0.25)


def counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list[tuple[Any, ...]]:
    """Record every call of ``cost.<name>`` (made through the module, as its callers make them)."""
    calls: list[tuple[Any, ...]] = []
    real: Callable[..., Any] = getattr(cost, name)

    def spy(*args: Any) -> Any:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(cost, name, spy)
    return calls


def test_a_shape_projected_before_is_not_summed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    sums = counted(monkeypatch, "_project")
    c = fresh()
    s = Shape(50_000, 50_000, 8_192)
    first = project_bytes(c, s)
    assert project_bytes(c, s) == project_bytes(c, Shape(50_000, 50_000, 8_192)) == first
    assert len(sums) == 1
    # Another model with the same coefficients is another entry; the first model's is still there.
    assert project_bytes(fresh(), s) == first and len(sums) == 2
    assert project_bytes(c, s) == first and len(sums) == 2


def test_arguments_projected_before_build_no_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    c = fresh()
    projections = counted(monkeypatch, "project_bytes")
    args = (40_000, 12_000, 8_192, 4, 900)
    first = project_shape(c, *args)
    assert [project_shape(c, *args) for _ in range(3)] == [first] * 3
    assert len(projections) == 1


def test_other_terms_are_summed_alone_and_never_memoised() -> None:
    """``project_bytes(c, s, terms)`` prices only ``terms`` (margin included), whatever the memo holds
    for the full sum, and leaves the full sum's memo as it was."""
    c = fresh()
    s = Shape(20_000, 20_000, 8_192)
    full = project_bytes(c, s)
    part = (fixed, activations)
    assert project_bytes(c, s, part) == int((8 * MiB + 1_000 * 8_192) * 1.5)
    assert project_bytes(c, s, part) < full == project_bytes(c, s)
    assert project_bytes(c, Shape(20_000, 20_000, 4_096), part) == int((8 * MiB + 1_000 * 4_096) * 1.5)
    # Two other sets of terms for one shape: neither answers for the other.
    assert project_bytes(c, s, (fixed,)) == int(8 * MiB * 1.5)
    assert project_bytes(c, s, part) == int((8 * MiB + 1_000 * 8_192) * 1.5)


def test_a_cost_models_table_is_emptied_when_full() -> None:
    c = fresh()
    shapes, arguments = cost._tables(c)[1:]
    for p in range(1, cost._MEMO_SHAPES + 2):
        project_bytes(c, Shape(p, p, 8_192))
        project_shape(c, p, p, 8_192)
        assert len(shapes) <= cost._MEMO_SHAPES and len(arguments) <= cost._MEMO_SHAPES
    # Emptied, not stale: the figures after the clear are the sums.
    assert project_bytes(c, Shape(7, 7, 8_192)) == cost._project(c, Shape(7, 7, 8_192), cost.TERMS)
    assert project_shape(c, 7, 7, 8_192) == cost._project(c, shape(7, 7, 8_192), cost.TERMS)


def test_the_memo_keeps_a_bounded_number_of_cost_models() -> None:
    models = [fresh(activation=1_000 + i) for i in range(cost._MEMO_MODELS + 3)]
    s = Shape(9_000, 9_000, 8_192)
    for i, c in enumerate(models):
        terms = 8 * MiB + (1_000 + i) * 8_192 + 300 * 9_000 + 0.25 * 8_192 * 9_000 + 2 * 9_000
        assert project_bytes(c, s) == int(terms * 1.5)
        assert len(cost._MEMO) <= cost._MEMO_MODELS
        assert cost._MEMO[id(c)][0] is c
