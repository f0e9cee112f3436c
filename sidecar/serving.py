"""Run an ASGI app under uvicorn on a loopback port inside the current event loop.

Used where several servers share one process: the demo (emulator + sidecar) and the tests (real
sockets, because ASGI test transports buffer streams and hide disconnects).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn


@asynccontextmanager
async def serve_app(
    app: Any, host: str = "127.0.0.1", port: int = 0, *, lifespan: str = "on"
) -> AsyncIterator[str]:
    """Serve ``app``; yield its base URL. Port 0 lets the OS pick a free one. Start-up errors raise."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan=lifespan,
        log_level="warning",
        access_log=False,
        log_config=None,  # lines go through the process's logging, not uvicorn's own handlers
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("uvicorn exited during start-up (see the log above)")
        await asyncio.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), 10)
        except TimeoutError:
            server.force_exit = True
            await task
