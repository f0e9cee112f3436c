"""The cost terms calibrate measures, in the core: chunk x context, and the batch join, checked while
requests run; the ledger keeps a request's running part until it ends."""

from __future__ import annotations

from pathlib import Path

from sidecar.core import demand as demand_mod
from sidecar.core.cost import project_bytes, shape
from sidecar.core.decide import Situation, decide
from sidecar.core.decision import Charge, Reason
from sidecar.core.ledger import Ledger, LedgerTotals
from sidecar.core.snapshot import DeviceMemory, EngineSignals, GpuSignals, Snapshot
from sidecar.policy.in_force import rules_of
from sidecar.policy.schema import load_policy_file

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def bounded(**cost: object):  # type: ignore[no-untyped-def]
    loaded = load_policy_file(ROOT / "sidecar_emulator/policies/maxq-qwen3next-bounded.yaml")
    return rules_of(loaded.with_section("cost", **cost).policy)


def test_ledger_keeps_the_running_part_until_the_end() -> None:
    ledger = Ledger()
    key = ledger.charge(Charge(prefill_tokens=100, kv_tokens=100, projected_bytes=5 * MiB, mamba_slots=3))
    assert ledger.totals.running_requests == 1 and ledger.totals.projected_bytes == 5 * MiB
    assert ledger.prefill_done(key) and not ledger.prefill_done(key)
    assert ledger.totals.projected_bytes == 0 and ledger.totals.requests == 0
    assert ledger.totals.running_requests == 1 and ledger.totals.running_mamba_slots == 3
    assert ledger.release(key) and not ledger.release(key)
    assert ledger.totals == LedgerTotals()
    # Released without a first token (the client left): both parts go at once.
    key = ledger.charge(Charge(prefill_tokens=7, projected_bytes=MiB))
    assert ledger.release(key) and ledger.totals == LedgerTotals()


def test_chunk_context_term_is_the_product() -> None:
    rules = bounded(
        chunk_context_bytes=6.0,
        activation_bytes_per_chunk_token=0,
        context_bytes_per_token=0,
        gather_bytes_per_context_token=0,
        margin=1.0,
    )
    assert project_bytes(rules.cost, shape(488_000, 488_000, 16_384)) == 6 * 16_384 * 488_000


def _free(n: int) -> Snapshot:
    engine = EngineSignals(observed_at=0.0, running_requests=0, queue_requests=0, pending_prefill_tokens=0)
    return Snapshot(engine=engine, gpu=GpuSignals(0.0, "test", (DeviceMemory("g", n, 80 << 30),)))


def test_a_newcomer_that_would_join_a_running_batch_waits_for_the_join_to_fit() -> None:
    """Budget 3,226 MiB - 128 MiB reserve; join 1,248 MiB x 1.05. One runs: a second joins (1,310 MiB
    fits). With the budget shrunk below the join, the second waits until the first ends; alone, a
    request never needs it."""
    rules = bounded(batch_join_bytes=1248 * MiB, margin=1.05)
    d = demand_mod.build(rules, 4096, arrived_at=0.0)
    alone = decide(d, Situation(rules, _free(0), LedgerTotals(), 0.0))
    assert alone.admitted
    beside = decide(d, Situation(rules, _free(0), LedgerTotals(running_requests=1), 0.0))
    assert beside.admitted and any(c.name == "batch_join" and c.ok for c in beside.checks)
    small = bounded(batch_join_bytes=3300 * MiB, margin=1.0)
    d = demand_mod.build(small, 4096, arrived_at=0.0)
    held = decide(d, Situation(small, _free(0), LedgerTotals(running_requests=1), 0.0))
    assert not held.admitted and held.reason is Reason.VRAM_HEADROOM
    assert decide(d, Situation(small, _free(0), LedgerTotals(), 0.0)).admitted
