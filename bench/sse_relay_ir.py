"""The SSE relay's cost per event and per stream, deterministically: one process, one event loop.

The overhead benchmark's SSE slope (CPU per relayed event, 100- vs 400-event streams, issue #27) is
measured on separate processes, where how many events a proxy reads per chunk depends on its own
speed. Here the proxy under test, an upstream and a client share one uvloop loop in one process, so
the interleaving is fixed and ``valgrind --tool=cachegrind`` counts the same instructions run after
run (``bench/sse_relay_ir.sh``: instructions of R+K streams minus R, per stream, for two stream
lengths; the slope is the relay's per event, the intercept the stream's own).

* the proxy: ``sidecar`` (``SidecarApp`` served as ``serve`` serves it: uvicorn with the guarded
  httptools protocol and its disconnect watch, ``uvicorn_options``, the overhead benchmark's policy,
  a gated streaming ``POST /generate``) or ``floor`` (``bench/floor_proxy.py``'s ``LeanFloor`` under
  the plain uvicorn + httptools it runs under: the same lean upstream client, relaying with
  ``iter_any``); ``direct``: no proxy, the client reads the upstream itself (the harness's own cost,
  to subtract);
* the upstream: ``/generate?events=N`` framed as ``bench/upstream.py`` under uvicorn frames it (a
  chunked SSE stream, one HTTP chunk per event, ``data: [DONE]`` and the last chunk in one write),
  ``--per-turn K`` events written per loop turn (1: each event alone, so the proxy relays one message
  per event; 0: the whole stream in one turn, as a fast upstream ahead of a slow proxy);
* the client: one keep-alive connection, streams back to back, every byte read.

``--count`` prints, per stream, the proxy's reads from the upstream (``data_received``) and the body
messages it sent its client (wrapping uvicorn's ``send``, and the server's ``BodyWriter`` where the relay
writes around it; not for an instruction count).

    PYTHONPATH=$PWD python bench/sse_relay_ir.py sidecar 100 50 [--per-turn 1] [--count]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after PYTHONPATH: the tree it names is the one measured
sys.path.insert(0, str(ROOT / "bench"))

from bench.upstream import EVENT, METRICS, SERVER_INFO  # noqa: E402

DONE = b"data: [DONE]\n\n"
# The overhead benchmark's policy with the pollers slowed: no poll lands inside a measured run.
POLICY = """
name: sse-relay-ir
lane: {context_len: 1048576, chunked_prefill_size: 8192}
cost: {activation_bytes_per_chunk_token: 1KiB, context_bytes_per_token: 1}
engine_queue: {max_requests: 1000000}
pending_prefill: {max_tokens: 1000000000}
engine: {poll_interval_s: 3000, max_age_s: 30000, on_stale: admit}
gpu: {poll_interval_s: 3000, max_age_s: 30000, on_stale: admit, required: false}
hold: {max_held: 1000, max_wait_s: 60}
"""


def _answer(body: bytes, ctype: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ndate: Sun, 06 Dec 2026 20:00:00 GMT\r\nserver: uvicorn\r\ncontent-type: "
        + ctype
        + b"\r\ncontent-length: %d\r\n\r\n" % len(body)
        + body
    )


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ndate: Sun, 06 Dec 2026 20:00:00 GMT\r\nserver: uvicorn\r\n"
    b"content-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
CHUNK = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
LAST = b"%x\r\n%s\r\n0\r\n\r\n" % (len(DONE), DONE)
ANSWERS = {
    b"/metrics": _answer(METRICS, b"text/plain; version=0.0.4"),
    b"/server_info": _answer(SERVER_INFO, b"application/json"),
    b"/get_server_info": _answer(SERVER_INFO, b"application/json"),
}


class Upstream(asyncio.Protocol):
    """SGLang-shaped enough: the stream of ``?events=N``; the pollers' pages; 404 for the rest."""

    per_turn = 1

    def connection_made(self, transport: Any) -> None:
        self.t = transport
        self.buf = b""
        self.loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (i := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:i].decode("latin-1")
            n = 0
            for line in head.split("\r\n")[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    n = int(v)
            if len(self.buf) < i + 4 + n:
                return
            self.buf = self.buf[i + 4 + n :]
            target = head.split(" ")[1]
            path, _, query = target.partition("?")
            if path == "/generate" and query.startswith("events="):
                self.t.write(STREAM_HEAD)
                self._events(int(query.split("=")[1].split("&")[0]))
            else:
                self.t.write(
                    ANSWERS.get(path.encode(), _answer(b'{"detail":"Not Found"}', b"application/json"))
                )

    def _events(self, left: int) -> None:
        if self.t.is_closing():
            return
        k = left if self.per_turn == 0 else min(self.per_turn, left)
        for _ in range(k):
            self.t.write(CHUNK)
        left -= k
        if left:
            self.loop.call_soon(self._events, left)
        else:
            self.t.write(LAST)


class Client(asyncio.Protocol):
    """Streams back to back on one keep-alive connection; each ends at the last chunk."""

    def __init__(self, request: bytes, count: int, done: asyncio.Future[None]) -> None:
        self.request, self.left, self.done = request, count, done
        self.tail = b""
        self.received = 0

    def connection_made(self, transport: Any) -> None:
        self.t = transport
        self.t.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        self.tail = (self.tail + data[-5:])[-5:]
        if self.tail == b"0\r\n\r\n":
            self.tail = b""
            self.left -= 1
            if self.left:
                self.t.write(self.request)
            elif not self.done.done():
                self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(
                RuntimeError(f"the proxy closed the connection ({exc}), {self.left} left")
            )


def request_bytes(events: int) -> bytes:
    body = json.dumps({"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": events}}).encode()
    return (
        b"POST /generate?events=%d HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (events, len(body), body)
    )


def build(kind: str, upstream: str) -> tuple[Any, dict[str, Any]]:
    """The app under test and the uvicorn.Config arguments it is served with."""
    if kind == "floor":
        from floor_proxy import LeanFloor

        # As floor_proxy.serve runs it: uvicorn.run's defaults (proxy headers on) with httptools.
        return LeanFloor(upstream), {"http": "httptools", "log_level": "warning", "access_log": False}
    from sidecar.app import SidecarApp
    from sidecar.http.server import ServingLimits, uvicorn_options
    from sidecar.ops.decision_file import DecisionFile
    from sidecar.policy.schema import load_policy_text
    from sidecar.signals.gpu import parse_gpu_source

    gpu = Path(tempfile.mkdtemp()) / "gpu.json"
    gpu.write_text(json.dumps({"free_bytes": 100 << 30, "total_bytes": 141 << 30}))
    app = SidecarApp(
        upstream=upstream,
        policy=load_policy_text(POLICY, "policy.yaml"),
        gpu_source=parse_gpu_source(f"file:{gpu}"),
        decision_log=DecisionFile(os.devnull, 0, 0),
    )
    options = {"interface": "asgi3", "log_level": "warning", "log_config": None, "access_log": False}
    return app, {**options, **uvicorn_options(ServingLimits())}


async def _quiet_decision_log(app: Any) -> None:
    """The decision log's lines go to a list, not a writer thread (whose turns would vary)."""
    tel = getattr(app, "telemetry", None)
    if tel is None or tel._writer is None:
        return

    class Sink:
        stream = None
        dropped = 0

        def put(self, line: Any) -> None:
            pass

        def close(self, *a: Any) -> None:
            pass

    tel._writer.close()
    tel._writer = Sink()


def _counting() -> dict[str, int]:
    """Wrap uvicorn's send and the lean client's reads with counters (changes their cost)."""
    from uvicorn.protocols.http import httptools_impl

    from sidecar.http import engine_client

    counts = {"reads": 0, "messages": 0, "bytes": 0}
    send = httptools_impl.RequestResponseCycle.send

    async def counted_send(self: Any, message: Any) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            counts["messages"] += 1
            counts["bytes"] += len(message["body"])
        await send(self, message)

    httptools_impl.RequestResponseCycle.send = counted_send  # type: ignore[method-assign]
    received = engine_client._Conn.data_received

    def counted_received(self: Any, data: bytes) -> None:
        counts["reads"] += 1
        received(self, data)

    engine_client._Conn.data_received = counted_received  # type: ignore[method-assign]
    from sidecar.http import server

    writer = getattr(server, "BodyWriter", None)  # the pieces a relay writes around send (issue #27)
    if writer is not None:
        write = writer.__call__

        def counted_write(self: Any, data: bytes) -> bool:
            taken = write(self, data)
            if taken:
                counts["messages"] += 1
                counts["bytes"] += len(data)
            return taken

        writer.__call__ = counted_write  # type: ignore[method-assign]
    return counts


async def _streams(
    loop: Any, port: int, request: bytes, warm: int, streams: int, counts: dict[str, int] | None
) -> None:
    """``warm`` streams on one connection, then ``streams`` on another (the counters reset between)."""
    for n in (warm, streams):
        if not n:
            continue
        if counts is not None:
            counts.update(dict.fromkeys(counts, 0))
        done = loop.create_future()
        t, _ = await loop.create_connection(lambda n=n, d=done: Client(request, n, d), "127.0.0.1", port)
        await done
        t.close()


async def main(kind: str, events: int, streams: int, per_turn: int, warm: int, count: bool) -> None:
    import uvicorn

    counts = _counting() if count else None
    loop = asyncio.get_running_loop()
    Upstream.per_turn = per_turn
    up = await loop.create_server(Upstream, "127.0.0.1", 0)
    up_port = up.sockets[0].getsockname()[1]
    if kind == "direct":
        await _streams(loop, up_port, request_bytes(events), warm, streams, counts)
        up.close()
        return
    app, options = build(kind, f"http://127.0.0.1:{up_port}")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on", **options))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    stop = asyncio.Event()

    async def main_loop() -> None:
        # uvicorn's own ticks (0.1 s: the date header, the exit check) run by the wall clock, which
        # valgrind stretches by a varying factor: one tick (the headers), then none until the end.
        await server.on_tick(0)
        await stop.wait()

    server.main_loop = main_loop  # type: ignore[method-assign]
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    if kind == "sidecar":
        deadline = loop.time() + 120
        while app.admission.snapshot.engine is None or app.admission.snapshot.gpu is None:
            if loop.time() > deadline:  # a first poll that timed out is retried only at the interval
                raise SystemExit("no signals: the pollers' first reads failed (a loaded machine?); run again")
            await asyncio.sleep(0.01)
        await _quiet_decision_log(app)
    port = server.servers[0].sockets[0].getsockname()[1]
    await _streams(loop, port, request_bytes(events), warm, streams, counts)
    if counts is not None:
        import sidecar

        per = {k: v / streams for k, v in counts.items()}
        print(
            f"{kind} ({Path(sidecar.__file__).parents[1]}) events={events} per_turn={per_turn}: per stream "
            f"{per['reads']:.1f} reads from the upstream, {per['messages']:.1f} body messages to the client "
            f"({per['bytes']:.0f} bytes); events per message {(events + 1) / max(per['messages'], 1e-9):.2f}"
        )
    server.should_exit = True
    stop.set()
    await serving
    up.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=("sidecar", "floor", "direct"))
    ap.add_argument("events", type=int)
    ap.add_argument("streams", type=int)
    ap.add_argument(
        "--per-turn", type=int, default=1, help="events the upstream writes per loop turn (0: all)"
    )
    ap.add_argument("--warm", type=int, default=20, help="streams before the measured ones")
    ap.add_argument("--count", action="store_true", help="print reads and messages per stream")
    a = ap.parse_args()
    import uvloop

    uvloop.run(main(a.kind, a.events, a.streams, a.per_turn, a.warm, a.count))
