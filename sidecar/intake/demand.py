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
    SGLang's ``parallel_sample_num``). The projection uses the engine's reported chunked-prefill size
    when it has one, else the lane's.
    """
    e = snapshot.engine
    return demand.build(
        rules,
        count.tokens,
        arrived_at=now,
        exact=count.exact,
        cached_tokens=req.declared_cached_tokens or 0,
        max_new_tokens=req.max_new_tokens,
        prompts=req.n_texts,
        samples=req.parallel_samples,
        logprob_start=req.logprob_start,
        priority=req.priority,
        chunk=e.chunked_prefill_size if e else None,
        request_id=request_id,
    )
