"""``serve`` as a process, for what only the real process shows: the event loop that runs the data
path, and which peers may rewrite a request's client address (``--forwarded-allow-ips``)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import FakeEngine, eventually, serve
from tests.test_logging import sidecar, write_policy


def lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def fields(line: dict[str, Any]) -> dict[str, Any]:
    return line.get("fields", line)


async def access_client(log: Path, request_id: str) -> str:
    """The access log's ``client`` for the request that carried ``request_id``."""
    found: list[str] = []

    def logged() -> bool:
        found[:] = [
            fields(x).get("client")
            for x in lines(log)
            if fields(x).get("request_id") == request_id and "duration_ms" in fields(x)
        ]
        return bool(found)

    await eventually(logged, timeout=10)
    return found[0]


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed")
async def test_serve_runs_on_uvloop_and_trusts_no_forwarded_header_by_default(tmp_path: Path) -> None:
    """Both listeners run in one loop of the CLI's own; it must be the loop uvicorn would choose
    (uvloop), not ``asyncio.run``'s stdlib loop. No peer is trusted for X-Forwarded-For unless named."""
    policy = write_policy(tmp_path)
    log = tmp_path / "stderr.log"
    async with serve(FakeEngine(events=1)) as engine_url:
        with log.open("w") as err:
            async with sidecar(engine_url, policy, "--log-format", "json", stderr=err) as (url, _):
                async with httpx.AsyncClient(timeout=10) as client:
                    r = await client.get(
                        url + "/v1/models", headers={"x-forwarded-for": "203.0.113.9", "x-request-id": "p1"}
                    )
                    assert r.status_code == 200
                client_addr = await access_client(log, "p1")
    loops = [fields(x)["loop"] for x in lines(log) if fields(x).get("event") == "event_loop"]
    assert loops and loops[0].startswith("uvloop."), loops
    assert client_addr.startswith("127.0.0.1:"), client_addr


async def test_forwarded_allow_ips_names_the_proxies_whose_forwarded_for_is_believed(tmp_path: Path) -> None:
    policy = write_policy(tmp_path)
    log = tmp_path / "stderr.log"
    async with serve(FakeEngine(events=1)) as engine_url:
        with log.open("w") as err:
            async with sidecar(
                engine_url, policy, "--log-format", "json", "--forwarded-allow-ips", "127.0.0.1", stderr=err
            ) as (url, _):
                async with httpx.AsyncClient(timeout=10) as client:
                    r = await client.get(
                        url + "/v1/models", headers={"x-forwarded-for": "203.0.113.9", "x-request-id": "p2"}
                    )
                    assert r.status_code == 200
                client_addr = await access_client(log, "p2")
    assert client_addr.startswith("203.0.113.9"), client_addr
