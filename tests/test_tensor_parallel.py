"""A tensor-parallel lane (issue 28): one device per rank, every rank allocating its share, the engine
dying when any rank cannot; and the TP2 scenario in which a neighbour grows on one of the two cards."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.core.snapshot import GpuSignals
from sidecar.policy.schema import load_policy_file
from sidecar_emulator.engine import EngineModel
from sidecar_emulator.profiles import MiB, get_profile, tensor_parallel
from sidecar_emulator.readings import gpu_signals
from sidecar_emulator.replay import Driver
from sidecar_emulator.scenario import load_scenario
from tests.conftest import ROOT

SCENARIO = ROOT / "scenarios" / "tp" / "tp2-neighbour.yaml"


def test_tensor_parallel_splits_what_sglang_splits_and_keeps_the_rest_whole() -> None:
    one = get_profile("maxq-bounded")
    two = tensor_parallel(one, 2)
    assert get_profile("maxq-bounded-tp2") == replace(two, name="maxq-bounded-tp2")
    assert two.kv_bytes_per_token == one.kv_bytes_per_token // 2
    assert two.activation_bytes_per_token == one.activation_bytes_per_token // 2
    assert two.gather_bytes_per_token == one.gather_bytes_per_token // 2
    # Kept whole on every rank: per-request index arrays over the context, logits, the batch join.
    assert two.context_bytes_per_token == one.context_bytes_per_token
    assert two.logprob_bytes_per_token == one.logprob_bytes_per_token
    assert two.unknown_extra_bytes == one.unknown_extra_bytes
    # The static fraction is kept: the weights a rank no longer holds become pool, the idle free is equal.
    assert abs(two.idle_free_bytes - one.idle_free_bytes) < two.kv_bytes_per_token
    assert two.kv_pool_tokens > one.kv_pool_tokens


def test_one_device_per_rank_and_the_engine_dies_when_any_rank_cannot_allocate() -> None:
    p = get_profile("maxq-bounded-tp2")
    e = EngineModel(p)
    assert [r[0] for r in e.device_readings()] == [p.idle_free_bytes] * 2
    # Rank 1's neighbour takes all but 500 MiB of its card; rank 0 is untouched.
    e.set_other_process_bytes(p.other_process_bytes + p.idle_free_bytes - 500 * MiB, 0.0, rank=1)
    free = [r[0] for r in e.device_readings()]
    assert free == [p.idle_free_bytes, 500 * MiB]
    signals = gpu_signals(e, 0.0)
    assert isinstance(signals, GpuSignals) and len(signals.devices) == 2
    assert signals.free_bytes == 500 * MiB  # the card that decides
    e.submit("r", 300_000, max_new_tokens=8, now=0.0)  # ~800 MiB per rank: rank 1 cannot
    t = 0.0
    while e.up and e.in_flight:
        t = e.next_event_time() or t + 1
        e.advance(t)
    assert len(e.crashes) == 1 and "[TP rank 1]" in e.crashes[0].reason


def test_a_neighbour_on_one_rank_of_a_one_gpu_engine_is_refused() -> None:
    e = EngineModel(get_profile("maxq-bounded"))
    with pytest.raises(ValueError, match="one GPU"):
        e.set_other_process_bytes(0, 0.0, rank=1)


def _run(policy: object, driver_cls: type[Driver] = Driver) -> dict:
    sc = load_scenario(SCENARIO)
    return driver_cls(sc, get_profile(sc.profile), policy, sc.seed).run()  # type: ignore[arg-type]


class _FirstCardOnly(Driver):
    """A GPU source that lists only the first card of the TP group (a misconfigured UUID list)."""

    def _read_gpu(self) -> None:
        assert self.admission is not None
        g = gpu_signals(self.engine, self.t)
        g = GpuSignals(g.observed_at, g.source, g.devices[:1])
        self.admission.update_snapshot(replace(self.admission.snapshot, gpu=g))


def test_tp2_replay_ungated_crashes_gated_per_gpu_does_not_and_a_summed_or_partial_view_would() -> None:
    sc = load_scenario(SCENARIO)
    policy = load_policy_file(sc.policy_path(SCENARIO.parent))
    ungated = _run(None)
    assert ungated["crashes"] and "[TP rank 1]" in ungated["crashes"][0]["reason"]
    gated = _run(policy)
    assert gated["crashes"] == [] and gated["completed"] > 0
    # A policy claiming the sum of both cards (as if the TP group were one pool) is not believed: the
    # idle figure measured per card is in force (docs/robustness.md), so it does not crash either.
    summed = policy.with_section(
        "vram",
        idle_free_bytes=2 * policy.policy.vram.idle_free_bytes,
        other_processes_bytes=2 * policy.policy.vram.other_processes_bytes,
    )
    assert _run(summed)["crashes"] == []
    # A GPU source that reads only GPU 0 never sees the neighbour grow on GPU 1.
    assert _run(policy, _FirstCardOnly)["crashes"]
