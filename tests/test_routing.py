"""Routing signals against the emulator's true state: the fit signal is never above what the engine
can really run now, and the /v1/loads view adds the sidecar's held and in-flight work."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from sidecar.app import SidecarApp
from sidecar.policy.schema import LoadedPolicy, Policy
from sidecar.signals.gpu import parse_gpu_source
from sidecar_emulator.events import Crashed, FirstToken
from sidecar_emulator.profiles import get_profile
from sidecar_emulator.server import EmulatorServer, build_emulator_app, build_model
from tests.conftest import maxq
from tests.harness import FakeEngine, _respond, eventually, gen, lane, serve_both

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"


def runs_without_crash(model, tokens: int) -> bool:  # type: ignore[no-untyped-def]
    """The engine's truth: submitted now, does a prompt of ``tokens`` reach its first token alive?"""
    t = model.now
    model.submit("probe", tokens, max_new_tokens=1, now=t)
    while True:
        t = model.next_event_time() or (t + 1.0)
        for ev in model.advance(t):
            if isinstance(ev, Crashed):
                return False
            if isinstance(ev, FirstToken) and ev.rid == "probe":
                return True


def patient_policy() -> LoadedPolicy:
    """The Max-Q policy with signals that do not go stale while a loaded machine is slow to serve
    the GET: the emulator stands still, so an old reading is the true state; a stale one would make
    the gate (rightly) advertise 0, which is not what this test is about."""
    loaded = maxq()
    p = loaded.policy
    update = {
        "engine": p.engine.model_copy(update={"max_age_s": 600.0}).model_dump(),
        "gpu": p.gpu.model_copy(update={"max_age_s": 600.0}).model_dump(),
    }
    return LoadedPolicy(Policy.model_validate(p.model_dump() | update), loaded.sha256, loaded.path)


async def test_fit_signal_is_never_above_what_the_engine_can_run(tmp_path: Path) -> None:
    gpu_file = tmp_path / "gpu.json"
    fits: list[int] = []
    for busy in (False, True):
        model = build_model(get_profile("maxq-old"), seed=1)
        # The emulator stands still while we read it (speed ~0): the state we measure stays the state.
        async with EmulatorServer(build_emulator_app(model, 1e-6, gpu_file)) as emu:
            app = SidecarApp(
                upstream=emu.url,
                policy=patient_policy(),
                gpu_source=parse_gpu_source(f"file:{gpu_file}"),
                trust_emulator_sizes=True,
            )
            async with serve_both(app) as url, httpx.AsyncClient(timeout=30) as client:
                # Both sources read (a sidecar with no GPU reading yet is blind and advertises 0):
                # wait for the reads themselves, not for time to pass.
                await eventually(
                    lambda app=app: (
                        app.admission.snapshot.engine is not None and app.admission.snapshot.gpu is not None
                    )
                )
                task = None
                if busy:  # a 150K-token prefill admitted through the sidecar, still prefilling
                    body = {"text": "x", "stream": True, "emulator": {"prompt_tokens": 150_000}}
                    task = asyncio.create_task(client.post(url + "/generate", json=body))
                    await eventually(lambda app=app: app.admission.ledger.totals.requests == 1)
                sig = (await client.get(url.admin + "/admission/signals")).json()
                metrics = (await client.get(url.admin + "/metrics")).text
                loads = (await client.get(url.admin + "/admission/loads")).json()["loads"][0]
                fit = sig["fit_prompt_tokens"]
                # The fit the gate advertises, run on the engine as it stands (the 150K prefill in
                # it when busy): no crash.
                assert fit > 0 and runs_without_crash(model, fit), (busy, fit)
                # What the lane could ever run is at least what it can run now (idle: about the same).
                assert sig["capacity_prompt_tokens"] >= fit
                if task is not None:
                    task.cancel()
        fits.append(fit)
        assert f"sglang_sidecar_fit_prompt_tokens {float(fit)}" in metrics
        assert loads["sidecar"]["ledger_requests"] == (1 if busy else 0)
        assert loads["num_waiting_uncached_tokens"] >= (150_000 if busy else 0)
    # A busy lane advertises less room than an idle one, and the idle fit is near the engine's real
    # limit, not a timid constant: a third more than it kills an idle engine.
    assert fits[1] < fits[0]
    assert not runs_without_crash(build_model(get_profile("maxq-old"), seed=1), fits[0] * 4 // 3)


async def test_fit_signal_is_zero_when_nothing_would_be_admitted(tmp_path: Path) -> None:
    async with (
        lane(tmp_path, FakeEngine(), free_mib=0) as (url, _app, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        sig = (await client.get(url.admin + "/admission/signals")).json()
        assert sig["fit_prompt_tokens"] == 0 and sig["held_requests"] == 0
        assert sig["headroom_bytes"] <= 0


def test_fit_bisection_finds_the_edge_within_its_resolution_and_reuses_the_last_answer() -> None:
    """The bisection is only as good as its two promises: never above the edge, at most
    FIT_RESOLUTION_TOKENS below it; and a scrape of an unchanged lane costs two evaluations."""
    from sidecar.ops.router_view import FIT_RESOLUTION_TOKENS, _bisect

    top = 1_000_000
    for edge in (0, 1, 2, 63, 64, 65, 1000, 499_999, 999_998, top):
        for hint in (None, 1, edge, edge + 1, edge - 1, edge + 5000, top - 1, top + 10):
            calls: list[int] = []

            def admits(n: int, edge: int = edge, calls: list[int] = calls) -> bool:
                calls.append(n)
                return n <= edge

            fit = _bisect(admits, top, hint)
            n = len(calls)
            assert fit <= edge and (edge == 0 or fit > edge - FIT_RESOLUTION_TOKENS), (edge, hint, fit)
            assert fit == 0 or admits(fit)
            assert n <= 24, (edge, hint, n)
            if hint == edge and 0 < edge < top - FIT_RESOLUTION_TOKENS:
                assert n == 2 and fit == edge


class LoadsEngine(FakeEngine):
    """A fake engine whose /v1/loads is SGLang 0.5.23's own document (the fixture), with the queue it
    reports emptied: an engine whose snapshot has not caught up with what was just sent to it."""

    def __init__(self) -> None:
        super().__init__()
        doc = json.loads((FIXTURES / "sglang-0.5.23-v1-loads.json").read_text())
        doc["loads"][0] |= {"num_waiting_reqs": 0, "num_waiting_uncached_tokens": 0}
        self.doc = doc
        self.asked: list[tuple[str, str | None]] = []
        self.loads_status = 200

    async def __call__(self, scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "http" and scope["path"] == "/v1/loads":
            query = scope["query_string"].decode()
            self.asked.append((query, dict(scope["headers"]).get(b"authorization", b"").decode() or None))
            if "format=prometheus" in query:
                await _respond(send, 200, PROM_LOADS, b"text/plain; version=0.0.4; charset=utf-8")
            elif self.loads_status != 200:
                await _respond(send, self.loads_status, b'{"detail":"Not Found"}', b"application/json")
            else:
                await _respond(send, 200, json.dumps(self.doc).encode(), b"application/json")
            return
        await super().__call__(scope, receive, send)


PROM_LOADS = b'# TYPE sglang_num_waiting_reqs gauge\nsglang_num_waiting_reqs{dp_rank="0"} 0\n'


async def test_v1_loads_on_the_data_port_adds_the_sidecars_in_flight_work(tmp_path: Path) -> None:
    engine = LoadsEngine()
    engine.gate_headers.clear()  # forwarded requests stay in prefill: in the ledger, not in the engine's view
    async with lane(tmp_path, engine) as (url, app, _), httpx.AsyncClient(timeout=10) as client:
        task = asyncio.create_task(client.post(url + "/generate", json=gen(tokens=5000)))
        await eventually(lambda: app.admission.ledger.totals.requests == 1)
        # What SGLang's model gateway asks, from the worker URL (the sidecar's data port).
        r = await client.get(url + "/v1/loads?include=core", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200
        doc = r.json()
        rank = doc["loads"][0]
        assert rank["num_waiting_reqs"] == 1 and rank["num_waiting_uncached_tokens"] == 5000
        assert doc["sidecar"]["ledger_requests"] == 1 and doc["sidecar"]["added_waiting_reqs"] == 1
        # Everything else the engine said is kept as it said it; the query and the credentials went
        # to the engine.
        want = engine.doc["loads"][0]
        assert {k: v for k, v in rank.items() if not k.startswith("num_waiting")} == {
            k: v for k, v in want.items() if not k.startswith("num_waiting")
        }
        assert {k: doc[k] for k in engine.doc if k != "loads"} == {
            k: v for k, v in engine.doc.items() if k != "loads"
        }
        assert ("include=core", "Bearer k") in engine.asked
        # The fields the gateway parses as non-negative i64 (a float or a null drops the report).
        for key in (
            "dp_rank",
            "num_running_reqs",
            "num_waiting_reqs",
            "num_used_tokens",
            "max_total_num_tokens",
            "max_running_requests",
        ):
            assert type(rank[key]) is int and rank[key] >= 0, key
        # Other formats, and an engine without /v1/loads, are passed on untouched.
        prom = await client.get(url + "/v1/loads?format=prometheus")
        assert prom.status_code == 200 and prom.content == PROM_LOADS
        engine.loads_status = 404
        assert (await client.get(url + "/v1/loads")).status_code == 404
        engine.gate_headers.set()
        engine.release.set()
        await task
        engine.loads_status = 200
        await eventually(lambda: app.admission.ledger.totals.requests == 0)
        rank = (await client.get(url + "/v1/loads")).json()["loads"][0]
        assert rank["num_waiting_reqs"] == 0  # back to the engine's own figure when nothing is in flight
