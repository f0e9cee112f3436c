"""What a router or an endpoint scorer can read from a sidecar to route well: signals of this lane now.

The sidecar does not route. It says, per lane, what a router needs and cannot see for itself:

- ``fit_prompt_tokens``: the largest *uncached* prompt the gate would admit at once right now (no
  decode tokens asked). Found by asking the gate itself (binary search over :meth:`Admission.evaluate`,
  which charges nothing), so it is never above what the gate would let in; and the gate's own
  projections are what keep the engine alive. 0 when nothing would be admitted now (full, held
  requests ahead, blind).
- ``headroom_bytes`` after the ledger, ``held_requests`` and the oldest held wait, the engine's queue.
- :func:`loads_view`: SGLang's ``/v1/loads`` shape (what the SGLang model gateway polls from workers)
  with the sidecar's in-flight work added: a request forwarded but not yet prefilled (the ledger) or
  held in the sidecar is waiting, whatever the engine's lagging gauges say.

Computed at read time (a scrape, a GET), never per request.
"""

from __future__ import annotations

from typing import Any

from sidecar.admission import Admission
from sidecar.core import demand
from sidecar.core.decide import headroom_bytes


def fit_prompt_tokens(a: Admission) -> int:
    """The largest uncached prompt (tokens) the gate would admit at once now; 0 if none."""
    snap = a.snapshot
    e = snap.engine
    hi = (e.context_len if e and e.context_len else None) or a.rules.lane.context_len
    chunk = e.chunked_prefill_size if e else None
    now = a.clock.now()

    def admits(n: int) -> bool:
        d = demand.build(a.rules, n, arrived_at=now, max_new_tokens=0, chunk=chunk)
        return a.evaluate(d).admitted

    if not admits(1):
        return 0
    lo = 1  # admits(lo) holds; find the largest such lo below the context
    hi = hi - 1  # a prompt must leave room for one new token
    if admits(hi):
        return hi
    while hi - lo > 1:  # the projection grows with the prompt: admission is monotone in it
        mid = (lo + hi) // 2
        if admits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def signals(a: Admission) -> dict[str, Any]:
    """``GET /admission/signals``: this lane's routing signals; unknown values are null, never 0."""
    e = a.snapshot.engine
    ledger = a.ledger.totals
    return {
        "fit_prompt_tokens": fit_prompt_tokens(a),
        "headroom_bytes": headroom_bytes(a.rules, a.snapshot, ledger),
        "held_requests": a.held,
        "oldest_held_wait_s": _round(a.oldest_wait_s()),
        "engine_queue_requests": e.queue_requests if e else None,
        "engine_running_requests": e.running_requests if e else None,
        "ledger_requests": ledger.requests,
        "ledger_prefill_tokens": ledger.prefill_tokens,
        "draining": a.draining,
    }


def loads_view(a: Admission) -> dict[str, Any]:
    """``GET /admission/loads``: SGLang's ``/v1/loads`` shape, one DP rank, with the sidecar's
    in-flight work added. Waiting = max(engine's queue, ledger) + held; waiting uncached tokens =
    max(engine's pending, ledger's) + held tokens (the same max the gate uses: the ledger's entries may
    already be in the engine's gauge)."""
    e = a.snapshot.engine
    ledger = a.ledger.totals
    queue = (e.queue_requests or 0) if e else 0
    pending = (e.pending_prefill_tokens or 0) if e else 0
    held_tokens = a.situation().held_tokens
    load = {
        "dp_rank": 0,
        "num_running_reqs": e.running_requests if e else None,
        "num_waiting_reqs": max(queue, ledger.requests) + a.held,
        "num_waiting_uncached_tokens": max(pending, ledger.prefill_tokens) + held_tokens,
        "num_used_tokens": e.kv_used_tokens if e else None,
        "max_total_num_tokens": e.max_total_tokens if e else None,
        "max_running_requests": e.max_running_requests if e else None,
        "token_usage": e.full_token_usage if e else None,
        "sidecar": {
            "held_requests": a.held,
            "held_uncached_tokens": held_tokens,
            "ledger_requests": ledger.requests,
            "ledger_prefill_tokens": ledger.prefill_tokens,
            "fit_prompt_tokens": fit_prompt_tokens(a),
        },
    }
    return {"version": e.version if e else None, "loads": [load]}


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)
