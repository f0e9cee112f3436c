"""``GET /v1/loads`` on the sidecar's data port: the engine's document with the sidecar's work added.

Routers poll ``/v1/loads`` from the worker URL they route to, which is the sidecar's (SGLang's model
gateway, smg 1.13, asks ``/v1/loads?include=core,disagg,queues,memory`` every 10 s, for its load-aware
policies and its overload veto, evidence F261). Passed
through, it shows only what the engine has seen: a request the sidecar is holding, or has forwarded
while the engine's snapshot is still the old one, is invisible, and a load-aware router piles more
onto the lane that looks idle. So the sidecar answers it: the engine's own answer (same query, same
``Authorization``), with held and in-flight work added (``routing.merge_engine_loads``).

Anything but a JSON answer of the expected shape (``format=prometheus``, a 404 from an engine older
than 0.5.9, an error) is passed on as the engine gave it. One small pool of its own, so a router's
polls never queue behind the scraper that feeds the gate.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from urllib.parse import parse_qs

import httpx

from sidecar.admission.controller import Admission
from sidecar.http.answers import error_response, json_response, send_response
from sidecar.http.asgi import Receive, Scope, Send
from sidecar.ops.router_view import merge_engine_loads
from sidecar.signals.engine import make_control_client

log = logging.getLogger("sidecar.ops.loads")

LOADS_PATH = "/v1/loads"
MAX_LOADS_BYTES = 4 << 20  # a /v1/loads document is ~2 KB per DP rank
_PASSED_HEADERS = ("authorization",)


class LoadsEndpoint:
    def __init__(self, upstream: str, admission: Callable[[], Admission]) -> None:
        self.upstream = upstream.rstrip("/")
        self.admission = admission
        self.client: httpx.AsyncClient | None = None

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = scope.get("query_string", b"").decode("latin-1")
        wants_json = parse_qs(query).get("format", ["json"])[-1] == "json"
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope.get("headers", [])
            if k.decode("latin-1").lower() in _PASSED_HEADERS
        }
        if self.client is None:
            self.client = make_control_client(timeout_s=5.0, max_connections=2)
        url = self.upstream + LOADS_PATH + (f"?{query}" if query else "")
        try:
            resp = await self.client.get(url, headers=headers)
        except httpx.HTTPError as exc:
            # The engine's address stays in the sidecar's log, not in an answer on the data port.
            log.warning("GET %s for a router: %r", url, exc)
            await send_response(
                send, error_response(502, f"engine unreachable for {LOADS_PATH}", "engine_unavailable")
            )
            return
        body = resp.content
        if wants_json and resp.status_code == 200 and len(body) <= MAX_LOADS_BYTES:
            try:
                merged = merge_engine_loads(json.loads(body), self.admission())
            except ValueError:
                merged = None
            if merged is not None:
                await send_response(send, json_response(200, merged))
                return
        kept = (
            [(b"content-type", resp.headers["content-type"].encode("latin-1"))]
            if "content-type" in resp.headers
            else []
        )
        await send_response(
            send, (resp.status_code, [*kept, (b"content-length", str(len(body)).encode())], body)
        )
