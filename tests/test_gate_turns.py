"""The proxy's gate turns (issue #27, bursts): a burst's gate work is spread over event-loop turns, in
arrival order, so that the engine's answers to its first requests are read between them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from sidecar.http.proxy import _Turns
from tests.harness import FakeEngine, eventually, gen, lane


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def _burst(turns: _Turns, clock: Clock, n: int, gate_s: float) -> list[tuple[int, int]]:
    """``n`` requests arriving in one loop turn, each doing ``gate_s`` of gate work once let in: the
    (request, loop turn) each started its gate in, in the order they started."""
    loop_turn = [0]
    started: list[tuple[int, int]] = []
    stop = asyncio.Event()

    async def count_turns() -> None:
        while not stop.is_set():
            await asyncio.sleep(0)
            loop_turn[0] += 1

    async def request(i: int) -> None:
        await turns.enter()
        started.append((i, loop_turn[0]))
        clock.now += gate_s  # its gate work, on the clock

    counter = asyncio.ensure_future(count_turns())
    await asyncio.gather(*(request(i) for i in range(n)))
    stop.set()
    await counter
    return started


async def test_a_burst_is_let_in_over_several_turns_in_arrival_order() -> None:
    clock = Clock()
    started = await _burst(_Turns(budget_s=1.0, clock=clock, min_per_turn=1), clock, n=12, gate_s=0.25)
    assert [i for i, _ in started] == list(range(12)), "arrival order"
    per_turn: dict[int, int] = {}
    for _, turn in started:
        per_turn[turn] = per_turn.get(turn, 0) + 1
    assert len(per_turn) >= 3, f"one turn did all the gates: {per_turn}"
    # The first turn holds as many gates as the budget (1 s of 0.25 s gates), every later one at least one.
    assert next(iter(per_turn.values())) == 4


async def test_requests_that_fit_one_turn_are_not_delayed() -> None:
    clock = Clock()
    started = await _burst(_Turns(budget_s=1.0, clock=clock, min_per_turn=1), clock, n=3, gate_s=0.1)
    assert len({turn for _, turn in started}) == 1


async def test_a_turn_lets_in_at_least_its_minimum_whatever_the_gates_cost() -> None:
    """At saturation a time budget alone let a couple of gates through a turn: the loop's per-turn
    costs then outweighed the gates. A turn lets in ``min_per_turn`` however long they take."""
    clock = Clock()
    started = await _burst(_Turns(budget_s=1.0, clock=clock, min_per_turn=5), clock, n=12, gate_s=2.0)
    per_turn: dict[int, int] = {}
    for _, turn in started:
        per_turn[turn] = per_turn.get(turn, 0) + 1
    assert list(per_turn.values()) == [5, 5, 2]


async def test_a_waiter_whose_client_left_is_skipped_and_the_rest_still_go() -> None:
    clock = Clock()
    turns = _Turns(budget_s=1.0, clock=clock, min_per_turn=1)

    async def request(i: int) -> int:
        await turns.enter()
        clock.now += 2.0  # a gate longer than the budget: the others of this turn wait
        return i

    tasks = [asyncio.ensure_future(request(i)) for i in range(4)]
    await asyncio.sleep(0)  # one loop turn: the first is let in, the other three wait
    assert [t.done() for t in tasks] == [True, False, False, False] and len(turns._queue) == 3
    tasks[1].cancel()  # its client left while it waited
    done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
    gone = [i for i, r in enumerate(done) if isinstance(r, asyncio.CancelledError)]
    assert gone == [1] and [r for r in done if isinstance(r, int)] == [0, 2, 3]
    assert not turns._queue


class _SteppingClock:
    """Each reading 2 s after the last: every gate after a turn's first has spent the turn's budget."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 2.0
        return self.now


class _CountingTurns(_Turns):
    __slots__ = ("waited",)

    def __init__(self) -> None:
        super().__init__(budget_s=1.0, clock=_SteppingClock(), min_per_turn=1)
        self.waited = 0

    async def wait(self) -> None:
        self.waited += 1
        await super().wait()


async def test_a_burst_through_the_proxy_does_its_gate_work_in_turns(tmp_path: Path) -> None:
    """The real proxy (a real engine-shaped upstream on loopback) takes every gated request through
    its gate turns: 6 requests arriving in one loop turn, a turn's budget spent by its first gate, so
    5 wait for later turns; every one is then answered 200, and the ledger is empty at the end. Fails
    if the gated path stops passing the turns (``waited`` stays 0)."""
    async with lane(tmp_path, FakeEngine(events=1)) as (_, app, _gpu):
        turns = app.proxy.turns = _CountingTurns()

        async def one(i: int) -> list[dict[str, Any]]:
            body = json.dumps(gen(stream=False, tokens=100, rid=f"burst-{i}")).encode()
            scope = {
                "type": "http",
                "http_version": "1.1",
                "method": "POST",
                "scheme": "http",
                "path": "/generate",
                "raw_path": b"/generate",
                "query_string": b"",
                "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
                "client": ("127.0.0.1", 50000 + i),
                "server": ("127.0.0.1", 8000),
            }
            sent: list[dict[str, Any]] = []
            done = asyncio.Event()
            parts = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive() -> dict[str, Any]:
                if parts:
                    return parts.pop()
                await done.wait()  # the client stays until its answer is complete
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    done.set()

            await app(scope, receive, send)
            return sent

        cycles = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(6))), timeout=30)
        statuses = [next(m["status"] for m in sent if m["type"] == "http.response.start") for sent in cycles]
        assert statuses == [200] * 6
        assert turns.waited == 5
        await eventually(lambda: len(app.admission.ledger) == 0)
