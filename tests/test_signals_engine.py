"""The SGLang adapter against real SGLang 0.5.23 responses and synthetic older expositions."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from sidecar.core.snapshot import EngineSignals, SourceHealth
from sidecar.signals.engine import (
    METRICS_ACCEPT,
    EngineScraper,
    EngineUnavailable,
    Pacing,
    Sooner,
    make_control_client,
    parse_loads,
    parse_metrics,
    parse_server_info,
    read_metrics,
)

# Real bytes from SGLang 0.5.23 (tests/fixtures/sglang/README.md), with their checksums in SHA256SUMS.
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "sglang"

BASE = "http://sglang.test:30000"


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def fixture_json(name: str) -> dict:
    return json.loads(fixture_text(name))


BUSY = fixture_text("sglang-0.5.23-metrics.txt")
BUSY_OPENMETRICS = fixture_text("sglang-0.5.23-metrics-openmetrics.txt")
IDLE_DENSE = fixture_text("sglang-0.5.23-metrics-idle-dense.txt")
FRESH_DENSE = fixture_text("sglang-0.5.23-metrics-idle-dense-fresh.txt")
LOADS = fixture_json("sglang-0.5.23-v1-loads.json")
SERVER_INFO = fixture_json("sglang-0.5.23-server-info.json")


def test_fixtures_are_the_recorded_bytes() -> None:
    """A fixture "tidied" by an editor (line endings, trailing spaces) would no longer be SGLang's bytes."""
    recorded = dict(
        reversed(line.split(maxsplit=1))
        for line in (FIXTURES / "SHA256SUMS").read_text(encoding="utf-8").splitlines()
    )
    present = sorted(p.name for p in FIXTURES.glob("sglang-*"))
    assert present == sorted(recorded)
    for name in present:
        assert hashlib.sha256((FIXTURES / name).read_bytes()).hexdigest() == recorded[name], name


# --------------------------------------------------------------------------------------------------
# /metrics, real 0.5.23 bytes
# --------------------------------------------------------------------------------------------------

BUSY_HYBRID = {
    "running_requests": 1,
    "queue_requests": 14,
    "full_token_usage": 0.72999923500612,
    "mamba_usage": 0.06,
    "kv_used_tokens": 381702,
    "kv_available_tokens": 141178,
    "kv_evictable_tokens": 0,
    "max_total_tokens": 522880,
    "mamba_used_slots": 3,
    "mamba_available_slots": 47,
    "mamba_evictable_slots": 0,
    "context_len": 524288,
    # sglang:realtime_tokens_total{mode="prefill_compute"}; the page has no prefill_cache series (0).
    "prefill_computed_tokens": 381622,
    "prefill_cached_tokens": 0,
}


def test_busy_hybrid_0_5_23() -> None:
    fields = parse_metrics(BUSY)
    assert fields == BUSY_HYBRID
    # The combined gauge (0.73 = round(max(full, swa, mamba), 2)) is never taken as a pool usage.
    assert fields["full_token_usage"] != 0.73
    signals = EngineSignals(observed_at=0.0, **fields)  # type: ignore[arg-type]
    assert signals.mamba_total_slots == 50
    assert signals.swa_token_usage is None  # the model has no SWA pool (0 slots)


def test_busy_hybrid_reading_keeps_the_scheduler_pid() -> None:
    assert read_metrics(BUSY).pids == frozenset({"21662"})


def test_openmetrics_escaped_names_parse_to_the_same_values() -> None:
    assert "sglang_num_running_reqs{" in BUSY_OPENMETRICS  # the renamed samples, `# TYPE sglang:...`
    assert parse_metrics(BUSY_OPENMETRICS) == parse_metrics(BUSY)
    assert read_metrics(BUSY_OPENMETRICS).pids == frozenset({"21662"})


def test_fresh_dense_server_has_no_load_gauges_and_they_stay_unknown() -> None:
    fields = parse_metrics(FRESH_DENSE)
    assert fields == {"max_total_tokens": 241520, "context_len": 40960}
    signals = EngineSignals(observed_at=0.0, **fields)  # type: ignore[arg-type]
    assert signals.running_requests is None
    assert signals.queue_requests is None
    assert signals.full_token_usage is None
    assert signals.mamba_usage is None


def test_idle_dense_server_reports_real_zeros_but_no_mamba_pool() -> None:
    fields = parse_metrics(IDLE_DENSE)
    assert fields["running_requests"] == 0
    assert fields["queue_requests"] == 0
    assert fields["full_token_usage"] == 0.0
    assert fields["kv_available_tokens"] == 241520
    # SGLang exports mamba_* as 0 for a dense model: a 0-slot pool means no pool, not a full one.
    for absent in ("mamba_usage", "mamba_used_slots", "mamba_available_slots", "swa_token_usage"):
        assert absent not in fields


def test_nan_is_accepted_and_means_not_reported() -> None:
    assert "sglang:fwd_occupancy" in BUSY and " NaN" in BUSY
    text = '# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{tp_rank="0"} NaN\n'
    assert parse_metrics(text) == {}


# --------------------------------------------------------------------------------------------------
# Version mapping, synthetic expositions (names per evidence S2, S3)
# --------------------------------------------------------------------------------------------------

L59 = 'engine_type="unified",model_name="Qwen/Qwen3-Next",moe_ep_rank="0",pp_rank="0",tp_rank="0"'


def gauges(labels: str, values: dict[str, float | str]) -> str:
    lines = []
    for name, value in values.items():
        lines += [f"# HELP sglang:{name} {name}", f"# TYPE sglang:{name} gauge"]
        lines.append(f"sglang:{name}{{{labels}}} {value}")
    return "\n".join(lines) + "\n"


SGLANG_0_5_9 = gauges(
    L59,
    {
        "num_running_reqs": "1.0",
        "num_queue_reqs": "14.0",
        "num_used_tokens": "381702.0",
        # 0.5.9: full-attention usage only, not rounded; no full_token_usage, no kv_*/mamba_*_tokens.
        "token_usage": "0.72999923500612",
        "swa_token_usage": "0.0",
        "mamba_usage": "0.06",
        "max_total_num_tokens": "522880.0",
        "num_running_reqs_offline_batch": "0.0",
        "num_prefill_prealloc_queue_reqs": "0.0",
        "gen_throughput": "41.5",
        "cache_hit_rate": "0.0",
        "engine_startup_time": "0.0",
    },
) + (
    "# TYPE sglang:num_retracted_reqs gauge\n"
    'sglang:num_retracted_reqs{engine_type="unified",model_name="Qwen/Qwen3-Next",moe_ep_rank="0",'
    'pid="4242",pp_rank="0",tp_rank="0"} 0.0\n'
    "# TYPE sglang:http_requests_total counter\n"
    'sglang:http_requests_total{endpoint="/generate",method="POST"} 15.0\n'
)

SGLANG_0_5_1 = gauges(
    'engine_type="unified",model_name="Qwen-32B",pp_rank="0",tp_rank="0"',
    {
        "num_running_reqs": "1.0",
        "num_used_tokens": "90000.0",
        "token_usage": "0.35",
        "gen_throughput": "0.8371284457403783",
        "num_queue_reqs": "3.0",
        "num_grammar_queue_reqs": "0.0",
        "cache_hit_rate": "0.0",
        "spec_accept_length": "0.0",
        "avg_request_queue_latency": "0.1",
        "total_retracted_reqs": "0.0",
    },
)


def test_0_5_9_token_usage_is_the_full_attention_usage() -> None:
    assert parse_metrics(SGLANG_0_5_9) == {
        "running_requests": 1,
        "queue_requests": 14,
        "full_token_usage": 0.72999923500612,
        "swa_token_usage": 0.0,  # 0.5.9 has no swa_*_tokens gauges to tell "no pool" from "empty"
        "mamba_usage": 0.06,
        "kv_used_tokens": 381702,  # `num_used_tokens`, the pre-0.5.14 name
        "max_total_tokens": 522880,
    }


def test_0_5_1_has_no_mamba_or_swa_and_no_pool_size() -> None:
    assert parse_metrics(SGLANG_0_5_1) == {
        "running_requests": 1,
        "queue_requests": 3,
        "full_token_usage": 0.35,
        "kv_used_tokens": 90000,
    }


def test_0_5_14_plus_never_reads_the_combined_token_usage() -> None:
    # A 0.5.23 page that lacks full_token_usage still has the 0.5.14 families: token_usage there
    # is max(full, swa, mamba) and must not stand in for the full-attention usage.
    without_full = "\n".join(line for line in BUSY.splitlines() if "full_token_usage" not in line)
    fields = parse_metrics(without_full)
    assert "full_token_usage" not in fields
    assert fields["mamba_usage"] == 0.06


def test_a_known_version_settles_the_token_usage_meaning() -> None:
    assert "full_token_usage" not in parse_metrics(SGLANG_0_5_9, version="0.5.23")
    assert "kv_used_tokens" not in parse_metrics(SGLANG_0_5_9, version="0.5.14")
    assert parse_metrics(SGLANG_0_5_9, version="0.5.9.post1")["full_token_usage"] == 0.72999923500612


# --------------------------------------------------------------------------------------------------
# Series selection: pid, priority, tp_rank, dp_rank
# --------------------------------------------------------------------------------------------------


def test_pid_labels_are_ignored() -> None:
    text = (
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{model_name="m",pid="101",tp_rank="0"} 4.0\n'
    )
    assert parse_metrics(text) == {"running_requests": 4}
    assert read_metrics(text).pids == frozenset({"101"})


def test_priority_scheduling_uses_the_total_series() -> None:
    text = (
        "# TYPE sglang:num_queue_reqs gauge\n"
        'sglang:num_queue_reqs{model_name="m",priority="",tp_rank="0"} 9.0\n'
        'sglang:num_queue_reqs{model_name="m",priority="0",tp_rank="0"} 4.0\n'
        'sglang:num_queue_reqs{model_name="m",priority="10",tp_rank="0"} 5.0\n'
    )
    assert parse_metrics(text) == {"queue_requests": 9}


def test_only_tp_rank_0_counts() -> None:
    # --enable-metrics-for-all-schedulers: every TP rank repeats the same scheduler state.
    text = (
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{model_name="m",tp_rank="0"} 3.0\n'
        'sglang:num_running_reqs{model_name="m",tp_rank="1"} 3.0\n'
        'sglang:num_running_reqs{model_name="m",tp_rank="2"} 7.0\n'
    )
    assert parse_metrics(text) == {"running_requests": 3}


def test_dp_ranks_sum_counts_and_max_usages() -> None:
    def two_ranks(name: str, a: float, b: float, tp_b: str = "0") -> str:
        return (
            f"# TYPE sglang:{name} gauge\n"
            f'sglang:{name}{{dp_rank="0",model_name="m",tp_rank="0"}} {a}\n'
            f'sglang:{name}{{dp_rank="1",model_name="m",tp_rank="{tp_b}"}} {b}\n'
        )

    text = (
        two_ranks("num_running_reqs", 2, 3)
        + two_ranks("num_queue_reqs", 1, 5)
        + two_ranks("full_token_usage", 0.4, 0.9)
        + two_ranks("mamba_usage", 0.5, 0.2)
        + two_ranks("kv_available_tokens", 1000, 50)
        + two_ranks("max_total_num_tokens", 4000, 4000)
        # With DP attention, DP group 1 is reported by its own attention-TP rank 0, tp_rank="1".
        + two_ranks("mamba_available_tokens", 10, 4, tp_b="1")
    )
    assert parse_metrics(text) == {
        "running_requests": 5,
        "queue_requests": 6,
        "full_token_usage": 0.9,
        "mamba_usage": 0.5,
        "kv_available_tokens": 1050,
        "max_total_tokens": 8000,
        "mamba_available_slots": 14,
    }


@pytest.mark.parametrize(
    "garbage",
    ["<html><body>Not Found</body></html>", '{"detail": "Not Found"}', "hello world", "foo 1\nbar{ 2"],
)
def test_garbage_is_a_value_error(garbage: str) -> None:
    with pytest.raises(ValueError, match="not Prometheus text"):
        parse_metrics(garbage)


# --------------------------------------------------------------------------------------------------
# /v1/loads and /server_info
# --------------------------------------------------------------------------------------------------


def test_loads_0_5_23() -> None:
    assert parse_loads(LOADS) == {
        "running_requests": 1,
        "queue_requests": 14,
        "pending_prefill_tokens": 738389,
        "max_running_requests": 24,
        "max_total_tokens": 522880,
        "version": "0.5.23",
    }


def test_loads_sum_dp_ranks_and_ignore_token_usage() -> None:
    rank = LOADS["loads"][0]
    doc = {**LOADS, "loads": [rank, {**rank, "dp_rank": 1, "num_waiting_uncached_tokens": 11}]}
    values = parse_loads(doc)
    assert values["pending_prefill_tokens"] == 738400
    assert values["running_requests"] == 2
    assert values["max_total_tokens"] == 2 * 522880
    assert not any("usage" in key for key in values)  # /v1/loads token_usage excludes Mamba


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ([], "loads"),
        ({"loads": None}, "loads"),
        ({"loads": ["x"]}, r"loads\[0\]"),
        ({"loads": [{"num_running_reqs": "3"}]}, "num_running_reqs"),
    ],
)
def test_loads_bad_shape(doc: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_loads(doc)


def test_server_info_0_5_23() -> None:
    assert parse_server_info(SERVER_INFO) == {
        "chunked_prefill_size": 8192,
        "max_running_requests": 24,
        "context_len": 524288,
        "max_total_tokens": 522880,
        "gpus": 1,  # tp_size x pp_size: compared with the GPU source's devices (core/facts.py)
        "version": "0.5.23",
    }


def test_server_info_prefers_effective_limits_summed_over_dp() -> None:
    state = SERVER_INFO["internal_states"][0]
    doc = {
        **SERVER_INFO,
        "max_running_requests": None,
        "internal_states": [
            {**state, "effective_max_running_requests_per_dp": 12},
            {**state, "effective_max_running_requests_per_dp": 12},
        ],
    }
    values = parse_server_info(doc)
    assert values["max_running_requests"] == 24
    assert values["max_total_tokens"] == 2 * 522880


def test_server_info_without_internal_states_uses_configured_values() -> None:
    doc = {"max_running_requests": None, "chunked_prefill_size": 4096, "max_total_num_tokens": 1000}
    assert parse_server_info(doc) == {"chunked_prefill_size": 4096, "max_total_tokens": 1000}


# --------------------------------------------------------------------------------------------------
# EngineScraper (respx)
# --------------------------------------------------------------------------------------------------


class FakeClock:
    """Advances one second per reading, so every timestamp is distinct and nothing sleeps."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with make_control_client() as c:
        yield c


def scraper(client: httpx.AsyncClient, clock: Callable[[], float] | None = None) -> EngineScraper:
    return EngineScraper(BASE, client, interval_s=0.001, clock=clock or FakeClock())


def ok_text(text: str) -> httpx.Response:
    return httpx.Response(200, text=text, headers={"content-type": "text/plain; version=0.0.4"})


def mock_engine(respx_mock, metrics: str = BUSY, loads: object = LOADS, info: object = SERVER_INFO):
    return (
        respx_mock.get(f"{BASE}/metrics").mock(return_value=ok_text(metrics)),
        respx_mock.get(f"{BASE}/v1/loads").mock(return_value=httpx.Response(200, json=loads)),
        respx_mock.get(f"{BASE}/server_info").mock(return_value=httpx.Response(200, json=info)),
    )


async def test_poll_once_merges_the_three_endpoints(respx_mock, client) -> None:
    metrics, _, _ = mock_engine(respx_mock)
    signals = await scraper(client).poll_once()
    assert signals == EngineSignals(
        observed_at=1002.0,
        # The counters are dated by the request for the page, before the poll ended.
        prefill_counted_at=1001.0,
        **BUSY_HYBRID,  # type: ignore[arg-type]
        pending_prefill_tokens=738389,
        chunked_prefill_size=8192,
        max_running_requests=24,
        gpus=1,
        version="0.5.23",
        # The scheduler's pid label (the fixture's): which process answered (``LaneWatch._read_carried``).
        pids=("21662",),
        sources=("server_info", "metrics", "loads"),
    )
    assert metrics.calls.last.request.headers["accept"] == METRICS_ACCEPT


async def test_loads_win_over_metrics_for_the_live_counts(respx_mock, client) -> None:
    rank = {**LOADS["loads"][0], "num_running_reqs": 2, "num_waiting_reqs": 13}
    mock_engine(respx_mock, loads={**LOADS, "loads": [rank]})
    signals = await scraper(client).poll_once()
    assert (signals.running_requests, signals.queue_requests) == (2, 13)


async def test_fresh_server_without_loads_reports_unknown_counts(respx_mock, client) -> None:
    mock_engine(respx_mock, metrics=FRESH_DENSE)
    respx_mock.get(f"{BASE}/v1/loads").mock(return_value=httpx.Response(404))
    signals = await scraper(client).poll_once()
    assert signals.running_requests is None
    assert signals.queue_requests is None
    assert signals.max_total_tokens == 241520  # /metrics wins over the once-read /server_info


async def test_loads_404_is_remembered_until_the_engine_restarts(respx_mock, client) -> None:
    metrics, _, info = mock_engine(respx_mock)
    loads = respx_mock.get(f"{BASE}/v1/loads").mock(return_value=httpx.Response(404))
    s = scraper(client)

    first = await s.poll_once()
    second = await s.poll_once()
    assert loads.call_count == 1
    assert info.call_count == 1  # /server_info is read once, not every poll
    assert first.pending_prefill_tokens is None and "loads" not in second.sources

    metrics.mock(side_effect=httpx.ConnectError("[Errno 111] Connection refused"))
    with pytest.raises(EngineUnavailable):
        await s.poll_once()
    metrics.mock(side_effect=None, return_value=ok_text(BUSY))
    await s.poll_once()
    assert loads.call_count == 2  # re-probed after the restart
    assert info.call_count == 2


@pytest.mark.parametrize(
    "changed",
    [BUSY.replace('pid="21662"', 'pid="31337"'), BUSY.replace("522880.0", "400000.0")],
    ids=["pid", "pool-size"],
)
async def test_a_changed_pid_or_pool_means_a_new_engine(respx_mock, client, changed: str) -> None:
    metrics, _, info = mock_engine(respx_mock)
    s = scraper(client)
    await s.poll_once()
    await s.poll_once()
    assert info.call_count == 1
    metrics.mock(return_value=ok_text(changed))
    await s.poll_once()
    assert info.call_count == 2


async def test_server_info_falls_back_to_get_server_info(respx_mock, client) -> None:
    mock_engine(respx_mock)
    new = respx_mock.get(f"{BASE}/server_info").mock(return_value=httpx.Response(404))
    old = respx_mock.get(f"{BASE}/get_server_info").mock(return_value=httpx.Response(200, json=SERVER_INFO))
    s = scraper(client)
    signals = await s.poll_once()
    assert signals.chunked_prefill_size == 8192
    await s.poll_once()
    assert (new.call_count, old.call_count) == (1, 1)


async def test_server_info_failure_is_retried_without_failing_the_poll(respx_mock, client) -> None:
    _, _, info = mock_engine(respx_mock)
    info.mock(side_effect=[httpx.Response(503), httpx.Response(200, json=SERVER_INFO)])
    s = scraper(client)
    first = await s.poll_once()
    assert first.chunked_prefill_size is None and first.running_requests == 1
    second = await s.poll_once()
    assert second.chunked_prefill_size == 8192


async def test_connection_error_is_engine_unavailable(respx_mock, client) -> None:
    respx_mock.get(f"{BASE}/metrics").mock(side_effect=httpx.ConnectError("[Errno 111] Connection refused"))
    with pytest.raises(EngineUnavailable) as info:
        await scraper(client).poll_once()
    assert info.value.message.startswith(f"GET {BASE}/metrics: cannot connect")
    assert "Connection refused" in info.value.message
    assert "is SGLang running" in info.value.message


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (httpx.Response(404), f"GET {BASE}/metrics: 404 — is SGLang started with --enable-metrics?"),
        (httpx.Response(500), f"GET {BASE}/metrics: 500 Internal Server Error"),
        (httpx.Response(307, headers={"location": "/metrics/"}), "307 Temporary Redirect to /metrics/"),
        (httpx.Response(200, text="<html>hello</html>"), "the response is not Prometheus text"),
        (httpx.Response(200, text="up 1\nprocess_cpu_seconds_total 3\n"), "an SGLang server?"),
    ],
    ids=["metrics-disabled", "server-error", "redirect", "html", "not-sglang"],
)
async def test_unusable_metrics_say_what_is_wrong(
    respx_mock, client, response: httpx.Response, expected: str
) -> None:
    respx_mock.get(f"{BASE}/metrics").mock(return_value=response)
    with pytest.raises(EngineUnavailable) as info:
        await scraper(client).poll_once()
    assert expected in info.value.message


async def test_timeout_is_engine_unavailable(respx_mock, client) -> None:
    respx_mock.get(f"{BASE}/metrics").mock(side_effect=httpx.ReadTimeout("timed out"))
    with pytest.raises(EngineUnavailable, match="timed out"):
        await scraper(client).poll_once()


async def test_default_client_keeps_no_cookies_and_ignores_proxy_env(respx_mock) -> None:
    metrics, _, _ = mock_engine(respx_mock)
    metrics.mock(return_value=httpx.Response(200, text=BUSY, headers={"set-cookie": "session=abc; Path=/"}))
    s = EngineScraper(BASE, interval_s=0.001)
    try:
        assert s._client.trust_env is False and s._client.follow_redirects is False
        await s.poll_once()
        await s.poll_once()
        assert "cookie" not in metrics.calls.last.request.headers
    finally:
        await s.aclose()


def test_scraper_rejects_a_url_without_scheme() -> None:
    with pytest.raises(ValueError, match="http://"):
        EngineScraper("localhost:30000")


# --------------------------------------------------------------------------------------------------
# run(): health reporting, survival, cancellation
# --------------------------------------------------------------------------------------------------


async def collect(run, n: int, on_each: Callable[[object, SourceHealth], None] | None = None) -> list:
    """Run a poller until it has reported ``n`` attempts, then cancel it."""
    updates: list[tuple[object, SourceHealth]] = []
    enough = asyncio.Event()

    def on_update(value: object, health: SourceHealth) -> None:
        updates.append((value, health))
        if len(updates) >= n:
            enough.set()
        if on_each is not None:
            on_each(value, health)

    task = asyncio.create_task(run(on_update))
    try:
        await asyncio.wait_for(enough.wait(), timeout=10)  # a safety net, not a timed assertion
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    return updates[:n]


async def test_run_reports_failures_and_recovery(respx_mock, client) -> None:
    metrics, _, _ = mock_engine(respx_mock)
    refused = httpx.ConnectError("[Errno 111] Connection refused")
    metrics.mock(side_effect=[refused, refused, ok_text(BUSY), refused] + [ok_text(BUSY)] * 100)

    updates = await collect(scraper(client).run, 4)

    (v0, h0), (v1, h1), (v2, h2), (v3, h3) = updates
    assert v0 is None and h0.consecutive_failures == 1 and h0.last_ok_at is None
    assert h0.last_error is not None and "cannot connect" in h0.last_error
    assert v1 is None and h1.consecutive_failures == 2
    assert isinstance(v2, EngineSignals) and v2.queue_requests == 14
    assert h2 == SourceHealth(last_ok_at=h2.last_ok_at, last_error=None, consecutive_failures=0)
    assert h2.last_ok_at is not None
    assert v3 is None and h3.consecutive_failures == 1 and h3.last_ok_at == h2.last_ok_at


async def test_run_survives_unexpected_errors_and_a_failing_callback(respx_mock, client) -> None:
    metrics, _, _ = mock_engine(respx_mock)
    metrics.mock(side_effect=[RuntimeError("boom"), *[ok_text(BUSY)] * 100])
    calls = 0

    def explode_once(value: object, health: SourceHealth) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("callback bug")

    updates = await collect(scraper(client).run, 3, explode_once)
    assert updates[0][0] is None and updates[0][1].last_error == "boom"
    assert all(isinstance(v, EngineSignals) for v, _ in updates[1:])


# --- the scrape's size bound, and parsing off the event loop -------------------------------------


def metrics_server(page: bytes, *, chunked: bool) -> object:
    """A real server whose /metrics answers ``page``, with a Content-Length or chunked (none)."""

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "lifespan":
            from tests.harness import answer_lifespan

            await answer_lifespan(receive, send)
            return
        headers = [(b"content-type", b"text/plain; version=0.0.4")]
        if not chunked:
            headers.append((b"content-length", str(len(page)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if chunked:
            for i in range(0, len(page), 16384):
                await send({"type": "http.response.body", "body": page[i : i + 16384], "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        else:
            await send({"type": "http.response.body", "body": page})

    return app


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_metrics_page_over_the_bound_is_a_failed_scrape(chunked: bool) -> None:
    from tests.harness import serve

    page = BUSY.encode()
    async with serve(metrics_server(page, chunked=chunked)) as url:
        async with EngineScraper(url, max_metrics_bytes=len(page)) as scraper:
            assert (await scraper.poll_once()).running_requests == 1
        async with EngineScraper(url, max_metrics_bytes=len(page) - 1) as scraper:
            with pytest.raises(
                EngineUnavailable, match=r"over the [\d,]+-byte bound.*engine\.max_metrics_bytes"
            ):
                await scraper.poll_once()


async def test_metrics_are_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import sidecar.signals.engine as engine_module
    from tests.harness import serve

    threads: list[threading.Thread] = []
    real = engine_module.read_metrics

    def spy(text: str, *, version: str | None = None):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread())
        return real(text, version=version)

    monkeypatch.setattr(engine_module, "read_metrics", spy)
    async with serve(metrics_server(BUSY.encode(), chunked=False)) as url, EngineScraper(url) as scraper:
        assert (await scraper.poll_once()).kv_available_tokens == 141178
    assert threads and threading.current_thread() not in threads


async def test_a_large_json_answer_is_parsed_off_the_event_loop(respx_mock, client, monkeypatch) -> None:
    """/server_info (46 KB in SGLang 0.5.23) is ~1 ms of ``json.loads``: on the pollers' own thread,
    never the loop's, where it would hold every request behind it at each engine start."""
    import threading

    import sidecar.signals.engine as engine_module
    from sidecar.signals.worker import THREAD_NAME_PREFIX

    parsed: list[tuple[int, threading.Thread]] = []
    real = engine_module.json_of

    def spy(content: bytes) -> object:
        parsed.append((len(content), threading.current_thread()))
        return real(content)

    monkeypatch.setattr(engine_module, "json_of", spy)
    mock_engine(respx_mock)
    signals = await scraper(client).poll_once()
    assert signals.chunked_prefill_size == 8192  # read from /server_info, parsed where it was parsed
    big = [thread for size, thread in parsed if size >= engine_module.JSON_OFF_LOOP_BYTES]
    assert len(json.dumps(SERVER_INFO)) >= engine_module.JSON_OFF_LOOP_BYTES and big
    assert all(t is not threading.current_thread() and t.name.startswith(THREAD_NAME_PREFIX) for t in big)


def test_the_line_filter_changes_no_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropping the series nobody reads before parsing gives the same reading on every fixture."""
    import sidecar.signals.engine as engine_module

    def seen(texts: tuple[str, ...]) -> list[tuple[object, ...]]:
        return [(r.fields, r.pids, r.sglang_families > 0) for r in map(read_metrics, texts)]

    texts = (BUSY, BUSY_OPENMETRICS, IDLE_DENSE, FRESH_DENSE)
    filtered = seen(texts)
    monkeypatch.setattr(engine_module, "_relevant_lines", lambda text: text)
    assert filtered == seen(texts)


# --- reads sooner than the interval while the gate wants them (Pacing, Sooner) --------------------


def test_pacing_reads_every_interval_and_sooner_only_while_wanted() -> None:
    p = Pacing()
    assert p.next_read(0.5, 0.05, False) == (-math.inf, False)  # the first read: at once
    p.began(10.0, False)
    assert p.next_read(0.5, 0.05, False) == (10.5, False)
    assert p.next_read(0.5, 0.0, True) == (10.5, False)  # gap 0: never sooner
    # Wanted: the first read the gate asks for is due at once, however recent the periodic one.
    assert p.next_read(0.5, 0.05, True) == (-math.inf, True)
    p.began(10.01, True)
    assert p.next_read(0.5, 0.05, True) == (pytest.approx(10.06), True)
    p.began(10.06, True)
    assert p.next_read(0.5, 0.05, False) == (10.56, False)  # no longer wanted: one interval on
    # A gap longer than what is left of the interval: the periodic read comes first.
    assert p.next_read(0.5, 0.6, True) == (10.56, False)


def blocking_metrics_server(started: list[int], inflight: list[int], release: asyncio.Queue) -> object:
    """/metrics answers only when the test puts an event in ``release``; counts reads, and the most
    at once in ``inflight[1]``. Everything else is 404 (a pre-0.5.9 engine)."""

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "lifespan":
            from tests.harness import answer_lifespan

            await answer_lifespan(receive, send)
            return
        if scope["path"] != "/metrics":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        started[0] += 1
        inflight[0] += 1
        inflight[1] = max(inflight[1], inflight[0])
        try:
            await release.get()
        finally:
            inflight[0] -= 1
        page = BUSY.encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", str(len(page)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": page})

    return app


async def test_a_burst_of_nudges_during_a_scrape_makes_one_more_scrape_never_two_at_once() -> None:
    """Fifty responses ending while a scrape is on its way: the scraper waits for it, then scrapes
    once more (the gate still wants a report), and never has two scrapes open at once."""
    from tests.harness import eventually, serve

    started, inflight = [0], [0, 0]
    release: asyncio.Queue = asyncio.Queue()
    wanted = [False]
    updates: list[EngineSignals | None] = []
    async with (
        serve(blocking_metrics_server(started, inflight, release)) as url,
        EngineScraper(url, interval_s=60) as scraper,
    ):
        scraper.sooner = Sooner(lambda: wanted[0], lambda: 0.05)
        task = asyncio.create_task(scraper.run(lambda v, h: updates.append(v)))
        try:
            await eventually(lambda: started[0] == 1)
            wanted[0] = True
            for _ in range(50):
                scraper.sooner.nudge()
            await release.put(None)
            await eventually(lambda: started[0] == 2)  # the one more, while the poll is 60 s away
            assert inflight == [1, 1] and scraper.sooner.reads == 1 and len(updates) == 1
            for _ in range(50):
                scraper.sooner.nudge()
            wanted[0] = False
            await release.put(None)
            await eventually(lambda: len(updates) == 2)
            assert started[0] == 2 and inflight[1] == 1 and scraper.sooner.reads == 1
            assert all(isinstance(u, EngineSignals) for u in updates)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
