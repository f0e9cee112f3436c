"""Shared builders: policies, snapshots and a manual clock. No mocks of our own code."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from sidecar.admission.controller import Admission, Handle
from sidecar.core import demand
from sidecar.core.demand import Demand
from sidecar.core.snapshot import DeviceMemory, EngineSignals, GpuSignals, Snapshot, SourceHealth
from sidecar.policy.in_force import rules_of
from sidecar.policy.schema import LoadedPolicy, Policy, load_policy_file, load_policy_text

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ROOT / "policies"  # the lane policies (deployed)
# The emulator-exact policies: cost terms of the emulator's profiles, for scenarios and benchmarks.
EMULATOR_POLICIES = ROOT / "sidecar_emulator" / "policies"
MIB = 1024 * 1024


class ManualClock:
    """A clock tests move by hand: no sleeps, no timing assertions. Deadlines scheduled on it with
    ``call_at`` fire, in order, when ``advance`` reaches them."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t
        self._timers: list[tuple[float, int, _ManualTimer]] = []
        self._seq = 0

    def __call__(self) -> float:
        return self.t

    def now(self) -> float:
        return self.t

    def call_at(self, when: float, fn: Callable[[], None]) -> _ManualTimer:
        timer = _ManualTimer(fn)
        self._seq += 1
        heapq.heappush(self._timers, (when, self._seq, timer))
        return timer

    @property
    def pending(self) -> int:
        return sum(1 for _, _, t in self._timers if t.fn is not None)

    def advance(self, dt: float) -> None:
        end = self.t + dt
        while self._timers and self._timers[0][0] <= end:
            when, _, timer = heapq.heappop(self._timers)
            self.t = max(self.t, when)
            timer.fire()
        self.t = end


class _ManualTimer:
    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn: Callable[[], None] | None = fn

    def fire(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()

    def cancel(self) -> None:
        self.fn = None


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def maxq() -> LoadedPolicy:
    return load_policy_file(EMULATOR_POLICIES / "maxq-qwen3next-old.yaml")


def small_policy(**overrides: object) -> LoadedPolicy:
    """A lane with round numbers, so tests can say "room for exactly N" without arithmetic."""
    text = """
name: test-lane
lane: {context_len: 100000, kv_pool_tokens: 100000, chunked_prefill_size: 1000}
cost: {activation_bytes_per_chunk_token: 1KiB, fixed_bytes: 0}
vram: {reserve_bytes: 0}
engine_queue: {max_requests: 1000}
pending_prefill: {max_tokens: 10000000}
engine: {poll_interval_s: 0.5, max_age_s: 5, on_stale: hold}
gpu: {poll_interval_s: 0.1, max_age_s: 2, on_stale: hold}
hold: {max_held: 10, max_wait_s: 30, retry_after_max_s: 60, prefill_tokens_per_s: 1000}
"""
    import yaml

    data = yaml.safe_load(text)
    for dotted, value in overrides.items():
        node = data
        *path, last = dotted.split("__")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return load_policy_text(yaml.safe_dump(data), "<test>")


def snapshot(
    now: float,
    *,
    free_bytes: int | None = 100 * 1024 * MIB,
    total_bytes: int = 140 * 1024 * MIB,
    **engine: object,
) -> Snapshot:
    base = dict(
        running_requests=0,
        queue_requests=0,
        full_token_usage=0.0,
        mamba_usage=0.0,
        kv_used_tokens=0,
        kv_available_tokens=100000,
        kv_evictable_tokens=0,
        max_total_tokens=100000,
        pending_prefill_tokens=0,
    )
    base.update(engine)
    e = EngineSignals(observed_at=now, **base)  # type: ignore[arg-type]
    gpu = (
        None
        if free_bytes is None
        else GpuSignals(now, "test", (DeviceMemory("GPU-0", free_bytes, total_bytes),))
    )
    return Snapshot(
        engine=e, gpu=gpu, engine_health=SourceHealth(last_ok_at=now), gpu_health=SourceHealth(last_ok_at=now)
    )


def ask(target: Admission | Policy, prompt_tokens: int, *, now: float | None = None, **kw: object) -> Demand:
    """A request's demand, priced by an Admission's rules at its clock's now, or by a policy at ``now``."""
    if isinstance(target, Admission):
        rules, at = target.rules, target.clock.now() if now is None else now
    else:
        rules, at = rules_of(target), 0.0 if now is None else now
    return demand.build(rules, prompt_tokens, arrived_at=at, **kw)  # type: ignore[arg-type]


def submit(a: Admission, d: Demand, answered: list[Handle] | None = None) -> Handle:
    """Open a handle and submit ``d``; a held one is appended to ``answered`` when the gate answers."""
    h = a.open()
    h.submit(d, answered.append if answered is not None else lambda h: None)
    return h


def with_engine(snap: Snapshot, **changes: object) -> Snapshot:
    assert snap.engine is not None
    return replace(snap, engine=replace(snap.engine, **changes))
