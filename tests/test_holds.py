"""A held request goes in when a response ends, not at the next engine poll: through a real sidecar in
front of the emulator on loopback, and in replay's figures.

SGLang shows what an ended request held only in its next report (at once when it goes idle), and the
sidecar reads the engine every ``engine.poll_interval_s``; after an admitted request ends while another
is held, the engine and the GPU are read sooner (``engine.poll_after_release_s``, ``Admission.
report_wanted``, ``signals.engine.Sooner``), and ``replay`` times its reads by the same rule.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import openai

from sidecar.app import SidecarApp
from sidecar.core.decision import Reason
from sidecar.http.server import serve_app
from sidecar.signals.gpu import parse_gpu_source
from sidecar_emulator.profiles import get_profile
from sidecar_emulator.replay import Driver
from sidecar_emulator.scenario import Rounds, Scenario
from sidecar_emulator.server import EmulatorServer, build_emulator_app, build_model
from tests.conftest import small_policy
from tests.harness import eventually

SPEED = 4.0
POOL = 60_000  # two 40,000-token requests do not fit the KV pool together


async def test_a_request_held_on_the_kv_pool_goes_in_when_the_running_one_ends_not_at_the_next_poll(
    tmp_path: Path,
) -> None:
    model = build_model(get_profile("maxq-bounded").replace(kv_pool_tokens=POOL), seed=1)
    gpu_file = tmp_path / "gpu.json"
    emu_app = build_emulator_app(model, SPEED, gpu_file)
    policy = small_policy(engine__poll_interval_s=1.0, engine__max_age_s=120, gpu__poll_interval_s=0.05)
    async with contextlib.AsyncExitStack() as stack:
        emu = await stack.enter_async_context(EmulatorServer(emu_app))
        app = SidecarApp(
            upstream=emu.url,
            policy=policy,
            gpu_source=parse_gpu_source(f"file:{gpu_file}"),
            trust_emulator_sizes=True,
        )
        url = await stack.enter_async_context(serve_app(app))
        client = await stack.enter_async_context(
            openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        )

        def complete(tokens: int, max_tokens: int, stream: bool) -> Any:
            return client.completions.create(
                model="m",
                prompt="x",
                max_tokens=max_tokens,
                stream=stream,
                extra_body={"emulator": {"prompt_tokens": tokens}},
            )

        running = await complete(40_000, 8_000, stream=True)
        first = await running.__anext__()  # its prefill is done; it decodes for ~6 s
        assert first.choices
        # A report that shows its KV, then the second request: it waits on the KV pool.
        await eventually(lambda: (app.admission.snapshot.engine.kv_used_tokens or 0) >= 40_000)
        waiting = asyncio.ensure_future(complete(40_000, 16, stream=False))
        await eventually(lambda: app.admission.held == 1)
        held = next(h for h in app.admission._queue.walk())
        assert held.decision is not None and held.decision.reason is Reason.KV_POOL
        # From now on the periodic poll comes only every 10 minutes: past the deadline below.
        app.scraper.interval_s = 600  # type: ignore[union-attr]
        async for _ in running:
            pass
        done = await asyncio.wait_for(waiting, 120)  # a deadline, not a measurement
        assert done.choices and done.usage is not None and done.usage.completion_tokens == 16
        assert app.scraper.sooner is not None and app.scraper.sooner.reads >= 1  # type: ignore[union-attr]
        assert model.crashes == [] and app.admission.ledger.totals.requests == 0


def rounds(count: int) -> Scenario:
    """Rounds of four ~240K requests on the bounded lane (the shipped sustained-rounds, shorter): two
    run at a time, the other two are held on the KV pool until both of those have ended."""
    return Scenario(
        name="rounds",
        profile="maxq-bounded",
        policy="sidecar_emulator/policies/maxq-qwen3next-bounded.yaml",
        seed=5,
        duration_s=900,
        workload=[
            Rounds(
                kind="rounds",
                rounds=count,
                per_round=4,
                prompt_tokens=(230_000, 250_000),
                max_new_tokens=8192,
            )
        ],
    )


def test_replay_admits_held_rounds_as_the_engine_alone_would_and_at_the_poll_without_sooner_reads() -> None:
    from sidecar.policy.schema import load_policy_file
    from tests.conftest import EMULATOR_POLICIES

    sc = rounds(3)
    profile = get_profile("maxq-bounded")
    policy = load_policy_file(EMULATOR_POLICIES / "maxq-qwen3next-bounded.yaml")
    alone = Driver(sc, profile, None, sc.seed).run()
    gated = Driver(sc, profile, policy, sc.seed)
    r = gated.run()
    assert r["crashes"] == [] and r["completed"] == alone["completed"] == 12
    assert r["decisions"].get("hold/kv_pool", 0) > 0  # the gate did hold requests
    # Every held request went in at the instant the engine alone would have started it.
    assert r["span_s"] == alone["span_s"]
    assert r["goodput_tokens_per_s"] == alone["goodput_tokens_per_s"]
    assert all(p.sooner_reads > 0 for p in gated.pollers)
    # Without reads after an end, each round waits for the poll: the run is longer.
    late = Driver(sc, profile, policy.with_section("engine", poll_after_release_s=0), sc.seed)
    rl = late.run()
    assert rl["crashes"] == [] and rl["span_s"] > alone["span_s"]
    assert all(p.sooner_reads == 0 for p in late.pollers)
