"""The sidecar's own telemetry: Prometheus metrics and one JSON log line per decision.

Counters for every (decision, reason) and outcome are created once at start-up, so the request path
only increments a pre-bound child. Gauges that describe state (headroom, ledger, engine, GPU, signal
ages) are computed at scrape time from the live objects: nothing per request, and an unknown value is
an absent series, never a 0.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import IO, TYPE_CHECKING, Any

import orjson
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from sidecar import __version__
from sidecar.admission.controller import Outcome
from sidecar.core.decide import headroom_bytes
from sidecar.core.decision import Action, Decision, Reason
from sidecar.core.demand import Demand
from sidecar.core.ledger import LedgerTotals
from sidecar.core.rules import Rules
from sidecar.http.answers import check_fields
from sidecar.ops import logs
from sidecar.ops.router_view import fit_prompt_tokens

if TYPE_CHECKING:
    from sidecar.admission.controller import Admission

PREFIX = "sglang_sidecar_"
HOLD_BUCKETS = (0.005, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
# A long prefill runs for minutes before its first token (a 500K-token prompt on one GPU).
FIRST_BYTE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200)
# What a request can be held for: the constraints and the signals (``on_stale``/``on_exceed: hold``).
# queue_full, hold_timeout, unfit_request and draining only ever reject.
HOLD_REASONS = tuple(
    r
    for r in Reason
    if r
    not in (
        Reason.QUEUE_FULL,
        Reason.HOLD_TIMEOUT,
        Reason.UNFIT_REQUEST,
        Reason.DRAINING,
        Reason.PREFILL_OVERRUN,
    )
)

log = logging.getLogger("sidecar.decision")


class LineWriter:
    """Writes lines on its own thread, so the event loop never waits on a disk or a full pipe.

    Bounded: if the writer falls ``max_pending`` lines behind, new lines are dropped and counted
    (``decision_log_dropped_total``) rather than growing memory or blocking requests.

    Cheap per line: ``put`` takes a line's UTF-8 bytes, or an item that ``render`` turns into them (a
    decision's values, ``render_decision``). Items are rendered on the thread that put them, a batch
    per turn of its event loop (one ``call_soon`` for a turn's decisions, ``RENDER_PER_TURN`` at most,
    once the requests that made them have gone on): the values die on the thread that made them, a
    turn later, and nothing but bytes crosses to the writer. Rendered on
    the writer's thread instead, every value lived ~20 ms and crossed cores, and the batch shared the
    GIL with the loop at saturation (issue #27; ``bench/results/2026-12-07-issue27-render-where.md``).
    Without a running loop (a script, a test) an item is rendered at once.

    The writer is woken only when a line lands in an empty buffer, and waits ``batch_s`` after each
    write so that lines arriving meanwhile go out together. A ``queue.Queue`` here cost a lock and a
    thread wake-up per decision, ~15 % of the sidecar's CPU on small requests at saturation (py-spy,
    issue #12). The wake-up is a bare lock released by the loop (one C call), not a
    ``threading.Event``, whose ``set``/``wait``/``clear`` run a Condition's Python code on both threads
    at each wake-up (issue #27).
    """

    # Lines rendered in one turn of the loop at most (a line is ~5-20 µs): a timer that comes due while
    # they render waits ~0.2-0.6 ms for them at most, and 64 streams arriving together (the overhead
    # benchmark's paced phase) are rendered over two turns, not one. The paced stall with it: 3.91 ms
    # median on 2 cores against 5.27 at 128 a turn (evidence QT5), 4.25 on a slow lent H100 (QU3).
    RENDER_PER_TURN = 32

    def __init__(
        self,
        stream: IO[str],
        max_pending: int = 100_000,
        batch_s: float = 0.02,
        render: Callable[[Any], bytes] | None = None,
    ) -> None:
        self.stream = stream
        # Dropped lines, one counter per thread that drops (the putting thread when the buffer is full
        # or a line cannot be rendered, the writer when it cannot write): each is written by its thread
        # alone, so no count is lost (one ``+=`` from both threads could lose one); ``dropped`` sums them.
        self._dropped_put = 0
        self._dropped_writer = 0
        self._max_pending = max_pending
        self._batch_s = batch_s
        self._render = render
        # Put, not yet rendered (the putting thread's alone), then the rendered bytes for the writer.
        self._unrendered: list[Any] = []
        self._lines: collections.deque[bytes] = collections.deque()
        # Locked: nothing to do. Bytes landing in an empty buffer (or ``close``) release it; the writer
        # takes it before each batch. A line is in the buffer only after a release the writer has
        # not yet taken, or while the writer drains: no wake-up is lost.
        self._wake = threading.Lock()
        self._wake.acquire()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="decision-log", daemon=True)
        self._thread.start()

    def put(self, line: Any) -> None:
        """Queue a line: its bytes, or an item ``render`` turns into them (it must not change after
        this call). Items, and bytes put while items wait, are put by one thread (the sidecar's event
        loop); bytes alone may come from any. Lines keep the order they were put in."""
        pending = self._unrendered
        if len(self._lines) + len(pending) >= self._max_pending:
            self._dropped_put += 1
            return
        if type(line) is bytes and not pending:
            self._append((line,))
            return
        pending.append(line)
        if len(pending) == 1:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop on this thread: rendered now
                self._render_pending(None)
                return
            loop.call_soon(self._render_pending, loop)

    def _render_pending(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Render what waits (on the thread that put it): on ``loop``, at most ``RENDER_PER_TURN`` lines a
        turn, the rest in the next (a pump that admits a thousand held requests at once does not stall
        the loop for all their lines); without one, all of it. A line that cannot be rendered is
        dropped, counted and logged, and the others go on."""
        pending = self._unrendered
        if loop is not None and len(pending) > self.RENDER_PER_TURN:
            pending, self._unrendered = pending[: self.RENDER_PER_TURN], pending[self.RENDER_PER_TURN :]
            loop.call_soon(self._render_pending, loop)
        else:
            self._unrendered = []
        render = self._render
        out: list[bytes] = []
        for item in pending:
            if type(item) is not bytes and render is not None:
                try:
                    item = render(item)
                except Exception:
                    self._dropped_put += 1
                    log.exception("decision log: a line could not be rendered (dropped, counted)")
                    continue
            out.append(item)
        if out:
            self._append(out)

    def render_waiting(self) -> None:
        """Render what waits now, on this thread, all of it (the loop does it a turn later by itself):
        for ``close``, and for a caller that puts items without giving its loop a turn (a benchmark's
        tight loop), whose items would otherwise wait, past ``max_pending``, until it awaits."""
        if self._unrendered:
            self._render_pending(None)

    def _append(self, out: Iterable[bytes]) -> None:
        lines = self._lines
        was_empty = not lines
        lines.extend(out)
        if was_empty:
            try:  # noqa: SIM105 (contextlib.suppress: a Python-level context manager per wake-up)
                self._wake.release()
            except RuntimeError:  # already released (two batches into an empty buffer): the writer is due
                pass

    @property
    def dropped(self) -> int:
        """Lines dropped so far: the buffer full, or a line that could not be rendered or written."""
        return self._dropped_put + self._dropped_writer

    def _run(self) -> None:
        lines = self._lines
        while True:
            self._wake.acquire()
            batch: list[bytes] = []
            while lines:
                batch.append(lines.popleft())
            if batch:
                try:
                    self.stream.write(b"\n".join(batch).decode() + "\n")
                    self.stream.flush()
                except (OSError, ValueError):
                    self._dropped_writer += len(batch)
            if self._closing and not lines:
                return
            time.sleep(self._batch_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, then stop. Called by the thread that puts items (what waits to be
        rendered is rendered here)."""
        self.render_waiting()
        self._closing = True
        with contextlib.suppress(RuntimeError):  # already released: the writer is due
            self._wake.release()
        self._thread.join(timeout_s)


class Telemetry:
    """Implements the admission Observer: counts decisions and outcomes, writes the decision log.

    Counters sum to what they name. ``decisions_total`` counts one *final* decision per gated request
    that got one (admit, or reject with its reason); a hold is not final, so a request that was held
    is counted once more, at the moment it is parked, in ``held_total{reason}``. ``hold_seconds``
    observes every final decision's wait (0 when decided at once), so its ``_count`` equals the sum of
    ``decisions_total``. In shadow mode a request that enforcement would have held is forwarded at
    once: it is counted in ``held_total`` and as an admit after a 0 s hold.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        decision_log: IO[str] | None = None,
        *,
        shadow: bool = False,
    ) -> None:
        self.registry = registry
        self.shadow = shadow
        # The per-request families are plain numbers bumped on the event loop's thread and written at
        # scrape time (``_PerRequest``): a prometheus_client Counter/Histogram takes a lock and ~6
        # Python calls per update, ~25k instructions of a gated request (issue #27).
        decisions = _CounterFamily(
            "decisions",
            "Final admission decisions, one per gated request that got one: admit, or reject by reason",
            ("decision", "reason"),
        )
        # Only the pairs that can happen exist: an admit has no reason, a reject always has one.
        self._admits = decisions.labels(Action.ADMIT.value, "none")
        # A guard abort (prefill_overrun) follows the request's admit: not a second final decision.
        self._rejects = {
            r: decisions.labels(Action.REJECT.value, r.value)
            for r in Reason
            if r is not Reason.PREFILL_OVERRUN
        }
        held = _CounterFamily(
            "held",
            "Gated requests parked in the hold queue, by the reason they were held and the check that "
            "held them (strict_order: behind an earlier request), whatever came next",
            ("reason", "check"),
        )
        self._held_by = held
        # Each reason's own check exists from the start (a rate() has a zero to start from); the
        # other pairs (vram_headroom's batch_join, join_pending, own_schedule; strict_order) on first use.
        self._held = {(r, r.value): held.labels(r.value, r.value) for r in HOLD_REASONS}
        requests = _CounterFamily(
            "requests", "Gated requests by how they ended, one per request", ("outcome",)
        )
        self._outcomes = {o: requests.labels(o.value) for o in Outcome}
        self._hold = _Histogram(
            "hold_seconds",
            "Time from arrival to the final decision (0 for a request decided at once)",
            HOLD_BUCKETS,
        )
        self._first_byte = _Histogram(
            "upstream_first_byte_seconds",
            "Time from forwarding an admitted request to the upstream's first body byte "
            "(for a stream, about the time to first token)",
            FIRST_BYTE_BUCKETS,
        )
        registry.register(_PerRequest((decisions, held, requests, self._hold, self._first_byte)))
        # The upstream's first body byte for an admitted request arrived ``seconds`` after forwarding:
        # the histogram's own method (no second call per request).
        self.first_byte: Callable[[float], None] = self._first_byte.observe
        reloads = Counter(
            PREFIX + "policy_reloads",
            "Policy reload attempts (SIGHUP or upload) by result: applied or refused",
            ["result"],
            registry=registry,
        )
        self._reloads = {ok: reloads.labels("applied" if ok else "refused") for ok in (True, False)}
        self._reload_ok = Gauge(
            PREFIX + "policy_last_reload_successful",
            "0 when the last policy reload attempt was refused (the previous policy stays), else 1",
            registry=registry,
        )
        self._reload_ok.set(1)
        self._implausible = Counter(
            PREFIX + "implausible_values",
            "Readings refused because a value could not be true (NaN, negative, absurdly large), "
            "by signal and the series that carried it; each refused reading is a failed read",
            ["signal", "series"],
            registry=registry,
        )
        self._writer = LineWriter(decision_log, render=render_decision) if decision_log is not None else None
        # The largest projection of a request the gate admitted since start: the live view sets the
        # headroom against it (would the lane's biggest request fit now?). 0 until the first admit.
        self.largest_admitted_bytes = 0
        registry.register(_LargestAdmitted(self))
        # The lane's state at a decision for its line (``LogCapture``: the shell's, read per decision,
        # serialized later); None: no context members.
        self.capture: Callable[[], LogCapture | None] = lambda: None

    def decision(self, d: Decision, cost: Demand, waited_s: float, ledger: LedgerTotals) -> None:
        action = d.action
        if action is Action.ADMIT:  # the common case first
            self._admits.n += 1
            hold = self._hold  # _Histogram.observe, inline: the call was ~5 % of this method
            if waited_s == waited_s:
                hold.counts[bisect_left(hold.bounds, waited_s)] += 1
            hold.sum += waited_s
            if cost.projected_bytes > self.largest_admitted_bytes:
                self.largest_admitted_bytes = cost.projected_bytes
        elif action is Action.HOLD:
            # A hold always names what it waits for; a reason-less hold would be a core bug, counted
            # under the strict-order wait it most likely is rather than dropped.
            reason = d.reason or Reason.VRAM_HEADROOM
            key = (reason, d.check or reason.value)
            counter = self._held.get(key)
            if counter is None:
                counter = self._held[key] = self._held_by.labels(reason.value, key[1])
            counter.n += 1
            if self.shadow:
                self._admits.n += 1
                self._hold.observe(0.0)
        elif d.reason is Reason.PREFILL_OVERRUN:
            # The in-flight guard aborted an admitted request (it was counted as an admit, and its
            # outcome is `prefill_overrun`): the decision log records this second verdict, and an
            # operator should hear of it (the lane ran out of room under a request it had admitted).
            check = d.checks[-1] if d.checks else None
            log.warning(
                "prefill overrun: %s stopped before its peak: %s",
                cost.request_id,
                check.note if check else "",
                extra={"fields": {"event": "prefill_overrun", "request_id": cost.request_id}},
            )
        else:
            self._rejects[d.reason or Reason.UNFIT_REQUEST].n += 1
            self._hold.observe(waited_s)
        # The record is built only when something writes it. To a decision-log file: what it is built
        # from is taken now (the values are frozen; the clock, the lane's state in ``capture``) and the
        # line is built once the loop's turn is done, with the turn's other lines (``LineWriter``).
        # Built here, on the request's path, it cost ~17 µs of a gated request's ~176 (2 cores,
        # in-process), ~3x what the same calls cost back to back: their code and objects miss the
        # caches between requests (bench/results/2026-12-07-issue27-deferred-line.md).
        if self._writer is not None:
            self._writer.put((d, cost, waited_s, ledger, wall_ts(), self.capture()))
        elif log.isEnabledFor(logging.INFO):
            # Through the process's log pipeline (sidecar.ops.logs): its format, its bounded queue.
            fields = decision_record(d, cost, waited_s, ledger, context_dict(self.capture()))
            log.info("decision %s", action._value_, extra={"fields": fields})

    def implausible(self, signal: str, series: str) -> None:
        """A reading of ``signal`` was refused because ``series`` held a value that cannot be true."""
        self._implausible.labels(signal, series).inc()

    def policy_reload(self, applied: bool) -> None:
        """One reload attempt, from either path (SIGHUP or ``POST /admission/policy``)."""
        self._reloads[applied].inc()
        self._reload_ok.set(1 if applied else 0)

    def reopen_decision_log(self) -> None:
        """SIGUSR1: a decision-log file (``ops/decision_file.py``) is reopened before the next batch; a
        plain stream (stderr, a test's buffer) has nothing to reopen."""
        reopen = getattr(self._writer.stream, "request_reopen", None) if self._writer else None
        if reopen is not None:
            reopen()
            logging.getLogger("sidecar").info(
                "decision log reopened", extra={"fields": {"event": "decision_log_reopen"}}
            )

    @property
    def dropped_log_lines(self) -> int:
        return self._writer.dropped if self._writer is not None else 0

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def outcome(self, outcome: Outcome) -> None:
        self._outcomes[outcome].n += 1


class _Count:
    """One counter series: a plain count, bumped (``n += 1``) on the event loop's thread only, and its
    start time (the ``_created`` sample prometheus_client writes for a series)."""

    __slots__ = ("created", "n")

    def __init__(self) -> None:
        self.n = 0
        self.created = time.time()


class _CounterFamily:
    """A labelled counter as :class:`prometheus_client.Counter` writes it (``_total``, ``_created``),
    its series in the order they were first asked for."""

    def __init__(self, name: str, doc: str, labelnames: tuple[str, ...]) -> None:
        self.name, self.doc, self.labelnames = PREFIX + name, doc, labelnames
        self.series: dict[tuple[str, ...], _Count] = {}

    def labels(self, *values: str) -> _Count:
        count = self.series.get(values)
        if count is None:
            count = self.series[values] = _Count()
        return count

    def describe(self) -> Metric:
        return Metric(self.name, self.doc, "counter")

    def collect(self, created: bool) -> Metric:
        m = self.describe()
        for values, count in list(self.series.items()):
            m.add_sample(
                self.name + "_total", dict(zip(self.labelnames, values, strict=True)), float(count.n)
            )
            if created:
                m.add_sample(
                    self.name + "_created", dict(zip(self.labelnames, values, strict=True)), count.created
                )
        return m


class _Histogram:
    """An unlabelled histogram as :class:`prometheus_client.Histogram` writes it: a count per bucket
    (the first bound at or above the value; +Inf last), the sum, the start time."""

    __slots__ = ("bounds", "counts", "created", "doc", "name", "sum")

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc = PREFIX + name, doc
        self.bounds = (*map(float, buckets), float("inf"))
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        if amount == amount:  # a NaN goes into the sum only, as prometheus_client does
            self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount

    def describe(self) -> Metric:
        return Metric(self.name, self.doc, "histogram")

    def collect(self, created: bool) -> Metric:
        m = self.describe()
        acc = 0.0
        for bound, n in zip(self.bounds, list(self.counts), strict=True):
            acc += n
            m.add_sample(self.name + "_bucket", {"le": floatToGoString(bound)}, acc)
        m.add_sample(self.name + "_count", {}, acc)
        m.add_sample(self.name + "_sum", {}, self.sum)
        if created:
            m.add_sample(self.name + "_created", {}, self.created)
        return m


class _PerRequest(Collector):
    """The families updated per gated request (decisions, held, requests, hold_seconds,
    upstream_first_byte_seconds), written at scrape time with the names, help, types, labels, values
    and ``_created`` samples prometheus_client's own classes gave them.

    Updates and scrapes (``/metrics``, the status page) both run on the event loop's thread, so a
    scrape sees whole requests. From another thread a read sees each number as it stands (an ``int``
    or ``float`` replaced under the GIL, never torn): at worst a request's decision without its hold
    observation, as prometheus_client's per-value locks also allow."""

    def __init__(self, families: tuple[_CounterFamily | _Histogram, ...]) -> None:
        self.families = families

    def describe(self) -> Iterable[Metric]:
        return [f.describe() for f in self.families]

    def collect(self) -> Iterable[Metric]:
        # PROMETHEUS_DISABLE_CREATED_SERIES or disable_created_metrics(), read as the library reads it.
        created = getattr(prometheus_metrics, "_use_created", True)
        return [f.collect(created) for f in self.families]


class _LargestAdmitted(Collector):
    """``largest_admitted_projection_bytes``: absent until a request was admitted (never a 0)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        if self.telemetry.largest_admitted_bytes:
            g = GaugeMetricFamily(
                PREFIX + "largest_admitted_projection_bytes",
                "The largest projected prefill transient of a request admitted since the sidecar started",
            )
            g.add_metric([], float(self.telemetry.largest_admitted_bytes))
            yield g


def register_process_metrics(registry: CollectorRegistry) -> None:
    """``process_*`` (CPU, memory, file descriptors), ``python_info``, ``python_gc_*`` and
    ``sglang_sidecar_build_info{version}``: what tells a restart, a leak or an upgrade apart."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    info = Gauge(
        PREFIX + "build_info", "The running sidecar's version; always 1", ["version"], registry=registry
    )
    info.labels(sidecar_version()).set(1)


def sidecar_version() -> str:
    return __version__


def _line(fields: dict[str, Any]) -> str:
    """One compact JSON line: orjson (~10x the standard encoder on this per-decision record; issue
    #12's profile had `json.dumps` at ~5 % of a gated request's CPU), the standard one for what orjson
    refuses (an integer past 64 bits, say)."""
    try:
        return orjson.dumps(fields).decode()
    except TypeError:
        return json.dumps(fields, separators=(",", ":"))


def spliced(fields: dict[str, Any], members: tuple[bytes, ...]) -> bytes | None:
    """``_line`` of ``fields`` followed by the context's ``members`` (pieces: ``context_fragments``
    and what changes per decision), as UTF-8: the same bytes as one ``orjson.dumps`` of the merged
    dict, whose members it writes in order. One join (no intermediate copies of the line). None where
    orjson refuses ``fields`` (then the merged dict goes ``_line``'s way)."""
    try:
        head = orjson.dumps(fields)
    except TypeError:
        return None
    if not members:
        return head
    return b"".join((memoryview(head)[:-1], b",", *members, b"}"))


# What a decision line's context is written from, taken at the decision: the shell's per-snapshot
# parts (``SnapshotContext``: the snapshot, policy and mode they were taken from, then the head, engine
# and GPU dicts without ages, then their JSON fragments, ``context_fragments``, None where orjson
# refused them), the held count, and the engine's and the GPU's ages in seconds (None: not read).
SnapshotContext = tuple[Any, Any, bool, dict[str, Any], dict[str, Any] | None, dict[str, Any] | None, Any]
LogCapture = tuple[SnapshotContext, int, float | None, float | None]


def context_dict(c: LogCapture | None) -> dict[str, Any]:
    """The decision's context as a dict (the log pipeline's record, and a record orjson refuses): the
    head, the held count, the engine and the GPU with their ages; an age below 0 (a reading stamped
    after the decision) is 0.0, as ``max(0.0, age)`` gave. One dict display per part."""
    if c is None:
        return {}
    (_, _, _, head, engine, gpu, _), held, e_age, g_age = c
    if e_age is not None:
        engine = {**engine, "age_s": round_ms(e_age) if e_age > 0.0 else 0.0}
    if g_age is not None:
        gpu = {**gpu, "age_s": round_ms(g_age) if g_age > 0.0 else 0.0}
    return {**head, "held": held, "engine": engine, "gpu": gpu}


def context_members(c: LogCapture | None) -> tuple[bytes, ...] | None:
    """``context_dict`` as the JSON members a decision line ends with, in pieces (``spliced``): the
    snapshot's fragments with the held count and the ages between them. None: the dict's way (orjson
    refused a part of the snapshot's)."""
    if c is None:
        return ()
    (_, _, _, _, _, _, parts), held, e_age, g_age = c
    if parts is None:
        return None
    return (
        parts[0],
        b"%d" % held,
        parts[1],
        b"" if e_age is None else orjson.dumps(round_ms(e_age) if e_age > 0.0 else 0.0),
        parts[2],
        b"" if g_age is None else orjson.dumps(round_ms(g_age) if g_age > 0.0 else 0.0),
        parts[3],
    )


def render_decision(item: tuple[Decision, Demand, float, LedgerTotals, float, LogCapture | None]) -> bytes:
    """A decision line from what ``Telemetry.decision`` took at the decision (later, after the loop's
    turn: everything in it is frozen or taken by value). The record's JSON with the context's members
    spliced in, or, where orjson refuses a part, the merged dict through ``_line``: the same bytes."""
    d, cost, waited_s, ledger, ts, capture = item
    fields = decision_record(d, cost, waited_s, ledger, {}, ts)
    members = context_members(capture)
    line = None if members is None else spliced(fields, members)
    if line is None:
        line = _line({**fields, **context_dict(capture)}).encode()
    return line


def context_fragments(
    head: dict[str, Any], engine: dict[str, Any] | None, gpu: dict[str, Any] | None
) -> tuple[bytes, bytes, bytes, bytes] | None:
    """The decision log's context parts that change only with a snapshot (the shell's ``_snapshot_context``
    head, engine and GPU fields; None for a signal not read) as JSON, once per snapshot. A decision's
    members are then ``(head, held, engine, engine age, gpu, gpu age, end)``: the head's members up to
    the held count's key, the engine's object left open for its ``age_s`` (last), the GPU's likewise
    after the engine's close, and the closing brace of the last (an absent signal: ``null``, no age).
    None where orjson cannot write them (the record then goes the dict's way)."""
    try:
        first = (orjson.dumps(head)[1:-1] + b"," if head else b"") + b'"held":'
        after_engine = b"}," if engine is not None else b","
        return (
            first,
            b',"engine":null' if engine is None else b',"engine":' + _open(engine),
            after_engine + (b'"gpu":null' if gpu is None else b'"gpu":' + _open(gpu)),
            b"}" if gpu is not None else b"",
        )
    except TypeError:
        return None


def _open(fields: dict[str, Any]) -> bytes:
    """``fields`` as a JSON object left open for one more member, ``age_s``."""
    return orjson.dumps(fields)[:-1] + (b',"age_s":' if fields else b'"age_s":')


def wall_ts() -> float:
    """The decision's wall-clock time in seconds, to the millisecond: the nearest float to the whole
    milliseconds (``time_ns`` rounded, then one division), so orjson writes it with at most three
    decimals, as ``round(time.time(), 3)`` did, for a fifth of that's instructions (issue #27)."""
    return (time.time_ns() + 500_000) // 1_000_000 / 1000


def round_ms(x: float) -> float:
    """``round(x, 3)`` for a positive ``x`` (a signal's age), the same float in fewer instructions:
    ``round`` takes dtoa's correctly rounded decimal and parses it back (~3.4k instructions). Here
    ``x * 1000`` is within a ten-thousandth of its exact value below 1e12, so where it is not within
    0.01 of a half its nearest integer is the exact value's, and one division gives the float
    nearest that many thousandths, which is ``round``'s. Near a half, or beyond, ``round`` itself."""
    q = x * 1000.0
    if 0.0 < q < 1e12:
        r = round(q)
        if -0.49 < q - r < 0.49:
            return r / 1000
    return round(x, 3)


def decision_record(
    d: Decision,
    cost: Demand,
    waited_s: float,
    ledger: LedgerTotals,
    context: dict[str, Any],
    ts: float | None = None,
) -> dict[str, Any]:
    """Every input that decided, and nothing of the prompt's text. ``replay`` reads these lines back.
    ``ts``: :func:`wall_ts` of the decision (read now if None).

    The decision's members are :func:`~sidecar.http.answers.decision_fields`' (the 503 body's and
    explain's), written out here in one dict display: that call, its dict and the merge cost ~5k
    instructions per gated request (issue #27); the checks come from the one writer both use,
    :func:`~sidecar.http.answers.check_fields`, and ``tests/test_decision_line.py`` checks the other
    members stay the same. A wait of exactly 0 (a request decided at once) is its own rounding."""
    reason = d.reason
    return {
        "ts": wall_ts() if ts is None else ts,
        "event": "decision",
        "request_id": cost.request_id,
        "decision": d.action._value_,
        "reason": reason._value_ if reason is not None else None,
        "prompt_tokens": cost.prompt_tokens,
        "exact": cost.exact,
        "cached_tokens": cost.cached_tokens,
        "max_new_tokens": cost.max_new_tokens,
        "sequences": cost.sequences,
        "priority": cost.priority,
        "projected_bytes": cost.projected_bytes,
        "headroom_bytes": d.headroom_bytes,
        "retry_after_s": d.retry_after_s,
        "checks": check_fields(d.checks),
        "waited_s": waited_s if waited_s == 0.0 else round(waited_s, 4),
        "ledger": {
            "requests": ledger.requests,
            "prefill_tokens": ledger.prefill_tokens,
            "projected_bytes": ledger.projected_bytes,
        },
        **context,
    }


class StateCollector(Collector):
    """Gauges read from the admission controller at scrape time."""

    def __init__(
        self,
        admission: Admission,
        clock: Callable[[], float],
        gate_open: Callable[[], bool],
        dropped_log_lines: Callable[[], int] = lambda: 0,
    ) -> None:
        self.admission = admission
        self.clock = clock
        self.gate_open = gate_open
        self.dropped_log_lines = dropped_log_lines

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        a, now = self.admission, self.clock()
        snap, ledger = a.snapshot, a.ledger.totals

        def gauge(name: str, doc: str, value: float | None, **labels: str) -> Metric | None:
            if value is None:
                return None
            g = GaugeMetricFamily(PREFIX + name, doc, labels=list(labels))
            g.add_metric(list(labels.values()), float(value))
            return g

        e, g = snap.engine, snap.gpu
        metrics = [
            gauge("held_requests", "Requests waiting in the sidecar's hold queue", a.held),
            gauge(
                "gate_open",
                "1 when a minimal request would be admitted now",
                1.0 if self.gate_open() else 0.0,
            ),
            gauge(
                "headroom_bytes",
                "GPU free minus reserve minus ledger projections",
                headroom_bytes(a.rules, snap, ledger),
            ),
            gauge(
                "projected_bytes",
                "Bytes the ledger's admitted prefills are projected to allocate",
                ledger.projected_bytes,
            ),
            gauge("ledger_requests", "Forwarded requests whose prefill has not finished", ledger.requests),
            gauge(
                "engine_queue_requests", "SGLang waiting queue, last report", e.queue_requests if e else None
            ),
            gauge(
                "engine_running_requests",
                "SGLang running requests, last report",
                e.running_requests if e else None,
            ),
            gauge("draining", "1 while the sidecar drains for shutdown", 1.0 if a.draining else 0.0),
            # Routing signals (sidecar/ops/router_view.py), for a router or an endpoint scorer.
            gauge(
                "fit_prompt_tokens",
                "Largest uncached prompt (tokens) the gate would admit at once now; 0 if none",
                fit_prompt_tokens(a),
            ),
            gauge(
                "oldest_held_wait_seconds",
                "How long the oldest held request has waited (absent when none is held)",
                a.oldest_wait_s(),
            ),
        ]
        yield from (m for m in metrics if m is not None)

        usage = GaugeMetricFamily(
            PREFIX + "engine_token_usage_ratio",
            "SGLang pool usage per pool (0-1), last report",
            labels=["pool"],
        )
        for pool, v in (
            ("full", e and e.full_token_usage),
            ("swa", e and e.swa_token_usage),
            ("mamba", e and e.mamba_usage),
        ):
            if isinstance(v, float | int) and v == v:  # skip None and NaN
                usage.add_metric([pool], float(v))
        yield usage

        # Two views of the prefill work ahead: the engine's last report (absent when it does not
        # report it, e.g. before 0.5.9) and the ledger's (always known, never lags).
        pending = GaugeMetricFamily(
            PREFIX + "pending_prefill_tokens", "Prefill tokens waiting, by source", labels=["source"]
        )
        if e is not None and e.pending_prefill_tokens is not None:
            pending.add_metric(["engine"], float(e.pending_prefill_tokens))
        pending.add_metric(["ledger"], float(ledger.prefill_tokens))
        yield pending

        free = GaugeMetricFamily(PREFIX + "gpu_free_bytes", "Free memory per GPU", labels=["gpu"])
        other = GaugeMetricFamily(
            PREFIX + "gpu_other_process_bytes", "Memory other processes hold per GPU", labels=["gpu"]
        )
        for d in g.devices if g else ():
            free.add_metric([d.ident], float(d.free_bytes))
            if d.other_process_bytes is not None:
                other.add_metric([d.ident], float(d.other_process_bytes))
        yield free
        yield other

        age = GaugeMetricFamily(
            PREFIX + "signal_age_seconds", "Age of the last successful read", labels=["signal"]
        )
        for name, v in (("engine", snap.engine_age(now)), ("gpu", snap.gpu_age(now))):
            if v is not None:
                age.add_metric([name], v)
        yield age

        fails = GaugeMetricFamily(
            PREFIX + "signal_consecutive_failures",
            "Failed reads in a row since the last good one (0 when the last read worked)",
            labels=["signal"],
        )
        fails.add_metric(["engine"], float(snap.engine_health.consecutive_failures))
        fails.add_metric(["gpu"], float(snap.gpu_health.consecutive_failures))
        yield fails

        dropped = CounterMetricFamily(
            PREFIX + "decision_log_dropped",
            "Decision-log lines dropped because the writer fell behind (or a line could not be written)",
        )
        dropped.add_metric([], float(self.dropped_log_lines()))
        yield dropped
        pipeline = logs.current()
        lost = CounterMetricFamily(
            PREFIX + "log_lines_dropped",
            "Log lines (any logger, including the decision log on stderr) dropped because the log "
            "writer fell behind: stderr is slow or not read",
        )
        lost.add_metric([], float(pipeline.dropped if pipeline else 0))
        yield lost

        yield from watch_metrics(a)

        info = GaugeMetricFamily(PREFIX + "policy_info", "The policy in force", labels=["name", "sha256"])
        info.add_metric([a.policy.name, a.loaded.sha256], 1.0)
        yield info
        yield from policy_limits(a.watch.own)


def watch_metrics(a: Admission) -> Iterable[Metric]:
    """The lane watch (``sidecar/admission/lane_watch.py``): under-predictions seen, the margin and idle figure in
    force. The worst ratio and the measured idle figure are absent until there is one."""
    w = a.watch
    found = CounterMetricFamily(
        PREFIX + "projection_underestimates",
        "GPU readings that showed more memory allocated than the ledger projected for what was running "
        "(one per finding; the same requests' growing prefill counts once)",
    )
    found.add_metric([], float(w.underestimates))
    yield found
    if w.worst_ratio is not None:
        worst = GaugeMetricFamily(
            PREFIX + "projection_underestimate_worst_ratio",
            "The largest observed/projected allocation ratio since the sidecar started",
        )
        worst.add_metric([], w.worst_ratio)
        yield worst
    margin = GaugeMetricFamily(
        PREFIX + "cost_margin",
        "The cost margin in force: the policy's cost.margin, or higher where the monitor raised it",
    )
    margin.add_metric([], float(a.rules.cost.margin))
    yield margin
    if w.idle is not None:
        idle = GaugeMetricFamily(
            PREFIX + "idle_free_bytes",
            "GPU free memory the sidecar measured with the engine idle (this engine process)",
        )
        idle.add_metric([], float(w.idle.free_bytes))
        yield idle
    yield from robustness_metrics(a)


def robustness_metrics(a: Admission) -> Iterable[Metric]:
    """Issue 29 (docs/robustness.md): lane facts measured against the policy, crashes read as
    under-predictions, and a new engine build not yet confirmed."""
    w = a.watch
    fact = GaugeMetricFamily(
        PREFIX + "lane_fact",
        "A lane fact as the policy states it, as the sidecar measured it, and the one in force (the "
        "safer): idle_free_bytes in bytes, pools and lengths in tokens or slots, gpus in devices",
        labels=["fact", "source"],
    )
    disagree = GaugeMetricFamily(
        PREFIX + "lane_fact_disagreement",
        "1 where the policy's figure for a lane fact and the measured one differ beyond the tolerance "
        "(the safer is in force), else 0",
        labels=["fact", "unsafe"],
    )
    for f in w.facts:
        for source, value in (("policy", f.policy), ("measured", f.measured), ("in_force", f.in_force)):
            if value is not None:
                fact.add_metric([f.name, source], float(value))
        if f.policy is not None and f.measured is not None:
            disagree.add_metric([f.name, "true" if f.unsafe else "false"], 1.0 if f.disagrees else 0.0)
    if fact.samples:
        yield fact
    if disagree.samples:
        yield disagree
    crashes = CounterMetricFamily(
        PREFIX + "engine_crashes",
        "Engine restarts while the gate had admitted work, each read as an under-prediction of what was "
        "admitted (the margin rises so that it would not have fitted)",
    )
    crashes.add_metric([], float(w.crashes))
    yield crashes
    build = GaugeMetricFamily(
        PREFIX + "engine_build_unconfirmed",
        "1 while a new engine build runs under the conservative margin, until a reading confirms the fit",
    )
    build.add_metric([], 1.0 if w.conservative is not None else 0.0)
    yield build


def policy_limits(p: Rules) -> Iterable[Metric]:
    """The limits of the policy in force, so dashboards draw them and alerts compare against them
    without copying numbers out of the YAML (and follow a reload)."""

    def one(name: str, doc: str, value: float, label: str | None = None, **values: float | None) -> Metric:
        g = GaugeMetricFamily(PREFIX + name, doc, labels=[label] if label else [])
        if label:
            for k, v in values.items():
                if v is not None:  # a section the policy does not have: no series
                    g.add_metric([k], float(v))
        else:
            g.add_metric([], float(value))
        return g

    yield one("policy_cost_margin", "cost.margin: the policy's own margin on every cost term", p.cost.margin)
    if p.vram.idle_free_bytes is not None and not p.vram.idle_free_auto:  # `auto`, none: no series
        yield one(
            "policy_idle_free_bytes",
            "vram.idle_free_bytes: the lane's idle free GPU memory as the policy states it",
            p.vram.idle_free_bytes,
        )
    yield one(
        "policy_reserve_bytes",
        "vram.reserve_bytes: GPU memory the gate never hands out",
        p.vram.reserve_bytes,
    )
    yield one(
        "policy_max_usage_ratio",
        "kv.max_usage and mamba.max_usage: pool usage at or above which the gate holds",
        0,
        "pool",
        full=p.kv.max_usage,
        mamba=p.mamba.max_usage if p.mamba else None,
    )
    yield one("policy_engine_queue_max_requests", "engine_queue.max_requests", p.engine_queue.limit)
    yield one("policy_pending_prefill_max_tokens", "pending_prefill.max_tokens", p.pending_prefill.limit)
    yield one(
        "policy_signal_max_age_seconds",
        "engine.max_age_s and gpu.max_age_s: a signal older than this is stale",
        0,
        "signal",
        engine=p.engine.max_age_s,
        gpu=p.gpu.max_age_s,
    )
    yield one(
        "policy_hold_max_requests",
        "hold.max_held: beyond it a request is rejected queue_full",
        p.hold.max_held,
    )
    yield one(
        "policy_hold_max_wait_seconds",
        "hold.max_wait_s: a request held longer is rejected hold_timeout",
        p.hold.max_wait_s,
    )
