"""What the sidecar answers with: the one place that builds response shapes.

- :func:`error_object` is the OpenAI-style error body (``{"error": {message, type, code, param}}``),
  the shape both SGLang's and OpenAI's clients already parse: every error the sidecar writes (400/413
  bodies, 503 rejections, upstream failures, admin errors) is built by it.
- :func:`decision_fields` is the one serialisation of a decision and the demand it judged: the 503
  body's ``admission`` object, ``/admission/explain`` and each decision-log line carry it.
- :func:`rejection_response` is the 503 a rejected request gets (status, headers, body).

Responses on the hot path are ``(status, headers, body)`` triples of bytes, sent as two ASGI messages.
"""

from __future__ import annotations

import json
from typing import Any

from sidecar.asgi import Send
from sidecar.core.decision import Decision
from sidecar.core.demand import Demand

Headers = list[tuple[bytes, bytes]]
Response = tuple[int, Headers, bytes]

_JSON = (b"content-type", b"application/json")

# One sentence per reason: what the client (or the person reading its log) is told.
REJECT_MESSAGES = {
    "vram_headroom": "Not enough free GPU memory for this request's prefill.",
    "kv_pool": "The engine's KV cache pool has no room for this prompt.",
    "mamba_slots": "The engine's Mamba state slots are exhausted.",
    "engine_queue": "The engine's queue is full.",
    "pending_prefill_tokens": "Too many prefill tokens are already pending in the engine.",
    "unfit_request": "This request can never fit this lane (context, KV pool or memory).",
    "signals_stale": "The engine's or GPU's signals are stale; admission is paused.",
    "queue_full": "The admission queue is full.",
    "hold_timeout": "The request waited the maximum hold time without room opening.",
    "engine_unavailable": "The engine is unreachable.",
    "draining": "The sidecar is shutting down.",
}


def error_object(message: str, code: str, type: str = "sidecar_error", param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "code": code, "param": param}}


def json_response(status: int, body: dict[str, Any], headers: Headers | tuple[()] = ()) -> Response:
    payload = json.dumps(body, separators=(",", ":")).encode()
    return status, [_JSON, (b"content-length", str(len(payload)).encode()), *headers], payload


def error_response(
    status: int, message: str, code: str, *, type: str = "sidecar_error", headers: Headers | tuple[()] = ()
) -> Response:
    return json_response(status, error_object(message, code, type), headers)


async def send_response(send: Send, resp: Response) -> None:
    status, headers, body = resp
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def decision_fields(d: Decision, demand: Demand) -> dict[str, Any]:
    """The decision with the numbers that decided it, and nothing of the prompt's text."""
    return {
        "request_id": demand.request_id,
        "decision": d.action.value,
        "reason": d.reason.value if d.reason else None,
        "prompt_tokens": demand.prompt_tokens,
        "exact": demand.exact,
        "cached_tokens": demand.cached_tokens,
        "max_new_tokens": demand.max_new_tokens,
        "sequences": demand.sequences,
        "priority": demand.priority,
        "projected_bytes": demand.projected_bytes,
        "headroom_bytes": d.headroom_bytes,
        "retry_after_s": d.retry_after_s,
        "checks": [
            {"name": c.name, "ok": c.ok, "need": c.need, "have": c.have, "note": c.note or None}
            for c in d.checks
        ],
    }


def rejection_response(d: Decision, demand: Demand, waited_s: float) -> Response:
    """HTTP 503 with Retry-After, the reason in a header and in an OpenAI-style error body."""
    reason = d.reason.value if d.reason else "rejected"
    retry = str(d.retry_after_s or 1)
    wait_ms = round(waited_s * 1000)
    body = error_object(
        REJECT_MESSAGES.get(reason, reason) + f" Retry after {retry} s.", reason, "admission_rejected"
    )
    body["admission"] = decision_fields(d, demand) | {"waited_ms": wait_ms}
    headers = [
        (b"retry-after", retry.encode()),
        (b"x-admission-decision", b"reject"),
        (b"x-admission-reason", reason.encode()),
        (b"x-admission-wait-ms", str(wait_ms).encode()),
    ]
    return json_response(503, body, headers)
