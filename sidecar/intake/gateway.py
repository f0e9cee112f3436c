"""Fields of a request body that only a trusted gateway may set, found and (where the policy says)
stripped before the engine sees the body.

Why: SGLang takes some fields from whoever sends the body and trusts them. ``bootstrap_host`` /
``bootstrap_port`` / ``bootstrap_room`` name the prefill server a disaggregated decode server pulls
KV cache from; sent to a lane that is not disaggregated, with a long prompt, one exhausted the KV
pool and killed the server (sgl-project/sglang issue #36855, open); a duplicate client-set
``bootstrap_room`` crashes both schedulers of a disaggregated pair (#40125, open). ``routed_dp_rank`` (and its
deprecated ``data_parallel_rank``) and ``disagg_prefill_dp_rank`` pin a request to a data-parallel
worker, the router's job. ``custom_logit_processor`` is a serialized callable the engine runs when
started with ``--enable-custom-logit-processor``. The policy's ``gateway_fields`` names them and says
what a client's copy gets: refused (400), stripped, or passed (a lane behind a gateway that sets them).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from sidecar.policy.engine_routes import DEFAULT_GATEWAY_FIELDS

__all__ = ["DEFAULT_GATEWAY_FIELDS", "gateway_fields_in", "without_fields"]


def gateway_fields_in(obj: Mapping[str, Any], names: Iterable[str]) -> tuple[str, ...]:
    """The gateway-only fields the body sets (a null counts as unset: it is SGLang's default)."""
    if isinstance(names, tuple) and _name_set(names).isdisjoint(obj):
        return ()  # every request but a gateway's: one set operation, no lookup per name
    found: tuple[str, ...] = ()
    for name in names:  # on every gated request: a loop, and nothing built when none is set
        if obj.get(name) is not None:
            found += (name,)
    return found


@functools.lru_cache(maxsize=16)
def _name_set(names: tuple[str, ...]) -> frozenset[str]:
    return frozenset(names)


def without_fields(body: bytes | bytearray, names: Iterable[str]) -> bytes:
    """The body re-encoded without ``names`` (top-level keys only, where SGLang reads them).

    The proxy otherwise forwards a body's bytes unchanged; only a body that carries such a field is
    decoded whole and written again. The standard parser decides what orjson refuses (integers over
    64 bits), as the body parser does."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        import json

        obj = json.loads(body)
        drop = set(names)
        return json.dumps({k: v for k, v in obj.items() if k not in drop}).encode()
    drop = set(names)
    return orjson.dumps({k: v for k, v in obj.items() if k not in drop})
