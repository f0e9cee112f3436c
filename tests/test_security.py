"""What each port tells and takes (#10 item 10, SECURITY.md): real servers on loopback, real clients.

The data port, which every client reaches, serves the engine's paths and the probes only, names no file
and no engine address, and takes only JSON on gated paths; the admin port answers only Host values that
cannot be a DNS rebinding; ``--allowed-hosts`` narrows both.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from sidecar.http.hosts import HostCheck
from sidecar.ops.admin import ADMIN_PATHS
from sidecar.policy.schema import LoadedPolicy
from tests.conftest import ROOT
from tests.harness import FakeEngine, eventually, gen, lane, write_gpu_file
from tests.test_faults import outcomes

ADMIN_GETS = [
    "/admission/state",
    "/admission/signals",
    "/admission/loads",
    "/metrics",
    "/admission/docs",
    "/admission/openapi.json",
]


async def test_the_data_port_serves_no_admin_path_and_the_admin_port_serves_them_all(tmp_path: Path) -> None:
    engine = FakeEngine()
    async with lane(tmp_path, engine) as (url, _, _), httpx.AsyncClient(timeout=10) as client:
        for path in sorted(ADMIN_PATHS):
            method = "POST" if path in ("/admission/explain", "/admission/policy") else "GET"
            r = await client.request(method, url + path, json={"prompt_tokens": 1})
            # Answered by the sidecar, saying where the path went; never passed to the engine, whose
            # own /metrics would otherwise answer in the sidecar's place.
            assert r.status_code == 404, (path, r.status_code, r.text[:200])
            assert (
                r.json()["error"]["code"] == "admin_path" and "--admin-listen" in r.json()["error"]["message"]
            )
        for path in ADMIN_GETS:
            assert (await client.get(url.admin + path)).status_code == 200, path
        explain = await client.post(url.admin + "/admission/explain", json={"prompt_tokens": 10})
        assert explain.json()["decision"] == "admit"
        metrics = (await client.get(url.admin + "/metrics")).text
        assert "sglang_sidecar_requests_total" in metrics and "sglang:num_running_reqs" not in metrics
        # Both answer the probes; the data port still proxies the engine's own paths.
        for base in (url, url.admin):
            assert (await client.get(base + "/healthz")).status_code == 200
            assert (await client.get(base + "/readyz")).status_code == 200
        assert (await client.get(url + "/v1/models")).status_code == 200
        assert (await client.get(url.admin + "/v1/models")).status_code == 404  # no proxy there
    assert engine.arrived == []


async def test_admin_on_data_port_keeps_the_old_layout_without_paths_or_addresses(tmp_path: Path) -> None:
    async with (
        lane(tmp_path, FakeEngine(), app_kwargs={"admin_on_data_port": True}) as (url, app, gpu_file),
        httpx.AsyncClient(timeout=10) as client,
    ):
        policy_file = tmp_path / "lane.yaml"
        loaded = app.admission.loaded
        app.apply_policy(LoadedPolicy(loaded.policy, loaded.sha256, str(policy_file)))
        public = (await client.get(url + "/admission/state")).json()
        private = (await client.get(url.admin + "/admission/state")).json()
        assert private["policy"]["path"] == str(policy_file) and str(gpu_file) in private["gpu"]["source"]
        assert public["policy"]["path"] is None and public["gpu"]["source"] is None
        assert public["policy"]["name"] == private["policy"]["name"] == "test-lane"
        assert public["gpu"]["free_bytes"] == private["gpu"]["free_bytes"]
        assert (await client.get(url + "/metrics")).status_code == 200


async def test_no_answer_on_the_data_port_names_the_engine_address(tmp_path: Path) -> None:
    down = "127.0.0.1:9"  # discard: nothing listens
    async with (
        lane(tmp_path, FakeEngine(), upstream=f"http://{down}", engine__on_stale="reject") as (url, app, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        passed = await client.get(url + "/v1/models")  # the proxy's own answer for an unreachable engine
        assert passed.status_code == 503 and passed.json()["error"]["code"] == "engine_unavailable"
        await eventually(lambda: app.admission.snapshot.engine_health.consecutive_failures >= 3)
        gated = await client.post(url + "/generate", json=gen())
        ready = await client.get(url + "/readyz")
        assert gated.status_code == 503 and ready.status_code == 503
        for r in (passed, gated, ready):
            assert down not in r.text and ":9" not in r.text, r.text
        assert "engine unreachable" in ready.json()["problems"]
        # The operator's port says where it is.
        assert down in (await client.get(url.admin + "/readyz")).text
        assert down in (await client.get(url.admin + "/admission/state")).json()["engine"]["last_error"]


async def test_gated_paths_take_json_only(tmp_path: Path) -> None:
    engine = FakeEngine()
    body = b'{"text": "x", "stream": false, "emulator": {"prompt_tokens": 10}}'
    refused = [
        {"content-type": "text/plain"},  # <form enctype="text/plain"> / fetch(no-cors) with a string
        {"content-type": "application/x-www-form-urlencoded"},  # a plain <form>, and curl -d
        {"content-type": "multipart/form-data; boundary=x"},
        {},  # fetch() with a Blob body sends none, without a preflight; SGLang would parse it as JSON
    ]
    accepted = [
        {"content-type": "application/json"},
        {"content-type": "Application/JSON; charset=utf-8"},
        {"content-type": "application/vnd.api+json"},
    ]
    async with lane(tmp_path, engine) as (url, app, _), httpx.AsyncClient(timeout=10) as client:
        for headers in refused:
            r = await client.post(url + "/generate", content=body, headers=headers)
            assert r.status_code == 415, (headers, r.status_code)
            err = r.json()["error"]
            assert err["code"] == "unsupported_media_type" and err["type"] == "invalid_request_error"
            assert "application/json" in err["message"] and r.headers["x-request-id"]
        r = await client.post(
            url + "/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"}
        )
        assert r.status_code == 415
        for headers in accepted:
            assert (await client.post(url + "/generate", content=body, headers=headers)).status_code == 200
        # The official client sends JSON, as every SDK does.
        oa = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        await oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        await oa.close()
        # An ungated path is the engine's business: passed through whatever its type.
        echo = await client.post(url + "/echo", content=b"a=1", headers={"content-type": "text/plain"})
        assert echo.status_code == 200
    assert len(engine.arrived) == len(accepted) + 1
    assert outcomes(app) == {"bad_request": len(refused) + 1, "completed": len(accepted) + 1}


class CorsEngine(FakeEngine):
    """SGLang's CORS: ``CORSMiddleware(allow_origins=["*"], allow_credentials=True, ...)`` approves
    every preflight (evidence S23)."""

    def __init__(self) -> None:
        super().__init__()
        self.preflights = 0

    async def __call__(self, scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "http" and scope["method"] == "OPTIONS":
            self.preflights += 1
            origin = dict(scope["headers"]).get(b"origin", b"*")
            headers = [(b"access-control-allow-origin", origin), (b"access-control-allow-methods", b"*")]
            headers += [(b"access-control-allow-headers", b"content-type"), (b"content-length", b"0")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        await super().__call__(scope, receive, send)


async def test_a_cross_site_preflight_to_a_gated_path_is_not_approved(tmp_path: Path) -> None:
    """With SGLang's allow-every-origin CORS relayed, any page could POST JSON (which passes the 415
    rule) and read the answer; the sidecar answers gated paths' preflights itself, approving none."""
    engine = CorsEngine()
    preflight = {
        "origin": "https://evil.example",
        "access-control-request-method": "POST",
        "access-control-request-headers": "content-type",
    }
    async with lane(tmp_path, engine) as (url, _, _), httpx.AsyncClient(timeout=10) as client:
        for path in ("/generate", "/v1/chat/completions", "/generate/"):
            r = await client.options(url + path, headers=preflight)
            assert r.status_code == 204 and "POST" in r.headers["allow"], path
            assert not any(k.lower().startswith("access-control-") for k in r.headers), r.headers
        # Ungated paths are the engine's, CORS included.
        assert (await client.options(url + "/v1/models", headers=preflight)).headers[
            "access-control-allow-origin"
        ] == "https://evil.example"
    assert engine.preflights == 1


async def test_a_rebinding_host_is_refused_on_the_admin_port(tmp_path: Path) -> None:
    async with lane(tmp_path, FakeEngine()) as (url, _, _), httpx.AsyncClient(timeout=10) as client:
        port = url.admin.rsplit(":", 1)[1]
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", "localhost.evil.example"):
            r = await client.get(url.admin + "/admission/state", headers={"host": host})
            assert r.status_code == 421, host
            assert r.json()["error"]["code"] == "host_not_allowed"
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "[::1]", "10.1.2.3:8002", "sidecar.localhost"):
            r = await client.get(url.admin + "/admission/state", headers={"host": host})
            assert r.status_code == 200, host
        # The data port answers any Host unless told otherwise (clients reach it by any name).
        assert (await client.get(url + "/healthz", headers={"host": "lane.example"})).status_code == 200


async def test_allowed_hosts_narrows_both_ports(tmp_path: Path) -> None:
    check = HostCheck.parse("lane.example, .corp.example")
    engine = FakeEngine()
    kwargs = {"host_check": check, "admin_host_check": check}
    async with (
        lane(tmp_path, engine, app_kwargs=kwargs) as (url, _, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        for base in (url, url.admin):
            for host in ("lane.example", "LANE.example:8001", "corp.example", "a.corp.example", "127.0.0.1"):
                assert (await client.get(base + "/healthz", headers={"host": host})).status_code == 200, host
            for host in ("evil.example", "lane.example.evil", "xcorp.example"):
                assert (await client.get(base + "/healthz", headers={"host": host})).status_code == 421, host
        r = await client.post(url + "/generate", json=gen(stream=False), headers={"host": "evil.example"})
        assert r.status_code == 421
    assert engine.arrived == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_serve_runs_both_listeners_from_flags_and_environment(tmp_path: Path) -> None:
    """The real CLI: --admin-listen, SIDECAR_ALLOWED_HOSTS, SIGTERM stopping both; a busy admin port."""
    from tests.harness import serve

    gpu = tmp_path / "gpu.json"
    write_gpu_file(gpu, 1024**3)
    policy = ROOT / "policies" / "h200-generic.yaml"
    data, admin = _free_port(), _free_port()
    env = {**os.environ, "SIDECAR_ALLOWED_HOSTS": "lane.example"}
    async with serve(FakeEngine()) as engine_url:
        base = [sys.executable, "-m", "sidecar", "serve", "--upstream", engine_url, "--policy", str(policy)]
        base += ["--gpu-source", f"file:{gpu}", "--log-level", "warning"]
        proc = subprocess.Popen(
            [*base, "--listen", f"127.0.0.1:{data}", "--admin-listen", f"127.0.0.1:{admin}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            async with httpx.AsyncClient(timeout=5) as client:

                async def up() -> bool:
                    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                    try:
                        return (await client.get(f"http://127.0.0.1:{data}/healthz")).status_code == 200
                    except httpx.TransportError:
                        return False

                await eventually(up, timeout=30)
                metrics = await client.get(f"http://127.0.0.1:{admin}/metrics")
                assert metrics.status_code == 200 and "sglang_sidecar_build_info" in metrics.text
                assert (await client.get(f"http://127.0.0.1:{data}/metrics")).status_code == 404
                lane_host = {"host": "lane.example"}
                assert (
                    await client.get(f"http://127.0.0.1:{data}/healthz", headers=lane_host)
                ).status_code == 200
                evil = {"host": "evil.example"}
                assert (await client.get(f"http://127.0.0.1:{data}/healthz", headers=evil)).status_code == 421
                assert (
                    await client.get(f"http://127.0.0.1:{admin}/metrics", headers=evil)
                ).status_code == 421
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 30)
        assert proc.returncode == 0


async def test_a_taken_admin_port_is_a_start_up_error_naming_the_flag(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """``run_uvicorn`` opens the admin listener first: when it cannot, nothing else starts (and the
    sidecar's own log says so, tests/test_startup.py has the format)."""
    caplog.set_level(logging.ERROR, logger="sidecar")
    from sidecar.app import SidecarApp
    from sidecar.cli import run_uvicorn
    from tests.conftest import small_policy

    app = SidecarApp(upstream="http://127.0.0.1:9", policy=small_policy(), gpu_source=None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc = await asyncio.to_thread(
            run_uvicorn, app, "127.0.0.1", 0, "warning", admin=(app.admin_asgi, "127.0.0.1", port)
        )
    said = [r.getMessage() for r in caplog.records if r.name == "sidecar"]
    assert rc == 3 and f"not started: cannot listen on --admin-listen 127.0.0.1:{port}" in said, said
    assert app.scraper is None  # the data app never started


def test_the_settings_have_flags_and_variables_and_refuse_a_url_as_a_host(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from pydantic import ValidationError

    from sidecar.cli import build_parser
    from sidecar.settings import Settings

    args = build_parser().parse_args(["serve", "--admin-listen", "0.0.0.0:9102", "--admin-on-data-port"])
    assert (args.admin_listen, args.admin_on_data_port) == ("0.0.0.0:9102", True)
    monkeypatch.setenv("SIDECAR_ALLOWED_HOSTS", "lane.example,.corp.example")
    s = Settings(upstream="http://127.0.0.1:1", policy="p.yaml")
    assert (s.admin_host, s.admin_port) == ("127.0.0.1", 8002)  # loopback unless told otherwise
    assert s.host_check() == HostCheck(frozenset({"lane.example", ".corp.example"}))
    monkeypatch.setenv("SIDECAR_ALLOWED_HOSTS", "https://lane.example:8001")
    with pytest.raises(ValidationError, match="without scheme or port"):
        Settings(upstream="http://127.0.0.1:1", policy="p.yaml")
    monkeypatch.delenv("SIDECAR_ALLOWED_HOSTS")
    assert Settings(upstream="http://127.0.0.1:1", policy="p.yaml").host_check() is None
