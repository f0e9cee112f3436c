"""A constant-cost SGLang-shaped upstream for the overhead benchmark: no model, no body parsing.

The shape of an answer comes from the query string, never from the body, so the upstream's own cost
does not depend on the prompt and cancels out of every "added over direct" figure:

- ``/generate`` (any method): reads the whole body, then answers a small JSON object, or with
  ``?events=N`` an SSE stream of N events of ~200 bytes, ``&interval_ms=M`` apart (0: as fast as the
  socket takes them, the saturation shape; 50: 20 events/s, a decoding model's pace).
- ``/v1/models``, ``/health``: small JSON (the pass-through shape).
- ``/metrics``: a real SGLang 0.5.23 exposition (~50 KB, from ``tests/fixtures``) with an idle pool of
  10M KV tokens, so the sidecar's scraper parses what it parses in production and every gate opens;
  ``BENCH_METRICS_REPEAT=k`` repeats its series ``k`` times under extra ``dp_rank`` labels (the
  8x-series page of issue #12).
- ``/server_info``: lane constants of a 1M-token context.

Run: ``python -m uvicorn bench.upstream:app --no-access-log``.
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

_FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "sglang" / "sglang-0.5.23-metrics.txt"

_POOL = {
    "sglang:kv_available_tokens": 10_000_000,
    "sglang:max_total_num_tokens": 10_000_000,
    "sglang:kv_used_tokens": 0,
    "sglang:kv_evictable_tokens": 0,
    "sglang:num_running_reqs": 0,
    "sglang:num_queue_reqs": 0,
    "sglang:full_token_usage": 0,
    "sglang:token_usage": 0,
    "sglang:context_len": 1_048_576,
    # A dense lane: a Mamba pool of 0 slots is "no such pool" to the scraper.
    "sglang:mamba_usage": 0,
    "sglang:mamba_used_tokens": 0,
    "sglang:mamba_available_tokens": 0,
    "sglang:mamba_evictable_tokens": 0,
    "sglang:swa_token_usage": 0,
}


def _metrics_page(repeat: int) -> bytes:
    """The fixture with the pool gauges set to an idle 10M-token lane, its series repeated ``repeat`` x."""
    lines = _FIXTURE.read_text().splitlines()
    out: list[str] = []
    for line in lines:
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if not line.startswith("#") and name in _POOL:
            line = re.sub(r"\s\S+$", f" {float(_POOL[name])}", line)
        out.append(line)
    if repeat > 1:
        extra = []
        for k in range(1, repeat):
            for line in out:
                if line.startswith("#") or "{" not in line:
                    continue
                name = line.split("{", 1)[0]
                if name in _POOL:
                    continue  # copies of the pool gauges would add up across dp ranks
                extra.append(line.replace("{", f'{{dp_rank="{k}",', 1))
        out += extra
    return ("\n".join(out) + "\n").encode()


METRICS = _metrics_page(int(os.environ.get("BENCH_METRICS_REPEAT", "1")))
SERVER_INFO = b'{"version":"0.5.23","context_length":1048576,"chunked_prefill_size":8192,"max_total_num_tokens":10000000}'
SMALL = b'{"object":"list","data":[{"id":"m","object":"model"}]}'
GENERATED = b'{"text":"ok","meta_info":{"id":"r","prompt_tokens":1,"completion_tokens":1}}'
# One SSE event of ~200 bytes, the size of an SGLang /generate chunk with its meta_info.
EVENT = (
    b'data: {"text":"' + b"x" * 120 + b'","meta_info":{"id":"r","prompt_tokens":1,"completion_tokens":1}}\n\n'
)


async def _send(send: Any, status: int, body: bytes, ctype: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _stream(send: Any, events: int, interval_s: float) -> None:
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    )
    loop = asyncio.get_running_loop()
    start = loop.time()
    for i in range(events):
        if interval_s:
            # On a schedule, not sleep-after-send: lateness does not accumulate.
            await asyncio.sleep(max(0.0, start + (i + 1) * interval_s - loop.time()))
        await send({"type": "http.response.body", "body": EVENT, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
        return
    while True:  # read (and drop) the whole body, as an engine would before answering
        m = await receive()
        if not m.get("more_body"):
            break
    path = scope["path"]
    if path == "/metrics":
        await _send(send, 200, METRICS, b"text/plain; version=0.0.4")
    elif path in ("/generate", "/generate_ungated"):
        q = parse_qs(scope.get("query_string", b"").decode())
        events = int(q.get("events", ["0"])[0])
        if events:
            await _stream(send, events, float(q.get("interval_ms", ["0"])[0]) / 1000)
        else:
            await _send(send, 200, GENERATED, b"application/json")
    elif path in ("/server_info", "/get_server_info"):
        await _send(send, 200, SERVER_INFO, b"application/json")
    elif path in ("/v1/models", "/health"):
        await _send(send, 200, SMALL, b"application/json")
    else:
        await _send(send, 404, b'{"detail":"Not Found"}', b"application/json")
