"""The pure parts of issue 29 in the core: per-GPU idle budgets (``decide.idle_budget``), a newcomer
refused at once when the work ahead outlasts its deadline (``decide.expected_wait_s``), and lane facts
measured against the policy's (``core/facts.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.core import demand
from sidecar.core import facts as lane_facts
from sidecar.core.decide import Situation, decide, expected_wait_s, headroom_bytes
from sidecar.core.decision import Action, Reason
from sidecar.core.ledger import LedgerTotals
from sidecar.core.rules import DeviceBaseline, Rules
from sidecar.core.snapshot import DeviceMemory, GpuSignals, Snapshot
from sidecar.policy.in_force import rules_of
from tests.conftest import MIB, small_policy, snapshot

GIB = 1024 * MIB

NOW = 1000.0


def rules(**overrides: object) -> Rules:
    return rules_of(small_policy(**overrides).policy)


def two_gpus(other0: int, other1: int, free: int = 20 * GIB) -> Snapshot:
    devices = (
        DeviceMemory("GPU-0", free, 80 * GIB, other0),
        DeviceMemory("GPU-1", free, 80 * GIB, other1),
    )
    return replace(snapshot(NOW), gpu=GpuSignals(NOW, "test", devices))


# -- per-GPU headroom ----------------------------------------------------------------------------------


def test_each_gpu_is_charged_its_own_neighbour_growth() -> None:
    """Issue 29: a 3 GiB neighbour on GPU 0 from the start and one growing 0 -> 2 GiB on GPU 1. One
    maximum over the GPUs left the headroom unchanged; each GPU against its own baseline sees GPU 1."""
    r = rules(
        vram__headroom="idle_budget", vram__idle_free_bytes=10 * GIB, vram__other_processes_bytes=3 * GIB
    )
    base = (DeviceBaseline("GPU-0", 10 * GIB, 3 * GIB), DeviceBaseline("GPU-1", 13 * GIB, 0))
    per_gpu = replace(r, vram=replace(r.vram, idle_devices=base))
    empty = LedgerTotals()
    assert headroom_bytes(per_gpu, two_gpus(3 * GIB, 0), empty) == 10 * GIB
    # GPU 1's neighbour grows by 2 GiB: GPU 1 has 11 GiB of budget left, GPU 0 still 10: unchanged.
    assert headroom_bytes(per_gpu, two_gpus(3 * GIB, 2 * GIB), empty) == 10 * GIB
    # By 4 GiB: GPU 1 is the tighter one now (13 - 4 = 9 GiB).
    assert headroom_bytes(per_gpu, two_gpus(3 * GIB, 4 * GIB), empty) == 9 * GIB
    # With one baseline for both (the policy's 3 GiB), the growth to 4 GiB on GPU 1 shows only as 1.
    assert headroom_bytes(r, two_gpus(3 * GIB, 4 * GIB), empty) == 9 * GIB
    # ... and a neighbour of 2 GiB on GPU 1 (where there was none) not at all: what per-GPU fixes.
    same = replace(
        per_gpu, vram=replace(per_gpu.vram, idle_devices=(base[0], replace(base[1], free_bytes=10 * GIB)))
    )
    assert headroom_bytes(r, two_gpus(3 * GIB, 2 * GIB), empty) == 10 * GIB
    assert headroom_bytes(same, two_gpus(3 * GIB, 2 * GIB), empty) == 8 * GIB
    # The ledger's share is on every GPU: taken off after the minimum.
    assert headroom_bytes(same, two_gpus(3 * GIB, 2 * GIB), LedgerTotals(projected_bytes=GIB)) == 7 * GIB


# -- expected wait -------------------------------------------------------------------------------------


def situation(r: Rules, *, rate: float | None, held_tokens: int = 0, pending: int = 0) -> Situation:
    snap = snapshot(NOW, pending_prefill_tokens=pending, kv_available_tokens=0)  # the KV pool holds all
    return Situation(r, snap, LedgerTotals(), NOW, held=1, held_tokens=held_tokens, prefill_tokens_per_s=rate)


def test_a_newcomer_whose_wait_outlasts_its_deadline_is_refused_at_once_with_retry_after() -> None:
    r = rules()  # max_wait_s 30
    d = demand.build(r, 1000, arrived_at=NOW)
    # 40,000 tokens ahead at a measured 1,000 tokens/s: 40 s > 30 s.
    late = decide(d, situation(r, rate=1000.0, held_tokens=30_000, pending=10_000))
    assert (late.action, late.reason) == (Action.REJECT, Reason.HOLD_TIMEOUT)
    assert late.retry_after_s is not None and late.retry_after_s > 0
    assert late.checks[-1].name == "expected_wait" and late.checks[-1].need == 40.0
    # 20,000 ahead: 20 s, within its 30 s: parked.
    assert decide(d, situation(r, rate=1000.0, held_tokens=10_000, pending=10_000)).action is Action.HOLD
    # No measured rate: the policy's assumed one refuses nobody; parked as before.
    assert decide(d, situation(r, rate=None, held_tokens=30_000, pending=10_000)).action is Action.HOLD
    # A request already held is timed out at its deadline, not refused on an estimate.
    queued = replace(situation(r, rate=1000.0, held_tokens=30_000, pending=10_000), queued=True)
    assert decide(d, queued).action is Action.HOLD


def test_with_backfill_the_held_requests_are_not_ahead() -> None:
    r = rules(hold__backfill=True)
    assert expected_wait_s(situation(r, rate=1000.0, held_tokens=30_000, pending=10_000)) == 10.0
    assert expected_wait_s(situation(rules(), rate=1000.0, held_tokens=30_000, pending=10_000)) == 40.0


# -- lane facts ------------------------------------------------------------------------------------------


def test_a_policy_claiming_more_idle_free_memory_than_measured_gets_the_measured_figure() -> None:
    r = rules(vram__headroom="idle_budget", vram__idle_free_bytes=1993 * MIB)
    facts = lane_facts.compare(r, snapshot(NOW).engine, 1372 * MIB, 1, idle_free_policy=1993 * MIB)
    idle = {f.name: f for f in facts}["idle_free_bytes"]
    assert (idle.policy, idle.measured, idle.in_force) == (1993 * MIB, 1372 * MIB, 1372 * MIB)
    assert idle.disagrees and idle.unsafe
    forced = lane_facts.in_force(r, lane_facts.overrides(facts))
    assert forced.vram.idle_free_bytes == 1372 * MIB
    assert headroom_bytes(forced, snapshot(NOW), LedgerTotals()) == 1372 * MIB
    # Within the tolerance (2 % and 64 MiB) nothing is loud (no warning, metric or alert), but the
    # measured figure still bounds the claim: a 40 MiB over-claim costs 40 MiB of headroom.
    close = lane_facts.compare(r, None, 1993 * MIB - 40 * MIB, None, idle_free_policy=1993 * MIB)
    assert not any(f.disagrees or f.unsafe for f in close)
    bounded = lane_facts.in_force(r, lane_facts.overrides(close))
    assert bounded.vram.idle_free_bytes == 1953 * MIB
    assert (
        headroom_bytes(r, snapshot(NOW), LedgerTotals())
        - headroom_bytes(bounded, snapshot(NOW), LedgerTotals())
        == 40 * MIB
    )
    # The same figure measured: nothing overridden, the policy's own rules.
    same = lane_facts.compare(r, None, 1993 * MIB, None, idle_free_policy=1993 * MIB)
    assert lane_facts.overrides(same) == () and lane_facts.in_force(r, ()) is r
    # A policy that claims less than measured is the safer: it stays in force (shown as disagreeing).
    less = {f.name: f for f in lane_facts.compare(r, None, 4000 * MIB, None, idle_free_policy=1993 * MIB)}
    assert less["idle_free_bytes"].disagrees and not less["idle_free_bytes"].unsafe
    assert (
        lane_facts.in_force(r, lane_facts.overrides(tuple(less.values()))).vram.idle_free_bytes == 1993 * MIB
    )


def test_the_engine_s_pool_context_and_chunk_are_in_force_and_a_gpu_count_mismatch_is_shown() -> None:
    r = rules()  # context 100000, pool 100000, chunk 1000
    e = snapshot(NOW, max_total_tokens=33_000, context_len=131_072, chunked_prefill_size=8192, gpus=2).engine
    facts = {f.name: f for f in lane_facts.compare(r, e, None, 1, idle_free_policy=None)}
    assert facts["kv_pool_tokens"].in_force == 33_000 and facts["kv_pool_tokens"].disagrees
    assert facts["context_len"].in_force == 131_072
    assert facts["gpus"].disagrees and facts["gpus"].in_force is None
    forced = lane_facts.in_force(r, lane_facts.overrides(tuple(facts.values())))
    assert (forced.lane.kv_pool_tokens, forced.lane.context_len, forced.lane.chunked_prefill_size) == (
        33_000,
        131_072,
        8192,
    )
    # Chunking off (-1) is not a chunk size to compare.
    off = snapshot(NOW, chunked_prefill_size=-1).engine
    assert not {f.name: f for f in lane_facts.compare(r, off, None, None, idle_free_policy=None)}[
        "chunked_prefill_size"
    ].disagrees


def by_name(found: tuple[lane_facts.Fact, ...]) -> dict[str, lane_facts.Fact]:
    return {f.name: f for f in found}


QUIET = {"disagrees": False, "unsafe": False}


def test_a_fact_only_one_side_states_is_that_side_s_figure_and_never_loud() -> None:
    """Nothing to compare: the measurement where the policy gives no figure (``idle_free_bytes:
    auto``), the policy's before the engine reports. Neither disagrees nor is unsafe, and
    /admission/state shows both as ``false`` (not ``null``)."""
    r = rules(vram__headroom="idle_budget", vram__idle_free_bytes="auto")
    found = by_name(lane_facts.compare(r, None, 5 * GIB, 1, idle_free_policy=None))
    assert found["idle_free_bytes"].fields() == {
        "policy": None,
        "measured": 5 * GIB,
        "in_force": 5 * GIB,
        **QUIET,
    }
    assert found["kv_pool_tokens"].fields() == {
        "policy": 100_000,
        "measured": None,
        "in_force": 100_000,
        **QUIET,
    }
    # The GPU source's count is compared with the engine's GPUs only: before the engine reports them
    # there is nothing to show, and a GPU count is never put in force.
    assert found["gpus"].fields() == {"policy": None, "measured": None, "in_force": None, **QUIET}
    assert lane_facts.overrides(tuple(found.values())) == ()


def idle_fact(policy: int, measured: int) -> tuple[bool, bool, int | None]:
    r = rules(vram__headroom="idle_budget", vram__idle_free_bytes=policy)
    f = by_name(lane_facts.compare(r, None, measured, None, idle_free_policy=policy))["idle_free_bytes"]
    return f.disagrees, f.unsafe, f.in_force


def test_idle_free_memory_disagrees_beyond_64_mib_or_2_percent_of_the_policy_s_whichever_is_more() -> None:
    """What is loud (the warning, the metric, the alert): more than 64 MiB apart on a small figure,
    more than 2 % of the policy's on a large one. The smaller figure is in force either way."""
    # 1,993 MiB (2 % is 40 MiB): 64 MiB apart is within, 65 MiB is not.
    assert idle_fact(1993 * MIB, 1929 * MIB) == (False, False, 1929 * MIB)
    assert idle_fact(1993 * MIB, 1928 * MIB) == (True, True, 1928 * MIB)
    # 70 GiB (an 80 GB card after the weights; 2 % is 1.4 GiB): 1 GiB apart is within, 2 GiB is not.
    assert idle_fact(70 * GIB, 69 * GIB) == (False, False, 69 * GIB)
    assert idle_fact(70 * GIB, 68 * GIB) == (True, True, 68 * GIB)
    # A policy claiming less than measured is shown as disagreeing, never as unsafe, and stays.
    assert idle_fact(70 * GIB, 72 * GIB) == (True, False, 70 * GIB)


def test_the_engine_s_mamba_pool_is_in_force_over_the_policy_s() -> None:
    r = rules(lane__mamba_slots=50)
    e = snapshot(NOW, mamba_used_slots=8, mamba_available_slots=30, mamba_evictable_slots=2).engine
    found = lane_facts.compare(r, e, None, None, idle_free_policy=None)
    assert by_name(found)["mamba_slots"].fields() == {
        "policy": 50,
        "measured": 40,
        "in_force": 40,
        "disagrees": True,
        "unsafe": True,
    }
    assert lane_facts.in_force(r, lane_facts.overrides(found)).lane.mamba_slots == 40


@pytest.mark.parametrize(("reported", "compared"), [(-1, None), (0, None), (1, 1), (8192, 8192)])
def test_the_engine_s_chunk_size_is_compared_where_sglang_chunks(reported: int, compared: int | None) -> None:
    """SGLang's scheduler turns chunked prefill off for a ``chunked_prefill_size`` of 0 or less
    (sgl-project/sglang ``python/sglang/srt/managers/scheduler.py``, ``Scheduler.init_chunked_prefill``:
    ``if self.chunked_prefill_size <= 0: self.chunked_prefill_size = None``); any positive size is the
    chunk it runs, 1 included."""
    r = rules()  # chunk 1000
    e = snapshot(NOW, chunked_prefill_size=reported).engine
    fact = by_name(lane_facts.compare(r, e, None, None, idle_free_policy=None))["chunked_prefill_size"]
    assert (fact.measured, fact.in_force) == (compared, 1000 if compared is None else compared)
    forced = lane_facts.in_force(r, lane_facts.overrides((fact,)))
    assert forced.lane.chunked_prefill_size == fact.in_force


@pytest.mark.parametrize(
    ("name", "figure"),
    [
        ("kv_pool_tokens", 33_000),
        ("mamba_slots", 40),
        ("context_len", 32_768),
        ("chunked_prefill_size", 8192),
    ],
)
def test_a_fact_in_force_changes_its_own_figure_and_no_other(name: str, figure: int) -> None:
    r = rules(lane__mamba_slots=50)
    forced = lane_facts.in_force(r, ((name, figure),))
    assert forced.lane == replace(r.lane, **{name: figure})
    assert forced.vram == r.vram


def test_the_idle_figure_in_force_leaves_the_lane_s_figures_and_cuts_a_transient_cap_it_no_longer_frees() -> (
    None
):
    """The policy: 10 GiB idle, a 1 GiB reserve; measured: 8 GiB. A cap the policy set above what
    the measured lane frees (8 - 1 = 7 GiB) is cut to it; one below stays; none stays none (the cap
    is then the idle figure less the reserve)."""
    for cap, in_force in ((8 * GIB, 7 * GIB), (5 * GIB, 5 * GIB), (None, 7 * GIB)):
        r = rules(
            lane__mamba_slots=50,
            vram__headroom="idle_budget",
            vram__idle_free_bytes=10 * GIB,
            vram__reserve_bytes=GIB,
            vram__max_transient_bytes=cap,
        )
        found = lane_facts.compare(r, None, 8 * GIB, None, idle_free_policy=10 * GIB)
        forced = lane_facts.in_force(r, lane_facts.overrides(found))
        assert (forced.vram.idle_free_bytes, forced.vram.transient_cap()) == (8 * GIB, in_force), cap
        assert forced.lane == r.lane


def test_a_gpu_count_is_never_in_force_even_before_the_gpu_source_is_read() -> None:
    """The engine runs on 2 GPUs and the GPU source has not been read (or there is none): the fact
    shows the engine's count and nothing in force, as it does once the source's count is compared
    (``/admission/state`` and ``sidecar_lane_fact{source="in_force"}`` never show a GPU count)."""
    e = snapshot(NOW, gpus=2).engine
    for devices in (None, 2, 1):
        gpus = by_name(lane_facts.compare(rules(), e, None, devices, idle_free_policy=None))["gpus"]
        assert (gpus.policy, gpus.measured, gpus.in_force, gpus.disagrees) == (2, devices, None, devices == 1)
