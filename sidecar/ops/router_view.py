"""What a router or an endpoint scorer can read from a sidecar to route well: signals of this lane now.

The sidecar does not route. It says, per lane, what a router needs and cannot see for itself:

- ``fit_prompt_tokens``: the largest *uncached* prompt the gate would admit at once right now (no
  decode tokens asked), to within 64 tokens below. Found by asking the gate itself (bisection over
  :meth:`Admission.evaluate`, which charges nothing), so it is never above what the gate would let in;
  and the gate's own projections are what keep the engine alive. 0 when nothing would be admitted now (full, held
  requests ahead, blind).
- ``capacity_prompt_tokens``: the largest uncached prompt this lane could ever run; larger ones are
  ``unfit_request`` (found the same way).
- ``headroom_bytes`` after the ledger, ``held_requests`` and the oldest held wait, the engine's queue.
- :func:`merge_engine_loads`: the engine's own ``/v1/loads`` (what the SGLang model gateway polls from
  workers, i.e. from the sidecar's data port) with the sidecar's in-flight work added: a request
  forwarded but not yet prefilled (the ledger) or held in the sidecar is waiting, whatever the
  engine's lagging gauges say. :func:`loads_view` is the same from the sidecar's own snapshot.

Computed at read time (a scrape, a GET), never per request.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from sidecar.admission.controller import Admission
from sidecar.core import demand
from sidecar.core.decide import headroom_bytes
from sidecar.core.decision import Reason
from sidecar.core.demand import Demand

FIT_RESOLUTION_TOKENS = 64  # the fit is a floor within this many tokens of the exact largest size
_last: weakref.WeakKeyDictionary[Admission, dict[str, int]] = weakref.WeakKeyDictionary()


def fit_prompt_tokens(a: Admission) -> int:
    """The largest uncached prompt (tokens) the gate would admit at once now, to within
    ``FIT_RESOLUTION_TOKENS`` below; 0 if none. Never above what the gate admits.

    Admission is monotone in the prompt (a larger prompt projects more bytes, tokens and slots), so
    a bisection finds the edge. A scrape usually finds the lane as the last one left it: the last
    answer is tried first (2 evaluations when it still holds, instead of ~20)."""
    return _edge(a, "fit", lambda d: a.evaluate(d).admitted)


def capacity_prompt_tokens(a: Admission) -> int:
    """The largest uncached prompt this lane could ever run (an idle engine); a larger one is
    ``unfit_request`` whatever happens. A router that knows it sends a request only to lanes that
    can run it, instead of learning it from a lane's refusal (and its breaker counting that)."""
    return _edge(a, "capacity", lambda d: a.evaluate(d).reason is not Reason.UNFIT_REQUEST)


def _edge(a: Admission, kind: str, ok: Callable[[Demand], bool]) -> int:
    snap = a.snapshot
    e = snap.engine
    top = ((e.context_len if e and e.context_len else None) or a.rules.lane.context_len) - 1
    chunk = e.chunked_prefill_size if e else None
    now = a.clock.now()

    def admits(n: int) -> bool:
        return ok(demand.build(a.rules, n, arrived_at=now, max_new_tokens=0, chunk=chunk))

    hints = _last.setdefault(a, {})
    hints[kind] = edge = _bisect(admits, top, hints.get(kind))
    return edge


def _bisect(admits: Callable[[int], bool], top: int, hint: int | None) -> int:
    """The largest ``n`` in [1, top] with ``admits(n)``, to within FIT_RESOLUTION_TOKENS; 0 if none.

    ``admits`` must be monotone (true up to an edge, false after it)."""
    lo, hi = 0, top + 1  # invariant: admits(lo) (0 by convention), not admits(hi) (past the top)
    if hint is not None and 0 < hint < top:
        if admits(hint):
            lo = hint
            probe = min(hint + FIT_RESOLUTION_TOKENS, top)
            if not admits(probe):
                return hint  # the edge has not moved past the resolution
            lo = probe
        else:
            hi = hint
    if lo == 0:
        if not admits(1):
            return 0
        lo = 1
    if hi == top + 1:
        if admits(top):
            return top
        hi = top
    while hi - lo > FIT_RESOLUTION_TOKENS:
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
        "capacity_prompt_tokens": capacity_prompt_tokens(a),
        "headroom_bytes": headroom_bytes(a.rules, a.snapshot, ledger),
        "held_requests": a.held,
        "oldest_held_wait_s": _round(a.oldest_wait_s()),
        "engine_queue_requests": e.queue_requests if e else None,
        "engine_running_requests": e.running_requests if e else None,
        "ledger_requests": ledger.requests,
        "ledger_prefill_tokens": ledger.prefill_tokens,
        "draining": a.draining,
    }


def inflight_extra(a: Admission, engine_waiting: int, engine_pending: int) -> tuple[int, int]:
    """What the sidecar knows is waiting beyond the engine's own counts: (requests, uncached tokens).

    The ledger's entries (forwarded, prefill not finished) may already be in the engine's gauges, so
    they count where they exceed them (the same max the gate uses); held requests are never there."""
    ledger = a.ledger.totals
    held_tokens = a.situation().held_tokens
    return (
        max(0, ledger.requests - engine_waiting) + a.held,
        max(0, ledger.prefill_tokens - engine_pending) + held_tokens,
    )


def loads_view(a: Admission) -> dict[str, Any]:
    """``GET /admission/loads``: SGLang's ``/v1/loads`` shape, one DP rank, from the sidecar's own
    snapshot, with its in-flight work added (:func:`inflight_extra`)."""
    e = a.snapshot.engine
    ledger = a.ledger.totals
    queue = (e.queue_requests or 0) if e else 0
    pending = (e.pending_prefill_tokens or 0) if e else 0
    extra_reqs, extra_tokens = inflight_extra(a, queue, pending)
    load = {
        "dp_rank": 0,
        "num_running_reqs": e.running_requests if e else None,
        "num_waiting_reqs": queue + extra_reqs,
        "num_waiting_uncached_tokens": pending + extra_tokens,
        "num_used_tokens": e.kv_used_tokens if e else None,
        "max_total_num_tokens": e.max_total_tokens if e else None,
        "max_running_requests": e.max_running_requests if e else None,
        "token_usage": e.full_token_usage if e else None,
        "sidecar": {
            "held_requests": a.held,
            "held_uncached_tokens": a.situation().held_tokens,
            "ledger_requests": ledger.requests,
            "ledger_prefill_tokens": ledger.prefill_tokens,
            "fit_prompt_tokens": fit_prompt_tokens(a),
        },
    }
    return {"version": e.version if e else None, "loads": [load]}


def merge_engine_loads(doc: object, a: Admission) -> dict[str, Any] | None:
    """The engine's own ``GET /v1/loads`` document with the sidecar's in-flight work added, for the
    routers that poll it from the worker URL (which is the sidecar's); None when ``doc`` is not that
    shape (the caller then passes the engine's answer on untouched).

    Everything the engine said is kept; only ``num_waiting_reqs`` and ``num_waiting_uncached_tokens``
    grow, on the first DP rank (the sidecar does not know which rank a request will land on; routers
    sum the ranks of a worker). Integers stay integers: SGLang's model gateway parses these fields as
    i64 and drops the whole report on a float or a null. A top-level ``sidecar`` object says what was
    added, so the view is never mistaken for the engine's own."""
    if not isinstance(doc, dict) or not isinstance(doc.get("loads"), list) or not doc["loads"]:
        return None
    ranks = doc["loads"]
    if not all(isinstance(r, dict) for r in ranks):
        return None
    waiting = sum(_count(r.get("num_waiting_reqs")) for r in ranks)
    pending = sum(_count(r.get("num_waiting_uncached_tokens")) for r in ranks)
    extra_reqs, extra_tokens = inflight_extra(a, waiting, pending)
    first = ranks[0]
    first["num_waiting_reqs"] = _count(first.get("num_waiting_reqs")) + extra_reqs
    if "num_waiting_uncached_tokens" in first or extra_tokens:
        first["num_waiting_uncached_tokens"] = _count(first.get("num_waiting_uncached_tokens")) + extra_tokens
    ledger = a.ledger.totals
    doc["sidecar"] = {
        "added_waiting_reqs": extra_reqs,
        "added_waiting_uncached_tokens": extra_tokens,
        "held_requests": a.held,
        "ledger_requests": ledger.requests,
        "ledger_prefill_tokens": ledger.prefill_tokens,
    }
    return doc


def _count(v: object) -> int:
    """A count as the engine wrote it; anything else (absent, null, a bool) counts 0."""
    if isinstance(v, bool) or not isinstance(v, int | float) or v != v or v < 0:
        return 0
    return int(v)


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)
