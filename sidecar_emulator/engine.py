"""A deterministic discrete-event model of one SGLang engine, with its memory failure modes.

Why a model: the sidecar must be demonstrable without a GPU, testable end to end in CI, and tunable
in virtual time. The model reproduces what the gate has to cope with - memory allocated outside the KV
pool during prefill, gauges that lag because SGLang writes them at batch boundaries, three separate
capacity limits (request slots, KV tokens, Mamba state slots) - and it crashes the way the real engine
does.

Clock-free: the caller passes the engine time ``now`` to every call and pulls events with
``advance(now)``; ``next_event_time()`` tells a virtual-time driver how far it may jump. Nothing here
reads a clock, sleeps or does I/O, and the only randomness is the seeded transient noise (a bounded
uniform factor per allocation, ``_noisy``), so the same calls give the same events.

Scheduler (after SGLang 0.5.x, simplified):

* Prefill first: while a chunked request is in progress or a waiting request can be admitted, each
  step is a prefill batch of at most ``chunked_prefill_size`` tokens; running requests decode only when
  no prefill batch can be formed (no ``--enable-mixed-chunk``).
* Admission (PrefillAdder): FCFS (higher ``priority`` first); a request is admitted when a running slot
  is free, its uncached input plus ``min(max_new_tokens, 4096) * new_token_ratio`` fits in free plus
  evictable KV minus what the running requests reserve, and its Mamba slots are free or evictable. A
  request that does not fit blocks the queue. The chunked request's remaining input is not reserved.
* ``sglang:num_running_reqs`` counts the decode batch; the request in chunked prefill is in neither the
  running count nor the queue count, as in SGLang.
* KV pool: requests own their computed tokens; a radix cache keyed by ``prefix_key`` holds shared
  prefixes (locked while a request uses them, evictable LRU otherwise, truncated from the tail when the
  pool needs room). A finished request leaves prompt + output in the cache under its key, so the next
  turn of an agent reuses it; a too-small pool evicts it and the next first token is slower.
* Decode: each step adds one token to every running request; when the pool is exhausted the engine
  retracts requests (fewest output tokens first) back to the queue, and fails a request with 503 on its
  third retraction.
* Mamba: each admitted request holds ``mamba_slots_per_request`` slots; chunked prefill keeps
  checkpoints (see the profile); if a slot is needed and none is free or evictable the engine dies with
  ``Can not alloc mamba cache``. Where the profile says so, in-flight requests' checkpoints are
  *reported* evictable while no allocation can take them, so the published usage jumps to 1.00 only at
  the failed allocation (evidence D13).
* Memory: every prefill step allocates the profile's transients on the device (activation, context,
  gather, plus noise) and the first decode step after the running batch grows allocates the unknown
  extra; an allocation that does not fit kills the engine. A crash fails every request in flight and
  the engine stays down for ``restart_s``, then comes back empty (cold cache, no gauges for 30 s).
* Publication: gauges are written after each prefill batch, every ``decode_log_interval`` decode steps,
  and when idle (immediately if the last report is stale, then every 30 s); a fresh engine has none.
  ``/v1/loads`` is refreshed after each prefill batch, every 15 decode steps, and when idle.

What the model does not reproduce (incident figures, docs/evidence.md): with smoothly growing transients the
outage crash happens on the 560 MiB gather of the chunk ending at 286,720 tokens, with 528 MiB free (the
incident saw 280.94 MiB free, evidence I4; why the model cannot, evidence D11 and the ``_MAXQ_RESERVED``
comment in ``profiles.py``); the old build's lone 500K peak is ~200 MiB below the measured 97,237 MiB
(evidence M2) because the measured gather coefficient (evidence M1: 1,024 MiB at 524,288 tokens) is kept
as given; the sustained cell's pool peaks at 73 % instead of 57 % (evidence M5): two ~240K requests run
together here, and 57 % is less than two of them hold.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field

from sidecar_emulator.device import Device, OutOfMemory, modeled
from sidecar_emulator.events import (
    Crashed,
    CrashInfo,
    Event,
    Failed,
    Finished,
    FirstToken,
    Gauges,
    LoadsSnapshot,
    Restarted,
    Retracted,
    Tokens,
)
from sidecar_emulator.profiles import LaneProfile

# The SGLang build the emulator reports until an upgrade (``LaneProfile.upgrade_version`` after it).
BASE_VERSION = "0.5.23"
MAMBA_CRASH = "AssertionError: Can not alloc mamba cache"
PREFILL_OOM = "RuntimeError: Prefill out of memory. Try to lower your batch size."


@dataclass(eq=False)
class _Request:
    rid: str
    prompt_tokens: int
    max_new_tokens: int
    prefix_key: str | None
    cached_tokens_hint: int | None
    priority: int
    arrival: float
    seq: int
    output: int = 0
    prefilled: int = 0  # tokens of (prompt + output) with KV, cache hit included
    target: int = 0  # tokens to prefill this round: prompt (+ output after a retraction)
    own_kv: int = 0  # pool tokens this request owns (not shared through the cache)
    cached_tokens: int = 0  # cache hit at first admission (meta_info.cached_tokens)
    locked_key: str | None = None
    extends_entry: bool = False  # the cache entry is exactly this request's prefix
    entry_len: int = 0
    mamba_working: int = 0
    mamba_ckpts: int = 0
    retractions: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    unreported: int = 0
    last_token_t: float = 0.0
    in_running: bool = False
    # Parallel sampling (``n`` > 1): the client's request id of a prompt's caching pass or of a copy.
    parent: str | None = None
    prime: bool = False
    # First prompt position whose input logprob is computed (None: none).
    logprob_start: int | None = None

    def sort_key(self) -> tuple[int, int]:
        return (-self.priority, self.seq)


@dataclass
class _Entry:
    """One radix-cache branch: the first ``tokens`` tokens of the sequence named by the prefix key."""

    tokens: int
    locks: int = 0
    last_used: float = 0.0


@dataclass
class _Step:
    kind: str  # "prefill" | "decode"
    start: float
    end: float
    items: list[tuple[_Request, int]] = field(default_factory=list)
    new_input: int = 0
    hit_tokens: int = 0


@dataclass
class _Family:
    """A client request with ``n`` > 1 samples: one caching pass, then ``samples`` copies; the client
    sees one request (its first token, its tokens, one end)."""

    samples: int
    max_new_tokens: int
    prefix_key: str
    priority: int
    logprob_start: int | None
    prompt_tokens: int
    cached_tokens: int = 0
    done: int = 0
    output: int = 0
    completed: int = 0
    ended: bool = False
    first_sent: bool = False


@dataclass
class SchedulerCounters:
    """Scheduler-side counters (reset when the process restarts, as Prometheus counters are)."""

    prefill_compute_tokens: int = 0
    prefill_cache_tokens: int = 0
    decode_tokens: int = 0
    retracted_requests: int = 0
    prefill_busy_s: float = 0.0
    queue_times: list[float] = field(default_factory=list)


class EngineModel:
    """One SGLang engine. See the module docstring for what it models and what it does not."""

    def __init__(
        self,
        profile: LaneProfile,
        seed: int = 0,
        *,
        start_time: float = 0.0,
        device: Device | None = None,
    ) -> None:
        self.profile = profile
        self.seed = seed
        self._rng = random.Random(seed)
        self._device: Device = device if device is not None else modeled(profile)
        self._clock = start_time
        self._events: list[Event] = []
        self._seq = 0
        self.restarts = 0
        self.crashes: list[CrashInfo] = []
        self.peak_used_bytes = self.total_bytes - self._device.free_bytes()
        self._up = True
        self._down_until: float | None = None
        # Parallel sampling: client request -> its family; caching pass or copy -> client request. Kept
        # across a restart until the events that end them have been translated.
        self._families: dict[str, _Family] = {}
        self._parents: dict[str, str] = {}
        self._upgraded = False
        self._boot(start_time)

    # ------------------------------------------------------------------ public API
    @property
    def version(self) -> str:
        """The build the engine reports (``/server_info``, ``/v1/loads``): the upgrade's once it came back."""
        return self.profile.upgrade_version if self._upgraded else BASE_VERSION

    @property
    def up(self) -> bool:
        return self._up

    @property
    def total_bytes(self) -> int:
        return self._device.total_bytes

    @property
    def now(self) -> float:
        """The engine time the model has been advanced to."""
        return self._clock

    @property
    def down_until(self) -> float | None:
        return self._down_until

    @property
    def started_at(self) -> float:
        """When the current engine process started serving (boot or last restart)."""
        return self._started_at

    def free_bytes(self, now: float | None = None) -> int:
        """Live device free memory (transients in flight included), as NVML would show it."""
        if now is not None:
            self._advance_to(now)
        return self._device.free_bytes()

    def submit(
        self,
        rid: str,
        prompt_tokens: int,
        *,
        max_new_tokens: int,
        now: float,
        prefix_key: str | None = None,
        cached_tokens_hint: int | None = None,
        priority: int = 0,
        samples: int = 1,
        logprob_start: int | None = None,
    ) -> None:
        """Hand a request to the engine at ``now``.

        ``prefix_key`` names the sequence whose cached prefix this prompt starts with (an agent's
        conversation, a shared system prompt); ``cached_tokens_hint`` says how many leading tokens it
        shares with it (default: all of the cached entry). Invalid requests and requests sent while
        the engine is down come back as :class:`Failed` events from the next ``advance``.

        ``samples`` > 1 is SGLang's parallel sampling (evidence B1): the prompt is prefilled alone with
        no output to cache it, then ``samples`` copies are queued at once and share it. ``logprob_start``
        asks for input-token logprobs from that prompt position (evidence B3, B4).
        """
        self._advance_to(now)
        if rid in self._requests or rid in self._families:
            raise ValueError(f"request id {rid!r} is already in flight")
        if not self._up:
            self._events.append(Failed(rid, now, "engine is down (restarting)", None))
            return
        error = self.validate(prompt_tokens, max_new_tokens)
        if error is not None:
            self._events.append(Failed(rid, now, error, 400))
            return
        if samples > 1:
            key = prefix_key if prefix_key is not None else f"{rid}#n"
            self._families[rid] = _Family(
                samples, max_new_tokens, key, priority, logprob_start, prompt_tokens
            )
            rid, prefix_key, max_new_tokens = f"{rid}#prime", key, 1
        self._seq += 1
        req = _Request(
            rid=rid,
            prompt_tokens=prompt_tokens,
            max_new_tokens=max_new_tokens,
            prefix_key=prefix_key,
            cached_tokens_hint=cached_tokens_hint,
            priority=priority,
            arrival=now,
            seq=self._seq,
            target=prompt_tokens,
            logprob_start=logprob_start,
        )
        if samples > 1:
            req.parent, req.prime = rid.removesuffix("#prime"), True
            self._parents[rid] = req.parent
        self._requests[rid] = req
        self._enqueue(req)
        if self._step is None:
            self._start_step(now)

    @property
    def idle(self) -> bool:
        """Fully idle (SGLang ``Scheduler.is_fully_idle``): nothing running, queued or in a step."""
        return self._up and not self._requests and self._step is None

    def flush_cache(self, now: float) -> bool:
        """SGLang's ``POST /flush_cache`` (``Scheduler.flush_cache(empty_cache=True)``): only when fully
        idle, the radix cache is reset (Mamba checkpoints with it) and PyTorch's allocator cache is
        emptied (``current_platform.empty_cache()``); docs/evidence.md RC2. False when busy."""
        self._advance_to(now)
        if not self.idle:
            return False
        self._cache.clear()
        self._cache_total = 0
        self._mamba_free += self._mamba_evictable
        self._mamba_evictable = 0
        self._mutations += 1
        self._device.empty_cache()
        return True

    def empty_allocator_cache(self, now: float) -> bool:
        """SGLang's idle sleeper with ``SGLANG_EMPTY_CACHE_INTERVAL`` (``IdleSleeper.maybe_sleep``): while
        idle, the allocator cache is emptied; the radix cache stays. False (nothing done) when busy."""
        self._advance_to(now)
        if not self.idle:
            return False
        self._device.empty_cache()
        return True

    def abort(self, rid: str, now: float) -> bool:
        """Drop a request (client disconnect); frees what it held. Returns whether it was in flight."""
        self._advance_to(now)
        fam = self._families.pop(rid, None)
        if fam is not None:
            members = [r for r, q in self._requests.items() if q.parent == rid]
            return any([self.abort(m, now) for m in members])
        req = self._requests.pop(rid, None)
        if req is None:
            return False
        if req in self._waiting:
            self._waiting.remove(req)
        if self._chunked is req:
            self._chunked = None
        if req.in_running:
            self._running.remove(req)
            req.in_running = False
        self._release(req, now, finished=False)
        self._dirty.discard(req)
        self._aborted += 1
        if self._step is None and self._up:
            self._start_step(now)
        return True

    def advance(self, now: float) -> list[Event]:
        """Run the engine up to ``now`` and return what happened since the last call, in order."""
        self._advance_to(now)
        self._flush_all_tokens()
        events, self._events = self._events, []
        if not self._parents:
            return events
        return [out for ev in events for out in self._translate(ev)]

    def next_event_time(self) -> float | None:
        """When the state next changes on its own (a step ends, a restart, an idle report)."""
        if not self._up:
            return self._down_until
        upgrade = self._upgrade_due()
        own = self._step.end if self._step is not None else self._next_idle_publish()
        if upgrade is not None and (own is None or upgrade < own):
            return max(upgrade, self._clock)
        return own

    def run_quiet(self, bound: float) -> float | None:
        """Run the engine through the steps that end by ``bound`` for as long as they produce nothing
        for the caller (no event; token counts wait for the next ``advance``), and return when the
        caller must look next: the instant an event was produced, else ``next_event_time()``.

        For a virtual-time driver that would otherwise wake at every decode step only to find nothing
        to do: the engine goes through exactly the same states; only ``Tokens`` come coalesced.
        """
        produced = len(self._events)
        while True:
            t = self.next_event_time()
            if t is None or t > bound:
                return t
            self._advance_to(t)
            if len(self._events) > produced:
                return self._clock

    def published_gauges(self) -> Gauges | None:
        """What ``/metrics`` shows: the last report, or ``None`` before the first one (fresh engine)."""
        return self._published

    def loads_snapshot(self) -> LoadsSnapshot:
        """What ``/v1/loads`` shows (refreshed on its own cadence, see the module docstring)."""
        return self._loads

    def live_gauges(self) -> Gauges:
        """The gauges as they are right now; what ``/metrics`` would show if SGLang reported live."""
        return self._gauges(self._clock)

    @property
    def other_process_bytes(self) -> int | None:
        """What other processes hold on the device (None on a real GPU: NVML says that there)."""
        return getattr(self._device, "other_process_bytes", None)

    def set_other_process_bytes(self, nbytes: int, now: float, rank: int | None = None) -> None:
        """A neighbour on the card changes its memory at ``now`` (a scenario's GPU event); under tensor
        parallelism on rank ``rank``'s GPU only (None: every rank's)."""
        self._advance_to(now)
        setter = getattr(self._device, "set_other_process_bytes", None)
        if setter is None:
            raise ValueError("this device cannot change other processes' memory (a real GPU)")
        if rank is None:
            setter(nbytes)
        elif not hasattr(self._device, "ranks"):
            raise ValueError(f"rank {rank}: this engine has one GPU")
        else:
            setter(nbytes, rank)

    def device_readings(self, now: float | None = None) -> list[tuple[int, int, int | None]]:
        """(free, total, other processes' bytes) of each GPU the engine runs on, in rank order."""
        if now is not None:
            self._advance_to(now)
        readings = getattr(self._device, "readings", None)
        if readings is not None:
            return list(readings())
        return [(self._device.free_bytes(), self.total_bytes, self.other_process_bytes)]

    def release_device(self) -> None:
        """Free everything the engine holds on its device (the emulator is shutting down)."""
        self._device.crash()

    @property
    def counters(self) -> SchedulerCounters:
        return self._counters

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ lifecycle
    def _boot(self, t: float) -> None:
        p = self.profile
        self._started_at = t
        self._requests: dict[str, _Request] = {}
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._chunked: _Request | None = None
        self._step: _Step | None = None
        self._cache: dict[str, _Entry] = {}
        self._own_total = 0
        self._cache_total = 0
        self._mamba_free = p.mamba_slots
        # Changes to the queue, the running batch, the KV pool or the Mamba pool other than a decode
        # step's (``_start_step``): when the queue's head was last found blocked, at which count.
        self._mutations = 0
        self._blocked_at = -1
        self._mamba_evictable = 0
        # Checkpoints of requests still in flight: held (never allocatable), maybe reported evictable.
        self._mamba_pinned = 0
        self._batch_grew = False
        self._dirty: set[_Request] = set()
        self._aborted = 0
        self._counters = SchedulerCounters()
        self._published: Gauges | None = None
        self._last_publish: float | None = None
        self._decode_steps_since_publish = 0
        self._decode_steps_since_loads = 0
        self._prefills_since_publish = 0
        self._gen_window_start = t
        self._gen_window_tokens = 0
        self._gen_throughput = 0.0
        self._cache_hit_rate = 0.0
        self._retracted_since_publish = 0
        self._loads = self._make_loads(t)

    def _crash(self, t: float, reason: str, oom: OutOfMemory | None = None) -> None:
        # The true state: the failed eviction has just found the pinned checkpoints locked.
        live = self._gauges(t, true_mamba=True)
        self._flush_all_tokens()
        failed = tuple(self._requests)
        for rid in failed:
            self._events.append(Failed(rid, t, f"engine crashed: {reason}", None))
        requested = oom.requested_bytes if oom else None
        free = oom.free_bytes if oom else None
        self._events.append(Crashed(t, reason, requested, free, failed))
        self.crashes.append(CrashInfo(t, reason, requested, free, live))
        self._go_down(t + self.profile.restart_s)

    def _go_down(self, until: float) -> None:
        """The process is gone until ``until`` (a crash, a planned restart): its memory released,
        nothing scheduled, every request forgotten (the caller has failed them)."""
        self._device.crash()
        self._up = False
        self._down_until = until
        self._step = None
        self._requests = {}
        self._waiting = []
        self._running = []
        self._chunked = None
        self._dirty = set()

    def _restart(self, t: float) -> None:
        self._device.restart()
        self._up = True
        self._down_until = None
        self.restarts += 1
        self._boot(t)
        self._events.append(Restarted(t))

    # ------------------------------------------------------------------ time
    def _advance_to(self, now: float) -> None:
        if now < self._clock:
            raise ValueError(f"time went backwards: {now} < {self._clock}")
        while True:
            if not self._up:
                assert self._down_until is not None
                if self._down_until <= now:
                    self._clock = self._down_until
                    self._restart(self._down_until)
                    continue
                break
            upgrade = self._upgrade_due()
            if upgrade is not None and upgrade <= now and (self._step is None or self._step.end > upgrade):
                self._clock = max(self._clock, upgrade)
                self._stop_for_upgrade(self._clock)
                continue
            if self._step is not None:
                if self._step.end <= now:
                    t = self._step.end
                    self._clock = t
                    self._finish_step(t)
                    if self._up:
                        self._start_step(t)
                    continue
                break
            due = self._next_idle_publish()
            if due is not None and due <= now:
                self._clock = due
                self._publish(due, idle=True)
                continue
            break
        self._clock = now

    def _upgrade_due(self) -> float | None:
        at = self.profile.upgrade_at_s
        return None if at is None or self._upgraded else at

    def _stop_for_upgrade(self, t: float) -> None:
        """A planned restart onto a new build (``LaneProfile.upgrade_at_s``): what is in flight fails as
        on a crash, but nothing ran out of memory; the build that comes back draws ``upgrade_scale``."""
        self._flush_all_tokens()
        for rid in tuple(self._requests):
            self._events.append(Failed(rid, t, "engine restarting: new build", None))
        self._upgraded = True
        self._go_down(t + self.profile.upgrade_down_s)

    def _next_idle_publish(self) -> float | None:
        if not self._up or self._step is not None:
            return None
        pub = self._published
        stale = pub is not None and (
            pub.num_running_reqs != len(self._running) or pub.num_queue_reqs != len(self._waiting)
        )
        if stale:
            return self._clock  # the last report is stale: SGLang re-reports at once
        last = self._last_publish if self._last_publish is not None else self._started_at
        return last + self.profile.idle_publish_s

    # ------------------------------------------------------------------ steps
    def _start_step(self, t: float) -> None:
        """Pick and start the next step at ``t`` (prefill first), or go idle."""
        if self._chunked is not None or (self._waiting and self._blocked_at != self._mutations):
            items, new_input, hits = self._form_prefill_batch(t)
            if items:
                self._start_prefill(t, items, new_input, hits)
                return
            if self._chunked is None and self.profile.new_token_ratio <= 1.0:
                # The head of the queue does not fit. Until something else changes (``_mutations``),
                # decode steps only take room (one token per running request, reserves shrinking by at
                # most one each at a ratio <= 1): it still does not, so do not ask again every step.
                self._blocked_at = self._mutations
        if self._running:
            self._start_decode(t)
            return
        if self._waiting and self._chunked is None:
            # Nothing runs, nothing will free memory: the head of the queue can never be admitted
            # (a retracted request that outgrew the pool). Fail it rather than hang the queue.
            req = self._waiting.pop(0)
            self._mutations += 1
            del self._requests[req.rid]
            reason = "The request does not fit in the KV cache pool (retracted and grown past it)."
            self._events.append(Failed(req.rid, t, reason, 503))
            self._start_step(t)
            return
        self._loads = self._make_loads(t)  # idle: /v1/loads is current

    def _form_prefill_batch(self, t: float) -> tuple[list[tuple[_Request, int]], int, int]:
        p = self.profile
        rem_chunk = p.chunked_prefill_size
        rem_total = self._kv_free() + self._kv_evictable() - sum(self._reserve(r) for r in self._running)
        items: list[tuple[_Request, int]] = []
        new_input = hits = 0
        if self._chunked is not None:
            req = self._chunked
            n = min(rem_chunk, req.target - req.prefilled)
            items.append((req, n))
            rem_chunk -= n
            rem_total -= n
            if req.prefilled + n >= req.target:
                rem_total -= self._reserve(req)
                self._chunked = None
            else:
                return items, new_input, hits
        admitted = len(self._running) + len(items)
        while rem_chunk > 0 and self._waiting:
            req = self._waiting[0]
            if admitted >= p.effective_max_running_requests:
                break
            hit, entry = self._match(req)
            unlock_gain = entry.tokens if entry is not None and entry.locks == 0 else 0
            need = req.target - hit + self._reserve(req)
            if need >= rem_total - unlock_gain:
                break  # NO_TOKEN: the head of the queue blocks it (FCFS)
            if p.mamba_slots > 0 and self._mamba_free + self._mamba_evictable < p.mamba_slots_per_request:
                break
            self._waiting.pop(0)
            self._admit(req, t, hit, entry)
            n = min(rem_chunk, req.target - req.prefilled)
            items.append((req, n))
            new_input += req.target - hit
            hits += hit
            rem_chunk -= n
            rem_total -= need + unlock_gain
            admitted += 1
            if req.prefilled + n < req.target:
                self._chunked = req
                break
        return items, new_input, hits

    def _admit(self, req: _Request, t: float, hit: int, entry: _Entry | None) -> None:
        p = self.profile
        if entry is not None:
            entry.locks += 1
            entry.last_used = t
            req.locked_key = req.prefix_key
            req.extends_entry = hit == entry.tokens
            req.entry_len = entry.tokens
        req.prefilled = hit
        if req.admitted_at is None:
            req.admitted_at = t
            req.cached_tokens = hit
            self._counters.queue_times.append(t - req.arrival)
        if p.mamba_slots > 0:
            self._take_mamba(p.mamba_slots_per_request, t, crash=False)
            req.mamba_working = p.mamba_slots_per_request

    def _start_prefill(self, t: float, items: list[tuple[_Request, int]], new_input: int, hits: int) -> None:
        self._mutations += 1
        p = self.profile
        total_tokens = sum(n for _, n in items)
        for req, n in items:
            if not self._alloc_kv(n, t):
                self._crash(t, PREFILL_OOM)
                return
            req.own_kv += n
            self._own_total += n
        pieces = [("activation", self._noisy(total_tokens * p.activation_bytes_per_token))]
        if p.fixed_bytes_per_step:
            pieces.append(("fixed", self._noisy(p.fixed_bytes_per_step)))
        for req, n in items:
            tp = p.transient_pieces(n, req.prefilled + n)
            pieces.append(("context", self._noisy(tp.context)))
            pieces.append(("gather", self._noisy(tp.gather)))
            if req.logprob_start is not None:
                rows = req.prefilled + n - max(req.prefilled, req.logprob_start)
                pieces.append(("logits", self._noisy(max(0, rows) * p.logprob_bytes_per_token)))
        duration = p.step_overhead_s + sum(p.prefill_seconds(n, req.prefilled) for req, n in items)
        self._step = _Step("prefill", t, t + duration, items, new_input, hits)
        self._allocate(t, pieces)

    def _start_decode(self, t: float) -> None:
        p = self.profile
        while self._running and self._kv_free() + self._kv_evictable() < len(self._running):
            self._retract_one(t)
        if not self._running:
            self._start_step(t)  # retracted requests may be admissible again, or the engine idles
            return
        self._alloc_kv(len(self._running), t)
        for req in self._running:
            req.own_kv += 1
        self._own_total += len(self._running)
        extra = 0
        if self._batch_grew and p.unknown_extra_bytes and len(self._running) >= p.unknown_extra_min_running:
            extra = self._noisy(p.unknown_extra_bytes)
        self._batch_grew = False
        duration = p.step_overhead_s + p.decode_step_seconds(len(self._running))
        self._step = _Step("decode", t, t + duration)
        if extra:
            self._allocate(t, [("unknown", extra)])

    def _drawn(self, t: float, nbytes: int) -> int:
        """What the engine really allocates for a piece its model sizes at ``nbytes``: the robustness
        perturbations (``LaneProfile.transient_scale``, ``upgrade_scale``, ``allocation_round_bytes``)."""
        p = self.profile
        scale = p.transient_scale if t >= p.transient_scale_from_s else 1.0
        if self._upgraded:
            scale *= p.upgrade_scale
        if scale != 1.0:
            nbytes = round(nbytes * scale)
        block = p.allocation_round_bytes
        return -(-nbytes // block) * block if block > 0 else nbytes

    def _allocate(self, t: float, pieces: list[tuple[str, int]]) -> None:
        for _what, nbytes in pieces:
            if nbytes <= 0:
                continue
            nbytes = self._drawn(t, nbytes)
            try:
                self._device.allocate(nbytes)
            except OutOfMemory as oom:
                self._crash(t, oom.message, oom)
                return
        used = self.total_bytes - self._device.free_bytes()
        self.peak_used_bytes = max(self.peak_used_bytes, used)

    def _finish_step(self, t: float) -> None:
        step = self._step
        assert step is not None
        self._step = None
        self._device.release_transients()
        if step.kind == "prefill":
            self._finish_prefill(step, t)
        else:
            self._finish_decode(t)

    def _finish_prefill(self, step: _Step, t: float) -> None:
        self._mutations += 1
        c = self._counters
        c.prefill_busy_s += step.end - step.start
        for req, n in step.items:
            if self._requests.get(req.rid) is not req:
                continue  # aborted during the step
            before = req.prefilled
            req.prefilled += n
            c.prefill_compute_tokens += n
            if not self._checkpoint_mamba(req, before, t):
                return  # crashed
            if req.prefilled >= req.target:
                self._complete_prefill(req, t)
        c.prefill_cache_tokens += step.hit_tokens
        total_in = step.new_input + step.hit_tokens
        self._cache_hit_rate = step.hit_tokens / total_in if total_in else 0.0
        self._prefills_since_publish += 1
        if self._prefills_since_publish >= self.profile.prefill_publish_every:
            self._publish(t)
            self._loads = self._make_loads(t)

    def _complete_prefill(self, req: _Request, t: float) -> None:
        p = self.profile
        if p.mamba_checkpoint_interval_tokens == 0 and req.mamba_ckpts:
            # Latest-only checkpoint: the final state lives in the working slot; the checkpoint is cached.
            self._mamba_evictable += req.mamba_ckpts
            self._mamba_pinned -= req.mamba_ckpts
            req.mamba_ckpts = 0
        self._cache_prefix(req, t)
        req.output += 1  # the prefill forward samples the next token
        if req.first_token_at is None:
            req.first_token_at = t
            self._events.append(FirstToken(req.rid, t, req.prompt_tokens, req.cached_tokens))
        else:
            req.unreported += 1
            req.last_token_t = t
            self._dirty.add(req)
        if req.output >= req.max_new_tokens:
            self._finish_request(req, t)
            return
        req.in_running = True
        self._running.append(req)
        self._batch_grew = True

    def _finish_decode(self, t: float) -> None:
        p = self.profile
        done: list[_Request] = []
        for req in self._running:
            req.output += 1
            req.unreported += 1
            req.last_token_t = t
            self._dirty.add(req)
            if req.output >= req.max_new_tokens:
                done.append(req)
        n = len(self._running)
        self._counters.decode_tokens += n
        self._gen_window_tokens += n
        for req in done:
            self._finish_request(req, t)
        self._decode_steps_since_publish += 1
        self._decode_steps_since_loads += 1
        if self._decode_steps_since_publish >= p.decode_log_interval:
            span = t - self._gen_window_start
            self._gen_throughput = self._gen_window_tokens / span if span > 0 else 0.0
            self._gen_window_start = t
            self._gen_window_tokens = 0
            self._publish(t)
        if self._decode_steps_since_loads >= p.loads_publish_interval:
            self._decode_steps_since_loads = 0
            self._loads = self._make_loads(t)

    def _finish_request(self, req: _Request, t: float) -> None:
        self._flush_tokens(req)
        if req.in_running:
            self._running.remove(req)
            req.in_running = False
        self._release(req, t, finished=True)
        del self._requests[req.rid]
        if req.prime:
            self._spawn_samples(req, t)
            return
        self._events.append(
            Finished(req.rid, t, req.prompt_tokens, req.output, req.cached_tokens, "length", req.retractions)
        )

    def _spawn_samples(self, prime: _Request, t: float) -> None:
        """The caching pass is done: queue the copies at once (SGLang's TokenizerManager sends them in
        one loop, so the scheduler admits them into one extend batch)."""
        assert prime.parent is not None
        fam = self._families.get(prime.parent)
        if fam is None:
            return
        fam.cached_tokens = prime.cached_tokens
        for i in range(fam.samples):
            self._seq += 1
            rid = f"{prime.parent}#{i}"
            req = _Request(
                rid=rid,
                prompt_tokens=fam.prompt_tokens,
                max_new_tokens=fam.max_new_tokens,
                prefix_key=fam.prefix_key,
                cached_tokens_hint=None,
                priority=fam.priority,
                arrival=t,
                seq=self._seq,
                target=fam.prompt_tokens,
                parent=prime.parent,
                logprob_start=fam.logprob_start,
            )
            self._parents[rid] = prime.parent
            self._requests[rid] = req
            self._enqueue(req)

    def _translate(self, ev: Event) -> list[Event]:
        """A copy's or a caching pass's event as the client sees it: one request, one end."""
        if isinstance(ev, Crashed):
            rids = dict.fromkeys(self._parents.get(r, r) for r in ev.failed_rids)
            return [Crashed(ev.t, ev.reason, ev.requested_bytes, ev.free_bytes, tuple(rids))]
        rid = getattr(ev, "rid", None)
        parent = self._parents.get(rid) if rid is not None else None
        if parent is None:
            return [ev]
        fam = self._families.get(parent)
        if fam is None or fam.ended or ((rid or "").endswith("#prime") and not isinstance(ev, Failed)):
            return []
        if isinstance(ev, FirstToken):
            if fam.first_sent:
                return []
            fam.first_sent = True
            return [FirstToken(parent, ev.t, fam.prompt_tokens, fam.cached_tokens)]
        if isinstance(ev, Tokens):
            fam.output += ev.count
            return [Tokens(parent, ev.t, ev.count, fam.output)]
        if isinstance(ev, Retracted):
            return [Retracted(parent, ev.t, ev.retractions)]
        if isinstance(ev, Failed):
            fam.ended = True
            self._families.pop(parent, None)
            return [Failed(parent, ev.t, ev.reason, ev.status)]
        if isinstance(ev, Finished):
            fam.done += 1
            fam.completed += ev.completion_tokens
            if fam.done < fam.samples:
                return []
            self._families.pop(parent, None)
            return [Finished(parent, ev.t, fam.prompt_tokens, fam.completed, fam.cached_tokens, "length", 0)]
        return [ev]

    # ------------------------------------------------------------------ retraction
    def _retract_one(self, t: float) -> None:
        # SGLang retract_decode: sort by (output len, -input len) descending, pop from the end.
        victim = min(self._running, key=lambda r: (r.output, -r.prompt_tokens))
        self._running.remove(victim)
        victim.in_running = False
        self._flush_tokens(victim)
        self._release(victim, t, finished=False)
        victim.retractions += 1
        self._counters.retracted_requests += 1
        self._retracted_since_publish += 1
        if victim.retractions >= self.profile.max_retractions:
            del self._requests[victim.rid]
            reason = f"The request was retracted {victim.retractions} times under KV cache pressure."
            self._events.append(Failed(victim.rid, t, reason, 503))
            return
        self._events.append(Retracted(victim.rid, t, victim.retractions))
        victim.prefilled = 0
        victim.target = victim.prompt_tokens + victim.output
        self._enqueue(victim)

    # ------------------------------------------------------------------ KV pool and radix cache
    def _kv_free(self) -> int:
        return self.profile.kv_pool_tokens - self._own_total - self._cache_total

    def _kv_evictable(self) -> int:
        return sum(e.tokens for e in self._cache.values() if e.locks == 0)

    def _reserve(self, req: _Request) -> int:
        p = self.profile
        left = max(0, req.max_new_tokens - req.output)
        return int(min(left, p.clip_max_new_tokens) * p.new_token_ratio)

    def _match(self, req: _Request) -> tuple[int, _Entry | None]:
        if req.prefix_key is None:
            return 0, None
        entry = self._cache.get(req.prefix_key)
        if entry is None or entry.tokens <= 0:
            return 0, None
        hit = entry.tokens
        if req.cached_tokens_hint is not None and req.retractions == 0:
            hit = min(hit, req.cached_tokens_hint)
        hit = min(hit, req.target - 1)  # SGLang always computes at least one token
        if req.logprob_start is not None:
            hit = min(hit, req.logprob_start)  # no cache reuse past logprob_start_len (evidence B4)
        return max(0, hit), entry

    def _alloc_kv(self, n: int, t: float) -> bool:
        free = self._kv_free()
        if free < n:
            self._evict(n - free)
        return self._kv_free() >= n

    def _evict(self, need: int) -> None:
        """Free ``need`` tokens from unlocked cache entries, least recently used first, tail first."""
        for key in sorted(self._cache, key=lambda k: self._cache[k].last_used):
            if need <= 0:
                break
            entry = self._cache[key]
            if entry.locks:
                continue
            take = min(need, entry.tokens)
            self._mutations += take > 0
            entry.tokens -= take
            self._cache_total -= take
            need -= take
            if entry.tokens == 0:
                del self._cache[key]

    def _cache_prefix(self, req: _Request, t: float) -> None:
        """After prefill (SGLang cache_unfinished_req): the prompt becomes a cache entry under its key."""
        key = req.prefix_key
        if key is None:
            return
        entry = self._cache.get(key)
        if entry is None:
            entry = self._cache[key] = _Entry(tokens=0, locks=1, last_used=t)
            req.locked_key = key
            req.extends_entry = True
            req.entry_len = 0
        if req.extends_entry and entry.tokens == req.entry_len and req.prefilled > entry.tokens:
            delta = min(req.prefilled - entry.tokens, req.own_kv)
            entry.tokens += delta
            self._cache_total += delta
            req.own_kv -= delta
            self._own_total -= delta
            req.entry_len = entry.tokens
        entry.last_used = t

    def _release(self, req: _Request, t: float, *, finished: bool) -> None:
        """Give back what a request holds. A finished sequence extends its cache entry (SGLang
        cache_finished_req) and leaves its Mamba checkpoints evictable; otherwise all is freed."""
        self._mutations += 1
        entry = self._cache.get(req.locked_key) if req.locked_key is not None else None
        own = req.own_kv
        self._own_total -= own
        req.own_kv = 0
        if finished and entry is not None and req.extends_entry and entry.tokens == req.entry_len:
            entry.tokens += own
            self._cache_total += own
        if entry is not None:
            entry.locks = max(0, entry.locks - 1)
            entry.last_used = t
        req.locked_key = None
        req.extends_entry = False
        req.entry_len = 0
        if self.profile.mamba_slots > 0:
            self._mamba_free += req.mamba_working
            self._mamba_pinned -= req.mamba_ckpts
            if finished:
                self._mamba_evictable += req.mamba_ckpts
            else:
                self._mamba_free += req.mamba_ckpts
            req.mamba_working = 0
            req.mamba_ckpts = 0

    # ------------------------------------------------------------------ Mamba slots
    def _take_mamba(self, n: int, t: float, *, crash: bool) -> bool:
        for _ in range(n):
            if self._mamba_free > 0:
                self._mamba_free -= 1
            elif self._mamba_evictable > 0:
                self._mamba_evictable -= 1
            else:
                if crash:
                    self._crash(t, MAMBA_CRASH)
                return False
        return True

    def _checkpoint_mamba(self, req: _Request, before: int, t: float) -> bool:
        """Checkpoints kept during chunked prefill; False if the engine died allocating one."""
        p = self.profile
        if p.mamba_slots <= 0 or req.prefilled >= req.target:
            return True
        interval = p.mamba_checkpoint_interval_tokens
        # With no interval only the latest checkpoint is kept: one slot, reused chunk after chunk.
        wanted = req.prefilled // interval - before // interval if interval > 0 else 1 - req.mamba_ckpts
        for _ in range(max(0, wanted)):
            if not self._take_mamba(1, t, crash=True):
                return False
            req.mamba_ckpts += 1
            self._mamba_pinned += 1
        return True

    # ------------------------------------------------------------------ queue
    def _enqueue(self, req: _Request) -> None:
        self._mutations += 1
        keys = [r.sort_key() for r in self._waiting]
        self._waiting.insert(bisect.bisect(keys, req.sort_key()), req)

    def cached_prefix_tokens(self, prefix_key: str | None) -> int:
        """Tokens of this prefix the radix cache holds now (0 if none): what a request would reuse."""
        entry = self._cache.get(prefix_key) if prefix_key is not None else None
        return entry.tokens if entry is not None else 0

    def validate(self, prompt_tokens: int, max_new_tokens: int) -> str | None:
        """Why SGLang would reject this request with 400, or None if it is acceptable."""
        p = self.profile
        if prompt_tokens < 1:
            return "The input is empty."
        if max_new_tokens < 1:
            return "max_new_tokens must be at least 1."
        if prompt_tokens >= p.max_req_input_len:
            return (
                f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed length "
                f"({p.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate."
            )
        total = prompt_tokens + max_new_tokens
        reserve = int(min(max_new_tokens, p.clip_max_new_tokens) * p.new_token_ratio)
        if prompt_tokens + reserve >= p.kv_pool_tokens:
            return (
                f"The request needs {prompt_tokens + reserve} KV tokens ({prompt_tokens} input + {reserve} "
                f"reserved for output) but the KV cache pool holds {p.kv_pool_tokens}."
            )
        if total > p.context_length:
            return (
                f"Requested token count exceeds the model's maximum context length of {p.context_length} "
                f"tokens. You requested a total of {total} tokens: {prompt_tokens} tokens from the input "
                f"messages and {max_new_tokens} tokens for the completion. Please reduce the number of "
                "tokens in the input messages or the completion to fit within the limit."
            )
        return None

    # ------------------------------------------------------------------ tokens and reports
    def _flush_tokens(self, req: _Request) -> None:
        if req.unreported:
            self._events.append(Tokens(req.rid, req.last_token_t, req.unreported, req.output))
            req.unreported = 0
        self._dirty.discard(req)

    def _flush_all_tokens(self) -> None:
        for req in sorted(self._dirty, key=lambda r: r.seq):
            if req.unreported:
                self._events.append(Tokens(req.rid, req.last_token_t, req.unreported, req.output))
                req.unreported = 0
        self._dirty.clear()

    def _noisy(self, nbytes: int) -> int:
        """``nbytes`` times a seeded factor drawn uniformly from ``[1 - noise, 1 + noise]``.

        Bounded on purpose: a real allocation's size varies within a range (kernel workspaces,
        allocator rounding), it has no unbounded tail. A gaussian factor has one, and with it no gate
        that keeps a finite margin can be crash-free over enough draws; only one that sees the draw
        (the oracle) could. A gate whose margin covers ``1 + noise`` survives every draw here.
        """
        noise = self.profile.transient_noise
        if nbytes <= 0 or noise <= 0:
            return max(0, nbytes)
        return max(0, round(nbytes * (1.0 + self._rng.uniform(-noise, noise))))

    def _pending_prefill_tokens(self) -> int:
        pending = sum(r.target - self._match(r)[0] for r in self._waiting)
        if self._chunked is not None:
            pending += self._chunked.target - self._chunked.prefilled
        return pending

    def _gauges(self, t: float, *, true_mamba: bool = False) -> Gauges:
        """What the engine reports; ``true_mamba`` counts pinned checkpoints as used even where the
        profile says the engine reports them evictable (the state at a failed Mamba allocation)."""
        p = self.profile
        pool = p.kv_pool_tokens
        evictable = self._kv_evictable()
        available = self._kv_free()
        kv_used = pool - available - evictable
        full = kv_used / pool if pool else 0.0
        m_evictable = self._mamba_evictable
        if p.mamba_inflight_checkpoints_reported_evictable and not true_mamba:
            m_evictable += self._mamba_pinned
        if p.mamba_slots > 0:
            m_used = p.mamba_slots - self._mamba_free - m_evictable
            mamba = m_used / p.mamba_slots
        else:
            m_used = 0
            mamba = 0.0
        idle = self._step is None and not self._running
        return Gauges(
            t=t,
            num_running_reqs=len(self._running),
            num_queue_reqs=len(self._waiting),
            token_usage=round(max(full, mamba), 2),
            full_token_usage=full,
            mamba_usage=mamba,
            num_used_tokens=kv_used,
            kv_available_tokens=available,
            kv_evictable_tokens=evictable,
            kv_used_tokens=kv_used,
            mamba_available_tokens=self._mamba_free if p.mamba_slots else 0,
            mamba_evictable_tokens=m_evictable if p.mamba_slots else 0,
            mamba_used_tokens=m_used,
            gen_throughput=0.0 if idle else self._gen_throughput,
            cache_hit_rate=self._cache_hit_rate,
            decode_sum_seq_lens=sum(r.prefilled + r.output for r in self._running),
            new_token_ratio=p.new_token_ratio,
            num_retracted_reqs=self._retracted_since_publish,
            pending_prefill_tokens=self._pending_prefill_tokens(),
        )

    def _publish(self, t: float, *, idle: bool = False) -> None:
        self._published = self._gauges(t)
        self._last_publish = t
        self._prefills_since_publish = 0
        self._decode_steps_since_publish = 0
        self._retracted_since_publish = 0
        if idle:
            self._loads = self._make_loads(t)

    def _make_loads(self, t: float) -> LoadsSnapshot:
        p = self.profile
        g = self._gauges(t)
        return LoadsSnapshot(
            t=t,
            num_running_reqs=g.num_running_reqs,
            num_waiting_reqs=g.num_queue_reqs,
            num_waiting_uncached_tokens=g.pending_prefill_tokens,
            num_used_tokens=g.num_used_tokens,
            max_total_num_tokens=p.kv_pool_tokens,
            max_running_requests=p.effective_max_running_requests,
            kv_token_usage=round(g.full_token_usage, 4),
            gen_throughput=g.gen_throughput,
            cache_hit_rate=g.cache_hit_rate,
            total_prefill_uncached_tokens=self._counters.prefill_compute_tokens,
            total_prefill_busy_us=int(self._counters.prefill_busy_s * 1e6),
            num_retracted_waiting=sum(1 for r in self._waiting if r.retractions),
        )
