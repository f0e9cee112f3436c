"""What one request will ask of the lane: tokens for the KV pool, slots, and bytes outside the pool.

The projection is per prefill chunk, not per prompt: SGLang prefills ``chunked_prefill_size`` tokens at
a time, so activations scale with ``min(uncached, chunk)``. The last chunk attends over the whole
request, so two terms grow with the context: temporaries that do on every build, and the full-context
gather that a bounded-gather build caps (1,024 MiB at 524,288 tokens on the old build, 32 MiB on the
bounded one). ``max_new_tokens`` never enters the transient.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.policy import Policy
from sidecar.requests import GenerationRequest
from sidecar.tokens import TokenCount


@dataclass(frozen=True, slots=True)
class RequestCost:
    prompt_tokens: int
    # Count from a tokenizer, input_ids or the engine: exact. From the bytes bound: an over-estimate.
    exact: bool = True
    cached_tokens: int = 0
    max_new_tokens: int = 0
    priority: int = 0
    projected_bytes: int = 0
    chunk_tokens: int = 0
    # The chunked-prefill size the projection used (the engine's, else the policy's lane).
    chunk_size: int = 0
    # Not an input to the decision: ties a request's decision-log lines together (hold, then admit).
    request_id: str = ""

    @property
    def uncached_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)


def project_bytes(policy: Policy, prompt_tokens: int, uncached_tokens: int, chunk: int) -> int:
    c = policy.cost
    chunk_tokens = min(uncached_tokens, chunk)
    gather = c.gather_bytes_per_context_token * prompt_tokens
    if c.gather_cap_bytes is not None:
        gather = min(gather, c.gather_cap_bytes)
    if uncached_tokens == 0:
        # A fully cached prompt still runs one extend step over the last token.
        chunk_tokens = 1
    context = c.context_bytes_per_token * prompt_tokens
    return int(
        (c.fixed_bytes + c.activation_bytes_per_chunk_token * chunk_tokens + context + gather) * c.margin
    )


def request_cost(
    policy: Policy,
    prompt_tokens: int,
    *,
    exact: bool = True,
    cached_tokens: int = 0,
    max_new_tokens: int | None = None,
    priority: int | None = None,
    chunk: int | None = None,
    request_id: str = "",
) -> RequestCost:
    """Build the cost once per request, off the decision: the gate re-reads it on every wake-up."""
    chunk = chunk or policy.lane.chunked_prefill_size
    if not exact:
        # An over-estimate beyond the context would hold the request for ever (no pool is that big);
        # a prompt really that long is refused by the engine itself with a 400, before any prefill.
        prompt_tokens = min(prompt_tokens, policy.lane.context_len)
    cached = min(max(0, cached_tokens), prompt_tokens)
    uncached = prompt_tokens - cached
    return RequestCost(
        prompt_tokens=prompt_tokens,
        exact=exact,
        cached_tokens=cached,
        max_new_tokens=max(0, max_new_tokens or 0),
        priority=priority or 0,
        projected_bytes=project_bytes(policy, prompt_tokens, uncached, chunk),
        chunk_tokens=min(uncached, chunk),
        chunk_size=chunk,
        request_id=request_id,
    )


def repriced(policy: Policy, c: RequestCost) -> RequestCost:
    """The same request priced under another policy (a reload while it is held)."""
    return request_cost(
        policy,
        c.prompt_tokens,
        exact=c.exact,
        cached_tokens=c.cached_tokens,
        max_new_tokens=c.max_new_tokens,
        priority=c.priority,
        chunk=c.chunk_size or None,
        request_id=c.request_id,
    )


def request_cost_of(
    policy: Policy, req: GenerationRequest, count: TokenCount, *, chunk: int | None, request_id: str = ""
) -> RequestCost:
    """The cost of a parsed request and its token count (the proxy and ``explain`` share this)."""
    return request_cost(
        policy,
        count.tokens,
        exact=count.exact,
        cached_tokens=req.declared_cached_tokens or 0,
        max_new_tokens=req.max_new_tokens,
        priority=req.priority,
        chunk=chunk,
        request_id=request_id,
    )
