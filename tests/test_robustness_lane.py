"""Issue 29 over HTTP, against the engine emulator on loopback and the real sidecar (uvicorn):
measured lane facts win over the policy's (and ``check-policy --upstream`` says so before a deploy),
and an engine that restarts with admitted work in it raises the margin, kept in the state file across a
sidecar restart. docs/robustness.md is the reference."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from sidecar.app import SidecarApp
from sidecar.core.decide import headroom_bytes
from sidecar.core.ledger import LedgerTotals
from sidecar.policy.schema import LoadedPolicy, load_policy_text
from sidecar.signals.gpu import parse_gpu_source
from sidecar_emulator.demo import scale_policy
from sidecar_emulator.profiles import get_profile
from sidecar_emulator.server import EmulatorServer, build_emulator_app, build_model
from tests.conftest import MIB, ROOT
from tests.harness import eventually, serve_both

SPEED = 20.0
POLICY = ROOT / "policies" / "maxq-qwen3next-old.yaml"


def policy_text(**vram: object) -> str:
    """The outage lane's policy with its vram section changed (the lane itself, the emulator's maxq-old
    profile, measures 1,372 MiB idle free)."""
    data = yaml.safe_load(POLICY.read_text())
    data["vram"].update(vram)
    return yaml.safe_dump(data)


def loaded(text: str) -> LoadedPolicy:
    return scale_policy(load_policy_text(text, "<test>"), SPEED)


def metric(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    line = f"sglang_sidecar_{name}{{{want}}} " if labels else f"sglang_sidecar_{name} "
    for row in text.splitlines():
        if row.startswith(line):
            return float(row.split()[-1])
    return None


def check_policy(path: Path, upstream: str, gpu_file: Path) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "sidecar", "check-policy", str(path), "--upstream", upstream]
    return subprocess.run(
        [*args, "--gpu-source", f"file:{gpu_file}"], capture_output=True, text=True, env=env, timeout=60
    )


async def test_check_policy_compares_a_policy_with_the_live_lane(tmp_path: Path) -> None:
    model = build_model(get_profile("maxq-old"), seed=0)
    gpu_file = tmp_path / "gpu.json"
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(POLICY.read_text())
    bad.write_text(policy_text(idle_free_bytes="1993MiB"))
    async with EmulatorServer(build_emulator_app(model, 1e-9, gpu_file)) as emu:
        ok = await asyncio.to_thread(check_policy, good, emu.url, gpu_file)
        wrong = await asyncio.to_thread(check_policy, bad, emu.url, gpu_file)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "idle_free_bytes: policy 1,372 MiB, lane 1,372 MiB: agree" in ok.stdout
    assert "context_len: policy 524,288 tokens, lane 524,288 tokens: agree" in ok.stdout
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert (
        "idle_free_bytes: policy 1,993 MiB, lane 1,372 MiB: DISAGREE (the policy claims more than the lane "
        "has; serve uses 1,372 MiB)"
    ) in wrong.stdout


async def test_a_policy_claiming_more_idle_free_memory_than_measured_is_overruled_loudly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 29: behind a policy saying 1,993 MiB on a lane that measures 1,372 MiB, the sidecar kept
    1,977 MiB of headroom silently. Now the measured figure is in force, a warning is logged once, and
    /admission/state and /metrics show both."""
    model = build_model(get_profile("maxq-old"), seed=0)
    gpu_file = tmp_path / "gpu.json"
    async with EmulatorServer(build_emulator_app(model, SPEED, gpu_file)) as emu:
        app = SidecarApp(
            upstream=emu.url,
            policy=loaded(policy_text(idle_free_bytes="1993MiB")),
            gpu_source=parse_gpu_source(f"file:{gpu_file}"),
            trust_emulator_sizes=True,
        )
        with caplog.at_level(logging.WARNING, logger="sidecar.admission.lane_watch"):
            async with serve_both(app) as url, aiohttp.ClientSession() as session:
                await eventually(lambda: app.admission.watch.idle is not None)
                await eventually(lambda: app.admission.rules.vram.idle_free_bytes == 1372 * MIB)
                a = app.admission
                room = headroom_bytes(a.rules, a.snapshot, LedgerTotals())
                assert room == 1372 * MIB - a.rules.vram.reserve_bytes
                state = await (await session.get(url.admin + "/admission/state")).json()
                fact = state["lane_facts"]["idle_free_bytes"]
                assert fact == {
                    "policy": 1993 * MIB,
                    "measured": 1372 * MIB,
                    "in_force": 1372 * MIB,
                    "disagrees": True,
                    "unsafe": True,
                }
                text = await (await session.get(url.admin + "/metrics")).text()
                assert metric(text, "lane_fact", fact="idle_free_bytes", source="policy") == 1993 * MIB
                assert metric(text, "lane_fact", fact="idle_free_bytes", source="measured") == 1372 * MIB
                assert metric(text, "lane_fact_disagreement", fact="idle_free_bytes", unsafe="true") == 1
                # The lane's other facts agree with this policy.
                assert metric(text, "lane_fact_disagreement", fact="context_len", unsafe="false") == 0
                # More readings of the same disagreement: no more warnings.
                polls = a.snapshot.gpu.observed_at  # type: ignore[union-attr]
                await eventually(
                    lambda: a.snapshot.gpu is not None and a.snapshot.gpu.observed_at > polls + 0.05
                )
    warned = [r for r in caplog.records if getattr(r, "fields", {}).get("event") == "lane_fact_disagrees"]
    assert len(warned) == 1 and "idle_free_bytes" in warned[0].getMessage()


def crash_policy(margin: float) -> LoadedPolicy:
    """The outage lane's policy with the cost terms that price the engine's context-sized temporaries
    zeroed: it admits a prompt the lane cannot run, as a policy for an older build would."""
    p = loaded(POLICY.read_text())
    cost = p.policy.cost.model_copy(
        update={"margin": margin, "context_bytes_per_token": 0, "gather_bytes_per_context_token": 0}
    )
    vram = p.policy.vram.model_copy(update={"max_transient_bytes": None})
    # The crash rule is bounded by monitor.max_margin: room for the x14 this prompt draws. The
    # monitor's readings (min_bytes) and the in-flight guard are out of the way: the crash alone teaches.
    monitor = p.policy.monitor.model_copy(update={"max_margin": 30.0, "min_bytes": 64 * 2**30})
    guard = p.policy.guard.model_copy(update={"enabled": False})
    update = {"cost": cost, "vram": vram, "monitor": monitor, "guard": guard}
    return LoadedPolicy(p.policy.model_copy(update=update), p.sha256, p.path)


async def test_a_crash_with_admitted_work_raises_the_margin_and_a_state_file_keeps_it(tmp_path: Path) -> None:
    profile = get_profile("maxq-old").replace(restart_s=5.0)
    model = build_model(profile, seed=1)
    gpu_file, state_file = tmp_path / "gpu.json", tmp_path / "state.json"
    policy = crash_policy(1.0)
    async with EmulatorServer(build_emulator_app(model, SPEED, gpu_file)) as emu:
        app = SidecarApp(
            upstream=emu.url,
            policy=policy,
            gpu_source=parse_gpu_source(f"file:{gpu_file}"),
            trust_emulator_sizes=True,
            state_file=state_file,
        )
        async with serve_both(app) as url, aiohttp.ClientSession() as session:
            a = app.admission
            await eventually(lambda: a.snapshot.engine is not None and a.snapshot.gpu is not None)
            body = {"text": "x", "stream": True, "rid": "too-big", "emulator": {"prompt_tokens": 400_000}}
            async with session.post(url + "/generate", json=body) as resp:
                assert resp.status == 502  # the engine died in its prefill
            await eventually(lambda: a.watch.crashes == 1, timeout=30)
            crash = a.watch.last_crash
            assert crash is not None and crash.admitted.request_ids == ("too-big",)
            # The margin now prices that prompt beyond the budget it was admitted into.
            assert a.rules.cost.margin > 1.0 and crash.margin_after == a.rules.cost.margin
            terms = crash.admitted.projected_bytes / crash.admitted.margin
            assert crash.admitted.budget_bytes is not None
            assert terms * a.rules.cost.margin > crash.admitted.budget_bytes
            text = await (await session.get(url.admin + "/metrics")).text()
            assert metric(text, "engine_crashes_total") == 1
            state = await (await session.get(url.admin + "/admission/state")).json()
            assert state["crashes"]["count"] == 1 and state["crashes"]["last"]["request_ids"] == ["too-big"]
            # The same request again is not admitted into the restarted engine.
            await eventually(lambda: a.snapshot.engine_health.consecutive_failures == 0, timeout=30)
            async with session.post(url + "/generate", json=body | {"rid": "again"}) as resp:
                # unfit for the lane now: 413 by default (answers.unfit_lane), no Retry-After
                assert resp.status == 413 and resp.headers["x-admission-reason"] == "unfit_request"
            learned_margin = a.rules.cost.margin
        saved = json.loads(state_file.read_text())
        assert saved["margin"] == pytest.approx(learned_margin) and saved["crashes"] == 1

        # A sidecar restart with the same state file starts from what was learned.
        again = SidecarApp(
            upstream=emu.url,
            policy=crash_policy(1.0),
            gpu_source=parse_gpu_source(f"file:{gpu_file}"),
            trust_emulator_sizes=True,
            state_file=state_file,
        )
        assert again.admission.rules.cost.margin == pytest.approx(learned_margin)
        # Without it, the policy's own margin.
        fresh = SidecarApp(upstream=emu.url, policy=crash_policy(1.0), gpu_source=None)
        assert fresh.admission.rules.cost.margin == 1.0


async def test_a_sidecar_restarted_while_the_engine_restarts_reads_the_crash_when_it_is_back(
    tmp_path: Path,
) -> None:
    """Issue 29 item 2, end to end: the engine dies in an admitted prefill and the sidecar restarts
    before it is back (a big model loads for minutes). The set admitted when the engine was seen
    failing is in the state file; the restarted sidecar reads it when the new process answers: the
    margin rises, and the same request is not let into the restarted engine."""
    profile = get_profile("maxq-old").replace(restart_s=1e6)  # down until the test brings it back
    model = build_model(profile, seed=1)
    gpu_file, state_file = tmp_path / "gpu.json", tmp_path / "state.json"

    def sidecar() -> SidecarApp:
        return SidecarApp(
            upstream=emu.url,
            policy=crash_policy(1.0),
            gpu_source=parse_gpu_source(f"file:{gpu_file}"),
            trust_emulator_sizes=True,
            state_file=state_file,
        )

    body = {"text": "x", "stream": True, "rid": "too-big", "emulator": {"prompt_tokens": 400_000}}
    async with EmulatorServer(build_emulator_app(model, SPEED, gpu_file)) as emu:
        first = sidecar()
        async with serve_both(first) as url, aiohttp.ClientSession() as session:
            a = first.admission
            await eventually(lambda: a.snapshot.engine is not None and a.snapshot.gpu is not None)
            async with session.post(url + "/generate", json=body) as resp:
                assert resp.status == 502  # the engine died in its prefill
        assert not model.up and first.admission.watch.crashes == 0
        saved = json.loads(state_file.read_text())
        assert saved["at_risk"]["request_ids"] == ["too-big"] and saved["crashes"] == 0

        again = sidecar()  # restarted while the engine is down
        async with serve_both(again) as url, aiohttp.ClientSession() as session:
            b = again.admission
            await eventually(lambda: b.snapshot.engine_health.consecutive_failures > 0)
            assert b.watch.crashes == 0
            model._down_until = model.now  # the engine's restart ends now (the emulator's next tick)
            await eventually(lambda: b.watch.crashes == 1, timeout=30)
            crash = b.watch.last_crash
            assert crash is not None and crash.admitted.request_ids == ("too-big",)
            assert crash.why.startswith("failing when the sidecar restarted; scheduler pid")
            assert crash.admitted.budget_bytes is not None and b.rules.cost.margin > 1.0
            terms = crash.admitted.projected_bytes / crash.admitted.margin
            assert terms * b.rules.cost.margin > crash.admitted.budget_bytes
            await eventually(lambda: b.snapshot.engine_health.consecutive_failures == 0, timeout=30)
            async with session.post(url + "/generate", json=body | {"rid": "again"}) as resp:
                assert resp.status == 413 and resp.headers["x-admission-reason"] == "unfit_request"
        saved = json.loads(state_file.read_text())
        assert saved["crashes"] == 1 and {"at_risk", "pending_restart"}.isdisjoint(saved)


async def test_a_planned_upgrade_is_ridden_through_and_the_new_build_is_priced_conservatively(
    tmp_path: Path,
) -> None:
    """The engine restarts onto a new build (the emulator's planned upgrade; its ``/server_info``
    ``version`` changes as SGLang's does, evidence RB1). Under ``engine.on_stale: hold`` a request
    that arrives while it is down is held and served when it is back; the restart is no crash; the
    new process's idle figure is measured before anything is let in; the new build is conservative."""
    profile = get_profile("maxq-old").replace(upgrade_at_s=40.0, upgrade_down_s=60.0)  # 2 s, then 3 s wall
    model = build_model(profile, seed=1)
    gpu_file = tmp_path / "gpu.json"
    async with EmulatorServer(build_emulator_app(model, SPEED, gpu_file)) as emu:
        app = SidecarApp(
            upstream=emu.url,
            policy=loaded(POLICY.read_text()),
            gpu_source=parse_gpu_source(f"file:{gpu_file}"),
            trust_emulator_sizes=True,
        )
        async with serve_both(app) as url, aiohttp.ClientSession() as session:
            a = app.admission
            await eventually(lambda: a.watch.build == "0.5.23" and a.watch.idle is not None)
            limit = a.rules.engine.unavailable_after_failures
            await eventually(lambda: a.snapshot.engine_health.consecutive_failures >= limit, timeout=30)
            body = {
                "text": "x",
                "stream": False,
                "sampling_params": {"max_new_tokens": 4},
                "emulator": {"prompt_tokens": 2000},
            }
            sent = asyncio.ensure_future(session.post(url + "/generate", json=body))
            await eventually(lambda: a.held == 1)  # held, not 503: the engine is restarting
            resp = await asyncio.wait_for(sent, 30)
            assert resp.status == 200, await resp.text()
            assert resp.headers["x-admission-decision"] == "admit"
            info = await (await session.get(emu.url + "/server_info")).json()
            assert info["version"] == "0.5.24"
            state = await (await session.get(url.admin + "/admission/state")).json()
    assert state["engine_build"]["version"] == "0.5.24" and state["engine_build"]["conservative"]
    assert state["crashes"]["count"] == 0
    # The new process's idle figure, measured before the held request was let in.
    assert state["idle_free"]["engine_restarts"] == 1 and state["idle_free"]["after_traffic"] is False


async def test_a_sidecar_restarted_before_a_new_build_is_confirmed_stays_conservative(tmp_path: Path) -> None:
    """Issue 29 item 2, end to end: the engine is upgraded under a sidecar with a state file, and the
    sidecar restarts before any reading confirmed the new build. The restarted one prices the lane as
    unconfirmed from its first request (the old build's margin is no evidence about the new one) and
    says since when; a small request, which cannot show the change, confirms nothing."""
    profile = get_profile("maxq-old").replace(upgrade_at_s=40.0, upgrade_down_s=60.0)  # 2 s, then 3 s wall
    model = build_model(profile, seed=1)
    gpu_file, state_file = tmp_path / "gpu.json", tmp_path / "state.json"

    def sidecar() -> SidecarApp:
        return SidecarApp(
            upstream=emu.url,
            policy=loaded(POLICY.read_text()),
            gpu_source=parse_gpu_source(f"file:{gpu_file}"),
            trust_emulator_sizes=True,
            state_file=state_file,
        )

    async with EmulatorServer(build_emulator_app(model, SPEED, gpu_file)) as emu:
        first = sidecar()
        async with serve_both(first):
            await eventually(lambda: first.admission.watch.build == "0.5.23")
            await eventually(lambda: first.admission.watch.conservative is not None, timeout=30)
            conservative_margin = first.admission.rules.cost.margin
        saved = json.loads(state_file.read_text())
        assert saved["engine_build"] == "0.5.24" and saved["conservative"] == "engine build 0.5.23 -> 0.5.24"
        assert saved["margin_in_force"] == pytest.approx(conservative_margin)

        again = sidecar()  # restarted; the engine runs on, 0.5.24
        policy_margin = again.admission.watch.own.cost.margin
        assert conservative_margin == pytest.approx(policy_margin * 1.25)
        assert again.admission.rules.cost.margin == pytest.approx(conservative_margin)
        async with serve_both(again) as url, aiohttp.ClientSession() as session:
            a = again.admission
            await eventually(lambda: a.snapshot.engine is not None and a.watch.idle is not None, timeout=30)
            body = {
                "text": "x",
                "sampling_params": {"max_new_tokens": 4},
                "emulator": {"prompt_tokens": 2000},
            }
            async with session.post(url + "/generate", json=body) as resp:
                assert resp.status == 200, await resp.text()
            state = await (await session.get(url.admin + "/admission/state")).json()
    build = state["engine_build"]
    assert build["version"] == "0.5.24" and build["conservative"], build
    assert build["margin_in_force"] == pytest.approx(conservative_margin, abs=1e-4)
    assert build["since"] is not None and build["since_age_s"] >= 0
    assert state["crashes"]["count"] == 0
