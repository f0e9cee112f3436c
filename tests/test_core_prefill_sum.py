"""Every admitted prefill's projected transient is charged until its first token: the sum, not the
largest prefill batch (``core/ledger.py`` says why: the gate cannot know how much of a prompt the engine
has cached, so it cannot know which prefills share a batch, nor how large a first chunk is)."""

from __future__ import annotations

from sidecar.core import demand
from sidecar.core.decide import Situation, decide
from sidecar.core.decision import Check
from sidecar.core.ledger import Ledger
from sidecar.policy.in_force import rules_of
from tests.conftest import small_policy, snapshot

NOW = 100.0


def test_a_second_long_prefill_is_charged_its_whole_projection() -> None:
    # 1,000-token chunks, 1 KiB per chunk token, 100 B per context token: a 5,000-token prompt that looks
    # cold projects 1,024,000 + 500,000 B. Were its prefix cached but for its last turn, its first chunk
    # would already attend over all of it, beside the other prompt's last chunk.
    r = rules_of(small_policy(cost__context_bytes_per_token=100).policy)
    one, two = (demand.build(r, 5000, arrived_at=NOW) for _ in range(2))
    ledger = Ledger()
    ledger.charge(decide(one, Situation(r, snapshot(NOW), ledger.totals, NOW)).charge)
    free = 2 * one.projected_bytes
    d = decide(two, Situation(r, snapshot(NOW, free_bytes=free), ledger.totals, NOW))
    assert d.admitted
    assert d.checks[0] == Check("vram_headroom", True, 1_524_000, 1_524_000)
    d = decide(two, Situation(r, snapshot(NOW, free_bytes=free - 1), ledger.totals, NOW))
    assert d.checks[0] == Check("vram_headroom", False, 1_524_000, 1_523_999)
