"""``/readyz`` asks the decision (``core.decide.readiness``), with real servers on loopback: a lane
whose gate admits is ready, and the answer says what was asked."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.harness import FakeEngine, eventually, gen, lane

# The GPU file is written once: its reading ages past 0.3 s while the engine's stays fresh.
OLD_GPU = dict(gpu__poll_interval_s=0.05, gpu__max_age_s=0.3)


async def test_a_gpu_reading_the_gate_does_not_read_keeps_the_lane_ready(tmp_path: Path) -> None:
    """Under an idle budget the gate does not read GPU free memory: an old GPU reading neither holds
    requests nor makes the lane unready (a router would otherwise pull a lane that serves)."""
    budget = dict(OLD_GPU, vram__headroom="idle_budget", vram__idle_free_bytes="10GiB")
    async with (
        lane(tmp_path, FakeEngine(events=1), **budget) as (url, app, _),
        httpx.AsyncClient(timeout=10) as c,
    ):
        await eventually(lambda: (app.admission.snapshot.gpu_age(app.clock()) or 0) > 0.35)
        r = await c.post(url + "/generate", json=gen(stream=False))
        assert r.status_code == 200 and r.headers["x-admission-decision"] == "admit"
        ready = await c.get(url + "/readyz")
        assert ready.status_code == 200, ready.text
        asked = ready.json()["asked"]
        assert asked["gpu"]["read_by_the_gate"] is False and asked["gpu"]["age_s"] > 0.3


async def test_an_old_reading_the_gate_reads_makes_the_lane_unready_and_says_which(tmp_path: Path) -> None:
    async with (
        lane(tmp_path, FakeEngine(events=1), **OLD_GPU) as (url, app, _),
        httpx.AsyncClient(timeout=10) as c,
    ):
        await eventually(lambda: (app.admission.snapshot.gpu_age(app.clock()) or 0) > 0.35)
        ready = await c.get(url + "/readyz")
        assert ready.status_code == 503
        body = ready.json()
        assert body["ready"] is False and body["problems"][0].startswith("gpu signals")
        assert body["asked"]["gpu"] | {"age_s": None} == {
            "age_s": None,
            "max_age_s": 0.3,
            "on_stale": "hold",
            "read_by_the_gate": True,
        }
