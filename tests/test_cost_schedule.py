"""The transient projection against every chunk schedule the engine model can run a prompt in.

``core/cost.py`` projects one chunk of ``min(uncached, chunk)`` tokens at the whole prompt's context.
For a request that starts its own prefill batch the last chunk is usually shorter than that (at the
old Max-Q lane's single-request limit, 284,359 tokens, it is 5,831 of 8,192: ~28 MiB of activations),
so projecting the chunk "as it is" looks like free goodput. It is not an upper bound: SGLang's
PrefillAdder (and the engine model, ``EngineModel._form_prefill_batch``) fills what is left of a batch's
chunk budget with the next waiting request, whose first chunk is then short and whose every later
chunk boundary moves, and the gate cannot know where (it does not see the engine's batches, and its
cached count is a lower bound). Over every first-chunk length the engine can choose, the largest step
is exactly a full chunk at the whole context; these tests hold the projection to that: never below
any schedule's step, and equal to the worst one (so nothing is left on the table either).
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.core.cost import project_bytes, project_own, shape
from sidecar.core.rules import CostModel
from sidecar_emulator.engine import EngineModel
from sidecar_emulator.events import FirstToken
from sidecar_emulator.profiles import MAXQ_BOUNDED, MAXQ_OLD, LaneProfile

MiB = 1 << 20


def schedule(prompt: int, cached: int, chunk: int, first: int) -> list[tuple[int, int]]:
    """(chunk tokens, context at the chunk's end) of each prefill step of one prompt whose first chunk
    is ``first`` tokens (the rest of a shared batch's budget), then full chunks. A fully cached prompt
    still computes its last token (SGLang's ``min(hit, len - 1)``)."""
    done = min(cached, prompt - 1)
    steps = []
    n = min(first, prompt - done)
    while done < prompt:
        done += n
        steps.append((n, done))
        n = min(chunk, prompt - done)
    return steps


def cost_of(p: LaneProfile, fixed: int = 0) -> CostModel:
    """The profile's own transients in the cost model's terms, margin 1: the projection's exactness."""
    return CostModel(
        fixed_bytes=fixed,
        activation_bytes_per_chunk_token=p.activation_bytes_per_token,
        context_bytes_per_token=p.context_bytes_per_token,
        gather_bytes_per_context_token=p.gather_bytes_per_token,
        gather_cap_bytes=p.gather_cap_bytes,
        margin=1.0,
    )


def true_peak(p: LaneProfile, steps: list[tuple[int, int]]) -> int:
    return max(p.transient_pieces(n, x).total for n, x in steps)


lanes = st.builds(
    lambda act, ctx, g, cap, chunk: MAXQ_OLD.replace(
        activation_bytes_per_token=act,
        context_bytes_per_token=ctx,
        gather_bytes_per_token=g,
        gather_cap_bytes=cap,
        chunked_prefill_size=chunk,
    ),
    st.integers(0, 64 * 1024),
    st.integers(0, 16 * 1024),
    st.integers(0, 8 * 1024),
    st.one_of(st.none(), st.integers(0, 2048 * MiB)),
    st.sampled_from([16, 1000, 2048, 4096, 8192, 16384]),
)


@settings(max_examples=400, deadline=None)
@given(lane=lanes, prompt=st.integers(1, 600_000), cached_frac=st.floats(0, 1), first_frac=st.floats(0, 1))
def test_the_projection_bounds_every_chunk_schedule(
    lane: LaneProfile, prompt: int, cached_frac: float, first_frac: float
) -> None:
    chunk = lane.chunked_prefill_size
    cached = int(prompt * cached_frac)
    uncached = prompt - cached
    computed = prompt - min(cached, prompt - 1)
    first = max(1, math.ceil(min(chunk, computed) * first_frac))
    projected = project_bytes(cost_of(lane), shape(prompt, uncached, chunk))
    assert projected >= true_peak(lane, schedule(prompt, cached, chunk, first))


@settings(max_examples=300, deadline=None)
@given(lane=lanes, prompt=st.integers(1, 600_000), cached_frac=st.floats(0, 1))
def test_the_projection_is_the_worst_schedule_not_more(
    lane: LaneProfile, prompt: int, cached_frac: float
) -> None:
    """Some first-chunk length puts a full chunk (or the whole uncached part) at the end: that step is
    the projection, to the byte. A shorter projected last chunk would be below it."""
    chunk = lane.chunked_prefill_size
    cached = int(prompt * cached_frac)
    computed = prompt - min(cached, prompt - 1)
    worst = max(true_peak(lane, schedule(prompt, cached, chunk, s)) for s in _firsts(computed, chunk))
    assert project_bytes(cost_of(lane), shape(prompt, prompt - cached, chunk)) == worst


def _firsts(computed: int, chunk: int) -> set[int]:
    """First-chunk lengths that include the one aligning the last chunk to a full chunk."""
    top = min(chunk, computed)
    aligned = (computed % chunk) or chunk
    return {top, min(aligned, top), 1}


def test_the_engine_model_does_shift_a_request_s_chunks() -> None:
    """Not hypothetical: a 10,000-token request ahead of a 280,000-token one on the old Max-Q lane. The
    long one gets the 6,384 tokens its neighbour's last chunk left, so its last chunk is 8,192 - 6,384
    + 1,472 = 3,280 tokens instead of the 1,472 it runs alone, 21 MiB more at the whole context."""
    alone = _steps_of(MAXQ_OLD, [("long", 280_000)])["long"]
    shared = _steps_of(MAXQ_OLD, [("short", 10_000), ("long", 280_000)])["long"]
    assert alone[0] == (8_192, 8_192) and alone[-1] == (280_000 - 34 * 8_192, 280_000)
    assert shared[0] == (6_384, 6_384) and shared[-1] == (280_000 - 6_384 - 33 * 8_192, 280_000)
    grew = true_peak(MAXQ_OLD, shared[-1:]) - true_peak(MAXQ_OLD, alone[-1:])
    assert grew == (3_280 - 1_472) * MAXQ_OLD.activation_bytes_per_token


def test_the_lane_s_limit_alone_crashes_it_behind_a_short_request() -> None:
    """The old Max-Q lane serves a cold 284,359-token prompt alone (its last chunk is 5,831 tokens);
    behind a 10,000-token request the same prompt's last chunk is 7,639 tokens and the engine dies. A
    projection of the last chunk as it runs alone would have called both safe."""
    assert _crashes(MAXQ_OLD, [("long", 284_359)]) is None
    crash = _crashes(MAXQ_OLD, [("short", 10_000), ("long", 284_359)])
    assert crash is not None and crash.requested_bytes is not None
    as_alone = 12_288 * 5_831 + MAXQ_OLD.transient_pieces(0, 284_359).total
    shifted = 12_288 * 7_639 + MAXQ_OLD.transient_pieces(0, 284_359).total
    assert as_alone <= MAXQ_OLD.idle_free_bytes < shifted
    assert project_bytes(cost_of(MAXQ_OLD), shape(284_359, 284_359, 8_192)) >= shifted


def _crashes(profile: LaneProfile, requests: list[tuple[str, int]]):  # type: ignore[no-untyped-def]
    model = EngineModel(profile)
    for rid, n in requests:
        model.submit(rid, n, max_new_tokens=1, now=0.0)
    while model.in_flight and not model.crashes:
        t = model.next_event_time()
        assert t is not None
        model.advance(t)
    return model.crashes[0] if model.crashes else None


def test_a_cached_prefix_moves_the_last_chunk_too() -> None:
    """The gate's cached count is a lower bound: the engine may hit more, and the last chunk moves with
    it. Bounded lane, 100,000 tokens of which the engine holds 40,000: 60,000 computed, last chunk 2,656."""
    steps = schedule(100_000, 40_000, 8_192, 8_192)
    assert steps[-1] == (60_000 - 7 * 8_192, 100_000)
    projected = project_bytes(cost_of(MAXQ_BOUNDED), shape(100_000, 100_000, 8_192))  # seen as cold
    assert projected >= true_peak(MAXQ_BOUNDED, steps)


def _steps_of(profile: LaneProfile, requests: list[tuple[str, int]]) -> dict[str, list[tuple[int, int]]]:
    """Each request's (chunk tokens, context at its end) as the engine model prefilled them."""
    model = EngineModel(profile)
    steps: dict[str, list[tuple[int, int]]] = {rid: [] for rid, _ in requests}
    for rid, n in requests:
        model.submit(rid, n, max_new_tokens=1, now=0.0)
    done: set[str] = set()
    while len(done) < len(requests):
        step = model._step
        assert step is not None and step.kind == "prefill", "only prefills run until every first token"
        for req, n in step.items:
            steps[req.rid].append((n, req.prefilled + n))
        t = model.next_event_time()
        assert t is not None
        done |= {e.rid for e in model.advance(t) if isinstance(e, FirstToken)}
    assert not model.crashes
    return steps


# -- a request that starts its own prefill batch (core/cost.project_own, core/decide) ---------------


@settings(max_examples=400, deadline=None)
@given(lane=lanes, prompt=st.integers(1, 600_000), cached_frac=st.floats(0, 1))
def test_a_request_starting_its_own_batch_is_priced_at_its_own_schedule_s_peak(
    lane: LaneProfile, prompt: int, cached_frac: float
) -> None:
    """Its first chunk is a full one from its cache hit, then full chunks: the projection is that
    schedule's largest step, to the byte (never below it, and nothing left on the table)."""
    chunk = lane.chunked_prefill_size
    cached = int(prompt * cached_frac)
    own = project_own(cost_of(lane), prompt, prompt - cached, chunk)
    assert own == true_peak(lane, schedule(prompt, cached, chunk, chunk))
    assert own <= project_bytes(cost_of(lane), shape(prompt, prompt - cached, chunk))


@settings(max_examples=300, deadline=None)
@given(
    lane=lanes.filter(lambda p: p.chunked_prefill_size >= 1000),
    prompt=st.integers(1, 120_000),
    cached_frac=st.floats(0, 1),
    extra=st.integers(0, 80),
)
def test_a_larger_cache_hit_than_counted_is_bounded_too(
    lane: LaneProfile, prompt: int, cached_frac: float, extra: int
) -> None:
    """The gate's cached count is a lower bound. With up to ``extra`` tokens more found cached, the
    bound is the largest step over every such schedule, to the byte."""
    chunk = lane.chunked_prefill_size
    cached = int(prompt * cached_frac)
    bound = project_own(cost_of(lane), prompt, prompt - cached, chunk, extra)
    peaks = [true_peak(lane, schedule(prompt, cached + x, chunk, chunk)) for x in range(extra + 1)]
    assert bound == max(peaks)


def test_a_hit_that_wraps_the_last_chunk_costs_a_full_chunk_at_the_whole_context() -> None:
    """284,359 tokens cold on the old Max-Q lane: the last chunk is 5,831 tokens alone; 5,831 more
    cached tokens than counted make it a full one, and a chunk's worth of doubt is the worst case."""
    c = cost_of(MAXQ_OLD)
    worst = project_bytes(c, shape(284_359, 284_359, 8_192))
    alone = project_own(c, 284_359, 284_359, 8_192)
    assert alone == true_peak(MAXQ_OLD, schedule(284_359, 0, 8_192, 8_192)) < worst
    assert project_own(c, 284_359, 284_359, 8_192, 5_830) < worst
    assert project_own(c, 284_359, 284_359, 8_192, 5_831) == worst
    assert project_own(c, 284_359, 284_359, 8_192, 6_000) == worst


def test_the_engine_model_runs_a_lone_request_at_its_own_schedule_and_a_newcomer_does_not_move_it() -> None:
    """Alone, the 284,359 tokens the old Max-Q lane serves run in full chunks from the start (peak =
    the own projection, under the idle budget). A short request sent after a long one's first batch
    only takes what the long one's last chunk leaves: the chunked request goes first in every batch
    (SGLang's ``add_chunked_req``, and the model's), so the long one's steps do not move."""
    alone = _steps_of(MAXQ_OLD, [("long", 284_359)])["long"]
    assert true_peak(MAXQ_OLD, alone) == project_own(cost_of(MAXQ_OLD), 284_359, 284_359, 8_192)
    assert true_peak(MAXQ_OLD, alone) <= MAXQ_OLD.idle_free_bytes
    model = EngineModel(MAXQ_OLD)
    model.submit("long", 250_000, max_new_tokens=1, now=0.0)
    steps: list[tuple[int, int]] = []
    for i in range(40):
        step = model._step
        assert step is not None and not model.crashes
        steps += [(n, req.prefilled + n) for req, n in step.items if req.rid == "long"]
        t = model.next_event_time()
        assert t is not None
        if any(isinstance(e, FirstToken) and e.rid == "long" for e in model.advance(t)):
            break
        if i == 0:
            model.submit("short", 10_000, max_new_tokens=1, now=model.now)
    assert steps == _steps_of(MAXQ_OLD, [("long", 250_000)])["long"]
    assert steps[-1] == (250_000 % 8_192, 250_000)
