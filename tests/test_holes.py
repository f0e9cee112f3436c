"""The holes issue #10 found by probing the sidecar from outside, each kept shut by a test.

Real processes on loopback: a fake engine (or a real FastAPI one, since SGLang is FastAPI) and a real
sidecar, raw HTTP from httpx. Every test also checks that each request ended in exactly one counted
outcome and that the ledger is back to zero.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from sidecar.admission.controller import Outcome
from sidecar.app import SidecarApp
from sidecar.http.server import ServingLimits
from sidecar.policy.engine_routes import (
    LATEST,
    NOT_PREFILL,
    PREFILL_ROUTES,
    REFUSED_PATHS,
    Route,
    normalize_path,
)
from tests.harness import METRICS_TEMPLATE, FakeEngine, eventually, gen, lane, serve

FIXTURES = Path(__file__).parent / "fixtures" / "routes"

# A prompt of ~200K tokens by the byte bound: it can never fit the test lane (see `_tight`).
BIG_TEXT = "x" * 500_000
# Per-context-token temporaries that make the big prompt need more than the 1 GiB the GPU file says.
TIGHT = {"cost__context_bytes_per_token": "20KiB", "hold__max_held": 0}


def outcomes(app: SidecarApp) -> dict[str, float]:
    values = {
        o.value: app.registry.get_sample_value("sglang_sidecar_requests_total", {"outcome": o.value}) or 0.0
        for o in Outcome
    }
    return {k: v for k, v in values.items() if v}


async def settled(app: SidecarApp, expected_requests: int) -> None:
    """Exactly one outcome per request, ledger and queue back to zero."""
    await eventually(lambda: sum(outcomes(app).values()) >= expected_requests)
    assert sum(outcomes(app).values()) == expected_requests, outcomes(app)
    await eventually(lambda: app.admission.ledger.totals.requests == 0 and app.admission.held == 0)


# --- 1. the emulator's size declaration ----------------------------------------------------------


async def test_declared_size_is_ignored_unless_started_for_the_emulator(tmp_path: Path) -> None:
    body = {"text": BIG_TEXT, "emulator": {"prompt_tokens": 1}}
    engine = FakeEngine()
    kwargs = {"trust_emulator_sizes": False}
    async with lane(tmp_path, engine, app_kwargs=kwargs, **TIGHT) as (url, app, _):
        async with httpx.AsyncClient(timeout=10) as client:
            state = (await client.get(url.admin + "/admission/state")).json()
            assert state["trust_emulator_sizes"] is False
            r = await client.post(url + "/generate", json=body)
            assert r.status_code == 429, r.text
            assert engine.arrived == []
            # explain agrees with the gate
            e = await client.post(url.admin + "/admission/explain", json=body)
            assert e.json()["decision"] != "admit"
        await settled(app, 1)


async def test_declared_size_is_honoured_with_the_flag(tmp_path: Path) -> None:
    body = {"text": BIG_TEXT, "emulator": {"prompt_tokens": 1}}
    engine = FakeEngine()
    async with lane(tmp_path, engine, app_kwargs={"trust_emulator_sizes": True}, **TIGHT) as (url, app, _):
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await client.get(url.admin + "/admission/state")).json()["trust_emulator_sizes"] is True
            r = await client.post(url + "/generate", json=body)
            assert r.status_code == 200
        await settled(app, 1)


def test_the_flag_is_off_by_default() -> None:
    from sidecar.cli import build_parser
    from sidecar.settings import Settings

    s = Settings(upstream="http://127.0.0.1:1", policy="p.yaml")
    assert s.trust_emulator_sizes is False
    args = build_parser().parse_args(["serve", "--trust-emulator-sizes"])
    assert args.trust_emulator_sizes is True


# --- 2. path variants and redirects ------------------------------------------------------------

VARIANTS = [
    "/generate/",
    "//generate",
    "/generate//",
    "/./generate",
    "/v1/chat/completions/",
    "/v1//chat/completions",
    "/v1/./chat/completions",
    "/v1/x/../chat/completions",
    "/gen%65rate",
]


@pytest.mark.parametrize("path", VARIANTS)
async def test_path_variants_are_gated(tmp_path: Path, path: str) -> None:
    engine = FakeEngine()
    async with lane(tmp_path, engine, app_kwargs={"trust_emulator_sizes": False}, **TIGHT) as (url, app, _):
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.post(
                url + path, json={"text": BIG_TEXT, "messages": [{"role": "user", "content": BIG_TEXT}]}
            )
            assert r.status_code == 429, (path, r.status_code, r.text[:200])
            assert r.headers["x-admission-decision"] == "reject"
            # a small one is admitted and reaches the route the engine serves, not a redirect
            r = await client.post(
                url + path, json={"text": "hi", "messages": [{"role": "user", "content": "hi"}]}
            )
            assert r.status_code == 200, (path, r.status_code, r.text[:200])
            assert r.headers["x-admission-decision"] == "admit"
        assert len(engine.arrived) == 1
        await settled(app, 2)


def test_normalize_path() -> None:
    assert normalize_path("//generate/") == "/generate"
    assert normalize_path("/v1/a/../chat/completions") == "/v1/chat/completions"
    assert normalize_path("/") == "/"
    assert normalize_path("") == "/"
    assert normalize_path("/..") == "/"


def fastapi_engine() -> FastAPI:
    """SGLang's shape: FastAPI routes, with FastAPI's trailing-slash redirects."""
    api = FastAPI()

    @api.post("/generate")
    async def generate(request: Request) -> dict[str, str]:
        await request.body()
        return {"text": "ok"}

    @api.get("/v1/models")
    async def models() -> dict[str, list]:
        return {"data": []}

    @api.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(METRICS_TEMPLATE.format(running=0.0, queue=0.0))

    return api


async def test_a_redirect_never_names_the_engine(tmp_path: Path) -> None:
    async with serve(fastapi_engine()) as engine_url:
        # direct: FastAPI tells the client where the engine is
        async with httpx.AsyncClient(timeout=10) as client:
            direct = await client.get(engine_url + "/v1/models/")
        assert direct.status_code == 307
        assert direct.headers["location"].startswith(engine_url)
        async with lane(tmp_path, FakeEngine(), upstream=engine_url) as (url, app, _):
            await eventually(lambda: app.admission.snapshot.engine is not None)
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.get(url + "/v1/models/")
                assert r.status_code == 307
                assert r.headers["location"] == "/v1/models"
                followed = await client.get(url + "/v1/models/", follow_redirects=True)
                assert followed.status_code == 200
                assert str(followed.url).startswith(url)
                # a gated variant is forwarded to the route itself: no redirect at all
                g = await client.post(url + "/generate/", json={"text": "hi"})
                assert g.status_code == 200 and g.json() == {"text": "ok"}
            await settled(app, 1)


def test_location_rewrite() -> None:
    from sidecar.http.proxy import _local_location, _origin

    o = _origin("http://127.0.0.1:30000")
    assert _local_location(b"http://127.0.0.1:30000/generate", o) == b"/generate"
    assert _local_location(b"HTTP://127.0.0.1:30000", o) == b"/"
    assert _local_location(b"//127.0.0.1:30000/x?y=1", o) == b"/x?y=1"
    assert _local_location(b"http://127.0.0.1:300001/x", o) == b"http://127.0.0.1:300001/x"
    assert _local_location(b"https://example.com/x", o) == b"https://example.com/x"
    assert _local_location(b"/relative", o) == b"/relative"
    d = _origin("http://engine")
    assert _local_location(b"http://engine/generate", d) == b"/generate"
    assert _local_location(b"http://engine:80/generate", d) == b"/generate"


# --- 11. every prefill route ------------------------------------------------------------------

SMALL_BODIES = {
    "generate": {"text": "hi"},
    "embedding": {"text": "hi"},
    "completions": {"prompt": "hi"},
    "chat": {"messages": [{"role": "user", "content": "hi"}]},
    "input": {"input": "hi"},
    "score": {"query": "hi", "items": ["a", "b"]},
    "responses": {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]},
    "rerank": {"query": "hi", "documents": ["a", "b"]},
    "messages": {"system": "s", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    "vertex": {"instances": [{"text": "hi"}], "parameters": {"sampling_params": {"max_new_tokens": 4}}},
    "ollama_chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "ollama_generate": {"model": "m", "prompt": "hi"},
    "decisions": {"input": "hi", "questions": [{"type": "noul", "question": "q?"}]},
    "systemone": {"state": "hi", "model": "m", "questions": {"a": {"type": "noul", "question": "q?"}}},
}


def big(shape: str) -> dict:
    return json.loads(json.dumps(SMALL_BODIES[shape]).replace('"hi"', json.dumps(BIG_TEXT)))


async def test_every_prefill_route_is_gated_with_its_parser(tmp_path: Path) -> None:
    engine = FakeEngine()
    routes = PREFILL_ROUTES[LATEST]
    async with lane(tmp_path, engine, app_kwargs={"trust_emulator_sizes": False}, **TIGHT) as (url, app, _):
        async with httpx.AsyncClient(timeout=10) as client:
            for route in routes:
                for method in route.methods:
                    r = await client.request(method, url + route.path, json=big(route.shape))
                    assert r.status_code == 429, (route, method, r.status_code, r.text[:300])
                    assert r.json()["error"]["type"] == "admission_rejected"
                    small = await client.request(method, url + route.path, json=SMALL_BODIES[route.shape])
                    assert small.headers.get("x-admission-decision") == "admit", (route, small.text[:300])
                    missing = await client.request(method, url + route.path, json={"nothing": 1})
                    assert missing.status_code == 400, (route, missing.text[:300])
            for path in REFUSED_PATHS:
                r = await client.post(url + path, content=b"--x--")
                assert r.status_code == 403, path
        n = sum(len(r.methods) for r in routes)
        await settled(app, 3 * n)
        assert outcomes(app) == {"rejected": n, "completed": n, "bad_request": n}


def sglang_route_table(version: str) -> list[tuple[str, tuple[str, ...]]]:
    """Paths and methods of SGLang's route decorators, recorded from its http_server.py."""
    text = (FIXTURES / f"sglang-{version}.txt").read_text()
    rows = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            methods, path = line.split()
            rows.append((path, tuple(methods.split(","))))
    return rows


@pytest.mark.parametrize("version", sorted(PREFILL_ROUTES))
def test_route_list_matches_sglangs_route_table(version: str) -> None:
    """Every POST/PUT route SGLang serves is either gated, refused, or known not to prefill: a route
    added by a new SGLang version fails here until it is classified."""
    ours: dict[str, Route] = {r.path: r for r in PREFILL_ROUTES[version]}
    table = sglang_route_table(version)
    theirs = {p for p, m in table}
    unclassified = [
        p
        for p, methods in table
        if set(methods) & {"POST", "PUT"}
        and p not in ours
        and p not in REFUSED_PATHS
        and p not in NOT_PREFILL
    ]
    assert unclassified == []
    assert set(ours) <= theirs, set(ours) - theirs
    for path, methods in table:
        if path in ours:
            assert set(ours[path].methods) == set(methods) & {"POST", "PUT"}, path
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)


# --- 8. numbers --------------------------------------------------------------------------------

HUGE = ["1e308", "99999999999999999999", "9223372036854775808", "1e19"]


@pytest.mark.parametrize("number", HUGE)
async def test_huge_numbers_are_a_400_naming_the_field(tmp_path: Path, number: str) -> None:
    engine = FakeEngine()
    async with lane(tmp_path, engine) as (url, app, _):
        async with httpx.AsyncClient(timeout=10) as client:
            bodies = [
                ("/admission/explain", f'{{"prompt_tokens": {number}}}', "prompt_tokens"),
                (
                    "/admission/explain",
                    f'{{"prompt_tokens": 5, "max_new_tokens": {number}}}',
                    "max_new_tokens",
                ),
                (
                    "/generate",
                    f'{{"text": "x", "emulator": {{"prompt_tokens": {number}}}}}',
                    "emulator.prompt_tokens",
                ),
                (
                    "/generate",
                    f'{{"text": "x", "sampling_params": {{"max_new_tokens": {number}}}}}',
                    "sampling_params.max_new_tokens",
                ),
                ("/v1/completions", f'{{"prompt": "x", "n": {number}}}', "n"),
                ("/generate", f'{{"text": "x", "priority": {number}}}', "priority"),
            ]
            for path, body, field in bodies:
                base = url.admin if path.startswith("/admission/") else url
                r = await client.post(base + path, content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400, (path, body, r.status_code, r.text)
                assert field in r.json()["error"]["message"], r.text
            r = await client.post(url + "/generate", headers={"x-admission-priority": "9" * 30}, json=gen())
            assert r.status_code == 400
        await settled(app, 5)  # the two explain requests are not gated requests
        assert engine.arrived == []


async def test_a_huge_declared_size_is_judged_unfit(tmp_path: Path) -> None:
    engine = FakeEngine()
    async with lane(tmp_path, engine) as (url, app, _):
        async with httpx.AsyncClient(timeout=10) as client:
            for tokens in (10**12, 2**63 - 1):
                r = await client.post(url + "/generate", json=gen(stream=False, tokens=tokens))
                assert r.status_code == 400, r.text  # longer than the context: as SGLang answers
                assert r.headers["x-admission-reason"] == "unfit_request"
                e = await client.post(
                    url.admin + "/admission/explain",
                    json={"prompt_tokens": tokens, "max_new_tokens": 2**63 - 1},
                )
                assert e.status_code == 200 and e.json()["reason"] == "unfit_request", e.text
        await settled(app, 2)


# --- 9. engine values that cannot be true -----------------------------------------------------


class BrokenMetricsEngine(FakeEngine):
    """A FakeEngine whose /metrics answer a test can replace."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: str | None = None

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] == "http" and scope["path"] == "/metrics" and self.metrics is not None:
            body = self.metrics.encode()
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
            )
            await send({"type": "http.response.body", "body": body})
            return
        await super().__call__(scope, receive, send)


GOOD = METRICS_TEMPLATE.format(running=0.0, queue=0.0)
BAD_METRICS = {
    "empty": ("", []),
    "all NaN": (re.sub(r"\} [0-9.]+$", "} NaN", GOOD, flags=re.M), ["sglang:num_running_reqs"]),
    "all +Inf": (re.sub(r"\} [0-9.]+$", "} +Inf", GOOD, flags=re.M), ["sglang:kv_available_tokens"]),
    "negative pool": (GOOD.replace("} 100000.0", "} -100000.0"), ["sglang:kv_available_tokens"]),
    "huge pool": (GOOD.replace("} 100000.0", "} 1e300"), ["sglang:kv_available_tokens"]),
}
STALE = {"engine__poll_interval_s": 0.05, "engine__max_age_s": 0.3, "engine__on_stale": "reject"}


@pytest.mark.parametrize("case", list(BAD_METRICS))
async def test_impossible_engine_values_are_a_failed_read(tmp_path: Path, case: str) -> None:
    text, series = BAD_METRICS[case]
    engine = BrokenMetricsEngine()
    async with lane(tmp_path, engine, **STALE) as (url, app, _):
        async with httpx.AsyncClient(timeout=10) as client:
            # Ready first (a good read younger than 0.3 s): waited for, not read at one instant, which a
            # loaded machine's slow poll or loop stall makes a 503 before anything is broken.
            async def ready() -> bool:
                return (await client.get(url + "/readyz")).status_code == 200

            await eventually(ready)
            engine.metrics = text

            async def stale() -> bool:
                return (
                    (await client.get(url.admin + "/admission/state")).json()["engine"]["age_s"] or 0
                ) > 0.35

            await eventually(stale)
            assert (await client.get(url + "/readyz")).status_code == 503
            state = (await client.get(url.admin + "/admission/state")).json()["engine"]
            assert state["consecutive_failures"] >= 1
            for name in series:
                assert name in state["implausible_series"], state
                assert name in state["last_error"]
            r = await client.post(url + "/generate", json=gen(stream=False))
            # Stale first (busy now: 429), then unavailable (a fault: 503) once policy
            # engine.unavailable_after_failures reads have failed; which one depends on how many polls a
            # loaded machine ran before this request, so the status is checked against the reason given.
            reason = r.headers["x-admission-reason"]
            assert (reason, r.status_code) in (("signals_stale", 429), ("engine_unavailable", 503)), r.text
            counted = sum(
                app.registry.get_sample_value(
                    "sglang_sidecar_implausible_values_total", {"signal": "engine", "series": name}
                )
                or 0
                for name in series
            )
            assert counted >= len(series)
            engine.metrics = None  # the engine recovers: so does the gate

            async def ready() -> bool:
                return (await client.get(url + "/readyz")).status_code == 200

            await eventually(ready)
            assert (await client.get(url.admin + "/admission/state")).json()["engine"][
                "implausible_series"
            ] == []
            attempts = 0

            async def served() -> bool:
                # The engine's max_age is 0.3 s: on a starved machine a poll can be late between the
                # readiness answer and this request, which is then (rightly) refused as stale.
                nonlocal attempts
                attempts += 1
                r = await client.post(url + "/generate", json=gen(stream=False))
                assert r.status_code == 200 or r.headers["x-admission-reason"] == "signals_stale", r.text
                return r.status_code == 200

            await eventually(served)
        await settled(app, 1 + attempts)


def test_plausibility_rules() -> None:
    from sidecar.signals.plausible import check_engine_fields

    ok = {
        "running_requests": 3,
        "full_token_usage": 1.0,
        "chunked_prefill_size": -1,
        "kv_available_tokens": 0,
    }
    assert check_engine_fields(ok) == []
    bad = check_engine_fields(
        {
            "full_token_usage": 1.7,
            "max_total_tokens": -5,
            "queue_requests": 2**50,
            "mamba_usage": float("nan"),
        },
        {"max_total_tokens": "sglang:max_total_num_tokens"},
    )
    assert [p.series for p in bad] == [
        "full_token_usage",
        "sglang:max_total_num_tokens",
        "queue_requests",
        "mamba_usage",
    ]


# --- 5. the GPU file source -------------------------------------------------------------------


async def test_gpu_fifo_does_not_block_the_proxy(tmp_path: Path) -> None:
    """A FIFO at the GPU file's path: main's open() blocked the event loop until a writer came."""
    import os
    import threading

    engine = FakeEngine()
    async with lane(tmp_path, engine) as (url, _, gpu_file):
        os.remove(gpu_file)
        os.mkfifo(gpu_file)
        unblocked, wrote = threading.Event(), threading.Event()

        def rescue() -> None:  # bounds the test on a build that blocks: writers for the FIFO
            if unblocked.wait(8):
                return
            while not unblocked.wait(0.2):
                wrote.set()
                with open(gpu_file, "w") as f:
                    f.write("{}")

        t = threading.Thread(target=rescue, daemon=True)
        t.start()
        try:
            async with httpx.AsyncClient(timeout=10) as client:

                async def refused() -> bool:
                    s = (await client.get(url.admin + "/admission/state")).json()["gpu"]
                    return "FIFO" in (s["last_error"] or "")

                await eventually(refused)
                assert (await client.get(url + "/healthz")).status_code == 200
        finally:
            unblocked.set()
            t.join()
        assert not wrote.is_set(), "the proxy was stuck until the FIFO got a writer"


async def test_gpu_file_refuses_directories_and_big_files(tmp_path: Path) -> None:
    from sidecar.signals.gpu import FileSource, GpuSourceError

    d = tmp_path / "dir.json"
    d.mkdir()
    with pytest.raises(GpuSourceError, match="a directory"):
        await FileSource(d).read(1.0)
    big_file = tmp_path / "big.json"
    big_file.write_text('{"free_bytes": 1, "total_bytes": 2, "pad": "' + "x" * 100_000 + '"}')
    with pytest.raises(GpuSourceError, match="larger than"):
        await FileSource(big_file).read(1.0)
    huge = tmp_path / "huge.json"
    huge.write_text('{"free_bytes": 1e300, "total_bytes": 1e300}')
    with pytest.raises(GpuSourceError, match="more than any GPU"):
        await FileSource(huge).read(1.0)


async def test_gpu_file_age_is_from_the_last_change_seen_not_a_future_mtime(tmp_path: Path) -> None:
    import os
    import time

    from sidecar.signals.gpu import FileSource

    path = tmp_path / "gpu.json"
    path.write_text('{"free_bytes": 1, "total_bytes": 2}')
    future = time.time() + 3600
    os.utime(path, (future, future))
    source = FileSource(path)
    assert (await source.read(100.0)).observed_at == 100.0  # a future mtime counts as now, not later
    # the writer died: nothing changes, so the reading ages with the sidecar's clock
    assert (await source.read(160.0)).observed_at == 100.0
    path.write_text('{"free_bytes": 1, "total_bytes": 2}')  # rewritten, same content: a new mtime
    os.utime(path, (future + 5, future + 5))
    assert (await source.read(170.0)).observed_at == 170.0
    path.write_text('{"free_bytes": 2, "total_bytes": 2}')
    os.utime(path, (future + 5, future + 5))  # content changed, mtime pinned: still a change
    assert (await source.read(180.0)).observed_at == 180.0


# --- 12. priority bounded by the policy -------------------------------------------------------


def _logged_priorities(log: io.StringIO) -> list[int]:
    return [json.loads(line)["priority"] for line in log.getvalue().splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("policy", "sent", "expected"),
    [
        ({}, [(10**9, {}), (-(10**9), {}), (None, {"x-admission-priority": "77"})], [0, 0, 0]),
        (
            {"priority__min": -2, "priority__max": 5, "priority__default": 1},
            [(10**9, {}), (-(10**9), {}), (3, {}), (None, {})],
            [5, -2, 3, 1],
        ),
        (
            {"priority__class_header": "X-Tenant-Class", "priority__classes": {"gold": 50, "batch": -5}},
            [
                (10**9, {}),
                (10**9, {"x-tenant-class": "gold"}),
                (0, {"x-tenant-class": "batch"}),
                (9, {"x-tenant-class": "forged"}),
            ],
            [0, 50, -5, 0],
        ),
    ],
)
async def test_client_priority_is_bounded_by_the_policy(
    tmp_path: Path, policy: dict, sent: list, expected: list[int]
) -> None:
    log = io.StringIO()
    engine = FakeEngine()
    async with lane(tmp_path, engine, app_kwargs={"decision_log": log}, **policy) as (url, app, _):
        async with httpx.AsyncClient(timeout=10) as client:
            for priority, headers in sent:
                body = gen(stream=False) | ({} if priority is None else {"priority": priority})
                r = await client.post(url + "/generate", json=body, headers=headers)
                assert r.status_code == 200, r.text
        await settled(app, len(sent))
        await eventually(lambda: len(_logged_priorities(log)) == len(sent))
    assert _logged_priorities(log) == expected


def test_priority_policy_is_checked() -> None:
    from sidecar.policy.schema import PolicyError
    from tests.conftest import small_policy

    for bad in (
        {"priority__min": 3, "priority__max": 1},
        {"priority__default": 9},
        {"priority__class_header": "x-t"},
    ):
        with pytest.raises(PolicyError, match="priority"):
            small_policy(**bad)


# --- 13. OPTIONS * and header bytes ------------------------------------------------------------


class HeaderBytesEngine(FakeEngine):
    """Answers /raw with the hex of the `x-name` header bytes it received."""

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] == "http" and scope["path"] == "/raw":
            got = [v.hex() for k, v in scope["headers"] if k == b"x-name"]
            body = json.dumps(got).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await super().__call__(scope, receive, send)


async def raw_request(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = re.search(rb"(?im)^content-length: *(\d+)", head)
        body = await asyncio.wait_for(reader.readexactly(int(length.group(1))), 10) if length else b""
        return head + body
    finally:
        writer.close()


async def test_options_star_and_header_bytes(tmp_path: Path) -> None:
    engine = HeaderBytesEngine()
    async with lane(tmp_path, engine) as (url, app, _):
        r = await raw_request(url, b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n")
        assert r.startswith(b"HTTP/1.1 204"), r[:200]
        r = await raw_request(url, b"GET /raw HTTP/1.1\r\nHost: x\r\nX-Name: caf\xc3\xa9\r\n\r\n")
        assert r.startswith(b"HTTP/1.1 200"), r[:200]
        assert json.loads(r.split(b"\r\n\r\n", 1)[1]) == [b"caf\xc3\xa9".hex()]  # not cafÃ©
        # a byte that is not UTF-8 cannot be relayed unchanged: said, not mangled
        r = await raw_request(url, b"GET /raw HTTP/1.1\r\nHost: x\r\nX-Name: caf\xe9\r\n\r\n")
        assert r.startswith(b"HTTP/1.1 400") and b"x-name" in r, r[:300]
        body = json.dumps(gen(stream=False)).encode()
        r = await raw_request(
            url,
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Name: caf\xe9\r\n"
            + b"Content-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body,
        )
        assert r.startswith(b"HTTP/1.1 400"), r[:300]
        await settled(app, 1)


# --- 6, 7. idle and slow connections, oversized input -----------------------------------------

SHORT = ServingLimits(
    header_timeout_s=0.5, body_timeout_s=0.5, max_header_bytes=16 * 1024, max_client_connections=50
)


async def _open(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def _answer(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes (bounded: a server that never closes fails)."""
    return await asyncio.wait_for(reader.read(), 10)


async def test_idle_and_slowloris_connections_are_closed(tmp_path: Path) -> None:
    async with lane(tmp_path, FakeEngine(), limits=SHORT) as (url, app, _):
        idle = [await _open(url) for _ in range(20)]
        slow = [await _open(url) for _ in range(20)]
        for _, w in slow:
            w.write(b"POST /gener")
            await w.drain()
        for r, _ in idle:
            assert await _answer(r) == b""  # closed, nothing to say
        for r, _ in slow:
            assert (await _answer(r)).startswith(b"HTTP/1.1 408")
        for _, w in idle + slow:
            w.close()
        # the port still serves
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await client.get(url + "/healthz")).status_code == 200
        await settled(app, 0)


async def test_stalled_body_is_408_and_one_outcome(tmp_path: Path) -> None:
    engine = FakeEngine()
    async with lane(tmp_path, engine, limits=SHORT) as (url, app, _):
        r, w = await _open(url)
        w.write(
            b'POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"te'
        )
        await w.drain()
        assert (await _answer(r)).startswith(b"HTTP/1.1 408")
        w.close()
        await settled(app, 1)
        assert outcomes(app) == {"client_gone": 1}
        assert engine.arrived == []


async def test_oversized_headers_are_431_and_never_forwarded(tmp_path: Path) -> None:
    engine = HeaderBytesEngine()
    async with lane(tmp_path, engine, limits=SHORT) as (url, app, _):
        r, w = await _open(url)
        w.write(b"GET /raw HTTP/1.1\r\nHost: x\r\nX-Name: ")
        try:
            for _ in range(64):  # up to 1 MiB; the server answers long before
                w.write(b"a" * 16384)
                await w.drain()
        except ConnectionError:
            pass
        assert (await _answer(r)).startswith(b"HTTP/1.1 431")
        w.close()
        assert engine.arrived == []
        await settled(app, 0)


async def test_explain_has_a_small_body_limit_and_stops_reading_at_it(tmp_path: Path) -> None:
    from sidecar.app import ADMIN_MAX_BODY_BYTES

    async with lane(tmp_path, FakeEngine(), limits=SHORT) as (url, _, _):
        # declared too large: refused before a byte of body is read
        r, w = await _open(url.admin)
        w.write(
            b"POST /admission/explain HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 314572800\r\n\r\n"
        )
        await w.drain()
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 413")
        w.close()

        # chunked, no length: refused as soon as the limit is passed (the client still had more)
        async def chunks():  # type: ignore[no-untyped-def]
            for _ in range(300):  # 300 MiB if it were all read
                yield b"x" * (1024 * 1024)

        async with httpx.AsyncClient(timeout=10) as client:
            try:
                resp = await client.post(url.admin + "/admission/explain", content=chunks())
                assert resp.status_code == 413
                assert f"{ADMIN_MAX_BODY_BYTES:,}" in resp.json()["error"]["message"]
            except httpx.HTTPError:
                pass  # the server answered and closed while the client was still writing
            assert (await client.get(url + "/healthz")).status_code == 200


async def test_connection_limit_answers_503(tmp_path: Path) -> None:
    limits = ServingLimits(header_timeout_s=5, max_client_connections=5)
    async with lane(tmp_path, FakeEngine(), limits=limits) as (url, _, _):
        idle = [await _open(url) for _ in range(5)]
        raw = await raw_request(url, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 503"), raw[:100]
        for _, w in idle:
            w.close()


async def test_a_keep_alive_connection_arms_no_timer_per_request_and_still_times_out(tmp_path: Path) -> None:
    """The header deadline and the body gap share one lazily armed timer per connection: 30 requests
    on one keep-alive connection arm a handful of timers, not three per request (issue #12); and the
    31st request, whose headers stall, still gets its 408 from that timer."""
    from sidecar.http.server import GuardedHttpToolsProtocol

    async with lane(tmp_path, FakeEngine(), limits=SHORT) as (url, app, _):
        loop = asyncio.get_running_loop()
        armed: list[object] = []
        real_at, real_later = loop.call_at, loop.call_later

        def count(real):  # type: ignore[no-untyped-def]
            def wrapper(when, callback, *args, **kwargs):  # type: ignore[no-untyped-def]
                # Ours only: uvicorn's own keep-alive timer (armed per response) is not this one.
                if isinstance(getattr(callback, "__self__", None), GuardedHttpToolsProtocol) and getattr(
                    callback, "__name__", ""
                ) in ("_on_timer", "_header_deadline", "_body_gap"):
                    armed.append(callback.__name__)
                return real(when, callback, *args, **kwargs)

            return wrapper

        loop.call_at, loop.call_later = count(real_at), count(real_later)  # type: ignore[method-assign]
        try:
            r, w = await _open(url)
            body = json.dumps(gen(stream=False)).encode()
            request = (
                b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            for _ in range(30):
                w.write(request)
                await w.drain()
                head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200"), head
                length = int(re.search(rb"(?im)^content-length: *(\d+)", head).group(1))
                await asyncio.wait_for(r.readexactly(length), 10)
            assert len(armed) <= 4, armed
            w.write(b"POST /gener")
            await w.drain()
            assert (await _answer(r)).startswith(b"HTTP/1.1 408")
            w.close()
        finally:
            loop.call_at, loop.call_later = real_at, real_later  # type: ignore[method-assign]
        await settled(app, 30)
