"""The extend batch of ``n`` > 1 parallel samples (``cost.project_samples``, evidence B1, B2), priced
copy by copy: every copy of every prompt computes one token at its prompt's whole context, what grows
with the context is allocated per copy, the fixed term once.

The coefficients are whole numbers (and the margin a power of two where sums are compared), so the
prices are exact and a test can say "equal", not "close".
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.core.cost import UNBOUNDED_BYTES, project_sample_rows, project_samples, project_shape
from sidecar.core.rules import CostModel

MiB = 1 << 20


def every_term(margin: float = 1.25, cap: int | None = 1 << 40) -> CostModel:
    """A cost model in which every term the samples' batch draws is non-zero."""
    return CostModel(
        fixed_bytes=64 * MiB,
        activation_bytes_per_chunk_token=3 * MiB,
        context_bytes_per_token=700,
        gather_bytes_per_context_token=1_100,
        gather_cap_bytes=cap,
        margin=margin,
        chunk_context_bytes=13.0,
    )


@pytest.mark.parametrize("prompt", [1, 2, 60_000])
def test_one_copy_is_the_one_token_extend_of_its_cached_prompt(prompt: int) -> None:
    """A copy hits the cache for all but its last prompt token and computes that one token at the
    whole context (evidence B1): alone, it costs what a fully cached prompt's extend step costs."""
    c = every_term()
    assert project_samples(c, prompt, 1, 1) == project_shape(c, prompt, 0, 8_192)


def test_copies_of_one_prompt_multiply_everything_but_the_fixed_term() -> None:
    c = every_term(margin=2.0)
    fixed = 2 * c.fixed_bytes
    one = project_samples(c, 60_000, 1, 1) - fixed
    for n in (2, 4, 64):
        assert project_samples(c, 60_000, 1, n) == fixed + n * one


@pytest.mark.parametrize("cap", [None, 8 * MiB])
def test_a_batch_of_prompts_prices_each_copy_at_its_own_prompt(cap: int | None) -> None:
    """``/generate`` with 3 prompts of 10,000 tokens and ``n`` 4: 12 copies in one extend batch, each
    one token at its own prompt's 10,000-token context (its gather capped alone), the fixed term once."""
    c = every_term(margin=2.0, cap=cap)
    fixed = 2 * c.fixed_bytes
    copy = project_samples(c, 10_000, 1, 1) - fixed
    assert project_samples(c, 30_000, 3, 4) == fixed + 12 * copy


def test_uneven_prompts_gather_at_their_mean_rounded_up_to_a_whole_token() -> None:
    """Prompts of 33, 33 and 34 tokens: the gathers are bounded by three gathers at the mean prompt,
    which the gate knows only from the sum (100) and prices in whole tokens, rounded up: 34 each."""
    gather_only = CostModel(
        fixed_bytes=0,
        activation_bytes_per_chunk_token=0,
        context_bytes_per_token=0,
        gather_bytes_per_context_token=1_000,
        gather_cap_bytes=None,
        margin=1.0,
    )
    priced = project_samples(gather_only, 100, 3, 2)
    assert priced == 2 * 3 * 34 * 1_000
    assert priced >= 2 * (33 + 33 + 34) * 1_000  # the copies' actual gathers


def test_a_samples_price_past_float_range_is_unbounded_not_an_error() -> None:
    """A coefficient no device has (``chunk_context_bytes`` 1e305) times the context overflows the
    float sum to infinity: the request is priced as more than any device holds, and judged unfit."""
    c = CostModel(0, 0, 0, 0, None, 1.0, chunk_context_bytes=1e305)
    assert project_samples(c, 10_000, 1, 4) == UNBOUNDED_BYTES
    assert project_shape(c, 10_000, 10_000, 8_192) == UNBOUNDED_BYTES


# -- the samples' batch with input logprobs (``cost.project_sample_rows``, evidence B3, B4) -----------


def with_rows(margin: float = 1.25) -> CostModel:
    """Every term non-zero, the input-logprob rows included; whole numbers, so prices are exact."""
    return CostModel(
        fixed_bytes=64 * MiB,
        activation_bytes_per_chunk_token=3 * MiB,
        context_bytes_per_token=700,
        gather_bytes_per_context_token=1_100,
        gather_cap_bytes=1 << 40,
        margin=margin,
        chunk_context_bytes=13.0,
        logprob_bytes_per_token=9 * MiB,
    )


def test_copies_with_input_logprobs_recompute_their_rows_each_at_their_prompt_s_context() -> None:
    """``/generate`` with 2 prompts summing 7 tokens, ``n`` 3, input logprobs over the last 3 tokens:
    6 copies, each recomputing 3 tokens (3 rows of logits) at its prompt's context, the mean prompt
    rounded up to a whole token (4), every term the copy's own, the fixed term once, margin on all."""
    c = with_rows(margin=1.25)
    ctx, rows = 4, 3
    per_copy = (
        3 * MiB * rows  # activations of the copy's recomputed tokens
        + 700 * ctx  # context temporaries
        + 13 * rows * ctx  # chunk x context
        + 1_100 * ctx  # the gather (under its cap)
        + 9 * MiB * rows  # a row of logits per recomputed token
    )
    assert project_sample_rows(c, 7, 2, 3, rows, 8_192) == int((64 * MiB + 6 * per_copy) * 1.25)
    # One prompt, one copy: the price of that prompt's own recomputed rows (no copy multiplies it).
    one = project_sample_rows(c, 7, 1, 1, rows, 8_192)
    assert one == project_shape(c, 7, rows, 8_192, 1, rows)
    # A prompt of one token still counts one token of context (never a second).
    assert project_sample_rows(c, 1, 1, 1, 1, 8_192) == project_shape(c, 1, 1, 8_192, 1, 1)


def test_copies_with_input_logprobs_past_float_range_are_unbounded() -> None:
    c = replace(with_rows(margin=1.0), chunk_context_bytes=1e300)
    assert project_sample_rows(c, 10**9, 1, 4, 8_192, 8_192) == UNBOUNDED_BYTES
