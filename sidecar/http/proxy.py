"""The data path: a plain-ASGI streaming reverse proxy with the admission gate in front of it.

Why plain ASGI and aiohttp: this is the hot path. No ``BaseHTTPMiddleware`` (it hides disconnects), no
framework routing per request, and aiohttp's client streams several times faster than httpx's
(issue #2's measurement). Per request we do what must be done per request - read and parse the body,
count tokens, decide, forward - and per chunk only a ``send``.

Client disconnects are watched from the moment the body has been read: while held, while waiting for
the engine's headers, and mid-stream. A disconnect cancels the request's task; cancellation closes
the upstream response (the engine sees the connection drop and aborts the request). A gated request's
admission handle is a context manager around all of it: its one outcome is decided on exit from what
happened (``Handle.outcome_on_exit``), so the ledger always returns to zero.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from sidecar.admission.controller import Admission, ClientGone, Handle, Outcome
from sidecar.core.decision import Action
from sidecar.http.access_log import ACCESS_NOTE
from sidecar.http.answers import (
    Response,
    error_response,
    invalid_request,
    json_response,
    rejection_response,
    send_response,
)
from sidecar.http.asgi import Message, Receive, Scope, Send
from sidecar.http.engine_client import UpstreamClient
from sidecar.http.hosts import json_media_refusal
from sidecar.http.server import DISCONNECT_WATCH
from sidecar.intake.body import PRIORITY_HEADERS, BadRequest, GenerationRequest, parse_generation
from sidecar.intake.demand import demand_of
from sidecar.intake.gateway import gateway_fields_in, without_fields
from sidecar.intake.tokens import PromptCounter, TokenCount
from sidecar.policy.engine_routes import Route
from sidecar.policy.priority import PriorityBounds

log = logging.getLogger("sidecar.http.proxy")

# RFC 9110 §7.6.1 plus the RFC 2616 list; headers named in `Connection` are dropped too.
HOP_BY_HOP = frozenset(
    b"connection keep-alive proxy-connection te trailer trailers transfer-encoding upgrade "
    b"proxy-authenticate proxy-authorization".split()
)
_DROP_REQUEST = HOP_BY_HOP | {b"host", b"content-length"}
_DROP_REQUEST_KEEP_LENGTH = _DROP_REQUEST - {b"content-length"}
# uvicorn adds its own; a duplicated `server` header breaks aiohttp clients.
_DROP_RESPONSE = HOP_BY_HOP | {b"server", b"date"}
_DROP_RESPONSE_GATED = _DROP_RESPONSE | {b"x-request-id"}
PARSE_IN_THREAD_BYTES = 256 * 1024
# Built once: an isinstance against `bytes | bytearray` makes a new union object at every call.
_BYTES = (bytes, bytearray)
# A client's X-Request-Id is kept when it looks like an id (what routers and SDKs send); anything else
# is replaced, so a header cannot smuggle text into logs.
_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:@/+=-]{1,128}$")
# The admit headers every admission sends as they are (a wait under half a millisecond rounds to 0).
_ADMITTED = (b"x-admission-decision", b"admit")
_NO_WAIT = (b"x-admission-wait-ms", b"0")
# Its own generator, seeded from the OS at import: request ids do not follow anyone's `random.seed`.
_random_bits = random.Random().getrandbits


def make_session(
    max_connections: int,
    connect_timeout_s: float,
    read_timeout_s: float,
    *,
    upstream: str | None = None,
    client: str = "lean",
) -> aiohttp.ClientSession | UpstreamClient:
    """One session for the process, created inside the running loop (the app's lifespan).

    ``client="lean"`` (the default): ``sidecar/http/engine_client.py``'s client for ``upstream``, which raises
    aiohttp's exception classes, so the error mapping below holds for both. It speaks plain HTTP/1.1
    only: an ``https://`` engine (or no ``upstream`` given) gets aiohttp's session."""
    if client == "lean" and upstream is not None and upstream.startswith("http://"):
        return UpstreamClient(
            upstream,
            max_connections=max_connections,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            keepalive_s=4.0,  # as the connector's below: under uvicorn's 5 s keep-alive
        )
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


class Proxy:
    """Forwards every request to the engine; gated paths pass the admission controller first."""

    def __init__(
        self,
        upstream: str,
        admission: Admission,
        counter: PromptCounter,
        *,
        on_first_byte: Callable[[float], None] = lambda seconds: None,
        trust_declared_sizes: bool = False,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.on_first_byte = on_first_byte
        # The emulator's `{"emulator": {"prompt_tokens": N}}` is the client's word about its own size:
        # honoured only when the sidecar was started for load generation against the emulator.
        self.trust_declared_sizes = trust_declared_sizes
        self._origin = _origin(self.upstream)
        # The engine URL's own path (``http://host:port/prefix``), put before every relayed target.
        self._prefix = URL(self.upstream).raw_path.rstrip("/").encode("latin-1")
        self.admission = admission
        self.counter = counter
        self.session: aiohttp.ClientSession | UpstreamClient | None = None
        # rids of the gated requests in flight through this sidecar (policy gateway_fields.rid: unique).
        self._rids: dict[str, int] = {}
        # Gate work per loop turn (``_Turns``): a burst's first requests reach the engine, and their first
        # bytes the clients, while the rest are still to be decided.
        self.turns = _Turns()
        # Held requests' futures, set by the gate's answer (``_held``, ``_answer``).
        self._answers: dict[Handle, asyncio.Future[None]] = {}
        # What a gated request's intake takes from the policy in force (``_Intake``), per policy.
        self._intake = _Intake(None)

    # -- entry ---------------------------------------------------------------------------------------

    def __call__(
        self, scope: Scope, receive: Receive, send: Send, gated: bool, route: Route | None = None
    ) -> Awaitable[None]:
        """The request's handler, as its own awaitable. Not a coroutine (as ``SidecarApp.__call__``):
        every resumption of a request's task passes through each frame of its chain (issue #27)."""
        if gated:
            return self._gated_request(scope, receive, send, route)
        return self._pass_through(scope, receive, send)

    async def _pass_through(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Forwarded unchanged: no size limit of ours, and a large body is relayed as it arrives.

        The headers are read in one pass (``_scan_pass``: the UTF-8 check, the body's framing and the
        headers to forward), and a small body's one message is taken here, not by a coroutine of its own
        (issue #27)."""
        bad, length, chunked, forward = _scan_pass(scope["headers"])
        if bad is not None:
            await send_response(send, _not_utf8(bad))
            return
        try:
            if chunked or not (
                length is None or (length.isdigit() and int(length) <= _PassThroughBody.INLINE_LIMIT)
            ):
                body = _PassThroughBody(receive)
                work = self._forward(scope, body.data, send, None, [], keep_length=True)
                await _until_disconnect(work, receive, scope, after=body.done)
                return
            msg = await receive()
            if msg.get("more_body"):
                data = await _PassThroughBody.rest(msg, receive)
            elif msg["type"] == "http.disconnect":
                raise ClientGone
            else:  # every small request: one message, no list, no join
                data = msg.get("body", b"")
            work = self._forward(scope, data, send, None, [], forward=forward)
            watch = scope.get(DISCONNECT_WATCH)
            if watch is None:
                await _until_disconnect(work, receive, scope)
                return
            task = asyncio.current_task()
            assert task is not None
            with _ServerWatch(watch, task):  # in this frame: one frame less per resumption (issue #27)
                await work
        except ClientGone:
            return

    async def _gated_request(self, scope: Scope, receive: Receive, send: Send, route: Route | None) -> None:
        """The admission handle around the whole request (its one outcome, decided on exit), the body,
        and the client's disconnect watched from then on.

        The headers are read once (``_scan_gated``), and a body that comes in one message is taken here,
        without ``read_body``'s coroutine (issue #27)."""
        a = self.admission
        intake = self._intake
        if intake.loaded is not a.loaded:  # once per policy, not per request
            intake = self._intake = _Intake(a.loaded)
        bad, ctype, sent, length, parser, forward = _scan_gated(scope["headers"], intake)
        if bad is not None:
            problem = _not_utf8(bad)
        elif ctype == b"application/json":  # nearly every request: json_media_refusal's answer, None
            problem = None
        else:
            problem = json_media_refusal(ctype)  # 415: a cross-site form must not spend the lane
        try:
            with a.open() as handle:  # the request's one outcome, decided on exit
                sent_id = None if sent is None else _request_id_of(sent)
                if problem is not None:
                    status, headers, payload = problem
                    rid = sent_id or new_request_id()
                    await send_response(send, (status, [*headers, _id_header(rid)], payload))
                    return
                limit = intake.max_body_bytes
                try:
                    if length is None or (
                        length is not _SEVERAL and not (length.isdigit() and int(length) > limit)
                    ):
                        msg = await receive()
                        data = msg.get("body", b"")
                        if (
                            msg.get("more_body", False)
                            or len(data) > limit
                            or msg["type"] == "http.disconnect"
                        ):
                            data = await read_body(scope, receive, limit, first=msg)
                    else:
                        data = await read_body(scope, receive, limit)  # its Content-Length check says why
                except BadRequest as e:
                    rid = sent_id or new_request_id()
                    await send_response(send, json_response(e.status, invalid_request(e), [_id_header(rid)]))
                    return
                if route is not None and (
                    scope["path"] != route.path or scope.get("raw_path") != _raw(route.path)
                ):
                    # Forward to the route the engine would serve, not to a variant it would redirect (a
                    # request to the route itself, nearly all, keeps its scope: the copy would be the same).
                    scope = {**scope, "path": route.path, "raw_path": _raw(route.path)}
                task = asyncio.current_task()  # once: the forward's overrun callback and the disconnect watch
                assert task is not None
                # A large body is held by a _Body, which lets go of it once written (issue #12); a small
                # one goes as its bytes (one object less per request).
                body = data if len(data) < _Body.STREAM_FROM else _Body(data)
                msg = data = None  # the bytes live in ``body`` alone: a _Body lets go of them once written
                work = self._gated(scope, body, send, handle, route, sent_id, task, forward, (intake, parser))
                watch = scope.get(DISCONNECT_WATCH)
                if watch is None:
                    await _until_disconnect(work, receive, scope, task=task)
                    return
                # In this frame: two frames less on every resumption of the request's task, and no
                # coroutine of their own (issue #27). ClientGone: the handle's exit records client_gone.
                with _ServerWatch(watch, task):
                    await work
        except ClientGone:
            return

    # -- gated ---------------------------------------------------------------------------------------

    async def _gated(
        self,
        scope: Scope,
        body: _Body | bytes | bytearray,
        send: Send,
        handle: Handle,
        route: Route | None = None,
        sent_id: str | None = None,
        task: asyncio.Task | None = None,
        forward: list[tuple[bytes, bytes]] | None = None,
        scanned: tuple[_Intake, list[tuple[bytes, bytes]] | None] | None = None,
    ) -> None:
        """Decide and forward. One coroutine (not one around another): every resumption of the
        upstream request passes through each frame of the stack (issue #27). ``task``: this request's
        (the current one; the caller hands it over when it has it). ``body``: a large one in a
        :class:`_Body`, a small one as its bytes. ``forward``, ``scanned``: what ``_scan_gated`` read of
        the headers (None: read them here)."""
        rids: list[str] = []
        try:
            try:
                if not self.turns.let_in():
                    await self.turns.wait()
                admitted = await self._decide(
                    scope,
                    body.data if type(body) is _Body else body,
                    send,
                    handle,
                    route,
                    sent_id,
                    rids,
                    scanned,
                )
                if admitted is not None:
                    mine = task if task is not None else asyncio.current_task()
                    assert mine is not None
                    handle.on_overrun(lambda h: mine.cancel(_OVERRUN))
                    # The parsed request, its count and demand died with _decide's frame; a large body's
                    # raw bytes go once they are written to the engine, not after a stream's minutes.
                    extra, request_id, measured, stripped = admitted
                    if stripped is not None:
                        body = _Body(stripped)
                    if type(body) is _Body:
                        payload, size = body.payload(), body.size
                    else:
                        payload, size = body, len(body)
                    await self._forward(
                        scope,
                        payload,
                        send,
                        handle,
                        extra,
                        length=size,
                        request_id=request_id,
                        measured=measured,
                        forward=forward,
                    )
            finally:  # the rids go before any answer below is sent
                for rid in rids:
                    left = self._rids.pop(rid) - 1
                    if left:
                        self._rids[rid] = left
        except asyncio.CancelledError:
            if handle.outcome is Outcome.PREFILL_OVERRUN and _overrun_cancel():
                # The in-flight guard stopped it before its first byte (core/overrun.py): the upstream
                # request was cancelled with this task (the engine aborts it as the connection closes),
                # and the client, who has seen nothing yet, gets the gate's answer.
                assert handle.decision is not None and handle.demand is not None
                answers = self.admission.policy.answers
                await send_response(
                    send, rejection_response(handle.decision, handle.demand, handle.waited_s, answers)
                )
                return
            raise

    async def _decide(
        self,
        scope: Scope,
        body: bytes | bytearray,
        send: Send,
        handle: Handle,
        route: Route | None,
        sent_id: str | None,
        rids: list[str],
        scanned: tuple[_Intake, list[tuple[bytes, bytes]] | None] | None = None,
    ) -> tuple[list[tuple[bytes, bytes]], str | None, bool, bytes | None] | None:
        """Parse, count, decide: the admit headers and _forward's options, or None once answered here.
        ``rids``: where the request's rids are put once it holds them (the caller lets them go).
        ``scanned``: the policy's intake the headers were read with and the parser's headers found
        (``_scan_gated``), used while that policy is still the one in force."""
        a = self.admission
        intake = self._intake
        if intake.loaded is not a.loaded:  # once per policy, not per request
            intake = self._intake = _Intake(a.loaded)
        bounds, max_body_bytes = intake.bounds, intake.max_body_bytes
        if scanned is not None and scanned[0] is intake:
            parser = scanned[1]
            headers = None if parser is None else _parser_dict(parser)
        else:  # a policy with another class header came in meanwhile: its names, read now
            headers = _headers_dict(scope, intake.names)
        shape = route.shape if route is not None and route.shape else None
        try:
            # A 500K-token prompt is MBs of JSON (tens of ms to decode): off the loop, so other requests
            # and the pollers do not wait behind it. Small bodies are cheaper parsed in place.
            if len(body) > PARSE_IN_THREAD_BYTES:
                options = {
                    "max_body_bytes": max_body_bytes,
                    "accept_emulator": self.trust_declared_sizes,
                    "priority": bounds,
                    "shape": shape,
                }
                parse = functools.partial(parse_generation, scope["path"], body, headers, **options)
                req = await asyncio.to_thread(parse)
            else:
                req = parse_generation(
                    scope["path"],
                    body,
                    headers,
                    max_body_bytes=max_body_bytes,
                    accept_emulator=self.trust_declared_sizes,
                    priority=bounds,
                    shape=shape,
                )
        except BadRequest as e:
            rid = sent_id or new_request_id()
            await send_response(send, json_response(e.status, invalid_request(e), [_id_header(rid)]))
            return None
        # Kept if the client (or a router) sent one; else SGLang's own `rid`; else a fresh one.
        rid = sent_id or (req.rid is not None and _usable_request_id(req.rid)) or new_request_id()
        stripped = None
        try:
            # Policy gateway_fields: a body that sets none of the names (nearly every one) has nothing
            # to refuse or strip (``gateway_fields_in``'s answer, ``()``, without its call).
            if intake.gateway_work and not intake.gateway_names.isdisjoint(req.body_obj):
                stripped = self._gateway_fields(req, body)
            if intake.rid_unique and req.rids:
                self._hold_rids(req, rids)
        except BadRequest as e:
            handle.end(Outcome.BAD_REQUEST)
            await send_response(send, json_response(e.status, invalid_request(e), [_id_header(rid)]))
            return None
        # No coroutine where the count needs no wait (ids, the bound the gate takes, no tokenizer); the
        # gate's callback only where the counter may ask it.
        counter = self.counter
        count = counter.count_now(req, admits=self._admits_now(req) if counter.asks_admits else None)
        if count is None:
            count = await counter.count(req)
        demand = demand_of(a.rules, a.snapshot, req, count, now=a.clock.now(), request_id=rid)
        if handle.submit(demand, self._answer) is Action.HOLD:
            await self._held(handle)  # the gate answers later
        if not handle.admitted:
            assert handle.decision is not None
            answer = rejection_response(handle.decision, demand, handle.waited_s, a.policy.answers)
            await send_response(send, answer)
            return None
        extra = [(b"x-request-id", rid.encode("latin-1")), _ADMITTED, _wait_header(handle.waited_s)]
        if handle.shadow_reject is not None:
            d = handle.shadow_reject
            extra.append((b"x-admission-shadow-decision", d.action.value.encode()))
            extra.append((b"x-admission-shadow-reason", (d.reason.value if d.reason else "none").encode()))
        # The forward's options: the id the sidecar chose (None: the client's goes with its headers),
        # whether the first byte times a prefill (a stream), the body without a stripped field.
        return extra, None if sent_id else rid, req.stream, stripped

    def _gateway_fields(self, req: GenerationRequest, body: bytes | bytearray) -> bytes | None:
        """Policy ``gateway_fields``: a client's copy of a gateway-only field refused (400), or the
        body without it (returned), or None when there is nothing to do."""
        rules = self.admission.policy.gateway_fields
        if rules.on_client == "pass":
            return None
        found = gateway_fields_in(req.body_obj, rules.names)
        if not found:
            return None
        if rules.on_client == "strip":
            return without_fields(body, found)
        raise BadRequest(
            400,
            f'field "{found[0]}" may be set only by a trusted gateway on this lane (policy '
            "gateway_fields); send the request without it",
            "gateway_field",
            found[0],
        )

    def _hold_rids(self, req: GenerationRequest, rids: list[str]) -> None:
        """Policy ``gateway_fields.rid: unique``: a rid already in flight is refused (400). ``_decide``
        calls it only where ``_Intake.rid_unique`` and the request has rids (else it does nothing)."""
        if self.admission.policy.gateway_fields.rid != "unique" or not req.rids:
            return
        taken = next((r for r in req.rids if r in self._rids), None)
        if taken is None and len(set(req.rids)) < len(req.rids):
            taken = next(r for r in req.rids if req.rids.count(r) > 1)
        if taken is not None:
            raise BadRequest(
                400,
                f'rid "{taken[:64]}" is already in flight on this lane; use a fresh rid',
                "rid_in_flight",
                "rid",
            )
        for r in req.rids:
            self._rids[r] = self._rids.get(r, 0) + 1
            rids.append(r)

    async def _held(self, handle: Handle) -> None:
        """Wait for the gate's answer (admit or refuse) to a held request: the future :meth:`_answer` sets.

        A client that leaves while held cancels the task awaiting it, and the handle's exit records
        ``client_gone``: that releases the charge if the gate admitted it in the same instant (a poll or
        a release pumped the queue before this task woke), or leaves the queue if not. Nothing can answer
        a held handle between ``submit`` and this future's creation (no await between): the future is
        made only for the few requests that wait, and the callback every ``submit`` takes is one bound
        method of the proxy (a closure per request was per-request work for the few held; issue #27).
        """
        answered = asyncio.get_running_loop().create_future()
        self._answers[handle] = answered
        try:
            await answered
        finally:
            self._answers.pop(handle, None)

    def _answer(self, handle: Handle) -> None:
        """A held request decided: wake its :meth:`_held`."""
        answered = self._answers.pop(handle, None)
        if answered is not None and not answered.done():
            answered.set_result(None)

    def _admits_now(self, req: GenerationRequest) -> Callable[[TokenCount], bool]:
        """Would ``req`` be admitted now at this count? The counter tokenizes only when the answer is no."""

        def admits(count: TokenCount) -> bool:
            a = self.admission
            return a.evaluate(demand_of(a.rules, a.snapshot, req, count, now=a.clock.now())).admitted

        return admits

    # -- forwarding ----------------------------------------------------------------------------------

    def _upstream_target(
        self,
        scope: Scope,
        lean: bool,
        keep_length: bool,
        length: int | None,
        request_id: str | None,
        forward: list[tuple[bytes, bytes]] | None = None,
    ) -> tuple[Any, Any]:
        """The engine's target and the request headers to send it. ``lean``: the lean client takes the
        request's own bytes (target and headers as received, nothing decoded and encoded back).
        ``forward``: ``_request_header_bytes(scope, keep_length)`` as the request's scan found them."""
        if lean:
            target = self._prefix + scope["raw_path"]
            if scope.get("query_string"):
                target += b"?" + scope["query_string"]
            headers = _request_header_bytes(scope, keep_length) if forward is None else forward
            if request_id is not None:
                headers.append((b"x-request-id", request_id.encode("latin-1")))
            if length is not None:
                headers.append((b"content-length", b"%d" % length))
            return target, headers
        url = self.upstream + scope["raw_path"].decode("latin-1")
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        cim = _request_headers(scope, keep_length=keep_length)
        if request_id is not None:
            cim["X-Request-Id"] = request_id
        if length is not None:
            cim["Content-Length"] = str(length)
        return URL(url, encoded=True), cim  # the path and query relayed byte for byte, no re-quoting

    async def _forward(
        self,
        scope: Scope,
        body: Any,
        send: Send,
        handle: Handle | None,
        extra_headers: list[tuple[bytes, bytes]],
        *,
        keep_length: bool = False,
        length: int | None = None,
        request_id: str | None = None,
        measured: bool = False,
        forward: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        """Relay to the engine. ``body``: bytes, or an async iterator of them (then ``keep_length``
        keeps the client's Content-Length, or ``length`` gives ours). ``request_id``: an id the sidecar
        chose, sent on as ``X-Request-Id`` (one the client sent goes with its other headers).
        ``measured``: a stream, whose first byte is its prefill's end (it times the lane's prefill rate).
        ``forward``: the request headers to send the lean client, read by the request's scan (None: read
        here); the list is the request's own, and gets the id and length appended."""
        session = self.session
        assert session is not None, "proxy used outside the app's lifespan"
        started = False
        forwarded_at = time.monotonic()
        sized = length is not None and not isinstance(body, _BYTES)
        lean = session.__class__ is UpstreamClient
        target, req_headers = self._upstream_target(
            scope, lean, keep_length, length if sized else None, request_id, forward
        )
        try:
            async with session.request(
                scope["method"], target, data=body or None, headers=req_headers, allow_redirects=False
            ) as resp:
                # A gated answer drops the engine's X-Request-Id too: ours names this request in the
                # decision log; an engine's echo would duplicate it.
                drop = _DROP_RESPONSE if handle is None else _DROP_RESPONSE_GATED
                headers = _response_headers(resp.raw_headers, self._origin, drop)
                headers += extra_headers
                status = resp.status
                start = {"type": "http.response.start", "status": status, "headers": headers}
                note = scope.get(ACCESS_NOTE)
                if note is None:
                    relay = send
                else:
                    # The relayed answer skips the access log's wrapper: the note tells it the status and
                    # headers (as the start goes out) and the bytes (at the end). An answer sent here on
                    # an error still goes through ``send`` (the wrapper), whose status the log prefers.
                    note["upstream_status"] = status
                    relay = note.get("raw_send", send)
                if handle is None:
                    if note is not None:
                        note["status"], note["headers"] = status, headers
                    await relay(start)
                    started = True
                # Read by ``readany`` (b"" at the end), not ``iter_any``'s async generator (one more
                # object, frame and loop hook per response); the lean client's ``take`` hands over
                # what has arrived already without a coroutine (a small answer: all of it).
                take = resp.take if lean else _nothing_taken
                read = resp.content.readany
                # Past the first piece, a lean response hands each read's pieces straight to the
                # server's writer (server.BodyWriter) from its connection's callback (``splice``): a
                # stream's event wakes no task and sends no message (issue #27). Only where the relay
                # goes to the server's own send anyway (the access log's note); a piece the writer
                # refuses (the client not draining, a length-framed answer) comes back to ``relay``.
                server = scope.get(DISCONNECT_WATCH) if lean and note is not None else None
                relayed = 0
                try:
                    chunk = take()
                    if chunk is None:
                        chunk = await read()
                    if handle is not None:
                        # A gated answer starts at the engine's first body byte (SGLang sends a stream's
                        # headers before its prefill): until then the in-flight guard may still turn
                        # it into a clean 503 (core/overrun.py).
                        if chunk:
                            handle.prefill_done(measured and status == 200)
                            self.on_first_byte(time.monotonic() - forwarded_at)
                        if note is not None:
                            note["status"], note["headers"] = status, headers
                        await relay(start)
                        started = True
                    while chunk:
                        relayed += len(chunk)
                        await relay({"type": "http.response.body", "body": chunk, "more_body": True})
                        chunk = take()
                        if chunk is None:
                            chunk = await read() if server is None else await resp.splice_via(server, relay)
                finally:
                    if note is not None:
                        if server is not None:
                            relayed += resp.spliced
                        note["body_bytes"] = note.get("body_bytes", 0) + relayed
                await relay({"type": "http.response.body", "body": b""})
                if handle is not None:
                    handle.relayed()
        except (aiohttp.ClientError, TimeoutError) as e:
            if not started:
                status, headers, payload = _upstream_error(e, self.upstream)
                await send_response(send, (status, headers + extra_headers, payload))
            else:
                # Headers are gone; the only honest signal left is to break the connection, so the
                # client does not mistake a truncated stream for a complete one.
                log.warning("upstream broke mid-response on %s: %s", scope["path"], e)
                raise UpstreamBroke(str(e)) from None


def _nothing_taken() -> None:
    """aiohttp's response has no ``take``: every read waits in ``readany``."""
    return None


class _Turns:
    """About ``budget_s`` of gated requests' gate work per event-loop turn; the rest wait for the next
    turns, in arrival order.

    Why (issue #27, bursts): the server starts every request that arrived together in one loop turn,
    and each runs its gate work (parse, count, decide, log) and its forward in one step. A burst of
    64 then did all 64 gates before the loop read any of the engine's answers: every request's first
    byte waited for the whole burst's gate work (p50 = p99 = 64 gates). Spread over turns, the engine's
    answers are read and relayed between them, so a request's first byte waits for the gates ahead of
    it only. The total work is the same; a request alone, or a trickle, never waits.

    At least ``min_per_turn`` gates a turn: at saturation (wrk, 64 connections, on the lent H100 host) a
    1 ms budget alone let ~2 gates through a turn and the loop's per-turn costs rose to ~40 % more CPU
    per gated request (381 -> 531 µs; ``bench/results/2026-12-06-h100-overhead.md``). The least is 4,
    not 16: alternated on the lent H100 host, 16 let a burst's gates stall the loop 6-8 ms a tick (the
    paced stall goal is 5) and held saturation p99 TTFB at 97-148 ms; 4 kept the stall at 3.0 ms and
    the p99 at 29-36 ms for ~15 % more CPU per gated request at saturation (evidence QE1).
    """

    __slots__ = ("_clock", "_entered", "_next", "_per_gate", "_queue", "_turn_at", "budget_s", "min_per_turn")

    def __init__(
        self, budget_s: float = 0.001, clock: Callable[[], float] = time.perf_counter, min_per_turn: int = 4
    ) -> None:
        self.budget_s = budget_s
        self.min_per_turn = min_per_turn
        self._clock = clock
        self._turn_at: float | None = None  # when this turn's first gate started; None: no turn open
        self._entered = 0  # gates started in this turn
        self._per_gate = budget_s / 4  # a gate's time, as last measured (how many a turn lets go)
        self._queue: collections.deque[asyncio.Future[None]] = collections.deque()
        self._next = self._next_turn  # bound once: every turn with a gate schedules it

    async def enter(self) -> None:
        """Return when this request may do its gate work: at once while this turn's budget lasts and
        nobody waits, else in a later turn, after those that waited before it."""
        if not self.let_in():
            await self.wait()

    def let_in(self) -> bool:
        """May this request do its gate work now (no coroutine for the common case: a request alone)?"""
        if self._turn_at is None:
            self._turn_at, self._entered = self._clock(), 1
            asyncio.get_running_loop().call_soon(self._next)
            return True
        if not self._queue:
            spent = self._clock() - self._turn_at
            if spent < self.budget_s or self._entered < self.min_per_turn:
                self._per_gate = spent / self._entered
                self._entered += 1
                return True
        return False

    async def wait(self) -> None:
        """Wait for a later turn, after those that waited before this request."""
        waiter = asyncio.get_running_loop().create_future()
        self._queue.append(waiter)
        await waiter

    def _next_turn(self) -> None:
        """A new loop turn: let go of as many waiters, in order, as the budget holds (their gates run
        in the next turn, after the engine's answers read in this one)."""
        self._turn_at = None
        queue = self._queue
        if not queue:  # nearly every turn: nobody waits
            return
        n = max(self.min_per_turn, int(self.budget_s / max(self._per_gate, 1e-6)))
        released = 0
        while queue and released < n:
            waiter = queue.popleft()
            if not waiter.done():  # done: its request was cancelled (the client left) while it waited
                waiter.set_result(None)
                released += 1
        if released:
            self._turn_at, self._entered = self._clock(), released
            asyncio.get_running_loop().call_soon(self._next)


# The cancellation message of a request the in-flight guard stopped (Handle.on_overrun): for whoever
# reads a traceback of the task. ``_gated`` decides by the handle's outcome, not by this message (of two
# cancellations, the client's and the guard's, only one message survives).
_OVERRUN = "prefill_overrun"


def _overrun_cancel() -> bool:
    """This task was cancelled by the guard's abort of its request alone (not also by the client leaving
    or a shutdown): take that cancellation back, so the task can still answer."""
    task = asyncio.current_task()
    assert task is not None
    return task.uncancel() == 0


class UpstreamBroke(Exception):
    """Raised after the response started, so that the server drops the client connection."""


def _upstream_error(e: BaseException, upstream: str) -> tuple[int, list, bytes]:
    """The client's answer names no address: the engine's URL is for the operator's log (this line),
    not for a client that could then go around the gate (SECURITY.md)."""
    log.warning("engine at %s: %s: %s", upstream, type(e).__name__, e)
    if isinstance(e, aiohttp.ClientConnectorError):
        why = e.os_error.strerror if e.os_error is not None and e.os_error.strerror else "cannot connect"
        return error_response(
            503,
            f"The engine is unreachable ({why.lower()}).",
            "engine_unavailable",
            headers=[(b"retry-after", b"5")],
        )
    if isinstance(e, TimeoutError | aiohttp.ServerTimeoutError):
        return error_response(504, "The engine sent no data within the read timeout.", "upstream_timeout")
    return error_response(502, f"The engine's answer broke off ({type(e).__name__}).", "upstream_error")


async def read_body(
    scope: Scope, receive: Receive, limit: int, source: str | None = None, *, first: Message | None = None
) -> bytes | bytearray:
    """The whole body, refused (413) by its Content-Length or as soon as the bytes read pass ``limit``:
    never buffered beyond it. ``source`` names the limit in the message. ``first``: the body's first
    message, already received (``Proxy._gated_request`` takes a body of one message itself, and hands
    any other here); its Content-Length was checked then."""
    where = {"source": source} if source else {}
    if first is None:
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > limit:
                raise BadRequest.body_too_large(int(v), limit, **where)
    # One growing buffer, not a list of chunks joined at the end (the join held every byte twice).
    # Not sized from Content-Length up front: a client could then make us allocate 32 MB by saying so.
    buf = bytearray()
    while True:
        if first is None:
            msg = await receive()
        else:
            msg, first = first, None
        if msg["type"] == "http.disconnect":
            raise ClientGone
        chunk = msg.get("body", b"")
        more = msg.get("more_body", False)
        if not buf and not more:
            if len(chunk) > limit:
                raise BadRequest.body_too_large(len(chunk), limit, at_least=True, **where)
            return chunk  # the whole body in one message (every small request): no copy at all
        buf += chunk
        if len(buf) > limit:
            raise BadRequest.body_too_large(len(buf), limit, at_least=True, **where)
        if not more:
            return buf


class _Body:
    """A gated request's body, held once: the parser reads ``data``; :meth:`payload` hands a large one
    to the upstream client as a one-shot iterator that lets go of it as soon as it has been written
    (aiohttp would keep a bytes payload referenced until the response ends: 3.6 MB per in-flight
    500K-id stream, for minutes; issue #12)."""

    __slots__ = ("data", "size")
    # Below this, a plain bytes payload (aiohttp's fastest path) and the few KB it keeps are cheaper.
    STREAM_FROM = 64 * 1024

    def __init__(self, data: bytes | bytearray) -> None:
        self.data: bytes | bytearray | None = data
        self.size = len(data)

    def __len__(self) -> int:
        return self.size

    def payload(self) -> Any:
        if self.size < self.STREAM_FROM:
            return self.data
        return self._drain()

    async def _drain(self) -> Any:
        data, self.data = self.data, None
        assert data is not None, "a gated body is forwarded once"
        yield memoryview(data)  # a view: aiohttp's slice to Content-Length copies nothing
        del data


class _PassThroughBody:
    """A large or chunked pass-through body, relayed to the engine as it arrives (a small one is read
    whole by ``Proxy._pass_through``, which hands the rest of one in several messages to :meth:`rest`).

    ``done`` is set once the body has been read: only then may the disconnect listener take over
    ``receive`` (two readers of one ASGI channel would steal each other's messages).
    """

    # Above this Content-Length (or chunked), the body is relayed as it arrives.
    INLINE_LIMIT = 1 << 20

    def __init__(self, receive: Receive) -> None:
        self.done = asyncio.Event()
        self.data = self._relay(receive)

    @staticmethod
    async def rest(msg: Message, receive: Receive) -> bytes:
        """A small body sent in several messages, from its first (``msg``) on, joined."""
        parts = [msg.get("body", b"")]
        while msg.get("more_body"):
            msg = await receive()
            parts.append(msg.get("body", b""))
        if msg["type"] == "http.disconnect":
            raise ClientGone
        return b"".join(parts)

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


class _ServerWatch:
    """The client's going learnt from the server's own connection (``serving.DISCONNECT_WATCH``) around
    work awaited in the caller's frame: ``with _ServerWatch(watch, task): await work``. If the client
    leaves first, the task is cancelled and the block raises :class:`ClientGone`; a cancellation from
    anyone else too (a shutdown) goes on. A ``with`` block adds no coroutine and no frame to the
    request's task, which a wrapper coroutine did on every resumption (issue #27). The instance is the
    callback itself (the server unwatches by identity), so no closure or bound method per request."""

    __slots__ = ("_gone", "_task", "_watch")

    def __init__(self, watch: Any, task: asyncio.Task) -> None:
        self._watch, self._task, self._gone = watch, task, False

    def __call__(self) -> None:  # the server's connection_lost
        self._gone = True
        self._task.cancel()

    def __enter__(self) -> None:
        self._watch.watch_disconnect(self)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self._watch.unwatch_disconnect(self)
        if kind is asyncio.CancelledError and self._gone and self._task.uncancel() == 0:
            raise ClientGone from None


async def _until_disconnect(
    work: Awaitable[None],
    receive: Receive,
    scope: Scope,
    after: asyncio.Event | None = None,
    task: asyncio.Task | None = None,
) -> None:
    """Run ``work`` in this task; if the client disconnects first, cancel it (its finally blocks do the
    cleanup) and raise :class:`ClientGone`.

    ``after``: start listening only once this is set (the request body is still being read).
    The work runs in the caller's own task. The client's going is learnt from the server's own
    connection (``serving.DISCONNECT_WATCH``: a callback from its ``connection_lost``) when it offers
    that and the body has been read; otherwise one listener task watches ``receive``. No task per
    request then, no ``asyncio.wait`` and no extra loop turn before the work starts (all were on every
    request's path; issue #12). Awaited in place, the work has started before anything can cancel it,
    so its own cleanup always runs.
    """
    if task is None:  # the caller may hand it over (it had it already)
        task = asyncio.current_task()
    assert task is not None
    watch = scope.get(DISCONNECT_WATCH) if after is None else None
    if watch is not None:
        with _ServerWatch(watch, task):
            await work
        return
    gone = False

    async def listen() -> None:
        nonlocal gone
        if after is not None:
            await after.wait()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                gone = True
                task.cancel()
                return

    listener = asyncio.get_running_loop().create_task(listen())
    try:
        await work
    except asyncio.CancelledError:
        # Ours (the client left: ClientGone) unless someone else cancelled this task too (a shutdown),
        # whose cancellation goes on.
        if gone and task.uncancel() == 0:
            raise ClientGone from None
        raise
    finally:
        listener.cancel()


def new_request_id() -> str:
    """32 random hex digits, like a uuid4's: an id for logs, not a secret, so the process's seeded PRNG
    serves (``uuid.uuid4`` costs a system call and an object per request). Its bytes' ``hex``: what
    ``f"{n:032x}"`` writes, for about two thirds of the instructions (issue #27)."""
    return _random_bits(128).to_bytes(16, "big").hex()


def _request_id_of(value: bytes) -> str | None:
    """A client's X-Request-Id value, kept when it looks like an id."""
    return value.decode("latin-1") if _REQUEST_ID.match(value) else None


def _usable_request_id(rid: str | None) -> str | None:
    """A body's ``rid`` as the answer's ``X-Request-ID`` only when it is a valid header value: any JSON
    string can be a rid (``"é"``, a newline), and an invalid header value fails the whole answer."""
    if rid is None or not _REQUEST_ID.match(rid.encode("utf-8", "replace")):
        return None
    return rid


def _wait_header(waited_s: float) -> tuple[bytes, bytes]:
    """``X-Admission-Wait-Ms``: the wait in whole milliseconds (``round``: half to even). A wait under
    half a millisecond, nearly every admission's, is the constant ``0`` header, not a formatted one."""
    ms = waited_s * 1000
    if -0.5 <= ms <= 0.5:
        return _NO_WAIT
    return (b"x-admission-wait-ms", b"%d" % round(ms))


def _id_header(rid: str) -> tuple[bytes, bytes]:
    return (b"x-request-id", rid.encode("latin-1"))


_DECODED = "sidecar.decoded_headers"


def _decoded(scope: Scope) -> list[tuple[bytes, str, str]]:
    """The request's headers decoded once per request (the parser and the forwarder both read them).

    Values as UTF-8: aiohttp writes header strings as UTF-8, so this relays the client's bytes
    unchanged (latin-1 turned `café` into `cafÃ©`); the scans have refused non-UTF-8 values (`_not_utf8`).
    """
    decoded = scope.get(_DECODED)
    if decoded is None:
        decoded = scope[_DECODED] = [(k, k.decode("latin-1"), v.decode("utf-8")) for k, v in scope["headers"]]
    return decoded


def _headers_dict(scope: Scope, names: frozenset[bytes]) -> dict[str, str]:
    """The headers the body parser reads (``names``: the priority headers, a policy's class header),
    decoded; a request carries none of them mostly, and decoding all of its headers was per-request
    work for nothing (issue #27)."""
    return {k.decode("latin-1"): v.decode("utf-8") for k, v in scope["headers"] if k in names}


class _Intake:
    """What a gated request's intake takes from the policy in force, read once per policy
    (``Proxy._intake``): the parser's priority bounds and the headers it reads
    (``_parser_header_names``), the body limit, whether policy ``gateway_fields`` has anything to do,
    and the header names ``_scan_gated`` looks at. Per request these were property reads and calls.
    ``tests/test_proxy_scan.py`` checks the shortcuts ``_decide`` takes with them against the calls."""

    __slots__ = (
        "bounds",
        "gateway_names",
        "gateway_work",
        "loaded",
        "max_body_bytes",
        "names",
        "rid_unique",
        "special",
    )

    def __init__(self, loaded: Any) -> None:
        self.loaded = loaded
        if loaded is None:  # before the first request: nothing read yet
            return
        policy = loaded.policy
        self.bounds: PriorityBounds = policy.priority.bounds
        self.names = _parser_header_names(self.bounds.class_header)
        self.max_body_bytes: int = policy.limits.max_body_bytes
        gateway = policy.gateway_fields
        self.gateway_work = gateway.on_client != "pass"  # a client's gateway field refused or stripped
        self.gateway_names = frozenset(gateway.names)
        self.rid_unique = gateway.rid == "unique"
        self.special = _DROP_REQUEST | _GATED_READ | self.names


@functools.lru_cache(maxsize=64)
def _raw(path: str) -> bytes:
    """A route's path as an ASGI ``raw_path`` (a lane's gated routes are few)."""
    return path.encode()


@functools.lru_cache(maxsize=8)
def _parser_header_names(class_header: str | None) -> frozenset[bytes]:
    """What ``parse_generation`` consults (``intake.body._priority``, ``PriorityBounds.resolve``), as
    ASGI header names (lower-case bytes); once per policy's class header."""
    names = {n.encode("latin-1") for n in PRIORITY_HEADERS}
    if class_header is not None:
        names.add(class_header.lower().encode("latin-1"))
    return frozenset(names)


# What ``_scan_gated`` reads besides the dropped headers and the parser's (the forwarded headers are
# every other one).
_GATED_READ = frozenset({b"content-type", b"x-request-id"})
# A Connection header naming only what is dropped anyway (nearly every one: HTTP/1.1 clients send
# `keep-alive`): nothing more to drop, so the scan keeps its one pass.
_CONNECTION_PLAIN = frozenset({b"keep-alive"})
# More than one Content-Length: ``read_body``'s own check reads them all.
_SEVERAL = b"several"


def _scan_gated(
    headers: list[tuple[bytes, bytes]], intake: _Intake
) -> tuple[
    bytes | None,
    bytes | None,
    bytes | None,
    bytes | None,
    list[tuple[bytes, bytes]] | None,
    list[tuple[bytes, bytes]],
]:
    """A gated request's headers in one pass (issue #27: six passes read them before): the name of the
    first value that is not UTF-8 (answered by ``_not_utf8``), the first Content-Type (by
    ``json_media_refusal``), the first X-Request-Id, the Content-Length (``_SEVERAL`` when sent more than
    once: ``read_body`` checks those), the headers the body parser reads (``_headers_dict``'s, undecoded;
    None when none) and those to forward (``_request_header_bytes(scope, False)``).
    ``tests/test_proxy_scan.py`` holds each equal to a plain one-question-per-pass reading of the rule
    on generated header lists."""
    special = intake.special
    names = intake.names
    forward = []
    bad = ctype = sent = length = parser = None
    named = False
    for h in headers:
        k, v = h
        if not v.isascii() and bad is None and not _is_utf8(v):
            bad = k
        if k not in special:
            forward.append(h)
            continue
        if k in names:
            if parser is None:
                parser = [h]
            else:
                parser.append(h)
        if k == b"content-type":
            if ctype is None:
                ctype = v
        elif k == b"x-request-id":
            if sent is None:
                sent = v
        elif k == b"content-length":
            length = v if length is None else _SEVERAL
        elif k == b"connection" and v.lower() not in _CONNECTION_PLAIN:
            named = True
        if k not in _DROP_REQUEST:
            forward.append(h)
    if named:  # rare: what its options name goes too (ASGI names are lower-case)
        drop = _connection_named(headers)
        forward = [h for h in forward if h[0] not in drop]
    return bad, ctype, sent, length, parser, forward


def _scan_pass(
    headers: list[tuple[bytes, bytes]],
) -> tuple[bytes | None, bytes | None, bool, list[tuple[bytes, bytes]]]:
    """A pass-through request's headers in one pass: the name of the first value that is not UTF-8
    (answered by ``_not_utf8``), the Content-Length and whether the body is chunked (how it is read), and the
    headers to forward when the body is read whole (``_request_header_bytes(scope, False)``; a relayed
    body keeps its Content-Length and reads them again). Compared with plain readings in
    ``tests/test_proxy_scan.py``."""
    forward = []
    bad = length = None
    chunked = named = False
    for h in headers:
        k, v = h
        if not v.isascii() and bad is None and not _is_utf8(v):
            bad = k
        if k not in _DROP_REQUEST:
            forward.append(h)
        elif k == b"content-length":
            length = v
        elif k == b"transfer-encoding":
            chunked = True
        elif k == b"connection" and v.lower() not in _CONNECTION_PLAIN:
            named = True
    if named:
        drop = _connection_named(headers)
        forward = [h for h in forward if h[0] not in drop]
    return bad, length, chunked, forward


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _parser_dict(found: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """``_headers_dict`` of the headers ``_scan_gated`` found (a later one of a name wins, as there)."""
    return {k.decode("latin-1"): v.decode("utf-8") for k, v in found}


def _request_header_bytes(scope: Scope, keep_length: bool) -> list[tuple[bytes, bytes]]:
    """:func:`_request_headers` as the client sent them, for the lean client (which writes bytes)."""
    drop = _DROP_REQUEST_KEEP_LENGTH if keep_length else _DROP_REQUEST
    raw = scope["headers"]
    # One loop, no generator and no comprehension's frame (every request's path, issue #27).
    out = []
    for h in raw:
        k = h[0]
        if k in drop:
            if k == b"connection":  # rare: what its options name goes too (ASGI names are lower-case)
                drop = drop | _connection_named(raw)
                return [h for h in raw if h[0] not in drop]
            continue
        out.append(h)
    return out


def _request_headers(scope: Scope, *, keep_length: bool = False) -> CIMultiDict[str]:
    """End-to-end headers only. ``keep_length``: a relayed body keeps the client's Content-Length."""
    drop = _DROP_REQUEST_KEEP_LENGTH if keep_length else _DROP_REQUEST
    raw = scope["headers"]
    # ASGI header names are lower-case; the `Connection` options are parsed only when one is sent.
    if any(k == b"connection" for k, _ in raw):
        drop = drop | _connection_named(raw)
    return CIMultiDict([(k, v) for name, k, v in _decoded(scope) if name not in drop])


def _not_utf8(name: bytes) -> Response:
    """A 400 for a header value that is not UTF-8: the upstream client can only send UTF-8 header text,
    so such bytes could not be relayed unchanged (they would be dropped or re-encoded)."""
    return error_response(
        400,
        f'header "{name.decode("latin-1")}" has bytes that are not UTF-8; the sidecar relays header bytes '
        "unchanged and cannot relay these",
        "invalid_header",
    )


def _response_headers(
    raw: tuple[tuple[bytes, bytes], ...], origin: bytes = b"", drop: frozenset[bytes] = _DROP_RESPONSE
) -> list[tuple[bytes, bytes]]:
    out = []
    connection = False
    for k, v in raw:
        k = k.lower()
        if k in drop:
            connection = connection or k == b"connection"
            continue
        if k in _LOCATION_HEADERS and origin:
            v = _local_location(v, origin)
        out.append((k, v))
    if connection:  # rare: drop what its options name too (one pass for everyone else)
        named = _connection_named(raw)
        out = [h for h in out if h[0] not in named]
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
