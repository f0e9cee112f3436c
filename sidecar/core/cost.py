"""The bytes one request's prefill allocates outside the KV pool: a sum of named terms, times a margin.

Projected per prefill chunk, the chunk full at the whole context (``docs/design.md``, the cost model,
says why); ``max_new_tokens`` never enters it, and the batch join is not a prefill term
(``CostModel.join_bytes``). To add a term: a function of ``(CostModel, Shape) -> bytes`` in ``TERMS``,
its coefficient in ``CostModel`` and in the policy's ``cost`` section.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.core.rules import CostModel
from sidecar.core.values import fast_init


@fast_init
@dataclass(frozen=True, slots=True)
class Shape:
    """What the terms may depend on."""

    prompt_tokens: int
    uncached_tokens: int
    # Tokens of the largest prefill chunk: min(uncached, chunk), and 1 for a fully cached prompt
    # (which still runs one extend step over its last token).
    chunk_tokens: int
    # Sequences the request creates (prompts x samples per prompt).
    sequences: int = 1
    # Prompt tokens of the largest chunk whose input-token logprobs the engine computes (``return_logprob``
    # with ``logprob_start_len`` >= 0): a row of logits over the vocabulary each (:func:`input_logprobs`).
    logprob_rows: int = 0


def fixed(c: CostModel, s: Shape) -> float:
    return c.fixed_bytes


def activations(c: CostModel, s: Shape) -> float:
    """Per token of the chunk being prefilled."""
    return c.activation_bytes_per_chunk_token * s.chunk_tokens


def context_temporaries(c: CostModel, s: Shape) -> float:
    """The last chunk's temporaries that grow with the whole context, on every build."""
    return c.context_bytes_per_token * s.prompt_tokens


def gather(c: CostModel, s: Shape) -> float:
    """The full-context gather; a bounded-gather build caps it."""
    g = c.gather_bytes_per_context_token * s.prompt_tokens
    return g if c.gather_cap_bytes is None else min(g, c.gather_cap_bytes)


def chunk_context(c: CostModel, s: Shape) -> float:
    """A buffer of one row per chunk token and one column per context token (a sparse-attention
    indexer's scores): the product, which a per-prompt-length projection cannot describe."""
    return c.chunk_context_bytes * s.chunk_tokens * s.prompt_tokens


def input_logprobs(c: CostModel, s: Shape) -> float:
    """Input-token logprobs: SGLang's ``LogitsProcessor`` computes full-vocabulary logits for every
    prompt token of the chunk from ``logprob_start_len`` on, in fp32, and log-softmaxes a copy of them
    (evidence B3): ``logprob_bytes_per_token`` per such row. Prefill chunks bound the rows."""
    return c.logprob_bytes_per_token * s.logprob_rows


Term = Callable[[CostModel, Shape], float]
TERMS: tuple[Term, ...] = (fixed, activations, context_temporaries, chunk_context, gather, input_logprobs)


def shape(
    prompt_tokens: int, uncached_tokens: int, chunk: int, sequences: int = 1, logprob_tokens: int = 0
) -> Shape:
    """``logprob_tokens``: prompt tokens whose input logprobs are asked for (0: none); the largest
    chunk computes at most ``min(logprob_tokens, chunk)`` rows of them."""
    chunk_tokens = min(uncached_tokens, chunk) or 1
    return Shape(prompt_tokens, uncached_tokens, chunk_tokens, sequences, min(logprob_tokens, chunk_tokens))


# What a projection past float range stands for: more bytes than any device has, so the request is
# judged unfit instead of the arithmetic raising (`chunk_context_bytes: 1e300` x chunk x context).
UNBOUNDED_BYTES = 2**63 - 1


# Projections already made, per cost model (held here, so its id is not reused while its entry
# lives): a lane's requests come in a few shapes, and a gated request projects its shape two to three
# times (demand, the guard's final peak, a re-decision); the sum of the terms was ~5 % of its CPU
# (issue #27). Bounded: the table of a cost model is emptied when full, all of them when too many.
# :func:`project_shape` keys its table by its arguments (a tuple: no ``Shape`` built or hashed).
_MEMO: dict[int, tuple[CostModel, dict[Shape, int], dict[tuple[int, ...], int]]] = {}
_MEMO_MODELS = 8
_MEMO_SHAPES = 4096


def _tables(c: CostModel) -> tuple[CostModel, dict[Shape, int], dict[tuple[int, ...], int]]:
    entry = _MEMO.get(id(c))
    if entry is None or entry[0] is not c:
        if len(_MEMO) >= _MEMO_MODELS:
            _MEMO.clear()
        entry = _MEMO[id(c)] = (c, {}, {})
    return entry


def project_bytes(c: CostModel, s: Shape, terms: tuple[Term, ...] = TERMS) -> int:
    if terms is not TERMS:
        return _project(c, s, terms)
    table = _tables(c)[1]
    found = table.get(s)
    if found is None:
        if len(table) >= _MEMO_SHAPES:
            table.clear()
        found = table[s] = _project(c, s, terms)
    return found


def project_shape(
    c: CostModel,
    prompt_tokens: int,
    uncached_tokens: int,
    chunk: int,
    sequences: int = 1,
    logprob_tokens: int = 0,
) -> int:
    """``project_bytes(c, shape(...))`` (the same arguments as :func:`shape`), memoised by the
    arguments themselves: a shape projected before costs one tuple and one lookup (issue #27)."""
    table = _tables(c)[2]
    key = (prompt_tokens, uncached_tokens, chunk, sequences, logprob_tokens)
    found = table.get(key)
    if found is None:
        if len(table) >= _MEMO_SHAPES:
            table.clear()
        found = table[key] = project_bytes(
            c, shape(prompt_tokens, uncached_tokens, chunk, sequences, logprob_tokens)
        )
    return found


def _project(c: CostModel, s: Shape, terms: tuple[Term, ...]) -> int:
    try:
        total = sum(t(c, s) for t in terms) * c.margin
    except OverflowError:  # an integer term too large for the float ones it is added to
        return UNBOUNDED_BYTES
    return min(int(total), UNBOUNDED_BYTES) if math.isfinite(total) else UNBOUNDED_BYTES


def project_samples(c: CostModel, prompt_tokens: int, prompts: int, samples: int) -> int:
    """The extend batch of ``n`` > 1 parallel samples, margin included (evidence B1, B2).

    SGLang's ``TokenizerManager`` first sends each prompt alone with ``max_new_tokens`` 0 (its prefill,
    priced by :func:`project_bytes`, caches it), waits for it, then sends ``n`` copies of each prompt
    at once. The copies reach the scheduler together and are admitted into one extend batch: each hits
    the cache for all but its last token and computes one token at the whole context. What grows with
    the context is per request in that batch (FlashInfer sizes ``kv_indices`` to the sum of the
    batch's sequence lengths), so each copy draws the context terms again: ``prompts x samples``
    one-token chunks at the prompts' context, the fixed term once. The gather is capped per copy."""
    k, n = max(1, prompts), max(1, samples)
    whole = Shape(prompt_tokens, 1, 1)  # one token of every copy, at the prompts' summed context
    # The gather is concave in the context: k gathers at the mean prompt bound the k actual ones.
    mean = Shape(max(1, -(-prompt_tokens // k)), 1, 1)
    try:
        total = (
            fixed(c, whole)
            + activations(c, whole) * k * n
            + (context_temporaries(c, whole) + chunk_context(c, whole)) * n
            + gather(c, mean) * k * n
        ) * c.margin
    except OverflowError:
        return UNBOUNDED_BYTES
    return min(int(total), UNBOUNDED_BYTES) if math.isfinite(total) else UNBOUNDED_BYTES


def project_sample_rows(
    c: CostModel, prompt_tokens: int, prompts: int, samples: int, rows: int, chunk: int
) -> int:
    """The extend batch of ``n`` > 1 parallel samples that ask for input logprobs, margin included:
    each copy matches the cache only up to ``logprob_start_len`` (evidence B4), so each recomputes its
    ``rows`` last prompt tokens, a row of logits each (B3), at its prompt's context. Every term but
    the fixed one is the copy's own (as for :func:`project_samples`), once per copy; the batch holds at
    most ``chunk`` tokens, so charging every copy at once bounds any split of them across batches."""
    k, n = max(1, prompts), max(1, samples)
    one = shape(max(1, -(-prompt_tokens // k)), rows, chunk, 1, rows)
    try:
        total = (fixed(c, one) + sum(t(c, one) for t in TERMS if t is not fixed) * k * n) * c.margin
    except OverflowError:
        return UNBOUNDED_BYTES
    return min(int(total), UNBOUNDED_BYTES) if math.isfinite(total) else UNBOUNDED_BYTES


# -- the transient at a point of the prefill (the in-flight guard and the monitor, ``core/overrun.py``) --


def project_at_progress(
    c: CostModel, prompt_tokens: int, uncached_tokens: int, chunk: int, done_tokens: int, cached_tokens: int
) -> int:
    """The most any chunk of a prefill can allocate once ``done_tokens`` of it are computed, with at
    most ``cached_tokens`` of the prompt taken from the cache, margin included.

    A chunked prefill's transient grows chunk by chunk to the last one's, which is what
    :func:`project_bytes` (the admission's figure) prices. The chunk after ``done_tokens`` has at most
    ``min(uncached, chunk)`` tokens (1 for a fully cached prompt: SGLang still runs one extend step)
    and ends at most at ``cached + done + chunk`` tokens of context, never beyond the prompt: the
    bound grows with ``done_tokens`` and reaches the final chunk's at the end. The monitor compares a
    GPU reading taken while a request prefills with this, so that a lane whose transients run 1.2x its
    coefficients is seen on the first chunks, not only near the last."""
    # min/max as comparisons: no builtin calls (~1.2k instructions each under 3.11; issue #27).
    n = (uncached_tokens if uncached_tokens < chunk else chunk) or 1
    context = (cached_tokens if cached_tokens > 0 else 0) + (done_tokens if done_tokens > 0 else 0) + n
    if prompt_tokens < context:
        context = prompt_tokens
    return project_shape(
        c, context, uncached_tokens, n
    )  # shape(context, uncached, n) is Shape(context, uncached, n)


# -- a prefill that starts its own batch (``decide``: nothing else admitted or queued ahead of it) --


def project_own(
    c: CostModel, prompt_tokens: int, uncached_tokens: int, chunk: int, extra_hit: int = 0
) -> int:
    """The peak of a prefill that starts its own prefill batch, margin included: its chunks run from
    its cache hit in full ``chunk``-token steps (SGLang's chunked request goes first in every batch),
    so its last chunk is ``L = (uncached - 1) % chunk + 1`` tokens at the whole prompt and the one
    before it a full chunk ending ``L`` tokens earlier; every other chunk is smaller than that one.

    The engine may find up to ``extra_hit`` more of the prompt cached than the gate counted (its count
    is a lower bound): each token more shortens the last chunk by one (and moves the full chunk before
    it up by one), until the last chunk wraps to a full one. The bound is taken over every such hit: at
    ``extra_hit >= L`` it is :func:`project_bytes`' full chunk at the whole context, the worst over
    every schedule. Single-chunk prompts have nothing to gain: the same figure as :func:`project_bytes`."""
    u = uncached_tokens
    if u <= chunk:
        return project_bytes(c, shape(prompt_tokens, u, chunk))
    last = (u - 1) % chunk + 1
    shortest = last - extra_hit
    if shortest < 1:  # a hit that long can make the last chunk a full one
        return project_bytes(c, Shape(prompt_tokens, u, chunk))
    final = project_bytes(c, Shape(prompt_tokens, u, last))
    before = project_bytes(c, Shape(prompt_tokens - shortest, u, chunk))
    return max(final, before)
