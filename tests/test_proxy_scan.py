"""The gated and pass-through requests' one pass over their headers (``proxy._scan_gated``,
``proxy._scan_pass``) against each rule read plainly, one question per pass (the oracles below: the
functions the proxy ran before issue #27, kept here and nowhere else, so the rules have one home in the
product), and against ``read_body``'s Content-Length check, ``_headers_dict``, ``_request_header_bytes``
and ``_PassThroughBody``'s framing, on generated header lists: repeated names, hop-by-hop headers,
Connection options, values that are not UTF-8. And the other shortcuts of the gated path (issue #27)
against the calls they stand for."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.http import proxy
from sidecar.http.answers import Response
from sidecar.http.hosts import json_media_refusal
from sidecar.intake.gateway import gateway_fields_in
from sidecar.policy.priority import OPEN, PriorityBounds
from tests.conftest import small_policy

NAMES = [
    b"host",
    b"content-type",
    b"content-length",
    b"x-request-id",
    b"connection",
    b"keep-alive",
    b"transfer-encoding",
    b"te",
    b"upgrade",
    b"x-priority",
    b"x-admission-priority",
    b"x-tier",
    b"close",
    b"user-agent",
    b"accept",
]
VALUES = [
    b"",
    b"x",
    b"127.0.0.1:8000",
    b"application/json",
    b"Application/JSON; charset=utf-8",
    b"application/vnd.api+json",
    b"text/plain",
    b"12",
    b"52",
    b"99999999999",
    b"-3",
    b"abc-123",
    b"a b",
    b"keep-alive",
    b"Keep-Alive",
    b"close",
    b"keep-alive, x-tier",
    b"upgrade, user-agent",
    b"chunked",
    "café".encode(),
    b"caf\xe9",  # latin-1: not UTF-8
    b"\xff\xfe",
    b"gold",
]


def header_problem(headers: list[tuple[bytes, bytes]]) -> Response | None:
    """The 400 for the first header value that is not UTF-8."""
    for k, v in headers:
        try:
            v.decode("utf-8")
        except UnicodeDecodeError:
            return proxy._not_utf8(k)
    return None


def json_body_refusal(headers: list[tuple[bytes, bytes]]) -> Response | None:
    """The 415 unless the first Content-Type is JSON."""
    first = next((v for k, v in headers if k == b"content-type"), None)
    return json_media_refusal(first)


def client_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The first X-Request-Id, kept when it looks like an id."""
    first = next((v for k, v in headers if k == b"x-request-id"), None)
    return None if first is None else proxy._request_id_of(first)


headers_lists = st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(VALUES)), max_size=12)
INTAKES = [
    proxy._Intake(small_policy()),
    proxy._Intake(small_policy(priority__class_header="X-Tier", priority__classes={"gold": 9})),
    # A class header that is also a header the scan reads for itself, or drops.
    proxy._Intake(small_policy(priority__class_header="Content-Type", priority__classes={"a": 1})),
    proxy._Intake(small_policy(priority__class_header="Connection", priority__classes={"a": 1})),
]


@settings(max_examples=400, deadline=None)
@given(headers=headers_lists, which=st.integers(0, len(INTAKES) - 1), limit=st.sampled_from([10, 52, 10**9]))
def test_the_gated_scan_reads_what_each_pass_read(
    headers: list[tuple[bytes, bytes]], which: int, limit: int
) -> None:
    intake = INTAKES[which]
    scope: dict[str, Any] = {"headers": headers}
    bad, ctype, sent, length, parser, forward = proxy._scan_gated(headers, intake)
    # The answer _gated_request gives, in its order: not UTF-8 (400), then not JSON (415).
    if bad is not None:
        problem = proxy._not_utf8(bad)
    elif ctype == b"application/json":
        problem = None
    else:
        problem = proxy.json_media_refusal(ctype)
    assert problem == (header_problem(headers) or json_body_refusal(headers))
    assert (None if sent is None else proxy._request_id_of(sent)) == client_request_id(headers)
    # A body is read without read_body's header check only where that check would refuse nothing.
    declared_too_large = any(k == b"content-length" and v.isdigit() and int(v) > limit for k, v in headers)
    fast = length is None or (length is not proxy._SEVERAL and not (length.isdigit() and int(length) > limit))
    if fast:
        assert not declared_too_large
    elif length is not proxy._SEVERAL:
        assert declared_too_large
    assert forward == proxy._request_header_bytes(scope, False)
    if bad is None:  # the parser's headers are decoded only once the values are known to be UTF-8
        assert (proxy._parser_dict(parser) if parser else {}) == proxy._headers_dict(scope, intake.names)


@settings(max_examples=400, deadline=None)
@given(headers=headers_lists)
def test_the_pass_through_scan_reads_what_each_pass_read(headers: list[tuple[bytes, bytes]]) -> None:
    scope: dict[str, Any] = {"headers": headers}
    bad, length, chunked, forward = proxy._scan_pass(headers)
    assert (None if bad is None else proxy._not_utf8(bad)) == header_problem(headers)
    # _PassThroughBody.start's framing: the last Content-Length, any Transfer-Encoding.
    lengths = [v for k, v in headers if k == b"content-length"]
    assert length == (lengths[-1] if lengths else None)
    assert chunked == any(k == b"transfer-encoding" for k, _ in headers)
    assert forward == proxy._request_header_bytes(scope, False)


def test_a_request_id_is_32_hex_digits_of_the_random_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """``new_request_id`` writes the bits' bytes in hex: what ``f"{n:032x}"`` wrote, leading zeros kept."""
    for bits in (0, 1, 0xABC, 2**127 + 5, 2**128 - 1):
        monkeypatch.setattr(proxy, "_random_bits", lambda k, bits=bits: bits)
        assert proxy.new_request_id() == f"{bits:032x}"
    monkeypatch.undo()
    assert re.fullmatch(r"[0-9a-f]{32}", proxy.new_request_id())


@pytest.mark.parametrize(
    "waited_s",
    [0.0, 1e-9, 0.0004999, 0.0005, 0.0005001, 0.0015, 0.0025, 0.2, 1.2345, 59.9995, -0.0005, -0.0007],
)
def test_the_wait_header_is_the_wait_rounded_as_before(waited_s: float) -> None:
    assert proxy._wait_header(waited_s) == (b"x-admission-wait-ms", str(round(waited_s * 1000)).encode())


@settings(max_examples=200, deadline=None)
@given(
    body=st.dictionaries(
        st.sampled_from(["text", "rid", "bootstrap_host", "bootstrap_room", "routed_dp_rank", "x"]),
        st.one_of(st.none(), st.integers(), st.text(max_size=3)),
        max_size=4,
    ),
    which=st.integers(0, len(INTAKES) - 1),
)
def test_a_body_with_no_gateway_name_is_what_gateway_fields_in_finds_nothing_in(
    body: dict[str, Any], which: int
) -> None:
    """``_decide`` skips ``_gateway_fields`` where the body has none of the policy's names."""
    intake = INTAKES[which]
    names = intake.loaded.policy.gateway_fields.names
    if intake.gateway_names.isdisjoint(body):
        assert gateway_fields_in(body, names) == ()


@pytest.mark.parametrize(
    "bounds",
    [OPEN, PriorityBounds(), PriorityBounds(minimum=-5, maximum=5, default=2), *(i.bounds for i in INTAKES)],
)
def test_a_plain_body_gets_what_resolve_gives_no_claim_and_no_headers(bounds: PriorityBounds) -> None:
    """The plain readers take ``bounds.default`` for ``bounds.resolve(None, None)``."""
    assert bounds.resolve(None, None) == bounds.default


def _frames(coro: Any) -> list[Any]:
    """The frames of a task's chain of coroutines and generators, outermost first."""
    out = []
    while coro is not None:
        frame = (
            getattr(coro, "cr_frame", None)
            or getattr(coro, "gi_frame", None)
            or getattr(coro, "ag_frame", None)
        )
        if frame is not None:
            out.append(frame)
        coro = (
            getattr(coro, "cr_await", None)
            or getattr(coro, "gi_yieldfrom", None)
            or getattr(coro, "ag_await", None)
        )
    return out


async def test_no_frame_of_a_streaming_gated_request_holds_its_large_body(tmp_path: Path) -> None:
    """The handler takes a body of one message itself (no ``read_body`` frame that ends with it): its
    locals must let go of the bytes, which a :class:`proxy._Body` alone holds until they are written
    (issue #12). Looked for in every frame of every task while the stream runs."""
    import httpx

    from tests.harness import FakeEngine, lane

    engine = FakeEngine(events=2)
    ids = [(i * 7919) % 151_000 for i in range(60_000)]  # ~400 KB
    async with (
        lane(tmp_path, engine) as (url, _app, _),
        httpx.AsyncClient(timeout=10) as client,
        client.stream("POST", url + "/generate", json={"input_ids": ids, "stream": True}) as r,
    ):
        chunks = r.aiter_bytes()
        assert b'"i": 0' in await anext(chunks)
        held = [
            (frame.f_code.co_name, name)
            for task in asyncio.all_tasks()
            for frame in _frames(task.get_coro())
            for name, value in frame.f_locals.items()
            if isinstance(value, bytes | bytearray | memoryview) and len(value) > 300_000
        ]
        assert held == [], "a frame still holds the forwarded body"
        engine.release.set()
        rest = b"".join([c async for c in chunks])
    assert b"[DONE]" in rest and engine.arrived[-1]["input_ids"] == ids
