"""Logs an on-call engineer can read and a collector can parse, that never stall the sidecar.

Each test runs `sglang-sidecar serve` as its own process (that is where logging is set up) in front of a
fake engine on loopback.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import socket
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, small_policy
from tests.harness import FAST, FakeEngine, SidecarUrl, _respond, eventually, serve, serve_argv, wait_serving

MARKER = "PROMPT-TEXT-THAT-MUST-NEVER-BE-LOGGED"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_policy(tmp_path: Path, **overrides: object) -> Path:
    data = json.loads(small_policy(**(FAST | overrides)).policy.model_dump_json())
    data["gpu"]["required"] = False
    path = tmp_path / "lane.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@asynccontextmanager
async def sidecar(
    engine_url: str, policy: Path, *args: str, stderr: Any = subprocess.PIPE
) -> AsyncIterator[tuple[str, subprocess.Popen[str]]]:
    port, admin_port = free_port(), free_port()
    proc = subprocess.Popen(
        serve_argv(engine_url, policy, port, admin_port, *args),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        text=True,
    )
    url = SidecarUrl(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}")
    try:
        await wait_serving(proc, url + "/readyz")
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def counter(metrics: str, name: str) -> float:
    for fam in text_string_to_metric_families(metrics):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"{name} not exported")


async def test_json_format_start_line_access_log_and_drain(tmp_path: Path) -> None:
    """--log-format json: every line is one JSON object (uvicorn's too); the start line names what runs;
    one access line per request, no prompt; SIGTERM drains with /readyz 503 while a stream finishes."""
    engine = FakeEngine(events=3)
    policy = write_policy(tmp_path)
    async with (
        serve(engine) as engine_url,
        sidecar(engine_url, policy, "--log-format", "json") as (url, proc),
    ):
        async with httpx.AsyncClient(timeout=10) as client:
            body = {"text": MARKER, "stream": True, "rid": "s1"}
            async with client.stream(
                "POST", url + "/generate", json=body, headers={"x-request-id": "req-42"}
            ) as stream:
                assert stream.status_code == 200
                chunks = stream.aiter_bytes()
                first = await chunks.__anext__()
                assert first
                proc.send_signal(signal.SIGTERM)  # a stream is in flight: the drain waits for it

                async def draining() -> bool:
                    r = await client.get(url + "/readyz")  # the listener still accepts connections
                    return r.status_code == 503 and "draining" in r.json()["problems"]

                await eventually(draining)
                refused = await client.post(url + "/generate", json={"text": "x", "stream": False})
                assert refused.status_code == 503 and refused.headers["x-admission-reason"] == "draining"
                engine.release.set()
                rest = b"".join([c async for c in chunks])
                assert rest.count(b"data:") >= 2  # the stream finished whole
        _, err = await asyncio.to_thread(proc.communicate, timeout=30)

    assert MARKER not in err
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]  # every line is JSON
    loggers = {rec["logger"] for rec in lines}
    assert (
        "uvicorn.error" in loggers and "sidecar.http.access_log" in loggers and "sidecar.decision" in loggers
    )
    [start] = [r for r in lines if r.get("event") == "start"]
    assert start["upstream"] == engine_url and start["listen"] == url.removeprefix("http://")
    assert start["policy"] == "test-lane" and len(start["policy_sha256"]) == 64
    assert start["mode"] == "enforce" and start["gpu_source"] is None
    [gen] = [
        r
        for r in lines
        if r["logger"] == "sidecar.http.access_log" and r["path"] == "/generate" and r["status"] == 200
    ]
    assert gen["method"] == "POST" and gen["decision"] == "admit" and gen["upstream_status"] == 200
    # Every body byte the client got, though the chunks bypass the log's per-message wrapper.
    assert gen["request_id"] == "req-42" and gen["bytes"] == len(first + rest) and gen["duration_ms"] > 0
    drained = [r for r in lines if r["logger"] == "sidecar.http.access_log" and r.get("reason") == "draining"]
    assert len(drained) == 1 and drained[0]["status"] == 503 and drained[0]["upstream_status"] is None
    decisions = [r for r in lines if r.get("event") == "decision"]
    assert decisions and all("prompt_tokens" in r for r in decisions)
    [begin] = [r for r in lines if r.get("event") == "drain_start"]
    [end] = [r for r in lines if r.get("event") == "drain_end"]
    assert begin["in_flight"] >= 1 and end["finished"] is True and end["in_flight"] == 0


async def test_text_format_at_debug_is_the_sidecars_own_lines(tmp_path: Path) -> None:
    """--log-level debug: the sidecar's lines, one format, not the HTTP libraries' chatter."""
    policy = write_policy(tmp_path)
    async with (
        serve(FakeEngine()) as engine_url,
        sidecar(engine_url, policy, "--log-level", "debug") as (url, proc),
    ):
        async with httpx.AsyncClient(timeout=10) as client:
            for _ in range(20):
                assert (await client.get(url + "/v1/models")).status_code == 200
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.to_thread(proc.communicate, timeout=30)
    lines = [line for line in err.splitlines() if line.strip()]
    names = [line.split(" ")[2].rstrip(":") for line in lines if line[:4].isdigit()]
    assert not [n for n in names if n.split(".")[0] in ("httpx", "httpcore", "aiohttp", "asyncio")]
    assert sum(n == "sidecar.http.access_log" for n in names) >= 20
    assert any("sglang-sidecar" in line and "starting: upstream" in line for line in lines)
    assert any(n.startswith("uvicorn") for n in names)
    # Every line that is not a traceback continuation starts with the timestamp: one format.
    assert all(line[:4].isdigit() or line.startswith((" ", "Traceback")) for line in lines)


class ChattyEngine(FakeEngine):
    """/v1/loads fails on every poll, so the scraper warns on every poll (an ordinary warning)."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/loads":
            await _respond(send, 500, b'{"error": "overloaded"}', b"application/json")
            return
        await super().__call__(scope, receive, send)


async def test_a_stalled_log_pipe_never_stalls_the_sidecar(tmp_path: Path) -> None:
    """stderr is a pipe nobody reads (a stalled collector), shrunk to one page so it fills at once.
    The warnings and access lines that follow are dropped and counted; /healthz and the proxy answer."""
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    policy = write_policy(tmp_path, engine__poll_interval_s=0.02)
    try:
        async with (
            serve(ChattyEngine()) as engine_url,
            sidecar(engine_url, policy, "--log-queue-lines", "100", stderr=write_end) as (url, proc),
        ):
            os.close(write_end)
            write_end = -1
            async with httpx.AsyncClient(timeout=5) as client:
                # Each of these logs an access line; with the scraper's warnings that is far more than
                # 4 KiB. With a blocking handler the event loop would stop at the first full write.
                for _ in range(200):
                    assert (await client.get(url + "/healthz")).status_code == 200
                assert (await client.get(url + "/v1/models")).status_code == 200

                async def dropping() -> bool:
                    metrics = (await client.get(url.admin + "/metrics")).text
                    return counter(metrics, "sglang_sidecar_log_lines_dropped_total") > 0

                await eventually(dropping)
                assert (await client.get(url + "/healthz")).status_code == 200
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, timeout=30)  # exits although its log is stuck
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
