"""What the sidecar would read from the engine model, without going through HTTP.

``replay`` runs hours of traffic in seconds, so it cannot render and parse ``/metrics`` text on every
poll. These functions give the same :class:`EngineSignals` the live scraper builds from the emulator's
``/metrics``, ``/v1/loads`` and ``/server_info`` (a test holds the two paths equal): the published,
lagging gauges, never the model's live state.
"""

from __future__ import annotations

from sidecar.core.snapshot import DeviceMemory, EngineSignals, GpuSignals
from sidecar_emulator.engine import BASE_VERSION, EngineModel
from sidecar_emulator.exposition import BASE_PID

SGLANG_VERSION = BASE_VERSION


def engine_signals(model: EngineModel, now: float) -> EngineSignals:
    """The engine as its endpoints describe it at ``now`` (``/v1/loads`` wins over ``/metrics``)."""
    p = model.profile
    g = model.published_gauges()
    loads = model.loads_snapshot()
    hybrid = p.mamba_slots > 0
    fields: dict[str, object] = {}
    if g is not None:
        fields.update(
            running_requests=g.num_running_reqs,
            queue_requests=g.num_queue_reqs,
            full_token_usage=g.full_token_usage,
            kv_used_tokens=g.kv_used_tokens,
            kv_available_tokens=g.kv_available_tokens,
            kv_evictable_tokens=g.kv_evictable_tokens,
            # The scheduler's pid label, published with the load gauges (``exposition``).
            pids=(str(BASE_PID + model.restarts),),
        )
        if hybrid:
            fields.update(
                mamba_usage=g.mamba_usage,
                mamba_used_slots=g.mamba_used_tokens,
                mamba_available_slots=g.mamba_available_tokens,
                mamba_evictable_slots=g.mamba_evictable_tokens,
            )
    fields.update(
        running_requests=loads.num_running_reqs,
        queue_requests=loads.num_waiting_reqs,
        pending_prefill_tokens=loads.num_waiting_uncached_tokens,
        max_running_requests=loads.max_running_requests,
        # Counters are live in SGLang (grown per prefill batch), not published with the gauges.
        prefill_computed_tokens=model.counters.prefill_compute_tokens,
        prefill_cached_tokens=model.counters.prefill_cache_tokens,
        prefill_counted_at=now,
    )
    return EngineSignals(
        observed_at=now,
        max_total_tokens=p.kv_pool_tokens,
        chunked_prefill_size=p.chunked_prefill_size,
        context_len=p.context_length,
        gpus=1,  # server_info's tp_size x pp_size (exposition.py)
        version=model.version,
        sources=("metrics", "loads", "server_info"),
        **fields,  # type: ignore[arg-type]
    )


def gpu_signals(model: EngineModel, now: float, ident: str = "GPU-emulated") -> GpuSignals:
    """One device per GPU of the engine (per rank under tensor parallelism: ``ident-<rank>``)."""
    readings = model.device_readings(now)
    if len(readings) == 1:
        free, total, other = readings[0]
        return GpuSignals(now, "emulator", (DeviceMemory(ident, free, total, other),))
    devices = tuple(DeviceMemory(f"{ident}-{i}", f, t, o) for i, (f, t, o) in enumerate(readings))
    return GpuSignals(now, "emulator", devices)
