"""What one request will ask of the lane, computed once at intake: the decision re-reads it on every
wake-up of the hold queue, and the ledger books what the decision hands back.

Every sequence the request creates is counted. A ``/generate`` batch of 8 prompts, or ``n: 8``
(SGLang's ``parallel_sample_num``), is 8 sequences: 8 entries in the engine's queue, 8 Mamba working
states, 8 decode reserves in the KV pool. The prompts themselves are prefilled once each: with
``n`` > 1 SGLang first prefills every prompt alone to cache it, and the samples then share that
prefix, so the prompt's KV does not multiply with ``n``. The transient does, in part: the ``n``
copies are then admitted together as one extend batch of one token each at the whole context, and
what grows with the context is allocated per copy (``cost.project_samples``, evidence B1, B2). The
projection is the larger of the prompt's prefill and that batch.

Input-token logprobs (``return_logprob`` with ``logprob_start_len`` >= 0) add a row of logits per
prompt token of a chunk from that position on, and stop the engine from reusing the cache beyond it
(evidence B3, B4). With ``n`` > 1 each copy then recomputes the prompt from that position, its rows
included, in the copies' one batch (``cost.project_sample_rows``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sidecar.core.cost import project_own, project_sample_rows, project_samples, project_shape
from sidecar.core.rules import Rules
from sidecar.core.values import fast_init, positional


@fast_init
@dataclass(frozen=True, slots=True)
class Demand:
    """A frozen value; ``build`` is the only place that derives its quantities."""

    # Ties a request's decision-log lines together (hold, then admit); not an input to the decision.
    request_id: str
    # Prompts the engine prefills, and sequences it runs (prompts x samples per prompt).
    prompts: int
    sequences: int
    # Sum over the prompts. Exact from a tokenizer, ids or the engine; else an over-estimate.
    prompt_tokens: int
    exact: bool
    cached_tokens: int
    uncached_tokens: int
    max_new_tokens: int
    # KV pool tokens: the uncached prompts plus the decode reserve of every sequence.
    kv_tokens: int
    # Mamba state slots if the lane has a pool: a working state per sequence plus prefill checkpoints.
    mamba_slots: int
    # Bytes outside the KV pool the largest prefill chunk allocates (``core/cost.py``).
    projected_bytes: int
    # The chunked-prefill size the projection used (the engine's, else the lane's; the lane's context
    # where the engine runs without chunking: every prompt is one chunk).
    chunk_size: int
    priority: int
    # When it arrived and the latest time it may leave the hold queue (``hold.max_wait_s`` later).
    arrived_at: float
    deadline: float
    # Admitted priced by its own chunk schedule (``decide``: it starts its own prefill batch).
    own_schedule: bool = False
    # First prompt position whose input logprob the engine computes; None: none (SGLang's -1).
    logprob_start: int | None = None

    def own_bytes(self, rules: Rules) -> int:
        """Its peak when it starts its own prefill batch (``cost.project_own``), computed only where
        a decision considers it (rarely: the full-chunk projection did not fit). Samples and input
        logprobs have no own schedule: their full projection."""
        if self.sequences > self.prompts or self.logprob_start is not None:
            return self.projected_bytes
        return project_own(rules.cost, self.prompt_tokens, self.uncached_tokens, self.chunk_size)


def build(
    rules: Rules,
    prompt_tokens: int,
    *,
    arrived_at: float,
    exact: bool = True,
    cached_tokens: int = 0,
    max_new_tokens: int | None = None,
    prompts: int = 1,
    samples: int = 1,
    priority: int | None = None,
    chunk: int | None = None,
    request_id: str = "",
    own_schedule: bool = False,
    logprob_start: int | None = None,
) -> Demand:
    """The demand of a request of ``prompt_tokens`` (summed over its ``prompts``), each prompt run as
    ``samples`` sequences; ``chunk``: the engine's chunked-prefill size (None: the lane's)."""
    return price(
        rules,
        prompt_tokens,
        arrived_at,
        exact,
        cached_tokens,
        max_new_tokens,
        prompts,
        samples,
        priority,
        chunk,
        request_id,
        own_schedule,
        logprob_start,
    )


def price(
    rules: Rules,
    prompt_tokens: int,
    arrived_at: float,
    exact: bool,
    cached_tokens: int,
    max_new_tokens: int | None,
    prompts: int,
    samples: int,
    priority: int | None,
    chunk: int | None,
    request_id: str,
    own_schedule: bool,
    logprob_start: int | None,
) -> Demand:
    """:func:`build`, every argument positional: once per gated request (``intake.demand.demand_of``),
    where a 12-keyword call cost more than the arithmetic (issue #27)."""
    # Conditions, not min()/max(): the same figures for a fraction of the calls.
    lane = rules.lane
    if not exact and prompt_tokens > lane.context_len:
        # An over-estimate beyond the context would hold the request for ever (no pool is that big);
        # a prompt really that long is refused by the engine itself with a 400, before any prefill.
        prompt_tokens = lane.context_len
    if chunk is None:
        chunk = lane.chunked_prefill_size
    elif chunk <= 0:
        # The engine's -1 (SGLang reads any size <= 0 so): chunked prefill off, the whole uncached
        # prompt in one extend step (evidence MTC1). A chunk as long as any prompt the lane takes.
        chunk = max(prompt_tokens, lane.context_len)
    cached = cached_tokens if cached_tokens > 0 else 0
    if cached > prompt_tokens:
        cached = prompt_tokens
    logprob_tokens = 0
    if logprob_start is not None:
        logprob_start = max(0, logprob_start)
        # SGLang matches the prefix cache only up to logprob_start_len (Req.init_next_round_input).
        cached = min(cached, logprob_start)
        logprob_tokens = max(1, prompt_tokens - logprob_start)
    uncached = prompt_tokens - cached
    if prompts < 1:
        prompts = 1
    sequences = prompts * samples if samples > 1 else prompts
    projected = project_shape(rules.cost, prompt_tokens, uncached, chunk, sequences, logprob_tokens)
    if sequences > prompts:
        copies = sequences // prompts
        projected = max(projected, project_samples(rules.cost, prompt_tokens, prompts, copies))
        if logprob_tokens:
            # Every copy recomputes its rows from logprob_start (B3, B4), not one token each.
            rows = project_sample_rows(rules.cost, prompt_tokens, prompts, copies, logprob_tokens, chunk)
            projected = max(projected, rows)
    max_new = max_new_tokens if max_new_tokens is not None and max_new_tokens > 0 else 0
    # Every field, positionally in their order (``_make_demand``), each named beside it.
    return _make_demand(
        request_id,
        prompts,
        sequences,
        prompt_tokens,
        exact,
        cached,  # cached_tokens
        uncached,  # uncached_tokens
        max_new,  # max_new_tokens
        uncached + math.ceil(rules.kv.decode_reserve_fraction * max_new * sequences),  # kv_tokens
        0 if rules.mamba is None else _mamba_slots(rules, prompt_tokens, prompts, sequences),  # mamba_slots
        projected,  # projected_bytes
        chunk,  # chunk_size
        priority or 0,  # priority
        arrived_at,
        arrived_at + rules.hold.max_wait_s,  # deadline
        own_schedule,
        logprob_start,
    )


_make_demand = positional(Demand)


def _mamba_slots(rules: Rules, prompt_tokens: int, prompts: int, sequences: int) -> int:
    m = rules.mamba
    if m is None:
        return 0
    checkpoints = 0
    if m.checkpoint_interval_tokens:
        # Each prompt's last partial interval rounds up: at most one more checkpoint per extra prompt.
        checkpoints = math.ceil(prompt_tokens / m.checkpoint_interval_tokens) + prompts - 1
    return m.slots_per_request * sequences + checkpoints


def reprice(rules: Rules, d: Demand) -> Demand:
    """The same request priced under another policy (a reload while it is held)."""
    return build(
        rules,
        d.prompt_tokens,
        exact=d.exact,
        cached_tokens=d.cached_tokens,
        max_new_tokens=d.max_new_tokens,
        prompts=d.prompts,
        samples=d.sequences // d.prompts,
        priority=d.priority,
        chunk=d.chunk_size,
        request_id=d.request_id,
        arrived_at=d.arrived_at,
        own_schedule=d.own_schedule,
        logprob_start=d.logprob_start,
    )
