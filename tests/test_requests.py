"""Parsing of gated request bodies: every endpoint shape, and every malformed body with its status
and a message that says what was wrong and where."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from sidecar.http.answers import invalid_request
from sidecar.intake import idscan
from sidecar.intake.body import (
    DEFAULT_MAX_BODY_BYTES,
    LIFT_IDS_BYTES,
    BadRequest,
    GenerationRequest,
    endpoint_kind,
    parse_explain,
    parse_generation,
)
from sidecar.intake.idscan import CountedIds, JsonText, find_ids, find_text

LIMIT = 1_000_000


def parse(path: str, obj: Any, headers: dict[str, str] | None = None, **kwargs: Any) -> GenerationRequest:
    return parse_generation(path, json.dumps(obj).encode(), headers, max_body_bytes=LIMIT, **kwargs)


def bad(
    path: str, body: bytes | Any, headers: dict[str, str] | None = None, *, limit: int = LIMIT
) -> BadRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(BadRequest) as caught:
        parse_generation(path, raw, headers, max_body_bytes=limit)
    return caught.value


# --- well-formed shapes ------------------------------------------------------------------------

# (path, body, headers, expected attributes)
SHAPES: list[tuple[str, str, dict[str, Any], dict[str, str] | None, dict[str, Any]]] = [
    (
        "generate-text",
        "/generate",
        {"text": "Hello", "sampling_params": {"max_new_tokens": 64}, "stream": True, "rid": "r1"},
        None,
        {
            "kind": "generate",
            "prompt_text": "Hello",
            "max_new_tokens": 64,
            "stream": True,
            "rid": "r1",
            "rids": ("r1",),
            "n_texts": 1,
            "model": None,
        },
    ),
    (
        "generate-defaults",
        "/generate",
        {"text": "Hello"},
        None,
        {"stream": False, "max_new_tokens": None, "priority": None, "rid": None, "parallel_samples": 1},
    ),
    (
        "generate-ids",
        "/generate",
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8, "n": 3}},
        None,
        {"prompt_token_ids": [1, 2, 3], "prompt_text": None, "parallel_samples": 3},
    ),
    (
        "generate-ids-win-over-text",  # SGLang tokenizes nothing when ids are given
        "/generate",
        {"text": "ignored", "input_ids": [5, 6]},
        None,
        {"prompt_token_ids": [5, 6], "prompt_text": None},
    ),
    (
        "generate-batch-text",
        "/generate",
        {
            "text": ["a b", "c"],
            "sampling_params": [{"max_new_tokens": 4}, {"max_new_tokens": 9}],
            "rid": ["x", "y"],
        },
        None,
        {
            "batch_texts": ("a b", "c"),
            "n_texts": 2,
            "max_new_tokens": 9,
            "rid": None,
            "rids": ("x", "y"),
            "prompt_text": None,
        },
    ),
    (
        "generate-batch-ids",
        "/generate",
        {"input_ids": [[1, 2], [3, 4, 5]]},
        None,
        {"batch_token_ids": ([1, 2], [3, 4, 5]), "n_texts": 2, "prompt_token_ids": None},
    ),
    (
        "generate-embeds",
        "/generate",
        {"input_embeds": [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]]},
        None,
        {"input_embeds_tokens": 3, "n_texts": 1},
    ),
    (
        "generate-embeds-batch",
        "/generate",
        {"input_embeds": [[[0.1], [0.2]], [[0.3]]]},
        None,
        {"input_embeds_tokens": 3, "n_texts": 2},
    ),
    (
        "generate-images",
        "/generate",
        {"text": "<image> describe", "image_data": ["a.png", "b.png"]},
        None,
        {"media_items": 2},
    ),
    (
        "generate-integral-float",  # JSON has one number type; 64.0 is an integer
        "/generate",
        {"text": "x", "sampling_params": {"max_new_tokens": 64.0}},
        None,
        {"max_new_tokens": 64},
    ),
    (
        "generate-prefixed-path",
        "/lane-a/generate",
        {"text": "x"},
        None,
        {"kind": "generate", "path": "/lane-a/generate"},
    ),
    (
        "completions-text",
        "/v1/completions",
        {"model": "qwen", "prompt": "Once", "max_tokens": 16, "stream": True, "n": 2},
        None,
        {
            "kind": "completions",
            "model": "qwen",
            "prompt_text": "Once",
            "max_new_tokens": 16,
            "stream": True,
            "parallel_samples": 2,
        },
    ),
    (
        "completions-batch-text",
        "/v1/completions",
        {"prompt": ["one", "two", "three"]},
        None,
        {"batch_texts": ("one", "two", "three"), "n_texts": 3},
    ),
    (
        "completions-ids",
        "/v1/completions",
        {"prompt": [10, 11, 12, 13]},
        None,
        {"prompt_token_ids": [10, 11, 12, 13], "n_texts": 1},
    ),
    (
        "completions-batch-ids",
        "/v1/completions",
        {"prompt": [[1], [2, 3]]},
        None,
        {"batch_token_ids": ([1], [2, 3]), "n_texts": 2},
    ),
    (
        "chat-string-content",
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "stream": False},
        None,
        {"kind": "chat", "messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 100},
    ),
    (
        "chat-max-completion-tokens-wins",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "max_completion_tokens": 7},
        None,
        {"max_new_tokens": 7},
    ),
    (
        "chat-null-max-completion-tokens-falls-back",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "max_completion_tokens": None},
        None,
        {"max_new_tokens": 100},
    ),
    (
        "chat-parts-tools-and-null-content",
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is"},
                        {"type": "image_url", "image_url": {"url": "data:..."}},
                    ],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
            ],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        None,
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
    ),
    (
        "priority-from-body",
        "/generate",
        {"text": "x", "priority": 5},
        {"X-Priority": "9"},
        {"priority": 5},
    ),
    (
        "priority-negative-body",
        "/v1/completions",
        {"prompt": "x", "priority": -3},
        None,
        {"priority": -3},
    ),
    (
        "priority-from-x-priority-header",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}]},
        {"X-Priority": " 7 "},
        {"priority": 7},
    ),
    (
        "priority-admission-header-wins",
        "/generate",
        {"text": "x", "priority": None},
        {"x-priority": "1", "X-Admission-Priority": "-2"},
        {"priority": -2},
    ),
    (
        "emulator-extension",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "emulator": {"prompt_tokens": 500_000, "prefix_key": "doc-7", "cached_tokens": 120_000, "new": 1},
        },
        None,
        {"declared_prompt_tokens": 500_000, "prefix_key": "doc-7", "declared_cached_tokens": 120_000},
    ),
    (
        "emulator-without-prompt",  # the declaration stands in for a prompt the load generator omits
        "/generate",
        {"emulator": {"prompt_tokens": 240_000}, "sampling_params": {"max_new_tokens": 8192}},
        None,
        {"declared_prompt_tokens": 240_000, "prompt_text": None, "max_new_tokens": 8192},
    ),
    (
        "unknown-path-read-by-keys",
        "/v2/whatever",
        {"messages": [{"role": "user", "content": "x"}]},
        None,
        {"kind": "chat"},
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "headers", "expected"), [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES]
)
def test_shapes(
    path: str, body: dict[str, Any], headers: dict[str, str] | None, expected: dict[str, Any]
) -> None:
    req = parse(path, body, headers)
    for name, value in expected.items():
        assert getattr(req, name) == value, name
    assert req.body_obj == body


def test_body_obj_is_the_parsed_object_and_lists_are_not_copied() -> None:
    body = json.dumps({"input_ids": list(range(1000))}).encode()
    req = parse_generation("/generate", body, max_body_bytes=LIMIT)
    assert req.prompt_token_ids is req.body_obj["input_ids"]


def test_emulator_ignored_when_not_accepted() -> None:
    req = parse("/generate", {"text": "x", "emulator": {"prompt_tokens": 3}}, accept_emulator=False)
    assert req.declared_prompt_tokens is None
    assert req.prompt_text == "x"


def test_content_type_is_not_checked() -> None:
    req = parse("/generate", {"text": "x"}, {"Content-Type": "text/plain"})
    assert req.prompt_text == "x"


def test_request_is_frozen() -> None:
    req = parse("/generate", {"text": "x"})
    with pytest.raises(AttributeError):
        req.stream = True  # type: ignore[misc]


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/generate", "generate"),
        ("/v1/completions", "completions"),
        ("/v1/chat/completions", "chat"),
        ("/v1/chat/completions/", "chat"),
        ("/v1/completions?x=1", "completions"),
        ("/v1/models", None),
    ],
)
def test_endpoint_kind(path: str, kind: str | None) -> None:
    assert endpoint_kind(path) == kind


# --- malformed bodies --------------------------------------------------------------------------

CHAT = "/v1/chat/completions"

# (id, path, body, headers, status, code, message)
MALFORMED: list[tuple[str, str, bytes | Any, dict[str, str] | None, int, str, str]] = [
    (
        "invalid-json",
        "/generate",
        b'{"text": "hello", "sampling_params": {"max_new_tokens": 8} "x": 1}',
        None,
        400,
        "invalid_json",
        "body is not valid JSON: Expecting ',' delimiter at line 1 column 60",
    ),
    (
        "invalid-json-second-line",
        "/generate",
        b'{"text": "a",\n  "stream": tru}',
        None,
        400,
        "invalid_json",
        "body is not valid JSON: Expecting value at line 2 column 13",
    ),
    ("empty-body", "/generate", b"", None, 400, "invalid_json", "body is empty; expected a JSON object"),
    (
        "whitespace-body",
        "/generate",
        b"  \n",
        None,
        400,
        "invalid_json",
        "body is empty; expected a JSON object",
    ),
    (
        "bad-utf8",
        "/generate",
        b'{"text": "\xff"}',
        None,
        400,
        "invalid_json",
        "body is not valid UTF-8: invalid start byte at byte 10",
    ),
    (
        "too-deep",
        "/generate",
        b"[" * 100_000 + b"]" * 100_000,
        None,
        400,
        "invalid_json",
        "body is not valid JSON: nested too deeply",
    ),
    ("array-body", "/generate", [1, 2], None, 400, "invalid_body", "body must be a JSON object, got array"),
    (
        "string-body",
        "/generate",
        "hello",
        None,
        400,
        "invalid_body",
        "body must be a JSON object, got string",
    ),
    ("null-body", "/generate", None, None, 400, "invalid_body", "body must be a JSON object, got null"),
    (
        "no-prompt-generate",
        "/generate",
        {"sampling_params": {}},
        None,
        400,
        "missing_prompt",
        'body has no prompt: expected one of "text", "input_ids" or "input_embeds"',
    ),
    (
        "no-prompt-completions",
        "/v1/completions",
        {"model": "m"},
        None,
        400,
        "missing_prompt",
        'body has no prompt: expected "prompt"',
    ),
    (
        "no-prompt-chat",
        CHAT,
        {"model": "m"},
        None,
        400,
        "missing_prompt",
        'body has no prompt: expected "messages"',
    ),
    (
        "unknown-shape",
        "/v2/x",
        {"foo": 1},
        None,
        400,
        "missing_prompt",
        'cannot tell the request shape of /v2/x: the body has none of "text", "input_ids", "input_embeds", '
        '"prompt" or "messages"',
    ),
    (
        "empty-text",
        "/generate",
        {"text": ""},
        None,
        400,
        "empty_prompt",
        'field "text" is empty; a prompt needs at least one token',
    ),
    (
        "empty-text-list",
        "/generate",
        {"text": []},
        None,
        400,
        "empty_prompt",
        'field "text" is empty; a prompt needs at least one token',
    ),
    (
        "empty-text-in-batch",
        "/generate",
        {"text": ["a", ""]},
        None,
        400,
        "empty_prompt",
        'field "text[1]" is empty; a prompt needs at least one token',
    ),
    (
        "empty-ids",
        "/generate",
        {"input_ids": []},
        None,
        400,
        "empty_prompt",
        'field "input_ids" is empty; a prompt needs at least one token',
    ),
    (
        "empty-prompt",
        "/v1/completions",
        {"prompt": ""},
        None,
        400,
        "empty_prompt",
        'field "prompt" is empty; a prompt needs at least one token',
    ),
    (
        "empty-messages",
        CHAT,
        {"messages": []},
        None,
        400,
        "empty_prompt",
        'field "messages" is empty; a chat needs at least one message',
    ),
    (
        "text-number",
        "/generate",
        {"text": 42},
        None,
        400,
        "invalid_field",
        'field "text" must be a string or a list of strings, got number',
    ),
    (
        "text-list-of-ints",
        "/generate",
        {"text": [1, 2]},
        None,
        400,
        "invalid_field",
        'field "text[0]" must be a string, got number',
    ),
    (
        "mixed-batch",
        "/v1/completions",
        {"prompt": ["a", 3]},
        None,
        400,
        "invalid_field",
        'field "prompt[1]" must be a string like the other prompts, got number',
    ),
    (
        "ids-not-list",
        "/generate",
        {"input_ids": "1 2 3"},
        None,
        400,
        "invalid_field",
        'field "input_ids" must be a list of token ids or a list of token-id lists, got string',
    ),
    (
        "ids-with-string",
        "/generate",
        {"input_ids": [1, 2, "3"]},
        None,
        400,
        "invalid_field",
        'field "input_ids[2]" must be a token id (an integer), got string',
    ),
    (
        "ids-with-float",
        "/v1/completions",
        {"prompt": [1, 2.5]},
        None,
        400,
        "invalid_field",
        'field "prompt[1]" must be a token id (an integer), got number',
    ),
    (
        "ids-negative",
        "/generate",
        {"input_ids": [1, -1]},
        None,
        400,
        "invalid_field",
        'field "input_ids[1]" must be a token id (0 or more), got -1',
    ),
    (
        "ids-batch-bad",
        "/generate",
        {"input_ids": [[1], [2, True]]},
        None,
        400,
        "invalid_field",
        'field "input_ids[1][1]" must be a token id (an integer), got boolean',
    ),
    (
        "prompt-object",
        "/v1/completions",
        {"prompt": {"text": "x"}},
        None,
        400,
        "invalid_field",
        'field "prompt" must be a string, a list of strings, a list of token ids '
        "or a list of token-id lists, got object",
    ),
    (
        "messages-object",
        CHAT,
        {"messages": {"role": "user"}},
        None,
        400,
        "invalid_field",
        'field "messages" must be a list of messages, got object',
    ),
    (
        "message-string",
        CHAT,
        {"messages": ["hi"]},
        None,
        400,
        "invalid_field",
        'field "messages[0]" must be a message object, got string',
    ),
    (
        "message-no-role",
        CHAT,
        {"messages": [{"content": "hi"}]},
        None,
        400,
        "invalid_field",
        'field "messages[0].role" is missing',
    ),
    (
        "message-content-number",
        CHAT,
        {
            "messages": [
                {"role": "system", "content": "a"},
                {"role": "user", "content": "b"},
                {"role": "user", "content": 3},
            ]
        },
        None,
        400,
        "invalid_field",
        'field "messages[2].content" must be a string or a list of content parts, got number',
    ),
    (
        "message-content-object",
        CHAT,
        {"messages": [{"role": "user", "content": {"text": "x"}}]},
        None,
        400,
        "invalid_field",
        'field "messages[0].content" must be a string or a list of content parts, got object',
    ),
    (
        "content-part-no-type",
        CHAT,
        {"messages": [{"role": "user", "content": [{"text": "x"}]}]},
        None,
        400,
        "invalid_field",
        'field "messages[0].content[0].type" must be a string, got null',
    ),
    (
        "content-part-text-missing",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        None,
        400,
        "invalid_field",
        'field "messages[0].content[0].text" must be a string, got number',
    ),
    (
        "tools-object",
        CHAT,
        {"messages": [{"role": "user", "content": "x"}], "tools": {}},
        None,
        400,
        "invalid_field",
        'field "tools" must be a list of tools, got object',
    ),
    (
        "stream-string",
        "/generate",
        {"text": "x", "stream": "yes"},
        None,
        400,
        "invalid_field",
        'field "stream" must be a boolean, got string',
    ),
    (
        "max-new-tokens-string",
        "/generate",
        {"text": "x", "sampling_params": {"max_new_tokens": "64"}},
        None,
        400,
        "invalid_field",
        'field "sampling_params.max_new_tokens" must be an integer, got string',
    ),
    (
        "max-new-tokens-fraction",
        "/generate",
        {"text": "x", "sampling_params": {"max_new_tokens": 1.5}},
        None,
        400,
        "invalid_field",
        'field "sampling_params.max_new_tokens" must be an integer, got 1.5',
    ),
    (
        "max-new-tokens-negative",
        "/generate",
        {"text": "x", "sampling_params": {"max_new_tokens": -1}},
        None,
        400,
        "invalid_field",
        'field "sampling_params.max_new_tokens" must be at least 0, got -1',
    ),
    (
        "max-new-tokens-in-batch",
        "/generate",
        {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": True}]},
        None,
        400,
        "invalid_field",
        'field "sampling_params[1].max_new_tokens" must be an integer, got boolean',
    ),
    (
        "sampling-params-string",
        "/generate",
        {"text": "x", "sampling_params": "greedy"},
        None,
        400,
        "invalid_field",
        'field "sampling_params" must be an object or a list of objects, got string',
    ),
    (
        "max-tokens-bool",
        "/v1/completions",
        {"prompt": "x", "max_tokens": True},
        None,
        400,
        "invalid_field",
        'field "max_tokens" must be an integer, got boolean',
    ),
    (
        "max-completion-tokens-string",
        CHAT,
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": "10"},
        None,
        400,
        "invalid_field",
        'field "max_completion_tokens" must be an integer, got string',
    ),
    (
        "n-zero",
        "/v1/completions",
        {"prompt": "x", "n": 0},
        None,
        400,
        "invalid_field",
        'field "n" must be at least 1, got 0',
    ),
    (
        "model-number",
        "/v1/completions",
        {"prompt": "x", "model": 3},
        None,
        400,
        "invalid_field",
        'field "model" must be a string, got number',
    ),
    (
        "rid-number",
        "/generate",
        {"text": "x", "rid": 3},
        None,
        400,
        "invalid_field",
        'field "rid" must be a string or a list of strings, got number',
    ),
    (
        "rid-list-openai",
        "/v1/completions",
        {"prompt": "x", "rid": ["a"]},
        None,
        400,
        "invalid_field",
        'field "rid" must be a string, got array',
    ),
    (
        "priority-string-body",
        "/generate",
        {"text": "x", "priority": "high"},
        None,
        400,
        "invalid_field",
        'field "priority" must be an integer, got string',
    ),
    (
        "priority-bad-header",
        "/generate",
        {"text": "x"},
        {"X-Priority": "high"},
        400,
        "invalid_field",
        "header \"X-Priority\" must be an integer, got 'high'",
    ),
    (
        "priority-bad-admission-header",
        "/generate",
        {"text": "x"},
        {"x-admission-priority": "1.5"},
        400,
        "invalid_field",
        "header \"x-admission-priority\" must be an integer, got '1.5'",
    ),
    (
        "emulator-not-object",
        "/generate",
        {"text": "x", "emulator": 5},
        None,
        400,
        "invalid_field",
        'field "emulator" must be an object, got number',
    ),
    (
        "emulator-zero-tokens",
        "/generate",
        {"text": "x", "emulator": {"prompt_tokens": 0}},
        None,
        400,
        "invalid_field",
        'field "emulator.prompt_tokens" must be at least 1, got 0',
    ),
    (
        "emulator-tokens-string",
        "/generate",
        {"text": "x", "emulator": {"prompt_tokens": "5"}},
        None,
        400,
        "invalid_field",
        'field "emulator.prompt_tokens" must be an integer, got string',
    ),
    (
        "emulator-prefix-number",
        "/generate",
        {"text": "x", "emulator": {"prefix_key": 5}},
        None,
        400,
        "invalid_field",
        'field "emulator.prefix_key" must be a string, got number',
    ),
    (
        "emulator-cached-over-prompt",
        "/generate",
        {"emulator": {"prompt_tokens": 10, "cached_tokens": 11}},
        None,
        400,
        "invalid_field",
        'field "emulator.cached_tokens" (11) exceeds "emulator.prompt_tokens" (10)',
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "code", "message"),
    [m[1:] for m in MALFORMED],
    ids=[m[0] for m in MALFORMED],
)
def test_malformed(
    path: str, body: bytes | Any, headers: dict[str, str] | None, status: int, code: str, message: str
) -> None:
    error = bad(path, body, headers)
    assert (error.status, error.code, error.message) == (status, code, message)
    assert str(error) == message


def test_invalid_json_column_points_at_the_error() -> None:
    body = b'{"model": "qwen", "messages": [{"role": "user"} {"x": 1}]}'
    error = bad(CHAT, body)
    assert error.message == "body is not valid JSON: Expecting ',' delimiter at line 1 column 49"
    assert body[48:49] == b"{"


def test_body_too_large_is_413_before_parsing() -> None:
    body = b"x" * 41_943_040  # not even JSON: the size is checked first
    error = bad("/generate", body, limit=33_554_432)
    assert error.status == 413
    assert error.code == "body_too_large"
    assert error.message == (
        "body of 41,943,040 bytes exceeds the limit of 33,554,432 (policy limits.max_body_bytes)"
    )


def test_body_at_the_limit_is_accepted() -> None:
    raw = json.dumps({"text": "x" * 100}).encode()
    req = parse_generation("/generate", raw, max_body_bytes=len(raw))
    assert req.prompt_text == "x" * 100


def test_default_limit_fits_a_524k_token_prompt() -> None:
    # ~4.7 MB: CJK text escaped as \uXXXX, the most expensive common JSON encoding of a long prompt.
    prompt = "\u4e2d" * (524_288 * 3 // 2)
    raw = json.dumps({"text": prompt}).encode()
    assert len(raw) > 4_000_000
    text = parse_generation("/generate", raw, max_body_bytes=DEFAULT_MAX_BODY_BYTES).prompt_text
    # Left encoded in the body (sidecar.intake.idscan), measured exactly, decoded whole only on demand.
    assert isinstance(text, JsonText) and text.utf8_len == len(prompt.encode()) and text.text() == prompt


def test_body_too_large_at_least_form() -> None:
    error = BadRequest.body_too_large(40_000_001, 40_000_000, at_least=True)
    assert (
        error.message == "body of at least 40,000,001 bytes exceeds the limit of 40,000,000 "
        "(policy limits.max_body_bytes)"
    )


def test_error_body_is_openai_shaped() -> None:
    error = bad(CHAT, {"messages": [{"role": "user", "content": 3}]})
    assert invalid_request(error) == {
        "error": {
            "message": 'field "messages[0].content" must be a string or a list of content parts, got number',
            "type": "invalid_request_error",
            "code": "invalid_field",
            "param": "messages[0].content",
        }
    }


# --- explain -----------------------------------------------------------------------------------


def explain(obj: Any, **kwargs: Any) -> GenerationRequest:
    return parse_explain(json.dumps(obj).encode(), max_body_bytes=LIMIT, **kwargs)


def test_explain_bare_form() -> None:
    req = explain({"prompt_tokens": 500_000, "max_new_tokens": 8192, "cached_tokens": 1000})
    assert (req.kind, req.path) == ("explain", "/admission/explain")
    assert (req.declared_prompt_tokens, req.max_new_tokens, req.declared_cached_tokens) == (
        500_000,
        8192,
        1000,
    )


def test_explain_bare_form_minimal() -> None:
    req = explain({"prompt_tokens": 5})
    assert (req.declared_prompt_tokens, req.max_new_tokens, req.declared_cached_tokens) == (5, None, None)


@pytest.mark.parametrize(
    ("obj", "key"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "chat"),
        ({"prompt": "x"}, "completions"),
        ({"text": "x"}, "generate"),
        ({"input_ids": [1]}, "generate"),
    ],
)
def test_explain_generation_body_by_keys(obj: dict[str, Any], key: str) -> None:
    assert explain(obj).kind == key


def test_explain_generation_body_with_path_and_emulator() -> None:
    req = explain({"prompt": "x", "emulator": {"prompt_tokens": 9}}, path="/v1/completions")
    assert (req.kind, req.path, req.declared_prompt_tokens) == ("completions", "/v1/completions", 9)


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (
            {"prompt_tokens": 5, "cache_tokens": 1},
            'unknown field "cache_tokens" in an explain body; allowed with '
            '"prompt_tokens": "cached_tokens", "max_new_tokens", "prefix_key", "priority"',
        ),
        ({"prompt_tokens": None}, 'field "prompt_tokens" must be an integer, got null'),
        ({"prompt_tokens": "5"}, 'field "prompt_tokens" must be an integer, got string'),
        ({"prompt_tokens": 0}, 'field "prompt_tokens" must be at least 1, got 0'),
        ({"prompt_tokens": 5, "cached_tokens": 6}, 'field "cached_tokens" (6) exceeds "prompt_tokens" (5)'),
        (
            {"max_new_tokens": 5},
            'body must be a generation request (with "text", "input_ids", "prompt" or '
            '"messages") or {"prompt_tokens": N, "max_new_tokens"?: N, "cached_tokens"?: N}',
        ),
    ],
)
def test_explain_errors(obj: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest) as caught:
        explain(obj)
    assert (caught.value.status, caught.value.message) == (400, message)


def test_explain_body_too_large() -> None:
    with pytest.raises(BadRequest) as caught:
        parse_explain(b'{"prompt_tokens": 5}', max_body_bytes=10)
    assert caught.value.status == 413


@pytest.mark.parametrize(
    "body",
    [
        json.dumps({"text": "a\ud800b"}).encode(),  # a lone surrogate escape: json.loads takes it
        json.dumps({"text": "héllo", "sampling_params": {"temperature": 0.5}}).encode("utf-16"),
        b'{"text": "x", "sampling_params": {"temperature": NaN}}',
    ],
    ids=["lone-surrogate", "utf-16", "nan"],
)
def test_bodies_the_fast_parser_refuses_are_decided_by_the_standard_one(body: bytes) -> None:
    """orjson parses the common case; whatever it refuses, SGLang's own parser (json.loads) accepts,
    so the sidecar must too."""
    req = parse_generation("/generate", body, max_body_bytes=1 << 20)
    assert req.prompt_text is not None and req.prompt_text.startswith(("a", "h", "x"))


# -- a large flat input_ids array is counted in the raw bytes, not decoded (sidecar.intake.idscan) ---------

BIG = 60_000  # ids: a body past requests.LIFT_IDS_BYTES (~7 bytes an id with ", ")


def big_ids(n: int = BIG) -> list[int]:
    return [(i * 7919) % 151_000 for i in range(n)]


@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_a_large_input_ids_body_is_counted_without_decoding_the_ids(separators: tuple[str, str]) -> None:
    obj = {
        "rid": "r1",
        "input_ids": big_ids(),
        "sampling_params": {"max_new_tokens": 16, "n": 2},
        "stream": True,
    }
    body = json.dumps(obj, separators=separators).encode()
    assert len(body) >= LIFT_IDS_BYTES
    req = parse_generation("/generate", bytearray(body), max_body_bytes=LIMIT)
    assert isinstance(req.prompt_token_ids, CountedIds) and len(req.prompt_token_ids) == BIG
    assert (req.rid, req.stream, req.max_new_tokens, req.parallel_samples) == ("r1", True, 16, 2)
    small = parse_generation(
        "/generate", json.dumps({**obj, "input_ids": [1, 2]}).encode(), max_body_bytes=LIMIT
    )
    assert replace(req, prompt_token_ids=None, body_obj={}) == replace(
        small, prompt_token_ids=None, body_obj={}
    )


@pytest.mark.parametrize(
    ("ids", "code", "where"),
    [
        ([*big_ids(), -3], "invalid_field", f"input_ids[{BIG}]"),
        ([*big_ids(), 2.5], "invalid_field", f"input_ids[{BIG}]"),
        ([*big_ids(), "x"], "invalid_field", f"input_ids[{BIG}]"),
    ],
)
def test_a_large_input_ids_body_that_is_not_plain_ids_gets_the_full_parsers_answer(
    ids: list[Any], code: str, where: str
) -> None:
    with pytest.raises(BadRequest) as e:
        parse_generation("/generate", json.dumps({"input_ids": ids}).encode(), max_body_bytes=LIMIT)
    assert e.value.code == code and e.value.param == where


def test_a_large_batch_of_id_lists_and_a_nested_input_ids_key_are_decoded_in_full() -> None:
    batch = parse_generation(
        "/generate", json.dumps({"input_ids": [big_ids(), [1, 2]]}).encode(), max_body_bytes=LIMIT
    )
    assert [len(ids) for ids in batch.batch_token_ids] == [BIG, 2]
    nested = {"sampling_params": {"input_ids": [1, 2, 3]}, "input_ids": big_ids()}
    req = parse_generation("/generate", json.dumps(nested).encode(), max_body_bytes=LIMIT)
    assert len(req.prompt_token_ids or []) == BIG
    twice = json.dumps({"input_ids": big_ids()})[:-1] + ', "input_ids": [5, 6]}'  # the last one wins
    assert (
        len(parse_generation("/generate", twice.encode(), max_body_bytes=LIMIT).prompt_token_ids or []) == 2
    )


@pytest.mark.parametrize(
    ("array", "found"),
    [
        (b"[1,2,3]", 3),
        (b"[ 1 ,\n 2\t]", 2),
        (b"[0]", 1),
        (b"[]", None),
        (b"[1,,2]", None),
        (b"[,1]", None),
        (b"[1,2,]", None),
        (b"[1 2]", None),
        (b"[1,-2]", None),
        (b"[1e3]", None),
        (b"[[1],[2]]", None),
    ],
)
def test_the_id_scan_counts_plain_id_arrays_and_refuses_the_rest(array: bytes, found: int | None) -> None:
    body = b'{"input_ids": ' + array + b', "stream": false}'
    got = find_ids(body)
    assert (got[2] if got else None) == found
    if got is not None:
        assert body[got[0] : got[1]] == array


def test_the_id_scan_counts_an_id_split_by_its_window_edge_once() -> None:
    ids = b",".join([b"123456789"] * (idscan.WINDOW // 5))
    for pad in range(10):  # one of these puts a window edge inside an id
        body = b'{"input_ids": [' + b" " * pad + ids + b"]}"
        edge = body.index(b"[") + 1 + idscan.WINDOW
        got = find_ids(body)
        assert got is not None and got[2] == idscan.WINDOW // 5
        if body[edge - 1 : edge + 1].isdigit():
            return
    raise AssertionError("no window edge fell inside an id")


@pytest.mark.parametrize(
    "prompt",
    [
        "plain words " * 30_000,
        'lines\n\tand "quotes" and \\ backslashes ' * 10_000,
        "caf\u00e9 \u4e2d\u6587 emoji \U0001f600 " * 20_000,
        '{"json": ["quoted", "inside"]} ' * 12_000,
    ],
)
@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_a_large_text_is_measured_in_the_raw_body_exactly(prompt: str, ensure_ascii: bool) -> None:
    raw = json.dumps({"text": prompt, "stream": True, "rid": "t"}, ensure_ascii=ensure_ascii).encode()
    assert len(raw) >= LIFT_IDS_BYTES
    req = parse_generation("/generate", raw, max_body_bytes=LIMIT * 8)
    text = req.prompt_text
    assert isinstance(text, JsonText) and (req.stream, req.rid) == (True, "t")
    assert text.utf8_len == len(prompt.encode("utf-8")) and text.text() == prompt


@pytest.mark.parametrize(
    "inside",
    [b"bad \\q escape", b"ctrl \x01 char", b"lone \\ud800 surrogate", b"bad utf-8 \xff"],
)
def test_a_large_text_that_is_not_valid_json_gets_the_full_parsers_answer(inside: bytes) -> None:
    raw = b'{"text": "' + b"w " * 200_000 + inside + b'"}'
    assert find_text(raw) is None
    try:
        req = parse_generation("/generate", raw, max_body_bytes=LIMIT * 8)
    except BadRequest as e:
        assert e.code == "invalid_json"
    else:  # what only the standard parser takes (a lone surrogate): decoded whole, as before
        assert isinstance(req.prompt_text, str)


def test_the_text_scan_never_cuts_an_escape_a_utf8_sequence_or_a_surrogate_pair() -> None:
    # Escaped (\\u4e2d, a surrogate pair for the emoji, \\\\ and \\") and raw UTF-8, every alignment.
    for unit in ("\u4e2d", "\U0001f600", '\\"', "\u00e9\n"):
        for pad in range(7):
            prompt = "x" * pad + unit * (idscan.WINDOW // 3)
            for ensure_ascii in (True, False):
                body = json.dumps({"text": prompt}, ensure_ascii=ensure_ascii).encode()
                found = find_text(body)
                assert found is not None and found[2] == len(prompt.encode("utf-8")), (
                    unit,
                    pad,
                    ensure_ascii,
                )


@pytest.mark.parametrize("digits", [18, 19, 25])
@pytest.mark.parametrize("where", ["first", "middle", "last", "window-edge", "whole-window"])
def test_the_id_scan_leaves_an_id_of_19_digits_or_more_to_the_full_parser(digits: int, where: str) -> None:
    """An id that may not fit int64 is not counted in the raw body, wherever it sits: first, last,
    inside a window, across a window's edge, or longer than a window; 18 digits are counted."""
    ids = [b"123456789"] * (idscan.WINDOW // 5)
    long = b"1" * (idscan.WINDOW + 7 if where == "whole-window" else digits)
    if where == "first":
        ids[0] = long
    elif where == "last":
        ids[-1] = long
    elif where == "middle":
        ids[len(ids) // 3] = long
    else:
        # The id whose digits run over the first window's end (the array's bytes start at `[` + 1).
        at, pos = 0, 0
        while pos + len(ids[at]) + 1 < idscan.WINDOW - digits // 2:
            pos += len(ids[at]) + 1
            at += 1
        ids[at] = long
    body = b'{"input_ids": [' + b",".join(ids) + b"]}"
    got = find_ids(body)
    if digits >= 19 or where == "whole-window":
        assert got is None
    else:
        assert got is not None and got[2] == len(ids)
