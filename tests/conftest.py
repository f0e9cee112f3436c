"""Shared builders: policies, snapshots and a manual clock. No mocks of our own code."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from sidecar.admission import Admission
from sidecar.core import demand
from sidecar.core.demand import Demand
from sidecar.core.snapshot import DeviceMemory, EngineSignals, GpuSignals, Snapshot, SourceHealth
from sidecar.intake import rules_of
from sidecar.policy import LoadedPolicy, Policy, load_policy_file, load_policy_text

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ROOT / "policies"
MIB = 1024 * 1024


class ManualClock:
    """A clock tests move by hand: no sleeps, no timing assertions."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def maxq() -> LoadedPolicy:
    return load_policy_file(POLICIES / "maxq-qwen3next-old.yaml")


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
        rules, at = target.rules, target.clock() if now is None else now
    else:
        rules, at = rules_of(target), 0.0 if now is None else now
    return demand.build(rules, prompt_tokens, arrived_at=at, **kw)  # type: ignore[arg-type]


def with_engine(snap: Snapshot, **changes: object) -> Snapshot:
    assert snap.engine is not None
    return replace(snap, engine=replace(snap.engine, **changes))
