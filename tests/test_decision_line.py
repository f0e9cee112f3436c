"""The decision line written from the values (``decision_line.line_text``, with the context written
once per snapshot: ``context_fragments``, ``context_text``) is the same text as one ``orjson.dumps`` of
the record merged with the context's dict (``decision_record``), byte for byte: for generated decisions
(every action and reason, absent values, huge integers, floats that round to integers, NaN and the
infinities, request ids with quotes, control and non-ASCII characters), and for the real app's context
whatever the snapshot holds (no engine report, no GPU reading, NaN usage, ages below zero)."""

from __future__ import annotations

import io
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.app import SidecarApp
from sidecar.core import demand
from sidecar.core.decision import Action, Check, Decision, Reason
from sidecar.core.demand import Demand
from sidecar.core.ledger import LedgerTotals
from sidecar.ops.decision_line import context_fragments, context_text, decision_record, line_text
from sidecar.ops.telemetry import LineWriter, _line
from sidecar.signals.gpu import parse_gpu_source
from tests.conftest import small_policy, snapshot

NOW = 1000.0


def _app(tmp_path: Path, log: io.StringIO | None = None) -> SidecarApp:
    gpu = tmp_path / "gpu.json"
    gpu.write_text('{"free_bytes": 1, "total_bytes": 2}')
    return SidecarApp(
        upstream="http://127.0.0.1:9",
        policy=small_policy(),
        gpu_source=parse_gpu_source(f"file:{gpu}"),
        clock=lambda: NOW,
        decision_log=log,
    )


def _reference(record: dict[str, Any]) -> bytes:
    """What the dict's way writes: orjson, or the standard encoder for what orjson refuses."""
    return _line(record).encode()


@pytest.mark.parametrize(
    "snap",
    [
        snapshot(NOW - 0.25),
        snapshot(NOW + 3.0),  # read "after" now: age 0.0, as max(0.0, age) gave
        snapshot(NOW - 1.0, free_bytes=None),  # no GPU reading
        replace(snapshot(NOW - 0.5), engine=None),  # no engine report
        replace(snapshot(NOW - 0.5, free_bytes=None), engine=None),  # neither
        snapshot(NOW - 0.1234567, full_token_usage=float("nan"), pending_prefill_tokens=None),
    ],
)
@pytest.mark.parametrize("shadow", [False, True])
def test_the_apps_line_is_the_merged_record(tmp_path: Path, snap, shadow: bool) -> None:  # type: ignore[no-untyped-def]
    """The app's context as text (``_log_context_text``) ends the line as its dict (``_log_context``)
    would, and ``Telemetry.decision`` writes that line to the decision log."""
    log = io.StringIO()
    app = _app(tmp_path, log)
    a = app.admission
    a.shadow = shadow
    a.update_snapshot(snap)
    want = demand.build(a.rules, 100, arrived_at=NOW, request_id="r-1")
    d = a.evaluate(want)
    for held in (0, 7):
        a._queue.live = held  # type: ignore[misc]  # the held count the context reports
        context = app._log_context_text()
        assert context is not None
        line = line_text(d, want, 0.01234, a.ledger.totals, 1796600000.0625, context)
        merged = decision_record(d, want, 0.01234, a.ledger.totals, app._log_context(), 1796600000.0625)
        assert line is not None
        assert line.encode() == _reference(merged)
        app.telemetry.decision(d, want, 0.01234, a.ledger.totals)
    app.telemetry.close()
    for written in log.getvalue().splitlines():
        ts = json.loads(written)["ts"]
        merged = decision_record(d, want, 0.01234, a.ledger.totals, app._log_context(), ts)
        assert written.encode() == _reference({**merged, "held": json.loads(written)["held"]})


# -- generated decisions ----------------------------------------------------------------------------

# orjson writes integers in [-2**63, 2**64 - 1]: both sides of both ends, and the common small counts.
INTS = st.one_of(
    st.integers(0, 10**6),
    st.integers(-(2**63) - 2, -(2**63) + 2),
    st.integers(2**64 - 3, 2**64 + 2),
    st.integers(-(10**30), 10**30),
)
COUNTS = st.one_of(st.integers(0, 10**6), st.integers(0, 2**64 + 2), st.integers(-(2**63) - 2, 10**3))
# Floats of every kind: NaN, the infinities, -0.0, tiny and huge; integers as floats; and values one
# step either side of a rounding boundary (x.xxx5), where a wrong rounding would show.
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-1e12, 1e12),
    st.integers(-(10**9), 10**12).map(float),
    st.integers(-(10**12), 10**12).map(lambda k: (k + 0.5) / 10**4),
    st.integers(-(10**12), 10**12).map(lambda k: math.nextafter((k + 0.5) / 10**3, math.inf)),
    st.integers(-(10**12), 10**12).map(lambda k: math.nextafter((k + 0.5) / 10**3, -math.inf)),
    st.sampled_from([0.0, -0.0, 1e10, -1e10, 9999999999.9995, 0.00005, 0.0005, 1e-5, 1e16, 2.5e-5]),
)
NUMBERS = st.one_of(st.none(), INTS, FLOATS)
# Any text: quotes, backslashes, control characters, non-ASCII, and lone surrogates (which orjson
# refuses: the dict's way then writes them as the standard encoder does).
TEXT = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(codec=None, exclude_categories=()), max_size=12),
    st.sampled_from(["", "a\"b", "\\", "\x00\x1f\x7f", "é€😀", "\u2028", "\ud800", "0123abcdef"]),
)
NAMES = st.one_of(st.sampled_from([r.value for r in Reason] + ["batch_join", "expected_wait"]), TEXT)
CHECKS = st.builds(
    Check, NAMES, st.booleans(), NUMBERS, NUMBERS, st.one_of(st.just(""), TEXT), st.one_of(st.just(""), TEXT)
)
DECISIONS = st.builds(
    Decision,
    action=st.sampled_from(Action),
    reason=st.one_of(st.none(), st.sampled_from(Reason)),
    retry_after_s=st.one_of(st.none(), INTS),
    headroom_bytes=st.one_of(st.none(), INTS),
    checks=st.lists(CHECKS, max_size=6).map(tuple),
)
DEMANDS = st.builds(
    Demand,
    request_id=st.one_of(st.uuids().map(lambda u: u.hex), st.uuids().map(str), TEXT),
    prompts=st.just(1),
    sequences=COUNTS,
    prompt_tokens=COUNTS,
    exact=st.booleans(),
    cached_tokens=COUNTS,
    uncached_tokens=st.just(0),
    max_new_tokens=COUNTS,
    kv_tokens=st.just(0),
    mamba_slots=st.just(0),
    projected_bytes=COUNTS,
    chunk_size=st.just(1),
    priority=st.one_of(st.integers(-100, 100), INTS),
    arrived_at=st.just(0.0),
    deadline=st.just(0.0),
)
LEDGERS = st.builds(LedgerTotals, requests=COUNTS, prefill_tokens=COUNTS, projected_bytes=COUNTS)
SIGNAL = st.one_of(st.none(), st.dictionaries(TEXT, st.one_of(NUMBERS, TEXT), max_size=4))
HEAD = st.one_of(
    st.just({}), st.fixed_dictionaries({"policy": TEXT, "mode": st.sampled_from(["enforce", "shadow"])})
)


@settings(max_examples=1500, deadline=None)
@given(
    d=DECISIONS,
    cost=DEMANDS,
    waited_s=FLOATS,
    ledger=LEDGERS,
    ts=st.one_of(st.floats(1.7e9, 2.1e9), FLOATS),
    head=HEAD,
    engine=SIGNAL,
    gpu=SIGNAL,
    held=st.integers(0, 10**5),
    ages=st.tuples(FLOATS, FLOATS),
    with_context=st.booleans(),
)
def test_the_fast_line_is_the_dicts_line(  # type: ignore[no-untyped-def]
    d, cost, waited_s, ledger, ts, head, engine, gpu, held, ages, with_context
) -> None:
    """Where orjson writes the merged record, ``line_text`` writes the same bytes; where orjson refuses
    it, ``line_text`` refuses too (None: the caller takes the dict's way, the standard encoder's)."""
    context: dict[str, Any] = {}
    text: str | None = ""
    if with_context:
        engine_age = None if engine is None else ages[0]
        gpu_age = None if gpu is None else ages[1]

        def aged(fields: dict[str, Any] | None, age: float | None) -> dict[str, Any] | None:
            if fields is None or age is None:
                return None
            return {**fields, "age_s": round(age, 3) if age > 0.0 else 0.0}

        context = {**head, "held": held, "engine": aged(engine, engine_age), "gpu": aged(gpu, gpu_age)}
        parts = context_fragments(head, engine, gpu)
        text = None if parts is None else context_text(parts, held, engine_age, gpu_age)
    record = decision_record(d, cost, waited_s, ledger, context, ts)
    try:
        want: bytes | None = orjson.dumps(record)
    except TypeError:
        want = None
    line = None if text is None else line_text(d, cost, waited_s, ledger, ts, text)
    assert (None if line is None else line.encode()) == want


def test_a_line_orjson_refuses_goes_the_dicts_way(tmp_path: Path) -> None:
    """An integer past 64 bits or a lone surrogate: no fast line, and ``Telemetry.decision`` writes the
    standard encoder's line instead (what it always wrote for these)."""
    log = io.StringIO()
    app = _app(tmp_path, log)
    a = app.admission
    a.update_snapshot(snapshot(NOW - 0.25))
    for rid, tokens in (("\ud800", 100), ("big", 1 << 70)):
        want = demand.build(a.rules, 100, arrived_at=NOW, request_id=rid)
        want = replace(want, prompt_tokens=tokens)
        d = a.evaluate(want)
        assert line_text(d, want, 0.0, a.ledger.totals, NOW, app._log_context_text() or "") is None
        app.telemetry.decision(d, want, 0.0, a.ledger.totals)
    app.telemetry.close()
    lines = [json.loads(x) for x in log.getvalue().splitlines()]
    assert [(x["request_id"], x["prompt_tokens"]) for x in lines] == [("\ud800", 100), ("big", 1 << 70)]
    assert all(x["held"] == 0 and x["engine"]["age_s"] == 0.25 for x in lines)


async def test_lines_put_after_each_write_all_reach_the_stream() -> None:
    """The writer sleeps on a lock that a put into an empty buffer releases: a line put after each
    batch went out (the buffer empty again, the lock taken again) still wakes it, and close() writes
    what is queued."""
    from tests.harness import eventually

    out = io.StringIO()
    writer = LineWriter(out, batch_s=0.0)
    for i in range(20):
        writer.put(b"%d" % i)
        await eventually(lambda i=i: out.getvalue().endswith(f"{i}\n"))
    for i in range(20, 25):
        writer.put(b"%d" % i)
    writer.close()
    assert out.getvalue().splitlines() == [str(i) for i in range(25)]
    assert writer.dropped == 0
