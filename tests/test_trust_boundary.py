"""Issue 24: the data port is a trust boundary. Each of the probe's findings, kept shut by a test.

Real processes on loopback (a recording engine, a real sidecar, raw sockets where a client library
would tidy the bytes), and the route lists of the SGLang versions the project supports
(``tests/fixtures/routes/``, read from SGLang's own ``http_server.py``: evidence S18).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from sidecar.core.snapshot import DeviceMemory
from sidecar.http.server import ServingLimits, fit_to_descriptors
from sidecar.intake.body import parse_generation
from sidecar.intake.demand import demand_of
from sidecar.intake.tokens import TokenCount
from sidecar.policy.engine_routes import (
    CONTROL,
    PREFILL_ROUTES,
    REFUSED_PATHS,
    SERVING,
    RouteTable,
    control_route,
    route_class,
)
from sidecar.policy.schema import PolicyError, load_policy_text
from sidecar.policy.source import PolicySource
from sidecar.signals.gpu import FileSource, GpuSourceError, parse_dcgm, parse_gpu_source
from tests.conftest import ROOT, small_policy, snapshot
from tests.harness import METRICS_TEMPLATE, FakeEngine, answer_lifespan, eventually, lane, read_body

ROUTES = Path(__file__).parent / "fixtures" / "routes"
TOKEN = "s3cret"
# Marks the test's own requests at the recording engine.
TEST = {"x-test": "1"}
AUTH = {"authorization": f"Bearer {TOKEN}"}


def route_table(version: str) -> list[tuple[tuple[str, ...], str]]:
    rows = []
    for line in (ROUTES / f"sglang-{version}.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            methods, path = line.split()
            rows.append((tuple(methods.split(",")), path))
    return rows


def concrete(path: str) -> str:
    """A request path that reaches a route template."""
    return re.sub(r"\{[^}]+\}", "x1", path)


class Recorder:
    """An SGLang-shaped engine that records every request and answers 200 (its /metrics as the
    harness's, so the sidecar's scraper sees a healthy engine)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        body = await read_body(receive)
        if scope["path"] == "/metrics":
            payload = METRICS_TEMPLATE.format(running=0.0, queue=0.0).encode()
        else:
            headers = {k.decode(): v.decode() for k, v in scope["headers"]}
            if "x-test" not in headers:  # the sidecar's own polls (loads, server info) are not counted
                await send({"type": "http.response.start", "status": 404, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
            self.seen.append((scope["method"], scope["path"], headers, body))
            payload = b'{"ok": true}'
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        )
        await send({"type": "http.response.body", "body": payload})

    def paths(self) -> list[str]:
        return [p for _, p, _, _ in self.seen]


# --- 1. route classes ----------------------------------------------------------------------------

# What the probe drove through the data port with no token, each answered 200 by SGLang.
PROBED = [
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/update_weights_from_disk",
    "/pause_generation",
    "/slow_down",
    "/abort_request",
    "/flush_cache",
    "/start_profile",
    "/stop_profile",
    "/configure_logging",
    "/load_lora_adapter",
    "/set_internal_state",
    "/open_session",
]


@pytest.mark.parametrize("version", sorted(PREFILL_ROUTES))
def test_every_route_of_every_supported_sglang_has_one_class(version: str) -> None:
    """Every route SGLang serves is gated (prefill), refused (a file upload), serving (forwarded) or
    control (closed): none is left unclassified, and no path is in two classes."""
    classes = {path: route_class(path, version) for _, path in route_table(version)}
    assert [p for p, c in classes.items() if c == "unknown"] == []
    prefill = {r.path for r in PREFILL_ROUTES[version]}
    for a, b in [
        (SERVING, CONTROL),
        (prefill, SERVING | CONTROL),
        (REFUSED_PATHS, SERVING | CONTROL | prefill),
    ]:
        assert not a & b, a & b
    for path in PROBED:
        assert route_class(path, version) == "control", path
    # Serving is only what a client reads: no POST of it changes the engine's state (checked by name).
    assert not {
        p
        for p in SERVING
        if re.search(r"flush|update_weight|weights|memory|lora|session|abort|pause|profile", p)
    }


@pytest.mark.parametrize("version", sorted(PREFILL_ROUTES))
async def test_control_routes_are_closed_on_the_data_port_and_relayed_on_the_admin_port(
    tmp_path: Path, version: str
) -> None:
    engine = Recorder()
    table = route_table(version)
    control = [
        (m, concrete(p)) for methods, p in table if route_class(p, version) == "control" for m in methods
    ]
    serving = [
        (m, concrete(p)) for methods, p in table if route_class(p, version) == "serving" for m in methods
    ]
    async with (
        lane(tmp_path, engine, upstream=None, app_kwargs={"admin_token": TOKEN}) as (url, _app, _),
        httpx.AsyncClient(timeout=10, headers=TEST) as c,
    ):
        for method, path in control:
            for variant in (path, path + "/", "/" + path, "/lane-a" + path):
                r = await c.request(method, url + variant, json={})
                assert r.status_code == 403, (method, variant, r.status_code, r.text[:200])
                assert r.json()["error"]["code"] == "engine_control_route"
        assert engine.paths() == []
        for method, path in serving:
            if path == "/v1/loads":
                continue  # answered by the sidecar itself (ops/loads.py)
            r = await c.request(method, url + path, json={})
            assert r.status_code == 200, (method, path, r.status_code, r.text[:200])
        assert len(engine.seen) == len([s for s in serving if s[1] != "/v1/loads"])
        # The admin port relays them, with the admin token only, and keeps the token to itself.
        engine.seen.clear()
        assert (await c.post(url.admin + "/flush_cache")).status_code == 401
        wrong = await c.post(url.admin + "/flush_cache", headers={"authorization": "Bearer no"})
        assert wrong.status_code == 401 and engine.seen == []
        for method, path in control:
            r = await c.request(method, url.admin + path, headers=AUTH, json={"a": 1})
            assert r.status_code == 200, (method, path, r.text[:200])
        assert [(m, p) for m, p, _, _ in engine.seen] == control
        assert all("authorization" not in h for _, _, h, _ in engine.seen)
        assert all(b == b'{"a":1}' or json.loads(b) == {"a": 1} for *_, b in engine.seen)


async def test_a_policy_opens_a_control_route_by_name(tmp_path: Path) -> None:
    engine = Recorder()
    async with (
        lane(tmp_path, engine, routes__open=["/flush_cache"]) as (url, _app, _),
        httpx.AsyncClient(timeout=10, headers=TEST) as c,
    ):
        assert (await c.post(url + "/flush_cache")).status_code == 200
        assert (await c.post(url + "/abort_request", json={"rid": "x"})).status_code == 403
        # Without --admin-token-file the admin port relays nothing.
        r = await c.post(url.admin + "/abort_request", headers=AUTH, json={"rid": "x"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "disabled"
    assert engine.paths() == ["/flush_cache"]


def test_a_policy_naming_an_unknown_control_route_is_refused_at_its_line() -> None:
    text = (ROOT / "policies" / "h200-generic.yaml").read_text()
    with pytest.raises(PolicyError, match=r"h\.yaml:\d+: routes\.open.*not one of SGLang's control routes"):
        load_policy_text(text + "routes:\n  open: [/generate]\n", "h.yaml")
    assert load_policy_text(text + "routes:\n  open: [/flush_cache]\n", "h.yaml").policy.routes.open


def test_control_route_matching() -> None:
    assert control_route("//flush_cache/") == "/flush_cache"
    assert control_route("/lane-a/release_memory_occupation") == "/release_memory_occupation"
    assert control_route("/dumper/anything") == "/dumper/{method}"
    assert control_route("/xflush_cache") is None
    assert control_route("/generate") is None
    assert control_route("/v1/responses/r1/cancel") is None


# --- 2. every sequence counted and bounded -------------------------------------------------------


async def test_a_million_sequences_is_unfit_at_once(tmp_path: Path) -> None:
    """`n: 1000000` on chat and /generate (with or without an output budget) and a 10,000-prompt batch
    were admitted under an engine queue limit of 4 ("a request alone always passes")."""
    engine = FakeEngine()
    bodies = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 1_000_000}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "n": 1_000_000, "max_tokens": 1},
        ),
        ("/generate", {"text": "hi", "sampling_params": {"n": 1_000_000}}),
        ("/generate", {"text": ["hi"] * 10_000}),
        ("/v1/completions", {"prompt": "hi", "best_of": 5}),
        ("/v1/completions", {"prompt": ["a", "b", "c", "d", "e"]}),
    ]
    async with (
        lane(
            tmp_path, engine, app_kwargs={"trust_emulator_sizes": False}, limits__max_sequences_per_request=4
        ) as (
            url,
            _app,
            _,
        ),
        httpx.AsyncClient(timeout=10) as c,
    ):
        for path, body in bodies:
            r = await c.post(url + path, json=body)
            assert r.status_code == 413, (path, r.status_code, r.text[:200])
            assert r.headers["x-admission-reason"] == "unfit_request"
            assert "retry-after" not in r.headers
            e = await c.post(
                url.admin + "/admission/explain", json={**body, "emulator": None}, params={"path": path}
            )
            assert e.status_code == 200 and e.json()["decision"] == "reject", e.text[:300]
        ok = await c.post(url + "/v1/completions", json={"prompt": ["a", "b", "c", "d"], "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    assert len(engine.arrived) == 1


@pytest.mark.parametrize(
    ("overrides", "samples", "limit"),
    [
        ({"limits__max_sequences_per_request": 2}, 3, "sequences"),
        ({"lane__max_running_requests": 3}, 4, "running_requests"),
    ],
)
def test_each_sequence_limit_makes_a_request_unfit(overrides: dict, samples: int, limit: str) -> None:
    from sidecar.admission.clock import LoopClock
    from sidecar.admission.controller import Admission
    from sidecar.core import demand

    a = Admission(small_policy(**overrides), LoopClock())
    a.update_snapshot(snapshot(a.clock.now()))
    d = a.evaluate(demand.build(a.rules, 10, arrived_at=a.clock.now(), samples=samples))
    assert d.reason is not None and d.reason.value == "unfit_request"
    assert d.checks[0].limit == limit and d.checks[0].need == samples
    assert a.evaluate(demand.build(a.rules, 10, arrived_at=a.clock.now(), samples=samples - 1)).admitted


def test_the_engine_queue_throttle_lets_a_request_alone_through_whatever_its_sequences() -> None:
    """``engine_queue.max_requests`` keeps SGLang's queue short; it is not the engine's limit, so a
    request of more sequences than it (n = 4 on a lane throttled at 2) passes alone and is not unfit."""
    from sidecar.admission.clock import LoopClock
    from sidecar.admission.controller import Admission
    from sidecar.core import demand

    a = Admission(small_policy(engine_queue__max_requests=2), LoopClock())
    a.update_snapshot(snapshot(a.clock.now()))
    assert a.evaluate(demand.build(a.rules, 10, arrived_at=a.clock.now(), samples=4)).admitted


def test_the_policy_bound_on_sequences_has_a_default() -> None:
    assert small_policy().policy.limits.max_sequences_per_request == 256


@pytest.mark.parametrize(
    ("path", "body", "budget"),
    [
        ("/generate", {"text": "hi"}, 128),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 7}}, 7),
        ("/v1/completions", {"prompt": "hi"}, 16),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 100_000 - 10),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, 3),
        ("/v1/embeddings", {"input": "hi"}, 0),
    ],
)
def test_a_missing_output_budget_is_priced_as_sglangs_default(path: str, body: dict, budget: int) -> None:
    """Evidence T3: /generate 128, /v1/completions 16, chat the rest of the context, embeddings 0."""
    policy = small_policy()
    from sidecar.policy.in_force import rules_of

    rules = rules_of(policy.policy)
    route = RouteTable().match(path, "POST")
    assert route is not None
    req = parse_generation(path, json.dumps(body).encode(), max_body_bytes=1 << 20, shape=route.shape)
    d = demand_of(rules, snapshot(0.0), req, TokenCount(10, True, "ids"), now=0.0)
    assert d.max_new_tokens == budget


async def test_the_decode_room_of_every_sequence_must_fit_the_pool(tmp_path: Path) -> None:
    """With a decode reserve of the whole output budget, two chat samples without max_tokens each
    reserve the rest of the 100,000-token context: more than the pool holds, unfit at once."""
    engine = FakeEngine()
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": False}
    async with (
        lane(
            tmp_path, engine, app_kwargs={"trust_emulator_sizes": False}, kv__decode_reserve_fraction=1.0
        ) as (
            url,
            _app,
            _,
        ),
        httpx.AsyncClient(timeout=10) as c,
    ):
        r = await c.post(url + "/v1/chat/completions", json={**chat, "n": 2})
        assert r.status_code == 413 and r.headers["x-admission-reason"] == "unfit_request", r.text
        assert "KV" in r.json()["error"]["message"]
        ok = await c.post(url + "/v1/chat/completions", json={**chat, "n": 2, "max_tokens": 10})
        assert ok.status_code == 200, ok.text


# --- 3. gateway-only fields ----------------------------------------------------------------------

BOOTSTRAP = {"text": "hi", "stream": False, "bootstrap_host": "10.0.0.9", "bootstrap_room": 7}


async def test_gateway_fields_are_refused_by_default(tmp_path: Path) -> None:
    """SGLang issue #36855: a client-set bootstrap_host with a long prompt exhausted the KV pool and
    killed a lane that is not disaggregated. Refused before the engine sees it."""
    engine = FakeEngine()
    async with lane(tmp_path, engine) as (url, _app, _), httpx.AsyncClient(timeout=10) as c:
        for body in (
            BOOTSTRAP,
            {"prompt": "x", "routed_dp_rank": 1},
            {"prompt": "x", "custom_logit_processor": "x"},
        ):
            path = "/generate" if "text" in body else "/v1/completions"
            r = await c.post(url + path, json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "gateway_field" and error["param"] in body
        # null is SGLang's default, not a claim
        assert (
            await c.post(url + "/generate", json={"text": "hi", "stream": False, "bootstrap_host": None})
        ).status_code == 200
    assert len(engine.arrived) == 1


@pytest.mark.parametrize("on_client", ["strip", "pass"])
async def test_gateway_fields_stripped_or_passed_as_the_policy_says(tmp_path: Path, on_client: str) -> None:
    engine = FakeEngine()
    async with (
        lane(tmp_path, engine, gateway_fields__on_client=on_client) as (url, _app, _),
        httpx.AsyncClient(timeout=10) as c,
    ):
        r = await c.post(url + "/generate", json=BOOTSTRAP)
        assert r.status_code == 200, r.text
    (seen,) = engine.arrived
    if on_client == "strip":
        assert seen == {"text": "hi", "stream": False}
    else:
        assert seen == BOOTSTRAP


async def test_a_rid_in_flight_is_refused_until_it_ends(tmp_path: Path) -> None:
    engine = FakeEngine()
    engine.gate_headers.clear()  # the first request stays in its prefill
    body = {"text": "hi", "stream": True, "rid": "mine"}
    async with lane(tmp_path, engine) as (url, _app, _), httpx.AsyncClient(timeout=10) as c:
        first = asyncio.create_task(c.post(url + "/generate", json=body))
        await eventually(lambda: len(engine.arrived) == 1)
        r = await c.post(url + "/generate", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "rid_in_flight", r.text
        twice = await c.post(url + "/generate", json={"text": ["a", "b"], "rid": ["x", "x"]})
        assert twice.status_code == 400 and twice.json()["error"]["code"] == "rid_in_flight"
        engine.gate_headers.set()
        engine.release.set()
        assert (await first).status_code == 200
        again = await c.post(url + "/generate", json={**body, "stream": False})
        assert again.status_code == 200
    async with (
        lane(tmp_path, FakeEngine(), gateway_fields__rid="pass") as (url, _app, _),
        httpx.AsyncClient(timeout=10) as c,
    ):
        assert (
            await c.post(url + "/generate", json={"text": ["a", "b"], "rid": ["x", "x"]})
        ).status_code == 200


# --- 4. GPU sources fail closed ------------------------------------------------------------------


async def test_a_gpu_missing_from_a_file_reading_is_a_failed_read(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    two = [
        {"uuid": "GPU-a", "free_bytes": 193 << 20, "total_bytes": 80 << 30},
        {"uuid": "GPU-b", "free_bytes": 60 << 30, "total_bytes": 80 << 30},
    ]
    path.write_text(json.dumps({"devices": two}))
    source = FileSource(path)
    first = await source.read(1.0)
    assert first.free_bytes == 193 << 20
    path.write_text(json.dumps({"devices": two[1:]}))
    with pytest.raises(GpuSourceError, match="GPU-a missing"):
        await source.read(2.0)
    path.write_text(json.dumps({"free_bytes": 60 << 30, "total_bytes": 80 << 30}))
    with pytest.raises(GpuSourceError, match="missing"):
        await source.read(3.0)
    path.write_text(json.dumps({"devices": two}))
    assert (await source.read(4.0)).free_bytes == 193 << 20


def _dcgm_page(*gpus: tuple[str, int]) -> str:
    lines = ["# TYPE DCGM_FI_DEV_FB_FREE gauge", "# TYPE DCGM_FI_DEV_FB_USED gauge"]
    for i, (uuid, free_mib) in enumerate(gpus):
        lines.append(f'DCGM_FI_DEV_FB_FREE{{gpu="{i}",UUID="{uuid}"}} {free_mib}')
        lines.append(f'DCGM_FI_DEV_FB_USED{{gpu="{i}",UUID="{uuid}"}} {80_000 - free_mib}')
    return "\n".join(lines) + "\n"


async def test_a_gpu_missing_from_a_dcgm_reading_without_uuids_is_a_failed_read() -> None:
    pages = [_dcgm_page(("GPU-a", 193), ("GPU-b", 60_000)), _dcgm_page(("GPU-b", 60_000))]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=pages.pop(0) if len(pages) > 1 else pages[0])

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    source = parse_gpu_source("dcgm:http://127.0.0.1:9400/metrics", http_client=client)
    assert (await source.read(1.0)).free_bytes == 193 * 2**20
    with pytest.raises(GpuSourceError, match="GPU-a missing"):
        await source.read(2.0)
    await client.aclose()
    assert [d.ident for d in parse_dcgm(_dcgm_page(("GPU-b", 1)))] == ["GPU-b"]
    assert isinstance(DeviceMemory("x", 1, 2), DeviceMemory)


async def test_the_gate_holds_when_a_gpu_drops_out_of_the_file(tmp_path: Path) -> None:
    """The probe: a 30K-token prompt held at 193 MB of headroom was admitted once one of two cards
    vanished from the file. Now the reading fails and the gate stays shut."""
    engine = FakeEngine()
    gen_big = {"text": "x", "stream": False, "emulator": {"prompt_tokens": 30_000}}
    tight = {"cost__context_bytes_per_token": "20KiB", "hold__max_held": 0}
    async with lane(tmp_path, engine, free_mib=193, **tight) as (url, app, gpu_file):
        two = [
            {"uuid": "GPU-a", "free_bytes": 193 << 20, "total_bytes": 80 << 30},
            {"uuid": "GPU-b", "free_bytes": 60 << 30, "total_bytes": 80 << 30},
        ]
        # The harness starts the lane with a one-device file: give it two, then start the count again.
        gpu_file.write_text(json.dumps({"devices": two}))
        fixed = app.gpu_poller.source.fixed

        def two_fixed() -> bool:
            # A poll in flight may still fix the old file's device: start the count again until not.
            if fixed.expected != ("GPU-a", "GPU-b"):
                fixed.expected = None
                return False
            return True

        await eventually(two_fixed)
        await eventually(
            lambda: app.admission.snapshot.gpu is not None and len(app.admission.snapshot.gpu.devices) == 2
        )
        async with httpx.AsyncClient(timeout=10) as c:
            assert (await c.post(url + "/generate", json=gen_big)).headers["x-admission-decision"] == "reject"
            gpu_file.write_text(json.dumps({"devices": two[1:]}))
            await eventually(lambda: "GPU-a missing" in (app.admission.snapshot.gpu_health.last_error or ""))
            r = await c.post(url + "/generate", json=gen_big)
            assert r.headers["x-admission-decision"] == "reject", r.text
            state = (await c.get(url.admin + "/admission/state")).json()
            assert "GPU-a missing" in json.dumps(state)
    assert engine.arrived == []


# --- 6. connection limits that hold before the descriptors are gone ------------------------------


def test_the_connection_cap_fits_the_descriptor_limit() -> None:
    limits = ServingLimits(max_client_connections=2048)
    assert fit_to_descriptors(limits, soft=8192).max_client_connections == 2048
    assert fit_to_descriptors(limits, soft=256).max_client_connections == (256 - 128) // 2
    assert fit_to_descriptors(limits, admin=True).max_client_connections == 64


def test_a_burst_beyond_the_cap_is_answered_while_descriptors_are_spare() -> None:
    """Turned away (503) while the cap leaves descriptors spare; only beyond them closed unanswered."""
    limits = ServingLimits(max_client_connections=2048)
    assert fit_to_descriptors(limits, soft=8192).turn_away_max == 8192 - 128 - 2 * 2048
    assert fit_to_descriptors(limits, soft=256).turn_away_max == limits.turn_away_max == 16


SILENT_CLIENTS = textwrap.dedent(
    """
    import asyncio, json, os, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    from sidecar.http.server import ServingLimits, serve_app

    failures = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(failures).encode()})

    async def poller():  # what the GPU poller does: open a file, every few milliseconds
        while True:
            try:
                os.close(os.open(sys.executable, os.O_RDONLY))
            except OSError as e:
                failures.append(str(e))
            await asyncio.sleep(0.002)

    async def main():
        asyncio.get_running_loop().create_task(poller())
        async with serve_app(app, limits=ServingLimits(header_timeout_s=30), lifespan="off") as url:
            print(url, flush=True)
            await asyncio.sleep(120)

    asyncio.run(main())
    """
)


async def test_silent_connections_leave_descriptors_for_the_pollers(tmp_path: Path) -> None:
    """The probe: under nofile=256, 300 silent connections caused ~10 s of resets and the GPU poller
    logged `Too many open files`. The cap is fitted below the limit and enforced at connect time."""
    script = tmp_path / "serve.py"
    script.write_text(SILENT_CLIENTS)
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
    )
    try:
        assert proc.stdout is not None
        url = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
        host, port = url.removeprefix("http://").split(":")
        held = []
        for _ in range(300):
            try:
                # Bounded: a server that stopped accepting leaves a connect waiting in the backlog.
                held.append(await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5))
            except (OSError, TimeoutError):
                break
        await asyncio.sleep(0.5)  # let the poller try while they sit (a window, not a synchronisation)
        for _, w in held:
            w.close()
        async with httpx.AsyncClient(timeout=10) as c:

            async def answers() -> bool:
                try:
                    return (await c.get(url + "/")).status_code == 200
                except httpx.HTTPError:
                    return False

            await eventually(answers)
            failures = (await c.get(url + "/")).json()
        assert failures == [], failures[:3]
    finally:
        proc.kill()
        await proc.wait()


# --- 7. every refusal of a policy counted and visible ---------------------------------------------


@pytest.mark.parametrize("bad", ["written: 2026-02-30\n", "hold:\n  max_held: 1" + "0" * 5000 + "\n"])
def test_every_refused_policy_is_counted_and_recorded(tmp_path: Path, bad: str) -> None:
    good = small_policy()
    path = tmp_path / "p.yaml"
    data = json.loads(good.policy.model_dump_json())
    text = yaml.safe_dump(data, sort_keys=False)
    path.write_text(text)
    attempts: list[bool] = []
    source = PolicySource(str(path), lambda loaded: None, lambda: good, attempts.append)
    path.write_text(
        text + bad if bad.startswith("written") else re.sub(r"\nhold:\n(  .*\n)*", "\n" + bad, text)
    )
    record = source.reload_file()
    assert record.result == "refused" and attempts == [False]
    assert source.last_failure is record
    assert re.search(rf"{re.escape(str(path))}:\d+:\d+: .* cannot be read", record.error or ""), record.error


async def test_a_policy_refused_by_any_exception_is_counted(tmp_path: Path) -> None:
    """Whatever raises while a policy is applied is a refusal, not a traceback the alert never sees."""
    good = small_policy()
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(json.loads(good.policy.model_dump_json())))

    def apply(loaded: Any) -> None:
        raise RuntimeError("boom")

    attempts: list[bool] = []
    source = PolicySource(str(path), apply, lambda: good, attempts.append)
    assert source.reload_file().result == "refused" and attempts == [False]
    assert "RuntimeError: boom" in (source.last_failure.error or "")  # type: ignore[union-attr]


async def test_an_unreadable_upload_is_refused_with_its_line_not_a_500(tmp_path: Path) -> None:
    engine = FakeEngine()
    text = yaml.safe_dump(json.loads(small_policy().policy.model_dump_json()))
    async with (
        lane(tmp_path, engine, app_kwargs={"admin_token": TOKEN}) as (url, app, _),
        httpx.AsyncClient(timeout=10) as c,
    ):
        for bad in (
            text + "written: 2026-02-30\n",
            text.replace("max_held: 10", "max_held: 1" + "0" * 5000),
        ):
            r = await c.post(url.admin + "/admission/policy", content=bad, headers=AUTH)
            assert r.status_code == 422, r.text
            assert re.search(r"POST /admission/policy>:\d+:\d+: .* cannot be read", r.json()["problems"][0])
        refused = app.registry.get_sample_value("sglang_sidecar_policy_reloads_total", {"result": "refused"})
        assert refused == 2
        state = (await c.get(url.admin + "/admission/state")).json()
        assert "cannot be read" in json.dumps(state)


# --- 8, 9. no 500 for client input ---------------------------------------------------------------

BIG = "9" * 400


async def test_four_hundred_digit_integers_answer_400_naming_the_field(tmp_path: Path) -> None:
    engine = FakeEngine()
    cases = [
        (
            "/generate",
            f'{{"text": "x", "sampling_params": {{"max_new_tokens": {BIG}}}}}',
            "sampling_params.max_new_tokens",
        ),
        ("/generate", f'{{"text": "x", "sampling_params": {{"n": {BIG}}}}}', "sampling_params.n"),
        ("/generate", f'{{"text": "x", "priority": {BIG}}}', "priority"),
        ("/generate", f'{{"text": "x", "priority": -{BIG}}}', "priority"),
        ("/v1/completions", f'{{"prompt": "x", "max_tokens": {BIG}}}', "max_tokens"),
        ("/v1/completions", f'{{"prompt": "x", "best_of": {BIG}}}', "best_of"),
        ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "x"}}], "n": {BIG}}}', "n"),
        ("/admission/explain", f'{{"prompt_tokens": {BIG}}}', "prompt_tokens"),
    ]
    async with lane(tmp_path, engine) as (url, app, _), httpx.AsyncClient(timeout=10) as c:
        for path, body, field in cases:
            base = url.admin if path.startswith("/admission") else url
            r = await c.post(base + path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, field, r.status_code, r.text[:200])
            assert (
                f'"{field}"' in r.json()["error"]["message"] and "400 digits" in r.json()["error"]["message"]
            )
        errors = app.registry.get_sample_value("sglang_sidecar_requests_total", {"outcome": "upstream_error"})
        assert not errors
    assert engine.arrived == []


async def _raw(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_many_small_headers_in_one_write_stop_at_the_parser(tmp_path: Path) -> None:
    """9,000 small headers (~100 KiB) in one write reached the engine: the byte count looked only after
    httptools had parsed them all. Now 431 at the 101st header, and nothing reaches the engine."""
    engine = FakeEngine()
    body = b'{"text": "hi", "stream": false}'
    head = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        % len(body)
    )
    async with lane(tmp_path, engine) as (url, _app, _):
        many = head + b"".join(b"a%d: b\r\n" % i for i in range(9000)) + b"\r\n" + body
        answer = await _raw(url, many)
        assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
        assert b"more than 100 request header fields" in answer
        few = head + b"".join(b"a%d: b\r\n" % i for i in range(90)) + b"connection: close\r\n\r\n" + body
        assert (await _raw(url, few)).startswith(b"HTTP/1.1 200")
    assert len(engine.arrived) == 1
