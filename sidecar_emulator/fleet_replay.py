"""``replay --lanes``: a fleet in virtual time. Several lanes, each an engine model with (or without) its
sidecar's gate, behind a model of SGLang's router; so an SRE can ask "how many lanes, and which routing
rule, for last night's traffic?" and see what the router's own machinery does with the answers.

Each lane is what ``replay`` runs for one: the engine model, and the same
:class:`~sidecar.admission.controller.Admission` (the same pure decision) polling that model's published gauges
and free memory at the policy's intervals. In front, one of SGLang's routers as measured (``RouterFlags``:
``smg`` 1.13.0, the model gateway, evidence F261-F265; ``sglang-router`` 0.3.2, evidence S19, F264):

- **retries** an answer of 408, 429, 500, 502, 503 or 504 (or a dropped connection) on a worker chosen
  again by the rule, ``--retry-max-retries`` (5) attempts in all, the first included; backoff 50 ms
  x1.5 (jitter 0.2, at most 30 s), ignoring ``Retry-After``; the last answer goes to the client. smg
  never retries a body over 1 MiB (``--max-buffered-request-bytes``): it streams it to the worker;
- **circuit breaker**, per worker: 10 consecutive failures open it for 60 s, then half-open (one failure
  reopens it, 3 successes close it). 0.3.2 counts every non-2xx answer as a failure; smg counts the
  retryable codes as failures, 429 (``capacity_status_codes``) as nothing, and any other 4xx as a
  success. With every lane out, smg answers 503 ``no_available_workers`` at once; 0.3.2 first retries
  through its attempts (~0.4 s);
- **health checks** (``/health`` every 60 s, 3 failures out, 2 successes back; the sidecar's ``/readyz``
  with the recommended flags). Both endpoints fail while the lane's engine is down;
- smg only: ``/v1/loads?include=core,disagg,queues,memory`` polled every 10 s; the **overload veto** (a
  lane whose last poll shows 8 waiting requests, the sidecar's held ones included, or KV usage 0.8 leaves
  the rotation while another lane is under both); **stall** (a lane that refused a connection after 2 s
  without contact is out until a poll reaches it) and **wedge** (4 requests in flight and no answer or
  token for 3 s, stretched to their prefill time up to 120 s: out until it answers).

A success for the breaker is the first token (the streamed answer's start); a failure after it reaches
the client as a broken stream and is not retried. The clients are ``replay``'s: they wait
``Retry-After`` when told one and give up on ``x-should-retry: false``.

Routing rules:

- ``round_robin``: the next available lane in turn.
- ``random``: a lane at random (``random``; ``power_of_two`` on equal loads).
- ``hash``: requests with the same prefix on the same lane while it is a candidate (``cache_aware``,
  ``consistent_hashing``, ``prefix_hash`` on a shared prefix).
- ``least_load``: the model gateway's score, ``(waiting uncached tokens + tokens sent since the last
  poll) / 2000 tok/s + 0.15 s x k/(1-k)`` on KV usage k, from each lane's ``/v1/loads`` as last polled
  (every 10 s). Behind a sidecar that document has the sidecar's held and in-flight work added
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
RULES = ("round_robin", "least_load", "fit", "random", "hash")
LOADS_POLL_S = (
    10.0  # smg's --load-monitor-interval: /v1/loads?include=core,disagg,queues,memory (evidence F261)
)
LEAST_LOAD_THROUGHPUT = 2000.0  # its default tokens/s when a worker reports none
LEAST_LOAD_KV_WEIGHT = 0.15  # its KV-pressure weight, seconds
WEDGE_MAX_S = 120.0  # smg: the wedge bound stretches to in-flight prefill time, up to 120 s
WEDGE_DEPTH = 4  # smg: an in-flight pile four deep (with no token) counts as wedged


# -- the router as measured ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterFlags:
    """The router's flags this model follows; defaults are sglang-router 0.3.2's (evidence S19, F262-F264).

    ``attempts`` is ``--retry-max-retries``: attempts in all, the first included (both routers: 5 means
    one try and 4 retries). ``router`` says whose rules classify an answer for the breaker:
    ``sglang-router`` counts every non-2xx as a failure; ``smg`` counts the retryable codes (408, 429,
    5xx) as failures, ``capacity_codes`` (429) as neither, any other answer (a 4xx) as a success.
    The rest are smg's alone (None: not that router's): no retry of a body over ``retry_cut_bytes``;
    ``/v1/loads`` polled every ``loads_poll_s``; the overload veto (a lane at ``overload_waiting``
    waiting requests or ``overload_usage`` KV usage leaves the rotation while another is under both);
    stall (a lane that refused a connection and was not heard from for ``stall_s`` is out until a poll
    reaches it) and wedge (``WEDGE_DEPTH`` requests in flight and no answer for ``wedge_s``: out until
    one comes). ``retry_no_worker``: with every lane out, 0.3.2 keeps retrying through its attempts
    (~0.4 s) before its own 503; smg answers at once.
    """

    name: str
    router: str = "sglang-router"
    attempts: int = 5
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
    capacity_codes: frozenset[int] = frozenset()
    retry_cut_bytes: int | None = None
    loads_poll_s: float = LOADS_POLL_S
    overload_waiting: int | None = None
    overload_usage: float | None = None
    stall_s: float | None = None
    wedge_s: float | None = None
    retry_no_worker: bool = True

    def breaker_outcome(self, status: int) -> bool | None:
        """What the breaker records for an answer: success, failure, or nothing (smg's capacity codes)."""
        if 200 <= status < 300:
            return True
        if self.router != "smg":
            return False
        if status in self.capacity_codes:
            return None
        return status not in RETRYABLE

    @classmethod
    def from_args(cls, name: str, args: Sequence[str], base: RouterFlags | None = None) -> RouterFlags:
        """The flags as written on the router's command line, over ``base`` (0.3.2's defaults)."""
        switches = {
            "--disable-circuit-breaker": {"breaker": False},
            "--disable-retries": {"attempts": 1},
            "--disable-worker-overload-protection": {"overload_waiting": None, "overload_usage": None},
        }
        names = {
            "--retry-max-retries": ("attempts", int),
            "--cb-failure-threshold": ("cb_failure_threshold", int),
            "--cb-success-threshold": ("cb_success_threshold", int),
            "--cb-timeout-duration-secs": ("cb_timeout_s", float),
            "--health-check-endpoint": ("health_endpoint", str),
            "--health-check-interval-secs": ("health_interval_s", float),
            "--health-failure-threshold": ("health_failure_threshold", int),
            "--health-success-threshold": ("health_success_threshold", int),
            "--load-monitor-interval": ("loads_poll_s", float),
            "--worker-overload-waiting-requests": ("overload_waiting", int),
            "--worker-overload-token-usage": ("overload_usage", float),
            "--worker-stall-secs": ("stall_s", float),
            "--worker-wedge-secs": ("wedge_s", float),
            "--max-buffered-request-bytes": ("retry_cut_bytes", int),
        }
        flags, i = replace(base or cls(name), name=name), 0
        while i < len(args):
            if args[i] in switches:
                flags, i = replace(flags, **switches[args[i]]), i + 1  # type: ignore[arg-type]
                continue
            if args[i] not in names or i + 1 >= len(args):
                raise ValueError(f"router flag {args[i]!r} is not modelled")
            attr, kind = names[args[i]]
            flags, i = replace(flags, **{attr: kind(args[i + 1])}), i + 2
        return flags

    def slowed(self, speed: float) -> RouterFlags:
        """The router's clocks as an emulator running ``speed`` times fast sees them (a live fleet at
        ``--speed 20``: the breaker's 60 s is 1,200 of the engine's seconds)."""
        s = speed

        def mul(v: float | None) -> float | None:
            return None if v is None else v * s

        return replace(
            self,
            backoff_initial_s=self.backoff_initial_s * s,
            backoff_max_s=self.backoff_max_s * s,
            cb_timeout_s=self.cb_timeout_s * s,
            health_interval_s=self.health_interval_s * s,
            loads_poll_s=self.loads_poll_s * s,
            stall_s=mul(self.stall_s),
            wedge_s=mul(self.wedge_s),
        )

    def backoff_s(self, retry: int, rng: random.Random) -> float:
        base = min(self.backoff_max_s, self.backoff_initial_s * self.backoff_multiplier**retry)
        return base * (1 + self.jitter * (2 * rng.random() - 1))


ROUTER_DEFAULTS = RouterFlags("sglang-router 0.3.2 defaults")
ROUTER_RECOMMENDED = RouterFlags.from_args("sglang-router 0.3.2, recommended flags", RECOMMENDED_ROUTER_FLAGS)
# smg 1.13.0 at its defaults (its --help and source, measured live: docs/routing.md, evidence F261-F264).
SMG_DEFAULTS = RouterFlags(
    "smg defaults",
    router="smg",
    capacity_codes=frozenset({429}),
    retry_cut_bytes=1 << 20,
    overload_waiting=8,
    overload_usage=0.8,
    stall_s=2.0,
    wedge_s=3.0,
    retry_no_worker=False,
)
SMG_RECOMMENDED = RouterFlags.from_args("smg, recommended flags", RECOMMENDED_ROUTER_FLAGS, SMG_DEFAULTS)


class Breaker:
    """One worker's circuit breaker: consecutive failures open it, a timeout half-opens it."""

    def __init__(self, flags: RouterFlags) -> None:
        self.flags = flags
        self.state = "closed"
        self.failures = 0
        self.successes = 0
        self.opened_at = 0.0
        self.opens = 0
        self.ejections = 0  # closed -> open: what the live runs count from the router's log

    def can_execute(self, now: float) -> bool:
        if not self.flags.breaker:
            return True
        if self.state == "open" and now - self.opened_at >= self.flags.cb_timeout_s:
            self.state, self.successes = "half_open", 0
        return self.state != "open"

    def record(self, ok: bool | None, now: float) -> None:
        if not self.flags.breaker or ok is None:
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
            self.ejections += self.state == "closed"
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
    """One forwarding of a client's request by the router: a request takes up to ``attempts``."""

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
        # /v1/loads as last polled: waiting uncached tokens, KV usage, waiting requests
        self.loads: tuple[int, float, int] | None = None
        self.sent_since_poll = 0
        self.in_flight_tokens = 0
        self.last_progress = 0.0  # the router last heard an answer or a token from this lane
        self.stalled = False  # smg: a refused connection after stall_s of silence; out until polled
        self.crashes: list[dict[str, Any]] = []
        self.completed = 0

    def available(self, now: float) -> bool:
        return self.healthy and not self.stalled and self.breaker.can_execute(now)

    def overloaded(self) -> bool:
        """smg's overload veto, on the last poll (held requests count: the sidecar adds them)."""
        f = self.driver.flags
        if self.loads is None:
            return False
        _, usage, waiting = self.loads
        return (f.overload_waiting is not None and waiting >= f.overload_waiting) or (
            f.overload_usage is not None and usage >= f.overload_usage
        )

    def wedged(self, now: float) -> bool:
        """smg's wedge check: a pile of requests in flight and no answer or token for the bound, which
        stretches to the prefill time of what is in flight (at the default throughput), up to 120 s."""
        f = self.driver.flags
        if f.wedge_s is None or self.in_flight < WEDGE_DEPTH:
            return False
        bound = min(WEDGE_MAX_S, max(f.wedge_s, self.in_flight_tokens / LEAST_LOAD_THROUGHPUT))
        return now - self.last_progress >= bound

    # -- what the router polls --------------------------------------------------------------------

    def poll_loads(self) -> None:
        """The lane's /v1/loads as the gateway reads it: the engine's published view, plus the
        sidecar's held and in-flight work when there is one (what it serves on the data port)."""
        t = self.driver.t
        if not self.engine.up and self.admission is None:
            self.loads = None  # refused: nothing heard
        elif not self.engine.up:
            self.loads, self.stalled = None, False  # the sidecar answered (its 502): contact
        else:
            e = engine_signals(self.engine, t)
            waiting, pending = e.queue_requests or 0, e.pending_prefill_tokens or 0
            if self.admission is not None:
                more_reqs, more_tokens = inflight_extra(self.admission, waiting, pending)
                waiting, pending = waiting + more_reqs, pending + more_tokens
            self.loads, self.stalled = (pending, e.full_token_usage or 0.0, waiting), False
        self.sent_since_poll = 0
        self.driver.at(t + self.driver.flags.loads_poll_s, self.poll_loads, True)

    def least_load_score(self) -> float:
        if self.loads is None:  # no fresh report: the router's in-flight at a mean prefill
            return self.in_flight * 1024 / LEAST_LOAD_THROUGHPUT
        waiting, k, _ = self.loads
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


class Random(Rule):
    name = "random"

    def __init__(self) -> None:
        self.rng = random.Random(0)  # its own: the clients' draws stay what they were

    def pick(self, driver: FleetDriver, a: Attempt, lanes: list[Lane]) -> Lane:
        return self.rng.choice(lanes)


class PrefixHash(Rule):
    """The hashing rules (``consistent_hashing``, ``prefix_hash``, ``cache_aware`` on a shared prefix):
    requests with the same prefix go to the same lane while it is a candidate, the next one on the ring
    otherwise."""

    name = "hash"

    def pick(self, driver: FleetDriver, a: Attempt, lanes: list[Lane]) -> Lane:
        ring = driver.lanes
        start = sum((a.prefix or "").encode()) % len(ring)
        return next(
            ring[(start + k) % len(ring)] for k in range(len(ring)) if ring[(start + k) % len(ring)] in lanes
        )


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
    rules: dict[str, type[Rule]] = {
        "round_robin": RoundRobin,
        "least_load": LeastLoad,
        "fit": FitAware,
        "random": Random,
        "hash": PrefixHash,
    }
    return rules[name]()


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
        body_bytes_per_token: float = 4.0,
    ) -> None:
        super().__init__()
        self.scenario = scenario
        self.flags = flags
        # A request body's size, for smg's retry cut: ~4 bytes a token of text; 3 for compact input_ids.
        self.body_bytes_per_token = body_bytes_per_token
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

    def candidates(self) -> list[Lane]:
        """The lanes the rule may pick: available (healthy, breaker, not stalled); then smg leaves out
        the wedged and the overloaded while any other lane is left."""
        lanes = [lane for lane in self.lanes if lane.available(self.t)]
        for out in (lambda lane: lane.wedged(self.t), Lane.overloaded):
            kept = [lane for lane in lanes if not out(lane)]
            lanes = kept or lanes
        return lanes

    def _route(self, a: Attempt, n: int) -> None:
        lanes = self.candidates()
        if not lanes:
            if self.flags.retry_no_worker and n + 1 < self.flags.attempts:
                self.router_retries += 1  # 0.3.2: "no worker" is retried like a failed attempt
                self.at(self.t + self.flags.backoff_s(n, self.router_rng), lambda: self._route(a, n + 1))
                return
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
        if lane.in_flight == 0:
            lane.last_progress = self.t  # the wedge clock runs only while something is in flight
        lane.in_flight += 1
        lane.in_flight_tokens += a.prompt_tokens
        lane.sent_since_poll += a.prompt_tokens
        if lane.admission is None:
            stall = self.flags.stall_s
            if not lane.engine.up and stall is not None and self.t - lane.last_progress >= stall:
                lane.stalled = True  # refused after a silence: out of smg's rotation until polled
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
        lane, f = tr.lane, self.flags
        lane.in_flight -= 1
        lane.in_flight_tokens -= tr.attempt.prompt_tokens
        lane.last_progress = self.t
        lane.breaker.record(f.breaker_outcome(status), self.t)
        small = (
            f.retry_cut_bytes is None
            or tr.attempt.prompt_tokens * self.body_bytes_per_token <= f.retry_cut_bytes
        )
        if status in RETRYABLE and tr.n + 1 < f.attempts and small:
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
            lane.last_progress = self.t
            if isinstance(ev, FirstToken):
                tr.started = True
                lane.in_flight_tokens -= a.prompt_tokens
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
            # closed -> open, as the live runs count them from the router's log
            "breaker_ejections": sum(lane.breaker.ejections for lane in self.lanes),
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
    """One run: ``gated``, ``rule``, ``flags``, ``seed`` (and ``body_bytes_per_token``) as
    :class:`FleetDriver` takes them."""
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


def setups(
    gate: str, answers: str, router_flags: str, rules: list[str], gateway: str = "both"
) -> list[Setup]:
    by_gateway = {
        "sglang-router": {"defaults": ROUTER_DEFAULTS, "recommended": ROUTER_RECOMMENDED},
        "smg": {"defaults": SMG_DEFAULTS, "recommended": SMG_RECOMMENDED},
    }
    gateways = ["smg", "sglang-router"] if gateway == "both" else [gateway]
    which = ["defaults", "recommended"] if router_flags == "both" else [router_flags]
    flag_sets = [by_gateway[g][w] for g in gateways for w in which]
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
    plan = setups(args.gate, args.answers, args.router_flags, rules, args.gateway)
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
