"""The data path: a plain-ASGI streaming reverse proxy with the admission gate in front of it.

Why plain ASGI and aiohttp: this is the hot path. No ``BaseHTTPMiddleware`` (it hides disconnects), no
framework routing per request, and aiohttp's client streams several times faster than httpx's
(issue #2's measurement). Per request we do what must be done per request - read and parse the body,
count tokens, decide, forward - and per chunk only a ``send``.

Client disconnects are watched from the moment the body has been read: while held, while waiting for
the engine's headers, and mid-stream. A disconnect cancels the request's task; cancellation closes
the upstream response (the engine sees the connection drop and aborts the request) and ``finally``
blocks end the ticket, so the ledger always returns to zero.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from sidecar.admission import Admission, Outcome, Rejection, Ticket, Waiter
from sidecar.core.decision import Decision
from sidecar.core.demand import Demand
from sidecar.intake import demand_of
from sidecar.requests import BadRequest, GenerationRequest, parse_generation
from sidecar.routes import Route
from sidecar.tokens import PromptCounter, TokenCount

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

log = logging.getLogger("sidecar.proxy")

# RFC 9110 §7.6.1 plus the RFC 2616 list; headers named in `Connection` are dropped too.
HOP_BY_HOP = frozenset(
    b"connection keep-alive proxy-connection te trailer trailers transfer-encoding upgrade "
    b"proxy-authenticate proxy-authorization".split()
)
_DROP_REQUEST = HOP_BY_HOP | {b"host", b"content-length"}
# uvicorn adds its own; a duplicated `server` header breaks aiohttp clients.
_DROP_RESPONSE = HOP_BY_HOP | {b"server", b"date"}
_JSON = [(b"content-type", b"application/json")]
PARSE_IN_THREAD_BYTES = 256 * 1024


class ClientGone(Exception):
    """The client disconnected before its request was complete."""


def make_session(
    max_connections: int, connect_timeout_s: float, read_timeout_s: float
) -> aiohttp.ClientSession:
    """One session for the process, created inside the running loop (the app's lifespan)."""
    connector = aiohttp.TCPConnector(
        limit=max_connections,
        limit_per_host=0,
        # Below uvicorn's 5 s keep-alive, so we never reuse a connection the engine is closing.
        keepalive_timeout=4.0,
        enable_cleanup_closed=True,
    )
    timeout = aiohttp.ClientTimeout(
        total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s, sock_read=read_timeout_s
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        cookie_jar=aiohttp.DummyCookieJar(),  # never share one user's cookies with another
        trust_env=False,  # no HTTP(S)_PROXY detour for a loopback engine
        auto_decompress=False,  # relay bytes as sent; content-encoding passes through unchanged
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )


def json_response(
    status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] = ()
) -> tuple[int, list, bytes]:  # type: ignore[assignment]
    payload = json.dumps(body, separators=(",", ":")).encode()
    return status, [*_JSON, (b"content-length", str(len(payload)).encode()), *headers], payload


def rejection_response(r: Rejection, prompt_tokens: int, projected_bytes: int) -> tuple[int, list, bytes]:
    d = r.decision
    reason = r.reason.value
    retry = str(d.retry_after_s or 1).encode()
    body = {
        "error": {
            "message": _REJECT_MESSAGES.get(reason, reason) + f" Retry after {retry.decode()} s.",
            "type": "admission_rejected",
            "code": reason,
            "param": None,
        },
        "admission": decision_body(d, prompt_tokens, projected_bytes)
        | {"waited_ms": round(r.waited_s * 1000)},
    }
    headers = [
        (b"retry-after", retry),
        (b"x-admission-decision", b"reject"),
        (b"x-admission-reason", reason.encode()),
        (b"x-admission-wait-ms", str(round(r.waited_s * 1000)).encode()),
    ]
    return json_response(503, body, headers)


def decision_body(d: Decision, prompt_tokens: int, projected_bytes: int) -> dict[str, Any]:
    return {
        "decision": d.action.value,
        "reason": d.reason.value if d.reason else None,
        "prompt_tokens": prompt_tokens,
        "projected_bytes": projected_bytes,
        "headroom_bytes": d.headroom_bytes,
        "retry_after_s": d.retry_after_s,
        "checks": [
            {"name": c.name, "ok": c.ok, "need": c.need, "have": c.have, "note": c.note or None}
            for c in d.checks
        ],
    }


_REJECT_MESSAGES = {
    "vram_headroom": "Not enough free GPU memory for this request's prefill.",
    "kv_pool": "The engine's KV cache pool has no room for this prompt.",
    "mamba_slots": "The engine's Mamba state slots are exhausted.",
    "engine_queue": "The engine's queue is full.",
    "pending_prefill_tokens": "Too many prefill tokens are already pending in the engine.",
    "unfit_request": "This request can never fit this lane (context, KV pool or memory).",
    "signals_stale": "The engine's or GPU's signals are stale; admission is paused.",
    "queue_full": "The admission queue is full.",
    "hold_timeout": "The request waited the maximum hold time without room opening.",
    "engine_unavailable": "The engine is unreachable.",
    "draining": "The sidecar is shutting down.",
}


async def send_response(send: Send, resp: tuple[int, list, bytes]) -> None:
    status, headers, body = resp
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def error_body(status: int, message: str, code: str) -> tuple[int, list, bytes]:
    return json_response(
        status, {"error": {"message": message, "type": "sidecar_error", "code": code, "param": None}}
    )


class Proxy:
    """Forwards every request to the engine; gated paths pass the admission controller first."""

    def __init__(
        self,
        upstream: str,
        admission: Admission,
        counter: PromptCounter,
        *,
        chunk_hint: Callable[[], int | None] = lambda: None,
        on_first_byte: Callable[[float], None] = lambda seconds: None,
        trust_declared_sizes: bool = False,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.on_first_byte = on_first_byte
        # The emulator's `{"emulator": {"prompt_tokens": N}}` is the client's word about its own size:
        # honoured only when the sidecar was started for load generation against the emulator.
        self.trust_declared_sizes = trust_declared_sizes
        self._origin = _origin(self.upstream)
        self.admission = admission
        self.counter = counter
        self.chunk_hint = chunk_hint
        self.session: aiohttp.ClientSession | None = None
        self._ids = itertools.count(1)

    # -- entry ---------------------------------------------------------------------------------------

    async def __call__(
        self, scope: Scope, receive: Receive, send: Send, gated: bool, route: Route | None = None
    ) -> None:
        if not gated:
            # Forwarded unchanged: no size limit of ours, and a large body is relayed as it arrives.
            try:
                body = await _PassThroughBody.start(scope, receive)
            except ClientGone:
                return
            work = self._forward(scope, body.data, send, None, [], keep_length=body.streaming)
            await _until_disconnect(work, receive, after=body.done)
            return
        policy = self.admission.policy
        try:
            body = await _read_body(scope, receive, policy.limits.max_body_bytes)
        except BadRequest as e:
            if gated:
                self.admission.observer.outcome(Outcome.BAD_REQUEST)
            await send_response(send, json_response(e.status, e.error_body()))
            return
        except ClientGone:
            if gated:
                self.admission.observer.outcome(Outcome.CLIENT_GONE)
            return
        if route is not None:
            # Forward to the route the engine would serve, not to a variant it would redirect.
            scope = {**scope, "path": route.path, "raw_path": route.path.encode()}
        await _until_disconnect(self._gated(scope, body, send, route), receive)

    # -- gated ---------------------------------------------------------------------------------------

    async def _gated(self, scope: Scope, body: bytes, send: Send, route: Route | None = None) -> None:
        policy = self.admission.policy
        parse = functools.partial(
            parse_generation,
            scope["path"],
            body,
            _headers_dict(scope),
            max_body_bytes=policy.limits.max_body_bytes,
            accept_emulator=self.trust_declared_sizes,
            shape=route.shape if route is not None and route.shape else None,
        )
        try:
            # A 500K-token prompt is MBs of JSON (tens of ms to decode): off the loop, so other requests
            # and the pollers do not wait behind it. Small bodies are cheaper parsed in place.
            req = await asyncio.to_thread(parse) if len(body) > PARSE_IN_THREAD_BYTES else parse()
        except BadRequest as e:
            self.admission.observer.outcome(Outcome.BAD_REQUEST)
            await send_response(send, json_response(e.status, e.error_body()))
            return
        except asyncio.CancelledError:
            self.admission.observer.outcome(Outcome.CLIENT_GONE)
            raise
        try:
            count = await self.counter.count(req, admits=self._admits_now(req))
        except asyncio.CancelledError:
            self.admission.observer.outcome(Outcome.CLIENT_GONE)
            raise
        demand = demand_of(
            self.admission.rules,
            req,
            count,
            now=self.admission.clock(),
            chunk=self.chunk_hint(),
            request_id=req.rid or f"sc-{next(self._ids)}",
        )
        result = await self._acquire(demand)
        if isinstance(result, Rejection):
            await send_response(
                send, rejection_response(result, demand.prompt_tokens, demand.projected_bytes)
            )
            return
        ticket = result
        extra = [
            (b"x-admission-decision", b"admit"),
            (b"x-admission-wait-ms", str(round(ticket.waited_s * 1000)).encode()),
        ]
        if ticket.shadow_reject is not None:
            d = ticket.shadow_reject
            extra.append((b"x-admission-shadow-decision", d.action.value.encode()))
            extra.append((b"x-admission-shadow-reason", (d.reason.value if d.reason else "none").encode()))
        await self._forward(scope, body, send, ticket, extra, req)

    def _admits_now(self, req: GenerationRequest) -> Callable[[TokenCount], bool]:
        """Would ``req`` be admitted now at this count? The counter tokenizes only when the answer is no."""

        def admits(count: TokenCount) -> bool:
            demand = demand_of(
                self.admission.rules, req, count, now=self.admission.clock(), chunk=self.chunk_hint()
            )
            return self.admission.evaluate(demand).admitted

        return admits

    async def _acquire(self, demand: Demand) -> Ticket | Rejection:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Ticket | Rejection] = loop.create_future()

        def on_done(r: Ticket | Rejection) -> None:
            if not fut.done():
                fut.set_result(r)

        res = self.admission.submit(demand, on_done)
        if not isinstance(res, Waiter):
            return res
        timer = loop.call_at(res.deadline, self.admission.expire)
        try:
            return await fut
        except asyncio.CancelledError:
            # The client left while held. Cancelling this task cancelled `fut` too, so ask the waiter:
            # the gate may have answered in the same instant (a poll or a release pumped the queue
            # before this task woke). A ticket must then be ended, or its ledger entry would leak.
            if res.done:
                if isinstance(res.result, Ticket):
                    res.result.finish(Outcome.CLIENT_GONE)
            else:
                self.admission.cancel(res)
            raise
        finally:
            timer.cancel()

    # -- forwarding ----------------------------------------------------------------------------------

    async def _forward(
        self,
        scope: Scope,
        body: bytes,
        send: Send,
        ticket: Ticket | None,
        extra_headers: list[tuple[bytes, bytes]],
        req: GenerationRequest | None = None,
        *,
        keep_length: bool = False,
    ) -> None:
        assert self.session is not None, "proxy used outside the app's lifespan"
        url = self.upstream + scope["raw_path"].decode("latin-1")
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        outcome = Outcome.UPSTREAM_ERROR
        started = False
        forwarded_at = time.monotonic()
        try:
            async with self.session.request(
                scope["method"],
                URL(url, encoded=True),  # relay the path and query byte for byte, no re-quoting
                data=body or None,
                headers=_request_headers(scope, keep_length=keep_length),
                allow_redirects=False,
            ) as resp:
                headers = _response_headers(resp.raw_headers, self._origin) + extra_headers
                await send({"type": "http.response.start", "status": resp.status, "headers": headers})
                started = True
                first = True
                async for chunk in resp.content.iter_any():
                    if first and ticket is not None:
                        ticket.prefill_done()
                        self.on_first_byte(time.monotonic() - forwarded_at)
                        first = False
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
                outcome = Outcome.COMPLETED
        except asyncio.CancelledError:
            outcome = Outcome.CLIENT_GONE
            raise
        except (aiohttp.ClientError, TimeoutError) as e:
            if not started:
                status, headers, payload = _upstream_error(e, self.upstream)
                await send_response(send, (status, headers + extra_headers, payload))
            else:
                # Headers are gone; the only honest signal left is to break the connection, so the
                # client does not mistake a truncated stream for a complete one.
                log.warning("upstream broke mid-response on %s: %s", scope["path"], e)
                raise UpstreamBroke(str(e)) from None
        finally:
            if ticket is not None:
                ticket.finish(outcome)


class UpstreamBroke(Exception):
    """Raised after the response started, so that the server drops the client connection."""


def _upstream_error(e: BaseException, upstream: str) -> tuple[int, list, bytes]:
    if isinstance(e, aiohttp.ClientConnectorError):
        resp = error_body(
            503, f"engine at {upstream} is unreachable: {e.os_error or e}", "engine_unavailable"
        )
        return resp[0], [*resp[1], (b"retry-after", b"5")], resp[2]
    if isinstance(e, TimeoutError | aiohttp.ServerTimeoutError):
        return error_body(
            504,
            f"engine at {upstream} timed out: {e or 'no data within the read timeout'}",
            "upstream_timeout",
        )
    return error_body(502, f"engine at {upstream} failed: {type(e).__name__}: {e}", "upstream_error")


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    for k, v in scope["headers"]:
        if k == b"content-length" and v.isdigit() and int(v) > limit:
            raise BadRequest.body_too_large(int(v), limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientGone
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BadRequest.body_too_large(size, limit, at_least=True)
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks)


class _PassThroughBody:
    """A pass-through request's body: read at once when small, else relayed to the engine as it arrives.

    ``done`` is set once the body has been read: only then may the disconnect listener take over
    ``receive`` (two readers of one ASGI channel would steal each other's messages).
    """

    INLINE_LIMIT = 1 << 20

    def __init__(self, data: Any, streaming: bool) -> None:
        self.data = data
        self.streaming = streaming
        self.done = asyncio.Event()

    @classmethod
    async def start(cls, scope: Scope, receive: Receive) -> _PassThroughBody:
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        chunked = any(k == b"transfer-encoding" for k, _ in scope["headers"])
        if not chunked and (length is None or (length.isdigit() and int(length) <= cls.INLINE_LIMIT)):
            msg = await receive()
            parts = [msg.get("body", b"")]
            while msg.get("more_body"):
                msg = await receive()
                parts.append(msg.get("body", b""))
            if msg["type"] == "http.disconnect":
                raise ClientGone
            body = cls(b"".join(parts), streaming=False)
            body.done.set()
            return body
        body = cls(None, streaming=True)
        body.data = body._relay(receive)
        return body

    async def _relay(self, receive: Receive) -> Any:
        try:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise ClientGone
                if chunk := msg.get("body", b""):
                    yield chunk
                if not msg.get("more_body", False):
                    return
        finally:
            self.done.set()


async def _until_disconnect(
    work: Awaitable[None], receive: Receive, after: asyncio.Event | None = None
) -> None:
    """Run ``work``; if the client disconnects first, cancel it (its finally blocks do the cleanup).

    ``after``: start listening only once this is set (the request body is still being read).
    """
    task = asyncio.ensure_future(work)
    # Let the task take its first step before anything can cancel it: a coroutine cancelled before it
    # starts runs none of its own cleanup, and its outcome would go unrecorded.
    await asyncio.sleep(0)

    async def listen() -> None:
        if after is not None:
            await after.wait()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                task.cancel()
                return

    listener = asyncio.ensure_future(listen())
    try:
        await asyncio.wait((task,), return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


def _headers_dict(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


def _request_headers(scope: Scope, *, keep_length: bool = False) -> CIMultiDict[str]:
    """End-to-end headers only. ``keep_length``: a relayed body keeps the client's Content-Length."""
    named = _connection_named(scope["headers"])
    drop = _DROP_REQUEST - {b"content-length"} if keep_length else _DROP_REQUEST
    return CIMultiDict(
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in scope["headers"]
        if k not in drop and k not in named
    )


def _response_headers(raw: tuple[tuple[bytes, bytes], ...], origin: bytes = b"") -> list[tuple[bytes, bytes]]:
    named = _connection_named(raw)
    out = []
    for k, v in raw:
        k = k.lower()
        if k in _DROP_RESPONSE or k in named:
            continue
        if k in _LOCATION_HEADERS and origin:
            v = _local_location(v, origin)
        out.append((k, v))
    return out


_LOCATION_HEADERS = frozenset({b"location", b"content-location"})


def _origin(upstream: str) -> bytes:
    """``scheme://host:port`` of the engine, lower-cased, as it appears at the start of its redirects."""
    u = URL(upstream)
    return f"{u.scheme}://{u.raw_host}:{u.port}".lower().encode() if u.host else b""


def _local_location(value: bytes, origin: bytes) -> bytes:
    """A redirect to the engine's own address, made relative so the client stays behind the gate.

    FastAPI answers ``/generate/`` with ``307 Location: http://<engine>/generate``: relayed as is, it
    tells any client where the ungated engine listens and sends it there.
    """
    lowered = value.lower()
    scheme, _, rest = origin.partition(b"://")
    host, _, port = rest.rpartition(b":")
    default = (scheme == b"http" and port == b"80") or (scheme == b"https" and port == b"443")
    for prefix in (origin, scheme + b"://" + host) if default else (origin,):
        if lowered.startswith(prefix) and lowered[len(prefix) : len(prefix) + 1] in (b"", b"/", b"?", b"#"):
            return value[len(prefix) :] or b"/"
    if lowered.startswith(b"//" + rest):  # scheme-relative
        return value[len(rest) + 2 :] or b"/"
    return value


def _connection_named(headers: Any) -> frozenset[bytes]:
    """Options named in every `Connection` header (a list header: it may appear more than once)."""
    return frozenset(
        t.strip().lower() for k, v in headers if k.lower() == b"connection" for t in v.split(b",")
    )
