"""What the gated request's hot path was made cheaper in, pinned: the same answers, and no reference
cycle left behind per request (each one cost a garbage collection's work, and full collections at load)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

from sidecar.core.snapshot import EngineSignals
from sidecar.http import proxy
from sidecar.http.access_log import ACCESS_NOTE, AccessLog
from sidecar.http.hosts import json_media_refusal
from tests.conftest import small_policy


@pytest.mark.parametrize(
    ("used", "available", "evictable", "total"),
    [
        (None, None, None, None),
        (None, 5, 3, None),
        (5, None, 3, None),
        (0, 0, None, 0),
        (10, 30, None, 40),
        (10, 30, 0, 40),
        (10, 30, 7, 47),
    ],
)
def test_mamba_total_slots(
    used: int | None, available: int | None, evictable: int | None, total: int | None
) -> None:
    e = EngineSignals(
        observed_at=0.0,
        mamba_used_slots=used,
        mamba_available_slots=available,
        mamba_evictable_slots=evictable,
    )
    assert e.mamba_total_slots == total


def test_a_gated_request_is_judged_by_its_first_content_type() -> None:
    """``_scan_gated`` keeps the first Content-Type; ``json_media_refusal`` answers for it."""
    intake = proxy._Intake(small_policy())

    def refusal(headers: list[tuple[bytes, bytes]]) -> Any:
        return json_media_refusal(proxy._scan_gated(headers, intake)[1])

    json_first = [(b"host", b"x"), (b"content-type", b"application/json"), (b"content-type", b"text/plain")]
    assert refusal(json_first) is None
    text_first = [(b"content-type", b"text/plain"), (b"content-type", b"application/json")]
    refused = refusal(text_first)
    assert refused is not None and refused[0] == 415
    missing = refusal([(b"host", b"x")])
    assert missing is not None and missing[0] == 415
    assert refusal([(b"content-type", b"Application/Problem+JSON; charset=utf-8")]) is None


class _Cycle:
    """A server's request cycle as uvicorn's: it holds the scope, and its ``send`` is a bound method."""

    def __init__(self) -> None:
        self.scope: dict[str, Any] = {"type": "http", "method": "POST", "path": "/generate", "headers": []}
        self.sent: list[dict[str, Any]] = []

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


async def _receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


async def test_access_log_leaves_no_cycle_through_the_servers_send() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        note = scope[ACCESS_NOTE]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await note["raw_send"]({"type": "http.response.body", "body": b"abc"})  # the relay's path
        note["body_bytes"] = note.get("body_bytes", 0) + 3

    access = AccessLog(app)
    cycle = _Cycle()
    gone = weakref.ref(cycle)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        await access(cycle.scope, _receive, cycle.send)
        assert [m["type"] for m in cycle.sent] == ["http.response.start", "http.response.body"]
        assert access.in_flight == 0
        del cycle
        assert gone() is None, "the request's cycle was kept alive by a reference cycle"
    finally:
        if was_enabled:
            gc.enable()
