"""``replay --lanes``: a fleet in virtual time. Several lanes, each an engine model with (or without) its
sidecar's gate, behind a model of SGLang's router; so an SRE can ask "how many lanes, and which routing
rule, for last night's traffic?" and see what the router's own machinery does with the answers.

Each lane is what ``replay`` runs for one: the engine model, and the same
:class:`~sidecar.admission.controller.Admission` (the same pure decision) polling that model's published gauges
and free memory at the policy's intervals. In front, the router as measured (sglang-router 0.3.2 on
loopback, evidence S19; the model gateway's ``least_load``, evidence S21):

- **retries** an answer of 408, 429, 500, 502, 503 or 504 (or a dropped connection) on a worker chosen
  again by the rule, up to ``--retry-max-retries`` (5) more times, backoff 50 ms x1.5 (jitter 0.2, at
  most 30 s), ignoring ``Retry-After``; the last answer goes to the client;
- counts **every** non-2xx answer as a failure of that worker's **circuit breaker**: 10 consecutive
  failures open it for 60 s, then half-open (one failure reopens it, 3 successes close it); with every
  breaker open (or every worker unhealthy) it answers 503 ``no_available_workers`` itself;
- **health-checks** each worker (``/health`` every 60 s, 3 failures out, 2 successes back; the sidecar's
  ``/readyz`` with the recommended flags). Both endpoints fail while the lane's engine is down.

A success for the breaker is the first token (the streamed answer's start); a failure after it reaches
the client as a broken stream and is not retried. The clients are ``replay``'s: they wait
``Retry-After`` when told one and give up on ``x-should-retry: false``.

Routing rules:

- ``round_robin``: the next available lane in turn.
- ``least_load``: the model gateway's score, ``(waiting uncached tokens + tokens sent since the last
  poll) / 2000 tok/s + 0.15 s x k/(1-k)`` on KV usage k, from each lane's ``/v1/loads`` polled every
  second. Behind a sidecar that document has the sidecar's held and in-flight work added
  (``routing.merge_engine_loads``, the same arithmetic as here).
- ``fit``: the routing signals (``routing.capacity_prompt_tokens``, ``fit_prompt_tokens``,
  ``headroom_bytes``), read at each request as an endpoint picker polling every few ms would. Only
  lanes that could ever run the request's uncached tokens are candidates (none: the router answers
  413 for the fleet and no lane's breaker hears of it); among them, those where it fits now first,
  then the lane this prefix was last served on (its cache), then the most headroom. Needs sidecars.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sidecar.admission.controller import Admission, Handle, Outcome
from sidecar.core.decide import headroom_bytes
from sidecar.core.decision import Action
from sidecar.core.snapshot import SourceHealth
from sidecar.http.answers import answer_for
from sidecar.ops.router_view import capacity_prompt_tokens, fit_prompt_tokens, inflight_extra
from sidecar.policy.schema import LoadedPolicy, Policy, load_policy_file
from sidecar.policy.yamlfile import ConfigError, load_model, read_text
from sidecar_emulator.engine import EngineModel
from sidecar_emulator.events import Crashed, Failed, Finished, FirstToken
from sidecar_emulator.fleet import RECOMMENDED_ROUTER_FLAGS, ROUTER_ANSWERS
from sidecar_emulator.profiles import LaneProfile, get_profile
from sidecar_emulator.readings import engine_signals, gpu_signals
from sidecar_emulator.replay import (
    Attempt,
    Client,
    RequestRecord,
    VirtualLoop,
    attempt_demand,
    input_problem,
    load_inputs,
    make_clients,
    outcome_summary,
    sidecar_pollers,
    start_clients,
    submit_attempt,
)
from sidecar_emulator.scenario import (
    Scenario,
)

RETRYABLE = frozenset({408, 429, 500, 502, 503, 504})
RULES = ("round_robin", "least_load", "fit")
LOADS_POLL_S = 1.0  # the model gateway's /v1/loads fallback interval (evidence S21)
LEAST_LOAD_THROUGHPUT = 2000.0  # its default tokens/s when a worker reports none
LEAST_LOAD_KV_WEIGHT = 0.15  # its KV-pressure weight, seconds


# -- the router as measured ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterFlags:
    """The router's flags this model follows; defaults are sglang-router 0.3.2's (evidence S19)."""

    name: str
    retries: int = 5
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 30.0
    backoff_multiplier: float = 1.5
    jitter: float = 0.2
    breaker: bool = True
    cb_failure_threshold: int = 10
    cb_success_threshold: int = 3
    cb_timeout_s: float = 60.0
    health_endpoint: str = "/health"
    health_interval_s: float = 60.0
    health_failure_threshold: int = 3
    health_success_threshold: int = 2

    @classmethod
    def from_args(cls, name: str, args: Sequence[str]) -> RouterFlags:
        """The flags as written on the router's command line (docs/routing.md's recommended list)."""
        names = {
            "--retry-max-retries": ("retries", int),
            "--cb-failure-threshold": ("cb_failure_threshold", int),
            "--cb-success-threshold": ("cb_success_threshold", int),
            "--cb-timeout-duration-secs": ("cb_timeout_s", float),
            "--health-check-endpoint": ("health_endpoint", str),
            "--health-check-interval-secs": ("health_interval_s", float),
            "--health-failure-threshold": ("health_failure_threshold", int),
            "--health-success-threshold": ("health_success_threshold", int),
        }
        flags, i = cls(name), 0
        while i < len(args):
            if args[i] == "--disable-circuit-breaker":
                flags, i = replace(flags, breaker=False), i + 1
                continue
            if args[i] not in names or i + 1 >= len(args):
                raise ValueError(f"router flag {args[i]!r} is not modelled")
            attr, kind = names[args[i]]
            flags, i = replace(flags, **{attr: kind(args[i + 1])}), i + 2
        return flags

    def backoff_s(self, retry: int, rng: random.Random) -> float:
        base = min(self.backoff_max_s, self.backoff_initial_s * self.backoff_multiplier**retry)
        return base * (1 + self.jitter * (2 * rng.random() - 1))


ROUTER_DEFAULTS = RouterFlags("router defaults")
ROUTER_RECOMMENDED = RouterFlags.from_args("recommended flags", RECOMMENDED_ROUTER_FLAGS)


class Breaker:
    """One worker's circuit breaker: consecutive failures open it, a timeout half-opens it."""

    def __init__(self, flags: RouterFlags) -> None:
        self.flags = flags
        self.state = "closed"
        self.failures = 0
        self.successes = 0
        self.opened_at = 0.0
        self.opens = 0

    def can_execute(self, now: float) -> bool:
        if not self.flags.breaker:
            return True
        if self.state == "open" and now - self.opened_at >= self.flags.cb_timeout_s:
            self.state, self.successes = "half_open", 0
        return self.state != "open"

    def record(self, ok: bool, now: float) -> None:
        if not self.flags.breaker:
            return
        if ok:
            self.failures = 0
            if self.state == "half_open":
                self.successes += 1
                if self.successes >= self.flags.cb_success_threshold:
                    self.state = "closed"
            return
        self.failures += 1
        if self.state == "half_open" or (
            self.state == "closed" and self.failures >= self.flags.cb_failure_threshold
        ):
            self.state, self.opened_at, self.failures = "open", now, 0
            self.opens += 1


# -- lanes --------------------------------------------------------------------------------------------


class LaneSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None
    profile: str | None = None  # default: the scenario's
    policy: str | None = None  # a policy file, relative to the fleet file; default: the scenario's
    count: int = Field(default=1, ge=1, le=64)


class FleetFile(BaseModel):
    """``--lanes fleet.yaml``: the lanes behind the router, each with its own profile and policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "fleet"
    lanes: list[LaneSpec] = Field(min_length=1)


class FleetError(ConfigError):
    kind = "fleet"


@dataclass
class LaneSetup:
    name: str
    profile: LaneProfile
    policy: LoadedPolicy


@dataclass(eq=False)
class Try:
    """One forwarding of a client's request by the router: a request takes up to 1 + retries."""

    attempt: Attempt
    lane: Lane
    n: int
    rid: str
    handle: Handle | None = None
    started: bool = False  # first token sent: the router can no longer retry it


class Lane:
    def __init__(self, driver: FleetDriver, setup: LaneSetup, gated: bool, seed: int) -> None:
        self.driver = driver
        self.name = setup.name
        self.profile = setup.profile
        self.policy = setup.policy
        self.engine = EngineModel(setup.profile, seed=seed)
        self.admission = Admission(setup.policy, driver) if gated else None
        self.engine_health = SourceHealth()
        # The sidecar's pollers, timed as ``replay``'s (and the live ones): sooner after an end.
        self.pollers = sidecar_pollers(driver, self.admission, self.read_gpu, self.read_engine)
        self.breaker = Breaker(driver.flags)
        self.healthy = True
        self.health_fails = 0
        self.health_oks = 0
        self.health_ejections = 0
        self.in_flight = 0  # the router's own count of requests it has on this lane
        self.loads: tuple[int, float] | None = None  # /v1/loads as last polled: waiting tokens, usage
        self.sent_since_poll = 0
        self.crashes: list[dict[str, Any]] = []
        self.completed = 0

    def available(self, now: float) -> bool:
        return self.healthy and self.breaker.can_execute(now)

    # -- what the router polls --------------------------------------------------------------------

    def poll_loads(self) -> None:
        """The lane's /v1/loads as the gateway reads it: the engine's published view, plus the
        sidecar's held and in-flight work when there is one (what it serves on the data port)."""
        t = self.driver.t
        if not self.engine.up:
            self.loads = None
        else:
            e = engine_signals(self.engine, t)
            waiting, pending = e.queue_requests or 0, e.pending_prefill_tokens or 0
            if self.admission is not None:
                pending += inflight_extra(self.admission, waiting, pending)[1]
            self.loads = (pending, e.full_token_usage or 0.0)
        self.sent_since_poll = 0
        self.driver.at(t + LOADS_POLL_S, self.poll_loads, True)

    def least_load_score(self) -> float:
        if self.loads is None:  # no fresh report: the router's in-flight at a mean prefill
            return self.in_flight * 1024 / LEAST_LOAD_THROUGHPUT
        waiting, k = self.loads
        k = min(max(k, 0.0), 0.999)
        return (waiting + self.sent_since_poll) / LEAST_LOAD_THROUGHPUT + LEAST_LOAD_KV_WEIGHT * k / (1 - k)

    def health_check(self) -> None:
        """/health (the engine's) and the sidecar's /readyz both fail while the engine is down."""
        f = self.driver.flags
        if self.engine.up:
            self.health_fails, self.health_oks = 0, self.health_oks + 1
            if not self.healthy and self.health_oks >= f.health_success_threshold:
                self.healthy = True
        else:
            self.health_oks, self.health_fails = 0, self.health_fails + 1
            if self.healthy and self.health_fails >= f.health_failure_threshold:
                self.healthy = False
                self.health_ejections += 1
        self.driver.at(self.driver.t + f.health_interval_s, self.health_check, True)

    # -- the sidecar's pollers (as ``replay``'s) ----------------------------------------------------

    def read_engine(self) -> None:
        assert self.admission is not None
        t, snap = self.driver.t, self.admission.snapshot
        if self.engine.up:
            self.engine_health = SourceHealth(t, None, 0)
            snap = replace(snap, engine=engine_signals(self.engine, t), engine_health=self.engine_health)
        else:
            h = self.engine_health
            self.engine_health = SourceHealth(h.last_ok_at, "connection refused", h.consecutive_failures + 1)
            snap = replace(snap, engine_health=self.engine_health)
        self.admission.update_snapshot(snap)

    def read_gpu(self) -> None:
        assert self.admission is not None
        t, snap = self.driver.t, self.admission.snapshot
        self.admission.update_snapshot(
            replace(snap, gpu=gpu_signals(self.engine, t), gpu_health=SourceHealth(t))
        )


# -- routing rules --------------------------------------------------------------------------------------


class Rule:
    name = ""

    def pick(self, driver: FleetDriver, a: Attempt, lanes: list[Lane]) -> Lane | None:
        raise NotImplementedError


class RoundRobin(Rule):
    name = "round_robin"

    def __init__(self) -> None:
        self.turn = 0

    def pick(self, driver: FleetDriver, a: Attempt, lanes: list[Lane]) -> Lane:
        lane = lanes[self.turn % len(lanes)]
        self.turn += 1
        return lane


class LeastLoad(Rule):
    name = "least_load"

    def pick(self, driver: FleetDriver, a: Attempt, lanes: list[Lane]) -> Lane:
        return min(lanes, key=lambda lane: (lane.least_load_score(), lane.in_flight))


class FitAware(Rule):
    name = "fit"

    def __init__(self) -> None:
        self.affinity: dict[str, tuple[str, int]] = {}  # prefix -> (lane, tokens it has cached there)

    def pick(self, driver: FleetDriver, a: Attempt, lanes: list[Lane]) -> Lane | None:
        """None: no lane could ever run it; the router answers for the fleet (413), touching none."""
        home, cached = self.affinity.get(a.prefix or "", (None, 0))
        scored = []
        for lane in lanes:
            adm = lane.admission
            if adm is None:
                raise ValueError("the fit rule reads the sidecars' signals: run it with --gate on")
            need = a.prompt_tokens - (min(cached, a.prompt_tokens - 1) if lane.name == home else 0)
            if capacity_prompt_tokens(adm) < need:
                continue
            fits = fit_prompt_tokens(adm) >= need
            room = headroom_bytes(adm.rules, adm.snapshot, adm.ledger.totals)
            scored.append((fits, lane.name == home, room, -lane.in_flight, lane))
        if not scored:
            return None
        # Where it fits now: its cache's lane, else the most headroom. Nowhere now: where its cache
        # is, else the most headroom among the lanes that can run it; that lane's sidecar holds it.
        return max(scored, key=lambda s: s[:4])[-1]

    def served(self, a: Attempt, lane: Lane, tokens: int) -> None:
        if a.prefix:
            self.affinity[a.prefix] = (lane.name, tokens)


def make_rule(name: str) -> Rule:
    return {"round_robin": RoundRobin, "least_load": LeastLoad, "fit": FitAware}[name]()


# -- the driver ---------------------------------------------------------------------------------------


class FleetDriver(VirtualLoop):
    """``replay``'s clients, talking to the router model in front of the lanes, in virtual time."""

    def __init__(
        self,
        scenario: Scenario,
        lanes: list[LaneSetup],
        *,
        gated: bool,
        rule: str,
        flags: RouterFlags,
        seed: int,
    ) -> None:
        super().__init__()
        self.scenario = scenario
        self.flags = flags
        self.rng = random.Random(seed)
        self.router_rng = random.Random(seed + 1)
        self.gated = gated
        self.lanes = [Lane(self, s, gated, seed + i) for i, s in enumerate(lanes)]
        self.rule = make_rule(rule)
        self.records: dict[str, RequestRecord] = {}
        self.tries: dict[str, Try] = {}
        self.router_retries = 0
        self.router_unavailable = 0
        self.router_refused = 0
        self.clients: list[Client] = []

    # -- client -> router ---------------------------------------------------------------------------

    def send(self, client: Client, a: Attempt) -> None:
        a.arrival = self.t
        self.records[a.rid] = RequestRecord(a.rid, self.t, a.prompt_tokens)
        self._route(a, 0)

    def _route(self, a: Attempt, n: int) -> None:
        lanes = [lane for lane in self.lanes if lane.available(self.t)]
        if not lanes:
            self.router_unavailable += 1
            self._to_client(a, "rejected:no_available_workers", None, give_up=False)
            return
        lane = self.rule.pick(self, a, lanes)
        if lane is None:
            self.router_refused += 1
            self._to_client(a, "rejected:no_lane_can_run", None, give_up=True)
            return
        tr = Try(a, lane, n, f"{a.rid}/{n}")
        self.tries[tr.rid] = tr
        lane.in_flight += 1
        lane.sent_since_poll += a.prompt_tokens
        if lane.admission is None:
            self._to_engine(tr)
            return
        h = tr.handle = lane.admission.open()
        d = attempt_demand(a, lane.admission.rules, self.t, lane.profile, tr.rid)
        if h.submit(d, lambda h, tr=tr: self._gate_answered(tr, h)) is not Action.HOLD:
            self._gate_answered(tr, h)
        else:
            self.records[a.rid].outcome = "held"

    def _gate_answered(self, tr: Try, h: Handle) -> None:
        rec = self.records[tr.attempt.rid]
        rec.held_s = round(self.t - tr.attempt.arrival, 4)
        if h.admitted:
            h.on_overrun(lambda h, tr=tr: self._overrun(tr, h))
            self._to_engine(tr)
            return
        assert h.decision is not None and h.decision.reason is not None and tr.lane.admission is not None
        ans = answer_for(tr.lane.admission.policy.answers, h.decision)
        retry_after = h.decision.retry_after_s if ans.retry_after else None
        self._lane_failed(
            tr,
            ans.status,
            f"rejected:{h.decision.reason.value}",
            retry_after,
            give_up=ans.should_retry is False,
        )

    def _overrun(self, tr: Try, h: Handle) -> None:
        """The lane's in-flight guard aborted the try before its first token: its engine drops it and
        the router gets the lane's 503, as for a rejection."""
        tr.lane.engine.abort(tr.rid, self.t)
        self._gate_answered(tr, h)

    def _to_engine(self, tr: Try) -> None:
        submit_attempt(tr.lane.engine, tr.rid, tr.attempt, self.t)

    def _lane_failed(
        self, tr: Try, status: int, outcome: str, retry_after: float | None, give_up: bool
    ) -> None:
        """A non-2xx answer (or a dropped connection, 502) from a lane, before any byte reached the
        client: a failure for that lane's breaker; the router retries it or hands it on."""
        tr.lane.in_flight -= 1
        tr.lane.breaker.record(False, self.t)
        if status in RETRYABLE and tr.n < self.flags.retries:
            self.router_retries += 1
            self.at(
                self.t + self.flags.backoff_s(tr.n, self.router_rng),
                lambda: self._route(tr.attempt, tr.n + 1),
            )
            return
        self._to_client(tr.attempt, outcome, retry_after, give_up)

    def _to_client(self, a: Attempt, outcome: str, retry_after: float | None, give_up: bool) -> None:
        rec = self.records[a.rid]
        rec.outcome, rec.end, rec.retry_after_s = outcome, self.t, retry_after
        a.client.on_done(a, False, retry_after, give_up=give_up)

    # -- lanes -> router ----------------------------------------------------------------------------

    def _engine_events(self, lane: Lane) -> None:
        for ev in lane.engine.advance(self.t):
            if isinstance(ev, Crashed):
                lane.crashes.append({"lane": lane.name, "t": round(ev.t, 3), "reason": ev.reason})
                continue
            if not isinstance(ev, FirstToken | Finished | Failed):
                continue
            tr = self.tries[ev.rid]
            a, rec = tr.attempt, self.records[tr.attempt.rid]
            if isinstance(ev, FirstToken):
                tr.started = True
                lane.breaker.record(True, self.t)
                rec.ttft_s = round(ev.t - a.arrival, 4)
                rec.cached_tokens = ev.cached_tokens
                if tr.handle is not None:
                    tr.handle.prefill_done()
            elif isinstance(ev, Finished):
                if tr.handle is not None:
                    tr.handle.end(Outcome.COMPLETED)
                lane.in_flight -= 1
                lane.completed += 1
                rec.outcome, rec.end, rec.completion_tokens = "completed", self.t, ev.completion_tokens
                if isinstance(self.rule, FitAware):
                    self.rule.served(a, lane, ev.prompt_tokens + ev.completion_tokens)
                a.client.on_done(a, True, None)
            else:
                if tr.handle is not None:
                    tr.handle.end(Outcome.UPSTREAM_ERROR)
                if tr.started:  # the stream broke after its first bytes: the client sees it
                    lane.in_flight -= 1
                    rec.outcome, rec.end = "failed", self.t
                    a.client.on_done(a, False, None)
                else:
                    self._lane_failed(tr, ev.status or 502, "failed", None, give_up=False)

    # -- the loop -----------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.clients = make_clients(self, self.scenario.workload)
        for lane in self.lanes:
            if lane.admission is not None:
                for p in lane.pollers:
                    p.start(0.0)
            self.at(0.0, lane.poll_loads, True)
            self.at(self.flags.health_interval_s, lane.health_check, True)
        start_clients(self, self.clients)
        end = self.scenario.duration_s
        while True:
            t_driver = self.next_time()
            t_engines = [x for x in (lane.engine.next_event_time() for lane in self.lanes) if x is not None]
            t = min([t_driver, *t_engines])
            if t > end or t == math.inf:
                break
            self.t = t
            for lane in self.lanes:
                self._engine_events(lane)
            self.run_due()
            if not self._work_left():
                break
        self.t = min(self.t, end)
        for lane in self.lanes:
            self._engine_events(lane)
        return self.summary()

    def _work_left(self) -> bool:
        return bool(
            self._pending
            or any(
                lane.engine.in_flight or (lane.admission is not None and lane.admission.held)
                for lane in self.lanes
            )
        )

    def summary(self) -> dict[str, Any]:
        recs = list(self.records.values())
        out = outcome_summary(recs, [], 0.0, self.scenario.duration_s)
        crashes = [c for lane in self.lanes for c in lane.crashes]
        completed = sum(1 for r in recs if r.outcome == "completed")
        return {
            "lanes": len(self.lanes),
            "gate": self.gated,
            "rule": self.rule.name,
            "router_flags": self.flags.name,
            "end_s": round(self.t, 3),
            "crashes": crashes,
            "client_errors": len(recs) - completed - out["in_flight_at_end"],
            "router_retries": self.router_retries,
            "router_unavailable": self.router_unavailable,
            "router_refused": self.router_refused,
            "breaker_opens": sum(lane.breaker.opens for lane in self.lanes),
            "health_ejections": sum(lane.health_ejections for lane in self.lanes),
            "ledger_at_end": sum(
                lane.admission.ledger.totals.requests for lane in self.lanes if lane.admission
            ),
            "per_lane": {
                lane.name: {
                    "completed": lane.completed,
                    "crashes": len(lane.crashes),
                    "breaker_opens": lane.breaker.opens,
                    "health_ejections": lane.health_ejections,
                }
                for lane in self.lanes
            },
            **{k: v for k, v in out.items() if k not in ("crashes", "downtime_s", "restart_s")},
            "requests_detail": [r.__dict__ for r in recs],
        }


def run_fleet(scenario: Scenario, lanes: list[LaneSetup], **kw: Any) -> dict[str, Any]:
    """One run: ``gated``, ``rule``, ``flags`` and ``seed`` as :class:`FleetDriver` takes them."""
    return FleetDriver(scenario, lanes, **kw).run()


# -- setups -------------------------------------------------------------------------------------------


def with_router_answers(loaded: LoadedPolicy) -> LoadedPolicy:
    """The policy with docs/routing.md's ``answers:`` block for routers (unfit_lane: 413, never retried)."""
    p = loaded.policy
    answers = p.answers.model_dump() | ROUTER_ANSWERS
    return LoadedPolicy(
        Policy.model_validate(p.model_dump() | {"answers": answers}), loaded.sha256, loaded.path
    )


def lanes_from_count(n: int, profile: LaneProfile, policy: LoadedPolicy) -> list[LaneSetup]:
    return [LaneSetup(f"{profile.name}-{i + 1}", profile, policy) for i in range(n)]


def load_fleet(path: Path, default_profile: str, default_policy: LoadedPolicy) -> list[LaneSetup]:
    fleet = load_model(read_text(path, FleetError), FleetFile, str(path), FleetError)
    out: list[LaneSetup] = []
    for i, spec in enumerate(fleet.lanes):
        try:
            profile = get_profile(spec.profile or default_profile)
        except KeyError as e:
            raise FleetError(str(path), [f"{path}: lanes[{i}].profile: {e.args[0]}"]) from None
        policy = load_policy_file(path.parent / spec.policy) if spec.policy else default_policy
        for k in range(spec.count):
            base = spec.name or profile.name
            out.append(
                LaneSetup(f"{base}-{k + 1}" if spec.count > 1 or not spec.name else base, profile, policy)
            )
    return out


@dataclass
class Setup:
    label: str
    gated: bool
    answers: str  # "policy" | "router"
    flags: RouterFlags
    rules: list[str] = field(default_factory=list)


def setups(gate: str, answers: str, router_flags: str, rules: list[str]) -> list[Setup]:
    flag_sets = {"defaults": [ROUTER_DEFAULTS], "recommended": [ROUTER_RECOMMENDED]}.get(
        router_flags, [ROUTER_DEFAULTS, ROUTER_RECOMMENDED]
    )
    out: list[Setup] = []
    if gate in ("off", "both"):
        plain = [r for r in rules if r != "fit"]
        out += [Setup(f"router alone, {f.name}", False, "policy", f, plain) for f in flag_sets if plain]
    if gate in ("on", "both"):
        for ans in {"policy": ["policy"], "router": ["router"]}.get(answers, ["policy", "router"]):
            word = "policy's answers" if ans == "policy" else "router answers"
            out += [Setup(f"sidecars ({word}), {f.name}", True, ans, f, rules) for f in flag_sets]
    return out


COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("setup", lambda r: r["setup"]),
    ("rule", lambda r: r["rule"]),
    ("lanes", lambda r: str(r["lanes"])),
    ("goodput tok/s", lambda r: f"{r['goodput_tokens_per_s']:,.0f}"),
    ("makespan s", lambda r: f"{r['span_s']:,.0f}"),
    ("completed", lambda r: f"{r['completed']}/{r['requests']}"),
    ("TTFT p99 s", lambda r: "-" if r["ttft_p99_s"] is None else f"{r['ttft_p99_s']:.1f}"),
    ("crashes", lambda r: str(len(r["crashes"]))),
    ("client errors", lambda r: str(r["client_errors"])),
    ("retries", lambda r: str(r["router_retries"])),
    ("ejections", lambda r: str(r["breaker_opens"] + r["health_ejections"])),
    ("no worker", lambda r: str(r["router_unavailable"])),
)


def format_fleet_table(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    """One line per setup, rule and lane count. Goodput is the run's own (served tokens over the time
    until its last request ended); the makespan says how long the same traffic took."""
    cells = [[c[0] for c in COLUMNS], *([c[1](r) for c in COLUMNS] for r in rows)]
    if markdown:
        lines = ["| " + " | ".join(cells[0]) + " |", "|---|---|" + "---:|" * (len(COLUMNS) - 2)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells[1:]])
    widths = [max(len(row[i]) for row in cells) + 2 for i in range(len(COLUMNS))]
    return "\n".join(
        "".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths, strict=True)))
        for row in cells
    )


def sweep(
    scenario: Scenario,
    fleets: list[list[LaneSetup]],
    plan: list[Setup],
    seed: int,
) -> list[dict[str, Any]]:
    rows = []
    for s in plan:
        for lanes in fleets:
            if s.answers == "router":
                lanes = [replace(lane, policy=with_router_answers(lane.policy)) for lane in lanes]
            for rule in s.rules:
                r = run_fleet(scenario, lanes, gated=s.gated, rule=rule, flags=s.flags, seed=seed)
                rows.append({"setup": s.label} | r)
    return rows


# -- command line -------------------------------------------------------------------------------------


def _lane_counts(spec: str) -> list[int] | None:
    try:
        counts = [int(x) for x in spec.split(",")]
    except ValueError:
        return None
    return counts if counts and all(0 < n <= 64 for n in counts) else None


def main(args: argparse.Namespace) -> int:
    rules = [r.strip() for r in args.router.split(",") if r.strip()]
    bad = [r for r in rules if r not in RULES]
    if bad or not rules:
        print(f"replay: --router {args.router}: rules are {', '.join(RULES)}", file=sys.stderr)
        return 2
    try:
        scenario, policy, profile = load_inputs(args)
        counts = _lane_counts(args.lanes)
        if counts is not None:
            fleets = [lanes_from_count(n, profile, policy) for n in counts]
        elif Path(args.lanes).is_file():
            fleets = [load_fleet(Path(args.lanes), profile.name, policy)]
        else:
            raise ValueError(
                f"--lanes {args.lanes}: give a lane count (2), counts to compare (1,2,4) or a fleet YAML"
                " file that exists"
            )
    except (KeyError, ValueError) as e:  # located file problems are ValueErrors too
        print(input_problem(e), file=sys.stderr)
        return 2
    seed = scenario.seed if args.seed is None else args.seed
    plan = setups(args.gate, args.answers, args.router_flags, rules)
    rows = sweep(scenario, fleets, plan, seed)
    print(
        f"replay {scenario.name}: fleet behind a router model, seed {seed}, {scenario.duration_s:g} s virtual"
    )
    print(format_fleet_table(rows))
    if args.json:
        slim = [{k: v for k, v in r.items() if k != "requests_detail"} for r in rows]
        Path(args.json).write_text(json.dumps(slim, indent=1, sort_keys=True, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0
