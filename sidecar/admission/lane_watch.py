"""The lane watch: what the sidecar learns about its lane while serving, from the readings it polls.

Two things, both fed by :class:`~sidecar.admission.controller.Admission` (so the live proxy and ``replay`` run
this same code) and both shown in ``/admission/state``:

* **The idle figure** (``vram.idle_free_bytes: auto``). GPU free memory with the engine idle: its
  fresh report says nothing runs or waits, the ledger is empty, and both readings were taken after
  the last request ended. Measured once per engine process: before any traffic it keeps the largest
  such reading (warm-up may still settle); a first measurement after traffic is a caching allocator's
  low-water mark, which is conservative, and is not raised later. An engine restart (noticed by the
  engine scraper, ``EngineScraper.on_engine_changed``) forgets it and measures again. Until it is
  measured the gate uses live GPU free memory (``policy.in_force.rules_of``): the safe side.
* **The under-prediction monitor**. At every new GPU reading, the engine's allocation beyond its idle
  figure (idle free minus free now, less what other processes grew by: the engine process's own used
  memory where NVML gives per-process figures) against the ledger's projection for what was running:
  the prefill transients it holds and the batch-join term of its running batch, the largest since the
  previous reading. A caching allocator (PyTorch's, so SGLang's) shows only new peaks, so a reading
  below the lowest free seen so far is compared with the largest projection since the idle figure
  was measured; a drop that is not a new low (an engine that returns memory) with the window's
  largest. Larger by more than the policy's tolerance: counted, logged with the request ids and the
  numbers, and, with ``monitor.raise_margin``, the cost margin in force rises to cover it, bounded by
  ``monitor.max_margin``, until the next policy load (a reload is a new calibration). The readings of
  one prefill in flight alone also bound its draw from above (``draw_bracket``): a draw bounded
  within the margin in force raises nothing (``raised_margin``), and after a raise the in-flight guard
  judges the prefills already admitted at that bound, without the safety (``in_flight_margin``). With
  ``cost.calibrated_ratio`` the projection a reading is compared with is the fit times that ratio (what
  the calibration saw), not the margin-priced one: the margin's safety above it is what keeps a prompt
  at the edge alive when the lane draws higher than it did when calibrated, so a reading that eats
  into it counts then, not once it is spent (evidence D18); what a finding showed is covered from then
  on (a later reading counts beyond it).

Nothing here does I/O or reads a clock: ``now`` is passed in. The decision never reads this object;
it reads the :class:`~sidecar.core.Rules` that ``sidecar/policy/in_force.py: rules_in_force`` builds
from the policy and :attr:`LaneWatch.learned`, in which the margin and the idle figure are plain inputs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from sidecar.core import facts as lane_facts
from sidecar.core.decide import idle_budget
from sidecar.core.facts import Fact
from sidecar.core.ledger import LedgerTotals
from sidecar.core.rules import CostModel, DeviceBaseline, Learned, MonitorRules, Rules
from sidecar.core.snapshot import GpuSignals, Snapshot

log = logging.getLogger("sidecar.admission.lane_watch")

# At most this many request ids in a finding's log line and in /admission/state.
MAX_IDS = 16
# The version of the state file's layout (``kept``/``restore``).
STATE_VERSION = 1
# A new engine build is priced this much above the learned margin until a reading confirms the fit
# (``LaneWatch._confirm``): the largest change of an engine's transients across an upgrade that the
# project has modelled (issue 29: x1.10 and x1.25 from one moment on) is covered from the first request.
NEW_BUILD_SAFETY = 0.25


@dataclass(frozen=True, slots=True)
class IdleFree:
    """GPU free memory with the engine idle, as the sidecar measured it (``monotonic`` seconds)."""

    free_bytes: int
    other_process_bytes: int | None
    measured_at: float
    # Measured after requests ran on this engine process: a caching allocator's low-water mark.
    after_traffic: bool
    # Each GPU at that instant (``decide.idle_budget`` compares each with its own).
    devices: tuple[DeviceBaseline, ...] = ()


@dataclass(frozen=True, slots=True)
class AdmittedSet:
    """What the gate had admitted when the engine was last seen failing: the evidence a crash is read
    against (``crash_margin``). ``budget_bytes``: what the gate could hand out then (the idle budget
    less the reserve, None where no idle figure was known)."""

    at: float
    request_ids: tuple[str, ...]
    projected_bytes: int
    margin: float
    budget_bytes: int | None
    reserve_bytes: int
    # The engine's scheduler pids then (its last report's): across a sidecar restart, what tells the
    # process that was failing from a new one (``LaneWatch._read_carried``).
    pids: tuple[str, ...] = ()
    # How many were admitted, where ``request_ids`` holds only the first ``MAX_IDS`` (a set the state
    # file kept); 0: as many as ``request_ids``.
    requests: int = 0

    @property
    def count(self) -> int:
        return max(self.requests, len(self.request_ids))

    def fields(self) -> dict[str, Any]:
        return {
            "request_ids": list(self.request_ids[:MAX_IDS]),
            "requests": self.count,
            "projected_bytes": self.projected_bytes,
            "priced_margin": round(self.margin, 4),
            "budget_bytes": self.budget_bytes,
            "reserve_bytes": self.reserve_bytes,
        }

    def kept(self) -> dict[str, Any]:
        """For the state file: what ``crash_margin`` reads (the margin at full precision), the first
        ``MAX_IDS`` ids with the count, and the pids (``at`` in the watch's clock)."""
        return {
            "at": self.at,
            "request_ids": list(self.request_ids[:MAX_IDS]),
            "requests": self.count,
            "projected_bytes": self.projected_bytes,
            "priced_margin": self.margin,
            "budget_bytes": self.budget_bytes,
            "reserve_bytes": self.reserve_bytes,
            "engine_pids": list(self.pids),
        }

    @classmethod
    def from_kept(cls, d: dict[str, Any]) -> AdmittedSet:
        return cls(
            d["at"],
            tuple(d["request_ids"]),
            d["projected_bytes"],
            d["priced_margin"],
            d["budget_bytes"],
            d["reserve_bytes"],
            tuple(d.get("engine_pids", ())),
            d.get("requests", 0),
        )


@dataclass(frozen=True, slots=True)
class Crash:
    """An engine that restarted while the gate had admitted work, and what the margin became."""

    at: float
    why: str
    admitted: AdmittedSet
    margin_before: float
    margin_after: float

    def fields(self) -> dict[str, Any]:
        return {
            "why": self.why,
            **self.admitted.fields(),
            "margin_before": round(self.margin_before, 4),
            "margin_after": round(self.margin_after, 4),
        }


def crash_margin(s: AdmittedSet, m: MonitorRules, policy_margin: float) -> float | None:
    """The margin at which the admitted set would not have fitted, with the monitor's stated safety:
    its cost terms (the projection over the margin it was priced at) took more than the budget and the
    reserve together (the engine ran out of memory), so they were at least ``(budget + reserve) /
    terms`` times what the terms say; priced at that times ``1 + monitor.safety`` the set exceeds the
    budget and is not admitted. Bounded by ``max_margin`` (a crash that needs more is not explained by
    the admitted prefills alone: it is logged as such). None: nothing to read it against."""
    terms = s.projected_bytes / s.margin if s.margin > 0 else 0
    if s.budget_bytes is None or terms <= 0:
        return None
    needed = (s.budget_bytes + s.reserve_bytes) / terms
    return min(max(m.max_margin, policy_margin), needed * (1.0 + m.safety))


def cost_fingerprint(own: Rules) -> str:
    """What a learned margin was learned against: the policy's cost section (a new calibration, a new
    fingerprint, starts again from its own margin)."""
    text = json.dumps(asdict(own.cost), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Finding:
    """One GPU reading that showed more memory allocated than the ledger projected."""

    at: float
    observed_bytes: int
    projected_bytes: int
    # observed / projected
    ratio: float
    free_bytes: int
    idle_free_bytes: int
    request_ids: tuple[str, ...]
    margin_before: float
    margin_after: float
    # With ``cost.calibrated_ratio``: the multiple of the cost terms ``projected_bytes`` is (what the
    # calibration and earlier findings covered); None: the projection as the ledger charged it.
    covered: float | None = None

    def fields(self) -> dict[str, Any]:
        return {
            "observed_bytes": self.observed_bytes,
            "projected_bytes": self.projected_bytes,
            "covered": None if self.covered is None else round(self.covered, 4),
            "ratio": round(self.ratio, 4),
            "free_bytes": self.free_bytes,
            "idle_free_bytes": self.idle_free_bytes,
            "request_ids": list(self.request_ids),
            "margin_before": round(self.margin_before, 4),
            "margin_after": round(self.margin_after, 4),
        }


def excess(observed: int, projected: int, m: MonitorRules, requests: int = 1) -> float | None:
    """``observed / projected`` when the observed allocation exceeds the projection by more than the
    tolerance and ``min_bytes``, and by more than the allocator's block (``allocator_block_bytes``: 2
    MiB for PyTorch's caching allocator, evidence R1) per request in the comparison, its rounding;
    ``inf`` when nothing was projected; None when it does not."""
    over = observed - projected
    rounding = m.allocator_block_bytes * max(1, requests)  # up to one block per request: rounding
    if over < m.min_bytes or over <= rounding or observed <= projected * (1.0 + m.tolerance):
        return None
    return observed / projected if projected > 0 else math.inf


def raised_margin(
    margin: float,
    projected_with: float,
    policy_margin: float,
    ratio: float,
    m: MonitorRules,
    ceiling: float | None = None,
    upper: float | None = None,
    slack: float = 0.0,
) -> float:
    """The margin in force after an allocation ``ratio`` times a projection made with the margin
    ``projected_with``: what the lane drew (``projected_with x ratio``, a multiple of the cost terms)
    times ``1 + safety``, at least plus ``step``: in proportion to what was seen, not a fixed step.
    Never above ``max_margin`` (nor the policy's own margin), never below ``margin`` (the one in
    force), and never above ``ceiling`` (the margin at which the largest prompt this engine has served
    would become unfit: it ran, so the lane fits it) unless what was seen itself is above it. A
    finding with nothing projected says nothing about the coefficients: the margin stays.

    ``upper``: what the readings bound the draw by from above (``draw_bracket``), None where they do
    not. A reading's draw is a lower bound (its projection may run up to a chunk ahead), which is why
    the safety goes on top of it; with an upper bound at or under ``margin`` (less ``step``, the least
    a policy keeps a margin above a draw) the margin in force already covers every draw the readings
    allow (a lane drawing x1.03 under a margin of 1.05 is within its stated safety): nothing to raise.
    ``slack``: the allocator's rounding on the reading, as a multiple of its cost terms: a bound that
    exceeds the margin by no more than that is a lane drawing its margin, seen at the readings'
    resolution (``excess`` counts no overrun within a block either). Beyond it the new margin covers
    at least the upper bound, and the draw seen times ``1 + safety``."""
    if not m.raise_margin or math.isinf(ratio):
        return margin
    cap = max(m.max_margin, policy_margin)
    seen = projected_with * ratio
    if upper is not None and upper + m.step <= margin + slack:
        return margin  # covered by the margin in force: the finding is logged, the line stays
    # At least every draw the readings allow (``upper``), and the draw seen with the stated safety on
    # top (which covers what the reading may understate where nothing bounds it).
    target = max(seen * (1.0 + m.safety), seen + m.step)
    if upper is not None:
        target = max(target, upper)
    if ceiling is not None:
        target = min(target, max(ceiling, seen))
    return max(margin, min(cap, target))


def chunk_growth(cost: CostModel, chunk_tokens: int) -> int:
    """How much one prefill's cost terms grow over one chunk (``chunk_tokens`` more context): the most
    a projection at progress, which may run up to a chunk ahead of what the engine has allocated
    (evidence D17), can overstate the terms of one prefill in flight."""
    per_token = cost.context_bytes_per_token + cost.gather_bytes_per_context_token
    return math.ceil(chunk_tokens * (per_token + cost.chunk_context_bytes * chunk_tokens))


def draw_bracket(
    observed: int,
    terms: int,
    growth: int,
    before: tuple[float, float] | None,
    rounding: int = 0,
    below: int | None = None,
) -> tuple[float, float] | None:
    """What the readings of one prefill in flight say about the lane's draw (a multiple of the cost
    terms): at least ``(observed - rounding) / terms`` (the projection's terms may run ahead of the
    engine; the allocator's rounding, ``rounding`` bytes at most, only ever adds to what a reading
    shows), at most ``observed / below``, ``below`` the terms the engine has surely allocated (the
    chunks its counter showed done), or where nothing says, ``observed / (terms - growth)`` (the
    projection runs ahead by no more than a chunk). Readings at a steady draw narrow the bracket; one
    that does not overlap it (the draw changed: an upgrade, a new kernel, noise) starts it again from
    itself. Two readings that pin the same draw, one from above and one from below, meet only up to the
    allocator's rounding and the projection's arithmetic: without ``rounding`` such a pair read as a
    change and threw the narrowed bracket away (evidence RE1). None: no bound (nothing surely
    allocated, or terms within a chunk of zero)."""
    floor = terms - growth if below is None else min(below, terms)
    if floor <= 0 or observed <= 0:
        return None
    lo, hi = max(0, observed - rounding) / terms, observed / floor
    if before is None or lo > before[1] or hi < before[0]:
        return lo, hi
    return max(lo, before[0]), min(hi, before[1])


def projection(totals: LedgerTotals, cost: CostModel) -> int:
    """What the ledger expects the engine to hold beyond idle now (``CostModel.at_once``)."""
    return cost.at_once(totals.projected_bytes, totals.running_requests)


class LaneWatch:
    def __init__(self, own: Rules) -> None:
        # The policy's own rules (nothing learned): its margin, idle figure and monitor settings.
        self._own = own
        self.margin = own.cost.margin
        # The finding that set the margin in force (None: the policy's own).
        self.margin_finding: Finding | None = None
        # What a reading is compared with, as a multiple of the cost terms (None: the projection as
        # charged, margin included): the calibrated ratio, then the largest a finding showed.
        self.covered = own.cost.calibrated_ratio
        self.idle: IdleFree | None = None
        self.engine_restarts = 0
        self.underestimates = 0
        # Readings that showed memory taken while nothing was admitted (not counted as findings).
        self.unprojected = 0
        self.worst_ratio: float | None = None
        self.last: Finding | None = None
        self._traffic = False  # anything admitted on this engine process
        self._last_activity = -math.inf
        self._low_water: int | None = None
        self._prev_free: int | None = None
        self._last_gpu: GpuSignals | None = None
        # The largest projection since the idle figure (this engine process), and since the previous
        # GPU reading, each with the margin it was made with.
        self._peak: tuple[int, float] = (0, self.margin)
        self._window: tuple[int, float] = (0, self.margin)
        # The margin of the latest charge: the ledger's bytes were projected with it or a lower one
        # (a raised margin applies to requests admitted after it, not to the bytes already booked).
        self._charged_with = self.margin
        # The smallest margin anything was priced with: the ledger's bytes over it bound their cost
        # terms from above, whatever margin each was charged. Only a policy load lowers the margin in
        # force (``raised_margin`` never does), so ``reload`` is the one place it moves.
        self._floor = self.margin
        self._alive: dict[int, str] = {}
        self._window_ids: dict[str, None] = {}
        # The final peaks of the counted prefills that ended since the previous reading (``left``): of
        # those that ended while others were in flight, and the largest such sum that ended with none.
        self._ended_now = 0
        self._ended_before = 0
        # What the latest charge was priced with (the policy's model until the first charge).
        self._cost: CostModel = own.cost
        # -- lane facts (``core/facts.py``): the policy's against the measured, and those warned of.
        self.facts: tuple[Fact, ...] = ()
        self._warned: dict[str, tuple[int | None, int | None]] = {}
        # -- crashes: the admitted set when the engine was last seen failing, those read so far, and
        # the margin the latest one set (kept across engine restarts and reloads of the same costs).
        self._risk: AdmittedSet | None = None
        # A restart with admitted work, read at the new process's first report (``_read_restart``).
        self._restart: tuple[float, str, AdmittedSet] | None = None
        # When the latest restart was noticed: a GPU reading older than it saw the engine down (its
        # memory released), never its idle figure.
        self._restarted_at = -math.inf
        # The latest engine report seen, and the last one of the process before the latest restart: a
        # report newer than that is the new process's (the one that showed the restart may be read a
        # hair before the restart was noticed).
        self._last_report_at = -math.inf
        self._old_report_at = -math.inf
        # Evidence (``_risk``, ``_restart``) restored from the state file that no engine report of
        # this sidecar has been read against yet (``_read_carried``).
        self._carried = False
        self.upgrades = 0  # restarts onto another build with work admitted (not crashes)
        self.crashes = 0
        self.last_crash: Crash | None = None
        self.crash_margin: float | None = None
        self._fingerprint = cost_fingerprint(own)
        # -- the engine build (its version): a new one puts the lane in a conservative state, its margin
        # times 1 + ``NEW_BUILD_SAFETY``, until a reading confirms the fit (``_confirm``).
        self.build: str | None = None
        self.conservative: str | None = None  # why, while in it
        # When it went in (this watch's clock; read only while ``conservative`` is set): the state
        # file keeps it (as wall-clock time) so a sidecar restart does not start the wait again.
        self.conservative_since: float | None = None
        # -- the largest prompt this engine process served (its cost terms, bytes): the monitor does
        # not raise the margin so far that it would be unfit (``raised_margin``'s ceiling).
        self._raw: dict[int, int] = {}
        self._served_raw = 0
        self._transient_cap: int | None = None
        # -- what the readings of a prefill in flight alone bound the lane's draw by (``draw_bracket``),
        # and the chunk size the projections at progress step by (the rules in force).
        self.bracket: tuple[float, float] | None = None
        self._bracket_of: str | None = None  # the prefill whose readings it is
        self._chunk_tokens = own.lane.chunked_prefill_size
        # -- what the findings since the margin last moved otherwise bound the draw by from above,
        # without the safety: the margin the in-flight guard judges admitted prefills at
        # (``in_flight_margin``); None: the margin in force (no finding, or one that bounded nothing).
        self._in_flight: float | None = None
        # Told when something the state file keeps changed (the app writes it: ``ops/learned_file``).
        self.on_learned: Callable[[], None] = lambda: None

    @property
    def own(self) -> Rules:
        """The policy's own rules, before anything was learnt (what ``policy_limits`` exports)."""
        return self._own

    @property
    def priced(self) -> CostModel:
        """The cost model the ledger's bytes were priced with: the rules' coefficients at the margin
        of the latest charge (a raised margin prices the requests admitted after it, not those in
        flight, so a reading is compared with what they were charged)."""
        c = self._cost
        return c if c.margin == self._charged_with else replace(c, margin=self._charged_with)

    # -- what Admission tells it ---------------------------------------------------------------------

    def reload(self, own: Rules) -> None:
        """A new policy (its own rules): its own margin again, or the one a crash set where the costs are
        the same; what was measured on the engine stays."""
        same = cost_fingerprint(own) == self._fingerprint
        self._own = own
        self._fingerprint = cost_fingerprint(own)
        if not same:
            self.crash_margin = None
        self.margin = max(own.cost.margin, self.crash_margin or 0.0)
        self.margin_finding = None
        self.covered = own.cost.calibrated_ratio
        self._floor = min(self._floor, own.cost.margin)
        self.bracket = None
        self._in_flight = None
        self._warned.clear()

    @property
    def in_flight_margin(self) -> float:
        """The margin the in-flight guard prices the admitted prefills at (``core/overrun.py``): what
        the findings' readings bound the lane's draw by from above, without the monitor's safety (the
        evidence itself), never above the margin in force. A prompt admitted at the margin in force on a
        lane that draws within it fits by construction: aborting it because the margin rose by the
        safety on top of a draw is the monitor over-reacting (evidence RE1). New admissions are priced at
        the margin in force (the draw with the safety). Where a finding bounded nothing (several
        requests, progress unknown), the margin in force."""
        m = self.margin_in_force
        return m if self._in_flight is None else min(m, self._in_flight)

    def _judge_in_flight(self, before: float, upper: float | None, seen: float) -> None:
        """A finding made with the margin ``before`` in force: the in-flight guard's margin from it.
        ``upper``: what its readings bound the draw by from above (None: nothing); ``seen``: the draw
        the reading showed (a lower bound, which the allocator's rounding may put a hair above it)."""
        if upper is None:
            self._in_flight = None
            return
        # Never below the margin the in-flight work was judged at before this finding.
        evidence = max(before, upper, seen)
        self._in_flight = evidence if self._in_flight is None else max(self._in_flight, evidence)

    @property
    def margin_in_force(self) -> float:
        """The margin the rules carry: the learned one, raised by ``NEW_BUILD_SAFETY`` while a new
        engine build is unconfirmed (never above ``max_margin``, nor below the learned one)."""
        if self.conservative is None:
            return self.margin
        cap = max(self._own.monitor.max_margin, self._own.cost.margin)
        return max(self.margin, min(cap, self.margin * (1.0 + NEW_BUILD_SAFETY)))

    def engine_restarted(
        self, now: float, why: str = "restarted", admitted: AdmittedSet | None = None
    ) -> bool:
        """A new engine process: its idle figure is measured again, its allocator starts empty. Where
        the gate had admitted work when it went (``admitted``, or the set seen when it was last seen
        failing), the restart is read when the new process first reports (``_read_restart``): the same
        build, a crash (an under-prediction of that set, ``_crash``); another build, a planned upgrade
        (conservative until confirmed, ``_see_build``). True when the margin in force changed."""
        changed = False
        if self._carried:
            # Evidence restored from the state file and no report read yet: this restart is the one
            # it awaits (a sidecar started while the engine was down sees it come back), not a second
            # one; the first report decides (``_read_carried``). A set of this sidecar's own is a set
            # at risk until then.
            if admitted is not None:
                self.at_risk(admitted)
        else:
            evidence = self._risk or admitted
            self._risk = None
            # An earlier restart whose process never reported: no build to tell an upgrade by, a crash.
            changed = self._read_restart(None)
            if evidence is not None:
                # Read when the new process first reports (``_read_restart``): its build tells a
                # planned upgrade from a crash. Kept in the state file until then.
                self._restart = (now, why, evidence)
                self.on_learned()
        self._restarted_at = now
        self._old_report_at = self._last_report_at
        self._served_raw = 0
        self.engine_restarts += 1
        had = self.idle
        self.idle = None
        self._traffic = False
        self._low_water = self._prev_free = None
        self._peak = self._window = (0, self.margin)
        self._window_ids = {}  # the old process's requests: a finding on the new one does not name them
        self._ended_now = self._ended_before = 0
        self.bracket = None
        self._in_flight = None
        if had is not None or self._own.vram.idle_free_auto:
            log.info(
                "engine changed (%s): idle free memory will be measured again when it is idle",
                why,
                extra={"fields": {"event": "idle_free_reset", "why": why}},
            )
        return changed

    def _read_restart(self, snap: Snapshot | None) -> bool:
        """The restart kept by ``engine_restarted``, read against the new process's first report
        (``snap``; None: it never reported before the next restart). A build other than the one the
        lane was learned on says the process was replaced on purpose (a deploy, a rolling upgrade):
        what it killed did not run out of memory, and the new build is priced conservatively until a
        reading confirms the fit (``_see_build``). The same build, or none reported: a crash. True
        when the margin in force changed."""
        pending = self._restart
        if pending is None:
            return False
        at, why, evidence = pending
        version = None
        if snap is not None:
            e = snap.engine
            if e is None or e.observed_at <= self._old_report_at or snap.engine_health.consecutive_failures:
                return False  # not the new process's report yet
            version = e.version
        self._restart = None
        if version is not None and self.build is not None and version != self.build:
            self.upgrades += 1
            log.warning(
                "engine restarted (%s) onto a new build %s -> %s while the gate had admitted %d "
                "request(s): read as a planned upgrade, not a crash (drain the lane before an upgrade "
                "to spare them); the new build is priced conservatively until its fit is confirmed",
                why,
                self.build,
                version,
                evidence.count,
                extra={
                    "fields": {
                        "event": "engine_upgraded_under_load",
                        "from": self.build,
                        "to": version,
                        **evidence.fields(),
                    }
                },
            )
            return False
        return self._crash(at, why, evidence)

    def at_risk(self, s: AdmittedSet) -> None:
        """The engine was seen failing (a scrape failed, an admitted request's connection broke) while
        ``s`` was admitted: kept as the evidence if the engine turns out to have restarted. The first
        sign wins (the set shrinks as the failed requests end)."""
        if self._risk is None and s.request_ids:
            self._risk = s
            self.on_learned()  # a sidecar restart before the engine is back keeps it (``kept``)

    def engine_ok(self, now: float, since: float) -> None:
        """The same engine process answered, read ``since`` or later than the set was kept: it did not
        die (a lost scrape, one broken connection), and the set is no evidence. Not a set restored
        from the state file: this sidecar cannot tell which process answers by when it reported, only
        by its pids (``_read_carried``)."""
        if not self._carried and self._risk is not None and since >= self._risk.at:
            self._risk = None
            self.on_learned()

    def _read_carried(self, snap: Snapshot, now: float) -> None:
        """Evidence restored from the state file, at this sidecar's first clean engine report. A restart
        the previous sidecar noticed stays pending: this report is the new process's (``_read_restart``
        reads it next), whatever its pids (a restarted container may reuse the old numbers). A set
        seen failing with no restart noticed: the scheduler pids tell the process. The same pids as
        when the set was kept: the process that was failing answers, it did not die (``engine_ok``:
        the set is no evidence). Other pids, none where it named some (a process that published its
        pid-labelled gauges keeps publishing them; a fresh one has none yet), or none on either side
        (nothing tells; the engine was seen failing with work admitted, and a restart not ruled out
        is read as one: the safe side): a new process, and this its first report; read as a restart
        noticed now."""
        e = snap.engine
        if not self._carried or e is None or snap.engine_health.consecutive_failures:
            return
        self._carried = False
        s = self._risk
        if s is None or self._restart is not None:
            return
        self._risk = None
        if s.pids and e.pids == s.pids:
            log.info(
                "the engine that was failing when the sidecar restarted answers with the same scheduler "
                "pids %s: the same process, no restart; the %d request(s) then admitted are no evidence",
                list(s.pids),
                s.count,
                extra={"fields": {"event": "engine_same_process", "pids": list(s.pids)}},
            )
            self.on_learned()
            return
        why = (
            f"failing when the sidecar restarted; scheduler pid {list(s.pids)} -> {list(e.pids)}"
            if s.pids or e.pids
            else "failing when the sidecar restarted; no scheduler pid to tell the process by"
        )
        self._restart = (now, why, s)

    def admitted_set(self, totals: LedgerTotals, rules: Rules, snap: Snapshot, now: float) -> AdmittedSet:
        """What is admitted now, for ``at_risk``: its projection and what the gate could hand out."""
        v = rules.vram
        if not v.uses_gpu_signal and v.idle_free_bytes is not None:
            budget: int | None = idle_budget(v, snap.gpu) - v.reserve_bytes
        elif self.idle is not None:
            budget = self.idle.free_bytes - v.reserve_bytes
        else:
            budget = None
        return AdmittedSet(
            now,
            tuple(self._alive.values()),
            projection(totals, self.priced),
            self._charged_with,
            budget,
            v.reserve_bytes,
            snap.engine.pids if snap.engine is not None else (),
        )

    def _crash(self, now: float, why: str, s: AdmittedSet) -> bool:
        before = self.margin_in_force
        target = crash_margin(s, self._own.monitor, self._own.cost.margin)
        if target is not None and target > self.margin:
            self.margin = target
            self.crash_margin = max(self.crash_margin or 0.0, target)
        self._in_flight = None  # the evidence did not hold: the margin in force
        self.crashes += 1
        crash = Crash(now, why, s, before, self.margin_in_force)
        self.last_crash = crash
        unexplained = target is not None and target >= max(
            self._own.monitor.max_margin, self._own.cost.margin
        )
        log.warning(
            "engine restarted (%s) while the gate had admitted %d request(s) projected at %.0f MiB of a "
            "%s budget: read as an under-prediction, margin %.3f -> %.3f%s; admitted: %s",
            why,
            s.count,
            s.projected_bytes / 2**20,
            "unknown" if s.budget_bytes is None else f"{s.budget_bytes / 2**20:,.0f} MiB",
            before,
            crash.margin_after,
            " (capped at monitor.max_margin: the admitted prefills alone do not explain it; check the lane)"
            if unexplained
            else "",
            ", ".join(s.request_ids[:MAX_IDS]) or "none",
            extra={"fields": {"event": "engine_crash", **crash.fields()}},
        )
        self.on_learned()
        return crash.margin_after != before

    def charged(
        self,
        key: int,
        request_id: str,
        totals: LedgerTotals,
        cost: CostModel,
        progress: bool,
        charge_bytes: int = 0,
    ) -> None:
        """A request was admitted (until it ``ended``, no reading is an idle one).

        ``progress``: the in-flight prefills' progress is known (``core/overrun.py``), so the readings
        are compared with what they allocate at the point reached (``observe(in_flight=...)``), and
        the request's final peak is not yet expected: only the batch join it may cause is."""
        self._alive[key] = request_id
        self._raw[key] = int(charge_bytes / cost.margin) if cost.margin > 0 else charge_bytes
        self._window_ids.setdefault(request_id)  # an ordered set
        self._traffic = True
        self._charged_with = cost.margin
        self._cost = cost
        expected = cost.join_bytes(totals.running_requests) if progress else projection(totals, cost)
        self.expect(expected)

    def expect(self, nbytes: int) -> None:
        """The engine may have allocated ``nbytes`` beyond idle since the previous reading (a prefill
        that finished between two readings reached its final peak there)."""
        p = (nbytes, self._charged_with)
        # max(self._window, p) and max(self._peak, p) without the builtin calls (~1.2k instructions
        # each under 3.11; at every admission, issue #27): max keeps the first of equals, as these do.
        if p > self._window:
            self._window = p
        if p > self._peak:
            self._peak = p

    def left(self, peak: int, last: bool) -> None:
        """A prefill whose progress was counted ended (its first byte, an abort, a failure), with its
        final peak ``peak`` (``overrun.final_bytes``); ``last``: no other prefill is in flight now.
        O(1): the next reading is compared with the sum of the peaks that ended since the previous one
        plus what the prefills in flight then have reached (``observe(in_flight=...)``), see
        :meth:`_ended`."""
        self._ended_now += peak
        if last:
            # No prefill in flight now overlapped these: the prefills that come next are summed apart.
            self._ended_before = max(self._ended_before, self._ended_now)
            self._ended_now = 0

    def _ended(self, in_flight: int | None) -> int:
        """What the engine may have allocated since the previous reading for the counted prefills that
        ended in between (``left``), with ``in_flight`` what the prefills in flight at this reading
        reach (None, unknown: 0 here, their final peaks are expected then); 0 when none ended.

        Why it is enough: when prefill i ended, the engine held at most i's final peak plus what each
        prefill P then in flight had reached. Either P ended later, before this reading: prefills were
        in flight all along between the two ends, so P's final peak, the most P can reach, is in i's
        sum. Or P is still in flight: i's sum is the open one (``_ended_now``), and ``in_flight``
        prices P at its progress now, at least its progress then (progress only grows, and the
        estimate bounds it from above, as every reading's comparison assumes). So the figure is at
        least what pricing every in-flight prefill at i's end gave (the O(in-flight) walk per first
        byte this replaces) whenever that estimate did not fall in between; where it did (a newer
        counter below an earlier allowance, a start or a cache hit shown since), the engine's real
        progress still bounds P, and ``in_flight`` bounds that. It is looser than that walk by the
        peaks of prefills that ended one after another while others ran (a larger projection: never a
        false finding); a sum closes when nothing is left in flight, as no later prefill overlapped it."""
        if not (self._ended_before or self._ended_now):
            return 0  # none ended: the reading is compared with what is in flight (``_check``)
        return max(self._ended_before, self._ended_now + (in_flight or 0))

    def ended(self, key: int, now: float) -> None:
        self._raw.pop(key, None)
        if self._alive.pop(key, None) is not None:
            self._last_activity = now

    def prefilled(self, key: int) -> None:
        """A prompt's prefill finished on this engine (its first byte): the lane fits its transient."""
        raw = self._raw.pop(key, 0)
        if raw > self._served_raw:  # max(served, raw) without the builtin call (every first byte)
            self._served_raw = raw

    def _ceiling(self) -> float | None:
        """The margin at which the largest prompt served on this engine would become unfit."""
        if not self._served_raw or self._transient_cap is None:
            return None
        return self._transient_cap / self._served_raw

    def observe(
        self,
        snap: Snapshot,
        totals: LedgerTotals,
        rules: Rules,
        now: float,
        in_flight: int | None = None,
        defer: bool = False,
        done: int | None = None,
    ) -> bool:
        """A new snapshot; True when the rules it builds (``effective``) change.

        ``in_flight``: what the in-flight prefills allocate at the progress they have reached
        (``core/overrun.in_flight_bytes``), None when their progress is unknown: a reading is then
        compared with their final peaks, so a long prefill that runs over is seen only near its end.
        ``defer``: their progress is too old for this GPU reading (``PrefillProgress.too_old``); it is
        compared at the next snapshot, with the next engine report. ``done``: what a prefill in flight
        alone has surely allocated (``core/overrun.done_bytes``, the chunks the counter showed done), None
        where nothing says: the readings' upper bound on the draw (``draw_bracket``)."""
        self._read_carried(snap, now)
        changed = self._read_restart(snap)
        changed = self._measure_idle(snap, rules, now) or changed
        if snap.engine is not None and not snap.engine_health.consecutive_failures:
            self._last_report_at = max(self._last_report_at, snap.engine.observed_at)
        changed = self._see_build(snap, now) or changed
        changed = self._compare_facts(snap) or changed
        self._transient_cap = rules.vram.transient_cap()
        self._chunk_tokens = rules.lane.chunked_prefill_size
        g = snap.gpu
        if g is not None and g is not self._last_gpu and g.free_bytes is not None and not defer:
            self._last_gpu = g
            changed = self._check(snap, g, g.free_bytes, totals, rules.cost, now, in_flight, done) or changed
        return changed

    # -- what it gives back ----------------------------------------------------------------------------

    @property
    def learned(self) -> Learned:
        """What was learnt, for ``rules_in_force``: the margin in force (a new build's conservative
        pricing included), the measured idle figure and each GPU's, and the lane facts that disagree."""
        idle = self.idle
        return Learned(
            idle_free_bytes=None if idle is None else idle.free_bytes,
            idle_other_process_bytes=None if idle is None else idle.other_process_bytes,
            margin=self.margin_in_force,
            idle_devices=() if idle is None else idle.devices,
            facts=lane_facts.overrides(self.facts),
        )

    def state(self, now: float) -> dict[str, Any]:
        """For /admission/state: ages in seconds (the admin endpoint adds wall-clock times)."""
        v, m, idle = self._own.vram, self._own.monitor, self.idle
        if idle is not None:
            note = "measured" + (
                " after traffic (a low-water mark: conservative)" if idle.after_traffic else ""
            )
        elif v.idle_free_auto:
            note = "not measured yet (waiting for an idle engine): headroom is live GPU free memory"
        else:
            note = "not measured yet (the policy's figure is in force)"
        f = self.margin_finding
        return {
            "lane_facts": {x.name: x.fields() for x in self.facts},
            "crashes": {
                "count": self.crashes,
                "margin": self.crash_margin,
                "last": None
                if self.last_crash is None
                else self.last_crash.fields() | {"age_s": round(now - self.last_crash.at, 3)},
                "at_risk": None if self._risk is None else self._risk.fields(),
                # Restarts onto another build with work admitted: planned upgrades, not crashes.
                "upgrades_under_load": self.upgrades,
            },
            "engine_build": {
                "version": self.build,
                "conservative": self.conservative is not None,
                "why": self.conservative,
                "since_age_s": None if self.conservative is None else _age(now, self.conservative_since),
                "margin_in_force": round(self.margin_in_force, 4),
            },
            "idle_free": {
                "policy": "auto" if v.idle_free_auto else v.idle_free_bytes,
                "measured_bytes": idle.free_bytes if idle else None,
                "measured_other_process_bytes": idle.other_process_bytes if idle else None,
                "measured_age_s": None if idle is None else round(now - idle.measured_at, 3),
                "measured_devices": [
                    {
                        "ident": d.ident,
                        "free_bytes": d.free_bytes,
                        "other_process_bytes": d.other_process_bytes,
                    }
                    for d in (idle.devices if idle else ())
                ],
                "after_traffic": idle.after_traffic if idle else None,
                "engine_restarts": self.engine_restarts,
                "note": note,
            },
            "monitor": {
                "underestimates": self.underestimates,
                "unprojected_allocations": self.unprojected,
                "worst_ratio": None if self.worst_ratio is None else round(self.worst_ratio, 4),
                "last": None
                if self.last is None
                else self.last.fields() | {"age_s": round(now - self.last.at, 3)},
                # Readings are compared with the cost terms times this (None: with the projection).
                "covered_ratio": None if self.covered is None else round(self.covered, 4),
                # What the readings of a lone prefill bound the lane's draw by (multiples of the cost
                # terms, ``draw_bracket``); None: no such readings since the draw last changed.
                "draw_bracket": None if self.bracket is None else [round(x, 4) for x in self.bracket],
                "raise_margin": m.raise_margin,
                "max_margin": max(m.max_margin, self._own.cost.margin),
                "margin": {
                    "policy": self._own.cost.margin,
                    "effective": round(self.margin_in_force, 4),
                    # What the in-flight guard judges admitted prefills at (``in_flight_margin``).
                    "in_flight": round(self.in_flight_margin, 4),
                    "raised": f is not None,
                    "since_age_s": None if f is None else round(now - f.at, 3),
                    "why": None if f is None else _why(f),
                },
            },
        }

    # -- internals ---------------------------------------------------------------------------------

    def _measure_idle(self, snap: Snapshot, rules: Rules, now: float) -> bool:
        e, g = snap.engine, snap.gpu
        if e is None or g is None or g.free_bytes is None:
            return False
        if self.idle is not None and (self.idle.after_traffic or self._traffic):
            return False
        idle = (
            not self._alive
            and snap.engine_health.consecutive_failures == 0
            and e.running_requests == 0
            and e.queue_requests == 0
            and min(e.observed_at, g.observed_at) >= self._last_activity
            and e.observed_at > self._old_report_at  # the new process's report
            # The GPU read after the restart was seen (as the decision waits for it: a source that
            # reports when its figure last changed, a file, is confirmed by every good poll).
            and max(g.observed_at, snap.gpu_health.last_ok_at or g.observed_at) >= self._restarted_at
            and now - e.observed_at <= rules.engine.max_age_s
            and now - g.observed_at <= rules.gpu.max_age_s
        )
        if not idle or (self.idle is not None and g.free_bytes <= self.idle.free_bytes):
            return False
        if self.idle is not None and e.observed_at < g.observed_at:
            # Raising a figure: only on a GPU reading the engine answered after. An engine that just
            # went away (a restart, a crash) has released its memory: that reading is not its idle.
            return False
        first = self.idle is None
        devices = tuple(DeviceBaseline(d.ident, d.free_bytes, d.other_process_bytes) for d in g.devices)
        self.idle = IdleFree(g.free_bytes, g.other_process_bytes, now, self._traffic, devices)
        # The allocator holds nothing beyond idle now: new lows count from the idle figure again
        # (``_check``). An earlier, higher low-water mark would change no comparison: a reading above
        # the idle figure shows nothing allocated beyond it.
        self._low_water = None
        if first:
            log.info(
                "idle GPU free memory measured: %.0f MiB%s",
                g.free_bytes / 2**20,
                " (after traffic: a low-water mark)" if self._traffic else "",
                extra={"fields": {"event": "idle_free_measured", "free_bytes": g.free_bytes}},
            )
        return self._own.vram.idle_free_auto

    def _see_build(self, snap: Snapshot, now: float) -> bool:
        """The engine's build (its reported version): a different one than the lane was learned on puts
        it in the conservative state. True when the margin in force changed."""
        version = snap.engine.version if snap.engine is not None else None
        if version is None or version == self.build:
            return False
        before, self.build = self.build, version
        if before is None:
            self.on_learned()
            return False
        was = self.margin_in_force
        self.conservative = f"engine build {before} -> {version}"
        self.conservative_since = now
        self._in_flight = None
        log.warning(
            "%s: the lane's learned margin %.3f is priced x%.2f (%.3f) until a reading confirms the fit",
            self.conservative,
            self.margin,
            1.0 + NEW_BUILD_SAFETY,
            self.margin_in_force,
            extra={"fields": {"event": "engine_build_changed", "from": before, "to": version}},
        )
        self.on_learned()
        return self.margin_in_force != was

    def _compare_facts(self, snap: Snapshot) -> bool:
        """Policy against measurement (``core/facts.py``); a warning once per change of a disagreement.
        True when a figure in force changed."""
        g = snap.gpu
        facts = lane_facts.compare(
            self._own,
            snap.engine,
            self.idle.free_bytes if self.idle is not None else None,
            len(g.devices) if g is not None and g.devices else None,
            idle_free_policy=self._own.vram.idle_free_bytes,
        )
        if facts == self.facts:
            return False
        before = lane_facts.overrides(self.facts)
        self.facts = facts
        for f in facts:
            key = (f.policy, f.measured)
            if not f.disagrees:
                self._warned.pop(f.name, None)
                continue
            if self._warned.get(f.name) == key:
                continue
            self._warned[f.name] = key
            log.warning(
                "lane fact %s: the policy says %s, the lane measures %s; %s",
                f.name,
                f.policy,
                f.measured,
                f"in force: {f.in_force} (the safer figure)" if f.in_force is not None else "check the lane",
                extra={"fields": {"event": "lane_fact_disagrees", "fact": f.name, **f.fields()}},
            )
        return before != lane_facts.overrides(facts)

    def _bracket(
        self,
        observed: int,
        projected: int,
        projected_with: float,
        lone: str | None,
        done: int | None,
        now: int,
    ) -> tuple[float | None, float]:
        """The upper bound the readings put on the lane's draw (``draw_bracket``), where they can:
        readings of one request alone (``lone``, its id), which holds at least its projection at its
        progress (``now``; 0 once its prefill ended: the peak the reading is compared with) less a
        chunk, or ``done`` where that is more (the chunks the counter showed done,
        ``core/overrun.done_bytes``; 0, nothing sure: no bound). Other readings (several requests, a sum of ended peaks, progress
        unknown) can run ahead by more than a chunk: the bracket is dropped and a finding is priced on
        its draw plus the safety. A bracket is one prefill's: another prompt starts its own (the draw
        may have changed in between unseen, under the allocator's cached peaks: evidence RE1). With
        it, the allocator's rounding on this reading (one block: one request) as a multiple of its
        cost terms (``raised_margin``'s ``slack``)."""
        if lone is None or projected <= 0 or projected_with <= 0 or self._chunk_tokens <= 0:
            self.bracket = None
            return None, 0.0
        if lone != self._bracket_of:
            self.bracket, self._bracket_of = None, lone
        terms = round(projected / projected_with)
        growth = chunk_growth(self._cost, self._chunk_tokens)
        # Its projection (in flight: at its progress; else the peak compared with) less a chunk, or
        # what its counter says it holds where that is more (0: nothing sure before its first batch).
        below = (round(now / self._charged_with) if now else terms) - growth
        if done is not None:
            below = max(below, round(done / self._charged_with)) if done else 0
        rounding = self._own.monitor.allocator_block_bytes
        self.bracket = draw_bracket(observed, terms, growth, self.bracket, rounding, below)
        return (None, 0.0) if self.bracket is None else (self.bracket[1], rounding / terms)

    def _bound_above(self, observed: int, lone: str | None, done: int | None) -> None:
        """A reading that shows nothing new still bounds a lone prefill's draw from above: the engine
        holds at least ``done`` for it (``core/overrun.done_bytes``) and the reading shows at least
        that times the draw, whatever it shows of earlier peaks. It narrows the bracket (never starts
        one: its lower bound needs a reading compared with a projection, ``_bracket``); one below the
        bracket says the draw fell (a reading that confirms nothing here: the bracket stays)."""
        b = self.bracket
        if b is None or lone != self._bracket_of or not done or observed <= 0:
            return
        hi = observed / round(done / self._charged_with)
        if hi >= b[0]:
            self.bracket = (b[0], min(b[1], hi))

    def _confirm(
        self,
        observed: int,
        projected: int,
        projected_with: float,
        requests: int,
        upper: float | None,
        slack: float,
    ) -> bool:
        """While a new build is unconfirmed, a reading that shows a new peak of what the lane draws for
        admitted work. It bounds the draw (a multiple of the cost terms) from below, ``observed / terms``:
        the projection may hold bytes the engine never drew (a full chunk priced where its last chunk was
        shorter), so the draw may be larger. Only a bound from above confirms the fit: ``upper``, what the
        readings of one prefill alone allow (``draw_bracket``; where the projection has nothing the engine
        may not draw, the two bounds meet). Within the learned margin (and the monitor's tolerance) the
        lane leaves the conservative state. A lower bound beyond the margin raises it (``raised_margin``,
        to at least ``upper`` where there is one), and the raised margin is confirmed where it covers
        ``upper``; a lower bound within the margin says nothing (issue 29: a reading at x1.048 of terms
        that priced a full last chunk confirmed a build drawing x1.10). True: the rules changed."""
        if self.conservative is None or projected <= 0 or projected_with <= 0:
            return False
        terms = projected / projected_with
        drew = observed / terms  # at least what the lane drew, as a multiple of the cost terms
        m = self._own.monitor
        # Only a reading that could show the change the state guards against confirms anything: the
        # safety's share of this projection beyond what the monitor tolerates (a small prompt cannot).
        expected = terms * self.margin
        if expected * NEW_BUILD_SAFETY <= max(
            m.min_bytes, m.allocator_block_bytes * requests, expected * m.tolerance
        ):
            return False
        before = self.margin
        if excess(observed, round(expected), m, requests) is not None:
            self.margin = raised_margin(
                self.margin, 1.0, self._own.cost.margin, drew, m, self._ceiling(), upper, slack
            )
            self._in_flight = None  # a new build's fit: the in-flight work is judged at the margin
        # ``upper`` is one prefill's (``_bracket``: a reading of one request alone): one block of rounding.
        confirmed = upper is not None and excess(round(terms * upper), round(terms * self.margin), m) is None
        if not confirmed and self.margin == before:
            return False  # a lower bound within the margin: nothing learnt
        why = self.conservative
        if confirmed:
            self.conservative = None
        log.warning(
            "%s: %s (the lane drew x%.3f of its cost terms, at most %s); margin %.3f -> %.3f",
            why,
            ("fit confirmed" if self.margin == before else "fit re-measured")
            if confirmed
            else "margin raised, fit not confirmed (no reading bounds the draw from above within it)",
            drew,
            "unbounded" if upper is None else f"x{upper:.3f}",
            before,
            self.margin,
            extra={
                "fields": {
                    "event": "engine_build_confirmed" if confirmed else "engine_build_margin_raised",
                    "drew": round(drew, 4),
                    "upper": None if upper is None else round(upper, 4),
                    "margin": self.margin,
                }
            },
        )
        self.on_learned()
        return True

    # -- the state file (``ops/learned_file.py`` reads and writes it atomically) ------------------------

    def kept(self) -> dict[str, Any]:
        """What a sidecar restart keeps, as JSON: the margins learned against these costs, the engine
        build and, while it is unconfirmed, why and since when (this watch's clock: ``ops/learned_file``
        writes it as wall-clock time), with the margin in force (for the reader: ``restore`` derives it
        again from the learned margin, under the policy in force then); and the crash evidence not yet
        read, while there is some: the set admitted when the engine was seen failing (``at_risk``) and
        a restart noticed whose new process has not reported (``pending_restart``), so that a sidecar
        restarted while a big model loads still reads the crash when the engine is back."""
        unconfirmed = self.conservative is not None
        kept: dict[str, Any] = {
            "version": STATE_VERSION,
            "cost_fingerprint": self._fingerprint,
            "margin": self.margin,
            "crash_margin": self.crash_margin,
            "crashes": self.crashes,
            "engine_build": self.build,
            "conservative": self.conservative,
            "conservative_since": self.conservative_since if unconfirmed else None,
            "margin_in_force": self.margin_in_force,
        }
        # Only while there is evidence: a file with nothing pending loads in a sidecar that predates it.
        if self._risk is not None:
            kept["at_risk"] = self._risk.kept()
        if (pending := self._restart) is not None:
            kept["pending_restart"] = {"at": pending[0], "why": pending[1], "admitted": pending[2].kept()}
        return kept

    def restore(self, saved: dict[str, Any], now: float) -> str:
        """What a previous run kept (``kept``, validated by ``ops/learned_file``); says what was taken.
        The engine build and an unconfirmed state always (a sidecar restarted before a new build was
        confirmed stays conservative: the old margin is no evidence about it), since when in this
        watch's clock (``now`` where the file does not say). Margins only for the same costs (another
        calibration starts from its own margin); never below the policy's margin nor above the cap. The
        crash evidence not yet read (``kept``) only for the same costs too (its projection is priced in
        them): it comes back armed, read at this sidecar's first engine report (``_read_carried``)."""
        self.build = saved.get("engine_build")
        self.conservative = saved.get("conservative")
        since = saved.get("conservative_since")
        self.conservative_since = None if self.conservative is None else (now if since is None else since)
        self.crashes = saved.get("crashes", 0)
        build = f"engine build {self.build}"
        if self.conservative is not None:
            build += f" unconfirmed ({self.conservative})"
        if saved.get("cost_fingerprint") != self._fingerprint:
            return f"{build}; margins ignored (the policy's costs changed)"
        cap = max(self._own.monitor.max_margin, self._own.cost.margin)
        self.margin = max(self.margin, min(cap, saved["margin"]))
        crash = saved.get("crash_margin")
        if crash is not None:
            self.crash_margin = min(cap, crash)
        return (
            f"margin {self.margin:.4f} (in force {self.margin_in_force:.4f}), {build}, "
            f"{self.crashes} crash(es) before{self._restore_pending(saved)}"
        )

    def _restore_pending(self, saved: dict[str, Any]) -> str:
        """The crash evidence ``kept`` wrote, armed again (``restore``); what it says of it."""
        risk, pending = saved.get("at_risk"), saved.get("pending_restart")
        said = ""
        if risk is not None:
            self._risk = AdmittedSet.from_kept(risk)
            said += f"; engine seen failing with {self._risk.count} request(s) admitted"
        if pending is not None:
            s = AdmittedSet.from_kept(pending["admitted"])
            self._restart = (pending["at"], pending["why"], s)
            said += f"; engine restarted ({pending['why']}) with {s.count} request(s) admitted"
        self._carried = bool(said)
        return said + (": read at the engine's first report" if said else "")

    def _baseline(self) -> tuple[int, int | None] | None:
        """(idle free, other processes then): the sidecar's measurement, else the policy's figure."""
        if self.idle is not None:
            return self.idle.free_bytes, self.idle.other_process_bytes
        v = self._own.vram  # the policy's own figure (None for ``auto``)
        return None if v.idle_free_bytes is None else (v.idle_free_bytes, v.other_processes_bytes)

    def _check(
        self,
        snap: Snapshot,
        g: GpuSignals,
        free: int,
        totals: LedgerTotals,
        cost: CostModel,
        now: float,
        in_flight: int | None,
        done: int | None = None,
    ) -> bool:
        base = self._baseline()
        prev, self._prev_free = self._prev_free, free
        expected = (
            projection(totals, cost)
            if in_flight is None
            else cost.at_once(in_flight, totals.running_requests)
        )
        current = (expected, self._charged_with)
        ended = (self._ended(in_flight), self._charged_with)
        self._ended_now = self._ended_before = 0
        window, ids = max(self._window, current, ended), tuple(self._window_ids)
        self._peak = max(self._peak, ended)
        # What the next reading must still allow for from this one. Without progress, this projection:
        # a prefill that ends before then leaves the ledger, while its peak stays in the allocator's
        # cache. With progress, only the running batch's join (a batch that shrinks before then
        # allocated its join with more requests): the prefills still in flight then are priced at
        # their progress then, which bounds what they allocated in between (true progress only grows),
        # and those that end in between are counted by ``left``. Carrying this reading's estimate for
        # them instead would carry its over-estimate (up to a chunk ahead), and a next reading would
        # not see an overrun smaller than that: too late for a prompt at the edge of its margin
        # (evidence D17).
        self._window = (
            current if in_flight is None else (cost.join_bytes(totals.running_requests), self._charged_with)
        )
        self._window_ids = dict.fromkeys(self._alive.values())
        # An engine that does not answer may be restarting: its new process's boot is no request's.
        if base is None or snap.engine_health.consecutive_failures:
            return False
        idle_free, idle_other = base
        grown = 0
        if g.other_process_bytes is not None and idle_other is not None:
            grown = max(0, g.other_process_bytes - idle_other)
        observed = idle_free - free - grown
        lone = ids[0] if in_flight is not None and len(ids) == 1 else None
        low = idle_free if self._low_water is None else self._low_water
        if free < low:
            self._low_water = free
            reference = max(self._peak, window)
        elif prev is not None and free < prev:
            reference = window
        else:
            self._bound_above(observed, lone, done)
            return False
        projected, projected_with = reference
        requests = max(1, len(ids))
        # A new build's fit is read only where the reading shows the peaks: a new low with no prefill
        # in flight (those that ran since the idle figure ended, their peaks in the allocator's
        # cache). A reading mid-prefill shows part of a peak: below the projection, it confirms nothing.
        shows_peaks = free < low and not self._raw
        upper, slack = self._bracket(observed, projected, projected_with, lone, done, in_flight or 0)
        confirmed = shows_peaks and self._confirm(observed, projected, projected_with, requests, upper, slack)
        cover = self.covered
        if cover is not None and projected:
            # The cost terms (at most the bytes over the smallest margin they were priced with) times
            # what the calibration and the findings since saw: the margin's safety above that is not
            # for the lane to use unseen (the module docstring).
            projected, projected_with = round(projected * cover / self._floor), cover
        ratio = excess(observed, projected, self._own.monitor, requests)
        if ratio is None:
            return confirmed
        if math.isinf(ratio):
            # Nothing was projected: no coefficient of the policy is wrong; memory was taken outside
            # any request (another process, where the GPU source cannot tell; the engine itself).
            self.unprojected += 1
            log.info(
                "GPU memory shows %.0f MiB taken beyond idle while nothing was admitted: another "
                "process (the GPU source cannot tell) or the engine outside any request",
                observed / 2**20,
                extra={"fields": {"event": "unprojected_allocation", "observed_bytes": observed}},
            )
            return confirmed
        before = self.margin
        self.margin = raised_margin(
            before,
            projected_with,
            self._own.cost.margin,
            ratio,
            self._own.monitor,
            self._ceiling(),
            upper,
            slack,
        )
        self._judge_in_flight(before, upper, projected_with * ratio)
        if cover is not None:
            # What the lane has shown is known from now on: a later reading counts beyond it.
            self.covered = max(cover, projected_with * ratio)
        finding = Finding(
            now,
            observed,
            projected,
            ratio,
            free,
            idle_free,
            ids[:MAX_IDS],
            before,
            self.margin,
            cover,
        )
        # The same requests still running (a long prefill whose chunks grow): the same finding, worse.
        again = bool(ids) and self.last is not None and self.last.request_ids == finding.request_ids
        self.underestimates += not again
        self.last = finding
        self.worst_ratio = ratio if self.worst_ratio is None else max(self.worst_ratio, ratio)
        raised = self.margin != before
        if raised:
            self.margin_finding = finding
        if raised or not again:
            log.warning(
                "projection under-estimate: %s; recalibrate this lane (sglang-sidecar calibrate)",
                _why(finding),
                extra={"fields": {"event": "projection_underestimate", **finding.fields()}},
            )
        if raised:
            self.on_learned()
        return raised or confirmed


def _age(now: float, since: float | None) -> float | None:
    return None if since is None else round(now - since, 3)


def _why(f: Finding) -> str:
    mib = 2**20
    seen = (
        f"GPU memory showed {f.observed_bytes / mib:,.0f} MiB allocated beyond idle, the ledger projected "
        f"{f.projected_bytes / mib:,.0f} MiB"
    )
    if f.covered is not None:
        seen += f" (its cost terms x{f.covered:.3f}: what the lane was seen to allocate, without the margin's safety)"
    ratio = f"x{f.ratio:.3f}"
    who = ", ".join(f.request_ids) or "no request running"
    margin = (
        f"margin {f.margin_before:.3f} -> {f.margin_after:.3f}"
        if f.margin_after != f.margin_before
        else f"margin stays {f.margin_after:.3f}"
    )
    return f"{seen} ({ratio}) for {who}; {margin}"
