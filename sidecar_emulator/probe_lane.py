"""``calibrate``'s lane and meter over an engine model in virtual time (tests, benches, no HTTP).

The same probe loop that qualifies a real lane over HTTP and NVML runs here against
:class:`~sidecar_emulator.engine.EngineModel` directly: a probe's requests are submitted, the model is
advanced event by event until each one finishes or the engine crashes, and the meter reads the
model's device memory as NVML would show it.
"""

from __future__ import annotations

import asyncio

from sidecar.calibrate.fit import (
    Bounds,
    Coefficients,
    EngineInfo,
    Fit,
    Probe,
    ProbeRun,
    fit,
    plan_probes,
    run_probes,
)
from sidecar.calibrate.proposal import LaneFacts, proposal_text
from sidecar.policy.schema import load_policy_text
from sidecar_emulator.engine import EngineModel
from sidecar_emulator.events import Crashed, Failed, Finished
from sidecar_emulator.profiles import LaneProfile


class ModelLane:
    """Both :class:`sidecar.calibrate.fit.Lane` and :class:`sidecar.calibrate.fit.Meter` for one model."""

    def __init__(
        self, model: EngineModel, *, flushes: bool = False, empty_cache_interval_s: float = 0.0
    ) -> None:
        self.model = model
        self.t = model.now
        # ``flushes``: the engine answers ``POST /flush_cache``; ``empty_cache_interval_s``: it empties
        # its allocator cache after idling this long (engine seconds; SGLANG_EMPTY_CACHE_INTERVAL).
        self.flushes = flushes
        self.empty_cache_interval_s = empty_cache_interval_s
        self._idle_s = 0.0

    async def flush(self) -> bool:
        return self.flushes and self.model.flush_cache(self.t)

    async def idle(self, seconds: float) -> None:
        """Let the engine idle for ``seconds`` (virtual time), emptying its cache if it is due."""
        self.t += seconds
        self._idle_s += seconds
        if 0 < self.empty_cache_interval_s <= self._idle_s and self.model.empty_allocator_cache(self.t):
            self._idle_s = 0.0

    async def warm(self, probe: Probe, seq: int) -> str | None:
        self._idle_s = 0.0
        return self._run({f"warm-{seq}": probe.cached_tokens}, f"calibrate-{seq}", None, 1)

    async def info(self) -> EngineInfo:
        p = self.model.profile
        live = self.model.live_gauges()
        return EngineInfo(
            p.chunked_prefill_size,
            p.context_length,
            live.num_running_reqs,
            live.num_queue_reqs,
            live.pending_prefill_tokens,
        )

    async def send(self, probe: Probe, seq: int, warmed: bool = False) -> str | None:
        m = self.model
        self._idle_s = 0.0
        key = f"calibrate-{seq}" if probe.cached_tokens else None
        if key is not None and not warmed:
            err = self._run({f"warm-{seq}": probe.cached_tokens}, key, None, 1)
            if err is not None:
                return err
        rids = {f"probe-{seq}-{i}": probe.prompt_tokens for i in range(probe.concurrent)}
        return (
            self._run(rids, key, probe.cached_tokens or None, probe.max_new_tokens) if m.up else "engine down"
        )

    def _run(self, rids: dict[str, int], key: str | None, cached: int | None, max_new: int) -> str | None:
        m = self.model
        for rid, tokens in rids.items():
            m.submit(
                rid, tokens, max_new_tokens=max_new, now=self.t, prefix_key=key, cached_tokens_hint=cached
            )
        left = set(rids)
        while left:
            nxt = m.next_event_time()
            if nxt is None:
                return "the engine went idle with probe requests unanswered"
            self.t = max(self.t, nxt)
            for ev in m.advance(self.t):
                if isinstance(ev, Crashed):
                    return f"engine crashed: {ev.reason}"
                if isinstance(ev, Failed) and ev.rid in left:
                    return f"{ev.rid} failed: {ev.reason}"
                if isinstance(ev, Finished):
                    left.discard(ev.rid)
        return None

    async def held_bytes(self) -> int:
        m = self.model
        return m.total_bytes - m.free_bytes(self.t) - (m.other_process_bytes or 0)

    async def free_bytes(self) -> int:
        return self.model.free_bytes(self.t)


def true_coefficients(profile: LaneProfile) -> Coefficients:
    """A profile's transients in the cost model's terms: what a perfect calibration would find.

    An uncapped gather grows exactly like the per-context-token temporaries, so no measurement can
    tell the two apart: they are one coefficient (their sum) here, as in a fitted policy.
    """
    p = profile
    capped = p.gather_cap_bytes is not None
    return Coefficients(
        fixed_bytes=0.0,
        activation_bytes_per_chunk_token=float(p.activation_bytes_per_token),
        context_bytes_per_token=float(
            p.context_bytes_per_token + (0 if capped else p.gather_bytes_per_token)
        ),
        chunk_context_bytes=0.0,
        gather_bytes_per_context_token=float(p.gather_bytes_per_token if capped else 0),
        gather_cap_bytes=float(p.gather_cap_bytes) if capped else None,
        batch_join_bytes=float(p.unknown_extra_bytes),
        batch_join_bytes_per_running_request=0.0,
    )


def calibrate_on_model(
    profile: LaneProfile,
    policy_text: str,
    *,
    start: Coefficients | None = None,
    seed: int = 0,
    safety: float = 0.05,
    command: str = "calibrate on the emulator (sidecar_emulator.probe_lane.calibrate_on_model)",
) -> tuple[str | None, ProbeRun, Fit | str]:
    """Run ``calibrate`` against a fresh engine model of ``profile``, starting from the policy's
    coefficients (or ``start``); the proposed policy's text, or None when nothing is proposed."""
    policy = load_policy_text(policy_text).policy
    lane = ModelLane(EngineModel(profile, seed))
    probes = plan_probes(profile.chunked_prefill_size, profile.context_length)
    bounds = Bounds(reserve_bytes=int(policy.vram.reserve_bytes))
    run = asyncio.run(run_probes(lane, lane, probes, start or Coefficients.of(policy.cost), bounds))
    result = fit(run, safety=safety) if run.refused is None else run.refused
    if isinstance(result, str):
        return None, run, result
    facts = LaneFacts(
        context_len=profile.context_length,
        chunked_prefill_size=profile.chunked_prefill_size,
        kv_pool_tokens=profile.kv_pool_tokens,
        max_running_requests=profile.effective_max_running_requests,
        mamba_slots=profile.mamba_slots or None,
        model=profile.served_model_name,
        mem_fraction_static=profile.mem_fraction_static,
        gpu=f"emulated {profile.name}",
        gpu_total_bytes=profile.device_total_bytes,
    )
    text = proposal_text(policy_text, result, run, command, facts=facts, name=policy.name, safety=safety)
    return text, run, result


def perturbed(profile: LaneProfile, *, scale: float = 1.0, noise: float = 0.0) -> LaneProfile:
    """The same lane whose transients and batch join are ``scale`` times larger, with relative noise:
    a new build or model the policy was not calibrated for."""
    p = profile

    def up(x: int) -> int:
        return int(x * scale)

    return p.replace(
        name=f"{p.name}-x{scale:g}-noise{noise:g}",
        activation_bytes_per_token=up(p.activation_bytes_per_token),
        context_bytes_per_token=up(p.context_bytes_per_token),
        gather_bytes_per_token=up(p.gather_bytes_per_token),
        gather_cap_bytes=None if p.gather_cap_bytes is None else up(p.gather_cap_bytes),
        unknown_extra_bytes=up(p.unknown_extra_bytes),
        transient_noise=noise,
    )
