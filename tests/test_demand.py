"""Intake: a request's demand counts every sequence it creates, and the ledger books exactly that."""

from __future__ import annotations

import json

import pytest

from sidecar.admission.controller import Admission, Outcome
from sidecar.core import demand
from sidecar.core.decision import Reason
from sidecar.intake.body import parse_generation
from sidecar.intake.demand import demand_of
from sidecar.intake.tokens import TokenCount
from sidecar.policy.in_force import rules_of
from tests.conftest import ManualClock, small_policy, snapshot, submit

# A lane with a 51-slot Mamba pool (lane 2), a checkpoint every 4,096 prompt tokens, and a decode
# reserve of every sequence's whole output budget, so each figure below can be read off the body.
LANE = dict(
    lane__mamba_slots=51,
    mamba__slots_per_request=1,
    mamba__checkpoint_interval_tokens=4096,
    kv__decode_reserve_fraction=1.0,
    engine_queue__max_requests=10,
)


def parsed(path: str, body: dict) -> object:
    return parse_generation(path, json.dumps(body).encode(), max_body_bytes=1 << 20)


@pytest.mark.parametrize(
    ("path", "body", "prompts", "sequences"),
    [
        # A /generate batch of 8 prompts: 8 prefills, 8 sequences.
        ("/generate", {"text": ["a"] * 8, "sampling_params": {"max_new_tokens": 100}}, 8, 8),
        # One prompt, n=8 (SGLang's parallel_sample_num): 1 prefill, 8 sequences.
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 100, "n": 8}}, 1, 8),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "max_tokens": 100, "n": 8},
            1,
            8,
        ),
        # Both: 2 prompts x 4 samples.
        ("/generate", {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 100, "n": 4}}, 2, 8),
    ],
)
def test_every_sequence_is_charged_kv_mamba_and_queue(
    clock: ManualClock, path: str, body: dict, prompts: int, sequences: int
) -> None:
    a = Admission(small_policy(**LANE), clock)
    a.update_snapshot(snapshot(clock()))
    d = demand_of(a.rules, a.snapshot, parsed(path, body), TokenCount(8000, True, "test"), now=clock())
    assert (d.prompts, d.sequences) == (prompts, sequences)
    assert d.kv_tokens == 8000 + 100 * sequences  # the prompts once, a decode reserve per sequence
    checkpoints = 2 + prompts - 1  # ceil(8000 / 4096), plus one per extra prompt's partial interval
    assert d.mamba_slots == sequences + checkpoints
    assert submit(a, d).admitted
    totals = a.ledger.totals
    assert (totals.requests, totals.sequences) == (1, sequences)
    assert totals.kv_tokens == d.kv_tokens and totals.mamba_slots == d.mamba_slots
    # The engine queue (limit 10) now holds `sequences`: a single-sequence request fits only if
    # sequences + 1 <= 10, and another request as wide as this one does not.
    one = demand.build(a.rules, 10, arrived_at=clock())
    assert submit(a, one).admitted
    wide = demand.build(a.rules, 10, arrived_at=clock(), prompts=prompts, samples=sequences // prompts)
    w = submit(a, wide)
    assert w.held and w.decision is not None and w.decision.reason is Reason.ENGINE_QUEUE
    queue = next(c for c in w.decision.checks if c.name == "engine_queue")
    assert queue.need == sequences + 1 + sequences


def test_a_request_wider_than_the_mamba_pool_is_unfit(clock: ManualClock) -> None:
    """n=64 on a 51-slot pool can never run: rejected at once, not held for ever."""
    a = Admission(small_policy(**LANE), clock)
    a.update_snapshot(snapshot(clock()))
    wide = demand.build(a.rules, 100, arrived_at=clock(), samples=64)
    r = submit(a, wide)
    assert r.outcome is Outcome.REJECTED and r.decision is not None
    assert r.decision.reason is Reason.UNFIT_REQUEST


def test_a_request_wider_than_the_engine_runs_is_unfit_even_alone(clock: ManualClock) -> None:
    """Issue 24: a request wider than the queue limit was admitted alone ("it would otherwise wait for
    ever"), so `n: 1000000` reached SGLang. One wider than the engine's running limit can never be taken
    whole: unfit at once, no hold. The policy's engine-queue throttle is not such a limit: alone, a
    request wider than it still passes."""
    a = Admission(
        small_policy(**{**LANE, "lane__max_running_requests": 12, "engine_queue__max_requests": 4}), clock
    )
    a.update_snapshot(snapshot(clock()))
    r = submit(a, demand.build(a.rules, 10, arrived_at=clock(), samples=13))
    assert r.outcome is Outcome.REJECTED and r.decision is not None
    assert r.decision.reason is Reason.UNFIT_REQUEST
    assert r.decision.checks[0].limit == "running_requests"
    assert submit(a, demand.build(a.rules, 10, arrived_at=clock(), samples=12)).admitted


def test_reprice_keeps_the_request_and_reprices_its_cost() -> None:
    cheap, dear = small_policy(), small_policy(cost__activation_bytes_per_chunk_token=2048)
    d = demand.build(
        rules_of(cheap.policy), 1000, arrived_at=7.0, prompts=2, samples=3, priority=4, request_id="r"
    )
    again = demand.reprice(rules_of(dear.policy), d)
    assert again.projected_bytes == 2 * d.projected_bytes
    assert (again.prompts, again.sequences, again.priority, again.request_id, again.arrived_at) == (
        2,
        6,
        4,
        "r",
        7.0,
    )
