"""The least a pure-Python ASGI + aiohttp proxy can do per request, for the overhead benchmark only.

Read the body, send it upstream on a pooled aiohttp connection, relay the status, headers and body
chunks: no gate, no parsing, no header filtering, no disconnect watch, no access log, no metrics.
Served by the same uvicorn (httptools, uvloop) as the sidecar. What the sidecar costs beyond this
is its own work; what this costs beyond nginx is the floor of the stack, not of the sidecar.

    python bench/floor_proxy.py --upstream http://127.0.0.1:PORT --port PORT
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    uvicorn.run(
        FloorProxy(args.upstream), host="127.0.0.1", port=args.port, log_level="warning", access_log=False
    )


if __name__ == "__main__":
    main()
