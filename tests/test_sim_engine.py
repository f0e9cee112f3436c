"""The engine model reproduces the incident figures of docs/evidence.md, deterministically, in virtual time."""

from __future__ import annotations

import importlib.util
import itertools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar_emulator.device import ModeledDevice, static_blocks
from sidecar_emulator.engine import MAMBA_CRASH, EngineModel
from sidecar_emulator.events import (
    Crashed,
    Event,
    Failed,
    Finished,
    FirstToken,
    Restarted,
    Retracted,
    Tokens,
)
from sidecar_emulator.profiles import (
    MAXQ_BOUNDED,
    MAXQ_OLD,
    GiB,
    LaneProfile,
    MiB,
    get_profile,
    profile_names,
)


def run_until(model: EngineModel, stop, limit: float = 1e6) -> list[Event]:
    """Jump from event to event (virtual time) until ``stop(model, events)`` or nothing is left."""
    events: list[Event] = []
    while not stop(model, events):
        t = model.next_event_time()
        if t is None or t > limit:
            break
        events += model.advance(t)
    return events


def drain(model: EngineModel) -> list[Event]:
    return run_until(model, lambda m, _e: m.in_flight == 0)


def crashed(model: EngineModel, _events: list[Event]) -> bool:
    return bool(model.crashes)


def outage(model: EngineModel) -> None:
    """The Max-Q outage state, reconstructed: one ~95K request decoding, a 420K request in chunked
    prefill, 14 queued ~96K requests; 1,485,849 pending prefill tokens when the 35th chunk starts."""
    model.submit("running", 95_000, max_new_tokens=8192, now=0.0)
    events = run_until(model, lambda _m, ev: any(isinstance(e, FirstToken) for e in ev))
    t = events[-1].t
    model.submit("long", 420_000, max_new_tokens=8192, now=t)
    for i in range(14):
        model.submit(f"queued-{i}", 96_027 if i else 96_026, max_new_tokens=8192, now=t + 0.5 + i * 0.1)


# ------------------------------------------------------------------------------------ profiles
def test_profiles_by_name() -> None:
    assert profile_names() == ["maxq-old", "maxq-bounded", "mamba-lane", "h200", "h200-qwen3next"]
    assert get_profile("maxq-old") is MAXQ_OLD
    with pytest.raises(KeyError, match="known: maxq-old"):
        get_profile("nope")
    for name in profile_names():
        p = get_profile(name)
        assert 0 < p.idle_free_bytes < p.device_total_bytes
        assert p.weights_bytes > 0


def test_profile_coefficients_match_the_evidence() -> None:
    old, bounded, mamba = MAXQ_OLD, MAXQ_BOUNDED, get_profile("mamba-lane")
    assert old.device_total_bytes == 97_887 * MiB
    assert old.kv_pool_tokens == 522_880 and bounded.kv_pool_tokens == 689_728
    assert old.transient_pieces(0, 524_288).gather == 1024 * MiB
    assert bounded.transient_pieces(0, 524_288).gather == 32 * MiB
    assert bounded.device_total_bytes - bounded.idle_free_bytes == 94_661 * MiB
    # SGLang's rule: weights + pools = mem_fraction_static of the memory seen at start.
    static = old.weights_bytes + old.kv_pool_bytes + old.mamba_pool_bytes
    assert static / old.startup_available_bytes == pytest.approx(0.98, abs=0.001)
    assert mamba.effective_max_running_requests == 12 == mamba.mamba_slots // mamba.mamba_slots_per_request
    assert mamba.chunked_prefill_size == 4096 and mamba.context_length == 262_144
    assert get_profile("h200").device_total_bytes == 143_771 * MiB
    assert old.restart_s == 12 * 60 + 54


# ------------------------------------------------------------------------------------ determinism
def _trace(seed: int) -> list[Event]:
    profile = MAXQ_OLD.replace(transient_noise=0.05)
    model = EngineModel(profile, seed)
    outage(model)
    return run_until(model, crashed)


def test_same_seed_same_events_and_noise_depends_on_seed() -> None:
    first, second = _trace(7), _trace(7)
    assert first == second
    assert any(isinstance(e, Crashed) for e in first)
    crash_a = next(e for e in first if isinstance(e, Crashed))
    crash_b = next(e for e in _trace(8) if isinstance(e, Crashed))
    assert (crash_a.t, crash_a.requested_bytes) != (crash_b.t, crash_b.requested_bytes)


class _Recording(ModeledDevice):
    """The modeled device, keeping every allocation the engine asks of it, in order."""

    def __init__(self, profile: LaneProfile) -> None:
        super().__init__(profile)
        self.asked: list[int] = []

    def allocate(self, nbytes: int) -> None:
        self.asked.append(nbytes)
        super().allocate(nbytes)


def _allocations(noise: float, seed: int) -> list[int]:
    """What a lone cold 200K prefill and a joining pair allocate on the bounded lane, in order."""
    profile = MAXQ_BOUNDED.replace(transient_noise=noise)
    device = _Recording(profile)
    model = EngineModel(profile, seed, device=device)
    model.submit("long", 200_000, max_new_tokens=2, now=0.0)
    drain(model)
    model.submit("a", 20_000, max_new_tokens=64, now=model.now)
    model.submit("b", 20_000, max_new_tokens=64, now=model.now)
    drain(model)
    assert not model.crashes
    return device.asked


@pytest.mark.parametrize("noise", [0.05, 0.10])
def test_noise_is_a_bounded_uniform_factor_on_every_piece(noise: float) -> None:
    exact = _allocations(0.0, 0)
    assert len(exact) > 60 and any(n == MAXQ_BOUNDED.unknown_extra_bytes for n in exact)  # the join too
    ratios = []
    for seed in range(5):
        noisy = _allocations(noise, seed)
        assert len(noisy) == len(exact)  # same steps, same pieces: only the sizes vary
        ratios += [n / e for n, e in zip(noisy, exact, strict=True)]
    # Every piece within [1 - noise, 1 + noise] of its noise-free size (rounding: one byte) ...
    assert all(1 - noise - 1e-6 <= r <= 1 + noise + 1e-6 for r in ratios)
    # ... and spread over the whole range, not a gaussian's narrow middle (sigma = noise would put 32 %
    # of draws outside it, sigma = noise / 3 almost none near its ends).
    assert min(ratios) < 1 - 0.9 * noise and max(ratios) > 1 + 0.9 * noise
    tenth = noise / 5
    bins = [
        sum(1 for r in ratios if 1 - noise + i * tenth <= r < 1 - noise + (i + 1) * tenth) for i in range(10)
    ]
    assert min(bins) > len(ratios) / 10 * 0.5, bins  # roughly flat


# ------------------------------------------------------------------------------------ the outage
def test_outage_state_crashes_the_old_build_outside_the_pool() -> None:
    model = EngineModel(MAXQ_OLD)
    outage(model)
    events = run_until(model, crashed)
    crash = model.crashes[0]
    live = crash.live
    # The failed allocation is the eager prefill gather of 35 x 8,192 = 286,720 tokens: 560 MiB.
    assert crash.requested_bytes == 560 * MiB
    assert "Tried to allocate 560.00 MiB" in crash.reason and "93.92 GiB memory in use" in crash.reason
    assert crash.free_bytes is not None and crash.free_bytes < crash.requested_bytes
    # The scheduler state at 16:44:17 (evidence I5).
    assert live.num_running_reqs == 1
    assert live.num_queue_reqs == 14
    assert live.pending_prefill_tokens == pytest.approx(1_485_849, rel=0.01)
    assert live.token_usage == 0.73
    assert live.mamba_usage == pytest.approx(0.06)
    assert live.kv_available_tokens > 100_000  # the pool was NOT full
    # Every request in flight failed with a dropped connection (no HTTP status).
    failed = [e for e in events if isinstance(e, Failed)]
    assert len(failed) == 16 and all(e.status is None for e in failed)
    assert not model.up and model.in_flight == 0


def test_crash_keeps_the_engine_down_for_the_restart_time_then_cold() -> None:
    model = EngineModel(MAXQ_OLD)
    outage(model)
    run_until(model, crashed)
    t_crash = model.crashes[0].t
    assert model.down_until == pytest.approx(t_crash + 774.0)
    model.submit("during", 1000, max_new_tokens=4, now=t_crash + 10)
    assert model.advance(t_crash + 10) == [
        Failed("during", t_crash + 10, "engine is down (restarting)", None)
    ]
    assert model.next_event_time() == pytest.approx(t_crash + 774.0)
    events = model.advance(t_crash + 774.0)
    assert events == [Restarted(t_crash + 774.0)]
    assert model.up and model.published_gauges() is None  # a fresh process: no load gauges yet
    model.submit("after", 1000, max_new_tokens=4, now=t_crash + 775)
    assert any(isinstance(e, Finished) for e in drain(model))


def test_lone_500k_request_peaks_near_the_measured_on_both_builds() -> None:
    idle_use = MAXQ_BOUNDED.device_total_bytes - MAXQ_BOUNDED.idle_free_bytes
    assert idle_use == 94_661 * MiB
    peaks = {}
    for build, profile in (("bounded", MAXQ_BOUNDED), ("old", MAXQ_BOUNDED.replace(gather_cap_bytes=None))):
        model = EngineModel(profile)
        model.submit("a", 500_000, max_new_tokens=16, now=0.0)
        events = drain(model)
        assert not model.crashes and any(isinstance(e, Finished) for e in events)
        peaks[build] = model.peak_used_bytes
    assert peaks["bounded"] == pytest.approx(96_093 * MiB, abs=8 * MiB)
    # Evidence M2: 97,237 MiB. The measured gather figure (M1) (1,024 MiB at 524,288 tokens) leaves ~200 MiB.
    assert peaks["old"] == pytest.approx(97_237 * MiB, abs=256 * MiB)
    assert peaks["old"] - peaks["bounded"] > 900 * MiB


@pytest.mark.parametrize("gather_cap", [MAXQ_BOUNDED.gather_cap_bytes, None], ids=["bounded", "old"])
def test_two_cold_250k_requests_peak_1248_mib_over_idle_on_both_builds(gather_cap: int | None) -> None:
    profile = MAXQ_BOUNDED.replace(gather_cap_bytes=gather_cap)
    model = EngineModel(profile)
    model.submit("a", 250_000, max_new_tokens=64, now=0.0)
    model.submit("b", 250_000, max_new_tokens=64, now=0.0)
    drain(model)
    over_idle = model.peak_used_bytes - (profile.device_total_bytes - profile.idle_free_bytes)
    assert over_idle == pytest.approx(1_248 * MiB, abs=16 * MiB)


def test_mamba_lane_dies_of_mamba_slots_with_two_running_and_half_empty_pool() -> None:
    model = EngineModel(get_profile("mamba-lane"))
    for i in range(3):
        model.submit(f"cold-{i}", 140_000, max_new_tokens=2048, now=0.0)
    published = set()
    while model.up:
        model.advance(model.next_event_time())
        g = model.published_gauges()
        if g is not None:
            published.add(round(g.mamba_usage, 2))
    crash = model.crashes[0]
    assert crash.reason == MAMBA_CRASH and crash.requested_bytes is None
    assert crash.live.num_running_reqs == 2
    assert crash.live.full_token_usage < 0.5
    assert crash.live.full_token_usage == pytest.approx(0.46, abs=0.005)
    assert crash.live.mamba_usage == 1.0
    # The checkpoints are reported evictable: what is published never shows the pool filling up, only
    # the working slots (3 in-flight requests x 4 of 51); the true state at the crash is full (D13).
    assert max(published) == round(12 / 51, 2) and 1.0 not in published


# ------------------------------------------------------------------------------------ publication
def test_fresh_engine_has_no_gauges_until_30s_idle() -> None:
    model = EngineModel(get_profile("h200"))
    assert model.published_gauges() is None
    assert model.next_event_time() == 30.0
    model.advance(29.9)
    assert model.published_gauges() is None
    model.advance(30.0)
    g = model.published_gauges()
    assert g is not None and g.num_running_reqs == 0 and g.t == 30.0
    assert model.next_event_time() == 60.0


def test_gauges_change_only_at_publication_points() -> None:
    profile = get_profile("h200")
    model = EngineModel(profile)
    for i in range(4):
        model.submit(f"r{i}", 2000, max_new_tokens=400, now=0.0)
    run_until(model, lambda m, _e: m.live_gauges().num_running_reqs == 4 and m.published_gauges() is not None)
    snapshots = []
    lagging = 0
    for _ in range(200):  # 200 decode steps
        model.advance(model.next_event_time())
        pub, live = model.published_gauges(), model.live_gauges()
        snapshots.append(pub)
        lagging += pub.decode_sum_seq_lens != live.decode_sum_seq_lens
    changes = sum(1 for a, b in itertools.pairwise(snapshots) if a is not b)
    assert changes == pytest.approx(200 / profile.decode_log_interval, abs=1)
    assert lagging > 150  # most of the time the published value is behind the live one
    for a, b in itertools.pairwise(snapshots):
        if a is not b:
            assert b.decode_sum_seq_lens - a.decode_sum_seq_lens == 4 * profile.decode_log_interval


def test_idle_report_follows_the_last_request_at_once() -> None:
    model = EngineModel(get_profile("h200"))
    model.submit("r", 100, max_new_tokens=3, now=0.0)
    events = drain(model)
    t_end = next(e for e in events if isinstance(e, Finished)).t
    # The last decode report (1 running) disagrees with the idle engine: SGLang re-reports at once.
    assert model.published_gauges().num_running_reqs == 0
    assert model.published_gauges().t == t_end
    assert model.next_event_time() == t_end + 30.0


# ------------------------------------------------------------------------------------ cache, queue
def _ttft(events: list[Event], rid: str) -> FirstToken:
    return next(e for e in events if isinstance(e, FirstToken) and e.rid == rid)


def test_shared_prefix_gives_cached_tokens_and_a_faster_first_token() -> None:
    model = EngineModel(MAXQ_BOUNDED)
    model.submit("turn-1", 200_000, max_new_tokens=100, now=0.0, prefix_key="agent")
    cold = _ttft(drain(model), "turn-1")
    t0 = model.now
    model.submit("turn-2", 210_000, max_new_tokens=100, now=t0, prefix_key="agent")
    events = drain(model)
    warm = _ttft(events, "turn-2")
    assert warm.cached_tokens >= 200_000
    assert warm.t - t0 < cold.t / 5
    done = next(e for e in events if isinstance(e, Finished))
    assert done.cached_tokens == warm.cached_tokens


def _second_turn(evict: bool) -> tuple[FirstToken, list[Event]]:
    model = EngineModel(get_profile("h200"))
    model.submit("turn-1", 30_000, max_new_tokens=10, now=0.0, prefix_key="agent")
    drain(model)
    if evict:  # unrelated requests need the pool: the history is evicted (LRU, tail first)
        for i in range(6):
            model.submit(f"other-{i}", 38_000, max_new_tokens=10, now=model.now)
        drain(model)
    t0 = model.now
    model.submit("turn-2", 32_000, max_new_tokens=10, now=t0, prefix_key="agent")
    events = drain(model)
    first = _ttft(events, "turn-2")
    return FirstToken(first.rid, first.t - t0, first.prompt_tokens, first.cached_tokens), events


def test_a_too_small_cache_loses_the_prefix_silently() -> None:
    kept, _ = _second_turn(evict=False)
    lost, events = _second_turn(evict=True)
    assert kept.cached_tokens >= 30_000
    assert 0 < lost.cached_tokens < 20_000
    assert lost.t > 3 * kept.t  # a slower first token ...
    assert any(isinstance(e, Finished) and e.rid == "turn-2" for e in events)  # ... and it "succeeds"


def test_retraction_fails_after_three_and_the_next_request_succeeds() -> None:
    tiny = get_profile("h200").replace(
        kv_pool_tokens=1000, new_token_ratio=0.1, context_length=4000, max_running_requests=8
    )
    model = EngineModel(tiny)
    for i in range(6):
        model.submit(f"r{i}", 100, max_new_tokens=600, now=0.0)
    events = drain(model)
    assert any(isinstance(e, Retracted) for e in events)
    failed = [e for e in events if isinstance(e, Failed)]
    assert failed and all(e.status == 503 and "retracted 3 times" in e.reason for e in failed)
    assert not model.crashes
    model.submit("next", 100, max_new_tokens=600, now=model.now)
    assert any(isinstance(e, Finished) and e.rid == "next" for e in drain(model))


def test_abort_frees_what_the_request_held() -> None:
    model = EngineModel(MAXQ_BOUNDED)
    model.submit("a", 100_000, max_new_tokens=1000, now=0.0)
    model.advance(2.0)
    assert model.live_gauges().kv_used_tokens > 0
    assert model.abort("a", 2.0)
    assert not model.abort("a", 2.0)
    assert model.live_gauges().kv_used_tokens == 0 and model.in_flight == 0
    events = model.advance(10.0)
    assert not any(getattr(e, "rid", None) == "a" for e in events if not isinstance(e, Tokens))


def test_invalid_requests_fail_with_400() -> None:
    model = EngineModel(get_profile("h200"))
    model.submit("huge", 50_000, max_new_tokens=10, now=0.0)
    model.submit("long-out", 40_000, max_new_tokens=5_000, now=0.0)
    events = model.advance(0.0)
    assert [(e.rid, e.status) for e in events if isinstance(e, Failed)] == [("huge", 400), ("long-out", 400)]
    with pytest.raises(ValueError, match="backwards"):
        model.advance(-1.0)


def test_max_running_requests_and_fifo_queue() -> None:
    profile: LaneProfile = get_profile("h200").replace(max_running_requests=2)
    model = EngineModel(profile)
    for i in range(4):
        model.submit(f"r{i}", 100, max_new_tokens=50, now=0.0)
    events = run_until(model, lambda m, _e: m.live_gauges().num_running_reqs == 2)
    assert model.live_gauges().num_queue_reqs == 2
    events += drain(model)
    order = [e.rid for e in events if isinstance(e, FirstToken)]
    assert order == ["r0", "r1", "r2", "r3"]


def test_free_memory_includes_transients_in_flight() -> None:
    profile = MAXQ_OLD.replace(allocator_caches_transients=False)
    model = EngineModel(profile)
    idle = model.free_bytes(0.0)
    assert idle == profile.idle_free_bytes
    model.submit("a", 100_000, max_new_tokens=4, now=0.0)
    during = model.free_bytes(0.01)  # the first chunk is in flight
    assert idle - during == profile.transient_pieces(8192, 8192).total
    assert model.total_bytes == 97_887 * MiB
    assert model.free_bytes(1000.0) == idle
    assert idle / GiB > 1


def test_a_caching_allocator_keeps_nvml_free_at_its_low_water_mark() -> None:
    """PyTorch keeps freed transients reserved (seen on an H200): NVML free does not come back."""
    model = EngineModel(MAXQ_OLD)  # caches, like every PyTorch engine
    idle = model.free_bytes(0.0)
    model.submit("a", 100_000, max_new_tokens=4, now=0.0)
    model.advance(1000.0)
    peak = MAXQ_OLD.transient_pieces(8192, 100_000).total
    assert model.free_bytes(1000.0) < idle - 0.9 * peak  # the last, shorter chunk peaks a little lower
    assert model.crashes == []  # a cached block is reused or released on retry: only live bytes kill


# ------------------------------------------------------------------------------------ devices
def test_cpu_mode_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from sidecar_emulator.profiles import get_profile\n"
        "from sidecar_emulator.server import build_emulator_app, build_model\n"
        "m = build_model(get_profile('maxq-old'))\n"
        "build_emulator_app(m)\n"
        "m.submit('a', 1000, max_new_tokens=2, now=0.0)\n"
        "m.advance(100.0)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


# The cards the CUDA mode must run on: NVML total less what the driver and CUDA context leave free
# (an H100 80 GB shows 81,559 MiB total, an H200 143,771 MiB: evidence N1 and issue 29's H100 figure).
H100_FREE = 81_559 * MiB - 1_100 * MiB
H200_FREE = 143_771 * MiB - 1_100 * MiB


@pytest.mark.parametrize("name", ["maxq-old", "maxq-bounded", "mamba-lane", "h200", "h200-qwen3next"])
@pytest.mark.parametrize("free", [H100_FREE, H200_FREE], ids=["h100-80gb", "h200"])
def test_cuda_mode_leaves_every_profile_its_idle_free_memory_on_either_card(name: str, free: int) -> None:
    """`emulate --cuda` allocates what the profile's engine holds, scaled to the card: what is left
    free is the profile's idle free memory, on an 80 GB H100 as on a 141 GB H200."""
    profile = get_profile(name)
    blocks = static_blocks(profile, free)
    assert all(b > 0 for b in blocks)
    assert free - sum(blocks) == profile.idle_free_bytes


def test_cuda_mode_scales_static_blocks_in_proportion_on_a_smaller_card() -> None:
    profile = get_profile("h200-qwen3next")  # ~140 GiB of static memory: more than an H100 has
    assert profile.engine_static_bytes > H100_FREE
    blocks = static_blocks(profile, H100_FREE)
    full = [profile.weights_bytes, profile.kv_pool_bytes, profile.mamba_pool_bytes, profile.cuda_graph_bytes]
    assert len(blocks) == 4  # no ballast: the blocks themselves shrink
    for got, want in zip(blocks[1:], full[1:], strict=True):
        assert got / want == pytest.approx(blocks[0] / full[0], rel=1e-6)
    # On a card larger than the profile's, the blocks are the profile's and a ballast fills the rest.
    assert static_blocks(MAXQ_OLD, H200_FREE)[:4] == [
        MAXQ_OLD.weights_bytes,
        MAXQ_OLD.kv_pool_bytes,
        MAXQ_OLD.mamba_pool_bytes,
        MAXQ_OLD.cuda_graph_bytes,
    ]


def test_cuda_mode_refuses_a_card_with_no_more_than_the_idle_free_memory() -> None:
    with pytest.raises(RuntimeError, match="nothing to emulate"):
        static_blocks(MAXQ_OLD, MAXQ_OLD.idle_free_bytes)


@pytest.mark.gpu
@pytest.mark.skipif(
    shutil.which("nvidia-smi") is None or importlib.util.find_spec("torch") is None,
    reason="needs torch and an NVIDIA GPU",
)
def test_cuda_mode_dies_of_cudas_own_out_of_memory() -> None:
    from sidecar_emulator.device import TorchDevice

    device = TorchDevice(MAXQ_OLD)  # the real card is filled down to the profile's idle free memory
    try:
        assert device.free_bytes() == pytest.approx(MAXQ_OLD.idle_free_bytes, abs=8 * MiB)
        model = EngineModel(MAXQ_OLD, device=device)
        outage(model)
        run_until(model, crashed)
        crash = model.crashes[0]
        # The chunk that ends at 286,720 tokens: on the modeled device its 560 MiB gather fails. The
        # chunk before it leaves 6 MiB to spare there; on a real card (H100, docs/evidence.md G4) its
        # 544 MiB gather failed with 544.19 MiB free: the crash comes one chunk earlier.
        assert crash.reason.startswith(
            (
                "CUDA out of memory. Tried to allocate 560.00 MiB",
                "CUDA out of memory. Tried to allocate 544.00 MiB",
            )
        )
        assert crash.live.num_queue_reqs == 14 and crash.live.token_usage in (0.71, 0.73)
    finally:
        device.crash()
