"""A real headless Chromium (Debian's package, ``scripts/tools.sh``), driven over the DevTools protocol.

Started before the moment a test wants to look, so that looking takes a navigation (~0.1 s) rather than
a browser start (seconds on a busy machine): the page is loaded, its DOM read and a screenshot taken
while what the test waits for is still on screen.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx
import websockets

from tests.tools import tool


class Browser:
    def __init__(self, profile: Path, width: int = 1400, height: int = 760) -> None:
        self.profile, self.size = profile, (width, height)
        self._ids = itertools.count(1)

    async def __aenter__(self) -> Browser:
        self.proc = subprocess.Popen(
            [
                tool("chromium"),
                "--headless",
                "--no-sandbox",  # root in CI
                "--disable-gpu",
                "--hide-scrollbars",
                "--no-first-run",
                "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        port = await asyncio.to_thread(self._devtools_port)
        async with httpx.AsyncClient() as client:
            targets = (await client.get(f"http://127.0.0.1:{port}/json/list")).json()
        page = next(t for t in targets if t["type"] == "page")
        self.ws = await websockets.connect(page["webSocketDebuggerUrl"], max_size=64 << 20)
        await self.call("Page.enable")
        width, height = self.size
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        return self

    def _devtools_port(self) -> int:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if m:
                return int(m.group(1))
        raise RuntimeError(f"chromium exited ({self.proc.wait()}) without a DevTools port")

    async def __aexit__(self, *exc: object) -> None:
        await self.ws.close()
        self.proc.terminate()
        await asyncio.to_thread(self.proc.wait, 30)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One command; events that arrive meanwhile are kept for :meth:`event`."""
        n = next(self._ids)
        await self.ws.send(json.dumps({"id": n, "method": method, "params": params}))
        while True:
            msg = json.loads(await self.ws.recv())
            if msg.get("id") == n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def open(self, url: str) -> tuple[str, bytes]:
        """Load ``url``; its DOM as the browser built it, and a PNG of the viewport."""
        n = next(self._ids)
        await self.ws.send(json.dumps({"id": n, "method": "Page.navigate", "params": {"url": url}}))
        loaded = answered = False
        while not (loaded and answered):
            msg = json.loads(await self.ws.recv())
            answered = answered or msg.get("id") == n
            loaded = loaded or msg.get("method") == "Page.loadEventFired"
        dom = await self.call("Runtime.evaluate", expression="document.documentElement.outerHTML")
        shot = await self.call("Page.captureScreenshot", format="png")
        return dom["result"]["value"], base64.b64decode(shot["data"])
