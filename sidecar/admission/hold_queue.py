"""The hold queue's structure: held requests in the order the gate takes them, and their oldest arrival.

Pure and synchronous (no clock, no asyncio). What the controller needs of it, each without touching
every held request (issue #27: 2,000 held cost ~9 admissions/s when each event walked them all):

* ``push``: a bisection and an insert (a newcomer of its priority lands at the end of it: an append);
* ``walk``: the live entries in order, lazily, so a walk that stops at the first request that cannot go
  costs what it visits; a push during the walk ends it (``version`` tells the walker);
* ``head``: the first live entry, dropping the dead prefix in one slice;
* ``oldest_arrival``: the earliest arrival among the live entries (a heap, its dead tops dropped).

Removal is lazy: an entry that left is one whose ``held`` is False (the controller then calls ``left``),
found dead when it surfaces; the lists are compacted past 2 x live + 16 entries (a memory bound).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class Entry(Protocol):
    """What the queue reads of a held request (``controller.Handle``)."""

    @property
    def held(self) -> bool: ...

    sort_key: tuple[int, int]

    def __lt__(self, other: Entry, /) -> bool: ...


E = TypeVar("E", bound=Entry)


@dataclass(slots=True)
class HoldQueue(Generic[E]):
    """Priority then arrival; see the module docstring. ``tokens`` is the controller's to keep (it
    knows what an entry weighs)."""

    items: list[E] = field(default_factory=list)
    live: int = 0
    # Uncached prompt tokens of the held requests (the work they add ahead of a newcomer: Retry-After).
    tokens: int = 0
    # Bumped by every push: a walk in progress stops (its indices moved).
    version: int = 0
    _arrivals: list[tuple[float, int, E]] = field(default_factory=list)

    def push(self, e: E, arrived_at: float) -> None:
        items = self.items
        if not items or not e < items[-1]:
            items.append(e)  # the common case: a newcomer of the lowest priority held
        else:
            bisect.insort(items, e)
        heapq.heappush(self._arrivals, (arrived_at, e.sort_key[1], e))
        self.live += 1
        self.version += 1

    def left(self) -> None:
        """An entry stopped being held (its ``held`` is False now): counted, and the lists compacted
        once the entries that left outnumber the live ones (more than 2 x live + 16 in all)."""
        self.live -= 1
        bound = 2 * self.live + 16
        if len(self.items) > bound:
            self.items = [x for x in self.items if x.held]
        if len(self._arrivals) > bound:
            self._arrivals = [a for a in self._arrivals if a[2].held]
            heapq.heapify(self._arrivals)

    def walk(self) -> Iterator[E]:
        """The live entries in order, from the head; stops early if the queue is pushed to meanwhile
        (the caller walks again from the head). Entries leaving during the walk are skipped."""
        items, version, i = self.items, self.version, 0
        while i < len(items) and self.version == version:
            e = items[i]
            i += 1
            if e.held:
                yield e

    def head(self) -> E | None:
        items = self.items
        dead = 0
        while dead < len(items) and not items[dead].held:
            dead += 1
        if dead:
            del items[:dead]
        return items[0] if items else None

    def oldest_arrival(self) -> float | None:
        arrivals = self._arrivals
        while arrivals and not arrivals[0][2].held:
            heapq.heappop(arrivals)
        return arrivals[0][0] if arrivals else None

    def all_live(self) -> list[E]:
        """Every live entry (a policy reload prices them all again: O(held), rarely)."""
        return [e for e in self.items if e.held]
