"""Parallel sampling (``n`` > 1) and input-token logprobs, priced as SGLang runs them (evidence B1-B4):
the emulator's engine allocates what SGLang's code allocates, and the demand covers it."""

from __future__ import annotations

import json

import pytest

from sidecar.core import demand
from sidecar.intake.body import parse_generation
from sidecar.policy.in_force import rules_of
from sidecar_emulator.engine import EngineModel
from sidecar_emulator.events import Finished, FirstToken
from sidecar_emulator.profiles import LaneProfile, get_profile
from tests.conftest import small_policy

# The bounded-gather lane without noise or the batch join, so one request's peak is its prefill's.
PROFILE = get_profile("maxq-bounded").replace(transient_noise=0.0, unknown_extra_bytes=0)


def rules_for(p: LaneProfile):
    """A policy whose cost terms are the profile's own, at margin 1: exact pricing of its model."""
    return rules_of(
        small_policy(
            lane__chunked_prefill_size=p.chunked_prefill_size,
            lane__context_len=p.context_length,
            lane__kv_pool_tokens=p.kv_pool_tokens,
            cost__activation_bytes_per_chunk_token=p.activation_bytes_per_token,
            cost__context_bytes_per_token=p.context_bytes_per_token,
            cost__gather_bytes_per_context_token=p.gather_bytes_per_token,
            cost__gather_cap_bytes=p.gather_cap_bytes,
            cost__logprob_bytes_per_token=p.logprob_bytes_per_token,
        ).policy
    )


def run_one(p: LaneProfile, prompt: int, **kw: object) -> tuple[int, list[object]]:
    """The engine's peak allocation outside the pool for one request, and the client's events."""
    e = EngineModel(p)
    idle_used = e.total_bytes - e.free_bytes()
    e.submit("r", prompt, max_new_tokens=4, now=0.0, **kw)
    events: list[object] = []
    t = 0.0
    while e.in_flight:
        t = e.next_event_time() or t + 1.0
        events += [ev for ev in e.advance(t) if getattr(ev, "rid", None) == "r"]
    assert not e.crashes
    return e.peak_used_bytes - idle_used, events


def test_parallel_samples_draw_the_context_terms_once_per_copy() -> None:
    prompt, n = 60_000, 4
    peak, events = run_one(PROFILE, prompt, samples=n)
    alone, _ = run_one(PROFILE, prompt)
    rules = rules_for(PROFILE)
    priced = demand.build(rules, prompt, arrived_at=0.0, max_new_tokens=4, samples=n).projected_bytes
    # The copies' extend batch draws more than the prompt's own prefill: the old "does not multiply
    # with n" price is under what the engine allocates; the new one covers it.
    assert peak > alone
    assert demand.build(rules, prompt, arrived_at=0.0, max_new_tokens=4).projected_bytes < peak <= priced
    # The client sees one request: one first token, one end with every copy's tokens.
    assert [type(ev) for ev in events if isinstance(ev, FirstToken | Finished)] == [FirstToken, Finished]
    assert events[-1].completion_tokens == n * 4


def test_samples_price_is_per_copy_and_the_prompt_kv_is_not() -> None:
    rules = rules_for(PROFILE)
    one = demand.build(rules, 100_000, arrived_at=0.0, max_new_tokens=10)
    four = demand.build(rules, 100_000, arrived_at=0.0, max_new_tokens=10, samples=4)
    c = rules.cost
    per_copy = c.activation_bytes_per_chunk_token + c.context_bytes_per_token * 100_000 + c.gather_cap_bytes
    assert four.projected_bytes == max(one.projected_bytes, 4 * per_copy)
    assert four.kv_tokens == one.kv_tokens == 100_000
    assert four.own_bytes(rules) == four.projected_bytes  # no own-schedule discount for copies


def test_input_logprobs_allocate_a_row_of_logits_per_prompt_token_of_a_chunk() -> None:
    prompt, start = 40_000, 40_000 - 500
    peak, _ = run_one(PROFILE, prompt, logprob_start=start)
    plain, _ = run_one(PROFILE, prompt)
    assert peak - plain == 500 * PROFILE.logprob_bytes_per_token
    rules = rules_for(PROFILE)
    priced = demand.build(rules, prompt, arrived_at=0.0, logprob_start=start).projected_bytes
    assert demand.build(rules, prompt, arrived_at=0.0).projected_bytes < peak <= priced


def test_input_logprobs_stop_cache_reuse_at_their_start() -> None:
    rules = rules_for(PROFILE)
    d = demand.build(rules, 50_000, arrived_at=0.0, cached_tokens=40_000, logprob_start=100)
    assert (d.cached_tokens, d.uncached_tokens) == (100, 49_900)
    # A whole chunk of rows: one 8,192-token chunk of logits is ~9.3 GiB on a 151,936-entry vocabulary.
    full = demand.build(rules, 50_000, arrived_at=0.0, logprob_start=0).projected_bytes
    assert full >= PROFILE.chunked_prefill_size * 8 * 151_936


@pytest.mark.parametrize(
    ("body", "start"),
    [
        ({"text": "a", "return_logprob": True, "logprob_start_len": 0}, 0),
        ({"text": "a", "return_logprob": True}, None),  # SGLang's default -1: output logprobs only
        ({"text": "a", "return_logprob": True, "logprob_start_len": -1}, None),
        ({"text": "a", "return_logprob": True, "logprob_start_len": -5}, None),  # negative: none, as -1
        ({"text": "a", "return_logprob": False, "logprob_start_len": 0}, None),
        ({"text": ["a", "b"], "return_logprob": [False, True], "logprob_start_len": [0, 7]}, 7),
        ({"text": ["a", "b"], "return_logprob": True, "logprob_start_len": [9, 3]}, 3),
    ],
)
def test_generate_body_names_where_input_logprobs_start(body: dict, start: int | None) -> None:
    req = parse_generation("/generate", json.dumps(body).encode(), max_body_bytes=1 << 20)
    assert req.logprob_start == start


def test_openai_routes_never_ask_for_prompt_logprobs() -> None:
    body = {"model": "m", "prompt": "a", "echo": True, "logprobs": 5}
    req = parse_generation("/v1/completions", json.dumps(body).encode(), max_body_bytes=1 << 20)
    assert req.logprob_start is None


def test_a_bad_logprob_start_names_the_field() -> None:
    body = {"text": ["a", "b"], "return_logprob": True, "logprob_start_len": [0, "x"]}
    with pytest.raises(Exception, match=r"logprob_start_len\[1\]"):
        parse_generation("/generate", json.dumps(body).encode(), max_body_bytes=1 << 20)


@pytest.mark.parametrize("n", [2, 4])
def test_parallel_samples_with_input_logprobs_are_priced_per_copy(n: int) -> None:
    """With input logprobs every copy recomputes its prompt from ``logprob_start`` (the cache match
    stops there, B4), logits rows included (B3), in the copies' one extend batch: the engine's peak
    grows with ``n`` (1,443 MiB at n = 2, 2,886 at n = 4 on this lane for these 500 rows), and the
    price covers it (it was 811 MiB for both: the rows counted once, the copies one token each)."""
    prompt, start = 40_000, 40_000 - 500
    peak, _ = run_one(PROFILE, prompt, samples=n, logprob_start=start)
    one, _ = run_one(PROFILE, prompt, samples=1, logprob_start=start)
    assert peak > one
    rules = rules_for(PROFILE)
    priced = demand.build(rules, prompt, arrived_at=0.0, samples=n, logprob_start=start).projected_bytes
    assert peak <= priced
    # And not by a wide margin: the copies' rows are at most what the price charges for them.
    assert priced <= 1.25 * peak
