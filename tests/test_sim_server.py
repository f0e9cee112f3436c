"""The emulator over real HTTP (uvicorn on 127.0.0.1): SGLang's shapes, streams, disconnects, crashes."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar_emulator.engine import EngineModel
from sidecar_emulator.exposition import FrontendMetrics, gauge_values, render_metrics
from sidecar_emulator.profiles import LaneProfile, get_profile
from sidecar_emulator.server import EmulatorServer, build_emulator_app, parse_generation

# SGLang's real responses, kept in tests/fixtures/sglang (see its README).
FIXTURES = Path(__file__).parent / "fixtures" / "sglang"


async def eventually(check: Callable[[], bool | Awaitable[bool]], what: str, limit_s: float = 10.0) -> None:
    """Poll until ``check`` holds; the limit only guards against hanging, it is not a timing claim."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def sse_payloads(lines: list[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


async def start(
    profile: LaneProfile, speed: float, gpu_file: Path | None = None, down_mode: str = "refuse"
) -> EmulatorServer:
    model = EngineModel(profile, seed=1)
    server = EmulatorServer(build_emulator_app(model, speed, gpu_file, down_mode=down_mode))
    await server.start()
    return server


@pytest.fixture
async def h200() -> AsyncIterator[EmulatorServer]:
    server = await start(get_profile("h200"), speed=50.0)
    yield server
    await server.stop()


# ------------------------------------------------------------------------------------ shapes
async def test_generate_json_and_sse(h200: EmulatorServer) -> None:
    async with httpx.AsyncClient(base_url=h200.url, timeout=30) as client:
        r = await client.post(
            "/generate", json={"text": "hello " * 100, "sampling_params": {"max_new_tokens": 12}}
        )
        assert r.status_code == 200
        body = r.json()
        meta = body["meta_info"]
        assert meta["prompt_tokens"] == len(("hello " * 100).encode()) // 4
        assert meta["completion_tokens"] == 12 and meta["cached_tokens"] == 0
        assert meta["finish_reason"] == {"type": "length", "length": 12}
        assert isinstance(body["text"], str) and len(body["output_ids"]) > 0

        request = {"input_ids": list(range(300)), "sampling_params": {"max_new_tokens": 30}, "stream": True}
        async with client.stream("POST", "/generate", json=request) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in s.aiter_lines() if line]
        payloads = sse_payloads(lines)
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
        assert chunks[-1]["meta_info"]["completion_tokens"] == 30
        assert chunks[-1]["meta_info"]["prompt_tokens"] == 300
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
        assert chunks[-1]["text"].startswith(chunks[0]["text"])  # SGLang streams cumulative text


async def test_openai_endpoints(h200: EmulatorServer) -> None:
    async with httpx.AsyncClient(base_url=h200.url, timeout=30) as client:
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "abcd" * 50, "max_tokens": 5})
        assert r.status_code == 200
        body = r.json()
        assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] == 50 and body["usage"]["completion_tokens"] == 5

        request = {
            "messages": [{"role": "user", "content": "hi " * 40}],
            "max_tokens": 20,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with client.stream("POST", "/v1/chat/completions", json=request) as s:
            lines = [line async for line in s.aiter_lines() if line]
        payloads = sse_payloads(lines)
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 20
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
        assert len(text) > 0

        r = await client.post("/v1/chat/completions", json={"messages": "nope"})
        assert r.status_code == 400 and r.json()["object"] == "error"


async def test_emulator_extension_describes_huge_prompts_and_prefixes(h200: EmulatorServer) -> None:
    model = h200.emulator.model
    async with httpx.AsyncClient(base_url=h200.url, timeout=30) as client:
        ext = {"prompt_tokens": 20_000, "prefix_key": "agent-1"}
        first = {"text": "x", "sampling_params": {"max_new_tokens": 4}, "emulator": ext}
        r = await client.post("/generate", json=first)
        assert r.json()["meta_info"]["prompt_tokens"] == 20_000
        second = {
            **first,
            "emulator": {"prompt_tokens": 21_000, "prefix_key": "agent-1", "cached_tokens": 20_000},
        }
        r = await client.post("/generate", json=second)
        assert r.json()["meta_info"]["cached_tokens"] == 20_000
        r = await client.post("/generate", json={**first, "emulator": {"prompt_tokens": 50_000}})
        assert r.status_code == 400 and "exceeds the maximum allowed length" in r.json()["error"]["message"]
        r = await client.post("/generate", json={**first, "emulator": {"bogus": 1}})
        assert r.status_code == 400
        r = await client.post("/generate", content=b"{not json")
        assert r.status_code == 400
    assert model.in_flight == 0


async def test_info_endpoints(h200: EmulatorServer) -> None:
    profile = h200.emulator.model.profile
    async with httpx.AsyncClient(base_url=h200.url, timeout=30) as client:
        info = (await client.get("/server_info")).json()
        assert info == (await client.get("/get_server_info")).json()
        assert info["version"] == "0.5.23"
        assert info["chunked_prefill_size"] == profile.chunked_prefill_size
        assert info["max_running_requests"] == profile.max_running_requests
        assert info["context_length"] == profile.context_length
        assert info["max_total_num_tokens"] == profile.kv_pool_tokens
        assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 64

        loads = (await client.get("/v1/loads")).json()
        assert set(loads) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
        assert loads["loads"][0]["max_total_num_tokens"] == profile.kv_pool_tokens
        assert loads["loads"][0]["timestamp"] > 1e9  # Unix time, like SGLang's, not engine time
        assert loads["timestamp"].endswith("+00:00")
        if FIXTURES is not None:
            fixture = json.loads((FIXTURES / "sglang-0.5.23-v1-loads.json").read_text())
            assert set(loads) == set(fixture)
            assert set(loads["loads"][0]) == set(fixture["loads"][0])
        prom = (await client.get("/v1/loads", params={"format": "prometheus"})).text
        assert 'sglang_num_waiting_uncached_tokens{dp_rank="0"} 0' in prom

        tok = (await client.post("/tokenize", json={"prompt": "a" * 40})).json()
        assert tok["count"] == 10 == len(tok["tokens"]) and tok["max_model_len"] == profile.context_length
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["max_model_len"] == profile.context_length
        assert (await client.get("/health")).status_code == 200


# ------------------------------------------------------------------------------------ disconnects
async def test_stream_disconnect_aborts_the_request_in_the_model() -> None:
    server = await start(get_profile("h200"), speed=1.0)
    model = server.emulator.model
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            request = {"text": "hi", "sampling_params": {"max_new_tokens": 30_000}, "stream": True}
            async with client.stream("POST", "/generate", json=request) as s:
                async for line in s.aiter_lines():
                    if line.startswith("data: "):
                        break
                assert model.in_flight == 1
        await eventually(lambda: model.in_flight == 0, "the model aborted the request")
        assert server.emulator.frontend.aborted == 1
    finally:
        await server.stop()


async def test_non_stream_disconnect_aborts_the_request_in_the_model() -> None:
    server = await start(get_profile("h200"), speed=1.0)
    model = server.emulator.model
    try:
        body = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 30_000}}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        await eventually(lambda: model.in_flight == 1, "the request reached the model")
        writer.close()
        await writer.wait_closed()
        await eventually(lambda: model.in_flight == 0, "the model aborted the request")
        del reader
    finally:
        await server.stop()


# ------------------------------------------------------------------------------------ crashes
async def test_crash_drops_streams_and_refuses_connections_until_restart() -> None:
    profile = get_profile("maxq-old").replace(restart_s=60.0)
    server = await start(profile, speed=100.0)
    model = server.emulator.model
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            request = {
                "text": "x",
                "emulator": {"prompt_tokens": 500_000},
                "sampling_params": {"max_new_tokens": 50},
                "stream": True,
            }
            lines: list[str] = []
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                async with client.stream("POST", "/generate", json=request) as s:
                    async for line in s.aiter_lines():
                        lines.append(line)
            assert "data: [DONE]" not in lines
            assert model.crashes and "Tried to allocate" in model.crashes[0].reason
            assert not model.up
            with pytest.raises(httpx.ConnectError):  # a dead process: connection refused
                await client.get("/health")

            async def healthy() -> bool:
                try:
                    return (await client.get("/health")).status_code == 200
                except httpx.ConnectError:
                    return False

            await eventually(healthy, "the engine restarted on the same port")
            metrics = (await client.get("/metrics")).text
            assert "sglang:num_running_reqs" not in metrics  # fresh process: no load gauges yet
            r = await client.post(
                "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 3}}
            )
            assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
    finally:
        await server.stop()


async def test_down_mode_503_keeps_listening() -> None:
    profile = get_profile("maxq-old").replace(restart_s=1e6)
    server = await start(profile, speed=100.0, down_mode="503")
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            request = {
                "text": "x",
                "emulator": {"prompt_tokens": 500_000},
                "sampling_params": {"max_new_tokens": 5},
            }
            with pytest.raises(httpx.RemoteProtocolError):
                await client.post("/generate", json=request)
            assert (await client.get("/health")).status_code == 503
            r = await client.post("/generate", json={"text": "hello"})
            assert r.status_code == 503
    finally:
        await server.stop()


# ------------------------------------------------------------------------------------ signals
async def test_metrics_parse_to_the_models_published_gauges() -> None:
    server = await start(get_profile("h200"), speed=5.0)
    model = server.emulator.model
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            for i in range(2):
                body = {"text": "y" * 20_000, "sampling_params": {"max_new_tokens": 5000}, "stream": True}
                asyncio.get_running_loop().create_task(client.post("/generate", json=body), name=f"gen-{i}")

            def decoding() -> bool:
                g = model.published_gauges()
                return g is not None and g.num_running_reqs == 2

            await eventually(decoding, "two requests decoding")
            for _ in range(50):
                before = model.published_gauges()
                text = (await client.get("/metrics")).text
                if model.published_gauges() is before:
                    break
            else:
                raise AssertionError("the gauges moved during every scrape")
        assert before is not None
        families = {f.name: f for f in text_string_to_metric_families(text)}
        for name, expected in gauge_values(before).items():
            (sample,) = families[f"sglang:{name}"].samples
            if math.isnan(expected):
                assert math.isnan(sample.value), name
            else:
                assert sample.value == pytest.approx(expected), name
        assert before.num_running_reqs == 2 and before.kv_used_tokens > 0
        (pool,) = families["sglang:max_total_num_tokens"].samples
        assert pool.value == model.profile.kv_pool_tokens
    finally:
        await server.stop()


def test_exposition_has_the_fixture_names_labels_and_format() -> None:
    assert FIXTURES is not None
    fixture = (FIXTURES / "sglang-0.5.23-metrics.txt").read_text()
    expected = {f.name: f for f in text_string_to_metric_families(fixture)}
    model = EngineModel(get_profile("maxq-old"))
    model.submit("a", 20_000, max_new_tokens=100, now=0.0)
    model.advance(3.0)
    frontend = FrontendMetrics()
    frontend.observe_ttft(1.5, streaming=True)
    body, content_type = render_metrics(model, frontend)
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    ours = {f.name: f for f in text_string_to_metric_families(body.decode())}
    shared = set(ours) & set(expected)
    assert len(shared) >= 35
    for name in shared:
        assert ours[name].type == expected[name].type, name
        assert ours[name].documentation == expected[name].documentation, name
        if expected[name].samples and ours[name].samples:
            assert set(ours[name].samples[0].labels) == set(expected[name].samples[0].labels), name
    text = body.decode()
    labels = 'engine_type="unified",model_name="Qwen/Qwen3-Next-80B-A3B-Instruct-NVFP4",moe_ep_rank="0"'
    assert f'sglang:max_total_num_tokens{{{labels},pp_rank="0",tp_rank="0"}} 522880.0' in text
    assert "sglang:fwd_occupancy{" in text and "} NaN" in text
    ttft = [line for line in text.splitlines() if line.startswith("sglang:time_to_first_token_seconds")]
    assert ttft[0].startswith("sglang:time_to_first_token_seconds_sum")
    assert ttft[-1].startswith("sglang:time_to_first_token_seconds_count")
    assert 'is_streaming="true",le="0.1",model_name=' in ttft[1]
    om, om_type = render_metrics(model, frontend, "application/openmetrics-text; version=1.0.0")
    assert "openmetrics" in om_type and b"sglang_num_running_reqs{" in om  # fixtures README item 7


def test_parse_generation_rejects_batches() -> None:
    assert parse_generation({"text": "abcd" * 3}, "generate").prompt_tokens == 3
    with pytest.raises(Exception, match="batched"):
        parse_generation({"text": ["a", "b"]}, "generate")
    with pytest.raises(Exception, match="batched"):
        parse_generation({"prompt": [[1, 2], [3]]}, "completions")


async def test_gpu_file_is_written_for_the_file_source(tmp_path: Path) -> None:
    gpu_file = tmp_path / "gpu.json"
    profile = get_profile("maxq-old")
    server = await start(profile, speed=50.0, gpu_file=gpu_file)
    try:
        await eventually(gpu_file.exists, "the GPU file was written")
        data = json.loads(gpu_file.read_text())
        assert data == {
            "free_bytes": profile.idle_free_bytes,
            "total_bytes": profile.device_total_bytes,
            "other_process_bytes": profile.other_process_bytes,
        }
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            body = {
                "text": "x",
                "emulator": {"prompt_tokens": 200_000},
                "sampling_params": {"max_new_tokens": 1},
            }
            task = asyncio.get_running_loop().create_task(client.post("/generate", json=body))

            def lower() -> bool:
                return json.loads(gpu_file.read_text())["free_bytes"] < profile.idle_free_bytes

            await eventually(lower, "a prefill transient shows in the file")
            assert (await task).status_code == 200
        assert [p.name for p in tmp_path.iterdir()] == ["gpu.json"]  # no temp files left behind
    finally:
        await server.stop()
