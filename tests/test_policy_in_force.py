"""The rules in force (``sidecar/policy/in_force.py``): the policy's own, with what the lane taught
(an ``auto`` idle figure measured, each GPU's idle baseline) and its own bounds carried over."""

from __future__ import annotations

from dataclasses import replace

from sidecar.core import demand
from sidecar.core.decide import Situation, decide, headroom_bytes
from sidecar.core.decision import Reason
from sidecar.core.ledger import LedgerTotals
from sidecar.core.rules import DeviceBaseline, HeadroomSource, Learned
from sidecar.core.snapshot import DeviceMemory, GpuSignals, Snapshot
from sidecar.policy.in_force import rules_in_force, rules_of
from tests.conftest import MIB, small_policy, snapshot

GIB = 1024 * MIB
NOW = 1000.0


def two_gpus(other1: int) -> Snapshot:
    devices = (
        DeviceMemory("GPU-0", 12 * GIB, 80 * GIB, 0),
        DeviceMemory("GPU-1", 14 * GIB, 80 * GIB, other1),
    )
    return replace(snapshot(NOW), gpu=GpuSignals(NOW, "test", devices))


def test_a_policy_idle_figure_below_the_measured_one_is_the_tightest_gpu_s_and_the_others_keep_their_lead() -> (
    None
):
    """The policy says 10 GiB; the GPUs measured 12 and 14 GiB at idle. The policy's smaller figure
    is in force for the tightest GPU, the other 2 GiB above it, as measured: a neighbour growing by
    3 GiB on GPU 1 leaves it 11 - 3 = 9 GiB, below GPU 0's 10."""
    p = small_policy(vram__headroom="idle_budget", vram__idle_free_bytes="10GiB").policy
    measured = (DeviceBaseline("GPU-0", 12 * GIB, 0), DeviceBaseline("GPU-1", 14 * GIB, 0))
    r = rules_in_force(p, Learned(idle_devices=measured))
    assert [(d.ident, d.free_bytes) for d in r.vram.idle_devices] == [
        ("GPU-0", 10 * GIB),
        ("GPU-1", 12 * GIB),
    ]
    assert headroom_bytes(r, two_gpus(0), LedgerTotals()) == 10 * GIB
    assert headroom_bytes(r, two_gpus(3 * GIB), LedgerTotals()) == 9 * GIB


def test_an_auto_idle_figure_once_measured_is_in_force_and_still_the_sidecar_s() -> None:
    """``idle_free_bytes: auto`` after the sidecar measured it: the measured figure and what other
    processes held then, the policy's headroom mode, and the rules still say the figure is the
    sidecar's measurement (as they do before it is measured), not a figure the policy states."""
    auto = small_policy(vram__headroom="idle_budget", vram__idle_free_bytes="auto").policy
    r = rules_in_force(auto, Learned(idle_free_bytes=3 * GIB, idle_other_process_bytes=512 * MIB))
    v = r.vram
    assert (v.headroom, v.idle_free_bytes, v.other_processes_bytes, v.idle_free_auto) == (
        HeadroomSource.IDLE_BUDGET,
        3 * GIB,
        512 * MIB,
        True,
    )


def test_the_policy_s_bound_on_sequences_is_the_one_in_force() -> None:
    """``limits.max_sequences_per_request: 2``: a request of three sequences is unfit at once."""
    r = rules_of(small_policy(limits__max_sequences_per_request=2).policy)
    situation = Situation(r, snapshot(NOW), LedgerTotals(), NOW)
    unfit = decide(demand.build(r, 10, arrived_at=NOW, samples=3), situation)
    assert unfit.reason is Reason.UNFIT_REQUEST and unfit.checks[0].limit == "sequences"
    assert decide(demand.build(r, 10, arrived_at=NOW, samples=2), situation).admitted
