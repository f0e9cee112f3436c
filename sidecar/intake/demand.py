"""Intake: from what the shell knows (a validated policy, a parsed request, its token count) to the
core's plain values (``Rules``, ``Demand``). The only place that reads pydantic models or HTTP bodies
on behalf of the decision.
"""

from __future__ import annotations

from typing import Any, TypeVar

from sidecar.core import demand
from sidecar.core.demand import Demand
from sidecar.core.rules import (
    Rules,
)
from sidecar.core.snapshot import Snapshot
from sidecar.intake.body import GenerationRequest
from sidecar.intake.tokens import TokenCount

T = TypeVar("T", bound=Any)

# What SGLang generates when a body leaves the output budget out (evidence T3): /generate's
# SamplingParams.max_new_tokens defaults to 128, /v1/completions' max_tokens to 16; the chat-shaped
# routes pass None, which the scheduler turns into the rest of the context (None here). Routes that
# only prefill (embeddings, classify, score, rerank) generate nothing.
DEFAULT_MAX_NEW_TOKENS: dict[str, int | None] = {
    "generate": 128,
    "explain": 128,
    "completions": 16,
    "embedding": 0,
    "input": 0,
    "score": 0,
    "rerank": 0,
    "decisions": 0,
    "systemone": 0,
}


def output_budget(req: GenerationRequest, tokens: int, exact: bool, context_len: int) -> int:
    """The body's output budget, or what SGLang would use without one: never 0 for a route that
    generates (a missing ``max_new_tokens`` priced at 0 let a million sequences in at no decode cost)."""
    if req.max_new_tokens is not None:
        return req.max_new_tokens
    if req.kind in DEFAULT_MAX_NEW_TOKENS:
        default = DEFAULT_MAX_NEW_TOKENS[req.kind]
        assert default is not None
        return default
    # The rest of the context; an estimated count is an over-estimate, so the rest may be more.
    return max(0, context_len - tokens) if exact else context_len


def demand_of(
    rules: Rules,
    snapshot: Snapshot,
    req: GenerationRequest,
    count: TokenCount,
    *,
    now: float,
    request_id: str = "",
) -> Demand:
    """The demand of a parsed request and its token count (the proxy and ``explain`` share this).

    Every sequence is counted: the prompts of a batch (``n_texts``) times the samples of each (``n``,
    ``best_of``, SGLang's ``parallel_sample_num``). A body without an output budget is priced at
    SGLang's default for its route (``output_budget``). The projection uses the engine's reported chunked-prefill size
    when it has one, else the lane's.
    """
    e = snapshot.engine
    budget = req.max_new_tokens
    if budget is None:
        context_len = (e.context_len if e else None) or rules.lane.context_len
        budget = output_budget(req, count.tokens, count.exact, context_len)
    # Positional (``demand.price``: ``demand.build``'s arguments in its order), once per request.
    return demand.price(
        rules,
        count.tokens,
        now,  # arrived_at
        count.exact,
        req.declared_cached_tokens or 0,  # cached_tokens
        budget,  # max_new_tokens
        req.n_texts,  # prompts
        req.parallel_samples,  # samples
        req.priority,
        e.chunked_prefill_size if e else None,  # chunk
        request_id,
        False,  # own_schedule
        req.logprob_start,
    )
