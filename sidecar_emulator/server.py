"""The engine model served over HTTP with SGLang 0.5.23's API shapes, in real time or sped up.

``build_emulator_app(model, speed=...)`` returns a Starlette app; :class:`EmulatorServer` runs it under
uvicorn on a real socket (tests, ``demo``) and :func:`serve` runs it until interrupted (``emulate``).

A background task advances the model: engine time = start + wall seconds x ``speed`` (``speed=10``:
one engine second passes in 0.1 s). On each tick it dispatches the model's events to the waiting
handlers and writes the live device memory to ``gpu_file`` as ``{"free_bytes": N, "total_bytes": N}``
(temp file + rename), which the sidecar's ``file:`` GPU source reads like NVML.

Endpoints: ``POST /generate`` (SGLang native), ``POST /v1/completions``, ``POST /v1/chat/completions``
(OpenAI shapes, SSE with ``stream: true``), ``GET /metrics``, ``/v1/loads``, ``/server_info``,
``/get_server_info``, ``/health``, ``/health_generate``, ``/ready``, ``POST /tokenize``, ``/v1/models``,
``/model_info``.

Prompt size. There is no tokenizer: a text prompt counts ``len(text.encode()) // 4`` tokens (at least
one), ``input_ids`` count one each. Load generators describe prompts they do not want to send with an
extension field in any generation body::

    "emulator": {"prompt_tokens": 500000, "prefix_key": "agent-7", "cached_tokens": 280000}

``prompt_tokens`` replaces the count, ``prefix_key`` names the cached sequence the prompt starts with
(radix-cache reuse), ``cached_tokens`` how many leading tokens it shares with it (default: all cached).

Failure behaviour, as the real server's:

* client disconnect -> the request is aborted in the model (SGLang aborts on disconnect);
* engine crash -> every open connection is dropped (streams end without ``[DONE]``, non-streaming
  requests get no response), and with ``down_mode="refuse"`` (default) the listening socket is closed
  for the restart time, so new connections are refused like a dead process's, then reopened on the same
  port. ``down_mode="503"`` keeps listening and answers 503 instead (``/health`` 503 while down); it is
  also what happens when the app runs under a server other than :class:`EmulatorServer`, which cannot
  reach the listening socket.
* a request retracted three times ends with 503 (in-band ``finish_reason`` abort when streaming).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from sidecar_emulator.engine import EngineModel
from sidecar_emulator.events import Crashed, Event, Failed, Finished, FirstToken, Restarted, Tokens
from sidecar_emulator.exposition import (
    SGLANG_VERSION,
    FrontendMetrics,
    loads_json,
    loads_prometheus,
    render_metrics,
    server_info,
)
from sidecar_emulator.profiles import LaneProfile, get_profile, profile_names

logger = logging.getLogger("sidecar_emulator.server")

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang SamplingParams default (the emulator also uses it for OpenAI)
VOCAB_SIZE = 151_936  # Qwen tokenizer size; only used to make fake token ids look plausible
_WORDS = ("the", " engine", " emulates", " tokens", " one", " step", " at", " a", " time", ".")


class BadRequest(Exception):
    """A malformed generation body; becomes HTTP 400."""


def build_model(profile: LaneProfile, seed: int = 0, *, cuda: bool = False) -> EngineModel:
    """An engine model on a modeled device, or on the real GPU with ``cuda=True`` (imports torch)."""
    if not cuda:
        return EngineModel(profile, seed)
    from sidecar_emulator.device import on_cuda  # torch is imported inside TorchDevice only

    return EngineModel(profile, seed, device=on_cuda(profile))


# ---------------------------------------------------------------------------------------- requests
@dataclass
class GenerationRequest:
    """A parsed generation body, whichever endpoint it came to."""

    rid: str
    prompt_tokens: int
    max_new_tokens: int
    stream: bool
    prefix_key: str | None
    cached_tokens: int | None
    priority: int
    include_usage: bool = False
    model: str | None = None


def count_text_tokens(text: str) -> int:
    return max(1, len(text.encode()) // 4)


def _int_field(body: dict[str, Any], key: str, default: int | None) -> int | None:
    value = body.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer")
    return value


def _emulator_ext(body: dict[str, Any]) -> tuple[int | None, str | None, int | None]:
    ext = body.get("emulator")
    if ext is None:
        return None, None, None
    if not isinstance(ext, dict):
        raise BadRequest("emulator must be an object")
    unknown = set(ext) - {"prompt_tokens", "prefix_key", "cached_tokens"}
    if unknown:
        raise BadRequest(f"unknown emulator field(s): {', '.join(sorted(unknown))}")
    tokens = _int_field(ext, "prompt_tokens", None)
    cached = _int_field(ext, "cached_tokens", None)
    key = ext.get("prefix_key")
    if key is not None and not isinstance(key, str):
        raise BadRequest("emulator.prefix_key must be a string")
    return tokens, key, cached


def _prompt_tokens(prompt: Any, what: str) -> int:
    if isinstance(prompt, str):
        return count_text_tokens(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return max(1, len(prompt))
    if isinstance(prompt, list):
        raise BadRequest(f"batched {what} is not supported by the emulator; send one prompt per request")
    raise BadRequest(f"{what} must be a string or a list of token ids")


def _chat_text(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise BadRequest("each message must be an object")
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(str(c.get("text", "")) for c in content if isinstance(c, dict))
        elif content is not None:
            raise BadRequest("message content must be a string or a list of parts")
    return "\n".join(parts)


def parse_generation(body: Any, kind: str) -> GenerationRequest:
    """Parse a ``/generate`` (``kind="generate"``), completions or chat body."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    ext_tokens, prefix_key, cached = _emulator_ext(body)
    if kind == "generate":
        if body.get("text") is not None:
            if not isinstance(body["text"], str):
                raise BadRequest("batched text is not supported by the emulator; send one prompt per request")
            tokens = count_text_tokens(body["text"])
        elif body.get("input_ids") is not None:
            tokens = _prompt_tokens(body["input_ids"], "input_ids")
        elif ext_tokens is None:
            raise BadRequest("Either text or input_ids should be provided.")
        else:
            tokens = ext_tokens
        sampling = body.get("sampling_params") or {}
        if not isinstance(sampling, dict):
            raise BadRequest("sampling_params must be an object")
        max_new = _int_field(sampling, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    else:
        if kind == "chat":
            tokens = count_text_tokens(_chat_text(body.get("messages")))
        elif body.get("prompt") is not None:
            tokens = _prompt_tokens(body["prompt"], "prompt")
        elif ext_tokens is None:
            raise BadRequest("prompt is required")
        else:
            tokens = ext_tokens
        max_new = _int_field(body, "max_completion_tokens", None) if kind == "chat" else None
        if max_new is None:
            max_new = _int_field(body, "max_tokens", DEFAULT_MAX_NEW_TOKENS)
    if ext_tokens is not None:
        tokens = ext_tokens
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean")
    rid = body.get("rid") or uuid.uuid4().hex
    if not isinstance(rid, str):
        raise BadRequest("rid must be a string")
    options = body.get("stream_options") or {}
    return GenerationRequest(
        rid=rid,
        prompt_tokens=tokens,
        max_new_tokens=max_new if max_new is not None else DEFAULT_MAX_NEW_TOKENS,
        stream=stream,
        prefix_key=prefix_key,
        cached_tokens=cached,
        priority=_int_field(body, "priority", 0) or 0,
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        model=body.get("model") if isinstance(body.get("model"), str) else None,
    )


def fake_text(start: int, count: int) -> str:
    """Deterministic output text, one short word per token."""
    return "".join(_WORDS[i % len(_WORDS)] for i in range(start, start + count))


def fake_token_ids(text: str) -> list[int]:
    data = text.encode()
    n = count_text_tokens(text)
    return [int.from_bytes(data[4 * i : 4 * i + 4] or b"\0", "little") % VOCAB_SIZE for i in range(n)]


# SGLang's idle scheduler polls its sockets this long before it may empty the cache (IdleSleeper).
IDLE_POLL_S = 1.0


# ---------------------------------------------------------------------------------------- emulator
class Emulator:
    """Owns the model, its clock, the per-request event queues and the listening socket's fate."""

    def __init__(
        self,
        model: EngineModel,
        *,
        speed: float = 1.0,
        gpu_file: Path | None = None,
        down_mode: str = "refuse",
        tick_s: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
        empty_cache_interval_s: float = 0.0,
        idle_poll_s: float | None = None,
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be positive")
        if down_mode not in ("refuse", "503"):
            raise ValueError("down_mode must be 'refuse' or '503'")
        self.model = model
        self.speed = speed
        self.gpu_file = Path(gpu_file) if gpu_file is not None else None
        self.down_mode = down_mode
        self.tick_s = tick_s
        self._clock = clock
        self._wall0 = clock()
        self._epoch0 = time.time()
        self._engine0 = model.now
        self.frontend = FrontendMetrics()
        self._queues: dict[str, asyncio.Queue[Event]] = {}
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._server: uvicorn.Server | None = None
        self._host = "127.0.0.1"
        self._port = 0
        self._listening = True
        # SGLang's idle sleeper with SGLANG_EMPTY_CACHE_INTERVAL (wall seconds, as there): while idle,
        # the allocator cache is emptied at most this often (0: never, SGLang's default).
        self.empty_cache_interval_s = empty_cache_interval_s
        self.idle_poll_s = IDLE_POLL_S if idle_poll_s is None else idle_poll_s
        self._last_empty = clock()
        self._idle_since: float | None = None
        # The radix cache over token ids: (length, hash of the ids, the model's prefix key).
        self._id_prefixes: list[tuple[int, int, str]] = []
        self._was_up = model.up

    # -- time
    def now(self) -> float:
        """Engine time now; never behind the model's own clock."""
        return max(self.model.now, self._engine0 + (self._clock() - self._wall0) * self.speed)

    def wall_time(self, engine_t: float) -> float:
        """The Unix time at which the engine clock reads (or read) ``engine_t``."""
        return self._epoch0 + (engine_t - self._engine0) / self.speed

    # -- lifecycle (the app's lifespan)
    async def start(self) -> None:
        self._wall0 = self._clock()
        self._epoch0 = time.time()
        self._engine0 = self.model.now
        self._write_gpu_file()
        self._task = asyncio.create_task(self._run(), name="emulator-ticker")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def attach(self, server: uvicorn.Server, host: str, port: int) -> None:
        """Give the emulator the uvicorn server, so a crash can drop connections and the socket."""
        self._server = server
        self._host = host
        self._port = port

    @property
    def drops_connections(self) -> bool:
        """Whether a crash can drop open connections itself (runs under :class:`EmulatorServer`)."""
        return self._server is not None

    # -- request side
    def subscribe(self, rid: str) -> asyncio.Queue[Event]:
        if rid in self._queues:
            raise BadRequest(f"request id {rid!r} is already in flight")
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self._queues[rid] = queue
        return queue

    def unsubscribe(self, rid: str) -> None:
        self._queues.pop(rid, None)

    def submit(self, req: GenerationRequest) -> None:
        self.model.submit(
            req.rid,
            req.prompt_tokens,
            max_new_tokens=req.max_new_tokens,
            now=self.now(),
            prefix_key=req.prefix_key,
            cached_tokens_hint=req.cached_tokens,
            priority=req.priority,
        )
        self._idle_since = None  # a request wakes the idle scheduler's poll
        self._kick.set()

    def abort(self, rid: str) -> None:
        if self.model.abort(rid, self.now()):
            self.frontend.aborted += 1
            self._kick.set()

    # -- the ticker
    async def _run(self) -> None:
        try:
            while True:
                await self._tick()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("the emulator's engine loop failed; the engine no longer advances")
            raise

    async def _tick(self) -> None:
        now = self.now()
        events = self.model.advance(now)
        for event in events:
            if isinstance(event, Crashed):
                self._log_crash(event)
        if any(isinstance(e, Crashed) for e in events):
            self._on_crash()
        elif self._was_up and not self.model.up:
            # A planned restart onto a new build (``LaneProfile.upgrade_at_s``): the process goes away
            # as on a crash (connections dropped, the port closed), though nothing ran out of memory.
            logger.warning(
                "engine stopped at engine time %.1f s for a planned restart onto build %s (back in %.0f s "
                "of engine time)",
                now,
                self.model.profile.upgrade_version,
                self.model.profile.upgrade_down_s,
            )
            self._on_crash()
        self._was_up = self.model.up
        for event in events:
            if isinstance(event, Restarted):
                self.frontend = FrontendMetrics()  # a new process: fresh counters
                logger.warning("engine restarted at engine time %.1f s: serving again, cache empty", event.t)
            rid = getattr(event, "rid", None)
            queue = self._queues.get(rid) if rid is not None else None
            if queue is not None:
                queue.put_nowait(event)
        if self.model.up and not self._listening:
            await self._listen_again()
        self._maybe_empty_cache(now)
        self._write_gpu_file()
        nxt = self.model.next_event_time()
        delay = self.tick_s if nxt is None else min(self.tick_s, max(0.0, (nxt - now) / self.speed))
        self._kick.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._kick.wait(), timeout=max(delay, 0.001))

    def _maybe_empty_cache(self, now: float) -> None:
        """SGLang's ``IdleSleeper.maybe_sleep``: an idle scheduler polls its sockets for up to 1 s, then
        empties the cache if the interval has passed since it last did."""
        if self.empty_cache_interval_s <= 0:
            return
        wall = self._clock()
        if not self.model.idle:
            self._idle_since = None
            return
        if self._idle_since is None:
            self._idle_since = wall
        polled = wall - self._idle_since >= self.idle_poll_s
        if polled and wall - self._last_empty > self.empty_cache_interval_s:
            self.model.empty_allocator_cache(now)
            self._last_empty = wall

    def prefix_for_ids(self, ids: list[int]) -> tuple[str, int | None]:
        """SGLang's radix match for a prompt of token ids: the longest earlier prompt it starts with
        (its prefix key and length), else a new key for this prompt."""
        for length, digest, key in sorted(self._id_prefixes, reverse=True):
            if (
                length <= len(ids)
                and self.model.cached_prefix_tokens(key)
                and hash(tuple(ids[:length])) == digest
            ):
                return key, length
        key = f"ids-{uuid.uuid4().hex}"
        self._id_prefixes = [*self._id_prefixes[-63:], (len(ids), hash(tuple(ids)), key)]
        return key, None

    def _log_crash(self, crash: Crashed) -> None:
        """What SGLang's own log would show, plus what a postmortem needs: the state at the crash
        (live values, not the lagging gauges) and when the engine will be back."""
        info = self.model.crashes[-1] if self.model.crashes else None
        live = info.live if info is not None else None
        restart_s = self.model.profile.restart_s
        state = (
            "unknown"
            if live is None
            else f"{live.num_running_reqs} running, {live.num_queue_reqs} queued, "
            f"{live.pending_prefill_tokens:,} pending prefill tokens, token usage {live.token_usage:.2f} "
            f"(full {live.full_token_usage:.2f}, mamba {live.mamba_usage:.2f})"
        )
        memory = (
            ""
            if crash.requested_bytes is None or crash.free_bytes is None
            else f", tried to allocate {crash.requested_bytes / (1 << 20):,.2f} MiB with "
            f"{crash.free_bytes / (1 << 20):,.2f} MiB free"
        )
        logger.error(
            "Scheduler hit an exception: %s | engine crashed at engine time %.1f s%s; state at the crash: "
            "%s; %d requests failed; connections dropped%s; back in %.0f s of engine time "
            "(%.1f s wall at --speed %g)",
            crash.reason,
            crash.t,
            memory,
            state,
            len(crash.failed_rids),
            ", new ones refused" if self.down_mode == "refuse" else "",
            restart_s,
            restart_s / self.speed,
            self.speed,
            extra={
                "fields": {
                    "event": "crash",
                    "reason": crash.reason,
                    "engine_t": round(crash.t, 3),
                    "requested_bytes": crash.requested_bytes,
                    "free_bytes": crash.free_bytes,
                    "running": live.num_running_reqs if live else None,
                    "queued": live.num_queue_reqs if live else None,
                    "pending_prefill_tokens": live.pending_prefill_tokens if live else None,
                    "token_usage": live.token_usage if live else None,
                    "mamba_usage": live.mamba_usage if live else None,
                    "failed_requests": len(crash.failed_rids),
                    "restart_s": restart_s,
                }
            },
        )

    def _on_crash(self) -> None:
        """The process died: drop every connection; in "refuse" mode stop listening too."""
        server = self._server
        if server is None:
            return
        if self.down_mode == "refuse":
            for listener in server.servers:
                listener.close()
            server.servers = []
            self._listening = False
        for connection in list(server.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()

    async def _listen_again(self) -> None:
        """The engine is back: listen on the same port again (retried each tick if it fails)."""
        server = self._server
        if server is None:
            self._listening = True
            return
        config = server.config

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config,
                server_state=server.server_state,
                app_state=server.lifespan.state,
                _loop=_loop,
            )

        loop = asyncio.get_running_loop()
        try:
            listener = await loop.create_server(
                create_protocol, host=self._host, port=self._port, backlog=config.backlog
            )
        except OSError as exc:
            logger.warning("cannot listen on %s:%s again yet: %s", self._host, self._port, exc)
            return
        server.servers = [listener]
        self._listening = True

    def _write_gpu_file(self) -> None:
        if self.gpu_file is None:
            return
        reading: dict[str, int] = {
            "free_bytes": self.model.free_bytes(),
            "total_bytes": self.model.total_bytes,
        }
        if self.model.other_process_bytes is not None:
            reading["other_process_bytes"] = self.model.other_process_bytes
        payload = json.dumps(reading)
        tmp = self.gpu_file.with_name(f".{self.gpu_file.name}.{os.getpid()}.tmp")
        tmp.write_text(payload)
        os.replace(tmp, self.gpu_file)


# ---------------------------------------------------------------------------------------- HTTP
class _HttpMetrics:
    """Pure ASGI middleware for SGLang's http_requests_* series (no BaseHTTPMiddleware: it hides
    client disconnects from the handlers)."""

    def __init__(self, app: ASGIApp, emulator: Emulator) -> None:
        self.app = app
        self.emulator = emulator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        fe = self.emulator.frontend
        key = (scope["path"], scope["method"])
        fe.http_requests[key] += 1
        fe.http_active[key] += 1
        status: list[int] = []

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            current = self.emulator.frontend
            if current is fe:
                fe.http_active[key] -= 1
                if status:
                    fe.http_responses[(key[0], key[1], str(status[0]))] += 1


def _sse(payload: object) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


_DONE = b"data: [DONE]\n\n"


def _openai_error(message: str, status: int) -> JSONResponse:
    kind = "BadRequestError" if status == 400 else "ServiceUnavailableError"
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return JSONResponse(body, status_code=status)


def _generate_error(message: str, status: int) -> JSONResponse:
    if status == 400:
        return JSONResponse({"error": {"message": message}}, status_code=400)
    body = {"object": "error", "message": message, "type": str(status), "param": None, "code": status}
    return JSONResponse(body, status_code=status)


class _ConnectionDropped(Exception):
    """Raised inside a response when the engine died: the server drops the connection."""


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def build_emulator_app(
    model: EngineModel,
    speed: float = 1.0,
    gpu_file: Path | None = None,
    *,
    down_mode: str = "refuse",
    tick_s: float = 0.02,
    empty_cache_interval_s: float = 0.0,
    idle_poll_s: float | None = None,
) -> Starlette:
    """The emulator as an ASGI app; ``app.state.emulator`` is its :class:`Emulator`."""
    emu = Emulator(
        model,
        speed=speed,
        gpu_file=gpu_file,
        down_mode=down_mode,
        tick_s=tick_s,
        empty_cache_interval_s=empty_cache_interval_s,
        idle_poll_s=idle_poll_s,
    )
    profile = model.profile

    def unavailable() -> Response | None:
        if model.up:
            return None
        return JSONResponse({"error": {"message": "The engine is restarting."}}, status_code=503)

    async def read_json(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"invalid JSON body: {exc}") from exc

    async def run_generation(request: Request, kind: str) -> Response:
        error = _generate_error if kind == "generate" else _openai_error
        try:
            body = await read_json(request)
            req = parse_generation(body, kind)
            ids = body.get("input_ids") if kind == "generate" else None
            if req.prefix_key is None and isinstance(ids, list) and ids:
                key, hit = emu.prefix_for_ids(ids)
                req = replace(req, prefix_key=key, cached_tokens=hit)
            problem = model.validate(req.prompt_tokens, req.max_new_tokens)
            if problem is not None:
                raise BadRequest(problem)
            down = unavailable()
            if down is not None:
                return down
            queue = emu.subscribe(req.rid)
        except BadRequest as exc:
            return error(str(exc), 400)
        started = emu.now()
        emu.submit(req)
        if req.stream:
            body = _stream(emu, req, queue, kind, started)
            return StreamingResponse(
                body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        return await _collect(emu, request, req, queue, kind, started, error)

    async def generate(request: Request) -> Response:
        return await run_generation(request, "generate")

    async def completions(request: Request) -> Response:
        return await run_generation(request, "completions")

    async def chat(request: Request) -> Response:
        return await run_generation(request, "chat")

    async def metrics(request: Request) -> Response:
        body, content_type = render_metrics(model, emu.frontend, request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    async def loads(request: Request) -> Response:
        if request.query_params.get("format") == "prometheus":
            return PlainTextResponse(loads_prometheus(model, wall_time=emu.wall_time))
        return JSONResponse(loads_json(model, wall_time=emu.wall_time))

    async def info(request: Request) -> Response:
        return JSONResponse(server_info(model))

    async def flush_cache(request: Request) -> Response:
        # SGLang's http_server.flush_cache: 200 when flushed, 400 with the same text when busy.
        ok = model.flush_cache(emu.now())
        emu._write_gpu_file()
        text = (
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            "waiting requests, the operation will not be performed.)\n"
        )
        return PlainTextResponse(text, status_code=200 if ok else 400)

    async def health(request: Request) -> Response:
        return Response(status_code=200 if model.up else 503)

    async def models(request: Request) -> Response:
        card = {
            "id": profile.served_model_name,
            "object": "model",
            "created": int(model.started_at),
            "owned_by": "sglang",
            "root": profile.served_model_name,
            "max_model_len": profile.context_length,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def model_info(request: Request) -> Response:
        return JSONResponse(
            {
                "model_path": profile.served_model_name,
                "served_model_name": profile.served_model_name,
                "tokenizer_path": profile.served_model_name,
                "is_generation": True,
                "weight_version": "default",
            }
        )

    async def tokenize(request: Request) -> Response:
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            if body.get("messages") is not None:
                prompt: Any = _chat_text(body["messages"])
            else:
                prompt = body.get("prompt")
            if isinstance(prompt, str):
                tokens: Any = fake_token_ids(prompt)
                count: Any = len(tokens)
            elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
                tokens = [fake_token_ids(p) for p in prompt]
                count = [len(t) for t in tokens]
            else:
                raise BadRequest("prompt must be a string or a list of strings")
        except BadRequest as exc:
            return _openai_error(str(exc), 400)
        return JSONResponse({"tokens": tokens, "count": count, "max_model_len": profile.context_length})

    routes = [
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/loads", loads, methods=["GET"]),
        Route("/server_info", info, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["POST", "GET"]),
        Route("/get_server_info", info, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/ready", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/v1/tokenize", tokenize, methods=["POST"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await emu.start()
        try:
            yield
        finally:
            await emu.stop()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.emulator = emu
    app.add_middleware(_HttpMetrics, emulator=emu)
    return app


def _meta(
    req: GenerationRequest, completion: int, cached: int, finish: object, started: float, now: float
) -> dict:
    return {
        "id": req.rid,
        "finish_reason": finish,
        "prompt_tokens": req.prompt_tokens,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "e2e_latency": now - started,
    }


def _usage(req: GenerationRequest, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": req.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": req.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def _stream(
    emu: Emulator, req: GenerationRequest, queue: asyncio.Queue[Event], kind: str, started: float
) -> AsyncIterator[bytes]:
    """SSE body; ends with ``[DONE]`` unless the engine dies, in which case the connection drops."""
    created = int(time.time())
    cid = ("chatcmpl-" if kind == "chat" else "cmpl-") + req.rid
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    model_name = req.model or emu.model.profile.served_model_name
    completion = cached = 0
    text = ""
    ended = False

    def openai_chunk(delta: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if kind == "chat":
            message: dict[str, Any] = (
                {"role": "assistant", "content": delta or ""} if first else {"content": delta}
            )
            choice: dict[str, Any] = {"index": 0, "delta": message, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        return {"id": cid, "object": obj, "created": created, "model": model_name, "choices": [choice]}

    try:
        if kind == "chat":
            yield _sse(openai_chunk("", None, first=True))
        while True:
            event = await queue.get()
            if isinstance(event, (FirstToken, Tokens)):
                count = 1 if isinstance(event, FirstToken) else event.count
                if isinstance(event, FirstToken):
                    cached = event.cached_tokens
                    emu.frontend.observe_ttft(event.t - started, streaming=True)
                delta = fake_text(completion, count)
                completion += count
                if kind == "generate":
                    text += delta
                    yield _sse(
                        {"text": text, "meta_info": _meta(req, completion, cached, None, started, event.t)}
                    )
                else:
                    yield _sse(openai_chunk(delta, None))
            elif isinstance(event, Finished):
                ended = True
                emu.frontend.observe_finished(
                    req.prompt_tokens, event.completion_tokens, cached, streaming=True
                )
                finish = {"type": "length", "length": event.completion_tokens}
                if kind == "generate":
                    meta = _meta(req, event.completion_tokens, cached, finish, started, event.t)
                    yield _sse({"text": text, "meta_info": meta})
                else:
                    yield _sse(openai_chunk("", "length"))
                    if req.include_usage:
                        usage = {
                            **openai_chunk(None, None),
                            "choices": [],
                            "usage": _usage(req, completion, cached),
                        }
                        yield _sse(usage)
                yield _DONE
                return
            elif isinstance(event, Failed):
                ended = True
                if event.status is None:
                    if emu.drops_connections:
                        return  # the connection was aborted already; no [DONE]
                    raise _ConnectionDropped(event.reason)  # makes the server drop the connection
                if kind == "generate":
                    finish = {"type": "abort", "status_code": event.status, "message": event.reason}
                    yield _sse(
                        {"text": text, "meta_info": _meta(req, completion, cached, finish, started, event.t)}
                    )
                else:
                    error = {
                        "object": "error",
                        "message": event.reason,
                        "type": "SERVICE_UNAVAILABLE",
                        "param": None,
                        "code": event.status,
                    }
                    yield _sse({"error": error})
                yield _DONE
                return
    finally:
        emu.unsubscribe(req.rid)
        if not ended:
            emu.abort(req.rid)  # the client went away (or the response was cancelled)


async def _collect(
    emu: Emulator,
    request: Request,
    req: GenerationRequest,
    queue: asyncio.Queue[Event],
    kind: str,
    started: float,
    error: Callable[[str, int], JSONResponse],
) -> Response:
    """Non-streaming: wait for the outcome while watching for the client leaving (then abort)."""
    cached = 0

    async def outcome() -> Finished | Failed:
        nonlocal cached
        while True:
            event = await queue.get()
            if isinstance(event, FirstToken):
                cached = event.cached_tokens
                emu.frontend.observe_ttft(event.t - started, streaming=False)
            if isinstance(event, (Finished, Failed)):
                return event

    waiter = asyncio.ensure_future(outcome())
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (waiter, watcher):
            task.cancel()
        emu.unsubscribe(req.rid)
    if not waiter.done() or waiter.cancelled():
        emu.abort(req.rid)
        return Response(status_code=499)  # nobody is listening any more
    result = waiter.result()
    if isinstance(result, Failed):
        # status None: the engine died. Under EmulatorServer the connection is already gone; under
        # another server this 503 is the closest a still-listening process can answer.
        return error(result.reason, result.status or 503)
    emu.frontend.observe_finished(req.prompt_tokens, result.completion_tokens, cached, streaming=False)
    text = fake_text(0, result.completion_tokens)
    if kind == "generate":
        finish = {"type": "length", "length": result.completion_tokens}
        meta = _meta(req, result.completion_tokens, cached, finish, started, result.t)
        return JSONResponse({"text": text, "output_ids": fake_token_ids(text), "meta_info": meta})
    created = int(time.time())
    model_name = req.model or emu.model.profile.served_model_name
    if kind == "chat":
        message = {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None}
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}
        obj, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        obj, prefix = "text_completion", "cmpl-"
    usage = _usage(req, result.completion_tokens, cached)
    return JSONResponse(
        {
            "id": prefix + req.rid,
            "object": obj,
            "created": created,
            "model": model_name,
            "choices": [choice],
            "usage": usage,
        }
    )


# ---------------------------------------------------------------------------------------- running it
class EmulatorServer:
    """Runs an emulator app under uvicorn in this event loop (tests, ``demo``).

    ``async with EmulatorServer(app) as srv: srv.url`` - the port is picked by the OS unless given.
    """

    def __init__(
        self, app: Starlette, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning"
    ) -> None:
        self.app = app
        self.emulator: Emulator = app.state.emulator
        self.host = host
        self.port = port
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            lifespan="on",
            timeout_graceful_shutdown=1,
            access_log=False,
            log_config=None,  # lines go through the process's logging (sidecar.ops.logs), not uvicorn's own
        )
        self.server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self._task = asyncio.create_task(self.server.serve(), name="emulator-uvicorn")
        while not self.server.started:
            if self._task.done():
                self._task.result()  # re-raise the start-up failure
                raise RuntimeError("uvicorn exited during start-up")
            await asyncio.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.emulator.attach(self.server, self.host, self.port)

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=5)
        except TimeoutError:
            self.server.force_exit = True
            await self._task
        self._task = None

    async def __aenter__(self) -> EmulatorServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def run_emulator(
    profile: LaneProfile,
    *,
    host: str = "127.0.0.1",
    port: int = 30000,
    speed: float = 1.0,
    seed: int = 0,
    gpu_file: Path | None = None,
    cuda: bool = False,
    down_mode: str = "refuse",
    log_level: str = "info",
    empty_cache_interval_s: float = 0.0,
) -> None:
    """Serve until cancelled (``sglang-sidecar emulate``)."""
    model = build_model(profile, seed, cuda=cuda)
    app = build_emulator_app(
        model, speed, gpu_file, down_mode=down_mode, empty_cache_interval_s=empty_cache_interval_s
    )
    server = EmulatorServer(app, host, port, log_level=log_level)
    await server.start()
    try:
        assert server._task is not None
        await server._task
    finally:
        await server.stop()


def main(args: argparse.Namespace) -> int:
    """``sglang-sidecar emulate``: options ``profile``, ``listen``, ``speed``, ``gpu_file``, ``seed``,
    ``cuda``, ``restart_s``, ``list_profiles`` (see ``sidecar/cli.py``). Returns the exit status."""
    if getattr(args, "list_profiles", False):
        for name in profile_names():
            print(f"{name:14} {get_profile(name).description}")
        return 0
    try:
        profile = get_profile(getattr(args, "profile", "maxq-old"))
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 2
    if getattr(args, "restart_s", None) is not None:
        profile = profile.replace(restart_s=float(args.restart_s))
    host, _, port = str(getattr(args, "listen", "127.0.0.1:30000")).rpartition(":")
    if not host or not port.isdigit():
        print(f"error: --listen wants HOST:PORT, got {args.listen!r}", file=sys.stderr)
        return 2
    gpu_file = getattr(args, "gpu_file", None)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(
            run_emulator(
                profile,
                host=host,
                port=int(port),
                speed=float(getattr(args, "speed", 1.0)),
                seed=int(getattr(args, "seed", 0)),
                gpu_file=Path(gpu_file) if gpu_file else None,
                cuda=bool(getattr(args, "cuda", False)),
                empty_cache_interval_s=_empty_cache_interval(args),
            )
        )
    return 0


def _empty_cache_interval(args: argparse.Namespace) -> float:
    """``--empty-cache-interval``, else ``SGLANG_EMPTY_CACHE_INTERVAL`` as SGLang reads it (0: off)."""
    value = getattr(args, "empty_cache_interval", None)
    if value is None:
        value = os.environ.get("SGLANG_EMPTY_CACHE_INTERVAL") or 0
    return float(value)


__all__ = [
    "SGLANG_VERSION",
    "BadRequest",
    "Emulator",
    "EmulatorServer",
    "GenerationRequest",
    "build_emulator_app",
    "build_model",
    "main",
    "parse_generation",
    "run_emulator",
]
