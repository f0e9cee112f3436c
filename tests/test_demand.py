"""Intake: a request's demand counts every sequence it creates, and the ledger books exactly that."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from sidecar.admission.controller import Admission, Outcome
from sidecar.core import demand
from sidecar.core.decision import Reason
from sidecar.core.snapshot import Snapshot
from sidecar.intake.body import parse_generation
from sidecar.intake.demand import demand_of
from sidecar.intake.tokens import TokenCount
from sidecar.policy.in_force import rules_of
from tests.conftest import ManualClock, small_policy, snapshot, submit, with_engine

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


# -- the output budget and the context it is priced against -------------------------------------------

CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})


@pytest.mark.parametrize(
    ("engine_context", "tokens", "exact", "budget"),
    [
        # The engine's reported context (5,000) wins over the lane's (100,000): the rest of it.
        (5000, 1200, True, 3800),
        # An estimated count over-counts: the rest may be the whole context.
        (5000, 1200, False, 5000),
        # A prompt that fills the context (or more) leaves nothing to generate: 0, not a negative.
        (5000, 5000, True, 0),
        (5000, 6000, True, 0),
        # No engine report yet: the lane's context.
        (None, 1200, True, 100_000 - 1200),
        (None, 1200, False, 100_000),
    ],
)
def test_a_chat_without_max_tokens_is_priced_at_the_rest_of_the_context(
    clock: ManualClock, engine_context: int | None, tokens: int, exact: bool, budget: int
) -> None:
    """SGLang's chat routes pass no max_new_tokens, and its scheduler generates up to the end of the
    engine's context: the demand's budget is what is left of it (evidence T3)."""
    a = Admission(small_policy(**LANE), clock)
    snap = with_engine(snapshot(clock()), context_len=engine_context) if engine_context else Snapshot()
    d = demand_of(a.rules, snap, parsed(*CHAT), TokenCount(tokens, exact, "test"), now=clock())
    assert d.max_new_tokens == budget
    assert d.kv_tokens == min(tokens, 100_000) + budget  # a decode reserve of the whole budget


@pytest.mark.parametrize(
    ("path", "body", "budget"),
    [
        ("/generate", {"text": "a"}, 128),
        ("/v1/completions", {"prompt": "a"}, 16),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 7}, 7),
    ],
)
def test_a_route_with_a_default_budget_is_priced_at_it_whatever_the_context(
    clock: ManualClock, path: str, body: dict, budget: int
) -> None:
    a = Admission(small_policy(**LANE), clock)
    snap = with_engine(snapshot(clock()), context_len=5000)
    d = demand_of(a.rules, snap, parsed(path, body), TokenCount(4990, True, "test"), now=clock())
    assert d.max_new_tokens == budget


def test_input_logprobs_reach_the_demand_and_bound_the_cache_hit(clock: ManualClock) -> None:
    """``logprob_start_len`` is passed through: SGLang matches the prefix cache only up to it, and
    computes a row of logits for every prompt position from it."""
    a = Admission(small_policy(), clock)
    body = {"text": "a", "emulator": {"prompt_tokens": 8000, "cached_tokens": 6000}}
    asks = {**body, "return_logprob": True, "logprob_start_len": 2000}
    count = TokenCount(8000, True, "declared")
    plain = demand_of(a.rules, Snapshot(), parsed("/generate", body), count, now=clock())
    d = demand_of(a.rules, Snapshot(), parsed("/generate", asks), count, now=clock())
    assert (plain.logprob_start, plain.uncached_tokens) == (None, 2000)
    assert (d.logprob_start, d.uncached_tokens) == (2000, 6000)
    assert d.projected_bytes > plain.projected_bytes


def test_an_engine_without_chunked_prefill_prefills_the_whole_prompt_in_one_step() -> None:
    """SGLang's ``chunked_prefill_size`` -1 turns chunking off (evidence MTC1): the uncached prompt is
    one extend step, so its activations are the whole uncached prompt's. Read as a chunk of -1 tokens
    the activation term went negative: a 50,000-token prompt was priced below a 1,000-token chunk's."""
    rules = rules_of(small_policy(cost__context_bytes_per_token=100).policy)
    body = parsed("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 10}})
    count = TokenCount(50_000, True, "test")
    off = demand_of(rules, snapshot(0.0, chunked_prefill_size=-1), body, count, now=0.0)
    # One 50,000-token step at the whole context: 1 KiB a chunk token plus 100 bytes a context token.
    assert off.projected_bytes == 50_000 * 1024 + 50_000 * 100
    assert (
        off.projected_bytes
        == demand_of(rules, snapshot(0.0, chunked_prefill_size=50_000), body, count, now=0.0).projected_bytes
    )
    chunked = demand_of(rules, snapshot(0.0), body, count, now=0.0)  # no engine figure: the lane's 1,000
    assert chunked.projected_bytes == 1_000 * 1024 + 50_000 * 100 < off.projected_bytes
    assert off.own_bytes(rules) == off.projected_bytes
    assert off.chunk_size == 100_000  # as long as the lane's context: any prompt is one chunk
    # SGLang reads any size of 0 or less as "off"; no figure from the engine is the lane's chunk.
    zero = demand.build(rules, 50_000, arrived_at=0.0, chunk=0)
    assert (zero.projected_bytes, zero.chunk_size) == (off.projected_bytes, 100_000)
    assert demand.build(rules, 50_000, arrived_at=0.0, chunk=None).chunk_size == 1_000
    assert demand.build(rules, 50_000, arrived_at=0.0, chunk=1).chunk_size == 1
    over = demand.build(rules, 150_000, arrived_at=0.0, chunk=-1)  # an exact count past the context
    assert (over.chunk_size, over.projected_bytes) == (150_000, 150_000 * 1024 + 150_000 * 100)
    # A cached prefix is not recomputed: the step is the uncached rest, at the whole context.
    hit = demand.build(rules, 50_000, arrived_at=0.0, cached_tokens=30_000, chunk=-1)
    assert hit.projected_bytes == 20_000 * 1024 + 50_000 * 100 == hit.own_bytes(rules)


def test_input_logprob_rows_are_the_prompt_tokens_from_their_start() -> None:
    """A row of logits per prompt token from ``logprob_start`` on, at least the last token's, at most
    a chunk's (evidence B3); the cache is reused only up to the start (B4)."""
    rules = rules_of(small_policy(cost__logprob_bytes_per_token=1000).policy)
    step = 1_000 * 1024  # a full 1,000-token chunk of activations, 1 KiB each

    def priced(start: int, cached: int = 0) -> demand.Demand:
        return demand.build(rules, 5_000, arrived_at=0.0, cached_tokens=cached, logprob_start=start)

    assert priced(4_500).projected_bytes == step + 500 * 1000
    assert priced(4_999).projected_bytes == step + 1 * 1000  # the last prompt token alone
    assert priced(5_000).projected_bytes == step + 1 * 1000  # past the prompt: still its last token
    assert priced(0).projected_bytes == step + 1_000 * 1000  # every token: a chunk's rows
    from_start = priced(0, cached=2_000)
    assert (from_start.logprob_start, from_start.cached_tokens, from_start.uncached_tokens) == (0, 0, 5_000)
    before = priced(-5, cached=2_000)  # a negative start (the intake passes none) counts from 0
    assert (before.logprob_start, before.cached_tokens) == (0, 0)
    partly = priced(1_500, cached=2_000)
    assert (partly.logprob_start, partly.cached_tokens, partly.uncached_tokens) == (1_500, 1_500, 3_500)
    assert demand.build(rules, 5_000, arrived_at=0.0).logprob_start is None


def test_a_batch_of_prompts_without_samples_is_priced_by_its_prefill_alone() -> None:
    """Eight prompts, ``n`` 1: no samples' extend batch (evidence B1 is for ``n`` > 1), so eight capped
    gathers are not charged where one prefill's is."""
    rules = rules_of(
        small_policy(cost__gather_bytes_per_context_token=1000, cost__gather_cap_bytes=1 << 20).policy
    )
    batch = demand.build(rules, 80_000, arrived_at=0.0, prompts=8)
    assert batch.sequences == 8
    assert batch.projected_bytes == 1_000 * 1024 + (1 << 20)  # a full chunk, one capped gather
    four = demand.build(rules, 80_000, arrived_at=0.0, prompts=8, samples=4)
    assert four.projected_bytes == 32 * (1024 + (1 << 20))  # 32 copies, each one token, gather capped


def test_reprice_keeps_where_input_logprobs_start() -> None:
    """A reload while a request with input logprobs is held: its rows and its cache limit stay."""
    before = rules_of(small_policy(cost__logprob_bytes_per_token=1000).policy)
    after = rules_of(small_policy(cost__logprob_bytes_per_token=3000).policy)
    d = demand.build(before, 5_000, arrived_at=0.0, cached_tokens=2_000, logprob_start=4_500)
    again = demand.reprice(after, d)
    assert (again.logprob_start, again.cached_tokens) == (4_500, 2_000)
    assert again.projected_bytes == 1_000 * 1024 + 500 * 3000


@pytest.mark.parametrize("chunk", [None, -1, 4096])
@pytest.mark.parametrize("exact", [True, False])
def test_demand_of_passes_each_figure_to_its_argument(
    clock: ManualClock, chunk: int | None, exact: bool
) -> None:
    """``demand_of`` calls ``demand.price`` positionally (per request, cheaper than ``build``'s keywords):
    every figure of the request must land in its own argument, as ``build`` by name would put it."""
    a = Admission(small_policy(**LANE), clock)
    engine = snapshot(clock()).engine
    assert engine is not None
    state = Snapshot(engine=replace(engine, chunked_prefill_size=chunk) if chunk else None)
    body = {
        "text": ["a", "b"],
        "sampling_params": [{"max_new_tokens": 300, "n": 3}, {"max_new_tokens": 200}],
        "priority": 5,
        "return_logprob": True,
        "logprob_start_len": 900,
        "emulator": {"prompt_tokens": 7000, "cached_tokens": 1234},
    }
    req = parse_generation(
        "/generate", json.dumps(body).encode(), max_body_bytes=1 << 20, accept_emulator=True
    )
    count = TokenCount(7000, exact, "declared")
    got = demand_of(a.rules, state, req, count, now=42.0, request_id="rid-1")
    want = demand.build(
        a.rules,
        7000,
        arrived_at=42.0,
        exact=exact,
        cached_tokens=1234,
        max_new_tokens=300,
        prompts=2,
        samples=3,
        priority=5,
        chunk=chunk if state.engine else None,
        request_id="rid-1",
        logprob_start=900,
    )
    assert got == want
    assert (got.prompts, got.sequences, got.cached_tokens, got.priority, got.logprob_start) == (
        2,
        6,
        900,
        5,
        900,
    )
    # Without a budget: SGLang's default for the route, as before.
    plain = parse_generation("/generate", b'{"text": "a"}', max_body_bytes=1 << 20)
    assert demand_of(a.rules, state, plain, count, now=1.0).max_new_tokens == 128
