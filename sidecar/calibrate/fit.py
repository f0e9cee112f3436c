"""Qualify a lane: measure what its requests allocate outside the KV pool, and propose a policy.

``sglang-sidecar calibrate`` sends probe requests (token ids, so no tokenizer is needed) to an idle
engine and reads the GPU source before, during and after each one. The fit is the policy's cost model
(``policy.Cost``): fixed, per chunk token, per context token, chunk x context, the capped gather, and
the batch-join term measured with probes that run together.

Why the probe order matters: PyTorch's caching allocator keeps freed blocks reserved, so the engine's
device memory only ever shows a new *high-water mark*. A probe whose peak is below the mark left by an
earlier one is invisible (censored). Probes therefore run in increasing order of their predicted peak
(the starting policy's prediction, then the fit's as it forms), and every censored probe is reported.
What is read is the engine's held memory: ``total - free - other processes`` (per-process memory where
the source reports it, e.g. NVML; plain free memory otherwise), relative to its value before the first
probe. On a real caching allocator the mark can rise by more than the live peak (blocks of a slightly
smaller size cannot be reused), so the fit is an upper bound there; on the emulator's model it is exact.

The fit is linear least squares (non-negative terms), one search over the gather cap's breakpoint,
then an upper envelope: the proposed margin covers the largest observed/predicted ratio and three
standard deviations of the ratios, times a stated safety margin. The longest probe is written into the
proposal (``cost.calibrated_up_to_prompt_tokens``): beyond it the coefficients are extrapolated.

Safety: refuses a busy lane (and stops if traffic appears), never sends a probe whose predicted peak
exceeds the idle headroom, is bounded in tokens and time, never touches the running policy.

This module is the pure part (plan, order, fit, proposal) plus the probe loop over two small
protocols (:class:`Lane`, :class:`Meter`); the HTTP and GPU adapters live in ``calibrate_io``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from sidecar.policy.schema import Cost, Policy

MiB = 1 << 20

# Terms of the prefill fit, in feature order.
PREFILL_TERMS = (
    "fixed_bytes",
    "activation_bytes_per_chunk_token",
    "context_bytes_per_token",
    "chunk_context_bytes",
    "gather_bytes_per_context_token",
)


# ---------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True, slots=True)
class Probe:
    """One probe: ``concurrent`` requests of ``prompt_tokens`` each, sent together.

    ``cached_tokens`` leading tokens are sent once before (a warm-up request) so the probe hits them
    in the radix cache; its context is still the whole prompt.
    """

    name: str
    prompt_tokens: int
    concurrent: int = 1
    cached_tokens: int = 0
    max_new_tokens: int = 1

    @property
    def kind(self) -> str:
        if self.concurrent > 1:
            return f"x{self.concurrent}"
        return "cached" if self.cached_tokens else "alone"

    @property
    def tokens_sent(self) -> int:
        return self.concurrent * self.prompt_tokens + self.cached_tokens


@dataclass(frozen=True, slots=True)
class Bounds:
    max_prompt_tokens: int | None = None
    max_total_tokens: int = 12_000_000
    max_duration_s: float = 900.0
    probe_timeout_s: float = 600.0
    # How often the GPU source is read while a probe runs (an engine without a caching allocator
    # frees its transients at once: only a read during the step sees them).
    sample_interval_s: float = 0.05
    # A probe is sent only if its predicted peak stays below this fraction of the idle headroom.
    headroom_fraction: float = 0.9
    reserve_bytes: int = 0
    # Empty the engine's caches before each probe (SGLang ``POST /flush_cache``: the radix cache and
    # PyTorch's allocator cache), so that each probe is read over a freshly idle engine.
    flush: bool = True
    # How long to wait, after a multi-chunk probe's prefix, for the engine to empty its allocator cache
    # while idle (SGLang ``--sleep-on-idle`` with ``SGLANG_EMPTY_CACHE_INTERVAL``); 0: never wait.
    settle_s: float = 5.0


def plan_probes(
    chunk: int,
    context_len: int,
    *,
    max_prompt_tokens: int | None = None,
    max_total_tokens: int = 12_000_000,
    groups: Sequence[int] = (2, 3),
    cached: bool = False,
) -> list[Probe]:
    """Lengths that identify every term: sub-chunk probes (one chunk: per-chunk-token, product),
    whole multiples of the chunk (the last chunk is full, the context grows: per-context, gather
    and its cap), and small groups (the batch join, as a function of the running batch)."""
    top = min(max_prompt_tokens or context_len, context_len - 64)
    top_multiple = (top // chunk) * chunk
    sub = sorted({max(16, chunk * f // 16) for f in (1, 2, 4, 8, 12)} | {chunk})
    sub = [n for n in sub if n <= top]
    multiples: list[int] = []
    k = 2
    while k * chunk <= top_multiple:
        multiples.append(k * chunk)
        k = k + 1 if k < 4 else math.ceil(k * 1.5)
    if top_multiple > chunk and (not multiples or multiples[-1] != top_multiple):
        multiples.append(top_multiple)
    # A last chunk of 7/8 of a chunk: the one shape that separates the per-chunk-token term from the
    # per-context ones below the gather's cap (its last step outgrows the full chunk before it).
    partial = [k * chunk + chunk * 7 // 8 for k in (1, 2, 3) if k * chunk + chunk * 7 // 8 <= top]
    multiples = sorted(set(multiples) | set(partial))
    probes = [Probe(f"alone-{n}", n) for n in sub + multiples]
    # Keep within the token budget: drop interior long probes first, never the shortest or the top.
    while sum(p.tokens_sent for p in probes) > max_total_tokens and len(multiples) > 5:
        multiples.pop(-2)
        probes = [Probe(f"alone-{n}", n) for n in sub + multiples]
    if cached and multiples:
        prefix = multiples[len(multiples) // 2]
        probes.append(Probe(f"cached-{prefix}+{chunk // 2}", prefix + chunk // 2, cached_tokens=prefix))
    small = max(16, chunk // 16)
    for g in groups:
        # Short prefills and long decodes: the group's requests overlap in the decode batch even when
        # they arrive milliseconds apart.
        if g * small <= chunk:
            probes.append(Probe(f"x{g}-{small}", small, concurrent=g, max_new_tokens=2048))
    return probes


def step_candidates(probe: Probe, chunk: int) -> list[list[tuple[int, int]]]:
    """The prefill steps that can be a probe's largest: (chunk tokens, context) per request.

    The last chunk has the longest context; when it is partial, the full chunk before it may still
    allocate more (the per-chunk-token term against the context terms). A group's requests arrive one
    after the other, so the scheduler prefills the first alone (it starts at once) and the group only
    meets in the decode batch: the first one's prefill is a single probe's, the others may share one.
    """
    uncached = probe.prompt_tokens - probe.cached_tokens
    last = uncached - (math.ceil(uncached / chunk) - 1) * chunk if uncached > 0 else 1
    steps = [[(last, probe.prompt_tokens)]]
    if last < chunk and uncached > chunk:
        steps.append([(chunk, probe.prompt_tokens - last)])
    if probe.concurrent > 2 and (probe.concurrent - 1) * uncached <= chunk:
        steps.append([(uncached, probe.prompt_tokens)] * (probe.concurrent - 1))  # the rest, batched
    return steps


def step_shapes(probe: Probe, chunk: int, coef: Coefficients | None = None) -> list[tuple[int, int]]:
    """The step that peaks under ``coef`` (the last one when no coefficients are known yet)."""
    steps = step_candidates(probe, chunk)
    if coef is None or len(steps) == 1:
        return steps[0]
    return max(steps, key=coef.prefill_step)


# ---------------------------------------------------------------------------------------------- model
@dataclass(frozen=True, slots=True)
class Coefficients:
    """The cost model's coefficients, without the margin (bytes)."""

    fixed_bytes: float = 0.0
    activation_bytes_per_chunk_token: float = 0.0
    context_bytes_per_token: float = 0.0
    chunk_context_bytes: float = 0.0
    gather_bytes_per_context_token: float = 0.0
    gather_cap_bytes: float | None = None
    # None: never measured (projected as 0; calibrate then probes the join after the early singles).
    batch_join_bytes: float | None = 0.0
    batch_join_bytes_per_running_request: float = 0.0

    @classmethod
    def of(cls, cost: Cost) -> Coefficients:
        return cls(
            float(cost.fixed_bytes),
            float(cost.activation_bytes_per_chunk_token),
            float(cost.context_bytes_per_token),
            float(cost.chunk_context_bytes),
            float(cost.gather_bytes_per_context_token),
            None if cost.gather_cap_bytes is None else float(cost.gather_cap_bytes),
            None if cost.batch_join_bytes is None else float(cost.batch_join_bytes),
            float(cost.batch_join_bytes_per_running_request),
        )

    def scaled(self, factor: float) -> Coefficients:
        cap = None if self.gather_cap_bytes is None else self.gather_cap_bytes * factor
        return Coefficients(
            self.fixed_bytes * factor,
            self.activation_bytes_per_chunk_token * factor,
            self.context_bytes_per_token * factor,
            self.chunk_context_bytes * factor,
            self.gather_bytes_per_context_token * factor,
            cap,
            None if self.batch_join_bytes is None else self.batch_join_bytes * factor,
            self.batch_join_bytes_per_running_request * factor,
        )

    def gather(self, context: int) -> float:
        g = self.gather_bytes_per_context_token * context
        return g if self.gather_cap_bytes is None else min(g, self.gather_cap_bytes)

    def prefill_step(self, shapes: Sequence[tuple[int, int]]) -> float:
        """Bytes of one prefill step holding these (chunk tokens, context) pieces."""
        total = self.fixed_bytes + self.activation_bytes_per_chunk_token * sum(n for n, _ in shapes)
        for n, x in shapes:
            total += self.context_bytes_per_token * x + self.chunk_context_bytes * n * x + self.gather(x)
        return total

    def join(self, running: int) -> float:
        if running < 2:
            return 0.0
        return (self.batch_join_bytes or 0.0) + self.batch_join_bytes_per_running_request * running

    def probe_peak(self, probe: Probe, chunk: int) -> float:
        prefill = max(self.prefill_step(s) for s in step_candidates(probe, chunk))
        return max(prefill, self.join(probe.concurrent))


# ---------------------------------------------------------------------------------------------- probing
@dataclass(frozen=True, slots=True)
class EngineInfo:
    chunked_prefill_size: int
    context_len: int
    running: int
    waiting: int
    # Prefill tokens not yet computed (a request in chunked prefill is in neither count above).
    pending_prefill_tokens: int = 0


class Lane(Protocol):
    """The engine under qualification."""

    async def info(self) -> EngineInfo: ...

    async def send(self, probe: Probe, seq: int) -> str | None:
        """Run the probe to completion; None on success, else what went wrong (crash, HTTP error)."""
        ...


class Meter(Protocol):
    """The GPU source, as bytes the engine holds now (total - free - other processes)."""

    async def held_bytes(self) -> int: ...

    async def free_bytes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Observation:
    """What one probe showed. ``after`` is the high-water mark of the engine's held bytes over their
    value before the first probe, once the probe is done (so it includes every earlier probe)."""

    probe: Probe
    before: int
    after: int
    # No new high-water mark: the probe's peak is at most ``before``.
    censored: bool
    # The probe's own peak is known: it set a new mark, or it was censored by a shorter single probe
    # (single peaks never shrink with length, so then it peaked exactly at that mark).
    exact: bool
    predicted: float
    error: str | None = None


@dataclass
class ProbeRun:
    info: EngineInfo
    idle_free_bytes: int
    observations: list[Observation] = field(default_factory=list)
    skipped: list[tuple[Probe, str]] = field(default_factory=list)
    refused: str | None = None
    stopped: str | None = None
    duration_s: float = 0.0
    tokens_sent: int = 0
    # How the engine's allocator cache was handled (flushes, the last-chunk reading): the report's notes.
    notes: list[str] = field(default_factory=list)


def order_probes(probes: Sequence[Probe], predict: Callable[[Probe], float]) -> list[Probe]:
    """Increasing predicted peak, so each probe can set a new high-water mark (ties: shorter first)."""
    return sorted(probes, key=lambda p: (predict(p), p.tokens_sent))


def _busy(info: EngineInfo) -> bool:
    return bool(info.running or info.waiting or info.pending_prefill_tokens)


def frontier_probes(coef: Coefficients, chunk: int, longest: int, top: int, limit: float) -> list[Probe]:
    """Where the lane's longest admissible prompts are: the longest cold prompt of whole chunks (its
    last chunk full, the step the gate projects) predicted to peak within ``limit``, and one halfway
    from the longest probe run so far. The plan's lengths grow by half each; without these the fit
    would stop at the last one below the headroom and extrapolate the rest of the way to the limit."""
    lo, hi = 0, top // chunk
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if coef.probe_peak(Probe("frontier", mid * chunk), chunk) <= limit:
            lo = mid
        else:
            hi = mid - 1
    far = lo * chunk
    if far <= longest:
        return []
    out = [Probe(f"alone-{far}", far)]
    half = (longest + far) // 2 // chunk * chunk
    if longest < half < far:
        out.append(Probe(f"alone-{half}", half))
    return out


def _caution(observations: Sequence[Observation], coef: Coefficients, chunk: int) -> float:
    """How far the visible single probes so far ran over ``coef``: the worst observed/predicted ratio,
    or 1 + 3 standard deviations of the ratios, at least 1 (the margin ``fit`` will propose, unsafed).
    A frontier probe is sized within the headroom divided by this, so a noisy lane is probed less far."""
    ratios = [
        o.after / p
        for o in _single_usable(observations)
        if not o.censored and (p := coef.probe_peak(o.probe, chunk)) > 0
    ]
    if not ratios:
        return 1.0
    sigma = math.sqrt(sum((r - 1.0) ** 2 for r in ratios) / len(ratios))
    return max(1.0, *ratios, 1.0 + 3.0 * sigma)


def _groups_due(observations: Sequence[Observation], chunk: int) -> bool:
    """Groups run once the single probes have given the fit its shape, while the mark is still low:
    a join above the mark is then measured exactly, one below it is bounded by a small number."""
    singles = [o for o in observations if o.probe.concurrent == 1 and o.exact and o.error is None]
    multi = {o.probe.prompt_tokens for o in singles if o.probe.prompt_tokens > chunk}
    return len(singles) >= MIN_USABLE and len(multi) >= 5


async def run_probes(
    lane: Lane,
    meter: Meter,
    probes: Sequence[Probe],
    start: Coefficients,
    bounds: Bounds,
    *,
    clock: Callable[[], float] = time.monotonic,
    progress: Callable[[str], None] | None = None,
) -> ProbeRun:
    """Send single probes in increasing order of predicted peak (re-ordered as the fit forms), the
    groups once :func:`_groups_due`, then the single probes that can still show a new peak.
    ``progress`` gets one line per probe sent or skipped (the command prints them on stderr)."""
    info = await lane.info()
    run = ProbeRun(info, await meter.free_bytes())
    if _busy(info):
        run.refused = (
            f"the lane is busy ({info.running} running, {info.waiting} waiting, "
            f"{info.pending_prefill_tokens:,} prefill tokens pending): calibrate needs an idle "
            "lane; drain it (or take it out of rotation) and run again. Nothing proposed."
        )
        return run
    loop = _ProbeLoop(run, probes, start, bounds, clock, progress or (lambda _line: None))
    await loop.go(lane, meter)
    return run


@dataclass
class _ProbeLoop:
    """The probe loop's state: what is left to send, the high-water mark, the fit as it forms."""

    run: ProbeRun
    probes: Sequence[Probe]
    start: Coefficients
    bounds: Bounds
    clock: Callable[[], float]
    say: Callable[[str], None]
    chunk: int = 0
    singles: list[Probe] = field(default_factory=list)
    groups: list[Probe] = field(default_factory=list)
    current: Coefficients = field(default_factory=Coefficients)
    headroom: float = 0.0
    top_single: int = 0
    # The high-water mark, and the single probe that set it (0: a group).
    mark: int = 0
    mark_single_tokens: int = 0
    fitted_yet: bool = False  # `current` comes from this lane's probes, not only from the start policy
    # The frontier probe (``frontier_probes``) while it waits its turn, and whether it went.
    pending: Probe | None = None
    frontier_started: bool = False
    frontier_sent: bool = False
    deferred: bool = False  # the groups wait for the frontier (see _start_frontier)
    seq: int = 0
    # The engine empties its caches on request (``Bounds.flush`` and the lane's ``flush``): every probe
    # is then read over a freshly idle engine, the mark starts at zero each time.
    flushing: bool = False
    # Whether the engine empties its allocator cache while idle (None: not tried yet). When it does, a
    # multi-chunk probe is read as its last chunk over its cached prefix (``_last_chunk``).
    idle_empty: bool | None = None

    def __post_init__(self) -> None:
        self.chunk = self.run.info.chunked_prefill_size
        self.singles = [p for p in self.probes if p.concurrent == 1]
        self.groups = sorted((p for p in self.probes if p.concurrent > 1), key=lambda p: p.concurrent)
        self.current = self.start
        self.headroom = (self.run.idle_free_bytes - self.bounds.reserve_bytes) * self.bounds.headroom_fraction
        self.top_single = max((p.prompt_tokens for p in self.singles), default=0)

    def peak(self, probe: Probe) -> float:
        return self.current.probe_peak(probe, self.chunk)

    async def go(self, lane: Lane, meter: Meter) -> None:
        base = await meter.held_bytes()
        if self.bounds.flush and await _flush(lane):
            self.flushing = True
            base = await meter.held_bytes()
            self.run.notes.append(
                "the engine's caches were flushed before every probe (POST /flush_cache: radix cache and "
                "allocator cache), so each probe was read over a freshly idle engine"
            )
        t0 = self.clock()
        total = len(self.singles) + len(self.groups)
        while self.singles or self.groups:
            if self.singles and self.fitted_yet and not self.frontier_sent:
                self._frontier()
            picked = self._next()
            if picked is None:
                continue
            probe, predicted = picked
            reason = self._skip_reason(probe, predicted, t0)
            if reason is not None:
                self.run.skipped.append((probe, reason))
                self.say(f"calibrate: skipped {probe.name}: {reason}")
                continue
            now_info = await lane.info()
            if _busy(now_info):
                self.run.stopped = (
                    f"traffic appeared before {probe.name} ({now_info.running} running, {now_info.waiting} "
                    "waiting): stopped; the lane must stay idle while calibrating"
                )
                self.say(f"calibrate: {self.run.stopped}")
                break
            self.seq += 1
            self.say(
                f"calibrate: probe {self.seq} ({len(self.run.observations) + len(self.run.skipped) + 1} of "
                f"~{total}) {probe.name}: {probe.tokens_sent:,} tokens, predicted {predicted / MiB:,.0f} MiB ..."
            )
            warmed = False
            if self.flushing:
                await _flush(lane)
                base = await meter.held_bytes()
                if self._last_chunk_due(probe):
                    probe, warmed, error = await self._last_chunk(lane, meter, probe, base)
                    if error is not None:
                        self._record(probe, predicted, 0, error)
                        self.run.stopped = f"{probe.name} failed: {error}"
                        self.say(f"calibrate:   {probe.name}: {error}")
                        break
                    if not warmed:
                        await _flush(lane)
                        base = await meter.held_bytes()
            error, during = await _send_sampling(lane, meter, probe, self.seq, self.bounds, warmed=warmed)
            held = max(during, await meter.held_bytes()) - base
            o = self._record(probe, predicted, held, error)
            shown = "no new peak" if o.censored else f"{o.after / MiB:,.0f} MiB over idle"
            self.say(f"calibrate:   {probe.name}: {error or shown} ({self.clock() - t0:.0f} s)")
            if error is not None:
                self.run.stopped = f"{probe.name} failed: {error}"
                break
        self.run.duration_s = self.clock() - t0

    def _last_chunk_due(self, probe: Probe) -> bool:
        return (
            self.idle_empty is not False
            and self.bounds.settle_s > 0
            and probe.concurrent == 1
            and probe.cached_tokens == 0
            and probe.prompt_tokens > self.chunk
        )

    async def _last_chunk(
        self, lane: Lane, meter: Meter, probe: Probe, base: int
    ) -> tuple[Probe, bool, str | None]:
        """A multi-chunk probe read as its last chunk: the prompt less its last chunk is sent first (the
        radix cache keeps it), the engine empties its allocator cache while idle, then the whole prompt
        runs one prefill step, the one the gate prices, over an empty cache. PyTorch's default allocator
        cannot serve a chunk's larger transients from the earlier chunks' freed blocks, so a cold
        multi-chunk probe's high-water mark adds up over its chunks; one step's cannot (docs/evidence.md
        RC3). (the probe as read, whether the prefix was cached, error)"""
        warm = getattr(lane, "warm", None)
        if warm is None:
            self.idle_empty = False
            return probe, False, None
        last = probe.prompt_tokens - (math.ceil(probe.prompt_tokens / self.chunk) - 1) * self.chunk
        step = replace(probe, cached_tokens=probe.prompt_tokens - last)
        error = await warm(step, self.seq)
        if error is not None:
            return probe, False, error
        self.run.tokens_sent += step.cached_tokens
        if await _settled(lane, meter, base, self.bounds.settle_s):
            if self.idle_empty is None:
                self.run.notes.append(
                    "multi-chunk probes were read as their last chunk over their cached prefix, after the "
                    "engine emptied its allocator cache while idle: one prefill step's peak, not the "
                    "allocator's high-water mark over every chunk"
                )
            self.idle_empty = True
            return step, True, None
        self.idle_empty = False
        self.run.notes.append(
            f"the engine did not empty its allocator cache within {self.bounds.settle_s:g} s of idling: "
            "multi-chunk probes read the allocator's high-water mark over all their chunks: the need "
            "with expandable_segments, an upper bound that adds up chunk after chunk with PyTorch's "
            "default allocator (then run SGLang with --sleep-on-idle and SGLANG_EMPTY_CACHE_INTERVAL=1 "
            "while calibrating: docs/calibrate.md)"
        )
        self.say(f"calibrate: {self.run.notes[-1]}")
        return probe, False, None

    def _frontier(self) -> None:
        """Size (or re-size) the frontier probe under the fit as it is now, until it is sent."""
        obs = self.run.observations
        longest = max((o.probe.prompt_tokens for o in _single_usable(obs)), default=0)
        limit = self.headroom / _caution(obs, self.current, self.chunk)
        far = frontier_probes(self.current, self.chunk, longest, self.top_single, limit)
        if self.frontier_started:
            # Re-sized under the fit as it is now, until it is sent: the probe sent closest to the
            # headroom is sized by every shorter probe's measurement, not by the first few.
            if self.pending is not None:
                self.singles.remove(self.pending)
                self.pending = None
            if far and far[0] not in self.singles:
                self.pending = far[0]
                self.singles.append(self.pending)
        elif far and (
            min(self.peak(p) for p in self.singles) > self.headroom
            or (self.groups and _groups_due(obs, self.chunk))
        ):
            self._start_frontier(far)

    def _start_frontier(self, far: list[Probe]) -> None:
        self.frontier_started = True
        known = {p.prompt_tokens for p in self.singles} | {
            o.probe.prompt_tokens for o in self.run.observations
        }
        self.singles.extend(p for p in far[1:] if p.prompt_tokens not in known)
        if far[0] not in self.singles:
            self.pending = far[0]
            self.singles.append(self.pending)
        # A lane whose longest prompts are limited by the transient headroom (not the context), with a
        # join the start policy measured above the longest probe it may send: the groups go after the
        # frontier. Early, their mark would hide every longer single probe; late, the join is still
        # measured exactly if it is above the frontier's peak, and bounded by that peak (the
        # conservative side) if the start policy's join was wrong.
        self.deferred = bool(
            self.groups
            and self.start.batch_join_bytes
            and far[0].prompt_tokens < self.top_single
            and self.peak(self.groups[0]) > self.peak(far[0])
        )

    def _groups_now(self) -> bool:
        if not self.groups or self.deferred:
            return False
        if not self.singles or _groups_due(self.run.observations, self.chunk):
            return True
        # A policy that measured no join: the groups go first, where even their own small prefill sets
        # a visible mark (a join would show on top of it).
        if self.start.batch_join_bytes == 0:
            return True
        return self.start.batch_join_bytes is not None and self.peak(self.groups[0]) <= min(
            self.peak(p) for p in self.singles
        )

    def _next(self) -> tuple[Probe, float] | None:
        """The next probe and its predicted peak; None when the one picked was skipped below a group's mark."""
        if self.deferred and not any(self.peak(p) <= self.headroom for p in self.singles):
            self.deferred = False
        if self._groups_now():
            probe = self.groups.pop(0)
            return probe, self.current.prefill_step(step_shapes(probe, self.chunk))
        self.singles = order_probes(self.singles, self.peak)
        probe = self.singles.pop(0)
        predicted = self.peak(probe)
        if probe == self.pending:
            self.pending, self.frontier_sent = None, True
        if self.mark_single_tokens == 0 and self.mark > 0 and predicted < self.mark * 0.95:
            self.run.skipped.append(
                (probe, f"predicted below the {self.mark / MiB:,.0f} MiB mark a group set")
            )
            return None
        return probe, predicted

    def _skip_reason(self, probe: Probe, predicted: float, t0: float) -> str | None:
        if predicted > self.headroom:
            return f"predicted {predicted / MiB:,.0f} MiB > {self.headroom / MiB:,.0f} MiB of safe headroom"
        if self.run.tokens_sent + probe.tokens_sent > self.bounds.max_total_tokens:
            return f"token budget ({self.bounds.max_total_tokens:,}) spent"
        if self.clock() - t0 > self.bounds.max_duration_s:
            return f"time budget ({self.bounds.max_duration_s:g} s) spent"
        return None

    def _record(self, probe: Probe, predicted: float, held: int, error: str | None) -> Observation:
        """One probe's observation against the mark; the fit re-formed from every usable one."""
        self.run.tokens_sent += probe.tokens_sent
        mark = self.mark
        after = max(mark, held)
        censored = after <= mark + max(MiB // 2, mark // 500)
        single = probe.concurrent == 1
        exact = not censored or (
            single and 0 < self.mark_single_tokens <= probe.prompt_tokens and probe.cached_tokens == 0
        )
        o = Observation(probe, mark, after, censored, exact, predicted, error)
        self.run.observations.append(o)
        if not censored:
            self.mark, self.mark_single_tokens = after, (probe.prompt_tokens if single else 0)
        if self.flushing:  # the next probe starts from an emptied cache
            self.mark, self.mark_single_tokens = 0, 0
        if error is None and (fitted := try_fit(self.run.observations, self.chunk)) is not None:
            self.fitted_yet = True
            self.current = replace(
                fitted,
                batch_join_bytes=self.start.batch_join_bytes,
                batch_join_bytes_per_running_request=self.start.batch_join_bytes_per_running_request,
            )
        return o


async def _flush(lane: Lane) -> bool:
    """Ask the engine to empty its caches (a lane without ``flush``, or one that refuses: False)."""
    flush = getattr(lane, "flush", None)
    if flush is None:
        return False
    try:
        return bool(await flush())
    except Exception:  # an engine without the endpoint is probed as before
        return False


SETTLE_POLL_S = 0.25


async def _settled(lane: Lane, meter: Meter, base: int, settle_s: float) -> bool:
    """Wait (the lane's ``idle``, else wall time) until the engine's held memory is back within 8 MiB of
    ``base``: its allocator cache was emptied while it idled. False if it is not within ``settle_s``."""
    idle = getattr(lane, "idle", None)
    for _ in range(max(1, math.ceil(settle_s / SETTLE_POLL_S))):
        if idle is not None:
            await idle(SETTLE_POLL_S)
        else:
            await asyncio.sleep(SETTLE_POLL_S)
        if await meter.held_bytes() - base <= 8 * MiB:
            return True
    return False


async def _send_sampling(
    lane: Lane, meter: Meter, probe: Probe, seq: int, bounds: Bounds, *, warmed: bool = False
) -> tuple[str | None, int]:
    """Send one probe while reading the GPU source; (error, highest held bytes read meanwhile).
    ``warmed``: its cached prefix was already sent (``_ProbeLoop._last_chunk``)."""
    peak = 0

    async def sample() -> None:
        nonlocal peak
        while True:
            with contextlib.suppress(Exception):  # a failed read during a probe is not a failed probe
                peak = max(peak, await meter.held_bytes())
            await asyncio.sleep(bounds.sample_interval_s)

    sampler = asyncio.create_task(sample())
    try:
        sent = lane.send(probe, seq, warmed=True) if warmed else lane.send(probe, seq)  # type: ignore[call-arg]
        error = await asyncio.wait_for(sent, bounds.probe_timeout_s)
    except TimeoutError:
        error = f"no answer within {bounds.probe_timeout_s:g} s"
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    return error, peak


# ---------------------------------------------------------------------------------------------- fit
@dataclass(frozen=True, slots=True)
class Residual:
    probe: Probe
    observed: int
    predicted: float
    censored: bool

    @property
    def ratio(self) -> float:
        return self.observed / self.predicted if self.predicted > 0 else math.inf


@dataclass(frozen=True, slots=True)
class Fit:
    coefficients: Coefficients
    margin: float
    envelope_ratio: float
    noise_sigma: float
    residuals: tuple[Residual, ...]
    largest_prompt_tokens: int
    usable: int
    notes: tuple[str, ...] = ()
    # The absolute error budget the margin (relative) does not cover: twice the largest amount by
    # which an observation exceeded the fit, at least MIN_RESERVE (allocator rounding, 2 MiB blocks).
    reserve_bytes: int = 0
    # What the observations reached against the fit (``margin`` is this times 1 + safety): written as
    # ``cost.calibrated_ratio``, so the monitor counts a lane that allocates beyond it.
    covered_ratio: float = 1.0
    # The allocator's granularity: the largest excess of a single-chunk probe over the fit (bytes).
    granularity_bytes: int = 0


MIN_RESERVE = 16 * MiB
# A single-chunk probe further off the fit than this is not rounding (PyTorch rounds to 2 MiB blocks and
# 20 MiB segments): the default caching allocator's marks add up over probes (docs/evidence.md G3).
CACHE_SUSPECT = 64 * MiB

MIN_USABLE = 7  # five prefill terms + the cap's breakpoint, and one to spare


def _nonneg_lstsq(a: np.ndarray, y: np.ndarray, free: Sequence[int] = (0,)) -> np.ndarray:
    """Least squares with every coefficient >= 0 except the ``free`` columns (the fixed term absorbs a
    pre-existing cache offset and may go negative). Drops the most negative column until none is."""
    cols = list(range(a.shape[1]))
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    while True:
        sub = a[:, cols] / scale[cols]
        sol, *_ = np.linalg.lstsq(sub, y, rcond=None)
        coef = np.zeros(a.shape[1])
        coef[cols] = sol / scale[cols]
        negative = [(coef[c], c) for c in cols if c not in free and coef[c] < 0]
        if not negative:
            return coef
        cols.remove(min(negative)[1])


def _features(probe: Probe, chunk: int, knee: float | None, coef: Coefficients | None) -> list[float]:
    shapes = step_shapes(probe, chunk, coef)
    n_sum = sum(n for n, _ in shapes)
    x_sum = sum(x for _, x in shapes)
    nx = sum(n * x for n, x in shapes)
    g = sum((x if knee is None else min(x, knee)) for _, x in shapes)
    return [1.0, float(n_sum), float(x_sum), float(nx), float(g)]


def try_fit(observations: Sequence[Observation], chunk: int) -> Coefficients | None:
    """The prefill coefficients once enough single probes are visible (the probe loop's guide)."""
    usable = _single_usable(observations)
    if len({o.probe.prompt_tokens for o in usable}) < 4:
        return None
    return _fit_prefill(usable, chunk)[0]


def _single_usable(observations: Sequence[Observation]) -> list[Observation]:
    return [o for o in observations if o.probe.concurrent == 1 and o.exact and o.error is None]


def _fit_prefill(usable: Sequence[Observation], chunk: int) -> tuple[Coefficients, str]:
    """Fit, then re-fit with each probe's peak step chosen under the previous fit (a partial last
    chunk may or may not outgrow the full one before it)."""
    plain = [o for o in usable if len(step_candidates(o.probe, chunk)) == 1]
    coef: Coefficients | None = _fit_once(plain, chunk, None)[0] if len(plain) >= 4 else None
    note = ""
    for _ in range(4):
        new, note = _fit_once(usable, chunk, coef)
        if new == coef:
            break
        coef = new
    assert coef is not None
    return coef, note


def _fit_once(
    usable: Sequence[Observation], chunk: int, prior: Coefficients | None
) -> tuple[Coefficients, str]:
    y = np.array([o.after for o in usable], dtype=float)
    xs = sorted({o.probe.prompt_tokens for o in usable})
    # Uncapped: the gather is one more per-context-token term, not separable from the other.
    a0 = np.array([_features(o.probe, chunk, None, prior)[:4] for o in usable])
    c0 = _nonneg_lstsq(a0, y)
    sse0 = float(np.sum((a0 @ c0 - y) ** 2))
    best = (sse0, None, np.append(c0, 0.0))
    for lo, hi in itertools.pairwise(xs):
        for knee in np.geomspace(lo, hi, 24)[:-1]:
            if abs(knee - chunk) < 0.02 * chunk:
                continue  # a cap at one chunk is the per-chunk-token term itself: not separable
            a1 = np.array([_features(o.probe, chunk, float(knee), prior) for o in usable])
            c1 = _nonneg_lstsq(a1, y)
            sse1 = float(np.sum((a1 @ c1 - y) ** 2))
            if c1[4] > 0 and sse1 < best[0] * (1 - 1e-6) - 1e-9 * float(np.sum(y**2)):
                best = (sse1, float(knee), c1)
    sse, knee, coef = best
    scale = float(np.sum(y**2)) or 1.0
    note = "gather: uncapped (grows with the whole request, merged into per-context-token)"
    # A cap is only believed when it explains the data clearly better than a straight line.
    if knee is None or sse > 0.25 * sse0 or sse0 / scale < 1e-9:
        coef = np.append(c0, 0.0)
        knee = None
    else:
        note = f"gather: capped at {coef[4] * knee / MiB:,.1f} MiB (breakpoint ~{knee:,.0f} tokens)"
    c = Coefficients(
        fixed_bytes=float(coef[0]),
        activation_bytes_per_chunk_token=float(coef[1]),
        context_bytes_per_token=float(coef[2]),
        chunk_context_bytes=float(coef[3]),
        gather_bytes_per_context_token=float(coef[4]) if knee is not None else 0.0,
        gather_cap_bytes=float(coef[4] * knee) if knee is not None else None,
    )
    return c, note


def fit(run: ProbeRun, *, safety: float = 0.05, min_usable: int = MIN_USABLE) -> Fit | str:
    """The upper-envelope fit, or why there is none (too few usable probes)."""
    chunk = run.info.chunked_prefill_size
    ok = [o for o in run.observations if o.error is None]
    usable = _single_usable(ok)
    if len(usable) < min_usable:
        censored = sum(1 for o in ok if o.censored)
        return (
            f"too few usable probes: {len(usable)} single probes set a visible peak (need {min_usable}; "
            f"{censored} censored, {len(run.skipped)} skipped, {len(run.observations) - len(ok)} failed); "
            "nothing proposed. Restart the engine so its allocator cache is empty, allow longer probes "
            "(--max-prompt-tokens) or a larger --max-total-tokens, and run again."
        )
    coef, gather_note = _fit_prefill(usable, chunk)
    join, per_running, join_notes = _batch_join(run, ok, coef)
    coef = replace(coef, batch_join_bytes=join, batch_join_bytes_per_running_request=per_running)
    residuals = tuple(Residual(o.probe, o.after, coef.probe_peak(o.probe, chunk), not o.exact) for o in ok)
    largest = max(o.probe.prompt_tokens for o in usable)
    env = _envelope(residuals, coef, chunk, run.idle_free_bytes, largest, safety)
    notes = [*run.notes, gather_note, *join_notes, *env.notes]
    if run.skipped:
        notes.append(f"{len(run.skipped)} probe(s) skipped (headroom or budget): see the plan")
    return Fit(
        coef,
        env.margin,
        env.envelope,
        env.sigma,
        residuals,
        largest,
        len(usable),
        tuple(notes),
        env.reserve,
        env.covered,
        env.grain,
    )


def _batch_join(
    run: ProbeRun, ok: Sequence[Observation], coef: Coefficients
) -> tuple[float, float, list[str]]:
    """The join term from the group probes, in increasing group size: each one that set a new mark
    above its own prefill step measured the join for that running batch. (join, per running, notes)"""
    chunk = run.info.chunked_prefill_size
    notes: list[str] = []
    joins: list[tuple[int, float]] = []
    bounded_only = True  # every join so far is an upper bound (censored), none a measurement
    for o in sorted((o for o in ok if o.probe.concurrent > 1), key=lambda o: o.probe.concurrent):
        prefill = coef.prefill_step(step_shapes(o.probe, chunk, coef))
        g = o.probe.concurrent
        if o.censored and joins and not bounded_only:
            notes.append(
                f"{o.probe.name}: no new peak above the smaller group's: the join does not grow with "
                f"the running batch (up to {g} running)"
            )
        elif o.censored and not joins:
            notes.append(
                f"{o.probe.name}: censored (no new peak above {o.before / MiB:,.0f} MiB): the join term for "
                f"{g} running is at most that, which is what is proposed"
            )
            joins.append((g, float(o.before)))
        elif o.censored:
            continue  # a bound above a bound says nothing more
        elif o.after > prefill * 1.05:
            if bounded_only:
                joins = []  # a measured join replaces the bounds below it (a slope needs two measurements)
            bounded_only = False
            joins.append((g, float(o.after)))
        else:
            notes.append(f"{o.probe.name}: peak explained by its prefill step: no join term seen")
    failed = [o for o in run.observations if o.error is not None and o.probe.concurrent > 1]
    if failed:
        # The group killed the engine: whatever joining allocates exceeds the idle headroom.
        joins = [(failed[0].probe.concurrent, float(run.idle_free_bytes))]
        notes.append(
            f"{failed[0].probe.name} crashed the engine: running {failed[0].probe.concurrent} requests "
            "together needs more than the idle headroom; the join term is set to it"
        )
    if not joins:
        return 0.0, 0.0, notes
    joins.sort()
    g0, j0 = joins[0]
    per_running = 0.0
    if len(joins) > 1 and joins[-1][1] > j0:
        g1, j1 = joins[-1]
        per_running = (j1 - j0) / (g1 - g0)
    return max(0.0, j0 - per_running * g0), per_running, notes


@dataclass(frozen=True, slots=True)
class _Envelope:
    envelope: float
    sigma: float
    covered: float
    margin: float
    reserve: int
    grain: int
    notes: tuple[str, ...]


def _envelope(
    residuals: Sequence[Residual], coef: Coefficients, chunk: int, idle_free: int, largest: int, safety: float
) -> _Envelope:
    """The margin (relative) and the reserve (absolute) that cover every visible observation.

    What an allocator adds per allocation does not scale with the request: PyTorch's caching allocator
    rounds a block up to 2 MiB and serves a 1-10 MiB one from a 20 MiB segment. That granularity is
    measured where nothing else can explain an error of the fit: single probes of at most one chunk
    (one step, one block per piece), in either direction. It is covered by the reserve (absolute), so
    the margin (relative) and the noise term cover only what is left of each observation's error, and
    a 22 MiB mark over an 8 MiB probe does not make every 500K prompt 2.6 times its cost (measured on
    an H100: docs/evidence.md G3). The safety is then trimmed, never below what was observed,
    so that the longest probe the lane served stays admissible: the unfit line sits at or beyond
    where the probes showed the lane serves.
    """
    visible = [r for r in residuals if not r.censored and r.predicted > 0]
    small = [
        abs(r.observed - r.predicted)
        for r in visible
        if r.probe.concurrent == 1 and r.probe.prompt_tokens <= chunk
    ]
    grain = math.ceil(max(small, default=0.0))

    def explained(r: Residual) -> float:  # the observation, less the granularity's share of its error
        return r.observed - max(-grain, min(grain, r.observed - r.predicted))

    ratios = np.array([explained(r) / r.predicted for r in visible])
    envelope = float(ratios.max()) if len(ratios) else 1.0
    sigma = float(np.sqrt(np.mean((ratios - 1.0) ** 2))) if len(ratios) else 0.0
    covered = max(1.0, envelope, 1.0 + 3.0 * sigma)
    worst = max((explained(r) - r.predicted for r in visible), default=0.0)
    reserve = max(MIN_RESERVE, math.ceil(2 * max(float(grain), worst) / MiB) * MiB)
    margin = covered * (1.0 + safety)
    notes: list[str] = []
    if grain >= MiB:
        notes.append(
            f"allocator granularity: single-chunk probes ran up to {grain / MiB:,.1f} MiB off the fit; "
            "covered by the reserve, not the margin"
        )
    if grain > CACHE_SUSPECT:
        # PyTorch's default allocator keeps each chunk's freed blocks and cannot reuse them for the next,
        # larger chunk: the marks add up over probes and chunks (H100: docs/evidence.md G3).
        notes.append(
            "the marks look like a caching allocator's, not the lane's need: restart the engine with "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and calibrate again (docs/calibrate.md)"
        )
    longest = coef.probe_peak(Probe("longest", largest), chunk)
    if longest > 0 and margin * longest > idle_free - reserve >= covered * longest:
        margin = (idle_free - reserve) / longest
        notes.append(
            f"safety trimmed to {margin / covered - 1:.3f}: with {1 + safety:.2f} the longest probe the lane "
            f"served ({largest:,} tokens) would be unfit"
        )
    return _Envelope(envelope, sigma, covered, margin, reserve, grain, tuple(notes))


# ---------------------------------------------------------------------------------------------- output
def _ceil3(x: float) -> float:
    """Rounded up to three decimals: a ratio written into a policy never understates the fit's."""
    return round(math.ceil(x * 1000) / 1000, 3)


def proposed_cost(fit_: Fit) -> dict[str, object]:
    """The ``cost:`` section of the proposal: every coefficient rounded up (an upper envelope)."""
    c = fit_.coefficients
    out: dict[str, object] = {
        "fixed_bytes": max(0, math.ceil(c.fixed_bytes)),
        "activation_bytes_per_chunk_token": math.ceil(c.activation_bytes_per_chunk_token),
        "context_bytes_per_token": math.ceil(c.context_bytes_per_token),
        "chunk_context_bytes": round(c.chunk_context_bytes, 4),
        "gather_bytes_per_context_token": math.ceil(c.gather_bytes_per_context_token),
    }
    if c.gather_cap_bytes is not None:
        out["gather_cap_bytes"] = math.ceil(c.gather_cap_bytes)
    out["batch_join_bytes"] = math.ceil(c.batch_join_bytes or 0.0)
    out["batch_join_bytes_per_running_request"] = math.ceil(c.batch_join_bytes_per_running_request)
    out["margin"] = _ceil3(fit_.margin)
    out["calibrated_ratio"] = _ceil3(fit_.covered_ratio)  # <= margin: both rounded up, covered <= margin
    out["calibrated_up_to_prompt_tokens"] = fit_.largest_prompt_tokens
    return out


_REPORT_TERMS = (
    ("fixed_bytes", "fixed", 1),
    ("activation_bytes_per_chunk_token", "per chunk token", 1),
    ("context_bytes_per_token", "per context token", 1),
    ("chunk_context_bytes", "chunk x context", 1),
    ("gather_bytes_per_context_token", "gather per context token", 1),
    ("gather_cap_bytes", "gather cap (MiB)", MiB),
    ("batch_join_bytes", "batch join (MiB)", MiB),
    ("batch_join_bytes_per_running_request", "join per running (MiB)", MiB),
)


def report(fit_: Fit | str, run: ProbeRun, policy: Policy) -> str:
    """What a person reads: the plan as run, the fit beside the policy's coefficients, residuals."""
    lines = [
        f"lane: chunk {run.info.chunked_prefill_size:,} tokens, context {run.info.context_len:,}, "
        f"free before probing {run.idle_free_bytes / MiB:,.0f} MiB",
    ]
    if run.refused:
        return "\n".join([*lines, f"refused: {run.refused}"])
    lines.append(f"probes: {len(run.observations)} sent, {run.tokens_sent:,} tokens, {run.duration_s:.1f} s")
    if run.stopped:
        lines.append(f"stopped: {run.stopped}")
    for probe, why in run.skipped:
        lines.append(f"  skipped {probe.name}: {why}")
    if isinstance(fit_, str):
        return "\n".join([*lines, fit_])
    start = Coefficients.of(policy.cost)
    lines.append(f"{'term':28} {'policy':>14} {'fitted':>14}")
    for name, label, unit in _REPORT_TERMS:
        old, new = getattr(start, name), getattr(fit_.coefficients, name)
        lines.append(f"{label:28} {_num(old, unit):>14} {_num(new, unit):>14}")
    lines.append(f"{'margin':28} {policy.cost.margin:>14.3f} {fit_.margin:>14.3f}")
    was = "-" if policy.cost.calibrated_ratio is None else f"{policy.cost.calibrated_ratio:.3f}"
    lines.append(f"{'calibrated ratio':28} {was:>14} {fit_.covered_ratio:>14.3f}")
    lines.append(f"{'probe':18} {'kind':7} {'observed MiB':>13} {'fit MiB':>10} {'ratio':>7}")
    for r in fit_.residuals:
        flag = "  censored (peak <= observed)" if r.censored else ""
        ratio = f"{r.ratio:7.3f}" if r.predicted > 0 and not r.censored else "      -"
        lines.append(
            f"{r.probe.name:18} {r.probe.kind:7} {r.observed / MiB:13,.1f} {r.predicted / MiB:10,.1f} {ratio}{flag}"
        )
    lines.append(
        f"largest probe: {fit_.largest_prompt_tokens:,} tokens; beyond it the fit is extrapolated "
        "(cost.calibrated_up_to_prompt_tokens)"
    )
    lines.extend(f"note: {n}" for n in fit_.notes)
    return "\n".join(lines)


def _num(v: float | None, unit: int) -> str:
    if v is None:
        return "none"
    v = v if abs(v) > 1e-6 else 0.0
    return f"{v / unit:,.1f}" if unit > 1 else f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
