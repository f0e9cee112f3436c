"""What the sidecar knows about the engine and the GPU at one instant.

These are plain frozen values: pollers build a new one per successful read and swap it in with a
single assignment, so the request path reads a consistent snapshot without locks or awaits.

Every field that the source did not report is ``None``. Never substitute 0 for "unknown": a missing
queue gauge on a fresh SGLang server (no load gauges for its first 30 s) is not an empty queue.
Timestamps are monotonic seconds (``time.monotonic()`` or the injected clock), so ages survive
wall-clock jumps.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class EngineSignals:
    """The engine's last-reported state, merged from /metrics, /v1/loads and /server_info.

    SGLang writes its gauges at batch boundaries (every prefill batch, every 40 decode steps), so
    even a fresh scrape reports a value that may be seconds old; ``observed_at`` is when *we* read it.
    """

    observed_at: float
    running_requests: int | None = None
    queue_requests: int | None = None
    # Per pool, never the combined `sglang:token_usage` (max of the pools since 0.5.14).
    full_token_usage: float | None = None
    swa_token_usage: float | None = None
    mamba_usage: float | None = None
    # Absolute full-attention KV slots (0.5.14+); `max_total_tokens` is the pool capacity.
    kv_used_tokens: int | None = None
    kv_available_tokens: int | None = None
    kv_evictable_tokens: int | None = None
    max_total_tokens: int | None = None
    # Mamba state slots (unit: request states, not tokens), 0.5.14+.
    mamba_used_slots: int | None = None
    mamba_available_slots: int | None = None
    mamba_evictable_slots: int | None = None
    # Prefill tokens waiting in the engine: /v1/loads `num_waiting_uncached_tokens` (0.5.9+).
    pending_prefill_tokens: int | None = None
    # Prompt tokens the engine has computed since it started (`sglang:realtime_tokens_total{mode=
    # "prefill_compute"}`, per prefill batch): the in-flight prefills' progress (``core/overrun.py``).
    prefill_computed_tokens: int | None = None
    # ... and those it took from its prefix cache (`mode="prefill_cache"`): bounds a prefill's hit.
    prefill_cached_tokens: int | None = None
    # When the request that read those counters was sent (``observed_at`` is when the poll ended): they
    # are no older than this, and a reading taken since may show batches they do not count.
    prefill_counted_at: float | None = None
    # Lane constants, from /server_info or /v1/loads.
    chunked_prefill_size: int | None = None
    max_running_requests: int | None = None
    context_len: int | None = None
    # GPUs the engine runs on: /server_info's tp_size x pp_size (``core/facts.py`` compares it with the
    # devices the GPU source reads).
    gpus: int | None = None
    version: str | None = None
    # The scheduler pids its /metrics named (``pid`` labels, sorted): which process answered. Empty on
    # a fresh server before it publishes its load gauges; a process that published them keeps them.
    pids: tuple[str, ...] = ()
    # Which endpoints contributed, e.g. ("metrics", "loads", "server_info").
    sources: tuple[str, ...] = ()

    @property
    def mamba_total_slots(self) -> int | None:
        # Read on every gated request (twice): plain tests, no generator per call.
        used, available = self.mamba_used_slots, self.mamba_available_slots
        if used is None or available is None:
            return None
        return used + available + (self.mamba_evictable_slots or 0)


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One GPU's memory, in bytes. ``ident`` is the NVML UUID, a DCGM label, or the file path.

    ``other_process_bytes``: what processes other than the engine hold on this device (NVML: every
    compute process but the largest), or None where the source cannot tell (dcgm, plain files).
    """

    ident: str
    free_bytes: int
    total_bytes: int
    other_process_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class GpuSignals:
    """Free memory over the engine's devices. Headroom is the minimum: one full GPU stops a TP group."""

    observed_at: float
    source: str
    devices: tuple[DeviceMemory, ...] = field(default_factory=tuple)
    # The least free over the devices (None without any): read by every decision, so taken once per
    # reading, not per request (issue #27).
    free_bytes: int | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "free_bytes", min((d.free_bytes for d in self.devices), default=None))

    @property
    def total_bytes(self) -> int | None:
        """Capacity of the device with the least free memory (the one that decides)."""
        if not self.devices:
            return None
        return min(self.devices, key=lambda d: d.free_bytes).total_bytes

    @property
    def other_process_bytes(self) -> int | None:
        """The most any device's other processes hold (None when no device can tell)."""
        known = [d.other_process_bytes for d in self.devices if d.other_process_bytes is not None]
        return max(known, default=None)


@dataclass(frozen=True, slots=True)
class SourceHealth:
    """How the last reads of one signal went: the gate distinguishes stale from unreachable."""

    last_ok_at: float | None = None
    last_error: str | None = None
    consecutive_failures: int = 0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the decision reads about the outside world. ``None`` means never read."""

    engine: EngineSignals | None = None
    gpu: GpuSignals | None = None
    engine_health: SourceHealth = SourceHealth()
    gpu_health: SourceHealth = SourceHealth()
    # When the shell last saw a new engine process (None: never). A GPU reading older than it saw the
    # old process (its memory released, or not yet allocated): the decision waits for a newer one.
    engine_restarted_at: float | None = None

    def engine_age(self, now: float) -> float | None:
        return None if self.engine is None else max(0.0, now - self.engine.observed_at)

    def gpu_age(self, now: float) -> float | None:
        return None if self.gpu is None else max(0.0, now - self.gpu.observed_at)
