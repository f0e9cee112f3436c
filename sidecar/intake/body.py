"""Parse a generation request body into what admission needs to know, without touching the bytes.

The gate decides from a request's *size* (prompt tokens, output budget, batch width) and its
*identity* (priority, rid, model), so the proxy parses each gated body once, here, before it decides.
This module is pure: no I/O, no clock, no logging. It never re-serializes anything: the proxy forwards
the original bytes unchanged, so what the engine receives is exactly what the client sent, and the
parsed object is kept only so later stages (the token counter, ``explain``) need not parse again.

Three request shapes are understood (SGLang 0.5.x, evidence S8):

- ``/generate`` (SGLang native): ``text`` (string or list of strings) or ``input_ids`` (list of ints or
  list of int lists) or ``input_embeds``; ``sampling_params`` (object, or a list of objects for a
  batch) with ``max_new_tokens`` and ``n``; ``stream``, ``rid`` (string or list), ``priority``;
  ``image_data`` / ``video_data`` / ``audio_data`` for multimodal prompts.
- ``/v1/completions`` (OpenAI): ``prompt`` (string, list of strings, list of ints, list of int lists),
  ``max_tokens``, ``n``, ``stream``, ``model``, SGLang's ``rid`` and ``priority``.
- ``/v1/chat/completions`` (OpenAI): ``messages`` (content a string, a list of content parts, or null),
  ``max_completion_tokens`` (preferred) or ``max_tokens``, ``tools``, ``n``, ``stream``, ``model``.

A path is matched by its suffix, so a gated list that mounts the engine under a prefix still works; a
gated path that matches none of them is read by the keys its body carries.

Bad input is answered here with a :class:`BadRequest` (400, or 413 for a body over the limit) whose
message says what was wrong and where, so a malformed body never reaches the engine and the client can
fix it from the message alone. Types are checked as strictly as JSON allows (a boolean is not an
integer, a number is not a string) because SGLang builds ``SamplingParams(**dict)`` without coercion
and would fail later and less clearly. What the engine would accept but we do not need (unknown keys,
the ``Content-Type`` header) is not our business and passes through untouched.

The ``emulator`` body extension ``{"prompt_tokens": N, "prefix_key": str, "cached_tokens": N}`` lets
the project's own engine emulator and load generators describe a 500K-token prompt without sending
megabytes. It is a declaration by the client about its own size, so a lane that serves untrusted
clients can refuse to honour it (``accept_emulator=False``): the real prompt is then counted instead.
"""

from __future__ import annotations

import functools
import json
import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from sidecar.core.values import fast_init, positional
from sidecar.intake.idscan import CountedIds, JsonText, find_ids, find_text
from sidecar.policy.priority import OPEN, PriorityBounds

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "EXPLAIN_PATH",
    "GATED_PATHS",
    "BadRequest",
    "GenerationRequest",
    "endpoint_kind",
    "parse_explain",
    "parse_generation",
]

# 32 MiB. A 524,288-token prompt is about 2 MB of English text at ~4 bytes per token, but JSON can
# inflate it: CJK text escaped as \uXXXX costs 6 bytes per character (~9 bytes per token), i.e.
# ~4.7 MB; the same prompt as `input_ids` costs ~7 bytes per id ("123456, "), ~3.7 MB. 32 MiB leaves
# room for those worst cases plus a few base64 images, while still refusing a body that could only
# be a mistake or an attack before it costs the engine a tokenizer pass.
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024

GATED_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
EXPLAIN_PATH = "/admission/explain"

# Where the body-size limit comes from, quoted in the 413 message so the operator knows what to raise.
_LIMIT_SOURCE = "policy limits.max_body_bytes"

# Headers that may carry a priority when the body has none; the sidecar's own name wins over the
# generic one because a gateway in front of us sets it deliberately.
# The headers a priority may come in (in this order of precedence); the proxy hands the parser only
# these and the policy's class header.
PRIORITY_HEADERS = ("x-admission-priority", "x-priority")
_PRIORITY_HEADERS = PRIORITY_HEADERS
_INT_HEADER = re.compile(r"[+-]?[0-9]{1,18}")

_MEDIA_KEYS = ("image_data", "video_data", "audio_data")
# The largest integer any numeric field may hold (int64).
MAX_INT = 2**63 - 1
# Nesting the generic prompt walk follows before it calls a body malformed.
_MAX_WALK_DEPTH = 32
# From this size on, a flat `input_ids` array is counted in the raw bytes (sidecar.intake.idscan) instead of
# decoded into Python ints, and a `text` string measured there instead of decoded whole; below it,
# decoding is cheaper than a second pass.
LIFT_IDS_BYTES = 256 * 1024
# What stands in for the lifted array while the rest of the body is decoded: a string no client sends.
_LIFTED = "\u0000sidecar: prompt sized in the raw body " + secrets.token_hex(8)
_LIFTED_JSON = orjson.dumps(_LIFTED)
_EXPLAIN_KEYS = frozenset({"prompt_tokens", "max_new_tokens", "cached_tokens", "prefix_key", "priority"})


class BadRequest(Exception):
    """A request the sidecar answers itself, before and instead of the engine.

    ``status`` is the HTTP status (400 or 413), ``message`` a sentence that says what was wrong and
    where, ``code`` a stable machine-readable name (``invalid_json``, ``body_too_large``,
    ``invalid_body``, ``invalid_field``, ``missing_prompt``, ``empty_prompt``), and ``param`` the
    offending field's path when there is one (OpenAI's error ``param``).
    """

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def __repr__(self) -> str:
        return f"BadRequest({self.status}, {self.message!r}, {self.code!r})"

    @classmethod
    def body_too_large(
        cls, size: int, limit: int, *, at_least: bool = False, source: str = _LIMIT_SOURCE
    ) -> BadRequest:
        """The 413 for a body over the limit.

        ``at_least`` is for a proxy that stops reading a streamed body as soon as it passes the limit
        and so never learns the full size: the message then says how much was read.
        """
        qualifier = "at least " if at_least else ""
        return cls(
            413,
            f"body of {qualifier}{size:,} bytes exceeds the limit of {limit:,} ({source})",
            "body_too_large",
        )


@fast_init
@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What admission needs from one generation request, read once from its body.

    The prompt is kept in the form the body gave it, so the token counter can pick its cheapest exact
    method: ``prompt_token_ids`` (or ``batch_token_ids``) is already a count, text needs a tokenizer,
    chat ``messages`` need a template bound. Exactly one of ``prompt_text``, ``prompt_token_ids``,
    ``messages``, a non-empty ``batch_texts`` / ``batch_token_ids``, ``input_embeds_tokens`` or
    ``declared_prompt_tokens`` describes the prompt (the emulator's declaration may accompany any of
    them and then takes precedence).

    Lists are shared with ``body_obj``, not copied (a 500K-token ``input_ids`` is 500K Python ints):
    treat them as read-only.
    """

    path: str
    # "generate", "completions", "chat" or "explain" (a bare `{"prompt_tokens": N}` explain body).
    kind: str = "generate"
    stream: bool = False
    # /generate: sampling_params.max_new_tokens (the largest over a batch's list); OpenAI:
    # max_completion_tokens, else max_tokens. None: the body left it to the engine's default.
    max_new_tokens: int | None = None
    priority: int | None = None
    rid: str | None = None
    # Every rid the body names: one for a single request, one per prompt for a /generate batch.
    rids: tuple[str, ...] = ()
    model: str | None = None
    # A str, or for a large body a JsonText (its UTF-8 size; the str only on demand).
    prompt_text: str | JsonText | None = None
    # A list, or for a large body a CountedIds (its length only: the ids were never decoded).
    prompt_token_ids: list[int] | CountedIds | None = None
    messages: list[Any] | None = None
    # Chat `tools`: rendered into the prompt by the chat template, so they cost tokens too.
    tools: list[Any] | None = None
    # A batch: /generate `text` or `input_ids` as a list of prompts, or completions `prompt` likewise.
    # The prompt tokens of a batch are the sum over its prompts.
    batch_texts: tuple[str, ...] = ()
    batch_token_ids: tuple[list[int], ...] = ()
    # /generate `input_embeds`: one row per prompt position, so the row count is an exact token count.
    input_embeds_tokens: int | None = None
    # Number of prompts the engine will prefill (1 unless the body is a batch).
    n_texts: int = 1
    # Completions per prompt (OpenAI `n`, /generate `sampling_params.n`): each is a running sequence.
    parallel_samples: int = 1
    # /generate `return_logprob` with `logprob_start_len` >= 0: the first prompt position whose input
    # logprob the engine computes (the smallest over a batch); None: none (SGLang's default -1, and
    # the OpenAI routes, which never compute prompt logprobs).
    logprob_start: int | None = None
    # /generate image_data/video_data/audio_data items; chat media parts are counted from `messages`.
    media_items: int = 0
    # The `emulator` body extension (or a bare explain body): the client's own statement of its size.
    declared_prompt_tokens: int | None = None
    prefix_key: str | None = None
    declared_cached_tokens: int | None = None
    body_obj: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


# Every field positionally, in their order: ~4k instructions against ~17k for GenerationRequest(...)
# (core.values.positional); once per gated request.
_make_request = positional(GenerationRequest)


@functools.lru_cache(maxsize=256)
def endpoint_kind(path: str) -> str | None:
    """Which request shape a path carries: ``generate``, ``completions``, ``chat`` or None.

    Matched by suffix so ``/lane-a/v1/chat/completions`` behind a path-prefix router still parses.
    Once per path (a lane's gated paths are few; the cache is bounded for any other caller).
    """
    bare = path.split("?", 1)[0].rstrip("/")
    if bare.endswith("/chat/completions"):
        return "chat"
    if bare.endswith("/completions"):
        return "completions"
    if bare.endswith("/generate"):
        return "generate"
    return None


def parse_generation(
    path: str,
    body: bytes,
    headers: Mapping[str, str] | None = None,
    *,
    max_body_bytes: int,
    accept_emulator: bool = True,
    shape: str | None = None,
    priority: PriorityBounds = OPEN,
) -> GenerationRequest:
    """Parse a gated request's body, or raise :class:`BadRequest` saying what is wrong and where.

    ``shape`` is the route's body shape (``sidecar.policy.engine_routes.Route.shape``); without one the path's
    suffix, then the body's keys, tell it.

    ``headers`` is consulted only for a priority the body does not carry (``X-Admission-Priority``,
    then ``X-Priority``); keys may be in any case. The ``Content-Type`` header is deliberately not
    checked: SGLang's ``/generate`` accepts JSON whatever the header says, and refusing what the
    engine would serve is not admission's job.

    ``priority``: the policy's bounds on what a client may claim (``sidecar.policy.priority``); the default
    takes the claim as is.

    ``accept_emulator=False`` ignores the ``emulator`` extension, for lanes whose clients must not be
    able to state their own prompt size.

    Parsing a 32 MB body takes tens of milliseconds; a proxy that must not stall its event loop for
    that long can call this through ``asyncio.to_thread`` (it is pure and thread-safe).
    """
    size = len(body)
    if size < LIFT_IDS_BYTES and size <= max_body_bytes:
        # A small body (every ordinary request): decoded whole, and if it is a plain one of its shape
        # (``_PLAIN``), read in one pass that checks exactly what the general path would accept.
        try:
            obj = _loads(body)
        except JSONDecodeError:
            obj = _load_object(body, max_body_bytes)  # the standard parser's turn, or its error
        if type(obj) is not dict:
            obj = _load_object(body, max_body_bytes)  # raises "body must be a JSON object"
        kind = shape or endpoint_kind(path) or _kind_from_keys(obj)
        if not headers and kind in _PLAIN:
            rare, plain = _PLAIN[kind]
            if rare.isdisjoint(obj) and (req := plain(path, kind, obj, priority)) is not None:
                return req
        return _from_object(path, kind, obj, headers, accept_emulator=accept_emulator, bounds=priority)
    # Only a lifted body holds a CountedIds or JsonText (an ordinary JSON body cannot).
    obj = _lifted(body) if LIFT_IDS_BYTES <= size <= max_body_bytes else None
    lifted = obj is not None
    if obj is None:
        obj = _load_object(body, max_body_bytes)
    kind = shape or endpoint_kind(path) or _kind_from_keys(obj)
    if lifted and kind not in ("generate", "embedding"):
        obj = _load_object(body, max_body_bytes)  # a shape that reads input_ids otherwise, if at all
    return _from_object(path, kind, obj, headers, accept_emulator=accept_emulator, bounds=priority)


def parse_explain(
    body: bytes,
    headers: Mapping[str, str] | None = None,
    *,
    max_body_bytes: int,
    path: str | None = None,
    accept_emulator: bool = True,
    priority: PriorityBounds = OPEN,
) -> GenerationRequest:
    """Parse a ``POST /admission/explain`` body: a generation body, or ``{"prompt_tokens": N, ...}``.

    The bare form (``prompt_tokens`` with optional ``max_new_tokens``, ``cached_tokens``,
    ``prefix_key``, ``priority``) asks "what would you do with a request this size?" without building
    one; it becomes a request of kind ``explain`` whose declared size the counter uses as is. Its keys
    are checked strictly, since a misspelt ``cached_tokens`` would silently change the answer.

    A generation body is parsed as the endpoint ``path`` names (e.g. from a ``?path=`` query), or,
    without one, as the shape its keys reveal (``messages``: chat, ``prompt``: completions,
    ``text``/``input_ids``/``input_embeds``: /generate). ``accept_emulator`` follows the proxy's
    setting, so explain answers what the gate would do with the same body.
    """
    obj = _load_object(body, max_body_bytes)
    if "prompt_tokens" in obj:
        return _explain_form(obj, headers, priority)
    kind = endpoint_kind(path) if path else None
    kind = kind or _kind_from_keys(obj)
    if kind is None:
        raise BadRequest(
            400,
            'body must be a generation request (with "text", "input_ids", "prompt" or "messages") '
            'or {"prompt_tokens": N, "max_new_tokens"?: N, "cached_tokens"?: N}',
            "missing_prompt",
        )
    return _from_object(
        path or EXPLAIN_PATH, kind, obj, headers, accept_emulator=accept_emulator, bounds=priority
    )


# --- JSON --------------------------------------------------------------------------------------


_MISSING: Any = object()
_loads = orjson.loads
JSONDecodeError = orjson.JSONDecodeError


def _fast_loads(body: bytes) -> Any:
    """orjson first: ~3x json.loads on a 500K-id body (39 vs 109 ms here), and these parsers hold the
    GIL, so the event loop waits for them even when they run in a worker thread."""
    return orjson.loads(body)


def _lifted(body: bytes) -> dict[str, Any] | None:
    """The body decoded with its top-level flat ``input_ids`` counted, or else its top-level ``text``
    measured, in the raw bytes (sidecar.intake.idscan); None when it has neither (or anything is unusual:
    the full parser then decides)."""
    key = "input_ids"
    value: CountedIds | JsonText
    if (ids := find_ids(body)) is not None:
        start, end, n = ids
        value = CountedIds(n)
    elif (text := find_text(body)) is not None and text[2] > 0:
        key = "text"
        start, end, size = text
        value = JsonText(body, start, end, size)
    else:
        return None
    try:
        obj = orjson.loads(body[:start] + _LIFTED_JSON + body[end:])
    except orjson.JSONDecodeError:
        return None
    # The value found must be the top-level key's (not a nested one's, not a duplicate's).
    if not isinstance(obj, dict) or obj.get(key) != _LIFTED:
        return None
    obj[key] = value
    return obj


def _load_object(body: bytes, max_body_bytes: int) -> dict[str, Any]:
    if len(body) > max_body_bytes:
        raise BadRequest.body_too_large(len(body), max_body_bytes)
    try:
        obj = _fast_loads(body)
    except orjson.JSONDecodeError:
        # Looked at only when the body did not parse (``strip`` copies it: 32 MB for the largest).
        if not body.strip():
            raise BadRequest(400, "body is empty; expected a JSON object", "invalid_json") from None
        obj = _MISSING
    try:
        if obj is _MISSING:
            # What orjson refuses (UTF-16/32 bodies, lone surrogates, NaN, integers over 64 bits) the
            # standard parser decides, so accepted bodies and error messages are SGLang's (FastAPI's
            # json.loads detects UTF-8/16/32 on bytes and takes all of those).
            obj = json.loads(body)
    except json.JSONDecodeError as exc:
        raise BadRequest(
            400,
            f"body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            "invalid_json",
        ) from None
    except UnicodeDecodeError as exc:
        raise BadRequest(
            400, f"body is not valid UTF-8: {exc.reason} at byte {exc.start}", "invalid_json"
        ) from None
    except RecursionError:
        raise BadRequest(400, "body is not valid JSON: nested too deeply", "invalid_json") from None
    except ValueError as exc:  # e.g. an integer literal over Python's 4,300-digit conversion limit
        raise BadRequest(400, f"body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(obj, dict):
        raise BadRequest(400, f"body must be a JSON object, got {_json_type(obj)}", "invalid_body")
    return obj


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _kind_from_keys(obj: Mapping[str, Any]) -> str | None:
    if "messages" in obj:
        return "chat"
    if "prompt" in obj:
        return "completions"
    if any(key in obj for key in ("text", "input_ids", "input_embeds")):
        return "generate"
    return None


# --- field checks ------------------------------------------------------------------------------


def _wrong(where: str, expected: str, value: object) -> BadRequest:
    return BadRequest(
        400, f'field "{where}" must be {expected}, got {_json_type(value)}', "invalid_field", where
    )


# Built once: an isinstance against `int | float` makes a new union object at every call (per field).
_NUMBER = (int, float)


def _opt_int(
    obj: Mapping[str, Any], key: str, where: str, *, minimum: int = 0, maximum: int = MAX_INT
) -> int | None:
    """An optional integer field; an integral float (``5.0``) is accepted as JSON has one number type.

    Bounded above by ``MAX_INT`` (int64, what SGLang's own fields hold): ``1e308`` is an integral float
    and ``99999999999999999999`` a valid JSON integer, and either would otherwise travel into the
    cost arithmetic and come out as a 500.
    """
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, _NUMBER):
        raise _wrong(where, "an integer", value)
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise BadRequest(
                400, f'field "{where}" must be an integer, got {value!r}', "invalid_field", where
            )
        value = int(value)
    if value < minimum:
        raise BadRequest(
            400,
            f'field "{where}" must be at least {minimum}, got {_magnitude(value)}',
            "invalid_field",
            where,
        )
    if value > maximum:
        raise BadRequest(
            400, f'field "{where}" must be at most {maximum}, got {_magnitude(value)}', "invalid_field", where
        )
    return value


def _magnitude(value: int) -> str:
    """An integer as the client would recognise it, never through a float: a 400-digit one overflows
    a float (``f"{value:.3g}"`` raised OverflowError, a 500). JSON's parser refuses more than 4,300
    digits, so ``str`` always works here."""
    text = str(value)
    return text if len(text) <= 24 else f"an integer of {len(text.lstrip('-'))} digits"


def _opt_bool(obj: Mapping[str, Any], key: str, where: str) -> bool:
    value = obj.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _wrong(where, "a boolean", value)
    return value


def _opt_str(obj: Mapping[str, Any], key: str, where: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _wrong(where, "a string", value)
    return value


def _opt_object(obj: Mapping[str, Any], key: str, where: str) -> dict[str, Any] | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _wrong(where, "an object", value)
    return value


def _token_ids(value: list[Any], where: str) -> list[int]:
    """Check a token-id list cheaply (500K ids) and locate the first bad element only on failure.

    Negative ids are refused: an embedding lookup with one is a device-side assert that can take the
    whole engine down, which is exactly what this sidecar exists to prevent.
    """
    if not value:
        raise BadRequest(
            400, f'field "{where}" is empty; a prompt needs at least one token', "empty_prompt", where
        )
    if all(type(item) is int for item in value) and min(value) >= 0:
        return value
    for index, item in enumerate(value):
        if type(item) is not int:
            raise _wrong(f"{where}[{index}]", "a token id (an integer)", item)
        if item < 0:
            raise BadRequest(
                400,
                f'field "{where}[{index}]" must be a token id (0 or more), got {item}',
                "invalid_field",
                f"{where}[{index}]",
            )
    raise AssertionError("unreachable")  # pragma: no cover


def _text(value: str, where: str) -> str:
    if not value:
        raise BadRequest(
            400, f'field "{where}" is empty; a prompt needs at least one token', "empty_prompt", where
        )
    return value


@dataclass(slots=True)
class _Prompt:
    text: str | JsonText | None = None
    token_ids: list[int] | CountedIds | None = None
    batch_texts: tuple[str, ...] = ()
    batch_token_ids: tuple[list[int], ...] = ()
    n_texts: int = 1


def _text_or_ids(value: object, where: str, *, allow_ids: bool) -> _Prompt:
    """A prompt given as a string, a list of strings, a list of ids, or a list of id lists."""
    if isinstance(value, str):
        return _Prompt(text=_text(value, where))
    expected = (
        "a string, a list of strings, a list of token ids or a list of token-id lists"
        if allow_ids
        else "a string or a list of strings"
    )
    if not isinstance(value, list):
        raise _wrong(where, expected, value)
    if not value:
        raise BadRequest(
            400, f'field "{where}" is empty; a prompt needs at least one token', "empty_prompt", where
        )
    first = value[0]
    if isinstance(first, str):
        texts = []
        for index, item in enumerate(value):
            if not isinstance(item, str):
                raise _wrong(f"{where}[{index}]", "a string like the other prompts", item)
            texts.append(_text(item, f"{where}[{index}]"))
        return _Prompt(batch_texts=tuple(texts), n_texts=len(texts))
    if allow_ids and type(first) is int:
        return _Prompt(token_ids=_token_ids(value, where))
    if allow_ids and isinstance(first, list):
        lists = []
        for index, item in enumerate(value):
            if not isinstance(item, list):
                raise _wrong(f"{where}[{index}]", "a list of token ids like the other prompts", item)
            lists.append(_token_ids(item, f"{where}[{index}]"))
        return _Prompt(batch_token_ids=tuple(lists), n_texts=len(lists))
    raise _wrong(
        f"{where}[0]", "a string" + (", a token id or a list of token ids" if allow_ids else ""), first
    )


def _input_embeds(value: object) -> tuple[int, int]:
    """(prompt positions, prompts) of /generate ``input_embeds``: rows x hidden, or a batch of those."""
    where = "input_embeds"
    if not isinstance(value, list):
        raise _wrong(where, "a list of embedding rows", value)
    if not value:
        raise BadRequest(
            400, f'field "{where}" is empty; a prompt needs at least one token', "empty_prompt", where
        )
    first = value[0]
    if isinstance(first, list) and first and isinstance(first[0], list):
        total = 0
        for index, item in enumerate(value):
            if not isinstance(item, list) or not item:
                raise _wrong(f"{where}[{index}]", "a non-empty list of embedding rows", item)
            total += len(item)
        return total, len(value)
    for index, item in enumerate(value):
        if not isinstance(item, list):
            raise _wrong(f"{where}[{index}]", "an embedding row (a list of numbers)", item)
    return len(value), 1


def _count_media(value: object) -> int:
    """Items in ``image_data``-like fields: a string, a list of them, or a list per batch prompt."""
    if value is None:
        return 0
    if isinstance(value, list):
        return sum(_count_media(item) for item in value)
    return 1


def _rids(obj: Mapping[str, Any], *, allow_list: bool) -> tuple[str | None, tuple[str, ...]]:
    value = obj.get("rid")
    if value is None:
        return None, ()
    if isinstance(value, str):
        return value, (value,)
    if allow_list and isinstance(value, list):
        for index, item in enumerate(value):
            if not isinstance(item, str):
                raise _wrong(f"rid[{index}]", "a string", item)
        return (value[0] if len(value) == 1 else None), tuple(value)
    raise _wrong("rid", "a string or a list of strings" if allow_list else "a string", value)


def _priority(obj: Mapping[str, Any], headers: Mapping[str, str] | None) -> int | None:
    """Body ``priority`` (SGLang's own field) first; else a header, so clients that cannot change
    their body (an OpenAI SDK) can still be ordered by a gateway in front of us."""
    body_priority = _opt_int(obj, "priority", "priority", minimum=-MAX_INT - 1)
    if body_priority is not None or not headers:
        return body_priority
    found: dict[str, tuple[str, str]] = {}
    for key, value in headers.items():
        lowered = key.lower()
        if lowered in _PRIORITY_HEADERS:
            found[lowered] = (key, value)
    for name in _PRIORITY_HEADERS:
        if name in found:
            key, value = found[name]
            if not _INT_HEADER.fullmatch(value.strip()):
                raise BadRequest(
                    400, f'header "{key}" must be an integer, got {value!r}', "invalid_field", key
                )
            return int(value.strip())
    return None


def _emulator(obj: Mapping[str, Any], accept: bool) -> tuple[int | None, str | None, int | None]:
    """The ``emulator`` extension. Unknown keys inside it are ignored: the emulator owns that object
    and may grow it; only the three keys admission reads are checked."""
    ext = _opt_object(obj, "emulator", "emulator")
    if ext is None or not accept:
        return None, None, None
    prompt_tokens = _opt_int(ext, "prompt_tokens", "emulator.prompt_tokens", minimum=1)
    cached = _opt_int(ext, "cached_tokens", "emulator.cached_tokens")
    prefix_key = _opt_str(ext, "prefix_key", "emulator.prefix_key")
    if prompt_tokens is not None and cached is not None and cached > prompt_tokens:
        raise BadRequest(
            400,
            f'field "emulator.cached_tokens" ({cached:,}) exceeds "emulator.prompt_tokens" '
            f"({prompt_tokens:,})",
            "invalid_field",
            "emulator.cached_tokens",
        )
    return prompt_tokens, prefix_key, cached


# --- messages ----------------------------------------------------------------------------------


def _check_messages(value: object) -> list[Any]:
    """Check the structure the token counter walks; contents are counted, not interpreted."""
    if not isinstance(value, list):
        raise _wrong("messages", "a list of messages", value)
    if not value:
        raise BadRequest(
            400, 'field "messages" is empty; a chat needs at least one message', "empty_prompt", "messages"
        )
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise _wrong(f"messages[{index}]", "a message object", message)
        role = message.get("role")
        content = message.get("content")
        if isinstance(role, str) and (content is None or isinstance(content, str)):
            continue  # the common message: `where` is written only for one with parts, or a wrong one
        where = f"messages[{index}]"
        if not isinstance(role, str):
            if role is None:
                raise BadRequest(400, f'field "{where}.role" is missing', "invalid_field", f"{where}.role")
            raise _wrong(f"{where}.role", "a string", role)
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise _wrong(f"{where}.content", "a string or a list of content parts", content)
        for part_index, part in enumerate(content):
            part_where = f"{where}.content[{part_index}]"
            if not isinstance(part, dict):
                raise _wrong(part_where, "a content part object", part)
            part_type = part.get("type")
            if not isinstance(part_type, str):
                raise _wrong(f"{part_where}.type", "a string", part_type)
            if part_type == "text" and not isinstance(part.get("text"), str):
                raise _wrong(f"{part_where}.text", "a string", part.get("text"))
    return value


# --- shapes ------------------------------------------------------------------------------------


def _from_object(
    path: str,
    kind: str | None,
    obj: dict[str, Any],
    headers: Mapping[str, str] | None,
    *,
    accept_emulator: bool,
    bounds: PriorityBounds = OPEN,
) -> GenerationRequest:
    if kind is None:
        raise BadRequest(
            400,
            f'cannot tell the request shape of {path}: the body has none of "text", "input_ids", '
            '"input_embeds", "prompt" or "messages"',
            "missing_prompt",
        )
    declared, prefix_key, cached = _emulator(obj, accept_emulator)
    common: dict[str, Any] = {
        "path": path,
        "kind": kind,
        "stream": _opt_bool(obj, "stream", "stream"),
        "priority": bounds.resolve(_priority(obj, headers), headers),
        "declared_prompt_tokens": declared,
        "prefix_key": prefix_key,
        "declared_cached_tokens": cached,
        "body_obj": obj,
    }
    if kind in ("generate", "embedding"):
        return _generate(obj, common, declared is not None)
    if kind in ("completions", "chat"):
        return _openai(obj, kind, common, declared is not None)
    if kind in _OTHER_SHAPES:
        return _other(obj, kind, common, declared is not None)
    raise BadRequest(400, f"cannot tell the request shape of {path}", "missing_prompt")


def _generate(obj: dict[str, Any], common: dict[str, Any], declared: bool) -> GenerationRequest:
    # SGLang tokenizes nothing when it is given ids or embeddings (input_embeds > input_ids > text),
    # so the count follows the same precedence.
    prompt = _Prompt()
    embeds_tokens: int | None = None
    if obj.get("input_embeds") is not None:
        embeds_tokens, prompt.n_texts = _input_embeds(obj["input_embeds"])
    elif obj.get("input_ids") is not None:
        value = obj["input_ids"]
        if isinstance(value, CountedIds):
            prompt = _Prompt(token_ids=value)
        elif not isinstance(value, list):
            raise _wrong("input_ids", "a list of token ids or a list of token-id lists", value)
        else:
            prompt = _text_or_ids(value, "input_ids", allow_ids=True)
    elif isinstance(obj.get("text"), JsonText):
        prompt = _Prompt(text=obj["text"])
    elif obj.get("text") is not None:
        prompt = _text_or_ids(obj["text"], "text", allow_ids=False)
    elif not declared:
        raise BadRequest(
            400,
            'body has no prompt: expected one of "text", "input_ids" or "input_embeds"',
            "missing_prompt",
        )

    max_new: int | None = None
    samples = 1
    params = obj.get("sampling_params")
    if isinstance(params, list):
        for index, item in enumerate(params):
            where = f"sampling_params[{index}]"
            if not isinstance(item, dict):
                raise _wrong(where, "an object", item)
            value = _opt_int(item, "max_new_tokens", f"{where}.max_new_tokens")
            if value is not None:
                max_new = value if max_new is None else max(max_new, value)
            samples = max(samples, _opt_int(item, "n", f"{where}.n", minimum=1) or 1)
    elif params is not None:
        if not isinstance(params, dict):
            raise _wrong("sampling_params", "an object or a list of objects", params)
        max_new = _opt_int(params, "max_new_tokens", "sampling_params.max_new_tokens")
        samples = _opt_int(params, "n", "sampling_params.n", minimum=1) or 1

    rid, rids = _rids(obj, allow_list=True)
    logprob_start = _logprob_start(obj)
    return _request(
        common,
        max_new,
        rid,
        rids,
        None,
        prompt,
        None,
        None,
        embeds_tokens,
        samples,
        logprob_start,
        _media_items(obj),
    )


def _request(
    common: dict[str, Any],
    max_new: int | None,
    rid: str | None,
    rids: tuple[str, ...],
    model: str | None,
    prompt: _Prompt,
    messages: list[Any] | None,
    tools: list[Any] | None,
    embeds_tokens: int | None,
    samples: int,
    logprob_start: int | None,
    media_items: int,
) -> GenerationRequest:
    """The request of ``_from_object``'s common fields and a shape's own, built positionally in the
    fields' order: per request, and a 23-field keyword call cost ~1.7x (issue #27).
    ``tests/test_body_request.py`` checks the order field by field."""
    return _make_request(
        common["path"],
        common["kind"],
        common["stream"],
        max_new,  # max_new_tokens
        common["priority"],
        rid,
        rids,
        model,
        prompt.text,  # prompt_text
        prompt.token_ids,  # prompt_token_ids
        messages,
        tools,
        prompt.batch_texts,
        prompt.batch_token_ids,
        embeds_tokens,  # input_embeds_tokens
        prompt.n_texts,
        samples,  # parallel_samples
        logprob_start,
        media_items,
        common["declared_prompt_tokens"],
        common["prefix_key"],
        common["declared_cached_tokens"],
        common["body_obj"],
    )


def _media_items(obj: dict[str, Any]) -> int:
    """``image_data``, ``video_data`` and ``audio_data`` items (a text-only body has none of the keys)."""
    items = 0
    for key in _MEDIA_KEYS:
        value = obj.get(key)
        if value is not None:
            items += _count_media(value)
    return items


def _logprob_start(obj: dict[str, Any]) -> int | None:
    """Where input-token logprobs start, from /generate's `return_logprob` and `logprob_start_len`
    (each a value or a per-prompt list): the smallest start >= 0 of a prompt that asks for logprobs."""
    asks, starts = obj.get("return_logprob"), obj.get("logprob_start_len")
    if not asks or starts is None:
        return None
    n = max(len(v) if isinstance(v, list) else 1 for v in (asks, starts))
    ask_list = asks if isinstance(asks, list) else [asks] * n
    start_list = starts if isinstance(starts, list) else [starts] * n
    found: list[int] = []
    for i, (ask, item) in enumerate(zip(ask_list, start_list, strict=False)):
        where = f"logprob_start_len[{i}]" if isinstance(starts, list) else "logprob_start_len"
        start = _opt_int({where: item}, where, where, minimum=-MAX_INT)
        if ask is True and start is not None and start >= 0:
            found.append(start)
    return min(found) if found else None


def _openai(obj: dict[str, Any], kind: str, common: dict[str, Any], declared: bool) -> GenerationRequest:
    prompt = _Prompt()
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    if kind == "chat":
        if obj.get("messages") is None:
            if not declared:
                raise BadRequest(400, 'body has no prompt: expected "messages"', "missing_prompt")
        else:
            messages = _check_messages(obj["messages"])
        raw_tools = obj.get("tools")
        if raw_tools is not None and not isinstance(raw_tools, list):
            raise _wrong("tools", "a list of tools", raw_tools)
        tools = raw_tools or None
    elif obj.get("prompt") is None:
        if not declared:
            raise BadRequest(400, 'body has no prompt: expected "prompt"', "missing_prompt")
    else:
        prompt = _text_or_ids(obj["prompt"], "prompt", allow_ids=True)

    # OpenAI deprecated max_tokens for chat in favour of max_completion_tokens; when a client sends
    # both, the newer one is what it means.
    max_new = _opt_int(obj, "max_completion_tokens", "max_completion_tokens")
    if max_new is None:
        max_new = _opt_int(obj, "max_tokens", "max_tokens")
    rid, rids = _rids(obj, allow_list=False)
    model = _opt_str(obj, "model", "model")
    # OpenAI's `best_of` generates that many completions server-side and returns the best `n`: every
    # one of them is a running sequence.
    samples = max(
        _opt_int(obj, "n", "n", minimum=1) or 1, _opt_int(obj, "best_of", "best_of", minimum=1) or 1
    )
    return _request(common, max_new, rid, rids, model, prompt, messages, tools, None, samples, None, 0)


# --- plain bodies --------------------------------------------------------------------------------
#
# Most gated bodies are plain: one text prompt (chat: a list of messages), an output budget, maybe
# `stream`, `model`, `n`, a string `rid`. ``parse_generation`` reads such a body here, in one pass, and
# every other body through ``_from_object``. A plain reader *accepts only*: it returns the request
# ``_from_object`` would return, or None on anything it does not take as is (a float budget, a batch, a
# wrong type, ...), and then ``_from_object`` reads the body from the start and says what is wrong.
# Every check that can refuse a plain body runs in ``_from_object``'s order, so the first error is the
# same (``tests/test_body_plain.py`` compares both paths on the fuzzer's bodies). The keys in each
# reader's ``rare`` set (and a priority header) send a body to ``_from_object`` without a look.


def _plain_stream(obj: dict[str, Any]) -> bool | None:
    stream = obj.get("stream")
    if stream is None:
        return False
    return stream if type(stream) is bool else None


def _plain_generate(
    path: str, kind: str, obj: dict[str, Any], bounds: PriorityBounds
) -> GenerationRequest | None:
    """``_generate`` for a body with a non-empty string ``text``, a ``sampling_params`` object (or
    none) and none of ``_GENERATE_RARE``."""
    stream = _plain_stream(obj)
    text = obj.get("text")
    if stream is None or type(text) is not str or not text:
        return None
    max_new = None
    samples = 1
    params = obj.get("sampling_params")
    if params is not None:
        if type(params) is not dict:
            return None
        max_new = params.get("max_new_tokens")
        if max_new is not None and not (type(max_new) is int and 0 <= max_new <= MAX_INT):
            return None
        n = params.get("n")
        if n is not None:
            if not (type(n) is int and 1 <= n <= MAX_INT):
                return None
            samples = n
    rid = obj.get("rid")
    if rid is None:
        rids: tuple[str, ...] = ()
    elif type(rid) is str:
        rids = (rid,)
    else:
        return None
    # Positional, in the fields' order (``_request``'s). ``bounds.default``: what ``bounds.resolve`` answers
    # for no claim and no headers (a plain body has neither), without its call.
    return _make_request(
        path, kind, stream, max_new, bounds.default, rid, rids, None, text, None, None, None,
        (), (), None, 1, samples, None, 0, None, None, None, obj,
    )  # fmt: skip


def _plain_openai(
    path: str, kind: str, obj: dict[str, Any], bounds: PriorityBounds
) -> GenerationRequest | None:
    """``_openai`` for a body with a non-empty string ``prompt`` (completions) or a list of messages
    (chat), integer budgets, a string ``model`` and ``rid`` (or none), and none of ``_OPENAI_RARE``."""
    stream = _plain_stream(obj)
    if stream is None:
        return None
    text = messages = tools = None
    if kind == "chat":
        messages = obj.get("messages")
        if type(messages) is not list or not messages:
            return None
        _check_messages(messages)  # refuses as _openai would: every check before it has passed
        tools = obj.get("tools")
        if tools is not None:
            if type(tools) is not list:
                return None
            tools = tools or None
    else:
        text = obj.get("prompt")
        if type(text) is not str or not text:
            return None
    max_new = obj.get("max_completion_tokens")
    if max_new is None:
        max_new = obj.get("max_tokens")
    if max_new is not None and not (type(max_new) is int and 0 <= max_new <= MAX_INT):
        return None
    rid = obj.get("rid")
    model = obj.get("model")
    n = obj.get("n")
    best_of = obj.get("best_of")
    if (
        not (rid is None or type(rid) is str)
        or not (model is None or type(model) is str)
        or not (n is None or (type(n) is int and 1 <= n <= MAX_INT))
        or not (best_of is None or (type(best_of) is int and 1 <= best_of <= MAX_INT))
    ):
        return None
    samples = n or 1
    if best_of is not None and best_of > samples:
        samples = best_of
    # ``bounds.default``: ``bounds.resolve(None, None)``, as in ``_plain_generate``.
    return _make_request(
        path, kind, stream, max_new, bounds.default, rid, () if rid is None else (rid,), model,
        text, None, messages, tools, (), (), None, 1, samples, None, 0, None, None, None, obj,
    )  # fmt: skip


# What a plain reader leaves to ``_from_object``: the emulator extension and a body priority (both
# paths), and for /generate the other prompt forms, input logprobs and media.
_COMMON_RARE = frozenset({"emulator", "priority"})
_GENERATE_RARE = _COMMON_RARE | {"input_embeds", "input_ids", "logprob_start_len", *_MEDIA_KEYS}
_OPENAI_RARE = _COMMON_RARE
_PLAIN: dict[str | None, tuple[frozenset[str], Any]] = {
    "generate": (_GENERATE_RARE, _plain_generate),
    "embedding": (_GENERATE_RARE, _plain_generate),
    "completions": (_OPENAI_RARE, _plain_openai),
    "chat": (_OPENAI_RARE, _plain_openai),
}


# Routes beyond the three generation APIs: where each body keeps its prompt and its output budget.
# (prompt fields, output-budget field). Their prompts are counted as the texts and token ids found in
# those fields, an upper bound where a field also carries names or roles.
_OTHER_SHAPES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "input": (("input",), None),  # /v1/embeddings, /v1/classify
    "responses": (("input", "instructions", "tools"), "max_output_tokens"),
    "rerank": (("query", "documents"), None),
    "score": (("query", "items"), None),
    "messages": (("system", "messages", "tools"), "max_tokens"),  # Anthropic
    "vertex": (("instances",), None),
    "ollama_chat": (("messages",), None),
    "ollama_generate": (("system", "prompt", "suffix", "context", "images"), None),
    "decisions": (("input", "questions", "images"), None),
    "systemone": (("state", "questions", "images"), None),
}


def _other(obj: dict[str, Any], kind: str, common: dict[str, Any], declared: bool) -> GenerationRequest:
    fields, budget_key = _OTHER_SHAPES[kind]
    texts: list[str] = []
    ids: list[list[int]] = []
    for key in fields:
        if obj.get(key) is not None:
            _walk_prompt(obj[key], key, texts, ids, 0)
    if kind == "rerank" and isinstance(obj.get("query"), str) and isinstance(obj.get("documents"), list):
        # Each document is prefilled together with the query: the query counts once per document.
        texts.extend([obj["query"]] * max(0, len(obj["documents"]) - 1))
    if not texts and not ids and not declared:
        raise BadRequest(
            400,
            "body has no prompt: expected " + " or ".join(f'"{f}"' for f in fields),
            "missing_prompt",
        )
    max_new = _opt_int(obj, budget_key, budget_key) if budget_key else None
    if kind == "vertex":
        params = _opt_object(obj, "parameters", "parameters") or {}
        sampling = _opt_object(params, "sampling_params", "parameters.sampling_params") or {}
        max_new = _opt_int(sampling, "max_new_tokens", "parameters.sampling_params.max_new_tokens")
    rid, rids = _rids(obj, allow_list=True)
    return GenerationRequest(
        **common,
        max_new_tokens=max_new,
        rid=rid,
        rids=rids,
        model=_opt_str(obj, "model", "model"),
        batch_texts=tuple(texts) if texts else (),
        batch_token_ids=tuple(ids) if not texts else (),
        n_texts=max(1, len(texts) + len(ids)),
    )


def _walk_prompt(value: object, where: str, texts: list[str], ids: list[list[int]], depth: int) -> None:
    """Collect every string and token-id list under ``value`` (keys and numbers are not prompt)."""
    if depth > _MAX_WALK_DEPTH:
        raise BadRequest(400, f'field "{where}" is nested too deeply', "invalid_field", where)
    if isinstance(value, str):
        if value:
            texts.append(value)
    elif isinstance(value, list):
        if value and all(type(item) is int for item in value):
            ids.append(_token_ids(value, where))
            return
        for index, item in enumerate(value):
            _walk_prompt(item, f"{where}[{index}]", texts, ids, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _walk_prompt(item, f"{where}.{key}", texts, ids, depth + 1)


def _explain_form(
    obj: dict[str, Any], headers: Mapping[str, str] | None, bounds: PriorityBounds = OPEN
) -> GenerationRequest:
    unknown = sorted(set(obj) - _EXPLAIN_KEYS)
    if unknown:
        raise BadRequest(
            400,
            f'unknown field "{unknown[0]}" in an explain body; allowed with "prompt_tokens": '
            + ", ".join(f'"{key}"' for key in sorted(_EXPLAIN_KEYS - {"prompt_tokens"})),
            "invalid_field",
            unknown[0],
        )
    prompt_tokens = _opt_int(obj, "prompt_tokens", "prompt_tokens", minimum=1)
    if prompt_tokens is None:
        raise BadRequest(
            400, 'field "prompt_tokens" must be an integer, got null', "invalid_field", "prompt_tokens"
        )
    cached = _opt_int(obj, "cached_tokens", "cached_tokens")
    if cached is not None and cached > prompt_tokens:
        raise BadRequest(
            400,
            f'field "cached_tokens" ({cached:,}) exceeds "prompt_tokens" ({prompt_tokens:,})',
            "invalid_field",
            "cached_tokens",
        )
    return GenerationRequest(
        path=EXPLAIN_PATH,
        kind="explain",
        max_new_tokens=_opt_int(obj, "max_new_tokens", "max_new_tokens"),
        priority=bounds.resolve(_priority(obj, headers), headers),
        declared_prompt_tokens=prompt_tokens,
        declared_cached_tokens=cached,
        prefix_key=_opt_str(obj, "prefix_key", "prefix_key"),
        body_obj=obj,
    )
