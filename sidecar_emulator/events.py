"""What the engine model reports: events from ``advance()`` and the snapshots it publishes.

Events are plain frozen values with the engine time ``t`` at which they happened. Every request ends in
exactly one of :class:`Finished` or :class:`Failed` (or the caller's own ``abort``), so a driver can
account for each one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FirstToken:
    """Prefill finished and produced the first output token."""

    rid: str
    t: float
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Tokens:
    """``count`` more output tokens since the last report; ``completion_tokens`` is the running total."""

    rid: str
    t: float
    count: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Finished:
    rid: str
    t: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str  # "length": the emulator has no EOS, requests run to max_new_tokens
    retractions: int


@dataclass(frozen=True, slots=True)
class Failed:
    """The request ended without finishing.

    ``status`` is the HTTP status SGLang would send (400 invalid, 503 retracted too often), or ``None``
    when the engine died or was down: the client sees a dropped or refused connection, not a status.
    """

    rid: str
    t: float
    reason: str
    status: int | None


@dataclass(frozen=True, slots=True)
class Retracted:
    """KV ran out during decode; the request went back to the waiting queue (SGLang ``retract_decode``)."""

    rid: str
    t: float
    retractions: int


@dataclass(frozen=True, slots=True)
class Crashed:
    """The scheduler died. ``requested_bytes``/``free_bytes`` are set for an out-of-memory crash."""

    t: float
    reason: str
    requested_bytes: int | None
    free_bytes: int | None
    failed_rids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Restarted:
    """The engine is serving again, with an empty cache and fresh metrics."""

    t: float


Event = FirstToken | Tokens | Finished | Failed | Retracted | Crashed | Restarted


@dataclass(frozen=True, slots=True)
class Gauges:
    """Scheduler gauges as SGLang 0.5.23 computes them (``sglang:*`` on ``/metrics``).

    ``token_usage`` is ``round(max(full, swa, mamba), 2)``; the per-pool usages are unrounded and count
    radix-cached (evictable) entries as free. Mamba "tokens" are state slots.
    """

    t: float
    num_running_reqs: int
    num_queue_reqs: int
    token_usage: float
    full_token_usage: float
    mamba_usage: float
    num_used_tokens: int
    kv_available_tokens: int
    kv_evictable_tokens: int
    kv_used_tokens: int
    mamba_available_tokens: int
    mamba_evictable_tokens: int
    mamba_used_tokens: int
    gen_throughput: float
    cache_hit_rate: float
    decode_sum_seq_lens: int
    new_token_ratio: float
    num_retracted_reqs: int
    # Not a /metrics gauge: SGLang's "#pending-token" (waiting input + rest of the chunked request).
    pending_prefill_tokens: int


@dataclass(frozen=True, slots=True)
class LoadsSnapshot:
    """One ``/v1/loads`` entry (dp_rank 0), published on SGLang's own, faster cadence."""

    t: float
    num_running_reqs: int
    num_waiting_reqs: int
    num_waiting_uncached_tokens: int
    num_used_tokens: int
    max_total_num_tokens: int
    max_running_requests: int
    kv_token_usage: float  # excludes Mamba, unlike sglang:token_usage
    gen_throughput: float
    cache_hit_rate: float
    total_prefill_uncached_tokens: int
    total_prefill_busy_us: int
    num_retracted_waiting: int


@dataclass(frozen=True, slots=True)
class CrashInfo:
    """What the engine looked like when it died (live values, not the lagging gauges)."""

    t: float
    reason: str
    requested_bytes: int | None
    free_bytes: int | None
    live: Gauges
