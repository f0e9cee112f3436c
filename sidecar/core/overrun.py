"""The in-flight prefill guard: which admitted requests, still prefilling, must be aborted now.

When the rules tighten (the monitor raised the margin) or the room shrinks (another process grew), a
prefill whose repriced peak no longer fits would kill the engine at its last chunk; aborted before it,
it costs only itself (503 ``prefill_overrun``). The rule is :func:`overruns`; progress comes from the
engine's counters (:class:`PrefillProgress`). ``docs/design.md`` gives the reasoning. Pure: no I/O, no
clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sidecar.core.cost import project_at_progress, project_own, project_shape
from sidecar.core.decide import headroom_bytes
from sidecar.core.decision import Action, Check, Decision, Reason
from sidecar.core.demand import Demand, reprice
from sidecar.core.ledger import LedgerTotals
from sidecar.core.rules import CostModel, Rules
from sidecar.core.snapshot import Snapshot


@dataclass(frozen=True, slots=True)
class Prefill:
    """One admitted request whose prefill has not finished (no first byte yet), in admission order."""

    key: int
    demand: Demand
    # Prompt tokens the engine has computed for it, an upper bound (None: unknown, no counter).
    done_tokens: int | None = None
    # Whether the counter has shown its first batch: only then is its cache hit counted, and bounded
    # by ``cached_bound`` (the cache counter's growth over the in-flight prefills).
    started: bool = False
    cached_bound: int = 0
    # Prompt tokens the counter showed computed for it when it was read, without the allowance for
    # what the engine computed since: a lower bound of its progress then (None: no counter).
    counted_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Overrun:
    """A verdict of the guard: abort this prefill now."""

    key: int
    request_id: str
    # Its peak under the rules now in force, and what it had to fit in (the cap for an unfit one).
    projected_bytes: int
    room_bytes: int
    # False: larger than the lane can ever run under these rules (no Retry-After).
    fits_idle: bool
    why: str

    def fields(self) -> dict[str, object]:
        """For ``/admission/state`` and the log."""
        return {
            "request_id": self.request_id,
            "projected_bytes": self.projected_bytes,
            "room_bytes": self.room_bytes,
            "retry": self.fits_idle,
            "why": self.why,
        }


def rejection(o: Overrun, admitted: Decision, retry_after_s: int | None) -> Decision:
    """The verdict an aborted request ends with: its admission's checks and charge, then the guard's
    check (``limit="transient"`` when it can never fit: answered as an unfit request)."""
    check = Check(
        Reason.PREFILL_OVERRUN.value,
        False,
        o.projected_bytes,
        o.room_bytes,
        o.why,
        "" if o.fits_idle else "transient",
    )
    retry = retry_after_s if o.fits_idle else None
    checks = (*admitted.checks, check)
    return Decision(
        Action.REJECT, Reason.PREFILL_OVERRUN, retry, o.room_bytes, checks, admitted.charge, check.name
    )


def overruns(
    prefills: Sequence[Prefill], rules: Rules, snap: Snapshot, running: int = 0
) -> tuple[Overrun, ...]:
    """The prefills to abort, in the order to abort them (the module docstring's rule). ``running``:
    the admitted requests not ended (the in-flight prefills included): the batch they all join."""
    if not prefills:
        return ()
    peaks = [peak(rules, p) for p in prefills]
    cap = rules.vram.transient_cap()
    out: list[Overrun] = []
    keep: list[int] = []
    for i, p in enumerate(prefills):
        if cap is not None and peaks[i] > cap:
            why = (
                f"projected peak {_mib(peaks[i])} under the rules now in force exceeds the lane's {_mib(cap)}"
            )
            out.append(Overrun(p.key, p.demand.request_id, peaks[i], cap, False, why))
        else:
            keep.append(i)
    room = None if rules.vram.uses_gpu_signal else headroom_bytes(rules, snap, LedgerTotals())
    if room is None:
        return tuple(out)
    total = sum(peaks[i] for i in keep)
    running -= len(out)
    while keep and rules.cost.at_once(total, running) > room:
        if total > room:
            why = f"in-flight prefills project {_mib(total)} under the rules now in force"
        else:
            join = rules.cost.join_bytes(running)
            why = f"joining the running batch of {running} projects {_mib(join)} under the rules now in force"
        i = keep.pop()  # the youngest
        p = prefills[i]
        out.append(
            Overrun(p.key, p.demand.request_id, peaks[i], room, True, f"{why}, the lane has {_mib(room)} now")
        )
        total -= peaks[i]
        running -= 1
    return tuple(out)


def peak(rules: Rules, p: Prefill) -> int:
    """A prefill's peak under ``rules``: as its admission priced it (``demand.reprice``), and for one
    admitted by its own chunk schedule (``Demand.own_schedule``) that schedule, from the cache hit the
    gate counted until the engine's counters show its first batch, then over every hit up to what the
    cache counter showed (``cost.project_own``: a hit the gate did not count moves its chunks, up to
    a full last chunk, and the guard aborts it then if that no longer fits). Without the counters the
    hit cannot be seen: a full last chunk."""
    d = reprice(rules, p.demand)
    if not d.own_schedule or p.done_tokens is None:
        return d.projected_bytes
    extra = max(0, p.cached_bound - d.cached_tokens) if p.started else 0
    return project_own(rules.cost, d.prompt_tokens, d.uncached_tokens, d.chunk_size, extra)


def in_flight_bytes(prefills: Sequence[Prefill], cost: CostModel) -> int | None:
    """The most the in-flight prefills can allocate now, at the progress they have reached (None when
    it is unknown: the caller then compares with their final peaks, as without a counter).

    A started prefill takes ``cost.project_at_progress`` (its next chunk at the context it can have
    reached, its cache hit bounded by what the cache counter showed). One not started yet may be in
    the batch running now with a cache hit no counter has shown yet, so it takes its final peak;
    unless an earlier one still has a full chunk or more to compute, which fills every batch until
    the next reading: then it cannot be running."""
    total = 0
    alone = False
    for p in prefills:
        if p.done_tokens is None:
            return None
        d = p.demand
        if not p.started:
            if not alone:
                total += project_at_progress(
                    cost, d.prompt_tokens, d.uncached_tokens, d.chunk_size, d.prompt_tokens, 0
                )
            continue
        hit = max(d.cached_tokens, p.cached_bound)
        total += project_at_progress(
            cost, d.prompt_tokens, d.uncached_tokens, d.chunk_size, p.done_tokens, hit
        )
        alone = alone or d.prompt_tokens - hit - p.done_tokens >= d.chunk_size
    return total


def done_bytes(prefills: Sequence[Prefill], cost: CostModel) -> int | None:
    """The least one prefill in flight alone has allocated (margin included): the chunk after those the
    engine's counter showed computed. SGLang counts a chunk after its forward pass (evidence S24) and
    gives the chunked request its next chunk first in the next batch (S26), so while the prefill is in
    flight the engine runs (or has run) that chunk; its context is counted from the cache hit the gate
    counted, a lower bound. 0 before the counter shows its first batch (it may not have run yet); None
    for several prefills or no counter. The monitor bounds the lane's draw from above with it
    (``LaneWatch``: ``draw_bracket``), and only with a counter read no later than the GPU reading."""
    if len(prefills) != 1 or prefills[0].counted_tokens is None:
        return None
    p = prefills[0]
    if not p.started or not p.counted_tokens:
        return 0
    d = p.demand
    return project_at_progress(
        cost, d.prompt_tokens, d.uncached_tokens, d.chunk_size, p.counted_tokens, d.cached_tokens
    )


def final_bytes(d: Demand, cost: CostModel) -> int:
    """The most :func:`in_flight_bytes` can ever count for this prefill: its last chunk's peak under
    ``cost`` (``project_at_progress`` grows with the progress to it), or as priced at its admission
    when that is larger. What the monitor expects from a prefill that ended (``LaneWatch.left``)."""
    # ``project_at_progress(cost, prompt, uncached, chunk, prompt, 0)`` without its frame and its
    # clamps (this runs at every gated request's first byte, issue #27): with all of the prompt done
    # its context is the whole prompt (``tests/test_core_overrun.py`` compares the two).
    u, chunk = d.uncached_tokens, d.chunk_size
    at_end = project_shape(cost, d.prompt_tokens, u, (u if u < chunk else chunk) or 1)
    # max(projected, at_end), without a builtin call.
    return at_end if at_end > d.projected_bytes else d.projected_bytes


class PrefillProgress:
    """The engine's prefill counters attributed to the in-flight prefills, first come first served.

    Each prefill's share is kept as prefills come and go, so a first byte is O(1); a counter older than a
    GPU reading is advanced by ``allowance_rate``. Every estimate errs towards more progress (the safe side
    for the monitor). ``docs/design.md`` (progress) says why the attribution is exact between moves.
    """

    def __init__(self) -> None:
        self.counter: int | None = None
        self.cached: int | None = None
        self.counter_at: float | None = None
        self.base: int | None = None
        self.base_cached = 0
        # The compute counter's growth rate over the last interval between two reports (tokens/s).
        self.rate = 0.0
        # The in-flight prefills (ledger key -> uncached tokens, admission order), the counted tokens
        # attributed to each, and those beyond them all (the next admitted prefill's first).
        self._uncached: dict[int, int] = {}
        self._share: dict[int, int] = {}
        self._spare = 0

    def observe(self, counter: int | None, cached: int | None, at: float, idle: bool) -> None:
        """A new engine report (``counter`` None: the engine does not export it)."""
        if counter is None:
            self.counter = self.cached = self.counter_at = self.base = None
            return
        restarted = self.counter is not None and (
            counter < self.counter or (cached or 0) < (self.cached or 0)
        )
        base = self.base
        if base is None or idle or restarted:
            base, self.base_cached = counter, cached or 0
        if self.counter is not None and self.counter_at is not None and at > self.counter_at:
            self.rate = max(0.0, (counter - self.counter) / (at - self.counter_at))
        self.base, self.counter, self.cached, self.counter_at = base, counter, cached, at
        self._attribute(counter - base)

    def started(self) -> None:
        """The first prefill of an idle ledger was admitted: what the counters show now is older work."""
        if self.counter is not None:
            self.base, self.base_cached = self.counter, self.cached or 0
            self._attribute(0)

    def admitted(self, key: int, uncached: int) -> None:
        """A prefill was admitted (``key`` larger than any in flight): it comes after them all."""
        self._uncached[key] = uncached
        # min(max(0, uncached), spare), without builtin calls: this runs at every admission.
        u, spare = (uncached if uncached > 0 else 0), self._spare
        share = spare if spare < u else u
        self._share[key] = share
        self._spare -= share

    def too_old(self, at: float, allowance_rate: float, chunk: int) -> bool:
        """Whether the counter is older than a reading taken at ``at`` by more than the lane takes to
        compute a chunk (at the allowance's rate): the engine may have run several batches since, and
        an allowance for them would blunt the comparison. The monitor waits for the next report then
        (a caching allocator's reading keeps its peak: nothing is lost by waiting)."""
        if self.counter is None or self.counter_at is None:
            return False
        rate = max(allowance_rate, 2.0 * self.rate)
        return (at - self.counter_at) * rate > chunk

    def done(
        self, uncached: Sequence[int], now: float | None = None, allowance_rate: float = 0.0, chunk: int = 0
    ) -> list[tuple[int, int, int | None]] | None:
        """Per in-flight prefill (admission order): (tokens counted, tokens with the allowance, cache
        hit bound, None when the engine does not count cache hits); None without a counter."""
        if self.counter is None or self.base is None:
            return None
        counted = self.counter - self.base
        extra = 0
        rate = max(allowance_rate, 2.0 * self.rate)
        if now is not None and self.counter_at is not None and now > self.counter_at:
            # What it computed since, and the chunk it may have been finishing when it was read.
            extra = math.ceil((now - self.counter_at) * rate) + chunk
        hits = None if self.cached is None else self.cached - self.base_cached
        out = []
        for u in uncached:
            share = min(max(0, u), max(0, counted))
            reach = min(max(0, u), max(0, counted + extra))
            out.append((share, reach, hits))
            counted -= share
            extra -= reach - share
        return out

    def prefills(
        self, entries: Sequence[tuple[int, Demand]], now: float | None = None, allowance_rate: float = 0.0
    ) -> list[Prefill]:
        """The in-flight prefills with their progress (``done_tokens`` None without a counter)."""
        chunk = max((d.chunk_size for _, d in entries), default=0)
        done = self.done([d.uncached_tokens for _, d in entries], now, allowance_rate, chunk)
        if done is None:
            return [Prefill(k, d) for k, d in entries]
        out = []
        for (k, d), (share, reach, hits) in zip(entries, done, strict=True):
            # Without a cache counter a hit is unbounded: the whole prompt may have come from the cache.
            bound = d.prompt_tokens if hits is None else hits
            out.append(Prefill(k, d, reach, share > 0, bound, share))
        return out

    def left(self, key: int) -> None:
        """The prefill ``key`` (admitted) left (its first byte, an abort, a failure): its share so far is
        done work. O(1): the others keep their shares (the class docstring says why)."""
        del self._uncached[key]
        share = self._share.pop(key)
        if self.base is not None:
            self.base += share

    def _attribute(self, counted: int) -> None:
        """Each in-flight prefill's share of the ``counted`` tokens, the oldest first (as ``done``)."""
        for key, u in self._uncached.items():
            share = min(max(0, u), max(0, counted))
            self._share[key] = share
            counted -= share
        self._spare = counted if counted > 0 else 0  # max(0, counted)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"
