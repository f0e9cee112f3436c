"""The sidecar's own endpoints: state, explain, policy reload, health, readiness and metrics.

These are off the data path, so FastAPI's conveniences (validation, OpenAPI at /admission/docs) cost
nothing that matters. ``/healthz`` never looks at the engine: a liveness probe that follows a
dependency restarts the sidecar for the engine's outage.

Two listeners serve them (SECURITY.md): the admin port (``--admin-listen``, loopback by default) all
of ``ADMIN_PATHS`` and the probes; the data port, which every client reaches, only ``PROBE_PATHS``,
built with ``public=True`` so that nothing there names a file or the engine's address.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from sidecar.admission.controller import Admission
from sidecar.core.decide import headroom_bytes, readiness
from sidecar.http.answers import decision_fields, error_object, invalid_request
from sidecar.intake.body import BadRequest, parse_explain
from sidecar.intake.demand import demand_of
from sidecar.intake.tokens import PromptCounter
from sidecar.ops.router_view import loads_view, signals
from sidecar.ops.status import Metrics, Sample, render_html
from sidecar.ops.status import view as status_view
from sidecar.policy.source import PolicySource, UploadRefused
from sidecar.policy.summary import summarize
from sidecar.signals.gpu import GpuSource

log = logging.getLogger("sidecar.policy.schema")

# Served by both listeners: the kubelet probes the data port, an operator's script the admin one.
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
# The status page refreshes every STATUS_REFRESH_S; its rates are over the latest of its earlier views
# at least STATUS_MIN_INTERVAL_S old (several open pages share the readings).
STATUS_REFRESH_S = 2.0
STATUS_MIN_INTERVAL_S = 1.0
STATUS_SAMPLES = 32
# The admin listener's own paths (and, with --admin-on-data-port, the data port's too).
ADMIN_PATHS = frozenset(
    {
        "/admission/state",
        "/admission/status",
        "/admission/explain",
        "/admission/policy",
        "/admission/signals",
        "/admission/loads",
        "/metrics",
        "/admission/docs",
        "/admission/openapi.json",
    }
)


class Host(Protocol):
    """What the admin endpoints read of the running sidecar (``app.SidecarApp`` is one)."""

    admission: Admission
    clock: Callable[[], float]
    counter: PromptCounter
    gpu_source: GpuSource | None
    policy_source: PolicySource
    registry: CollectorRegistry

    def gate_open(self) -> bool: ...


def _err(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_object(message, code), status)


def state(app: Host, *, public: bool = False) -> dict[str, Any]:
    """The /admission/state contract: unknown values are null, never 0.

    ``public`` (the data port, with --admin-on-data-port): the policy's file path, the GPU source's
    spec and the last errors (which name the engine's URL or a file) are null.
    """
    a, now = app.admission, app.clock()
    snap, ledger = a.snapshot, a.ledger.totals
    e = snap.engine
    out = {
        "mode": "shadow" if a.shadow else "enforce",
        # true only when started with --trust-emulator-sizes (load generation against the emulator):
        # a client's `emulator.prompt_tokens` then replaces the counted prompt.
        "trust_emulator_sizes": app.trust_emulator_sizes,
        "gate_open": app.gate_open(),
        "draining": a.draining,
        "headroom_bytes": headroom_bytes(a.rules, snap, ledger),
        "engine": _engine_state(app, now),
        "gpu": _gpu_state(app, now),
        # What the sidecar measured of its lane: idle free memory (vram.idle_free_bytes: auto) and
        # the under-prediction monitor, with the cost margin in force.
        **_watch_state(a, now),
        # The in-flight prefill guard (core/overrun.py): progress read or not, aborts, the last one.
        "guard": a.guard_state(),
        "ledger": {
            "requests": ledger.requests,
            "prefill_tokens": ledger.prefill_tokens,
            "kv_tokens": ledger.kv_tokens,
            "projected_bytes": ledger.projected_bytes,
            "mamba_slots": ledger.mamba_slots,
        },
        "queue": {
            "held": a.held,
            "oldest_wait_s": a.oldest_wait_s(),
            "max_held": a.rules.hold.max_held,
            "max_wait_s": a.rules.hold.max_wait_s,
            # The first held request: the reason it waits for, and what it is projected to allocate.
            **dict(zip(("head_waits_for", "head_projected_bytes"), a.waiting_for(), strict=True)),
        },
        "policy": {
            "name": a.policy.name,
            "sha256": a.loaded.sha256,
            "path": a.loaded.path,
            # What it will do on this lane, with the engine's reported constants where it has them.
            "summary": summarize(
                a.policy,
                context_len=e.context_len if e else None,
                kv_pool_tokens=e.max_total_tokens if e else None,
                mamba_slots=e.mamba_total_slots if e else None,
                chunk=e.chunked_prefill_size if e else None,
                rules=a.rules,
            ).as_dict(),
            **app.policy_source.state(),
        },
    }
    if public:
        _scrub(out)
    return out


_ENGINE_FIELDS = (
    "running_requests",
    "queue_requests",
    "full_token_usage",
    "swa_token_usage",
    "mamba_usage",
    "kv_available_tokens",
    "mamba_available_slots",
    "pending_prefill_tokens",
    "chunked_prefill_size",
    "version",
)


def _engine_state(app: Host, now: float) -> dict[str, Any]:
    a = app.admission
    snap = a.snapshot
    e = snap.engine
    return {
        # The engine's report as read, each null before the first one.
        **{name: getattr(e, name) if e else None for name in _ENGINE_FIELDS},
        "sources": list(e.sources) if e else [],
        "age_s": snap.engine_age(now),
        "consecutive_failures": snap.engine_health.consecutive_failures,
        "last_error": snap.engine_health.last_error,
        # Series whose values could not be true in the last reading, which was then refused.
        "implausible_series": list(app.scraper.last_implausible) if app.scraper else [],
        "on_stale": a.rules.engine.on_stale.value,
    }


def _gpu_state(app: Host, now: float) -> dict[str, Any]:
    a = app.admission
    snap = a.snapshot
    g = snap.gpu
    return {
        "free_bytes": g.free_bytes if g else None,
        "total_bytes": g.total_bytes if g else None,
        "source": g.source if g else (app.gpu_source.spec if app.gpu_source else None),
        "other_process_bytes": g.other_process_bytes if g else None,
        "devices": [
            {
                "id": d.ident,
                "free_bytes": d.free_bytes,
                "total_bytes": d.total_bytes,
                "other_process_bytes": d.other_process_bytes,
            }
            for d in (g.devices if g else ())
        ],
        "headroom_from": a.policy.vram.headroom.value,
        "age_s": snap.gpu_age(now),
        "consecutive_failures": snap.gpu_health.consecutive_failures,
        "last_error": snap.gpu_health.last_error,
        "required": a.rules.gpu.required,
        "on_stale": a.rules.gpu.on_stale.value,
    }


def _scrub(out: dict[str, Any]) -> None:
    """The data port's view: no file paths, source specs, errors or other clients' request ids."""
    out["engine"]["last_error"] = out["gpu"]["last_error"] = out["gpu"]["source"] = None
    out["policy"]["path"] = None
    # Other clients' request ids stay on the admin port.
    if out["monitor"]["last"] is not None:
        out["monitor"]["last"]["request_ids"] = None
    out["monitor"]["margin"]["why"] = None
    if out["guard"]["last"] is not None:
        out["guard"]["last"]["request_id"] = None
    for key in ("last_reload", "last_failure"):
        if out["policy"][key] is not None:
            out["policy"][key] = out["policy"][key] | {"error": None}


def readiness_of(a: Admission, *, public: bool = False) -> dict[str, Any]:
    """``/readyz``: the decision's own answer to "would anything be admitted now?" (``core.decide.
    readiness``: draining, the engine unavailable after ``unavailable_after_failures`` failed reads, a
    signal the gate reads older than its ``max_age_s`` where the policy does not admit blind), with
    what it asked. A held request does not make the lane unready: it is serving."""
    s = a.situation()
    why = readiness(s)
    problems = [] if why is None else [why.note]
    if why is not None and why.name == "engine_unavailable":
        # The engine's error names its URL: on the data port, only that it is unreachable.
        problems = ["engine unreachable" + ("" if public else f": {why.note}")]
    r, snap = s.rules, s.snapshot
    asked = {
        "draining": s.draining,
        "engine": {
            "age_s": snap.engine_age(s.now),
            "max_age_s": r.engine.max_age_s,
            "on_stale": r.engine.on_stale.value,
            "consecutive_failures": snap.engine_health.consecutive_failures,
            "unavailable_after_failures": r.engine.unavailable_after_failures,
        },
        "gpu": {
            "age_s": snap.gpu_age(s.now),
            "max_age_s": r.gpu.max_age_s,
            "on_stale": r.gpu.on_stale.value,
            # The gate reads the GPU only for live free memory (``vram.headroom: nvml_free``).
            "read_by_the_gate": r.gpu.required and r.vram.uses_gpu_signal,
        },
    }
    return {"ready": why is None, "problems": problems, "asked": asked}


def _watch_state(a: Admission, now: float) -> dict[str, Any]:
    """The lane watch's state with wall-clock times (UTC, ISO 8601) beside its ages."""
    out = a.watch.state(now)
    idle, margin = out["idle_free"], out["monitor"]["margin"]
    idle["in_force_bytes"] = a.rules.vram.idle_free_bytes
    idle["headroom_in_force"] = a.rules.vram.headroom.value
    idle["measured_at"] = _wall(idle["measured_age_s"])
    margin["since"] = _wall(margin["since_age_s"])
    out["engine_build"]["since"] = _wall(out["engine_build"]["since_age_s"])
    last = out["monitor"]["last"]
    if last is not None:
        last["at"] = _wall(last["age_s"])
    return out


def _wall(age_s: float | None) -> str | None:
    if age_s is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - age_s))


# The error answers of the admin endpoints, declared so the published schema says every status a
# client can get (the OpenAI-style body of responses.error_object; schemathesis checks it).
_ERROR_BODY = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": "string"},
                "param": {"type": ["string", "null"]},
            },
        }
    },
}
_WHY = {
    400: "The body or a parameter is wrong (the error names it).",
    401: "Missing or wrong bearer token.",
    403: "Policy uploads are disabled (no --admin-token-file).",
    409: "The policy file cannot be written; nothing changed.",
    413: "The body is larger than the limit.",
    422: "The policy is invalid; the one in force is kept.",
    503: "Not ready: the problems say why.",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {
        s: {
            "description": _WHY[s],
            "content": {"application/json": {"schema": _ERROR_BODY if s != 503 else {"type": "object"}}},
        }
        for s in statuses
    }


def build_admin(app: Host, admin_token: str | None, *, public: bool = False) -> FastAPI:
    """The admin app; ``public`` for the data port (see the module's docstring)."""
    api = FastAPI(
        title="sglang-sidecar admin",
        docs_url="/admission/docs",
        openapi_url="/admission/openapi.json",
        redoc_url=None,
    )

    @api.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/readyz", responses=_errors(503))
    async def readyz() -> JSONResponse:
        body = readiness_of(app.admission, public=public)
        return JSONResponse(body, 200 if body["ready"] else 503)

    @api.get("/admission/state")
    async def get_state() -> dict[str, Any]:
        return state(app, public=public)

    samples: collections.deque[Sample] = collections.deque(maxlen=STATUS_SAMPLES)

    @api.get("/admission/status", response_class=HTMLResponse)
    async def get_status() -> HTMLResponse:
        """The live view as a page (sidecar/ops/status.py): refreshes itself; rates since an earlier view."""
        cur = Sample(
            time.monotonic(), state(app, public=public), Metrics.parse(generate_latest(app.registry).decode())
        )
        prev = next((x for x in samples if cur.at - x.at >= STATUS_MIN_INTERVAL_S), None)
        samples.append(cur)
        at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        return HTMLResponse(render_html(status_view(cur, prev), STATUS_REFRESH_S, at))

    @api.get("/admission/signals")
    async def get_signals() -> dict[str, Any]:
        """Routing signals of this lane now (sidecar/ops/router_view.py): what fits, headroom, held, queue."""
        return signals(app.admission)

    @api.get("/admission/loads")
    async def get_loads() -> dict[str, Any]:
        """SGLang's /v1/loads shape with the sidecar's held and forwarded-not-prefilled work added."""
        return loads_view(app.admission)

    @api.post("/admission/explain", responses=_errors(400, 413))
    async def explain(request: Request) -> JSONResponse:
        a = app.admission
        body = await request.body()
        try:
            req = parse_explain(
                body,
                dict(request.headers),
                max_body_bytes=a.policy.limits.max_body_bytes,
                path=request.query_params.get("path"),
                accept_emulator=app.trust_emulator_sizes,
                priority=a.policy.priority.bounds,
            )
        except BadRequest as e:
            return JSONResponse(invalid_request(e), e.status)
        count = await app.counter.count(req)
        demand = demand_of(a.rules, a.snapshot, req, count, now=a.clock.now())
        out = decision_fields(a.evaluate(demand), demand)
        out |= {
            "count_method": count.method,
            "uncached_tokens": demand.uncached_tokens,
            "held_ahead": a.held,
            "policy": a.policy.name,
            # The margin and idle figure this answer was priced with (the monitor may have raised one,
            # the sidecar may not have measured the other yet).
            "margin": a.rules.cost.margin,
            "headroom_from": a.rules.vram.headroom.value,
            "idle_free_bytes": a.rules.vram.idle_free_bytes,
            "idle_free_note": a.watch.state(a.clock.now())["idle_free"]["note"],
        }
        return JSONResponse(out)

    @api.post("/admission/policy", responses=_errors(400, 401, 403, 409, 413, 422))
    async def put_policy(request: Request) -> JSONResponse:
        client = f"{request.client.host}:{request.client.port}" if request.client else "unknown client"
        if admin_token is None:
            log.warning("policy upload from %s refused (403): uploads are disabled", client)
            return _err(403, "policy upload is disabled: start with --admin-token-file", "disabled")
        auth = request.headers.get("authorization", "")
        if not hmac.compare_digest(auth.encode(), f"Bearer {admin_token}".encode()):
            log.warning("policy upload from %s refused (401): missing or wrong bearer token", client)
            return _err(401, "missing or wrong bearer token", "unauthorized")
        try:
            # In a worker thread: validation, the file's fsync and the tokenizer load all block.
            record = await asyncio.to_thread(app.policy_source.upload, await request.body())
        except UploadRefused as e:
            body = error_object(e.message, e.code, "policy_refused")
            body |= {"problems": e.problems, "kept": app.admission.policy.name}
            return JSONResponse(body, e.status)
        return JSONResponse(
            {
                "name": record.policy,
                "sha256": record.sha256,
                "written_to_file": app.policy_source.path is not None,
            }
        )

    # Declared as what it is (Prometheus text), not FastAPI's default JSON: a client generated from
    # this schema must not expect JSON here (schemathesis found the mismatch).
    @api.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}},
    )
    async def metrics() -> Response:
        return Response(generate_latest(app.registry), media_type=CONTENT_TYPE_LATEST)

    return api
