"""The decision line's context written from JSON fragments kept per snapshot (``telemetry.context_members``,
``telemetry.spliced``): the same bytes as one ``orjson.dumps`` of the record merged with the context's
dict, whatever the snapshot holds (no engine report, no GPU reading, NaN usage, ages below zero). A
decision-log file's line is built later, after the loop's turn, from what the decision took by value
(``Telemetry.capture``, ``telemetry.render_decision``): the same bytes as the line of that instant."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.app import SidecarApp
from sidecar.core import demand
from sidecar.ops.telemetry import _line, context_dict, context_members, decision_record, spliced
from sidecar.signals.gpu import parse_gpu_source
from tests.conftest import small_policy, snapshot

NOW = 1000.0


def _app(tmp_path: Path) -> SidecarApp:
    gpu = tmp_path / "gpu.json"
    gpu.write_text('{"free_bytes": 1, "total_bytes": 2}')
    return SidecarApp(
        upstream="http://127.0.0.1:9",
        policy=small_policy(),
        gpu_source=parse_gpu_source(f"file:{gpu}"),
        clock=lambda: NOW,
    )


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
def test_the_spliced_line_is_the_merged_record(tmp_path: Path, snap, shadow: bool) -> None:  # type: ignore[no-untyped-def]
    app = _app(tmp_path)
    a = app.admission
    a.shadow = shadow
    a.update_snapshot(snap)
    want = demand.build(a.rules, 100, arrived_at=NOW, request_id="r-1")
    d = a.evaluate(want)
    for held in (0, 7):
        a._queue.live = held  # type: ignore[misc]  # the held count the context reports
        record = decision_record(d, want, 0.01234, a.ledger.totals, {})
        merged = decision_record(d, want, 0.01234, a.ledger.totals, context_dict(app._log_capture()))
        members = context_members(app._log_capture())
        assert members is not None
        line = spliced(record, members)
        record["ts"] = merged["ts"]  # the same instant in both
        assert spliced(record, members) == _line(merged).encode()
        assert line is not None


def test_a_record_orjson_refuses_goes_the_dicts_way() -> None:
    assert spliced({"big": 1 << 70}, (b'"held":', b"0")) is None
    assert spliced({"a": 1}, ()) == b'{"a":1}'


async def test_lines_put_after_each_write_all_reach_the_stream() -> None:
    """The writer sleeps on a lock that a put into an empty buffer releases: a line put after each
    batch went out (the buffer empty again, the lock taken again) still wakes it, and close() writes
    what is queued."""
    import io

    from sidecar.ops.telemetry import LineWriter
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


def test_the_records_decision_members_are_decision_fields(tmp_path: Path) -> None:
    """``decision_record`` writes the decision's members itself (no call, no merge): the same members,
    in the same order, as ``decision_fields`` (the 503 body's and explain's), for every kind of check
    (limit or none, note or none) and a wait of exactly 0 (its own rounding) or not."""
    from sidecar.core.decision import Action, Check, Decision, Reason
    from sidecar.http.answers import decision_fields

    app = _app(tmp_path)
    a = app.admission
    a.update_snapshot(snapshot(NOW - 0.25))
    want = demand.build(a.rules, 100, arrived_at=NOW, request_id='r"1é')
    checks = (Check("kv_pool", True, 1, 2.5), Check("unfit_request", False, 3, None, "too big", "context"))
    for d in (a.evaluate(want), Decision(Action.REJECT, Reason.UNFIT_REQUEST, 7, -5, checks)):
        for waited, rounded in ((0.0, 0.0), (-0.0, -0.0), (0.123456, 0.1235)):
            record = decision_record(d, want, waited, a.ledger.totals, {"held": 1}, 1796600000.125)
            fields = decision_fields(d, want)
            assert list(record) == ["ts", "event", *fields, "waited_s", "ledger", "held"]
            assert {k: record[k] for k in fields} == fields
            assert repr(record["waited_s"]) == repr(rounded)
            assert record["ts"] == 1796600000.125


def test_the_wall_clock_is_written_to_the_millisecond() -> None:
    import time

    from sidecar.ops.telemetry import wall_ts

    before = time.time()
    ts = wall_ts()
    after = time.time()
    assert before - 0.001 <= ts <= after + 0.001
    assert ts == round(ts, 3)
    text = orjson.dumps(ts).decode()
    assert len(text.partition(".")[2]) <= 3


@settings(max_examples=3000, deadline=None)
@given(
    st.one_of(
        st.floats(min_value=0.0),
        st.sampled_from([math.nan, math.inf]),
        st.floats(0.0, 1e4),
        st.integers(0, 10**13).map(lambda k: (k + 0.5) / 1000),
        st.integers(0, 10**13).map(lambda k: math.nextafter((k + 0.5) / 1000, math.inf)),
        st.integers(0, 10**13).map(lambda k: math.nextafter((k + 0.5) / 1000, -math.inf)),
        st.sampled_from([5e-4, 1.0005, 2.0005, 1e9 + 0.0005, 1e12, 1e9]),
    )
)
def test_round_ms_is_round_to_three_places(x: float) -> None:
    """A signal's age, rounded without dtoa where that cannot differ (half-way cases, ties to even,
    huge values, NaN and infinity go ``round``'s way): the same float, sign and all."""
    from sidecar.ops.telemetry import round_ms

    assert repr(round_ms(x)) == repr(round(x, 3))
    assert orjson.dumps(round_ms(x)) == orjson.dumps(round(x, 3))


def test_a_deferred_line_is_the_lane_at_its_decision(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A decision-log file's line is built after the loop's turn, later (``render_decision``), from
    what ``Telemetry.decision`` took at the decision: a snapshot, a held count and a wall clock that
    changed before the writer ran do not reach it. The line is the in-loop line of that instant."""
    import io

    import sidecar.ops.telemetry
    from sidecar.ops.telemetry import Telemetry, render_decision

    app = _app(tmp_path)
    a = app.admission
    a.update_snapshot(snapshot(NOW - 0.25))
    a._queue.live = 3  # type: ignore[misc]
    want = demand.build(a.rules, 100, arrived_at=NOW, request_id="r-1")
    d = a.evaluate(want)
    record = decision_record(d, want, 0.5, a.ledger.totals, {})
    members = context_members(app._log_capture())
    assert members is not None
    telemetry = Telemetry(type(app.registry)(), io.StringIO())
    telemetry.capture = app._log_capture
    assert telemetry._writer is not None
    taken: list[object] = []
    telemetry._writer.put = taken.append  # type: ignore[method-assign]  # what the writer would render
    clock = iter([1796600000.125, 1796600009.5])  # the decision's instant, then any later reading
    monkeypatch.setattr(sidecar.ops.telemetry, "wall_ts", lambda: next(clock))
    telemetry.decision(d, want, 0.5, a.ledger.totals)
    a.update_snapshot(snapshot(NOW - 0.01, free_bytes=None))  # a new snapshot, no GPU reading
    a._queue.live = 9  # type: ignore[misc]
    (item,) = taken
    line = render_decision(item)  # type: ignore[arg-type]
    record["ts"] = 1796600000.125
    assert line == spliced(record, members)
    fields = orjson.loads(line)
    assert fields["held"] == 3 and fields["gpu"] is not None  # the new snapshot has no GPU reading


def test_a_deferred_line_orjson_refuses_is_the_merged_dicts(tmp_path: Path) -> None:
    """``render_decision`` where orjson refuses the record (an integer past 64 bits): the merged dict
    through ``_line`` (the standard encoder), the context included, as the in-loop line was."""
    from sidecar.core.decision import Action, Decision
    from sidecar.ops.telemetry import render_decision

    app = _app(tmp_path)
    a = app.admission
    a.update_snapshot(snapshot(NOW - 0.25))
    want = replace(demand.build(a.rules, 100, arrived_at=NOW, request_id="r-2"), projected_bytes=1 << 70)
    d = Decision(Action.ADMIT, None, None, 5, ())
    line = render_decision((d, want, 0.0, a.ledger.totals, 1796600000.125, app._log_capture()))
    merged = decision_record(d, want, 0.0, a.ledger.totals, context_dict(app._log_capture()), 1796600000.125)
    assert line == _line(merged).encode()
    assert b'"projected_bytes":%d' % (1 << 70) in line and b'"gpu":{' in line


def test_a_line_that_cannot_be_rendered_is_dropped_counted_and_the_rest_written() -> None:
    """The writer renders what is not bytes; an item whose rendering raises is dropped and counted
    (``decision_log_dropped_total``), logged, and the lines before and after it still go out."""
    import io

    from sidecar.ops.telemetry import LineWriter

    def render(item: object) -> bytes:
        if item == "bad":
            raise ValueError("cannot render")
        return str(item).encode()

    out = io.StringIO()
    writer = LineWriter(out, batch_s=0.0, render=render)
    for item in (b"1", "bad", 2):
        writer.put(item)
    writer.close()
    assert out.getvalue().splitlines() == ["1", "2"]
    assert writer.dropped == 1


async def test_items_are_rendered_on_the_loop_after_its_turn_in_one_batch_in_order() -> None:
    """On a running loop, ``put`` only queues an item: the turn's items are rendered together once the
    turn is done, on the loop's thread (the values never cross to the writer's), and bytes put while
    items wait keep their place. ``close`` renders what still waits; the bound counts what waits."""
    import asyncio
    import io
    import threading

    from sidecar.ops.telemetry import LineWriter
    from tests.harness import eventually

    rendered: list[tuple[object, int]] = []

    def render(item: object) -> bytes:
        rendered.append((item, threading.get_ident()))
        return str(item).encode()

    out = io.StringIO()
    writer = LineWriter(out, batch_s=0.0, render=render)
    writer.put(b"a")  # nothing waits: straight to the writer
    for item in (1, 2):
        writer.put(item)
    writer.put(b"b")  # behind the items that wait
    writer.put(3)
    assert rendered == []  # not in the putting request's turn
    await asyncio.sleep(0)  # the turn ends
    assert [i for i, _ in rendered] == [1, 2, 3]
    assert {t for _, t in rendered} == {threading.get_ident()}
    await eventually(lambda: out.getvalue() == "a\n1\n2\nb\n3\n")
    writer.put(4)
    writer.close()  # renders 4 first
    assert out.getvalue().splitlines() == ["a", "1", "2", "b", "3", "4"]
    assert writer.dropped == 0

    # A turn renders at most RENDER_PER_TURN lines; the rest go in the turns after, in order.
    many = LineWriter(io.StringIO(), render=render)
    rendered.clear()
    for item in range(LineWriter.RENDER_PER_TURN * 2 + 5):
        many.put(item)
    await asyncio.sleep(0)
    assert len(rendered) == LineWriter.RENDER_PER_TURN
    await eventually(lambda: len(rendered) == LineWriter.RENDER_PER_TURN * 2 + 5)
    many.close()
    assert many.stream.getvalue().splitlines() == [str(i) for i in range(LineWriter.RENDER_PER_TURN * 2 + 5)]

    bounded = LineWriter(io.StringIO(), max_pending=3, render=render)
    for item in range(5):
        bounded.put(item)
    assert bounded.dropped == 2  # the three waiting to be rendered fill the bound
    bounded.close()
    assert bounded.stream.getvalue().splitlines() == ["0", "1", "2"]
