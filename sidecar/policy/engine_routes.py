"""Which engine routes prefill, per SGLang version, and how a request path is matched against them.

Why a list per version: every route that makes the engine prefill reaches its GPU memory, so every one
must pass the gate; a route the sidecar does not know is an open door. The lists are read from
SGLang's own route table (``python/sglang/srt/entrypoints/http_server.py``), and
``tests/test_holes.py`` checks them against the methods and paths of that table's decorators, recorded
in ``tests/fixtures/sglang/sglang-<version>-routes.txt``.

Why normalise: the engine's router (Starlette) redirects ``/generate/`` to ``/generate`` and a client
that follows the redirect reaches the route, so a path is matched after collapsing repeated slashes,
dropping a trailing slash and resolving dot segments, the way the engine would end up routing it.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Route:
    """One engine route that prefills: its path, the methods it serves and the body shape it takes.

    ``shape`` names the parser in ``sidecar.intake.body`` (``generate``, ``completions``, ``chat``,
    ``embedding``, ``input``, ``responses``, ``rerank``, ``score``, ``messages``, ``vertex``).
    """

    path: str
    methods: tuple[str, ...]
    shape: str


_POST = ("POST",)
_POST_PUT = ("POST", "PUT")

# SGLang 0.5.3 line (http_server.py at sgl-project/sglang commit 0025436e; evidence S18).
_V0_5_3 = (
    Route("/generate", _POST_PUT, "generate"),
    Route("/encode", _POST_PUT, "embedding"),
    Route("/classify", _POST_PUT, "embedding"),
    Route("/v1/completions", _POST, "completions"),
    Route("/v1/chat/completions", _POST, "chat"),
    Route("/v1/embeddings", _POST, "input"),
    Route("/v1/classify", _POST, "input"),
    Route("/v1/score", _POST, "score"),
    Route("/v1/responses", _POST, "responses"),
    Route("/v1/rerank", _POST_PUT, "rerank"),
    # SageMaker's chat endpoint and Vertex AI's predict route (AIP_PREDICT_ROUTE's default).
    Route("/invocations", _POST, "chat"),
    Route("/vertex_generate", _POST, "vertex"),
)
# SGLang 0.5.23 (the released wheel): adds Anthropic Messages, Ollama chat and generate (their
# SGLANG_OLLAMA_*_ROUTE defaults), and the scoring-based decision APIs.
_V0_5_23 = (
    *_V0_5_3,
    Route("/v1/messages", _POST, "messages"),
    Route("/api/chat", _POST, "ollama_chat"),
    Route("/api/generate", _POST, "ollama_generate"),
    Route("/v1/decisions", _POST, "decisions"),
    Route("/v1/systemone", _POST, "systemone"),
)

PREFILL_ROUTES: dict[str, tuple[Route, ...]] = {"0.5.3": _V0_5_3, "0.5.23": _V0_5_23}
LATEST = "0.5.23"

# Prefill routes whose body is a file upload the sidecar cannot size from JSON: refused (403) rather
# than forwarded ungated. `/generate_from_file` (input_embeds, 0.5.3) and audio transcription (0.5.23).
REFUSED_PATHS = frozenset({"/generate_from_file", "/v1/audio/transcriptions"})

# The routes of SGLang that do not prefill, in two classes (issue 24: any client drove the engine's
# control routes through the data port, one anonymous POST freed its weights). Every route of every
# supported version is in exactly one class with the prefill routes and REFUSED_PATHS;
# tests/test_route_classes.py checks it against tests/fixtures/routes/.
#
# SERVING: what an SGLang client or router calls besides generation: health, model and server info,
# loads, the tokenizer, output parsers, a response's own status and cancel. Forwarded ungated.
SERVING = frozenset(
    {
        "/",
        "/ping",
        "/ready",
        "/health",
        "/health_generate",
        "/get_model_info",
        "/model_info",
        "/get_server_info",
        "/server_info",
        "/get_load",
        "/v1/loads",
        "/get_weight_version",
        "/v1/models",
        "/v1/models/{model:path}",
        "/api/tags",
        "/api/show",
        "/v1/tokenize",
        "/tokenize",
        "/v1/detokenize",
        "/detokenize",
        "/v1/messages/count_tokens",
        "/parse_function_call",
        "/separate_reasoning",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/cancel",
    }
)
# CONTROL: the operator's routes: memory, weights, LoRA adapters, sessions, caches, profiling, logging,
# pausing, aborting anyone's request, disaggregation roles, debugging hooks. The data port answers
# 403 ``engine_control_route`` unless the policy opens one by name (``routes.open``); the admin port
# relays them with the admin bearer token (SECURITY.md).
CONTROL = frozenset(
    {
        "/set_internal_state",
        "/flush_cache",
        "/clear_hicache_storage_backend",
        "/start_profile",
        "/stop_profile",
        "/freeze_gc",
        "/start_expert_distribution_record",
        "/stop_expert_distribution_record",
        "/dump_expert_distribution_record",
        "/update_weights_from_disk",
        "/init_weights_send_group_for_remote_instance",
        "/send_weights_to_remote_instance",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/update_weights_from_ipc",
        "/update_weight_version",
        "/get_weights_by_name",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/slow_down",
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/open_session",
        "/close_session",
        "/configure_logging",
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        # 0.5.23
        "/add_external_corpus",
        "/remove_external_corpus",
        "/list_external_corpora",
        "/hicache/storage-backend/clear",
        "/hicache/storage-backend",
        "/get_hicache_l3_cache_layout",
        "/set_trace_level",
        "/begin_weight_update",
        "/end_weight_update",
        "/weights_checker",
        "/pd_role_switch",
        "/load_lora_adapter_from_tensors",
        "/get_remote_instance_transfer_engine_info",
        "/remote_instance_transfer_engine_info",
        "/dumper/{method}",
    }
)
# Kept for the route-table test's first question: which POST/PUT routes do not prefill.
NOT_PREFILL = SERVING | CONTROL


# Body fields only a trusted gateway may set (policy gateway_fields.names by default): fields of
# SGLang's GenerateReqInput, CompletionRequest and ChatCompletionRequest (evidence T4;
# sidecar/intake/gateway.py says why each).
DEFAULT_GATEWAY_FIELDS = (
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "routed_dp_rank",
    "data_parallel_rank",
    "disagg_prefill_dp_rank",
    "custom_logit_processor",
)


def _template(path: str) -> re.Pattern[str]:
    """A route path as the engine's router matches it (``{x}`` one segment, ``{x:path}`` any), after
    any prefix (an engine mounted under one: ``/lane-a/flush_cache``)."""
    parts = re.split(r"(\{[^}]+\})", path)
    body = "".join(
        (".+" if part.endswith(":path}") else "[^/]+") if part.startswith("{") else re.escape(part)
        for part in parts
    )
    return re.compile(r"(?:/[^?]*)?" + body if path != "/" else "/")


_CONTROL_EXACT = frozenset(p for p in CONTROL if "{" not in p)
_CONTROL_TEMPLATES = tuple((p, _template(p)) for p in sorted(CONTROL) if "{" in p)


def control_route(path: str) -> str | None:
    """The control route ``path`` reaches (its SGLang name), or None. Matched after normalising, and
    by suffix at a segment boundary, so ``//flush_cache/`` and ``/lane-a/flush_cache`` are caught."""
    normal = normalize_path(path)
    if normal in _CONTROL_EXACT:
        return normal
    for name in _CONTROL_EXACT:
        if normal.endswith(name):  # every name starts with "/": a segment boundary
            return name
    for name, pattern in _CONTROL_TEMPLATES:
        if pattern.fullmatch(normal):
            return name
    return None


def route_class(path: str, version: str = LATEST) -> str:
    """``prefill``, ``refused``, ``control``, ``serving`` or ``unknown``: which class an SGLang route
    path (as the route table writes it, templates included) belongs to."""
    if path in {r.path for r in routes_for(version)}:
        return "prefill"
    if path in REFUSED_PATHS:
        return "refused"
    if path in CONTROL:
        return "control"
    if path in SERVING:
        return "serving"
    return "unknown"


def routes_for(version: str) -> tuple[Route, ...]:
    """The prefill routes of an SGLang version: the newest list at or below it (unknown: the latest)."""
    if version in PREFILL_ROUTES:
        return PREFILL_ROUTES[version]
    known = sorted(PREFILL_ROUTES, key=_version_key)
    try:
        wanted = _version_key(version)
    except ValueError:
        return PREFILL_ROUTES[LATEST]
    older = [v for v in known if _version_key(v) <= wanted]
    return PREFILL_ROUTES[older[-1] if older else known[0]]


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3])


def normalize_path(path: str) -> str:
    """The path the engine would route ``path`` to: ``//generate/`` and ``/v1/./chat/completions``
    are ``/generate`` and ``/v1/chat/completions``. The root stays ``/``."""
    if not path.startswith("/"):
        path = "/" + path
    # posixpath keeps a leading "//" (POSIX leaves it implementation-defined); the engine does not.
    normal = posixpath.normpath("/" + path.lstrip("/"))
    return normal if normal != "." else "/"


class RouteTable:
    """Gated paths to their shapes, built once per policy (not per request)."""

    def __init__(
        self, gated_paths: tuple[str, ...] = (), version: str = LATEST, open_control: tuple[str, ...] = ()
    ) -> None:
        """Every prefill route of ``version`` is gated, whatever the policy lists; ``gated_paths`` adds
        paths (an engine mounted under a prefix, a route this list does not know yet). ``open_control``:
        the control routes the policy lets the data port forward (``routes.open``)."""
        self.open_control = frozenset(open_control)
        by_path = {r.path: r for r in routes_for(version)}
        self.routes: dict[str, Route] = dict(by_path)
        for p in gated_paths:
            p = normalize_path(p)
            # A prefix-mounted engine (`/lane-a/generate`) keeps the shape of the route it ends with.
            known = by_path.get(p) or next(
                (r for path, r in by_path.items() if p.endswith(path)), Route(p, _POST_PUT, "")
            )
            self.routes[p] = Route(p, known.methods, known.shape)
        self.refused = frozenset(normalize_path(p) for p in REFUSED_PATHS)

    def match(self, path: str, method: str) -> Route | None:
        """The gated route ``path`` reaches with ``method``, or None when the request is not gated."""
        route = self.routes.get(path) or self.routes.get(normalize_path(path))
        if route is None or method not in route.methods:
            return None
        return route

    def closed(self, path: str) -> str | None:
        """The control route ``path`` reaches when the policy has not opened it (403 on the data port)."""
        name = control_route(path)
        return None if name is None or name in self.open_control else name
