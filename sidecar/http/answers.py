"""What the sidecar answers with: the one place that builds response shapes.

- :func:`error_object` is the OpenAI-style error body (``{"error": {message, type, code, param}}``),
  the shape both SGLang's and OpenAI's clients already parse: every error the sidecar writes (400/413
  bodies, 503 rejections, upstream failures, admin errors) is built by it.
- :func:`decision_fields` is the one serialisation of a decision and the demand it judged: the 503
  body's ``admission`` object, ``/admission/explain`` and each decision-log line carry it.
- :func:`rejection_response` is what a rejected request gets (status, headers, body), with the
  status and headers the policy's ``answers:`` section chooses per case (``policy.Answers`` says why
  there are three: longer than the context, larger than the lane can ever run, busy now).

Responses on the hot path are ``(status, headers, body)`` triples of bytes, sent as two ASGI messages.
"""

from __future__ import annotations

import json
from typing import Any

from sidecar.core.decision import Check, Decision, Reason
from sidecar.core.demand import Demand
from sidecar.http.asgi import Send
from sidecar.intake.body import BadRequest
from sidecar.policy.schema import Answer, Answers

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
    "signals_stale": "The engine's or GPU's signals are stale; admission is paused.",
    "queue_full": "The admission queue is full.",
    "hold_timeout": "The request waited the maximum hold time without room opening.",
    "engine_unavailable": "The engine is unreachable.",
    "draining": "The sidecar is shutting down.",
    "prefill_overrun": (
        "The lane could no longer run this request's prefill safely (its memory grew short while it "
        "ran); it was stopped before its peak, and nothing was generated."
    ),
}


def error_object(
    message: str, code: str, type: str = "sidecar_error", param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "code": code, "param": param}}


def invalid_request(e: BadRequest) -> dict[str, Any]:
    """A refused request body as the OpenAI-style error object both SGLang and OpenAI clients parse."""
    return error_object(e.message, e.code, "invalid_request_error", e.param)


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
    """The decision with the numbers that decided it, and nothing of the prompt's text. The enums'
    ``_value_`` (their plain string): ``.value`` is a Python-level property, read per decision."""
    reason = d.reason
    return {
        "request_id": demand.request_id,
        "decision": d.action._value_,
        "reason": reason._value_ if reason is not None else None,
        "prompt_tokens": demand.prompt_tokens,
        "exact": demand.exact,
        "cached_tokens": demand.cached_tokens,
        "max_new_tokens": demand.max_new_tokens,
        "sequences": demand.sequences,
        "priority": demand.priority,
        "projected_bytes": demand.projected_bytes,
        "headroom_bytes": d.headroom_bytes,
        "retry_after_s": d.retry_after_s,
        "checks": check_fields(d.checks),
    }


def check_fields(checks: tuple[Check, ...]) -> list[dict[str, Any]]:
    """The decision's checks as ``decision_fields`` and the decision line write them: one dict per check,
    ``limit`` only where the check names one. One call per decision, the dicts built inline (a call per
    check was per-decision work too, issue #27)."""
    return [
        {"name": c.name, "ok": c.ok, "need": c.need, "have": c.have, "note": c.note or None, "limit": c.limit}
        if c.limit
        else {"name": c.name, "ok": c.ok, "need": c.need, "have": c.have, "note": c.note or None}
        for c in checks
    ]


def unfit_check(d: Decision) -> Check | None:
    return next((c for c in d.checks if c.name == Reason.UNFIT_REQUEST.value), None)


def answer_for(answers: Answers, d: Decision) -> Answer:
    """The policy's answer for this rejection (the unfit cases split by the limit they exceed)."""
    if d.reason is Reason.UNFIT_REQUEST:
        check = unfit_check(d)
        return answers.unfit_context if check is not None and check.limit == "context" else answers.unfit_lane
    if d.reason is Reason.PREFILL_OVERRUN and d.retry_after_s is None:
        # Stopped by the in-flight guard, and larger than the lane can ever run under the rules now in
        # force: no wait helps, as for an unfit request.
        return answers.unfit_lane
    return answers.for_reason(d.reason.value if d.reason else "")


def unfit_message(check: Check | None) -> str:
    """Which limit the request exceeds, and by how much, in the units an SRE reads."""
    if check is None or check.need is None or check.have is None:
        return "This request can never fit this lane."
    need, have = int(check.need), int(check.have)
    over = need - have
    if check.limit == "context":
        return (
            f"This request needs {need:,} tokens (prompt + max_new_tokens), {over:,} more than the "
            f"model's context length of {have:,} tokens. Shorten the prompt or lower max_new_tokens."
        )
    if check.limit == "kv_pool":
        return (
            f"This request can never run on this lane: it needs {need:,} KV cache tokens, {over:,} more "
            f"than the {have:,} this lane's KV pool can ever give one request. Another lane may fit it."
        )
    if check.limit in _SEQUENCE_LIMITS:
        return (
            f"This request asks for {need:,} sequences (prompts x n), {over:,} more than {_SEQUENCE_LIMITS[check.limit]} "
            f"allows ({have:,}). Send fewer prompts or samples per request."
        )
    if check.limit == "mamba_slots":
        return (
            f"This request can never run on this lane: it needs {need} Mamba state slots, {over} more "
            f"than the {have} this lane has. Another lane may fit it."
        )
    return (
        f"This request can never run on this lane: its prefill would allocate {size_text(need)} outside "
        f"the KV pool, {size_text(over)} more than the {size_text(have)} this lane can ever free "
        "(vram.max_transient_bytes, or idle_free_bytes - reserve_bytes). Another lane may fit it."
    )


_SEQUENCE_LIMITS = {
    "sequences": "the lane's policy (limits.max_sequences_per_request)",
    "engine_queue": "the engine queue limit (engine_queue.max_requests)",
    "running_requests": "the engine's max_running_requests",
}


def size_text(n: int) -> str:
    """Binary units, three significant figures at most: what nvidia-smi and the policy files use."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:,.2f} {unit}" if abs(v) < 10 else f"{v:,.0f} {unit}"
    return f"{n} bytes"


def rejection_response(d: Decision, demand: Demand, waited_s: float, answers: Answers) -> Response:
    """The status and headers the policy chose for this case, the reason in a header, the request id,
    and an OpenAI-style error body (``code`` is the reason) with the decision's numbers."""
    reason = d.reason.value if d.reason else "rejected"
    answer = answer_for(answers, d)
    retry = d.retry_after_s if answer.retry_after else None
    wait_ms = round(waited_s * 1000)
    if d.reason is Reason.UNFIT_REQUEST:
        message = unfit_message(unfit_check(d))
    elif d.reason is Reason.PREFILL_OVERRUN and d.retry_after_s is None:
        check = next((c for c in d.checks if c.name == reason), None)
        message = REJECT_MESSAGES[reason] + " " + unfit_message(check)
    else:
        message = REJECT_MESSAGES.get(reason, reason) + (f" Retry after {retry} s." if retry else "")
    # A 4xx says the request itself is at fault; 429 (busy now) is the lane's state, like a 503.
    kind = "invalid_request_error" if answer.status < 500 and answer.status != 429 else "admission_rejected"
    body = error_object(message, reason, kind)
    body["admission"] = decision_fields(d, demand) | {"waited_ms": wait_ms}
    for check in body["admission"]["checks"]:
        if check["name"] == Reason.ENGINE_UNAVAILABLE.value:
            # The scrape's error names the engine's URL: a client must not learn where the ungated
            # engine listens (SECURITY.md). The decision log and the admin port keep the detail.
            check["note"] = "engine unreachable (the admin port's /admission/state says why)"
    headers = [
        (b"x-admission-decision", b"reject"),
        (b"x-admission-reason", reason.encode()),
        (b"x-admission-wait-ms", str(wait_ms).encode()),
        (b"x-request-id", demand.request_id.encode("latin-1")),
    ]
    if retry:
        headers.append((b"retry-after", str(retry).encode()))
    if answer.should_retry is not None:
        headers.append((b"x-should-retry", b"true" if answer.should_retry else b"false"))
    headers.extend((k.lower().encode(), v.encode()) for k, v in answer.headers.items())
    return json_response(answer.status, body, headers)
