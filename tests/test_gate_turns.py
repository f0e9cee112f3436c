"""The proxy's gate turns (issue #27, bursts): a burst's gate work is spread over event-loop turns, in
arrival order, so that the engine's answers to its first requests are read between them."""

from __future__ import annotations

import asyncio

from sidecar.http.proxy import _Turns


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
