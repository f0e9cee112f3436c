"""The emulator logs its own crash the way an on-call engineer needs it: the CUDA-style message, the
state at the crash, when it will be back; and its restart."""

from __future__ import annotations

import logging
import re

import httpx
import pytest

from sidecar_emulator.profiles import get_profile
from tests.harness import eventually
from tests.test_sim_server import start


async def test_the_emulator_logs_its_crash_and_its_restart(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sidecar_emulator")
    server = await start(get_profile("maxq-old").replace(restart_s=60.0), speed=100.0)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            request = {"text": "x", "emulator": {"prompt_tokens": 500_000}, "stream": True}
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                async with client.stream("POST", "/generate", json=request) as s:
                    async for _ in s.aiter_lines():
                        pass

            def restarted() -> bool:
                return any("engine restarted" in r.getMessage() for r in caplog.records)

            await eventually(restarted)
    finally:
        await server.stop()
    [crash] = [
        r
        for r in caplog.records
        if r.levelno == logging.ERROR and "Scheduler hit an exception" in r.getMessage()
    ]
    text = crash.getMessage()
    assert "CUDA out of memory. Tried to allocate" in text  # the engine's own message
    assert "tried to allocate" in text and "MiB free" in text
    # A lone 500K prompt dies mid-prefill: not yet running, the rest of it still pending.
    assert re.search(
        r"state at the crash: 0 running, 0 queued, [\d,]+ pending prefill tokens, token usage", text
    )
    assert "1 requests failed" in text and "new ones refused" in text
    assert "back in 60 s of engine time (0.6 s wall at --speed 100)" in text
    fields = crash.fields  # type: ignore[attr-defined]
    assert fields["event"] == "crash" and fields["requested_bytes"] > fields["free_bytes"]
