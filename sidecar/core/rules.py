"""The policy as the decision reads it: plain frozen values, no validation, no YAML.

The shell validates a policy file with pydantic (``sidecar/policy/schema.py``) and builds these once per
loaded policy (``sidecar/policy/in_force.py: rules_of``); the core never imports the validator. Each section
here holds only what a rule reads, under the same name as the policy file's field.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from sidecar.core.decision import Action


class ExceedAction(StrEnum):
    HOLD = "hold"
    REJECT = "reject"


class HeadroomSource(StrEnum):
    """Where the VRAM headroom comes from.

    ``nvml_free``: live free memory from the GPU source. Exact for an engine that returns freed
    memory to the driver; for a PyTorch engine it is a low-water mark, because the caching allocator
    keeps freed transients reserved (on an H200, one 500K prefill left NVML free ~100 MiB of an idle
    3.2 GiB although its live transients peaked at 1.4 GiB), and the gate would then hold everything.
    ``idle_budget``: the lane's measured idle free memory (``idle_free_bytes``), minus the reserve,
    minus what the ledger's prefills will allocate, minus what other processes on the card hold beyond
    ``other_processes_bytes`` (read live from NVML's per-process list when the source can tell). Right
    for caching engines. NVML is still read, exported and shown in both modes.
    """

    NVML_FREE = "nvml_free"
    IDLE_BUDGET = "idle_budget"


@dataclass(frozen=True, slots=True)
class LaneRules:
    """Fallbacks: the engine's own reports win when present."""

    context_len: int
    kv_pool_tokens: int | None
    mamba_slots: int | None
    chunked_prefill_size: int
    # SGLang's --max-running-requests when the engine does not report it (``decide._unfit``).
    max_running_requests: int | None = None


@dataclass(frozen=True, slots=True)
class CostModel:
    """Coefficients of the transient projection (``sidecar/core/cost.py`` says how they combine)."""

    fixed_bytes: int
    activation_bytes_per_chunk_token: int
    context_bytes_per_token: int
    gather_bytes_per_context_token: int
    gather_cap_bytes: int | None
    margin: float
    # Bytes per chunk token per context token ([chunk_rows, context] buffers, indexer-style).
    chunk_context_bytes: float = 0.0
    # Bytes per prompt token whose input logprob is computed (fp32 logits and their log-softmax over
    # the vocabulary, ``cost.input_logprobs``); 0: never priced.
    logprob_bytes_per_token: int = 0
    # Allocated when a request joins the running batch, as a function of that batch (not a prefill
    # term: ``constraints.BatchJoin`` checks it while requests run). None: never measured (0).
    batch_join_bytes: int | None = None
    batch_join_bytes_per_running_request: int = 0
    # How long after a streamed first token, with no prefill ahead of it, the engine's next decode step
    # (where the running batch allocates the join) is taken to have started (``constraints.JoinPending``).
    join_settle_s: float = 0.0
    # The multiple of the cost terms the calibration saw (the monitor compares readings with it; the
    # decision does not read it). None: not calibrated.
    calibrated_ratio: float | None = None

    def at_once(self, prefill_bytes: int, running: int) -> int:
        """The most the engine holds beyond idle at one time: the prefill transients (``prefill_bytes``)
        or the running batch's join as it grows to ``running``, never both. SGLang runs a prefill batch
        and the decode batch in separate forward passes (no mixed chunk; evidence S25), so the two never
        coexist. The one statement of that rule: the admission's join check, the guard and the monitor
        read it from here."""
        return max(prefill_bytes, self.join_bytes(running))

    def join_bytes(self, running: int) -> int:
        """What the running batch allocates when it grows to ``running`` requests, margin included."""
        if running < 2 or not (self.batch_join_bytes or self.batch_join_bytes_per_running_request):
            return 0
        raw = (self.batch_join_bytes or 0) + self.batch_join_bytes_per_running_request * running
        return int(raw * self.margin)


@dataclass(frozen=True, slots=True)
class DeviceBaseline:
    """One GPU as the sidecar measured it with the engine idle: its free memory and what other
    processes held on it then (None where the GPU source cannot tell). ``ident`` matches
    ``snapshot.DeviceMemory.ident``."""

    ident: str
    free_bytes: int
    other_process_bytes: int | None


@dataclass(frozen=True, slots=True)
class VramRules:
    headroom: HeadroomSource
    idle_free_bytes: int | None
    other_processes_bytes: int | None
    reserve_bytes: int
    max_transient_bytes: int | None
    on_exceed: ExceedAction
    # ``idle_free_bytes: auto``: the sidecar measures the figure (``Learned``); until then the headroom
    # is live GPU free memory and ``idle_free_bytes`` is None.
    idle_free_auto: bool = False
    # Per GPU, measured at idle (``admission/lane_watch.py``): each GPU's budget is its own idle free
    # memory less what ITS other processes grew by since (``decide.idle_budget``). Empty: the policy's
    # one figure and one ``other_processes_bytes`` for every GPU.
    idle_devices: tuple[DeviceBaseline, ...] = ()

    def transient_cap(self) -> int | None:
        """The largest transient the lane can ever take; larger requests are unfit."""
        if self.max_transient_bytes is not None:
            return self.max_transient_bytes
        if self.idle_free_bytes is not None:
            return self.idle_free_bytes - self.reserve_bytes
        return None

    @property
    def uses_gpu_signal(self) -> bool:
        return self.headroom is HeadroomSource.NVML_FREE


@dataclass(frozen=True, slots=True)
class KvRules:
    reserve_tokens: int
    max_usage: float
    count_evictable_as_free: bool
    decode_reserve_fraction: float
    on_exceed: ExceedAction


@dataclass(frozen=True, slots=True)
class MambaRules:
    slots_per_request: int
    checkpoint_interval_tokens: int | None
    reserve_slots: int
    max_usage: float
    on_exceed: ExceedAction


@dataclass(frozen=True, slots=True)
class LimitRules:
    """A limit on work waiting in the engine: ``engine_queue.max_requests`` (sequences forwarded whose
    prefill has not finished) or ``pending_prefill.max_tokens``."""

    limit: int
    on_exceed: ExceedAction


@dataclass(frozen=True, slots=True)
class SignalRules:
    max_age_s: float
    # How often the shell reads the signal.
    poll_interval_s: float
    # What to do when the signal is too old to trust: hold, reject or admit (the policy always says).
    on_stale: Action
    unavailable_after_failures: int
    # Only the GPU signal: False runs without it (the VRAM constraint is then off).
    required: bool = True
    # Only the engine: how often it is read for one poll interval after an admitted request ended
    # while requests are held (0: only every poll_interval_s).
    poll_after_release_s: float = 0.0


@dataclass(frozen=True, slots=True)
class HoldRules:
    max_held: int
    max_wait_s: float
    backfill: bool
    low_priority_values_first: bool
    retry_after_min_s: int
    retry_after_max_s: int
    prefill_tokens_per_s: float


@dataclass(frozen=True, slots=True)
class MonitorRules:
    """The under-prediction monitor (``sidecar/admission/lane_watch.py``): an allocation over the
    projection by more than ``tolerance`` (relative) and ``min_bytes`` is a finding; with
    ``raise_margin`` the margin rises to cover it plus ``step``, never above ``max_margin``."""

    raise_margin: bool
    max_margin: float
    step: float
    tolerance: float
    min_bytes: int
    # The new margin is what a reading showed times 1 + safety (``lane_watch.raised_margin``); also the
    # safety on a crash's margin (``lane_watch.crash_margin``).
    safety: float = 0.05
    # The engine allocator's rounding per request: an excess under it is no finding (``lane_watch.excess``).
    allocator_block_bytes: int = 2 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class GuardRules:
    """The in-flight prefill guard (``sidecar/core/overrun.py``); enforce mode only."""

    enabled: bool


@dataclass(frozen=True, slots=True)
class ExperimentalRules:
    """Rules whose only evidence is the emulator's benchmark: off unless a policy turns them on
    (``experimental:``; docs/evidence.md G-rows say what each bought there)."""

    # Price a request that starts its own prefill batch by its own chunk schedule (decide: own batch).
    own_schedule_pricing: bool = False
    # Admit a request that waited only on a GPU reading taken after its wait began (decide step 4).
    gpu_reading_after_wait: bool = False


@dataclass(frozen=True, slots=True)
class Learned:
    """What the lane has taught the sidecar since the policy was loaded, as plain values; the rules in
    force are the policy's with these (``sidecar/policy/in_force.py: rules_in_force``). Empty: the
    policy alone. A new learned fact is a field here and one line there."""

    # GPU free memory measured with the engine idle (for ``vram.idle_free_bytes: auto``), and what
    # other processes held then (None: the GPU source cannot tell).
    idle_free_bytes: int | None = None
    idle_other_process_bytes: int | None = None
    # The cost margin the monitor raised to cover an under-prediction, a crash set, or a new engine
    # build's conservative state priced (None: the policy's own).
    margin: float | None = None
    # Each GPU's idle baseline, when the idle figure was measured on several (``decide.idle_budget``).
    idle_devices: tuple[DeviceBaseline, ...] = ()
    # The lane facts measured to differ from the policy's, with the figure in force for each (the safer:
    # ``core/facts.py``), e.g. (("idle_free_bytes", 1438646272), ("kv_pool_tokens", 33000)).
    facts: tuple[tuple[str, int], ...] = ()


NOTHING_LEARNED = Learned()


@dataclass(frozen=True, slots=True)
class Rules:
    """Everything the decision and its shell read of a policy. ``mamba`` is None on lanes without a
    Mamba pool; ``monitor`` and ``guard`` are read by the shell only."""

    lane: LaneRules
    cost: CostModel
    vram: VramRules
    kv: KvRules
    mamba: MambaRules | None
    engine_queue: LimitRules
    pending_prefill: LimitRules
    engine: SignalRules
    gpu: SignalRules
    hold: HoldRules
    monitor: MonitorRules
    guard: GuardRules
    # The most sequences (prompts x samples) one request may ask for: policy
    # ``limits.max_sequences_per_request``. More is ``unfit_request`` at once, whatever the lane holds.
    max_sequences_per_request: int = 256
    experimental: ExperimentalRules = ExperimentalRules()
