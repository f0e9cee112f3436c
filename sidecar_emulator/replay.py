"""``replay``: a scenario through the engine model and the gate, in virtual time.

The same :class:`~sidecar.admission.controller.Admission` (and so the same pure decision) as the live proxy,
driven by a virtual clock: the sidecar polls the model's *published* gauges and live free memory at
the policy's intervals, exactly as it polls a real engine, so scrape lag is part of the run. Hours of
traffic take seconds, and a seed makes every run identical.

Clients behave like the agents and batch jobs of a long-context lane: a rejected client waits
``Retry-After`` and tries again (up to its ``retries``); a failed one (engine crash, connection
refused) waits the scenario's default and tries again.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sidecar.admission.controller import Admission, Handle, Outcome
from sidecar.core import demand
from sidecar.core.decide import headroom_bytes
from sidecar.core.decision import Action, Decision
from sidecar.core.demand import Demand
from sidecar.core.ledger import LedgerTotals
from sidecar.core.rules import Rules
from sidecar.core.snapshot import SourceHealth
from sidecar.policy.schema import LoadedPolicy, PolicyError, load_policy_file
from sidecar.policy.yamlfile import ConfigError
from sidecar.signals.engine import Pacing
from sidecar_emulator.engine import EngineModel
from sidecar_emulator.events import Crashed, Failed, Finished, FirstToken, Restarted, Retracted, Tokens
from sidecar_emulator.profiles import LaneProfile, get_profile
from sidecar_emulator.readings import engine_signals, gpu_signals
from sidecar_emulator.scenario import (
    Agents,
    Burst,
    Requests,
    Rounds,
    Scenario,
    ScenarioError,
    load_scenario,
    load_trace,
)

SAMPLE_S = 0.5  # series resolution in the JSON output; the plot uses every GPU poll


@dataclass(eq=False)
class Attempt:
    """One HTTP request of a client: a turn may take several attempts."""

    rid: str
    client: Client
    arrival: float
    prompt_tokens: int
    max_new_tokens: int
    prefix: str | None
    cached_tokens: int | None
    priority: int
    tries: int = 0
    handle: Handle | None = None
    # Parallel samples per prompt (``n``): SGLang caches the prompt, then runs n copies of it.
    samples: int = 1
    admitted_at: float | None = None
    first_token_at: float | None = None


@dataclass
class RequestRecord:
    rid: str
    arrival: float
    prompt_tokens: int
    outcome: str = "in_flight"  # completed | failed | rejected:<reason> | in_flight | held
    ttft_s: float | None = None
    held_s: float = 0.0
    completion_tokens: int = 0
    cached_tokens: int = 0
    end: float | None = None
    retry_after_s: float | None = None  # what a rejection told the client, engine seconds
    # Replay only, for a rejection with a Retry-After: would a retry at that time have been let in?
    # "admit": admitted at once; "hold": queued (not rejected); "reject": rejected again.
    retry_probe: str | None = None


class Client:
    """Base of the workload generators: schedules attempts, reacts to their ends."""

    def __init__(self, driver: Driver, name: str, retries: int) -> None:
        self.driver = driver
        self.name = name
        self.retries = retries

    def start(self) -> None:
        raise NotImplementedError

    def on_done(self, a: Attempt, ok: bool, retry_after: float | None, give_up: bool = False) -> None:
        """Retry a failed attempt after ``retry_after``, up to ``retries``; subclasses chain turns.

        ``give_up``: the answer said a retry cannot help (``x-should-retry: false``), and the client
        obeys it, as the official OpenAI SDKs do."""
        if not ok and not give_up and a.tries < self.retries:
            delay = retry_after if retry_after is not None else self.driver.scenario.retry_after_default_s
            self.driver.at(
                self.driver.t + delay,
                lambda: self.driver.send(
                    self, replace_attempt(a, self.driver.new_rid(self.name), self.driver.t)
                ),
            )
            return
        self.finished(a, ok)

    def finished(self, a: Attempt, ok: bool) -> None:
        pass


def replace_attempt(a: Attempt, rid: str, t: float) -> Attempt:
    return Attempt(
        rid,
        a.client,
        t,
        a.prompt_tokens,
        a.max_new_tokens,
        a.prefix,
        a.cached_tokens,
        a.priority,
        a.tries + 1,
        samples=a.samples,
    )


class FixedRequests(Client):
    def __init__(self, driver: Driver, spec: Requests) -> None:
        super().__init__(driver, "req", spec.retries)
        self.spec = spec

    def start(self) -> None:
        for r in self.spec.requests:
            a = Attempt(
                self.driver.new_rid("req"),
                self,
                r.t,
                r.prompt_tokens,
                r.max_new_tokens,
                r.prefix,
                r.cached_tokens,
                r.priority,
                samples=r.samples,
            )
            self.driver.at(r.t, lambda a=a: self.driver.send(self, a))


class BurstClient(Client):
    def __init__(self, driver: Driver, spec: Burst) -> None:
        super().__init__(driver, "burst", spec.retries)
        self.spec = spec

    def start(self) -> None:
        s, rng = self.spec, self.driver.rng
        for i in range(s.count):
            t = s.start_s + i * s.interval_s
            tokens = rng.randint(*s.prompt_tokens)
            a = Attempt(
                self.driver.new_rid("burst"),
                self,
                t,
                tokens,
                s.max_new_tokens,
                None,
                None,
                s.priority,
                samples=s.samples,
            )
            self.driver.at(t, lambda a=a: self.driver.send(self, a))


class RoundsClient(Client):
    def __init__(self, driver: Driver, spec: Rounds) -> None:
        super().__init__(driver, "round", spec.retries)
        self.spec = spec
        self.round = 0
        self.open = 0

    def start(self) -> None:
        self.driver.at(self.spec.start_s, self._next_round)

    def _next_round(self) -> None:
        if self.round >= self.spec.rounds:
            return
        self.round += 1
        self.open = self.spec.per_round
        for _ in range(self.spec.per_round):
            tokens = self.driver.rng.randint(*self.spec.prompt_tokens)
            a = Attempt(
                self.driver.new_rid(f"round{self.round}"),
                self,
                self.driver.t,
                tokens,
                self.spec.max_new_tokens,
                None,
                None,
                0,
                samples=self.spec.samples,
            )
            self.driver.send(self, a)

    def finished(self, a: Attempt, ok: bool) -> None:
        self.open -= 1
        if self.open == 0:
            self.driver.at(self.driver.t + self.spec.gap_s, self._next_round)


class AgentClient(Client):
    """One agent: turn N sends history + N x turn_tokens, cached under the agent's own prefix key."""

    def __init__(self, driver: Driver, spec: Agents, index: int) -> None:
        super().__init__(driver, f"{spec.name}{index}", spec.retries)
        self.spec = spec
        self.index = index
        self.turn = 0
        self.context = spec.history_tokens
        self.listeners: list[tuple[int, Callable[[], None]]] = []

    def start(self, at: float | None = None) -> None:
        t = (self.spec.start_s if at is None else at) + self.index * self.spec.stagger_s
        self.driver.at(t, self._next_turn)

    def _next_turn(self) -> None:
        if self.turn >= self.spec.turns:
            return
        self.turn += 1
        self.context += self.spec.turn_tokens
        a = Attempt(
            self.driver.new_rid(self.name),
            self,
            self.driver.t,
            self.context,
            self.spec.output_tokens,
            self.name,
            None,
            self.spec.priority,
        )
        self.driver.send(self, a)

    def finished(self, a: Attempt, ok: bool) -> None:
        if not ok:
            return  # gave up after its retries: the agent's session is lost
        self.context += self.spec.output_tokens
        for turn, fn in list(self.listeners):
            if turn == self.turn:
                fn()
        self.driver.at(self.driver.t + self.spec.think_s, self._next_turn)


class Recorder:
    """The Observer for replay: decisions with their virtual time, outcomes counted."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.decisions: list[tuple[float, str, str | None]] = []
        self.counts: Counter[tuple[str, str]] = Counter()
        self.outcomes: Counter[str] = Counter()

    def decision(self, d: Decision, cost: Demand, waited_s: float, ledger: LedgerTotals) -> None:
        reason = d.reason.value if d.reason else None
        self.decisions.append((round(self.driver.t, 3), d.action.value, reason))
        self.counts[(d.action.value, reason or "none")] += 1

    def outcome(self, outcome: Outcome) -> None:
        self.outcomes[outcome.value] += 1


class _VirtualTimer:
    """A hold deadline on the virtual clock; cancelled ones still pop from the heap, as no-ops."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn: Callable[[], None] | None = fn

    def fire(self) -> None:
        if self.fn is not None:
            fn, self.fn = self.fn, None
            fn()

    def cancel(self) -> None:
        self.fn = None


class VirtualPoller:
    """One of the sidecar's pollers on the virtual clock, timed by the live pollers' rule
    (``signals.engine.Pacing``): the next read is due when that rule says, a nudge
    (``Admission.on_report_wanted``) asks it again, and a read takes no time, so none overlaps another."""

    def __init__(
        self,
        loop: VirtualLoop,
        read: Callable[[], None],
        interval_s: Callable[[], float],
        gap_s: Callable[[], float],
        wanted: Callable[[], bool],
    ) -> None:
        self.loop = loop
        self.read = read
        self.interval_s, self.gap_s, self.wanted = interval_s, gap_s, wanted
        self.pacing = Pacing()
        self.reads = 0
        self.sooner_reads = 0
        self._due = math.inf
        self._gen = 0

    def start(self, t: float) -> None:
        self._schedule(t, False)

    def nudge(self) -> None:
        due, asked = self.pacing.next_read(self.interval_s(), self.gap_s(), self.wanted())
        due = max(self.loop.t, due)
        if due < self._due:
            self._schedule(due, asked)

    def _schedule(self, t: float, asked: bool) -> None:
        self._gen += 1
        self._due = t
        self.loop.at(t, lambda g=self._gen: self._fire(g, asked), housekeeping=True)

    def _fire(self, gen: int, asked: bool) -> None:
        if gen != self._gen:
            return  # asked again since: that read is this one
        self.pacing.began(self.loop.t, asked)
        self.reads += 1
        self.sooner_reads += asked
        self.read()
        due, asked = self.pacing.next_read(self.interval_s(), self.gap_s(), self.wanted())
        self._schedule(max(self.loop.t, due), asked)


def sidecar_pollers(
    loop: VirtualLoop,
    admission: Admission | None,
    read_gpu: Callable[[], None],
    read_engine: Callable[[], None],
) -> list[VirtualPoller]:
    """A gated lane's GPU and engine pollers, wired to its gate as the app wires the live ones (none
    for an ungated lane). The GPU first: a reading at the same instant counts as taken since a wait
    began (``core/decide.py``)."""
    if admission is None:
        return []
    a = admission

    def gap() -> float:
        return a.policy.engine.poll_after_release_s

    pollers = [
        VirtualPoller(loop, read_gpu, lambda: a.policy.gpu.poll_interval_s, gap, a.report_wanted),
        VirtualPoller(loop, read_engine, lambda: a.policy.engine.poll_interval_s, gap, a.report_wanted),
    ]

    def nudge() -> None:
        for p in pollers:
            p.nudge()

    a.on_report_wanted = nudge
    return pollers


def attempt_demand(a: Attempt, rules: Rules, now: float, profile: LaneProfile, request_id: str) -> Demand:
    """What an attempt asks of a lane's gate, as if it arrived ``now``."""
    return demand.build(
        rules,
        a.prompt_tokens,
        arrived_at=now,
        max_new_tokens=a.max_new_tokens,
        samples=a.samples,
        priority=a.priority,
        request_id=request_id,
        chunk=profile.chunked_prefill_size,
    )


def submit_attempt(engine: Any, rid: str, a: Attempt, now: float) -> None:
    """Hand an admitted attempt to an engine model (one lane's or a fleet lane's): one home for the call."""
    a.admitted_at = now
    engine.submit(
        rid,
        a.prompt_tokens,
        max_new_tokens=a.max_new_tokens,
        now=now,
        prefix_key=a.prefix,
        cached_tokens_hint=a.cached_tokens,
        priority=a.priority,
        samples=a.samples,
    )


class VirtualLoop:
    """The virtual clock and event heap of a replay: what the clients schedule their requests on, and
    what the admission controller reads the time from and schedules its hold deadlines on (one lane's
    :class:`Driver`, or a fleet's)."""

    def __init__(self) -> None:
        self.t = 0.0
        self._heap: list[tuple[float, int, Callable[[], None], bool]] = []
        self._seq = 0
        self._pending = 0
        self._rids = Counter[str]()

    def at(self, t: float, fn: Callable[[], None], housekeeping: bool = False) -> None:
        """Schedule ``fn``; housekeeping (pollers, sampling) alone does not keep the replay running."""
        self._seq += 1
        heapq.heappush(self._heap, (max(t, self.t), self._seq, fn, housekeeping))
        self._pending += not housekeeping

    def now(self) -> float:
        return self.t

    def call_at(self, when: float, fn: Callable[[], None]) -> _VirtualTimer:
        timer = _VirtualTimer(fn)
        self.at(when, timer.fire)
        return timer

    def new_rid(self, prefix: str) -> str:
        self._rids[prefix] += 1
        return f"{prefix}-{self._rids[prefix]}"

    def run_due(self) -> None:
        """Everything scheduled up to now, in order."""
        while self._heap and self._heap[0][0] <= self.t:
            _, _, fn, housekeeping = heapq.heappop(self._heap)
            self._pending -= not housekeeping
            fn()

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else math.inf


def make_clients(driver: Any, workload: list[Any]) -> list[Client]:
    """The scenario's workload as clients of ``driver`` (anything with ``at``, ``send``, ``new_rid``,
    ``rng``, ``scenario`` and ``t``)."""
    clients: list[Client] = []
    for w in workload:
        if isinstance(w, Requests):
            clients.append(FixedRequests(driver, w))
        elif isinstance(w, Burst):
            clients.append(BurstClient(driver, w))
        elif isinstance(w, Rounds):
            clients.append(RoundsClient(driver, w))
        elif isinstance(w, Agents):
            clients.extend(AgentClient(driver, w, i) for i in range(w.count))
    return clients


def start_clients(driver: Any, clients: list[Client]) -> None:
    """Start them; an agent group that joins another's turn starts when that turn is done."""
    groups: dict[str, list[AgentClient]] = {}
    for c in clients:
        if isinstance(c, AgentClient):
            groups.setdefault(c.spec.name, []).append(c)
    for c in clients:
        if isinstance(c, AgentClient) and c.spec.join is not None:
            leader = groups[c.spec.join.after][0]
            leader.listeners.append((c.spec.join.turn, lambda c=c: c.start(driver.t)))
        else:
            c.start()


class Driver(VirtualLoop):
    def __init__(
        self, scenario: Scenario, profile: LaneProfile, policy: LoadedPolicy | None, seed: int
    ) -> None:
        super().__init__()
        self.scenario = scenario
        self.profile = profile
        self.policy = policy
        self.rng = random.Random(seed)
        self.engine = EngineModel(profile, seed=seed)
        self.attempts: dict[str, Attempt] = {}
        self.records: dict[str, RequestRecord] = {}
        self.recorder = Recorder(self)
        self.admission = Admission(policy, self, observer=self.recorder) if policy is not None else None
        self.engine_health = SourceHealth()
        self.pollers = sidecar_pollers(self, self.admission, self._read_gpu, self._read_engine)
        self.series: dict[str, list[Any]] = {
            k: []
            for k in (
                "t",
                "free_bytes",
                "headroom_bytes",
                "ledger_projected_bytes",
                "full_usage",
                "mamba_usage",
                "engine_queue",
                "running",
                "held",
                "other_process_bytes",
            )
        }
        self.crashes: list[dict[str, Any]] = []
        self.retractions = 0
        self.clients: list[Client] = []

    # -- the client side ----------------------------------------------------------------------------

    def send(self, client: Client, a: Attempt) -> None:
        a.arrival = self.t
        self.attempts[a.rid] = a
        self.records[a.rid] = RequestRecord(a.rid, self.t, a.prompt_tokens)
        if self.admission is None:
            self._to_engine(a)
            return
        h = self.admission.open()
        if h.submit(self._demand(a), lambda h, a=a: self._gate_answered(a, h)) is Action.HOLD:
            self.records[a.rid].outcome = "held"
        else:
            self._gate_answered(a, h)

    def _demand(self, a: Attempt) -> Demand:
        """The attempt's demand as if it arrived now."""
        assert self.admission is not None
        return attempt_demand(a, self.admission.rules, self.t, self.profile, a.rid)

    def _probe(self, rec: RequestRecord, a: Attempt) -> None:
        assert self.admission is not None
        rec.retry_probe = self.admission.evaluate(self._demand(a)).action.value

    def _gate_answered(self, a: Attempt, h: Handle) -> None:
        rec = self.records[a.rid]
        rec.held_s = round(self.t - a.arrival, 4)
        if not h.admitted:
            assert h.decision is not None and h.decision.reason is not None
            rec.outcome = f"rejected:{h.decision.reason.value}"
            rec.retry_after_s = h.decision.retry_after_s
            rec.end = self.t
            retry = h.decision.retry_after_s
            if retry is None:
                a.client.on_done(a, False, None, give_up=True)
                return
            # Probe first (same instant, earlier in the heap than the client's own retry): is the
            # advertised time one at which this request would have been let in?
            self.at(self.t + retry, lambda: self._probe(rec, a), housekeeping=True)
            a.client.on_done(a, False, float(retry))
            return
        a.handle = h
        h.on_overrun(lambda h, a=a: self._overrun(a, h))
        self._to_engine(a)

    def _overrun(self, a: Attempt, h: Handle) -> None:
        """The in-flight guard aborted an admitted attempt before its first token: the engine drops
        it (as SGLang's /abort_request does) and the client gets the 503 (the same path as a rejection)."""
        self.engine.abort(a.rid, self.t)
        self._gate_answered(a, h)

    def _to_engine(self, a: Attempt) -> None:
        submit_attempt(self.engine, a.rid, a, self.t)

    # -- the engine side ----------------------------------------------------------------------------

    def _engine_events(self) -> None:
        for ev in self.engine.advance(self.t):
            if isinstance(ev, FirstToken):
                a = self.attempts[ev.rid]
                a.first_token_at = ev.t
                self.records[ev.rid].ttft_s = round(ev.t - a.arrival, 4)
                self.records[ev.rid].cached_tokens = ev.cached_tokens
                if a.handle is not None:
                    a.handle.prefill_done()
            elif isinstance(ev, Finished):
                self._end(ev.rid, ok=True, completion=ev.completion_tokens)
            elif isinstance(ev, Failed):
                self._end(ev.rid, ok=False)
            elif isinstance(ev, Crashed):
                self.crashes.append(
                    {
                        "t": round(ev.t, 3),
                        "reason": ev.reason,
                        "requested_bytes": ev.requested_bytes,
                        "free_bytes": ev.free_bytes,
                        "failed_requests": len(ev.failed_rids),
                    }
                )
            elif isinstance(ev, Retracted):
                self.retractions += 1
            elif isinstance(ev, Restarted | Tokens):
                pass

    def _end(self, rid: str, ok: bool, completion: int = 0) -> None:
        a = self.attempts[rid]
        rec = self.records[rid]
        rec.outcome = "completed" if ok else "failed"
        rec.completion_tokens = completion
        rec.end = self.t
        if a.handle is not None:
            a.handle.end(Outcome.COMPLETED if ok else Outcome.UPSTREAM_ERROR)
        a.client.on_done(a, ok, None)

    # -- the sidecar's pollers ----------------------------------------------------------------------

    def _read_engine(self) -> None:
        assert self.admission is not None
        snap = self.admission.snapshot
        if self.engine.up:
            if self.engine_health.consecutive_failures:
                # Answered again after failed reads: a new engine process, as the live scraper sees it.
                self.admission.engine_restarted("it answered again after a failed scrape")
                snap = self.admission.snapshot  # as the live scraper's callback reads it: after
            self.engine_health = SourceHealth(self.t, None, 0)
            snap = replace(snap, engine=engine_signals(self.engine, self.t), engine_health=self.engine_health)
        else:
            h = self.engine_health
            self.engine_health = SourceHealth(h.last_ok_at, "connection refused", h.consecutive_failures + 1)
            snap = replace(snap, engine_health=self.engine_health)
        self.admission.update_snapshot(snap)

    def _read_gpu(self) -> None:
        assert self.admission is not None
        snap = self.admission.snapshot
        self.admission.update_snapshot(
            replace(snap, gpu=gpu_signals(self.engine, self.t), gpu_health=SourceHealth(self.t))
        )

    def _sample(self) -> None:
        live = self.engine.live_gauges() if self.engine.up else None
        s = self.series
        s["t"].append(round(self.t, 3))
        s["free_bytes"].append(self.engine.free_bytes(self.t))
        if self.admission is not None:
            a = self.admission
            s["headroom_bytes"].append(headroom_bytes(a.rules, a.snapshot, a.ledger.totals))
            s["ledger_projected_bytes"].append(a.ledger.totals.projected_bytes)
            s["held"].append(a.held)
        else:
            s["headroom_bytes"].append(None)
            s["ledger_projected_bytes"].append(0)
            s["held"].append(0)
        s["full_usage"].append(round(live.full_token_usage, 4) if live else None)
        s["mamba_usage"].append(round(live.mamba_usage, 4) if live and self.profile.mamba_slots else None)
        s["engine_queue"].append(live.num_queue_reqs if live else 0)
        s["running"].append(live.num_running_reqs if live else 0)
        s["other_process_bytes"].append(self.engine.other_process_bytes)
        self.at(self.t + SAMPLE_S, self._sample, True)

    # -- the loop -----------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.clients = make_clients(self, self.scenario.workload)
        if self.admission is not None:
            # The sidecar reads its signals before the first client arrives, as a started sidecar has.
            for p in self.pollers:
                p.start(0.0)
        start_clients(self, self.clients)
        self.at(0.0, self._sample, True)
        for ev in self.scenario.gpu_events:
            self.at(
                ev.t,
                lambda ev=ev: self.engine.set_other_process_bytes(
                    int(ev.other_process_bytes), self.t, ev.gpu
                ),
            )
        end = self.scenario.duration_s
        while True:
            t_driver = self.next_time()
            # The engine runs on by itself through steps that give the driver nothing to handle.
            t_engine = self.engine.run_quiet(min(t_driver, end))
            t = min(t_driver, t_engine if t_engine is not None else math.inf)
            if t > end or t == math.inf:
                break
            self.t = t
            self._engine_events()
            self.run_due()
            if not self._work_left():
                break
        self.t = min(max(self.t, self.engine.now), end)
        self._engine_events()  # requests sent to a dead engine fail at once: collect those answers
        return self.summary()

    def _work_left(self) -> bool:
        """Anything in flight, held, or still to be sent? (The engine restarting counts: clients wait.)"""
        held = self.admission is not None and self.admission.held
        return bool(self._pending or self.engine.in_flight or held)

    # -- the report ---------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        out = outcome_summary(
            list(self.records.values()), self.crashes, self.profile.restart_s, self.scenario.duration_s
        )
        out = {
            "scenario": self.scenario.name,
            "profile": self.profile.name,
            "gate": self.policy is not None,
            "policy": self.policy.policy.name if self.policy else None,
            "seed": self.engine.seed,
            "end_s": round(self.t, 3),
            "retractions": self.retractions,
            "peak_used_bytes": self.engine.peak_used_bytes,
            **out,
        }
        if self.admission is not None:
            out["decisions"] = {f"{a}/{r}": n for (a, r), n in sorted(self.recorder.counts.items())}
            out["ledger_at_end"] = self.admission.ledger.totals.requests
            # The under-prediction monitor, as /admission/state shows it (sidecar/admission/lane_watch.py).
            out["monitor"] = self.admission.watch.state(self.t)
            out["guard"] = self.admission.guard_state()
        out["requests_detail"] = [r.__dict__ for r in self.records.values()]
        out["series"] = self.series
        out["decision_events"] = self.recorder.decisions
        return out


def outcome_summary(
    recs: list[RequestRecord], crashes: list[dict[str, Any]], restart_s: float, duration_s: float
) -> dict[str, Any]:
    """What the table shows, from per-request records; shared by ``replay`` and the live ``demo``."""
    completed = [r for r in recs if r.outcome == "completed"]
    ttfts = sorted(r.ttft_s for r in completed if r.ttft_s is not None)
    # Goodput: tokens of completed requests over the time until the last request ended, whatever its
    # outcome (a crash that fails everything still takes the clients' time).
    span = max((r.end for r in recs if r.end is not None), default=0.0) or 1.0
    served = sum(r.prompt_tokens + r.completion_tokens for r in completed)
    outcomes = Counter(r.outcome.split(":")[0] for r in recs)
    rejected = Counter(r.outcome.split(":", 1)[1] for r in recs if r.outcome.startswith("rejected:"))
    downtime = sum(min(c["t"] + restart_s, duration_s) - c["t"] for c in crashes)
    return {
        "crashes": crashes,
        "downtime_s": round(downtime, 3),
        "restart_s": restart_s,
        "requests": len(recs),
        "completed": outcomes["completed"],
        "failed": outcomes["failed"],
        "rejected": outcomes["rejected"],
        "rejected_by_reason": dict(sorted(rejected.items())),
        "held_then_admitted": sum(1 for r in recs if r.held_s > 0 and not r.outcome.startswith("rejected")),
        # Rejections that advertised a Retry-After, and how many a retry at that time would have got
        # in: at once, or into the queue (replay measures it; the live demo cannot).
        "retry_after_advertised": sum(1 for r in recs if r.retry_probe is not None),
        "retry_after_admitted": sum(1 for r in recs if r.retry_probe == "admit"),
        "retry_after_let_in": sum(1 for r in recs if r.retry_probe in ("admit", "hold")),
        "in_flight_at_end": outcomes["in_flight"] + outcomes["held"],
        "served_tokens": served,
        "span_s": round(span, 3),
        "goodput_tokens_per_s": round(served / span, 1),
        "ttft_p50_s": _pct(ttfts, 50),
        "ttft_p99_s": _pct(ttfts, 99),
    }


def _pct(sorted_values: list[float], p: float) -> float | None:
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, math.ceil(p / 100 * len(sorted_values)) - 1))
    return round(sorted_values[k], 3)


def run_replay(
    scenario: Scenario, *, gate: bool, policy: LoadedPolicy | None, profile: LaneProfile, seed: int
) -> dict[str, Any]:
    return Driver(scenario, profile, policy if gate else None, seed).run()


# -- command line ---------------------------------------------------------------------------------

SUMMARY_ROWS = [
    ("crashes", lambda r: str(len(r["crashes"]))),
    ("downtime", lambda r: f"{r['downtime_s']:.0f} s"),
    ("requests sent", lambda r: str(r["requests"])),
    ("completed", lambda r: str(r["completed"])),
    ("failed (engine)", lambda r: str(r["failed"])),
    ("rejected (413, 429, 503)", lambda r: str(r["rejected"])),
    ("  by reason", lambda r: ", ".join(f"{k} {v}" for k, v in r["rejected_by_reason"].items()) or "-"),
    ("held, then admitted", lambda r: str(r["held_then_admitted"])),
    ("retry at Retry-After let in", lambda r: _retry_fraction(r, "retry_after_let_in")),
    ("  admitted at once", lambda r: _retry_fraction(r, "retry_after_admitted")),
    ("in flight at end", lambda r: str(r["in_flight_at_end"])),
    ("goodput (tok/s)", lambda r: f"{r['goodput_tokens_per_s']:,.0f}"),
    ("TTFT p50 (completed)", lambda r: "-" if r["ttft_p50_s"] is None else f"{r['ttft_p50_s']:.1f} s"),
    ("TTFT p99 (completed)", lambda r: "-" if r["ttft_p99_s"] is None else f"{r['ttft_p99_s']:.1f} s"),
]


def _retry_fraction(r: dict[str, Any], key: str) -> str:
    n = r.get("retry_after_advertised", 0)
    return "-" if not n else f"{r[key]}/{n} ({100 * r[key] / n:.0f} %)"


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """Side by side; goodput over the longest run's span, so runs that ended early are not flattered."""
    span = max(r["span_s"] for r in results.values())
    results = {k: r | {"goodput_tokens_per_s": r["served_tokens"] / span} for k, r in results.items()}
    cols = list(results)
    width = max(len(label) for label, _ in SUMMARY_ROWS) + 2
    colw = max(22, *(len(c) + 2 for c in cols))
    lines = [" " * width + "".join(c.rjust(colw) for c in cols)]
    for label, fmt in SUMMARY_ROWS:
        lines.append(label.ljust(width) + "".join(fmt(results[c]).rjust(colw) for c in cols))
    return "\n".join(lines)


def plot_path_problem(out: str) -> str | None:
    """Why a picture cannot be written to ``out`` (checked before an hour of replay), or None."""
    import importlib.util
    import os

    if importlib.util.find_spec("matplotlib") is None:
        return "plots need matplotlib, which `pip install sglang-sidecar` leaves out: pip install 'sglang-sidecar[emulator]'"
    p = Path(out)
    if p.is_dir():
        return "is a directory; give a file name such as night.png"
    if p.suffix.lower() not in (".png", ".svg", ".pdf"):
        return "the picture's name must end in .png, .svg or .pdf"
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        return f"directory {parent} does not exist"
    if not os.access(parent, os.W_OK):
        return f"directory {parent} is not writable"
    return None


def load_inputs(args: argparse.Namespace) -> tuple[Scenario, LoadedPolicy, LaneProfile]:
    """The scenario (or trace), policy and profile the command line names. Raises ScenarioError,
    PolicyError, KeyError (no such profile) or ValueError (a trace without --policy and --profile)."""
    path = Path(args.scenario)
    if path.suffix in (".jsonl", ".log", ".ndjson"):
        if not args.policy or not args.profile:
            raise ValueError("a trace needs --policy and --profile")
        scenario = load_trace(path, profile=args.profile, policy=args.policy, seed=args.seed or 0)
    else:
        scenario = load_scenario(path)
    policy = load_policy_file(Path(args.policy) if args.policy else scenario.policy_path(path.parent))
    return scenario, policy, get_profile(args.profile or scenario.profile)


def input_problem(e: Exception) -> str:
    """What ``replay`` prints for a problem ``load_inputs`` raised."""
    if isinstance(e, ConfigError):  # a scenario's, policy's or fleet file's located problems
        return str(e)
    return f"replay: {e.args[0]}"


def main(args: argparse.Namespace) -> int:
    try:
        scenario, policy, profile = load_inputs(args)
    except (ScenarioError, PolicyError, KeyError, ValueError) as e:
        print(input_problem(e), file=sys.stderr)
        return 2
    if args.plot and (problem := plot_path_problem(args.plot)):
        print(f"replay: --plot {args.plot}: {problem}", file=sys.stderr)
        return 2
    seed = scenario.seed if args.seed is None else args.seed
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.gate]
    results: dict[str, dict[str, Any]] = {}
    for gated in modes:
        label = f"gated ({policy.policy.name})" if gated else "ungated"
        results[label] = run_replay(scenario, gate=gated, policy=policy, profile=profile, seed=seed)
    print(f"replay {scenario.name}: profile {profile.name}, seed {seed}, {scenario.duration_s:g} s virtual")
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True, default=str) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        from sidecar_emulator.plot import plot_replay

        try:
            plot_replay(
                results,
                args.plot,
                title=f"{scenario.name} ({profile.name}, seed {seed})",
                policy=policy.policy,
                start_unix=scenario.start_unix,
            )
        except OSError as e:
            print(f"replay: --plot {args.plot}: cannot write the picture: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}")
    return 0
