"""``sglang-sidecar init``: a starting policy read from the lane in front of it, over HTTP.

The emulator serves SGLang's /server_info and /metrics and publishes its device memory for the
``file:`` GPU source; ``init`` runs as a real process against it.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import yaml

from sidecar.policy.schema import load_policy_file
from sidecar_emulator.profiles import get_profile
from sidecar_emulator.replay import run_replay
from sidecar_emulator.scenario import load_scenario
from sidecar_emulator.server import EmulatorServer, build_emulator_app, build_model
from tests.conftest import ROOT
from tests.harness import eventually


async def init(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "sidecar", "init", *args]
    return await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)


async def test_init_reads_the_lane_and_writes_a_policy_check_policy_accepts(tmp_path: Path) -> None:
    profile = get_profile("maxq-old")
    model = build_model(profile, seed=1)
    gpu = tmp_path / "gpu.json"
    out = tmp_path / "lane.yaml"
    async with EmulatorServer(build_emulator_app(model, 1.0, gpu)) as emu:
        await eventually(gpu.exists)
        free = model.free_bytes()  # idle: init reads it before its probe (whose peak the allocator keeps)
        r = await init("--upstream", emu.url, "--gpu-source", f"file:{gpu}", "-o", str(out))
        assert r.returncode == 0, r.stderr
        again = await init("--upstream", emu.url, "--gpu-source", f"file:{gpu}", "-o", str(out))
    assert again.returncode == 2 and "not overwritten" in again.stderr
    check = subprocess.run(
        [sys.executable, "-m", "sidecar", "check-policy", str(out)], capture_output=True, text=True, cwd=ROOT
    )
    assert check.returncode == 0, check.stderr
    p = load_policy_file(out).policy
    # The lane's own figures: the engine's constants and the idle free memory read now.
    assert p.lane.context_len == profile.context_length
    assert p.lane.chunked_prefill_size == profile.chunked_prefill_size
    assert p.lane.kv_pool_tokens == profile.kv_pool_tokens
    assert p.lane.mamba_slots == profile.mamba_slots and p.mamba is not None
    assert p.vram.headroom.value == "idle_budget"
    assert abs(p.vram.idle_free_bytes - free) < (1 << 20)  # written in whole MiB
    # One comment per field: where its figure comes from.
    for line in out.read_text().splitlines():
        if line.startswith("  ") and ":" in line:
            assert "  # " in line, line
    # Conservative: the outage scenario replayed through it does not crash the lane it was read from.
    scenario = load_scenario(ROOT / "scenarios/maxq-outage-burst.yaml")
    gated = run_replay(scenario, gate=True, policy=load_policy_file(out), profile=profile, seed=scenario.seed)
    assert gated["crashes"] == [] and gated["completed"] > 0, gated["crashes"]


async def test_a_busy_engine_gets_auto_and_an_unreachable_one_a_clear_error(tmp_path: Path) -> None:
    model = build_model(get_profile("maxq-old"), seed=1)
    model.submit("a", 150_000, max_new_tokens=32, now=0.0)
    model.submit("b", 90_000, max_new_tokens=32, now=0.0)
    model.advance(4.0)  # a prefill batch or two: one request still waiting, the model stands still
    gpu = tmp_path / "gpu.json"
    async with EmulatorServer(build_emulator_app(model, 1e-9, gpu)) as emu:
        await eventually(gpu.exists)
        r = await init("--upstream", emu.url, "--gpu-source", f"file:{gpu}")
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["vram"]["idle_free_bytes"] == "auto"
    assert "busy" in r.stderr
    down = await init("--upstream", "http://127.0.0.1:9", "--gpu-source", f"file:{gpu}")
    assert (
        down.returncode == 1
        and "engine at http://127.0.0.1:9" in down.stderr
        and "Traceback" not in down.stderr
    )
    bad = await init("--upstream", "http://127.0.0.1:9", "--gpu-source", "cuda")
    assert bad.returncode == 1 and "--gpu-source" in bad.stderr


async def test_init_derives_the_hold_bounds_from_the_lane_it_probes(tmp_path: Path) -> None:
    """Issue 29, the dense lane (70B FP8 on an 80 GB card, a ~33K-token pool, 128K context): another
    lane's assumed bounds (300 s, 128 held) parked requests for minutes. ``init`` times one cold
    chunk-sized prefill and bounds a hold at two pools' worth of prefill at that rate."""
    sys.path.insert(0, str(ROOT / "bench"))
    import admission as bench

    bounds = {}
    for name in (bench.DENSE_H100, "maxq-old"):
        profile = bench.profile_for(name)
        gpu, out = tmp_path / f"{name}.json", tmp_path / f"{name}.yaml"
        async with EmulatorServer(build_emulator_app(build_model(profile, seed=1), 1.0, gpu)) as emu:
            await eventually(gpu.exists)
            r = await init("--upstream", emu.url, "--gpu-source", f"file:{gpu}", "-o", str(out))
        assert r.returncode == 0, r.stderr
        assert "probing the prefill rate" in r.stderr
        hold = load_policy_file(out).policy.hold
        assert "probed: one" in out.read_text()
        bounds[name] = (hold.max_wait_s, hold.max_held, hold.prefill_tokens_per_s, profile.kv_pool_tokens)
    wait, held, rate, pool = bounds[bench.DENSE_H100]
    # Two pools at the probed rate (an under-estimate: the probe's time holds a decode step too).
    assert wait == max(10, -(-2 * pool // rate)) and wait < 60, bounds
    assert held <= 16, bounds
    # The outage lane's 522K-token pool holds more, and longer.
    assert bounds["maxq-old"][0] > wait and bounds["maxq-old"][1] > held, bounds
