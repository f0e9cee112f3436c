"""Real servers on 127.0.0.1 for proxy and end-to-end tests (ASGI transports buffer streams and hide
disconnects, so they cannot show what these tests are about)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from sidecar.app import SidecarApp
from sidecar.http.server import ServingLimits, serve_app, serve_sidecar
from sidecar.signals.gpu import parse_gpu_source
from tests.conftest import MIB, small_policy

Scope = dict[str, Any]


def serve(app: Any, *, lifespan: str = "on", limits: ServingLimits | None = None) -> Any:
    """Run ``app`` under uvicorn on a free loopback port in this event loop; yield its base URL."""
    return serve_app(app, lifespan=lifespan, limits=limits)


class SidecarUrl(str):
    """The data port's base URL, with the admin port's as ``.admin`` (``url.admin + "/metrics"``)."""

    admin: str

    def __new__(cls, url: str, admin: str) -> SidecarUrl:
        self = super().__new__(cls, url)
        self.admin = admin
        return self


@asynccontextmanager
async def serve_both(app: SidecarApp, *, limits: ServingLimits | None = None) -> AsyncIterator[SidecarUrl]:
    """Both of a sidecar's listeners on free loopback ports, as ``serve`` runs them."""
    async with serve_sidecar(app, limits=limits) as (url, admin):
        yield SidecarUrl(url, admin)


async def eventually(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool], timeout: float = 10.0
) -> None:
    """Wait until ``check`` holds. The timeout only turns a hang into a failure; nothing is timed."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        r = check()
        if asyncio.iscoroutine(r):
            r = await r
        if r:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition never became true")
        await asyncio.sleep(0.02)


def serve_argv(engine_url: str, policy: Path, port: int, admin_port: int, *args: str) -> list[str]:
    """The command line of a real ``sglang-sidecar serve`` process on the given loopback ports."""
    return [
        sys.executable,
        "-m",
        "sidecar",
        "serve",
        "--upstream",
        engine_url,
        "--listen",
        f"127.0.0.1:{port}",
        "--admin-listen",
        f"127.0.0.1:{admin_port}",
        "--policy",
        str(policy),
        *args,
    ]


async def wait_serving(proc: subprocess.Popen[str], url: str, timeout: float = 30) -> None:
    """Wait until a sidecar process answers ``url``, failing at once (with its stderr) if it exits."""
    async with httpx.AsyncClient(timeout=5) as client:

        async def up() -> bool:
            if proc.poll() is not None:
                err = proc.stderr.read() if proc.stderr else ""
                raise AssertionError(f"sidecar exited during start-up: {err}")
            try:
                return (await client.get(url)).status_code == 200
            except httpx.TransportError:
                return False

        await eventually(up, timeout=timeout)


async def send_sse_start(send: Any) -> None:
    """An engine stream's beginning, for engines that then fail: SSE headers and one event."""
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    )
    await send({"type": "http.response.body", "body": b'data: {"i": 0}\n\n', "more_body": True})


def write_gpu_file(path: Path, free_bytes: int, total_bytes: int = 80 * 1024**3) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"free_bytes": free_bytes, "total_bytes": total_bytes}))
    tmp.replace(path)


async def answer_lifespan(receive: Any, send: Any) -> None:
    """The ASGI lifespan of a fake server: start, then wait for shutdown."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def read_body(receive: Any) -> bytes:
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            return body


FAST = dict(engine__poll_interval_s=0.05, engine__max_age_s=5, gpu__poll_interval_s=0.02, gpu__max_age_s=5)


@asynccontextmanager
async def lane(
    tmp_path: Path,
    engine: Any,
    free_mib: int = 1024,
    upstream: str | None = None,
    app_kwargs: dict[str, Any] | None = None,
    limits: ServingLimits | None = None,
    **overrides: object,
) -> AsyncIterator[tuple[SidecarUrl, SidecarApp, Path]]:
    """A fake engine and a real sidecar in front of it (GPU from a file), both on loopback. The URL is
    the data port's; ``url.admin`` is the admin port's (state, explain, policy, signals, /metrics)."""
    gpu_file = tmp_path / "gpu.json"
    write_gpu_file(gpu_file, free_mib * MIB)
    policy = small_policy(**(FAST | overrides))
    async with serve(engine) as engine_url:
        app = SidecarApp(
            upstream=upstream or engine_url,
            policy=policy,
            gpu_source=parse_gpu_source(f"file:{gpu_file}"),
            # Tests size their requests with the emulator declaration (`gen`); a test of the default
            # passes trust_emulator_sizes=False.
            **({"trust_emulator_sizes": True} | (app_kwargs or {})),
        )
        # The sidecar is served with the data port's connection limits, as `serve` runs it.
        async with serve_both(app, limits=limits or ServingLimits()) as url:
            if upstream is None:
                await eventually(lambda: app.admission.snapshot.engine is not None)
            yield url, app, gpu_file


def gen(stream: bool = True, tokens: int = 1000, rid: str = "r") -> dict[str, Any]:
    """A /generate body whose size is declared (the emulator extension), so tests need no tokenizer."""
    return {"text": "x", "stream": stream, "rid": rid, "emulator": {"prompt_tokens": tokens}}


METRICS_TEMPLATE = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"}} {running}
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"}} {queue}
# HELP sglang:full_token_usage The token usage for full attention layers.
# TYPE sglang:full_token_usage gauge
sglang:full_token_usage{{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"}} 0.0
# HELP sglang:kv_available_tokens Number of free token slots in the KV cache pool.
# TYPE sglang:kv_available_tokens gauge
sglang:kv_available_tokens{{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"}} 100000.0
# HELP sglang:kv_used_tokens Number of used token slots.
# TYPE sglang:kv_used_tokens gauge
sglang:kv_used_tokens{{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"}} 0.0
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"}} 100000.0
"""


class FakeEngine:
    """A minimal SGLang-shaped upstream whose timing the test controls with asyncio events.

    ``/generate`` streams ``events`` SSE events; before each event after the first it waits for
    ``release`` (so a test can prove the first event arrived before the second was sent). Requests
    whose client vanished are recorded in ``aborted``. ``gate_headers`` makes it hold the response
    headers until set (a long prefill).
    """

    def __init__(self, events: int = 3) -> None:
        self.events = events
        self.release = asyncio.Event()
        self.gate_headers = asyncio.Event()
        self.gate_headers.set()
        self.arrived: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.running = 0
        self.queue = 0

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        path = scope["path"]
        if path == "/metrics":
            body = METRICS_TEMPLATE.format(running=float(self.running), queue=float(self.queue)).encode()
            await _respond(send, 200, body, b"text/plain; version=0.0.4; charset=utf-8")
        elif path in ("/generate", "/v1/chat/completions", "/v1/completions"):
            await self._generate(scope, receive, send)
        elif path == "/v1/models":
            await _respond(
                send,
                200,
                b'{"object":"list","data":[{"id":"m"}]}',
                b"application/json",
                extra=[
                    (b"set-cookie", b"session=secret"),
                    (b"connection", b"keep-alive, x-hop"),
                    (b"x-hop", b"1"),
                ],
            )
        elif path == "/echo":
            body = await read_body(receive)
            info = {
                "headers": [[k.decode(), v.decode()] for k, v in scope["headers"]],
                "query": scope["query_string"].decode(),
                "method": scope["method"],
                "body": body.decode(),
            }
            await _respond(send, 200, json.dumps(info).encode(), b"application/json")
        else:
            await _respond(send, 404, b'{"detail":"Not Found"}', b"application/json")

    async def _generate(self, scope: Scope, receive: Any, send: Any) -> None:
        req = json.loads(await read_body(receive))
        rid = str(req.get("rid", len(self.arrived)))
        self.arrived.append(req)
        disconnected = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()

        watcher = asyncio.create_task(watch())
        try:
            gate = asyncio.create_task(self.gate_headers.wait())
            gone = asyncio.create_task(disconnected.wait())
            await asyncio.wait({gate, gone}, return_when=asyncio.FIRST_COMPLETED)
            gate.cancel()
            gone.cancel()
            if disconnected.is_set():
                self.aborted.append(rid)
                return
            if not req.get("stream"):
                await _respond(
                    send,
                    200,
                    json.dumps({"text": "ok", "meta_info": {"id": rid}}).encode(),
                    b"application/json",
                )
                self.finished.append(rid)
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            for i in range(self.events):
                if i > 0:
                    rel = asyncio.create_task(self.release.wait())
                    gone = asyncio.create_task(disconnected.wait())
                    await asyncio.wait({rel, gone}, return_when=asyncio.FIRST_COMPLETED)
                    rel.cancel()
                    gone.cancel()
                    if disconnected.is_set():
                        self.aborted.append(rid)
                        return
                await send(
                    {
                        "type": "http.response.body",
                        "body": f'data: {{"i": {i}}}\n\n'.encode(),
                        "more_body": True,
                    }
                )
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            self.finished.append(rid)
        finally:
            watcher.cancel()


async def _respond(send: Any, status: int, body: bytes, ctype: bytes, extra: list | None = None) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", ctype),
                (b"content-length", str(len(body)).encode()),
                *(extra or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
