"""SGLang 0.5.23's observable surface for the emulator: ``/metrics``, ``/v1/loads``, ``/server_info``.

The shapes follow ``tests/fixtures/sglang/sglang-0.5.23-*`` (real output of SGLang's own classes): metric
names keep the ``sglang:`` prefix, labels are sorted (``engine_type,model_name,moe_ep_rank,pp_rank,
tp_rank``), values are floats, histograms list ``_sum``, the buckets, then ``_count``. Rendering goes
through ``prometheus_client`` itself, so content negotiation behaves like SGLang's: plain text keeps the
colon, an OpenMetrics ``Accept`` header gets ``sglang_...`` sample names (evidence F7).

Scheduler gauges come from :meth:`EngineModel.published_gauges` - the last report, absent on a fresh
engine - never from the live state. Tokenizer- and HTTP-side series (TTFT, token counters, HTTP
requests) are live, as in SGLang, and are kept by :class:`FrontendMetrics`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from sidecar_emulator.engine import BASE_VERSION, EngineModel
from sidecar_emulator.events import Gauges
from sidecar_emulator.profiles import GiB, LaneProfile

SGLANG_VERSION = BASE_VERSION  # before an upgrade: ``EngineModel.version`` is what it reports
TTFT_BUCKETS = (
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
    10.0,
    20.0,
    40.0,
    60.0,
    80.0,
    100.0,
    200.0,
    400.0,
)
QUEUE_TIME_BUCKETS = (
    0.0,
    0.001,
    0.005,
    0.01,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    3.0,
    4.0,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    70.0,
    80.0,
    90.0,
    100.0,
    200.0,
    300.0,
    400.0,
    500.0,
    600.0,
    700.0,
    800.0,
    900.0,
    1000.0,
    1200.0,
    1400.0,
    1600.0,
    1800.0,
    2000.0,
    2500.0,
    3000.0,
)
GRAPH_PHASES = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend")
# Fixture values (illustrative): SGLang reports these once per process.
STARTUP_TIME = {
    "load_weight": 61.4,
    "kv_cache_allocation": 2.7,
    "scheduler_e2e": 118.9,
    "tokenizer_e2e": 131.6,
}
BASE_PID = 21662  # fixture pid; the emulator adds the restart count, so the label changes on restart


@dataclass
class _Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
        self.total += value
        self.n += 1


@dataclass
class FrontendMetrics:
    """Live tokenizer-manager and HTTP series; a new one per engine process (reset on restart)."""

    prompt_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    generation_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    num_requests: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    cached_tokens: int = 0
    aborted: int = 0
    ttft: dict[str, _Histogram] = field(default_factory=dict)
    http_requests: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    http_responses: dict[tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    http_active: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))

    def observe_ttft(self, seconds: float, streaming: bool) -> None:
        key = "true" if streaming else "false"
        self.ttft.setdefault(key, _Histogram(TTFT_BUCKETS)).observe(seconds)

    def observe_finished(self, prompt: int, completion: int, cached: int, streaming: bool) -> None:
        key = "true" if streaming else "false"
        self.prompt_tokens[key] += prompt
        self.generation_tokens[key] += completion
        self.num_requests[key] += 1
        self.cached_tokens += cached


def scheduler_labels(profile: LaneProfile) -> dict[str, str]:
    return {
        "engine_type": "unified",
        "model_name": profile.served_model_name,
        "moe_ep_rank": "0",
        "pp_rank": "0",
        "tp_rank": "0",
    }


def tokenizer_labels(profile: LaneProfile) -> dict[str, str]:
    return {"engine_type": "unified", "model_name": profile.served_model_name}


def _gb(nbytes: int) -> float:
    return round(nbytes / GiB, 2)


def _gauge(name: str, doc: str, value: float, labels: dict[str, str]) -> Metric:
    m = Metric(name, doc, "gauge")
    m.add_sample(name, labels, float(value))
    return m


def _histogram(name: str, doc: str, hist: Iterable[tuple[dict[str, str], _Histogram]]) -> Metric:
    m = Metric(name, doc, "histogram")
    for labels, h in hist:
        m.add_sample(name + "_sum", labels, h.total)
        counts = h.counts or [0] * len(h.buckets)
        for upper, count in zip(h.buckets, counts, strict=True):
            m.add_sample(name + "_bucket", {**labels, "le": _le(upper)}, float(count))
        m.add_sample(name + "_bucket", {**labels, "le": "+Inf"}, float(h.n))
        m.add_sample(name + "_count", labels, float(h.n))
    return m


def _le(upper: float) -> str:
    return repr(float(upper))


# Gauges in the order SGLang's fixture lists them, with their HELP texts (evidence S5).
_LOAD_GAUGES: tuple[tuple[str, str], ...] = (
    ("num_running_reqs", "The number of running requests."),
    ("num_queue_reqs", "The number of requests in the waiting queue."),
    ("num_grammar_queue_reqs", "The number of requests in the grammar waiting queue."),
    ("gen_throughput", "The generation throughput (token/s)."),
    ("cache_hit_rate", "The prefix cache hit rate."),
    ("decode_sum_seq_lens", "The sum of all sequence lengths in decode."),
    ("token_usage", "The token usage."),
    ("full_token_usage", "The token usage for full attention layers."),
    ("swa_token_usage", "The token usage for SWA layers."),
    ("mamba_usage", "The token usage for Mamba layers."),
    ("num_used_tokens", "The number of used tokens."),
    ("kv_available_tokens", "Number of free token slots in the KV cache pool."),
    ("kv_evictable_tokens", "Number of evictable (radix-cached) token slots in the KV cache pool."),
    ("kv_used_tokens", "Number of actively used token slots in the KV cache pool."),
    ("swa_available_tokens", "Number of free token slots in the SWA pool (hybrid-SWA only)."),
    ("swa_evictable_tokens", "Number of evictable (radix-cached) token slots in the SWA pool."),
    ("swa_used_tokens", "Number of actively used token slots in the SWA pool."),
    ("mamba_available_tokens", "Number of free state slots in the mamba SSM pool (hybrid-SSM only)."),
    ("mamba_evictable_tokens", "Number of evictable (radix-cached) state slots in the mamba SSM pool."),
    ("mamba_used_tokens", "Number of actively used state slots in the mamba SSM pool."),
    ("utilization", "The utilization."),
    ("fwd_occupancy", "Forward pass GPU occupancy percentage."),
    ("new_token_ratio", "The new token ratio."),
)


def gauge_values(g: Gauges) -> dict[str, float]:
    """The value of each ``sglang:<name>`` load gauge for a published report."""
    return {
        "num_running_reqs": g.num_running_reqs,
        "num_queue_reqs": g.num_queue_reqs,
        "num_grammar_queue_reqs": 0,
        "gen_throughput": g.gen_throughput,
        "cache_hit_rate": g.cache_hit_rate,
        "decode_sum_seq_lens": g.decode_sum_seq_lens,
        "token_usage": g.token_usage,
        "full_token_usage": g.full_token_usage,
        "swa_token_usage": 0.0,
        "mamba_usage": g.mamba_usage,
        "num_used_tokens": g.num_used_tokens,
        "kv_available_tokens": g.kv_available_tokens,
        "kv_evictable_tokens": g.kv_evictable_tokens,
        "kv_used_tokens": g.kv_used_tokens,
        "swa_available_tokens": 0,
        "swa_evictable_tokens": 0,
        "swa_used_tokens": 0,
        "mamba_available_tokens": g.mamba_available_tokens,
        "mamba_evictable_tokens": g.mamba_evictable_tokens,
        "mamba_used_tokens": g.mamba_used_tokens,
        "utilization": 0.0,  # always 0 in 0.5.23 (tests/fixtures/sglang/README.md, item 5)
        "fwd_occupancy": math.nan,  # NaN without SGLANG_ENABLE_METRICS_DEVICE_TIMER (item 3)
        "new_token_ratio": g.new_token_ratio,
    }


class EngineCollector(Collector):
    """A prometheus_client collector over the engine model and the frontend metrics."""

    def __init__(self, model: EngineModel, frontend: FrontendMetrics) -> None:
        self.model = model
        self.frontend = frontend

    def collect(self) -> Iterator[Metric]:
        model, fe = self.model, self.frontend
        p = model.profile
        base = scheduler_labels(p)
        tok = tokenizer_labels(p)

        startup = Metric(
            "sglang:startup_time_seconds", "Engine startup duration by phase in seconds.", "gauge"
        )
        for phase, seconds in STARTUP_TIME.items():
            startup.add_sample("sglang:startup_time_seconds", {**tok, "phase": phase}, seconds)
        yield startup
        yield _gauge(
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
            p.kv_pool_tokens,
            base,
        )
        yield _gauge(
            "sglang:weight_memory_usage_gb", "Memory used by model weights in GB.", _gb(p.weights_bytes), base
        )
        yield _gauge(
            "sglang:kv_cache_memory_usage_gb",
            "Memory used by the KV cache pools in GB.",
            _gb(p.kv_pool_bytes + p.mamba_pool_bytes),
            base,
        )
        graphs = Metric(
            "sglang:graph_memory_usage_gb", "Memory used by captured device graphs in GB.", "gauge"
        )
        for phase in GRAPH_PHASES:
            value = _gb(p.cuda_graph_bytes) if phase == "decode" else 0.0
            graphs.add_sample("sglang:graph_memory_usage_gb", {**base, "phase": phase}, value)
        yield graphs
        yield _gauge("sglang:page_size", "KV cache page size in tokens.", p.page_size, base)
        yield _gauge("sglang:num_pages", "Number of KV cache pages.", p.kv_pool_tokens // p.page_size, base)
        yield _gauge("sglang:context_len", "Maximum context length.", p.context_length, base)
        yield _gauge(
            "sglang:startup_available_gpu_memory_gb",
            "Available GPU memory in GB at startup.",
            _gb(p.startup_available_bytes),
            base,
        )

        published = model.published_gauges()
        if published is not None:
            values = gauge_values(published)
            for name, doc in _LOAD_GAUGES:
                yield _gauge(f"sglang:{name}", doc, values[name], base)

        if fe.ttft:
            yield _histogram(
                "sglang:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                ((({**tok, "is_streaming": k}), h) for k, h in sorted(fe.ttft.items())),
            )
        queue = _Histogram(QUEUE_TIME_BUCKETS)
        for seconds in model.counters.queue_times:
            queue.observe(seconds)
        if queue.n:
            yield _histogram(
                "sglang:queue_time_seconds", "Histogram of queueing time in seconds.", [(base, queue)]
            )

        if published is not None:
            pid = {**base, "pid": str(BASE_PID + model.restarts)}
            yield _gauge(
                "sglang:num_retracted_reqs",
                "The number of retracted requests.",
                published.num_retracted_reqs,
                pid,
            )

        c = model.counters
        retracted = Metric("sglang:num_retracted_requests", "Total number of retracted requests.", "counter")
        retracted.add_sample("sglang:num_retracted_requests_total", base, float(c.retracted_requests))
        yield retracted
        realtime = Metric(
            "sglang:realtime_tokens",
            "Total number of tokens processed (updated on each log interval). mode: prefill_compute, "
            "prefill_cache, decode.",
            "counter",
        )
        for mode, value in (
            ("prefill_compute", c.prefill_compute_tokens),
            ("prefill_cache", c.prefill_cache_tokens),
            ("decode", c.decode_tokens),
        ):
            realtime.add_sample("sglang:realtime_tokens_total", {**base, "mode": mode}, float(value))
        yield realtime

        for name, doc, series in (
            ("prompt_tokens", "Number of prefill tokens processed.", fe.prompt_tokens),
            ("generation_tokens", "Number of generation tokens processed.", fe.generation_tokens),
            ("num_requests", "Number of requests processed.", fe.num_requests),
        ):
            if series:
                m = Metric(f"sglang:{name}", doc, "counter")
                for streaming, value in sorted(series.items()):
                    m.add_sample(f"sglang:{name}_total", {**tok, "is_streaming": streaming}, float(value))
                yield m
        if fe.num_requests:
            m = Metric(
                "sglang:cached_tokens",
                "Number of cached prompt tokens by source (device/host/storage).",
                "counter",
            )
            m.add_sample(
                "sglang:cached_tokens_total", {**tok, "cache_source": "device"}, float(fe.cached_tokens)
            )
            yield m
        if fe.aborted:
            m = Metric("sglang:num_aborted_requests", "Number of requests aborted.", "counter")
            m.add_sample("sglang:num_aborted_requests_total", tok, float(fe.aborted))
            yield m

        if fe.http_requests:
            m = Metric(
                "sglang:http_requests", "Total number of HTTP requests by endpoint and method", "counter"
            )
            for (endpoint, method), value in fe.http_requests.items():
                m.add_sample(
                    "sglang:http_requests_total", {"endpoint": endpoint, "method": method}, float(value)
                )
            yield m
        if fe.http_responses:
            m = Metric(
                "sglang:http_responses",
                "Total number of HTTP responses by endpoint and status code",
                "counter",
            )
            for (endpoint, method, status), value in fe.http_responses.items():
                labels = {"endpoint": endpoint, "method": method, "status_code": status}
                m.add_sample("sglang:http_responses_total", labels, float(value))
            yield m
        yield _gauge(
            "sglang:routing_keys_active", "Number of unique routing keys with active requests", 0.0, {}
        )
        if fe.http_active:
            m = Metric("sglang:http_requests_active", "Number of currently active HTTP requests", "gauge")
            for (endpoint, method), value in fe.http_active.items():
                m.add_sample(
                    "sglang:http_requests_active", {"endpoint": endpoint, "method": method}, float(value)
                )
            yield m


def render_metrics(
    model: EngineModel, frontend: FrontendMetrics, accept: str | None = None
) -> tuple[bytes, str]:
    """The ``/metrics`` body and content type, negotiated the way SGLang's prometheus_client does."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(EngineCollector(model, frontend)), content_type


def loads_json(
    model: EngineModel,
    *,
    wall_time: Callable[[float], float] | None = None,
    accelerator: str = "Emulated GPU (sglang-sidecar)",
) -> dict[str, object]:
    """``GET /v1/loads`` (0.5.23 field set, ``dp_rank`` 0 only).

    ``wall_time`` maps engine time to Unix time (the server's clock); SGLang stamps each load with
    the Unix time it was published and the response with an ISO-8601 time of the request.
    """
    p = model.profile
    s = model.loads_snapshot()
    to_wall = wall_time or (lambda t: t)
    now = datetime.fromtimestamp(to_wall(model.now), tz=UTC).isoformat()
    total = s.num_used_tokens + s.num_waiting_uncached_tokens
    load = {
        "timestamp": to_wall(s.t),
        "dp_rank": 0,
        "num_running_reqs": s.num_running_reqs,
        "num_waiting_reqs": s.num_waiting_reqs,
        "num_waiting_uncached_tokens": s.num_waiting_uncached_tokens,
        "num_used_tokens": s.num_used_tokens,
        "num_total_tokens": total,
        "num_active_tokens": total,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": s.max_total_num_tokens,
        "max_running_requests": s.max_running_requests,
        "token_usage": s.kv_token_usage,
        "gen_throughput": s.gen_throughput,
        "cache_hit_rate": s.cache_hit_rate,
        "utilization": 0.0,
        "total_prefill_uncached_tokens": s.total_prefill_uncached_tokens,
        "total_prefill_busy_us": s.total_prefill_busy_us,
        "decode_moments": [],
        "memory": {
            "weight_gb": _gb(p.weights_bytes),
            "kv_cache_gb": _gb(p.kv_pool_bytes + p.mamba_pool_bytes),
            "graph_gb": _gb(p.cuda_graph_bytes),
            "token_capacity": p.kv_pool_tokens,
        },
        "disaggregation": {
            "mode": "null",
            "prefill_bootstrap_queue_reqs": 0,
            "prefill_inflight_queue_reqs": 0,
            "decode_prealloc_queue_reqs": 0,
            "decode_transfer_queue_reqs": 0,
            "decode_retracted_queue_reqs": 0,
            "kv_transfer_speed_gb_s": 0.0,
            "kv_transfer_latency_ms": 0.0,
        },
        "queues": {
            "waiting": s.num_waiting_reqs,
            "grammar": 0,
            "paused": 0,
            "retracted": s.num_retracted_waiting,
            "prealloc_ready": 0,
        },
    }
    return {
        "timestamp": now,
        "version": model.version,
        "accelerator": accelerator,
        "num_accelerators": 1,
        "loads": [load],
    }


def loads_prometheus(model: EngineModel, *, wall_time: Callable[[float], float] | None = None) -> str:
    """``GET /v1/loads?format=prometheus``: ``sglang_<field>{dp_rank="0"}`` lines (fixture shape)."""
    load = loads_json(model, wall_time=wall_time)["loads"][0]  # type: ignore[index]
    assert isinstance(load, dict)
    lines: list[str] = []

    def emit(name: str, value: object) -> None:
        lines.append(f"# TYPE sglang_{name} gauge")
        lines.append(f'sglang_{name}{{dp_rank="0"}} {value}')

    for key, value in load.items():
        if key in ("dp_rank", "decode_moments"):
            continue
        if isinstance(value, dict):
            prefix = {"disaggregation": "disagg"}.get(key, key)
            for sub, v in value.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    emit(f"{prefix}_{sub}", v)
        elif isinstance(value, (int, float)):
            emit(key, value)
    return "\n".join(lines) + "\n"


def server_info(model: EngineModel) -> dict[str, object]:
    """``GET /server_info`` (and ``/get_server_info``): the fields a scraper reads, 0.5.23 names."""
    p = model.profile
    args = {
        "model_path": p.served_model_name,
        "served_model_name": p.served_model_name,
        "context_length": p.context_length,
        "mem_fraction_static": p.mem_fraction_static,
        "max_running_requests": p.max_running_requests,
        "max_queued_requests": None,
        "max_total_tokens": None,
        "chunked_prefill_size": p.chunked_prefill_size,
        "max_prefill_tokens": 16384,
        "schedule_policy": "fcfs",
        "schedule_conservativeness": 1.0,
        "page_size": p.page_size,
        "kv_cache_dtype": p.kv_cache_dtype,
        "tp_size": 1,
        "pp_size": 1,
        "dp_size": 1,
        "disable_radix_cache": False,
        "enable_metrics": True,
        "decode_log_interval": p.decode_log_interval,
        "max_mamba_cache_size": p.mamba_slots or None,
    }
    internal = {
        **args,
        "effective_max_running_requests_per_dp": p.effective_max_running_requests,
        "last_gen_throughput": model.loads_snapshot().gen_throughput,
        "memory_usage": {
            "weight": _gb(p.weights_bytes),
            "kvcache": _gb(p.kv_pool_bytes + p.mamba_pool_bytes),
            "startup_available": _gb(p.startup_available_bytes),
            "token_capacity": p.kv_pool_tokens,
            "token_capacity_swa": None,
            "graph": {
                phase: (_gb(p.cuda_graph_bytes) if phase == "decode" else 0.0) for phase in GRAPH_PHASES
            },
        },
    }
    return {
        **args,
        "max_total_num_tokens": p.kv_pool_tokens,
        "max_req_input_len": p.max_req_input_len,
        "internal_states": [internal],
        "version": model.version,
        "frontend": "python",
        "emulator": {"profile": p.name, "seed": model.seed, "restarts": model.restarts},
    }
