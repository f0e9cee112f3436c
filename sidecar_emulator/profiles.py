"""Lane profiles: the numbers that describe one SGLang lane to the engine model.

A profile is everything the emulator needs to behave like a particular card + model + SGLang build:
device memory, the static allocations SGLang makes at start, the scheduler's limits, how fast it
prefills and decodes, and - the point of this project - how much memory each prefill step allocates
*outside* the KV pool. Every coefficient in the shipped profiles says where it comes from: a figure in
a row of ``docs/evidence.md`` (cited as "evidence <id>"), a fixture, or "assumed, calibrate".

Byte quantities are exact integers; ``MiB`` and ``GiB`` are binary units (the incident report's "MiB" are NVML's).

Transient model (per prefill step, allocated in this order, freed when the step ends):

1. ``activation``: ``chunk_tokens * activation_bytes_per_token`` (hidden states, MoE buffers of the chunk);
2. ``context``: ``context_tokens * context_bytes_per_token`` - temporaries that grow with the whole
   request on *both* builds (calibrated from the bounded build still peaking 1,432 MiB over idle);
3. ``gather``: ``min(context_tokens * gather_bytes_per_token, gather_cap_bytes)`` - the full-context
   prefill gather (1,024 MiB at 524,288 tokens on the old build, 32 MiB on the bounded-gather build).

``context_tokens`` is the whole context at the end of the chunk, *including* a radix-cached prefix: a
request that hits a 280K-token cached history pays the full-context temporaries on its first chunk.
Each piece may carry seeded relative noise: a factor uniform in ``[1 - transient_noise, 1 + transient_noise]``
(bounded, as a real allocation's variation is). ``unknown_extra_bytes`` is one more allocation that no cost
model knows about: it is taken for one decode step whenever the running batch grows to at least
``unknown_extra_min_running`` requests (SGLang merges the new prefill batch into the running batch
there). It reproduces the paired-250K cell: +1,248 MiB over idle on both builds, while the gather fix
lowered the lone 500K peak.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class TransientPieces:
    """The allocations one prefill step makes outside the KV pool, in allocation order (bytes)."""

    activation: int
    context: int
    gather: int

    @property
    def total(self) -> int:
        return self.activation + self.context + self.gather

    def as_list(self) -> list[tuple[str, int]]:
        return [("activation", self.activation), ("context", self.context), ("gather", self.gather)]


@dataclass(frozen=True, slots=True)
class LaneProfile:
    """One SGLang lane (one engine on one device). Frozen: derive variants with :meth:`replace`."""

    name: str
    description: str
    served_model_name: str

    # --- device -------------------------------------------------------------------------------
    device_total_bytes: int
    # NVML v2 "reserved": counted in total, never free to anyone (driver/firmware).
    device_reserved_bytes: int
    other_process_bytes: int

    # --- static allocations of the engine process ----------------------------------------------
    mem_fraction_static: float
    weights_bytes: int
    kv_pool_tokens: int
    kv_bytes_per_token: int
    cuda_context_bytes: int
    cuda_graph_bytes: int
    mamba_slots: int = 0
    mamba_bytes_per_slot: int = 0

    # --- scheduler -----------------------------------------------------------------------------
    chunked_prefill_size: int = 8192
    max_running_requests: int = 24
    context_length: int = 131072
    # Mamba state slots each admitted request holds (working state + ping-pong buffers).
    mamba_slots_per_request: int = 1
    # During chunked prefill a checkpoint (one slot) is kept every this many prompt tokens and stays
    # locked while its request is in flight; 0 keeps only the latest checkpoint (one slot).
    mamba_checkpoint_interval_tokens: int = 0
    # Whether the engine REPORTS those interval checkpoints of in-flight requests as evictable. SGLang
    # donates each chunk's state to the radix tree (cache_unfinished_req), where it counts in
    # `mamba_evictable_tokens`; eviction still cannot take it while the request's path is locked
    # (sgl-project/sglang PR #36770: "the pool looks half empty ... nothing in it is evictable").
    # So the published Mamba usage stays low and jumps to 1.00 only at the failed allocation
    # (evidence I10, D12). The allocator never takes them either way.
    mamba_inflight_checkpoints_reported_evictable: bool = False
    # SGLang reserves min(max_new_tokens - output, clip) * new_token_ratio KV tokens per running
    # request when admitting prefills (SGLANG_INIT_NEW_TOKEN_RATIO 0.7, CLIP_MAX_NEW_TOKENS 4096).
    new_token_ratio: float = 0.7
    clip_max_new_tokens: int = 4096
    # "after three retractions an unfit request gets 503" (evidence M6).
    max_retractions: int = 3
    page_size: int = 1
    kv_cache_dtype: str = "fp8_e4m3"

    # --- speed ---------------------------------------------------------------------------------
    prefill_tokens_per_s: float = 20000.0
    # Prefill speed halves when the context reaches this many tokens (attention over the prefix).
    prefill_half_speed_context: float | None = None
    decode_tokens_per_s: float = 100.0
    # Decode step time grows by this fraction per extra running request.
    decode_batch_slowdown: float = 0.0
    step_overhead_s: float = 0.002

    # --- transients outside the pool -------------------------------------------------------------
    # Allocated by every prefill step whatever its size (workspaces, a fixed buffer): a lane shape no
    # shipped profile has but the cost model's ``fixed_bytes`` describes (the robustness block).
    fixed_bytes_per_step: int = 0
    activation_bytes_per_token: int = 0
    context_bytes_per_token: int = 0
    gather_bytes_per_token: int = 0
    gather_cap_bytes: int | None = None
    # Relative noise on every transient piece and the batch join: a seeded factor uniform in [1-n, 1+n].
    transient_noise: float = 0.0
    unknown_extra_bytes: int = 0
    unknown_extra_min_running: int = 2
    # Input-token logprobs: fp32 logits over the vocabulary and their log-softmax, per prompt token of a
    # chunk from logprob_start_len on (evidence B3); the Qwen3 family's vocabulary of 151,936.
    logprob_bytes_per_token: int = 8 * 151_936

    # --- what the engine does that no policy was told (the benchmark's robustness block) -------------
    # Every transient piece and the batch join drawn this many times their model size from engine time
    # ``transient_scale_from_s`` on (an upgrade, a kernel change); 1.0 before it.
    transient_scale: float = 1.0
    transient_scale_from_s: float = 0.0
    # Every allocation rounded up to this many bytes (PyTorch's caching allocator: 2 MiB blocks); 0: exact.
    allocation_round_bytes: int = 0
    # A planned restart at this engine time (a new build rolled out): in-flight requests fail, the
    # engine is down ``restart_s`` and comes back with its transients ``upgrade_scale`` times larger
    # (on top of ``transient_scale``). Not a crash. None: never.
    upgrade_at_s: float | None = None
    upgrade_scale: float = 1.0
    # How long that planned restart keeps the lane down (assumed: a rolling restart with the weights in
    # the page cache, not the 774 s crash recovery of evidence I6).
    upgrade_down_s: float = 60.0
    # The version the new build reports (``/server_info`` and ``/v1/loads`` ``version``: SGLang's
    # ``get_server_info`` returns ``"version": __version__``, evidence RB1), so a sidecar sees the build change.
    upgrade_version: str = "0.5.24"

    # --- tensor parallelism --------------------------------------------------------------------
    # Ranks (one engine process and one GPU each). Every device, static and transient figure of the
    # profile is PER RANK (``tensor_parallel`` derives them from a one-GPU profile), every rank runs
    # the same steps, and the engine dies when any rank's allocation fails.
    tp_size: int = 1
    # What other processes hold on each rank's GPU at start (default: ``other_process_bytes`` on every
    # one); a neighbour on one card only is what makes per-GPU headroom matter.
    rank_other_process_bytes: tuple[int, ...] = ()
    # PyTorch's caching allocator keeps freed transients reserved, so NVML free stays at the low-water
    # mark; an out-of-memory retry releases the cache first, so only live bytes decide a crash. On by
    # default: every PyTorch engine does this (measured on an H200: bench/results/).
    allocator_caches_transients: bool = True
    # PyTorch's DEFAULT caching allocator (no ``expandable_segments``): a freed block serves only a
    # request that fits in it, so each prefill chunk's larger transient reserves a new segment and the
    # reserved memory (what NVML shows) adds up over chunks; an out-of-memory retry releases the free
    # segments first (docs/evidence.md G3, RC1). Off: the cache holds only the largest live set (what
    # expandable segments do). ``emulate --cuda`` gets the real allocator's behaviour either way.
    allocator_segments: bool = False

    # --- lifecycle and publication ---------------------------------------------------------------
    restart_s: float = 774.0  # evidence I6: "down 12 min 54 s"
    decode_log_interval: int = 40  # SGLang --decode-log-interval default
    idle_publish_s: float = 30.0  # SGLang 0.5.23 _maybe_log_idle_metrics
    loads_publish_interval: int = 15  # --load-snapshot-publish-interval default
    # Gauges and /v1/loads are written after every this many prefill batches (SGLang: every one). The
    # benchmark's slow-signals setting raises it, with the decode and idle intervals, to publish 10x less.
    prefill_publish_every: int = 1

    # --- derived -------------------------------------------------------------------------------
    @property
    def kv_pool_bytes(self) -> int:
        return self.kv_pool_tokens * self.kv_bytes_per_token

    @property
    def mamba_pool_bytes(self) -> int:
        return self.mamba_slots * self.mamba_bytes_per_slot

    @property
    def engine_static_bytes(self) -> int:
        """What the idle engine process holds on the device."""
        return (
            self.weights_bytes
            + self.kv_pool_bytes
            + self.mamba_pool_bytes
            + self.cuda_context_bytes
            + self.cuda_graph_bytes
        )

    @property
    def idle_free_bytes(self) -> int:
        """Device free memory (NVML ``free``) with the engine idle."""
        return (
            self.device_total_bytes
            - self.device_reserved_bytes
            - self.other_process_bytes
            - self.engine_static_bytes
        )

    @property
    def startup_available_bytes(self) -> int:
        """Free memory SGLang sees before loading weights (its ``total_gpu_memory``)."""
        return (
            self.device_total_bytes
            - self.device_reserved_bytes
            - self.other_process_bytes
            - self.cuda_context_bytes
        )

    @property
    def effective_max_running_requests(self) -> int:
        """SGLang caps running requests by Mamba state slots: floor(slots / slots per request)."""
        if self.mamba_slots <= 0:
            return self.max_running_requests
        return min(self.max_running_requests, self.mamba_slots // max(1, self.mamba_slots_per_request))

    @property
    def max_req_input_len(self) -> int:
        """Longest prompt SGLang accepts (0.5.23 fixture: pool 522,880 -> 522,874)."""
        return min(self.context_length, self.kv_pool_tokens - 1) - 5

    def transient_pieces(self, chunk_tokens: int, context_tokens: int) -> TransientPieces:
        """Noise-free transient allocations of one prefill chunk ending at ``context_tokens``."""
        gather = context_tokens * self.gather_bytes_per_token
        if self.gather_cap_bytes is not None:
            gather = min(gather, self.gather_cap_bytes)
        return TransientPieces(
            activation=chunk_tokens * self.activation_bytes_per_token,
            context=context_tokens * self.context_bytes_per_token,
            gather=gather,
        )

    def prefill_seconds(self, tokens: int, context_start: int) -> float:
        """Time to prefill ``tokens`` new tokens after ``context_start`` tokens of context."""
        if tokens <= 0:
            return 0.0
        speed = self.prefill_tokens_per_s
        if self.prefill_half_speed_context:
            speed /= 1.0 + (context_start + tokens / 2) / self.prefill_half_speed_context
        return tokens / speed

    def decode_step_seconds(self, batch_size: int) -> float:
        slowdown = 1.0 + self.decode_batch_slowdown * max(0, batch_size - 1)
        return slowdown / self.decode_tokens_per_s

    def replace(self, **changes: object) -> LaneProfile:
        """A copy with some fields changed, e.g. ``p.replace(gather_cap_bytes=None)``."""
        return replace(self, **changes)  # type: ignore[arg-type]


def tensor_parallel(p: LaneProfile, tp: int, *, name: str | None = None) -> LaneProfile:
    """``p`` (one GPU) served with ``--tp tp`` on ``tp`` such GPUs, each rank's figures as SGLang
    splits them (evidence B5): weights, KV heads (bytes per pool token), Mamba states, activations and
    the KV gather divide by ``tp``; the pool keeps the static fraction, so it takes the weight bytes a
    rank no longer holds (more tokens at fewer bytes each); every rank allocates the same pool in
    tokens. Kept whole on every rank: the context temporaries (index arrays over every request's
    context are built per rank; the rest is unmeasured, so the safe side), input-logprob logits
    (all-gathered to the full vocabulary), CUDA graphs and the batch join."""
    weights = p.weights_bytes // tp
    kv_per_token = max(1, p.kv_bytes_per_token // tp)
    mamba_per_slot = p.mamba_bytes_per_slot // tp
    pool_bytes = (
        p.kv_pool_bytes + (p.weights_bytes - weights) + (p.mamba_pool_bytes - p.mamba_slots * mamba_per_slot)
    )
    return p.replace(
        name=name or f"{p.name}-tp{tp}",
        description=f"{p.description} (tensor parallel over {tp} GPUs; figures per rank)",
        tp_size=tp,
        weights_bytes=weights + pool_bytes % kv_per_token,
        kv_bytes_per_token=kv_per_token,
        kv_pool_tokens=pool_bytes // kv_per_token,
        mamba_bytes_per_slot=mamba_per_slot,
        activation_bytes_per_token=p.activation_bytes_per_token // tp,
        gather_bytes_per_token=p.gather_bytes_per_token // tp,
        gather_cap_bytes=None if p.gather_cap_bytes is None else p.gather_cap_bytes // tp,
    )


def _residual_weights(
    *,
    total: int,
    reserved: int,
    other: int,
    context: int,
    graphs: int,
    kv: int,
    mamba: int,
    idle_free: int,
) -> int:
    """Weight bytes that make the idle free memory come out at ``idle_free``.

    The incident report gives no weight size. SGLang sizes its pools so that weights + pools fill
    ``mem_fraction_static`` of the memory it sees at start; whatever the card held beyond the pools,
    the CUDA context and graphs is "weights" here (NVFP4 80B weights alone are ~45 GB; the rest of
    the static fraction is buffers this model does not separate).
    """
    return total - reserved - other - context - graphs - kv - mamba - idle_free


# --------------------------------------------------------------------------------------------------
# Coefficients shared by the Qwen3-Next (hybrid Mamba, FP8 KV) lanes on the RTX PRO 6000 Max-Q.
# --------------------------------------------------------------------------------------------------
_MAXQ_TOTAL = 97_887 * MiB  # evidence I1: "RTX PRO 6000 Blackwell Max-Q, 97,887 MiB"
_MAXQ_OTHER = 676 * MiB  # evidence I3: "another process on the card held 676 MiB"
# Derived: capacity - process (93.92 GiB) - other (676 MiB) - the model's free memory at the outage
# crash (528 MiB, see maxq-old). Why the model shows 528 MiB free at the failed 560 MiB gather and not the
# incident's 280.94 MiB (evidence I4, D11): the incident's four figures (I1, I3, I4) leave 756 MiB to the
# driver; with transients that depend only on the chunk and its context (D1, D2), the chunk that ended at
# 278,528 tokens needed 96 + 727 + 544 = 1,366 MiB and succeeded, and the failing chunk held 96 + 748 =
# 844 MiB before its gather, so at least 1,366 - 844 = 522 MiB was free when the gather failed. Seeing
# 280.94 MiB needs >= 241 MiB allocated between the two chunks by something the incident report does not
# name (the neighbour growing, allocator fragmentation, a workspace growing). The profile keeps the
# 93.92 GiB process figure and the 676 MiB neighbour; adding an unnamed ~247 MiB allocation at that
# instant would fit the figure, not the model.
_MAXQ_RESERVED = 509 * MiB
_MAXQ_CONTEXT = 560 * MiB  # assumed, calibrate: CUDA context + cuBLAS/NCCL workspaces (~0.5 GiB on H200)
_MAXQ_GRAPHS = 552 * MiB  # assumed, calibrate: leaves (1 - 0.98) of start memory minus graphs = idle free
# Assumed from the architecture: 12 full-attention layers x 2 KV heads x 256 dims x (K+V) x 1 B (FP8).
_QWEN3_NEXT_KV_BYTES = 12 * 2 * 256 * 2
# Assumed: 36 Gated-DeltaNet layers x (32 heads x 128 x 128 x fp32 SSM state + conv state) ~ 74 MiB.
_QWEN3_NEXT_MAMBA_SLOT = 74 * MiB
# Assumed, calibrate: per-chunk activations, 12 KiB per chunk token (96 MiB for an 8,192 chunk). Kept
# small because the paired 250K cell (+1,248 MiB on both builds) bounds activation + context + gather.
_ACTIVATION_PER_TOKEN = 12 * 1024
# Calibrated: bounded build, lone 500,000-token request peaks 96,093 - 94,661 = 1,432 MiB over idle
# = 96 MiB activation + 32 MiB bounded gather + 500,000 x this.
_CONTEXT_PER_TOKEN = (1_432 * MiB - 8192 * _ACTIVATION_PER_TOKEN - 32 * MiB) // 500_000
# Evidence M1: "1,024.0 MiB at 524,288 tokens (FP8) on the old build" = 2 KiB per context token (D1).
_GATHER_PER_TOKEN = 1024 * MiB // 524_288
_GATHER_BOUNDED_CAP = 32 * MiB  # evidence M1: "32.0 MiB on the bounded-gather build"
# Evidence M3: "two cold ~250K requests together: +1,248 MiB non-pool peak over idle on both builds".
_UNKNOWN_EXTRA = 1_248 * MiB
# Assumed, calibrate: the sustained cell (evidence M5: 4 x ~240K prompts, 8,192 output tokens, 93-107 s a
# round) and prefix-loss TTFTs (evidence M4: 22.9 s / 41.1 s cold) put cold prefill at roughly 10-20K tokens/s.
_MAXQ_PREFILL_TPS = 24_000.0
_MAXQ_PREFILL_HALF = 500_000.0
# Calibrated on the sustained cell (evidence M5, D10): the 689,728-token pool holds two ~240K requests at
# a time, so a round is two pairs of (~480K prefill tokens, ~25 s here, then 8,192 decode steps together);
# 93-107 s a round leaves ~3.1 ms a decode step: 0.5 ms of step overhead (graph launch, sampling) plus
# 1 / 385 s. (With 2 ms + 1 / 330 s, rounds took 130-134 s.)
_MAXQ_DECODE_TPS = 385.0
_MAXQ_STEP_OVERHEAD_S = 0.0005
_QWEN3_NEXT_NAME = "Qwen/Qwen3-Next-80B-A3B-Instruct-NVFP4"  # evidence I8: Qwen3-Next family, NVFP4 weights

_MAXQ_OLD_POOL = 522_880  # evidence I2: "KV pool of 522,880 tokens"
_MAXQ_OLD_MAMBA_SLOTS = 50  # evidence F1 (fixture: 3 used + 47 free; illustrative)
# Calibrated: with this idle free memory the old build's cold prefill fails on the gather of the chunk
# that ends at 286,720 tokens (35 x 8,192), which is exactly 560 MiB (the failed allocation, evidence I4, D3).
_MAXQ_OLD_IDLE_FREE = 1_372 * MiB

MAXQ_OLD = LaneProfile(
    name="maxq-old",
    description=(
        "The outage lane: RTX PRO 6000 Max-Q, Qwen3-Next NVFP4, FP8 KV, 524K context, old build whose "
        "full-context prefill gather grows with the request (crashed at 16:44:17)."
    ),
    served_model_name=_QWEN3_NEXT_NAME,
    device_total_bytes=_MAXQ_TOTAL,
    device_reserved_bytes=_MAXQ_RESERVED,
    other_process_bytes=_MAXQ_OTHER,
    mem_fraction_static=0.98,  # evidence I2: "--mem-fraction-static 0.98"
    weights_bytes=_residual_weights(
        total=_MAXQ_TOTAL,
        reserved=_MAXQ_RESERVED,
        other=_MAXQ_OTHER,
        context=_MAXQ_CONTEXT,
        graphs=_MAXQ_GRAPHS,
        kv=_MAXQ_OLD_POOL * _QWEN3_NEXT_KV_BYTES,
        mamba=_MAXQ_OLD_MAMBA_SLOTS * _QWEN3_NEXT_MAMBA_SLOT,
        idle_free=_MAXQ_OLD_IDLE_FREE,
    ),
    kv_pool_tokens=_MAXQ_OLD_POOL,
    kv_bytes_per_token=_QWEN3_NEXT_KV_BYTES,
    cuda_context_bytes=_MAXQ_CONTEXT,
    cuda_graph_bytes=_MAXQ_GRAPHS,
    mamba_slots=_MAXQ_OLD_MAMBA_SLOTS,
    mamba_bytes_per_slot=_QWEN3_NEXT_MAMBA_SLOT,
    chunked_prefill_size=8192,  # evidence F2 (outage launch config)
    max_running_requests=24,  # evidence F2: max_running_requests / effective 24
    context_length=524_288,  # evidence F2: context_length (evidence I8: 500K-token requests)
    # Assumed: one working slot per request and only the latest chunk checkpoint kept; reproduces the
    # Mamba usage 0.06 at the outage (evidence I5) (1 running + 1 chunked + its checkpoint = 3 of 50).
    mamba_slots_per_request=1,
    mamba_checkpoint_interval_tokens=0,
    prefill_tokens_per_s=_MAXQ_PREFILL_TPS,
    prefill_half_speed_context=_MAXQ_PREFILL_HALF,
    decode_tokens_per_s=_MAXQ_DECODE_TPS,
    step_overhead_s=_MAXQ_STEP_OVERHEAD_S,
    activation_bytes_per_token=_ACTIVATION_PER_TOKEN,
    context_bytes_per_token=_CONTEXT_PER_TOKEN,
    gather_bytes_per_token=_GATHER_PER_TOKEN,
    gather_cap_bytes=None,  # old build: the gather grows with the whole request
    unknown_extra_bytes=_UNKNOWN_EXTRA,
    unknown_extra_min_running=2,
)

_MAXQ_BOUNDED_POOL = 689_728  # evidence M2: "pool 689,728 tokens"
# Evidence M2: "idle device use 94,661 MiB" (device use = capacity - free, assumed to include NVML reserved).
_MAXQ_BOUNDED_IDLE_FREE = (97_887 - 94_661) * MiB

MAXQ_BOUNDED = LaneProfile(
    name="maxq-bounded",
    description=(
        "Max-Q lane on the bounded-gather build (prefill gather capped at 32 MiB), pool 689,728 tokens, "
        "idle device use 94,661 MiB. Lone 500K request peaks 96,093 MiB (97,237 MiB on the old build)."
    ),
    served_model_name=_QWEN3_NEXT_NAME,
    device_total_bytes=_MAXQ_TOTAL,
    device_reserved_bytes=_MAXQ_RESERVED,
    other_process_bytes=_MAXQ_OTHER,
    # Derived from the idle figure: (start memory - graphs - idle free) / start memory = 0.961.
    mem_fraction_static=0.96,
    weights_bytes=_residual_weights(
        total=_MAXQ_TOTAL,
        reserved=_MAXQ_RESERVED,
        other=_MAXQ_OTHER,
        context=_MAXQ_CONTEXT,
        graphs=_MAXQ_GRAPHS,
        kv=_MAXQ_BOUNDED_POOL * _QWEN3_NEXT_KV_BYTES,
        mamba=_MAXQ_OLD_MAMBA_SLOTS * _QWEN3_NEXT_MAMBA_SLOT,
        idle_free=_MAXQ_BOUNDED_IDLE_FREE,
    ),
    kv_pool_tokens=_MAXQ_BOUNDED_POOL,
    kv_bytes_per_token=_QWEN3_NEXT_KV_BYTES,
    cuda_context_bytes=_MAXQ_CONTEXT,
    cuda_graph_bytes=_MAXQ_GRAPHS,
    mamba_slots=_MAXQ_OLD_MAMBA_SLOTS,  # assumed same as maxq-old
    mamba_bytes_per_slot=_QWEN3_NEXT_MAMBA_SLOT,
    chunked_prefill_size=8192,  # assumed same launch config as maxq-old
    max_running_requests=24,  # assumed same launch config as maxq-old
    context_length=524_288,  # assumed same launch config as maxq-old
    mamba_slots_per_request=1,
    mamba_checkpoint_interval_tokens=0,
    prefill_tokens_per_s=_MAXQ_PREFILL_TPS,
    prefill_half_speed_context=_MAXQ_PREFILL_HALF,
    decode_tokens_per_s=_MAXQ_DECODE_TPS,
    step_overhead_s=_MAXQ_STEP_OVERHEAD_S,
    activation_bytes_per_token=_ACTIVATION_PER_TOKEN,
    context_bytes_per_token=_CONTEXT_PER_TOKEN,
    gather_bytes_per_token=_GATHER_PER_TOKEN,
    gather_cap_bytes=_GATHER_BOUNDED_CAP,
    unknown_extra_bytes=_UNKNOWN_EXTRA,
    unknown_extra_min_running=2,
)

# Calibrated: full-token usage 0.46 when the third cold ~140K request exhausts the 51 Mamba slots
# (2 x 140K decoding + 49,152 prefilled tokens of the third).
_MAMBA_LANE_POOL = 739_000
_MAMBA_LANE_IDLE_FREE = 2_500 * MiB  # assumed, calibrate: this lane died of Mamba slots, not VRAM

MAMBA_LANE = LaneProfile(
    name="mamba-lane",
    description=(
        "The second lane: 262K window, FP8 KV, 51 Mamba slots, 12-request ceiling, 4,096-token chunks. "
        "~140K cold inputs exhaust the Mamba slots with 2 running requests -> 'Can not alloc mamba cache'."
    ),
    served_model_name=_QWEN3_NEXT_NAME,
    device_total_bytes=_MAXQ_TOTAL,  # assumed: the same card model as the outage lane
    device_reserved_bytes=_MAXQ_RESERVED,
    other_process_bytes=_MAXQ_OTHER,  # assumed
    mem_fraction_static=0.97,  # assumed, derived from the idle free memory below
    weights_bytes=_residual_weights(
        total=_MAXQ_TOTAL,
        reserved=_MAXQ_RESERVED,
        other=_MAXQ_OTHER,
        context=_MAXQ_CONTEXT,
        graphs=_MAXQ_GRAPHS,
        kv=_MAMBA_LANE_POOL * _QWEN3_NEXT_KV_BYTES,
        mamba=51 * _QWEN3_NEXT_MAMBA_SLOT,
        idle_free=_MAMBA_LANE_IDLE_FREE,
    ),
    kv_pool_tokens=_MAMBA_LANE_POOL,
    kv_bytes_per_token=_QWEN3_NEXT_KV_BYTES,  # evidence I9: FP8 KV
    cuda_context_bytes=_MAXQ_CONTEXT,
    cuda_graph_bytes=_MAXQ_GRAPHS,
    mamba_slots=51,  # evidence I9: "51 Mamba slots"
    mamba_bytes_per_slot=_QWEN3_NEXT_MAMBA_SLOT,
    chunked_prefill_size=4096,  # evidence I9: "4,096-token prefill chunks"
    max_running_requests=12,  # evidence I9: "12-request ceiling" (= floor(51 / 4) state cap as well, D8)
    context_length=262_144,  # evidence I9: "262K window"
    # Assumed: 4 slots per request (working state + ping-pong buffers; SGLang's state cap
    # floor(51 / 4) = 12 matches the lane's ceiling (evidence D8); 4 held were seen elsewhere (evidence S13)).
    mamba_slots_per_request=4,
    # Assumed, calibrate: a locked checkpoint every 8,192 prompt tokens; with 3 cold ~140K requests the
    # pool runs out while 2 are running (evidence I10: usage 0.18 -> 1.00 with 2 running, full 0.46).
    mamba_checkpoint_interval_tokens=8192,
    # Reported evictable while pinned: usage 0.18 with 2 running, then 1.00 at the crash (evidence I10, D12).
    mamba_inflight_checkpoints_reported_evictable=True,
    prefill_tokens_per_s=_MAXQ_PREFILL_TPS,
    prefill_half_speed_context=_MAXQ_PREFILL_HALF,
    decode_tokens_per_s=_MAXQ_DECODE_TPS,
    step_overhead_s=_MAXQ_STEP_OVERHEAD_S,
    activation_bytes_per_token=_ACTIVATION_PER_TOKEN,
    context_bytes_per_token=_CONTEXT_PER_TOKEN,
    gather_bytes_per_token=_GATHER_PER_TOKEN,
    gather_cap_bytes=None,  # assumed: old build
    unknown_extra_bytes=0,  # this lane's failure is the Mamba pool; keep it the only surprise
)

# --------------------------------------------------------------------------------------------------
# A generic single H200 with a dense model: numbers from the idle-dense fixture (Qwen3-32B).
# --------------------------------------------------------------------------------------------------
_H200_TOTAL = 143_771 * MiB  # evidence N1: NVML total 150,754,820,096 B on an H200
_H200_RESERVED = 615 * MiB  # evidence N1: NVML v2 reserved measured on an H200
_H200_CONTEXT = 500 * MiB  # evidence N2: "10 GiB plus about 0.5 GiB of CUDA context"
_H200_GRAPHS = 860 * MiB  # evidence F8: graph_memory_usage_gb{phase="decode"} 0.84
_H200_POOL = 241_520  # evidence F8: max_total_num_tokens
# Qwen3-32B BF16: 64 layers x 8 KV heads x 128 x (K+V) x 2 B; x 241,520 = 58.96 GiB (evidence F8: kv 58.96).
_H200_KV_BYTES = 64 * 8 * 128 * 2 * 2
_H200_WEIGHTS = int(61.03 * GiB)  # evidence F8: weight_memory_usage_gb 61.03

H200 = LaneProfile(
    name="h200",
    description="A generic single H200 (143,771 MiB) serving a dense 32B model (Qwen3-32B, BF16 KV).",
    served_model_name="Qwen/Qwen3-32B",  # fixture idle-dense
    device_total_bytes=_H200_TOTAL,
    device_reserved_bytes=_H200_RESERVED,
    other_process_bytes=0,  # assumed: the engine is alone on the card
    # Derived: (weights + pool) / (memory free at start) for the fixture's numbers.
    mem_fraction_static=0.86,
    weights_bytes=_H200_WEIGHTS,
    kv_pool_tokens=_H200_POOL,
    kv_bytes_per_token=_H200_KV_BYTES,
    kv_cache_dtype="auto",
    cuda_context_bytes=_H200_CONTEXT,
    cuda_graph_bytes=_H200_GRAPHS,
    chunked_prefill_size=8192,  # assumed: SGLang default for an 80 GB+ card
    max_running_requests=64,  # assumed, calibrate
    context_length=40_960,  # evidence F8: context_len
    prefill_tokens_per_s=12_000.0,  # assumed, calibrate
    prefill_half_speed_context=200_000.0,  # assumed, calibrate
    decode_tokens_per_s=45.0,  # assumed, calibrate: 32B dense BF16 at low batch
    decode_batch_slowdown=0.01,  # assumed, calibrate
    # Assumed, calibrate: 32B dense, 25,600-wide MLP in BF16 ~ 96 KiB of live activations per token.
    activation_bytes_per_token=96 * 1024,
    context_bytes_per_token=0,  # assumed: paged attention, no full-context temporaries
    gather_bytes_per_token=0,
)

# --------------------------------------------------------------------------------------------------
# An H200 serving a Qwen3-Next-class hybrid model with the outage lane's long-context settings
# (--mem-fraction-static 0.98, 524K context, 8,192-token chunks, FP8 KV), bounded-gather build.
# --------------------------------------------------------------------------------------------------
_H200_QN_GRAPHS = 860 * MiB  # assumed, calibrate: as the idle-dense fixture's decode graphs (0.84 GB)
_H200_QN_MAMBA_SLOTS = 64  # assumed, calibrate: SGLang sizes the state pool with the card
_H200_QN_START = _H200_TOTAL - _H200_RESERVED - _H200_CONTEXT  # memory SGLang sees at start
# Derived: SGLang leaves (1 - 0.98) of its start memory outside the static pools; the graphs take
# their share of it, the rest is what NVML shows free with the engine idle (~1,993 MiB, evidence D12).
_H200_QN_IDLE_FREE = int(_H200_QN_START * 0.02) - _H200_QN_GRAPHS
# Assumed: FP8 weights (Hopper has no NVFP4 kernels) of an 80B model, ~77,700 MiB with the BF16 parts.
_H200_QN_WEIGHTS = 77_700 * MiB
_H200_QN_POOL = (
    int(_H200_QN_START * 0.98) - _H200_QN_WEIGHTS - _H200_QN_MAMBA_SLOTS * _QWEN3_NEXT_MAMBA_SLOT
) // _QWEN3_NEXT_KV_BYTES

H200_QWEN3NEXT = LaneProfile(
    name="h200-qwen3next",
    description=(
        "One H200 (143,771 MiB) serving a Qwen3-Next-class hybrid model, FP8 weights and KV, "
        "--mem-fraction-static 0.98, 524K context, 8,192-token chunks, bounded-gather build; "
        "~1.9 GiB free when idle, the Max-Q lanes' transients and batch-join allocation."
    ),
    served_model_name="Qwen/Qwen3-Next-80B-A3B-Instruct-FP8",
    device_total_bytes=_H200_TOTAL,
    device_reserved_bytes=_H200_RESERVED,
    other_process_bytes=0,  # assumed: the engine is alone on the card
    mem_fraction_static=0.98,  # the outage lane's launch flag (evidence I2)
    weights_bytes=_residual_weights(
        total=_H200_TOTAL,
        reserved=_H200_RESERVED,
        other=0,
        context=_H200_CONTEXT,
        graphs=_H200_QN_GRAPHS,
        kv=_H200_QN_POOL * _QWEN3_NEXT_KV_BYTES,
        mamba=_H200_QN_MAMBA_SLOTS * _QWEN3_NEXT_MAMBA_SLOT,
        idle_free=_H200_QN_IDLE_FREE,
    ),
    kv_pool_tokens=_H200_QN_POOL,
    kv_bytes_per_token=_QWEN3_NEXT_KV_BYTES,
    cuda_context_bytes=_H200_CONTEXT,
    cuda_graph_bytes=_H200_QN_GRAPHS,
    mamba_slots=_H200_QN_MAMBA_SLOTS,
    mamba_bytes_per_slot=_QWEN3_NEXT_MAMBA_SLOT,
    chunked_prefill_size=8192,  # as the outage lane (fixture server-info)
    max_running_requests=32,  # assumed, calibrate
    context_length=524_288,  # as the outage lane (fixture server-info)
    mamba_slots_per_request=1,
    mamba_checkpoint_interval_tokens=0,
    # Assumed, calibrate: ~2x the Max-Q card's compute.
    prefill_tokens_per_s=2 * _MAXQ_PREFILL_TPS,
    prefill_half_speed_context=_MAXQ_PREFILL_HALF,
    decode_tokens_per_s=2 * _MAXQ_DECODE_TPS,
    # Assumed: the same model family and build as maxq-bounded, so its transients (evidence D1, D2, M3).
    activation_bytes_per_token=_ACTIVATION_PER_TOKEN,
    context_bytes_per_token=_CONTEXT_PER_TOKEN,
    gather_bytes_per_token=_GATHER_PER_TOKEN,
    gather_cap_bytes=_GATHER_BOUNDED_CAP,
    unknown_extra_bytes=_UNKNOWN_EXTRA,
    unknown_extra_min_running=2,
)

PROFILES: dict[str, LaneProfile] = {
    p.name: p for p in (MAXQ_OLD, MAXQ_BOUNDED, MAMBA_LANE, H200, H200_QWEN3NEXT)
}


def profile_names() -> list[str]:
    """Names of the shipped profiles, in a stable order."""
    return list(PROFILES)


def get_profile(name: str) -> LaneProfile:
    """The shipped profile called ``name``, or ``<profile>-tp<N>``: that lane with tensor parallelism over
    N GPUs (:func:`tensor_parallel`); a clear error lists the valid names."""
    base, sep, tp = name.rpartition("-tp")
    if sep and tp.isdigit() and int(tp) >= 2 and base in PROFILES:
        return tensor_parallel(PROFILES[base], int(tp), name=name)
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(PROFILES)
        raise KeyError(
            f"unknown lane profile {name!r}; known: {known} (each also as <name>-tp2, -tp4, ...)"
        ) from None
