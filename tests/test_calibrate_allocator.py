"""calibrate on PyTorch's default caching allocator (issue 29 item 10; docs/evidence.md RC1-RC4).

With the default allocator a chunked prefill's freed blocks cannot serve the next chunk's larger
transients, so the memory the card shows adds up chunk after chunk; an out-of-memory retry releases
the free blocks, so only the live set decides a crash. The modeled device reproduces that
(``allocator_segments``, the H100's 2,472 MiB mark at 114,688 tokens), and calibrate reads a
multi-chunk probe as its last chunk over its cached prefix once the engine emptied its allocator
cache while idle (SGLang ``--sleep-on-idle`` with ``SGLANG_EMPTY_CACHE_INTERVAL``). Pure: the engine
model in virtual time, and the emulator's HTTP server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from sidecar.calibrate.fit import Bounds, Coefficients, Fit, Probe, ProbeRun, fit, plan_probes, run_probes
from sidecar.cli import main
from sidecar.policy.schema import load_policy_file
from sidecar_emulator.engine import EngineModel
from sidecar_emulator.probe_lane import ModelLane, true_coefficients
from sidecar_emulator.profiles import MiB, get_profile
from sidecar_emulator.server import EmulatorServer, build_emulator_app
from tests.harness import eventually

ROOT = Path(__file__).resolve().parent.parent
BOUNDED = get_profile("maxq-bounded").replace(allocator_segments=True)  # PyTorch's default allocator
START = Coefficients.of(load_policy_file(ROOT / "policies/maxq-qwen3next-bounded.yaml").policy.cost)


def run_prefill(model: EngineModel, rid: str, tokens: int) -> None:
    model.submit(rid, tokens, max_new_tokens=1, now=model.now)
    while model.in_flight:
        model.advance(model.next_event_time() or model.now)


def calibrate(flushes: bool, interval_s: float) -> tuple[ModelLane, ProbeRun, Fit]:
    lane = ModelLane(EngineModel(BOUNDED, 0), flushes=flushes, empty_cache_interval_s=interval_s)
    probes = plan_probes(BOUNDED.chunked_prefill_size, BOUNDED.context_length)
    run = asyncio.run(run_probes(lane, lane, probes, START, Bounds(reserve_bytes=2 * MiB)))
    result = fit(run)
    assert isinstance(result, Fit) and not lane.model.crashes
    return lane, run, result


def projection_over_true(result: Fit, upto: int) -> tuple[float, float]:
    """(lowest, highest) of the proposal's projection (margin included) over the true peak, from one
    chunk on (below it the allocator's 2 MiB blocks are most of a probe, and the reserve covers them)."""
    chunk, truth = BOUNDED.chunked_prefill_size, true_coefficients(BOUNDED)
    ratios = [
        result.coefficients.probe_peak(Probe("p", n), chunk)
        * result.margin
        / truth.probe_peak(Probe("p", n), chunk)
        for n in range(chunk, upto + 1, chunk // 2)
    ]
    return min(ratios), max(ratios)


def test_the_default_allocators_marks_add_up_over_chunks_and_an_oom_retry_releases_them() -> None:
    model = EngineModel(BOUNDED, 0)
    run_prefill(model, "p", 114_688)
    held = BOUNDED.idle_free_bytes - model.free_bytes()
    live = true_coefficients(BOUNDED).probe_peak(Probe("p", 114_688), BOUNDED.chunked_prefill_size)
    # The H100 run of 2026-12-06 (bench/results/2026-12-06-h100-run4.log): 2,472 MiB at 114,688 tokens.
    assert held == pytest.approx(2_472 * MiB, rel=0.05) and held > 5 * live
    assert model.empty_allocator_cache(model.now) and model.free_bytes() == BOUNDED.idle_free_bytes
    # 516,096 tokens add up to ~40 GiB of blocks on a 3.2 GiB headroom; the live peak (1.5 GiB) fits.
    run_prefill(model, "long", 516_096)
    assert not model.crashes
    assert model.flush_cache(model.now) and model.free_bytes() == BOUNDED.idle_free_bytes


def test_last_chunk_readings_make_the_fit_tight_on_the_default_allocator() -> None:
    _lane, run, result = calibrate(flushes=True, interval_s=1.0)
    assert result.largest_prompt_tokens == 516_096 and result.margin <= 1.06
    low, high = projection_over_true(result, BOUNDED.context_length - 64)
    assert low >= 1.0 and high <= 1.1
    cached = [o for o in run.observations if o.probe.prompt_tokens > BOUNDED.chunked_prefill_size]
    assert cached and all(o.probe.cached_tokens for o in cached if o.probe.concurrent == 1)
    assert any("last chunk" in n for n in result.notes)


def test_without_idle_emptying_it_says_so_and_stays_above_the_need() -> None:
    _lane, _run, result = calibrate(flushes=True, interval_s=0.0)
    assert any("did not empty its allocator cache" in n for n in result.notes)
    low, _high = projection_over_true(result, result.largest_prompt_tokens)
    assert low >= 1.0  # the high-water marks are an upper bound: never under the need


def test_without_flushing_the_marks_add_up_across_probes_as_on_the_h100() -> None:
    _lane, run, result = calibrate(flushes=False, interval_s=0.0)
    groups = [o for o in run.observations if o.probe.concurrent > 1]
    # H100 (run4): the groups came after a 2,472 MiB mark and only bounded the join by it.
    assert groups and all(o.censored for o in groups)
    assert result.coefficients.batch_join_bytes == pytest.approx(2_472 * MiB, rel=0.05)


def _gpu_free(path: Path) -> int:
    return int(json.loads(path.read_text())["free_bytes"])


async def test_the_emulator_flushes_and_empties_its_cache_while_idle_and_hits_token_id_prefixes(
    tmp_path: Path,
) -> None:
    gpu = tmp_path / "gpu.json"
    model = EngineModel(BOUNDED, 0)
    app = build_emulator_app(model, 50.0, gpu, empty_cache_interval_s=0.05, idle_poll_s=0.05)
    ids = list(range(1000, 1000 + 40_960))
    async with EmulatorServer(app) as emu, httpx.AsyncClient(base_url=emu.url, timeout=30) as client:
        first = await client.post(
            "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
        )
        assert first.status_code == 200 and first.json()["meta_info"]["cached_tokens"] == 0
        await eventually(lambda: _gpu_free(gpu) == BOUNDED.idle_free_bytes)  # emptied while idle
        body = {"input_ids": [*ids, *range(7, 7 + 4096)], "sampling_params": {"max_new_tokens": 1}}
        second = await client.post("/generate", json=body)
        assert second.json()["meta_info"]["cached_tokens"] == len(ids)  # the radix cache over token ids
        flushed = await client.post("/flush_cache")
        assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
        assert _gpu_free(gpu) == BOUNDED.idle_free_bytes
        third = await client.post("/generate", json=body)
        assert third.json()["meta_info"]["cached_tokens"] == 0  # the flush reset the radix cache


async def test_the_calibrate_command_reads_last_chunks_over_http(tmp_path: Path) -> None:
    """The real command against the emulator with a default allocator that empties its cache while idle."""
    profile = get_profile("h200").replace(allocator_segments=True)
    gpu, out, js = tmp_path / "gpu.json", tmp_path / "proposed.yaml", tmp_path / "run.json"
    app = build_emulator_app(
        EngineModel(profile, 0), 50.0, gpu, empty_cache_interval_s=0.05, idle_poll_s=0.05
    )
    async with EmulatorServer(app) as emu:
        argv = ["calibrate", "--upstream", emu.url, "--gpu-source", f"file:{gpu}"]
        argv += ["--policy", str(ROOT / "sidecar_emulator/policies/h200-generic.yaml"), "--out", str(out)]
        argv += ["--max-prompt-tokens", "32768", "--json", str(js), "--quiet"]
        rc = await asyncio.to_thread(main, argv)
    assert rc == 0
    obs = json.loads(js.read_text())["observations"]
    multi = [o for o in obs if o["concurrent"] == 1 and o["prompt_tokens"] > profile.chunked_prefill_size]
    assert multi and all(o["kind"] == "cached" and not o["censored"] for o in multi)
    cost = load_policy_file(out).policy.cost
    truth = true_coefficients(profile)
    assert cost.activation_bytes_per_chunk_token == pytest.approx(
        truth.activation_bytes_per_chunk_token, rel=0.05
    )
