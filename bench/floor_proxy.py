"""The least a pure-Python ASGI proxy can do per request, for the overhead benchmark only.

Read the body, send it upstream on a pooled connection, relay the status, headers and body chunks: no
gate, no parsing, no header filtering, no disconnect watch, no access log, no metrics. By default served
by the same uvicorn (httptools, uvloop) as the sidecar, with aiohttp's client. What the sidecar costs
beyond this is its own work; what this costs beyond nginx is the floor of the stack, not of the sidecar.

``--server`` and ``--client`` swap the two sides, so the ASGI servers that exist can be measured as
floors with the same benchmark (issue #27): ``uvicorn`` (httptools + uvloop), ``granian`` (Rust HTTP,
its ASGI interface, uvloop), ``hypercorn`` (h11, uvloop); ``--client lean`` relays through the
sidecar's own upstream client (``sidecar/http/engine_client.py``), the one its data path uses, so
``--client lean`` under a server is that server's floor for the sidecar.

``--lag-probe`` (uvicorn only) adds ``bench/lag_probe.py``'s event-loop lag probe at ``GET /__bench/lag``,
ticking only between ``?probe=on`` and ``?probe=off``, and freezes start-up's objects as ``serve`` does
(``gc.freeze``): the floor's loop stall under the same load as the sidecar's, measured the same way.

    python bench/floor_proxy.py --upstream http://127.0.0.1:PORT --port PORT [--server S] [--client C]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import aiohttp
import uvicorn
from yarl import URL


class FloorProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.session: Any = None

    def make_session(self) -> Any:
        """The upstream client, made inside the running loop (``bench/floor_variants.py`` swaps it)."""
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024), auto_decompress=False)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    self.session = self.make_session()
                    await send({"type": "lifespan.startup.complete"})
                else:
                    assert self.session is not None
                    await self.session.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        assert self.session is not None
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        url = self.upstream + scope["raw_path"].decode("latin-1")
        if scope["query_string"]:
            url += "?" + scope["query_string"].decode("latin-1")
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope["headers"]
            if k not in (b"host", b"content-length")
        ]
        async with self.session.request(
            scope["method"], URL(url, encoded=True), data=body or None, headers=headers
        ) as resp:
            out = [
                (k.lower(), v)
                for k, v in resp.raw_headers
                if k.lower() not in (b"transfer-encoding", b"connection")
            ]
            await send({"type": "http.response.start", "status": resp.status, "headers": out})
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})


class LeanFloor(FloorProxy):
    """The floor with the sidecar's own upstream client in place of aiohttp's."""

    def make_session(self) -> Any:
        from sidecar.http.engine_client import UpstreamClient

        return UpstreamClient(
            self.upstream, max_connections=1024, connect_timeout_s=5.0, read_timeout_s=1800.0
        )


SERVERS = ("uvicorn", "granian", "hypercorn")
CLIENTS = ("aiohttp", "lean")


def app_from_env() -> FloorProxy:
    """The app granian imports by name (``floor_proxy:app_from_env``, a factory) in its worker."""
    cls = LeanFloor if os.environ["FLOOR_CLIENT"] == "lean" else FloorProxy
    return cls(os.environ["FLOOR_UPSTREAM"])


def with_lag_probe(app: Any) -> Any:
    """``app`` behind the benchmarks' lag probe (off until ``?probe=on``), start-up frozen once the
    lifespan has started, as ``sglang-sidecar serve`` freezes its own (``cli._freeze_startup_objects``)."""
    import gc

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from lag_probe import LagProbe, probed

    probe = LagProbe()

    async def frozen_after_start(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)

        async def send_then_freeze(msg: dict[str, Any]) -> None:
            await send(msg)
            if msg["type"] == "lifespan.startup.complete":
                gc.collect()
                gc.freeze()
                probe.frozen = gc.get_freeze_count()

        return await app(scope, receive, send_then_freeze)

    return probed(frozen_after_start, probe, run_at_start=False)


def serve(server: str, client: str, upstream: str, port: int, lag_probe: bool = False) -> None:
    app = (LeanFloor if client == "lean" else FloorProxy)(upstream)
    if lag_probe:
        if server != "uvicorn":
            raise SystemExit("--lag-probe: uvicorn only")
        app = with_lag_probe(app)
    if server == "uvicorn":
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                    loop="uvloop", http="httptools")  # fmt: skip
    elif server == "granian":
        from granian import Granian

        os.environ.update(FLOOR_UPSTREAM=upstream, FLOOR_CLIENT=client)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        # One worker process, one runtime thread, uvloop: the same single core of Python as the others.
        Granian("floor_proxy:app_from_env", address="127.0.0.1", port=port, interface="asgi", workers=1,
                runtime_threads=1, loop="uvloop", factory=True, log_access=False,
                log_level="warning", backlog=4096).serve()  # fmt: skip
    elif server == "hypercorn":
        import asyncio

        import uvloop
        from hypercorn.asyncio import serve as hypercorn_serve
        from hypercorn.config import Config

        config = Config()
        config.bind = [f"127.0.0.1:{port}"]
        config.accesslog = None
        config.loglevel = "WARNING"
        config.backlog = 4096
        uvloop.run(hypercorn_serve(app, config, shutdown_trigger=asyncio.Future))
    else:
        raise SystemExit(f"unknown server {server}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--server", choices=SERVERS, default="uvicorn")
    ap.add_argument("--client", choices=CLIENTS, default="aiohttp")
    ap.add_argument("--lag-probe", action="store_true", help="GET /__bench/lag: the loop's stalls (uvicorn)")
    args = ap.parse_args()
    serve(args.server, args.client, args.upstream, args.port, args.lag_probe)


if __name__ == "__main__":
    main()
