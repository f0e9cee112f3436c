"""The rules other systems ship, and an oracle, as gates for ``replay``'s virtual-time driver.

The admission-quality benchmark (``bench/admission.py``) compares the sidecar with what a lane would get
from the admission rules peers ship, each fed the same engine model and the same lagging gauges:

* ``none``: the engine alone;
* ``static-cap``: a concurrency cap with a queue (the SGLang model gateway's ``--max-concurrent-requests``,
  queue 100, 60 s timeout: 429 queue full, 408 timeout);
* ``token-budget``: a budget of prompt tokens in prefill (vLLM ``--max-num-queued-tokens``, SGLang's
  proposed ``--max-inflight-prefill-tokens``): over budget answers 503 at once, no queue;
* ``max-length``: a static prompt-length limit an SRE might set by hand;
* ``gie-saturation``: the inference gateway's utilization detector at its defaults (queue depth 5, KV
  utilisation 0.8, metrics staleness 200 ms, stale = saturated), holding while saturated (flow control,
  60 s TTL), scraping every 50 ms;
* ``smg-overload``: the SGLang model gateway's worker overload protection: shed (503, Retry-After = the
  poll interval) while ``/v1/loads`` token usage >= 0.9;
* ``oracle``: sees the engine model's true state; admits a request only if a copy of the engine survives
  its prefill and the decode step after it, and rejects at once what would crash an idle engine alone
  (cold: a turn whose history the engine caches is judged on the copy, with its cache).
  An upper bound, not a product.

The gates here decide on what they would see; the driver owns the hold queue (FIFO, head-of-line unless
the gate backfills), the clients and the engine. Nothing in the sidecar's own decision code is used.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import dataclass
from typing import Literal

from sidecar_emulator.engine import EngineModel
from sidecar_emulator.events import Crashed, Failed, Finished, Tokens
from sidecar_emulator.profiles import LaneProfile
from sidecar_emulator.replay import Attempt, Client, Driver, RequestRecord
from sidecar_emulator.scenario import Scenario

Action = Literal["admit", "hold", "reject"]


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Action
    reason: str | None = None
    retry_after_s: float | None = None


ADMIT = Verdict("admit")
HOLD = Verdict("hold")


class Gate:
    """A baseline admission rule. ``decide`` sees the attempt and the driver (its own counters)."""

    name = "gate"
    poll_interval_s: float | None = None  # when it scrapes the engine; None: it never does
    max_held = 100
    max_wait_s = 60.0
    backfill = False

    def decide(self, a: Attempt, d: GatedDriver) -> Verdict:
        raise NotImplementedError

    def observe(self, t: float, engine: EngineModel) -> None:
        """A scrape of the engine's published gauges (what ``/metrics`` and ``/v1/loads`` show)."""

    @property
    def setting(self) -> str:
        return "default"


class NoGate(Gate):
    name = "none"

    def decide(self, a: Attempt, d: GatedDriver) -> Verdict:
        return ADMIT


class StaticCap(Gate):
    """At most ``cap`` requests in flight (admitted, response not ended); the rest wait in a queue."""

    name = "static-cap"

    def __init__(self, cap: int, *, queue: int = 100, timeout_s: float = 60.0) -> None:
        self.cap = cap
        self.max_held = queue
        self.max_wait_s = timeout_s

    def decide(self, a: Attempt, d: GatedDriver) -> Verdict:
        return ADMIT if len(d.inflight) < self.cap else HOLD

    @property
    def setting(self) -> str:
        return f"cap={self.cap}"


class TokenBudget(Gate):
    """Prompt tokens of admitted requests still in prefill (no first token) stay within ``budget``.

    A partially prefilled request counts its whole prompt (vLLM says so: deliberately conservative).
    """

    name = "token-budget"

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def decide(self, a: Attempt, d: GatedDriver) -> Verdict:
        if sum(d.prefilling.values()) + a.prompt_tokens <= self.budget:
            return ADMIT
        return Verdict("reject", "pending_prefill_tokens", None)

    @property
    def setting(self) -> str:
        return f"budget={self.budget}"


class MaxLength(Gate):
    name = "max-length"

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def decide(self, a: Attempt, d: GatedDriver) -> Verdict:
        return ADMIT if a.prompt_tokens <= self.limit else Verdict("reject", "unfit_request", None)

    @property
    def setting(self) -> str:
        return f"max_prompt={self.limit}"


class GieSaturation(Gate):
    """Utilization detector: saturated when max(queue / 5, KV usage / 0.8) >= 1 or the scrape is stale."""

    name = "gie-saturation"
    max_held = 1000
    max_wait_s = 60.0  # llm-d flow control TTL

    def __init__(
        self,
        *,
        queue_depth: int = 5,
        kv_util: float = 0.8,
        staleness_s: float = 0.2,
        poll_interval_s: float = 0.05,
    ) -> None:
        self.queue_depth = queue_depth
        self.kv_util = kv_util
        self.staleness_s = staleness_s
        self.poll_interval_s = poll_interval_s
        self._scraped_at: float | None = None
        self._queue = 0
        self._usage = 0.0

    def observe(self, t: float, engine: EngineModel) -> None:
        if not engine.up:
            return  # the scrape failed: the last sample ages and turns stale
        g = engine.published_gauges()
        self._scraped_at = t
        # A fresh engine exports no load gauges yet: the sample reads them as zero.
        self._queue = g.num_queue_reqs if g is not None else 0
        self._usage = g.token_usage if g is not None else 0.0

    def decide(self, a: Attempt, d: GatedDriver) -> Verdict:
        if self._scraped_at is None or d.t - self._scraped_at > self.staleness_s:
            return HOLD  # fail closed
        saturation = max(self._queue / self.queue_depth, self._usage / self.kv_util)
        return HOLD if saturation >= 1.0 else ADMIT

    @property
    def setting(self) -> str:
        return f"defaults (scrape {self.poll_interval_s:g} s)"


class SmgOverload(Gate):
    """Shed while the worker's ``/v1/loads`` token usage (KV only, no Mamba) is >= 0.9."""

    name = "smg-overload"

    def __init__(self, *, threshold: float = 0.9, poll_interval_s: float = 1.0) -> None:
        self.threshold = threshold
        self.poll_interval_s = poll_interval_s
        self._usage = 0.0

    def observe(self, t: float, engine: EngineModel) -> None:
        if engine.up:
            self._usage = engine.loads_snapshot().kv_token_usage

    def decide(self, a: Attempt, d: GatedDriver) -> Verdict:
        if self._usage >= self.threshold:
            return Verdict("reject", "kv_pool", self.poll_interval_s)
        return ADMIT

    @property
    def setting(self) -> str:
        return f"usage>={self.threshold:g} (poll {self.poll_interval_s:g} s)"


class Oracle(Gate):
    """Admits a request only if a copy of the true engine survives its prefill and next decode step."""

    name = "oracle"
    backfill = True
    poll_interval_s = 1.0  # re-decide what it holds every second (the world changes without events)
    max_held = 1_000_000
    max_wait_s = math.inf
    probe = "oracle-probe"

    def __init__(self, profile: LaneProfile, *, horizon_steps: int = 200_000) -> None:
        self.profile = profile
        self.horizon_steps = horizon_steps
        self._alone: dict[tuple[int, int], str] = {}
        self.checks = 0

    def decide(self, a: Attempt, d: GatedDriver) -> Verdict:
        cold_unfit = self.alone(a.prompt_tokens, a.max_new_tokens) == "crashed"
        # A turn whose history the engine still caches prefills only its new tokens: it may fit where
        # the same prompt cold would not, so only a request with nothing cached is refused at once.
        if cold_unfit and (not d.engine.up or not d.engine.cached_prefix_tokens(a.prefix)):
            return Verdict("reject", "unfit_request", None)
        if not d.engine.up:
            return HOLD
        self.checks += 1
        sim = copy.deepcopy(d.engine)
        sim.submit(
            self.probe,
            a.prompt_tokens,
            max_new_tokens=a.max_new_tokens,
            now=d.t,
            prefix_key=a.prefix,
            cached_tokens_hint=a.cached_tokens,
            priority=a.priority,
            samples=a.samples,
        )
        if self._outcome(sim) != "crashed":
            return ADMIT
        if cold_unfit and not d.engine.in_flight:
            return Verdict("reject", "unfit_request", None)  # cached, idle, and it still does not fit
        return HOLD

    def alone(self, prompt_tokens: int, max_new_tokens: int) -> str:
        """What an idle engine does with this request alone: ``served``, ``refused`` (400) or ``crashed``."""
        key = (prompt_tokens, max_new_tokens)
        if key not in self._alone:
            sim = EngineModel(self.profile, seed=0)
            sim.submit(self.probe, prompt_tokens, max_new_tokens=max_new_tokens, now=0.0)
            self._alone[key] = self._outcome(sim)
        return self._alone[key]

    def _outcome(self, sim: EngineModel) -> str:
        for _ in range(self.horizon_steps):
            t = sim.next_event_time()
            if t is None:
                return "served"
            events = sim.advance(t)
            if any(isinstance(ev, Crashed) for ev in events):
                return "crashed"
            for ev in events:
                if isinstance(ev, Tokens | Finished) and ev.rid == self.probe:
                    return "served"  # prefilled, and one decode step (or the end) after it
                if isinstance(ev, Failed) and ev.rid == self.probe:
                    return "refused"  # the engine refuses it itself (400, retraction): no crash
        return "served"


@dataclass
class Neighbour:
    """Another process on the card grows by ``grow_bytes`` for ``hold_s`` at the instant the first
    request that waited (held by a gate, or retried after a 503) is admitted."""

    grow_bytes: int
    hold_s: float = 60.0
    fired_at: float | None = None


class NeighbourHook:
    """Mixin for drivers: fires the :class:`Neighbour` on the first admission of a request that waited."""

    neighbour: Neighbour | None = None

    def _to_engine(self, a: Attempt) -> None:  # type: ignore[override]
        nb = self.neighbour
        d: Driver = self  # type: ignore[assignment]
        if nb is not None and nb.fired_at is None and (d.t > a.arrival or a.tries > 0) and d.engine.up:
            nb.fired_at = d.t
            base = d.engine.other_process_bytes or 0
            d.engine.set_other_process_bytes(base + nb.grow_bytes, d.t)
            d.at(d.t + nb.hold_s, lambda: d.engine.set_other_process_bytes(base, d.t))
        super()._to_engine(a)  # type: ignore[misc]


class SidecarDriver(NeighbourHook, Driver):
    """``replay``'s own driver (the sidecar's Admission), with the neighbour perturbation available."""


@dataclass
class _Held:
    attempt: Attempt
    deadline: float


class GatedDriver(NeighbourHook, Driver):
    """``replay``'s driver with a baseline :class:`Gate` in front of the engine instead of the sidecar."""

    def __init__(self, scenario: Scenario, profile: LaneProfile, gate: Gate, seed: int) -> None:
        Driver.__init__(self, scenario, profile, None, seed)
        self.gate = gate
        self.queue: list[_Held] = []
        self.inflight: dict[str, Attempt] = {}
        self.prefilling: dict[str, int] = {}
        self.counts: Counter[str] = Counter()

    # -- requests in --------------------------------------------------------------------------------
    def send(self, client: Client, a: Attempt) -> None:
        a.arrival = self.t
        self.attempts[a.rid] = a
        self.records[a.rid] = RequestRecord(a.rid, self.t, a.prompt_tokens)
        if self.queue and not self.gate.backfill:
            self._hold(a)  # strict order: wait behind the head
            return
        self._apply(a, self.gate.decide(a, self), queued=False)

    def _apply(self, a: Attempt, v: Verdict, *, queued: bool) -> bool:
        """Act on a verdict; True when the attempt left the queue (or never entered it)."""
        if v.action == "admit":
            self.counts["admit"] += 1
            self._dispatch(a)
            return True
        if v.action == "reject":
            self._reject(a, v.reason or "rejected", v.retry_after_s)
            return True
        if not queued:
            self._hold(a)
        return False

    def _hold(self, a: Attempt) -> None:
        if len(self.queue) >= self.gate.max_held:
            self._reject(a, "queue_full", None)
            return
        self.counts["hold"] += 1
        self.records[a.rid].outcome = "held"
        deadline = self.t + self.gate.max_wait_s
        self.queue.append(_Held(a, deadline))
        if math.isfinite(deadline):
            self.at(deadline, self._expire, True)

    def _dispatch(self, a: Attempt) -> None:
        rec = self.records[a.rid]
        rec.held_s = round(self.t - a.arrival, 4)
        rec.outcome = "in_flight"
        self.inflight[a.rid] = a
        self.prefilling[a.rid] = a.prompt_tokens
        self._to_engine(a)

    def _reject(self, a: Attempt, reason: str, retry_after: float | None) -> None:
        self.counts[f"reject/{reason}"] += 1
        rec = self.records[a.rid]
        rec.held_s = round(self.t - a.arrival, 4)
        rec.outcome = f"rejected:{reason}"
        rec.retry_after_s = retry_after
        rec.end = self.t
        a.client.on_done(a, False, retry_after)

    def _pump(self) -> None:
        i = 0
        while i < len(self.queue):
            h = self.queue[i]
            if self._apply(h.attempt, self.gate.decide(h.attempt, self), queued=True):
                self.queue.pop(i)
                continue
            if not self.gate.backfill:
                break
            i += 1

    def _expire(self) -> None:
        keep: list[_Held] = []
        for h in self.queue:
            if h.deadline <= self.t:
                self._reject(h.attempt, "hold_timeout", None)
            else:
                keep.append(h)
        self.queue = keep
        self._pump()

    # -- the engine side ----------------------------------------------------------------------------
    def _engine_events(self) -> None:
        before = len(self.inflight), len(self.prefilling)
        super()._engine_events()
        for rid in [r for r in self.prefilling if self.attempts[r].first_token_at is not None]:
            del self.prefilling[rid]
        if (len(self.inflight), len(self.prefilling)) != before and self.queue:
            self._pump()

    def _end(self, rid: str, ok: bool, completion: int = 0) -> None:
        self.inflight.pop(rid, None)
        self.prefilling.pop(rid, None)
        super()._end(rid, ok, completion)

    def _poll(self) -> None:
        self.gate.observe(self.t, self.engine)
        if self.queue:
            self._pump()
        assert self.gate.poll_interval_s is not None
        self.at(self.t + self.gate.poll_interval_s, self._poll, True)

    def _work_left(self) -> bool:
        return super()._work_left() or bool(self.queue)

    def run(self) -> dict:
        if self.gate.poll_interval_s is not None:
            self.at(0.0, self._poll, True)
        return super().run()

    def summary(self) -> dict:
        out = super().summary()
        out["gate"] = self.gate.name
        out["decisions"] = dict(sorted(self.counts.items()))
        out["held_at_end"] = len(self.queue)
        return out


__all__ = [
    "Gate",
    "GatedDriver",
    "GieSaturation",
    "MaxLength",
    "Neighbour",
    "NoGate",
    "Oracle",
    "SidecarDriver",
    "SmgOverload",
    "StaticCap",
    "TokenBudget",
    "Verdict",
]
