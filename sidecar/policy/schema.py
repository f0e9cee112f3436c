"""Lane policies: which signals the gate reads, which limits it enforces, what it does when blind.

A policy is a YAML file validated by the models below (unknown keys are errors, so a typo never
silently disables a limit). Sizes accept plain bytes or binary units (``560MiB``, ``1.5GiB``); decimal
units (``560MB``) are refused because NVML, nvidia-smi and the incident figures all count in MiB, and an
SRE who writes "MB" almost always means MiB: a silent 5 % difference in a reserve is how a lane dies.
Errors name the file, the line and the field, because the person reading them is on call.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from sidecar.core.decision import Action
from sidecar.core.rules import ExceedAction, HeadroomSource
from sidecar.policy.engine_routes import CONTROL, DEFAULT_GATEWAY_FIELDS, LATEST, PREFILL_ROUTES
from sidecar.policy.priority import PriorityBounds
from sidecar.policy.yamlfile import ConfigError, load_model, read_text

_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)")
_DECIMAL = {"k", "kb", "m", "mb", "g", "gb"}


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as ``560MiB``; refuses negatives and decimal units, saying why."""
    if isinstance(value, bool):
        raise ValueError(f"a size must be bytes or a string such as 560MiB, got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value:g}")
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"a size in bytes must be a whole number, got {value:g}")
        return int(value)
    if not isinstance(value, str):
        got = (
            "nothing (an empty value)"
            if value is None
            else f"a {'list' if isinstance(value, list) else 'mapping' if isinstance(value, dict) else 'value of another kind'}"
        )
        raise ValueError(f"a size must be bytes or a string such as 560MiB, got {got}")
    text = value.strip()
    if text.startswith("-"):
        raise ValueError(f"a size cannot be negative, got {value!r}")
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"not a size: {value!r} (write plain bytes, or a number with KiB, MiB or GiB)")
    number, unit = m.groups()
    if unit not in _UNITS:
        prefix = unit[:1].upper()
        if unit.lower() in _DECIMAL and prefix in "KMG":
            raise ValueError(
                f"{value!r}: decimal units ({unit}) are not accepted: sizes are binary, as NVML and "
                f"nvidia-smi count them; write {number}{prefix}iB or plain bytes (units: KiB, MiB, GiB)"
            )
        raise ValueError(f"{value!r}: unknown unit {unit!r}; write plain bytes, or KiB, MiB or GiB")
    if _UNITS[unit] == 1 and "." in number:
        raise ValueError(f"a size in bytes must be a whole number, got {value!r}")
    return int(float(number) * _UNITS[unit])


# Bytes: an int, or a string with a binary unit. Never negative, never a decimal unit.
Size = Annotated[int, BeforeValidator(parse_size)]


def format_size(n: float | None) -> str:
    """Bytes as an SRE reads them: MiB with thousands separators (GiB from 10 GiB up)."""
    if n is None:
        return "unknown"
    if abs(n) >= 10 * (1 << 30):
        return f"{n / (1 << 30):,.1f} GiB"
    return f"{n / (1 << 20):,.0f} MiB"


_MAX_FIGURE = 2**63 - 1


class _Strict(BaseModel):
    # allow_inf_nan=False: `margin: .inf` validated (ge=1) and then overflowed every projection (a 500
    # per request); no figure in a policy is infinite.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _not_astronomical(cls, v: object) -> object:
        # A YAML integer has no bound: `context_len: 1` followed by 400 zeros validated, then every
        # projection (float arithmetic) raised OverflowError. No figure of a lane needs more than int64.
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > _MAX_FIGURE:
            raise ValueError(
                f"a {len(str(abs(v)))}-digit number is beyond any figure a policy can need "
                f"(at most {_MAX_FIGURE:,})"
            )
        return v


class Lane(_Strict):
    """Constants of the lane. The engine's own reports win when present; these are the fallback."""

    context_len: int = Field(gt=0)
    kv_pool_tokens: int | None = Field(default=None, gt=0)
    mamba_slots: int | None = Field(default=None, gt=0)
    chunked_prefill_size: int = Field(gt=0)
    max_running_requests: int | None = Field(default=None, gt=0)


class Prompt(_Strict):
    """How prompt tokens are counted; these are ``tokens.CounterConfig``'s fields (its docstring says
    why each default is an upper bound), so a policy can tune every one of them."""

    tokenizer_path: str | None = None
    # No tokenizer_path: the tokenizer.json of the model /server_info reports, when readable here.
    tokenizer_from_engine: bool = True
    # Opt-in: the engine's /tokenize costs it a second tokenizer pass per text prompt.
    use_engine_tokenize: bool = False
    bytes_per_token: float = Field(default=2.5, gt=0)
    chat_overhead_tokens_per_message: int = Field(default=8, ge=0)
    # Qwen2.5's default system prompt (~20 tokens) plus the generation prompt, with room to spare.
    chat_overhead_tokens_fixed: int = Field(default=64, ge=0)
    chat_overhead_tokens_tools: int = Field(default=256, ge=0)
    tokens_per_media_item: int = Field(default=16_384, ge=0)
    engine_tokenize_timeout_s: float = Field(default=10.0, gt=0)


# Term shapes per architecture and build, filled in for the fields a policy leaves out. The numbers are
# the Qwen3-Next family's (docs/evidence.md); a calibrated policy states every coefficient itself.
COST_PRESETS: dict[str, dict[str, object]] = {
    # Full-context prefill gather that grows with the whole request (the outage build).
    "old_gather": {
        "activation_bytes_per_chunk_token": 12 * 1024,
        "context_bytes_per_token": 2735,
        "gather_bytes_per_context_token": 2048,
        "gather_cap_bytes": None,
        "batch_join_bytes": 1248 * 1024 * 1024,
    },
    # The same gather bounded at 32 MiB (the validation build).
    "bounded_gather": {
        "activation_bytes_per_chunk_token": 12 * 1024,
        "context_bytes_per_token": 2735,
        "gather_bytes_per_context_token": 2048,
        "gather_cap_bytes": 32 * 1024 * 1024,
        "batch_join_bytes": 1248 * 1024 * 1024,
    },
    # A sparse-attention indexer's [chunk rows x context] buffer outside the static fraction (about
    # 6 bytes per chunk token per context token); the other terms must still be measured.
    "indexer": {
        "activation_bytes_per_chunk_token": 12 * 1024,
        "chunk_context_bytes": 6.0,
    },
}


class Cost(_Strict):
    """Bytes a request allocates outside the KV pool, term by term (each optional).

    Prefill transient, held until the first token:
    ``(fixed + per_chunk_token * n + per_context_token * x + chunk_context * n * x
    + min(gather_per_context_token * x, gather_cap)) * margin`` with ``n = min(uncached, chunk)`` (chunked
    prefill: a bigger prompt is more chunks, not a bigger chunk) and ``x`` the whole prompt (the last
    chunk attends over the request, cached prefix included). Batch join, held while the request runs
    (first token to end): ``(batch_join + per_running_request * running) * margin`` once two or more
    requests run together. ``preset`` fills the fields left out (``COST_PRESETS``).
    """

    preset: str | None = None
    fixed_bytes: Size = 0
    activation_bytes_per_chunk_token: Size
    context_bytes_per_token: Size = 0
    # Bytes per chunk token per context token: a [chunk_rows, context] buffer (indexer-style).
    chunk_context_bytes: float = Field(default=0.0, ge=0)
    gather_bytes_per_context_token: Size = 0
    gather_cap_bytes: Size | None = None
    # Input-token logprobs (/generate ``return_logprob`` with ``logprob_start_len`` >= 0): SGLang computes
    # fp32 logits over the vocabulary for every such prompt token of a chunk and log-softmaxes a copy, 8
    # bytes per vocabulary entry per token (evidence B3). The default is the Qwen3 family's vocabulary
    # of 151,936 (8 x 151,936 B); set 8 x your model's vocabulary size.
    logprob_bytes_per_token: Size = 8 * 151_936
    # What the running batch allocates when a request joins it (SGLang merges a finished prefill into
    # the decode batch); a function of the running batch size.
    # None: never measured (counts as 0, and calibrate probes for it); 0: measured, nothing seen.
    batch_join_bytes: Size | None = None
    batch_join_bytes_per_running_request: Size = 0
    # How long after a streamed first token the join is taken to be done when no admitted prefill is
    # ahead of it (new prefills wait that long). 0: at once, as on SGLang, whose scheduler launches
    # the next batch before it sends the last one's tokens (evidence S25); an engine that sends first
    # tokens before it schedules its next step needs one decode step here.
    join_settle_s: float = Field(default=0.0, ge=0, le=5)
    margin: float = Field(default=1.0, ge=1.0)
    # What the calibration's observations reached against the fit: max(1, the worst observed/predicted
    # ratio, 1 + 3 standard deviations of the ratios); ``margin`` is this times (1 + safety). Set, the
    # monitor counts a GPU reading above the fit times this ratio (not only one above the projection,
    # margin included), so a lane that allocates more than it did when calibrated is seen while the
    # safety still covers it, before a prompt admitted at the edge of the margin draws past it
    # (evidence D18). None: a reading counts only above the projection.
    calibrated_ratio: float | None = Field(default=None, ge=1.0)
    # The longest probe of the calibration these coefficients come from: beyond it they are an
    # extrapolation (shown by check-policy and /admission/state). None: not calibrated.
    calibrated_up_to_prompt_tokens: int | None = Field(default=None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: object) -> object:
        if not isinstance(data, dict) or data.get("preset") is None:
            return data
        name = data["preset"]
        if name not in COST_PRESETS:
            raise ValueError(f"unknown cost preset {name!r}; known: {', '.join(COST_PRESETS)}")
        return {**COST_PRESETS[name], **data}


# ``vram.idle_free_bytes: auto``: the sidecar measures the figure itself.
AUTO = "auto"


def _size_or_auto(value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        return parse_size(value)
    except ValueError as e:
        raise ValueError(f"{e}; or auto, to let the sidecar measure it") from None


IdleFreeSize = Annotated[int | Literal["auto"], BeforeValidator(_size_or_auto)]


class Vram(_Strict):
    """Free VRAM against what prefills will allocate (``HeadroomSource`` says which free memory)."""

    headroom: HeadroomSource = HeadroomSource.NVML_FREE
    # NVML free with the engine idle and warmed up (CUDA graphs captured), measured on the lane; or
    # ``auto``: measured by the sidecar itself (``sidecar/admission/lane_watch.py: IdleFree``), again after every
    # engine restart; until it is measured the headroom is live GPU free memory (``nvml_free``).
    idle_free_bytes: IdleFreeSize | None = None
    # What other processes held on the card when idle_free_bytes was measured; growth beyond it comes
    # out of the budget (idle_budget mode, GPU sources that report per-process memory).
    other_processes_bytes: Size | None = None
    reserve_bytes: Size = 0
    # The most a transient can ever get on this lane when idle; larger requests are unfit. Defaults to
    # idle_free_bytes - reserve_bytes when that is known.
    max_transient_bytes: Size | None = None
    on_exceed: ExceedAction = ExceedAction.HOLD

    @model_validator(mode="after")
    def _budget_needs_figure(self) -> Vram:
        if self.headroom is HeadroomSource.IDLE_BUDGET and self.idle_free_bytes is None:
            raise ValueError(
                "headroom: idle_budget needs idle_free_bytes (NVML free, engine idle and warm, or auto)"
            )
        return self

    @property
    def idle_free_auto(self) -> bool:
        return self.idle_free_bytes == AUTO

    @property
    def idle_free_figure(self) -> int | None:
        """The policy's own figure (None when it gives none or says ``auto``)."""
        return self.idle_free_bytes if isinstance(self.idle_free_bytes, int) else None


class Monitor(_Strict):
    """The live under-prediction monitor (``sidecar/admission/lane_watch.py``): GPU memory against the ledger.

    Always on, in shadow and enforce: an allocation larger than the ledger's projection for what was
    running is counted and logged. With ``raise_margin`` the cost margin in force rises to cover it
    (observed / projected x margin, or the readings' upper bound on it, times 1 + ``safety``, at
    least plus ``step``; nothing while that bound is within the margin in force), never above
    ``max_margin``, nor so far that a prompt this engine has served becomes unfit; a policy reload
    starts again from the policy's own margin (a crash's margin stays: docs/robustness.md). An allocation within ``tolerance`` (relative) of the projection
    or smaller than ``min_bytes`` over it is allocator rounding, not a finding. With
    ``cost.calibrated_ratio`` the projection it is compared with is the fit times that ratio, without
    the margin's safety on top (``Cost`` says why).
    """

    raise_margin: bool = True
    max_margin: float = Field(default=1.5, ge=1.0)
    # The new margin is the ratio the reading showed times (1 + safety): proportional to what was seen
    # (``lane_watch.raised_margin``). ``step``, when set, is the least it adds on top of that ratio.
    safety: float = Field(default=0.05, ge=0.0, le=1.0)
    step: float = Field(default=0.0, ge=0.0, le=1.0)
    tolerance: float = Field(default=0.02, ge=0.0, le=1.0)
    min_bytes: Size = 32 * 1024 * 1024
    # The engine allocator's granularity: an excess under this per request in a reading is rounding,
    # whatever ``min_bytes`` says (``lane_watch.excess``). PyTorch's caching allocator, so SGLang's,
    # rounds every large block up to 2 MiB (evidence R1); 0 only for an engine that allocates exactly.
    allocator_block_bytes: Size = 2 * 1024 * 1024


class Guard(_Strict):
    """The in-flight prefill guard (``sidecar/core/overrun.py``): when the rules tighten (the monitor
    raised the margin) or the room shrinks (another process on the card grew), every admitted request
    still prefilling is priced again, and one that no longer fits is aborted before its peak chunk,
    with a 503 ``prefill_overrun``, instead of killing the engine and everything in it. Enforce mode
    only (shadow never aborts). ``enabled: false`` turns it off (the lane then relies on the margin
    and the reserve alone, as before it existed)."""

    enabled: bool = True


class Experimental(_Strict):
    """Rules whose only evidence is that they win seeds of the emulator's benchmark; off by default
    (docs/evidence.md, rows G, says what each buys there). ``own_schedule_pricing``: a request that
    starts its own prefill batch is priced by its own chunk schedule (needs the in-flight guard and the
    engine's prefill counters). ``gpu_reading_after_wait``: a held request is admitted only on a GPU
    reading taken after its wait began."""

    own_schedule_pricing: bool = False
    gpu_reading_after_wait: bool = False


class Kv(_Strict):
    reserve_tokens: int = Field(default=0, ge=0)
    max_usage: float = Field(default=1.0, gt=0, le=1.0)
    count_evictable_as_free: bool = True
    # Fraction of max_new_tokens to reserve for decode on top of the uncached prompt.
    decode_reserve_fraction: float = Field(default=0.0, ge=0, le=1.0)
    on_exceed: ExceedAction = ExceedAction.HOLD


class Mamba(_Strict):
    """Mamba state slots: a pool separate from KV tokens, which ran out first on lane 2."""

    slots_per_request: int = Field(default=1, ge=1)
    # Chunked prefill keeps a state checkpoint every this many prompt tokens, locked while the request
    # is in flight; unset when the build keeps only the latest one.
    checkpoint_interval_tokens: int | None = Field(default=None, gt=0)
    reserve_slots: int = Field(default=0, ge=0)
    max_usage: float = Field(default=1.0, gt=0, le=1.0)
    on_exceed: ExceedAction = ExceedAction.HOLD


class EngineQueue(_Strict):
    """Requests forwarded whose prefill has not finished: in the engine's waiting queue, or prefilling.

    A request inside SGLang's queue is beyond the gate's reach; keeping this small keeps the rest in
    the sidecar's queue, where they can still be ordered, timed out or rejected.
    """

    max_requests: int = Field(ge=1)
    on_exceed: ExceedAction = ExceedAction.HOLD


class PendingPrefill(_Strict):
    """Prefill tokens forwarded but not yet prefilled. A request alone is never held by this limit."""

    max_tokens: int = Field(gt=0)
    on_exceed: ExceedAction = ExceedAction.HOLD


class SignalPolicy(_Strict):
    poll_interval_s: float = Field(gt=0)
    max_age_s: float = Field(gt=0)
    # hold, reject or admit: there is no silent default.
    on_stale: Action
    # After this many failed reads in a row the engine is reported unavailable, not just stale.
    unavailable_after_failures: int = Field(default=3, ge=1)

    @model_validator(mode="after")
    def _poll_faster_than_staleness(self) -> SignalPolicy:
        if self.poll_interval_s >= self.max_age_s:
            raise ValueError(
                f"poll_interval_s ({self.poll_interval_s}) must be below max_age_s ({self.max_age_s}), "
                "or every read would already be stale"
            )
        return self


class Engine(SignalPolicy):
    # A /metrics page over this is a failed scrape, not an unbounded read: SGLang's is ~50 KB per
    # scheduler (8 DP ranks with every scheduler's metrics: well under 4 MiB).
    max_metrics_bytes: Size = Field(default=8 * 1024 * 1024, gt=0)
    # For one poll interval after an admitted request ends while requests are held, the engine and the
    # GPU are read this often instead (0: only every poll_interval_s): SGLang publishes the room the
    # request left at its next report, and a held request goes in at the first read that shows it.
    poll_after_release_s: float = Field(default=0.05, ge=0)


class Gpu(SignalPolicy):
    # false: run without a GPU source (the VRAM constraint is off, and /admission/state says so).
    required: bool = True


class Hold(_Strict):
    max_held: int = Field(ge=0)
    max_wait_s: float = Field(gt=0)
    # false: strict order; a request never overtakes an earlier one of equal or higher priority.
    backfill: bool = False
    # SGLang's default: larger `priority` values are served first.
    low_priority_values_first: bool = False
    retry_after_min_s: int = Field(default=1, ge=1)
    retry_after_max_s: int = Field(default=60, ge=1)
    # Used only to derive Retry-After from the tokens ahead; calibrate from the lane's own throughput.
    prefill_tokens_per_s: float = Field(default=20000.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> Hold:
        if self.retry_after_min_s > self.retry_after_max_s:
            raise ValueError("retry_after_min_s must not exceed retry_after_max_s")
        return self


class Priority(_Strict):
    """Bounds on the client-set ``priority`` (sidecar/policy/priority.py says why). Either a range that what
    clients say is clamped into, or ``classes`` mapped from ``class_header``, a header set by a gateway
    the operator trusts (client claims are then ignored). ``default``: a request that says nothing or
    has no known class."""

    min: int = 0
    max: int = 0
    default: int = 0
    class_header: str | None = Field(default=None, min_length=1)
    classes: dict[str, int] = {}

    @model_validator(mode="after")
    def _consistent(self) -> Priority:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        if self.class_header is None and not self.min <= self.default <= self.max:
            raise ValueError(f"default ({self.default}) must lie within min..max ({self.min}..{self.max})")
        if bool(self.classes) != (self.class_header is not None):
            raise ValueError("class_header and classes go together: name the header and map its values")
        return self

    @cached_property
    def bounds(self) -> PriorityBounds:
        """Built once per loaded policy, read per request."""
        return PriorityBounds(
            self.min,
            self.max,
            self.default,
            self.class_header.lower() if self.class_header else None,
            dict(self.classes),
        )


class Routes(_Strict):
    """Which of SGLang's control routes (``sidecar/policy/engine_routes.py: CONTROL``) the data port
    forwards. None by default: they answer 403 there, and the admin port relays them with the admin
    token. Name a route to open it to every client of the data port (a trusted lane, a tool that must)."""

    open: tuple[str, ...] = ()

    @field_validator("open")
    @classmethod
    def _known(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            if name not in CONTROL:
                raise ValueError(
                    f"{name!r} is not one of SGLang's control routes; they are: " + ", ".join(sorted(CONTROL))
                )
        return v


class GatewayFields(_Strict):
    """Body fields only a trusted gateway may set (``sidecar/intake/gateway.py`` says why each).

    ``on_client``: what a request that sets one gets: ``refuse`` (400 naming the field), ``strip``
    (removed, the rest forwarded) or ``pass`` (a disaggregated lane behind a router that sets them).
    ``rid``: ``unique`` refuses a request whose ``rid`` is already in flight through this sidecar
    (400 ``rid_in_flight``: a second request under one rid would share, or take over, the first's
    state in the engine); ``pass`` forwards it as sent.
    """

    names: tuple[str, ...] = DEFAULT_GATEWAY_FIELDS
    on_client: Literal["refuse", "strip", "pass"] = "refuse"
    rid: Literal["unique", "pass"] = "unique"


class Limits(_Strict):
    # A 524,288-token prompt is several MB of text; JSON escaping can double it.
    max_body_bytes: Size = 32 * 1024 * 1024
    # Sequences one request may ask for (prompts of a batch x `n` / `best_of`): more is unfit_request.
    # 256: twice the largest `n` OpenAI's API accepts (128); the engine-queue limit usually binds first.
    max_sequences_per_request: int = Field(default=256, ge=1)


# Every route that makes the engine prefill is gated whatever this lists (sidecar/policy/engine_routes.py); a policy
# adds paths here, e.g. for an engine mounted under a prefix.
# Reasons a rejection can carry besides unfit_request (which has two answers of its own, below).
AnsweredReason = Literal[
    "vram_headroom",
    "kv_pool",
    "mamba_slots",
    "engine_queue",
    "pending_prefill_tokens",
    "signals_stale",
    "queue_full",
    "hold_timeout",
    "engine_unavailable",
    "draining",
]
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
# Headers the sidecar writes itself; a policy may not override them with a fixed value.
_OWN_HEADERS = frozenset(
    [
        "content-type",
        "content-length",
        "retry-after",
        "x-should-retry",
        "x-request-id",
        "x-admission-decision",
        "x-admission-reason",
        "x-admission-wait-ms",
    ]
)


class Answer(_Strict):
    """What a rejected client is told: the status, whether ``Retry-After`` is sent, ``x-should-retry``
    (the header the official OpenAI SDKs obey before the status), and fixed extra headers."""

    status: int = Field(ge=400, le=599)
    retry_after: bool = True
    # true/false: send `x-should-retry` with that value; null: do not send it.
    should_retry: bool | None = None
    headers: dict[str, str] = Field(default_factory=dict)

    @field_validator("headers")
    @classmethod
    def _header_names(cls, v: dict[str, str]) -> dict[str, str]:
        for name, value in v.items():
            if not _HEADER_NAME.match(name):
                raise ValueError(f"{name!r} is not a valid HTTP header name")
            if name.lower() in _OWN_HEADERS:
                raise ValueError(f"{name} is written by the sidecar itself and cannot be set here")
            if not value.isprintable() or not value.isascii():
                raise ValueError(f"header {name}: value must be printable ASCII")
        return v


# Reasons that say the lane cannot serve at all now (its engine is gone, or the sidecar is stopping):
# a fault a router should count against the lane, unlike a refusal for lack of room.
UNAVAILABLE_REASONS = frozenset(["engine_unavailable", "draining"])


class Answers(_Strict):
    """Status and headers per rejection reason, chosen by what SGLang's model gateway (``smg``) does
    with them at its defaults (docs/routing.md has the measured table): a 4xx it does not retry is a
    success for its circuit breaker, 429 is retried on another worker and counted neither way, 5xx is
    retried and counted as a failure. So no admission answer ejects a healthy lane from its rotation.

    ``unfit_context``: prompt + max_new_tokens beyond the context (an exact count): SGLang answers 400,
    so do we, and the request never reaches the engine. ``unfit_lane``: larger than this lane can ever
    run (transient, KV pool, Mamba slots): 413, which no router or client retries. ``transient``: busy
    now, room may open (held too long, queue full, signals stale, ...): 429 with ``Retry-After``, which
    the gateway retries elsewhere. ``unavailable``: the engine is unreachable or the sidecar is
    draining: 503, a fault the breaker should count. ``reasons`` overrides any of them per reason.
    """

    unfit_context: Answer = Answer(status=400, retry_after=False, should_retry=False)
    unfit_lane: Answer = Answer(status=413, retry_after=False, should_retry=False)
    transient: Answer = Answer(status=429, retry_after=True, should_retry=True)
    unavailable: Answer = Answer(status=503, retry_after=True, should_retry=True)
    reasons: dict[AnsweredReason, Answer] = Field(default_factory=dict)

    def for_reason(self, reason: str) -> Answer:
        if reason in self.reasons:
            return self.reasons[reason]  # type: ignore[index]
        return self.unavailable if reason in UNAVAILABLE_REASONS else self.transient


DEFAULT_GATED_PATHS = tuple(r.path for r in PREFILL_ROUTES[LATEST])


class Policy(_Strict):
    name: str = Field(min_length=1)
    description: str = ""
    gated_paths: tuple[str, ...] = DEFAULT_GATED_PATHS
    lane: Lane
    prompt: Prompt = Prompt()
    cost: Cost
    vram: Vram = Vram()
    kv: Kv = Kv()
    mamba: Mamba | None = None
    engine_queue: EngineQueue
    pending_prefill: PendingPrefill
    engine: Engine
    gpu: Gpu
    hold: Hold
    limits: Limits = Limits()
    routes: Routes = Routes()
    gateway_fields: GatewayFields = GatewayFields()
    answers: Answers = Answers()
    priority: Priority = Priority()
    monitor: Monitor = Monitor()
    guard: Guard = Guard()
    experimental: Experimental = Experimental()

    def located_problems(self) -> list[tuple[tuple[str | int, ...], str]]:
        """Policies that validate field by field but contradict themselves, each at its field.

        Most make every request ``unfit_request``: the lane would answer nothing but 503s from the
        moment the policy is loaded, which is worse than refusing the policy. A calibrated ratio above
        the margin says the margin does not cover what its own calibration saw.
        """
        problems: list[tuple[tuple[str | int, ...], str]] = []
        c = self.cost
        if c.calibrated_ratio is not None and c.calibrated_ratio > c.margin:
            problems.append(
                (
                    ("cost", "calibrated_ratio"),
                    f"{c.calibrated_ratio:g} is above cost.margin ({c.margin:g}): the margin would not cover "
                    "what the calibration saw (calibrate writes margin = calibrated_ratio x (1 + safety))",
                )
            )
        v = self.vram
        if v.idle_free_figure is not None and v.reserve_bytes >= v.idle_free_figure:
            problems.append(
                (
                    ("vram", "reserve_bytes"),
                    f"{format_size(v.reserve_bytes)} is at or above idle_free_bytes "
                    f"({format_size(v.idle_free_bytes)}): no transient could ever fit, every request "
                    "would be rejected as unfit_request",
                )
            )
        if v.max_transient_bytes == 0:
            problems.append(
                (("vram", "max_transient_bytes"), "0 bytes: every request would be rejected as unfit_request")
            )
        pool = self.lane.kv_pool_tokens
        if pool is not None and self.kv.reserve_tokens >= pool:
            problems.append(
                (
                    ("kv", "reserve_tokens"),
                    f"{self.kv.reserve_tokens:,} tokens is at or above the KV pool (lane.kv_pool_tokens "
                    f"{pool:,}): every request would be rejected as unfit_request",
                )
            )
        slots = self.lane.mamba_slots
        m = self.mamba
        if m is not None and slots is not None and m.slots_per_request + m.reserve_slots > slots:
            problems.append(
                (
                    ("mamba", "reserve_slots"),
                    f"slots_per_request ({m.slots_per_request}) + reserve_slots ({m.reserve_slots}) exceed "
                    f"the pool (lane.mamba_slots {slots}): every request would be rejected as unfit_request",
                )
            )
        return problems


@dataclass(frozen=True, slots=True)
class LoadedPolicy:
    policy: Policy
    sha256: str
    path: str | None

    def with_section(self, section: str, **changes: object) -> LoadedPolicy:
        """A variant with some fields of one section changed (what-if runs: replay, benches, tests)."""
        current = getattr(self.policy, section)
        updated = self.policy.model_copy(update={section: current.model_copy(update=changes)})
        return LoadedPolicy(updated, self.sha256, self.path)


class PolicyError(ConfigError):
    """A policy that cannot be used, with every problem located (file:line: field: message)."""

    kind = "policy"


def load_policy_text(text: str, source: str = "<policy>") -> LoadedPolicy:
    """Parse and validate policy YAML; raise PolicyError with file, line and field for each problem."""
    policy = load_model(text, Policy, source, PolicyError)
    return LoadedPolicy(policy, hashlib.sha256(text.encode()).hexdigest(), None)


def load_policy_file(path: str | Path) -> LoadedPolicy:
    loaded = load_policy_text(read_text(path, PolicyError), str(path))
    return LoadedPolicy(loaded.policy, loaded.sha256, str(path))
