"""A minimal SGLang-shaped upstream for proxy benchmarks: no model, constant-time answers.

``/v1/models`` and ``/health`` answer small JSON; ``/generate`` (and ``/generate_ungated``, the same
handler on a path the sidecar does not gate) answers JSON, or with ``stream: true``
``events`` SSE events of ~100 bytes as fast as the socket takes them; ``/metrics`` is a tiny SGLang
exposition so the sidecar's scraper is satisfied. Run: ``python -m uvicorn bench.upstream:app``.
"""

from __future__ import annotations

import json
from typing import Any

METRICS = (
    b'# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{tp_rank="0"} 0.0\n'
    b'# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{tp_rank="0"} 0.0\n'
    b'# TYPE sglang:kv_available_tokens gauge\nsglang:kv_available_tokens{tp_rank="0"} 1000000.0\n'
    b'# TYPE sglang:kv_used_tokens gauge\nsglang:kv_used_tokens{tp_rank="0"} 0.0\n'
    b'# TYPE sglang:full_token_usage gauge\nsglang:full_token_usage{tp_rank="0"} 0.0\n'
)
SMALL = b'{"object":"list","data":[{"id":"m","object":"model"}]}'
EVENT = b'data: {"text":"' + b"x" * 80 + b'","meta_info":{"id":"r"}}\n\n'


async def _send(send: Any, status: int, body: bytes, ctype: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    path = scope["path"]
    if path == "/metrics":
        await _send(send, 200, METRICS, b"text/plain; version=0.0.4")
    elif path in ("/generate", "/generate_ungated"):
        req = json.loads(body or b"{}")
        if not req.get("stream"):
            await _send(send, 200, b'{"text":"ok","meta_info":{"prompt_tokens":1}}', b"application/json")
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for _ in range(int(req.get("events", 100))):
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    elif path in ("/v1/models", "/health"):
        await _send(send, 200, SMALL, b"application/json")
    else:
        await _send(send, 404, b'{"detail":"Not Found"}', b"application/json")
