"""What clients are told, through the official `openai` client against a real sidecar on loopback.

A request that can never fit must make the client give up at once with a usable error (no retry
storm); a transient rejection must still be retried after its Retry-After. Request ids: kept if sent,
generated otherwise, in every gated response and in the decision log.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import MIB, small_policy
from tests.harness import FakeEngine, eventually, gen, lane, write_gpu_file

# small_policy: context 100,000 tokens, 1 KiB per chunk token, 1,000-token chunks. With a 500 KiB
# transient cap, a prompt of 600 tokens (600 KiB) can never run on this lane; 100 tokens (100 KiB) can.
UNFIT_LANE = dict(vram__max_transient_bytes="500KiB")


def rejected(app) -> int:  # type: ignore[no-untyped-def]
    return app.admission.observer.inner._outcomes["rejected"].n  # the counter itself


@asynccontextmanager
async def openai_client(url: str, kind: str, max_retries: int = 2) -> AsyncIterator[Any]:
    """The official client, sync or async, with its default retry policy unless told otherwise."""
    kw: dict[str, Any] = dict(base_url=url + "/v1", api_key="unused", max_retries=max_retries, timeout=20)
    if kind == "async":
        async with openai.AsyncOpenAI(**kw) as client:
            yield client
    else:
        with openai.OpenAI(**kw) as client:
            yield client


async def call(client: openai.OpenAI | openai.AsyncOpenAI, **kw):  # type: ignore[no-untyped-def]
    """One completion through either client; the sync one runs in a thread (the sidecar shares this loop)."""
    if isinstance(client, openai.AsyncOpenAI):
        return await client.completions.create(model="m", **kw)
    return await asyncio.to_thread(client.completions.create, model="m", **kw)


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_longer_than_the_context_is_a_400_the_client_does_not_retry(tmp_path: Path, kind: str) -> None:
    engine = FakeEngine()
    async with lane(tmp_path, engine) as (url, app, _), openai_client(url, kind) as client:
        with pytest.raises(openai.BadRequestError) as info:
            # An exact count (token ids): 1,000 + 100,000 > the 100,000-token context.
            await call(client, prompt=[1] * 1000, max_tokens=100_000)
        e = info.value
        assert e.status_code == 400 and e.code == "unfit_request"
        assert "101,000 tokens" in e.message and "1,000 more than" in e.message
        assert e.response.headers["x-should-retry"] == "false"
        assert "retry-after" not in e.response.headers
        assert engine.arrived == []  # never reached the engine
        assert rejected(app) == 1  # one attempt: the client did not retry


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_larger_than_the_lane_is_a_413_the_client_does_not_retry(tmp_path: Path, kind: str) -> None:
    engine = FakeEngine()
    async with lane(tmp_path, engine, **UNFIT_LANE) as (url, app, _), openai_client(url, kind) as client:
        with pytest.raises(openai.APIStatusError) as info:
            await call(client, prompt=[1] * 600, max_tokens=10)
        e = info.value
        # 413: no router retries it, and SGLang's gateway counts it as a success for its breaker.
        assert e.status_code == 413 and e.code == "unfit_request" and e.type == "invalid_request_error"
        # Which limit, and by how much.
        assert "allocate 600 KiB" in e.message and "100 KiB more than the 500 KiB" in e.message
        assert "max_transient_bytes" in e.message
        h = e.response.headers
        assert h["x-should-retry"] == "false" and "retry-after" not in h
        assert h["x-admission-reason"] == "unfit_request"
        assert engine.arrived == [] and rejected(app) == 1
        # A request this lane can run still goes through.
        ok = await call(client, prompt=[1] * 100, max_tokens=10)
        assert ok is not None and len(engine.arrived) == 1


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("reason", ["queue_full", "hold_timeout"])
async def test_a_transient_rejection_is_retried_after_its_retry_after(
    tmp_path: Path, kind: str, reason: str
) -> None:
    """No room (0 MiB free): queue_full (nothing may be held) or hold_timeout (a short hold). The first
    attempt is rejected with Retry-After: 1; the test then frees the memory; the client's own retry,
    after the advertised second, is admitted."""
    engine = FakeEngine()
    bounds = {"hold__max_held": 0} if reason == "queue_full" else {"hold__max_wait_s": 0.2}
    async with (
        lane(tmp_path, engine, free_mib=0, **bounds) as (url, app, gpu_file),
        openai_client(url, kind, max_retries=5) as client,
        httpx.AsyncClient(timeout=10) as http,
    ):
        task = asyncio.create_task(call(client, prompt=[1] * 100, max_tokens=10))
        await eventually(lambda: rejected(app) >= 1)
        write_gpu_file(gpu_file, 1024 * MIB)
        result = await asyncio.wait_for(task, 30)
        assert result is not None
        assert len(engine.arrived) == 1
        metrics = (await http.get(url.admin + "/metrics")).text
        assert f'decisions_total{{decision="reject",reason="{reason}"}}' in metrics


async def test_retry_after_counts_the_work_ahead(tmp_path: Path) -> None:
    """Retry-After is the prefill tokens ahead (forwarded + held) over the rate, not a constant."""
    engine = FakeEngine(events=1)
    engine.gate_headers.clear()  # admitted requests stay in prefill
    # 4 MiB of room: 4 requests of 1,000 tokens prefill; 2 more are held; the 7th finds the queue full.
    async with (
        lane(tmp_path, engine, free_mib=4, hold__max_held=2, hold__retry_after_max_s=600) as (url, app, _),
        httpx.AsyncClient(timeout=30) as client,
    ):
        tasks = [asyncio.create_task(client.post(url + "/generate", json=gen(rid=str(i)))) for i in range(6)]
        await eventually(lambda: len(engine.arrived) == 4 and app.admission.held == 2)
        r = await client.post(url + "/generate", json=gen(rid="late"))
        assert r.status_code == 429 and r.headers["x-admission-reason"] == "queue_full"
        assert r.json()["error"]["type"] == "admission_rejected"  # the lane is busy, not the request wrong
        # 4,000 forwarded + 2,000 held + its own 1,000, at the policy's 1,000 tokens/s (nothing
        # measured yet): 7 s.
        assert r.headers["retry-after"] == "7" and r.headers["x-should-retry"] == "true"
        engine.gate_headers.set()
        engine.release.set()
        await asyncio.gather(*tasks)


async def test_request_id_is_kept_or_generated_on_every_gated_answer(tmp_path: Path) -> None:
    log = tmp_path / "decisions.jsonl"
    engine = FakeEngine(events=1)
    with log.open("w") as sink:
        async with (
            lane(tmp_path, engine, app_kwargs={"decision_log": sink}, **UNFIT_LANE) as (url, app, _),
            httpx.AsyncClient(timeout=10) as client,
        ):
            engine.release.set()
            sent = await client.post(
                url + "/generate", json=gen(tokens=100), headers={"X-Request-Id": "abc-1"}
            )
            assert sent.status_code == 200 and sent.headers["x-request-id"] == "abc-1"
            fresh = await client.post(url + "/generate", json=gen(tokens=100, rid="body-rid"))
            assert fresh.headers["x-request-id"] == "body-rid"  # SGLang's own rid, when no header
            anon = await client.post(
                url + "/generate", json={"text": "x", "emulator": {"prompt_tokens": 100}}
            )
            generated = anon.headers["x-request-id"]
            assert len(generated) == 32 and generated != "abc-1"
            assert [a.get("rid") for a in engine.arrived] == ["r", "body-rid", None]
            no = await client.post(url + "/generate", json=gen(tokens=600), headers={"X-Request-Id": "abc-2"})
            assert no.status_code == 413 and no.headers["x-request-id"] == "abc-2"
            assert no.json()["admission"]["request_id"] == "abc-2"
            bad = await client.post(
                url + "/generate",
                content=b"{not json",
                headers={"X-Request-Id": "abc-3", "content-type": "application/json"},
            )
            assert bad.status_code == 400 and bad.headers["x-request-id"] == "abc-3"
            body = {"text": "x", "emulator": {"prompt_tokens": 100}}
            smuggled = await client.post(url + "/generate", json=body, headers={"X-Request-Id": "a b"})
            assert len(smuggled.headers["x-request-id"]) == 32  # not an id: replaced
            await eventually(lambda: app.admission.ledger.totals.requests == 0)
    ids = [json.loads(line)["request_id"] for line in log.read_text().splitlines()]
    assert ids[:4] == ["abc-1", "body-rid", generated, "abc-2"]


async def test_readyz_stays_ready_while_requests_are_held(tmp_path: Path) -> None:
    """A router health-checking /readyz must not eject a lane because it is holding requests."""
    engine = FakeEngine()
    async with (
        lane(tmp_path, engine, free_mib=0) as (url, app, gpu_file),
        httpx.AsyncClient(timeout=10) as client,
    ):
        task = asyncio.create_task(client.post(url + "/generate", json=gen(stream=False)))
        await eventually(lambda: app.admission.held == 1)
        r = await client.get(url + "/readyz")
        assert r.status_code == 200, r.text
        write_gpu_file(gpu_file, 1024 * MIB)
        assert (await task).status_code == 200


def test_answers_section_is_validated() -> None:
    # The defaults (docs/routing.md): 413 unfit, 429 busy, 503 only where the lane cannot serve at all.
    d = small_policy().policy.answers
    assert (d.unfit_context.status, d.unfit_lane.status, d.for_reason("hold_timeout").status) == (
        400,
        413,
        429,
    )
    assert d.for_reason("engine_unavailable").status == d.for_reason("draining").status == 503
    p = small_policy(answers__unfit_lane={"status": 503}, answers__reasons={"queue_full": {"status": 503}})
    assert p.policy.answers.unfit_lane.status == 503
    assert p.policy.answers.for_reason("queue_full").status == 503
    assert p.policy.answers.for_reason("hold_timeout").status == 429
    from sidecar.policy.schema import PolicyError

    with pytest.raises(PolicyError, match=r"answers\.reasons\.queue_ful"):
        small_policy(answers__reasons={"queue_ful": {"status": 429}})
    with pytest.raises(PolicyError, match="written by the sidecar"):
        small_policy(answers__transient={"status": 503, "headers": {"Retry-After": "5"}})
    with pytest.raises(PolicyError, match="status"):
        small_policy(answers__transient={"status": 200})


def test_prefill_rate_is_a_ratio_of_sums_not_an_average_of_ratios() -> None:
    from sidecar.core.prefill_rate import PrefillRate

    rate = PrefillRate(keep=1.0)
    assert rate.tokens_per_s is None  # nothing measured: the policy's figure is used
    rate.busy(0.0)
    rate.prefilled(10_000, 10.0)
    rate.prefilled(10_000, 10.0)  # two prefills ending in the same instant: tokens, no time
    assert rate.tokens_per_s == 2000.0
    rate.prefilled(0, 20.0)  # not a measurement (a non-streaming first byte is fed as 0)
    rate.prefilled(5_000, 15.0)
    assert rate.tokens_per_s == 25_000 / 15.0


def test_replay_reports_whether_a_retry_at_retry_after_would_have_got_in() -> None:
    from sidecar.policy.schema import load_policy_file
    from sidecar_emulator.profiles import get_profile
    from sidecar_emulator.replay import run_replay
    from sidecar_emulator.scenario import load_scenario
    from tests.conftest import ROOT

    path = ROOT / "scenarios" / "noisy-neighbour.yaml"
    sc = load_scenario(path)
    policy = load_policy_file(sc.policy_path(path.parent)).with_section("hold", max_held=2, max_wait_s=60)
    r = run_replay(sc, gate=True, policy=policy, profile=get_profile(sc.profile), seed=sc.seed)
    assert r["rejected_by_reason"].get("hold_timeout", 0) == r["retry_after_advertised"] > 0
    assert r["retry_after_let_in"] == r["retry_after_advertised"]
    for rec in r["requests_detail"]:
        assert (rec["retry_probe"] is None) == (rec["retry_after_s"] is None)
