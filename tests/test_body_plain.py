"""``intake.body``'s plain readers (``_plain_generate``, ``_plain_openai``) read the common small body in
one pass; every other body goes to ``_from_object``. A plain reader may only accept: whatever it returns
must be what ``_from_object`` returns for the same body, and a body it declines must get
``_from_object``'s answer, the same first error included. Compared here on bodies that are mostly plain,
with one field or another wrong, missing or rare (the fuzzer's values: floats, booleans, huge integers,
nested junk)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sidecar.intake.body as body_module
from sidecar.intake.body import BadRequest, parse_generation
from sidecar.policy.priority import OPEN, PriorityBounds
from tests.test_fuzz import EXAMPLES, FUZZ, emulator, junk, messages, numbers

LIMIT = 64 * 1024
BOUNDS = [
    OPEN,
    PriorityBounds(),
    PriorityBounds(minimum=-5, maximum=5, default=2),
    PriorityBounds(default=7, class_header="x-tier", classes={"gold": 9}),
]
ROUTES = [
    ("/generate", "generate"),
    ("/encode", "embedding"),
    ("/v1/completions", "completions"),
    ("/v1/chat/completions", "chat"),
]


def mostly(valid: st.SearchStrategy[Any], wrong: st.SearchStrategy[Any] = junk) -> st.SearchStrategy[Any]:
    """``valid`` nine times in ten, else ``wrong``: one body in a few has one field off."""
    return st.integers(0, 9).flatmap(lambda i: wrong if i == 9 else valid)


edges = st.sampled_from([-1, 0, 1, 2**63 - 1, 2**63, 5.0, 0.5, True, False, None, "1"]) | numbers
counts = mostly(st.integers(0, 3) | st.integers(0, 2**63 + 1), edges)
texts = mostly(st.sampled_from(["hi", "", "é"]) | st.text(max_size=4))
rids = mostly(st.text(max_size=4), st.lists(st.text(max_size=3), max_size=2) | junk)
streams = mostly(st.booleans() | st.none())


def with_rare(plain: st.SearchStrategy[dict[str, Any]], rare: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A plain body, one in ten times with one of the keys only the general path reads."""
    one_rare = st.sampled_from(sorted(rare)).flatmap(lambda k: st.tuples(st.just(k), rare[k]))
    return st.tuples(plain, mostly(st.none(), one_rare)).map(lambda p: p[0] | dict([p[1]] if p[1] else []))


RARE = {"priority": counts, "emulator": emulator | junk}
generate_bodies = with_rare(
    st.fixed_dictionaries(
        {"text": texts},
        optional={
            "sampling_params": mostly(
                st.fixed_dictionaries(
                    {}, optional={"max_new_tokens": counts, "n": counts, "temperature": junk}
                ),
                st.lists(st.fixed_dictionaries({}, optional={"max_new_tokens": counts}), max_size=2) | junk,
            ),
            "stream": streams,
            "rid": rids,
            "return_logprob": st.booleans() | junk,
            "extra": junk,
        },
    ),
    RARE
    | {
        "logprob_start_len": counts,
        "input_ids": st.lists(st.integers(min_value=-1, max_value=9), max_size=3) | junk,
        "input_embeds": junk,
        "image_data": junk,
    },
)
OPENAI = {
    "tools": mostly(st.lists(junk, max_size=2) | st.none()),
    "max_completion_tokens": counts,
    "max_tokens": counts,
    "model": mostly(st.text(max_size=4)),
    "n": counts,
    "best_of": counts,
    "rid": rids,
    "stream": streams,
    "extra": junk,
}
chat_messages = st.lists(
    st.fixed_dictionaries(
        {"role": mostly(st.sampled_from(["user", "system"]))},
        optional={"content": mostly(st.text(max_size=4) | st.none()), "name": junk},
    ),
    max_size=3,
)
chat_bodies = with_rare(
    st.fixed_dictionaries({"messages": mostly(chat_messages, messages | junk)}, optional=OPENAI), RARE
)
completions_bodies = with_rare(
    st.fixed_dictionaries(
        {"prompt": mostly(texts, st.lists(st.integers(min_value=0, max_value=9), max_size=2) | junk)},
        optional=OPENAI,
    ),
    RARE,
)
MANY = settings(FUZZ, max_examples=EXAMPLES or 200)


def _outcome(parse: Any) -> Any:
    try:
        req = parse()
    except BadRequest as e:
        return ("refused", e.status, e.message, e.code, e.param)
    return ("request", [getattr(req, f.name) for f in dataclasses.fields(req)])


def _both(path: str, kind: str, obj: dict[str, Any], bounds: PriorityBounds, emulator_ok: bool) -> None:
    raw = json.dumps(obj).encode()
    fast = _outcome(
        lambda: parse_generation(
            path, raw, {}, max_body_bytes=LIMIT, accept_emulator=emulator_ok, shape=kind, priority=bounds
        )
    )
    general = _outcome(
        lambda: body_module._from_object(
            path, kind, body_module._load_object(raw, LIMIT), None, accept_emulator=emulator_ok, bounds=bounds
        )
    )
    assert fast == general, raw


@MANY
@given(
    obj=generate_bodies, route=st.sampled_from(ROUTES[:2]), bounds=st.sampled_from(BOUNDS), ok=st.booleans()
)
def test_a_generate_body_reads_the_same_on_either_path(
    obj: dict[str, Any], route: tuple[str, str], bounds: PriorityBounds, ok: bool
) -> None:
    _both(*route, obj, bounds, ok)


@MANY
@given(obj=chat_bodies, bounds=st.sampled_from(BOUNDS), ok=st.booleans())
def test_a_chat_body_reads_the_same_on_either_path(
    obj: dict[str, Any], bounds: PriorityBounds, ok: bool
) -> None:
    _both(*ROUTES[3], obj, bounds, ok)


@MANY
@given(obj=completions_bodies, bounds=st.sampled_from(BOUNDS), ok=st.booleans())
def test_a_completions_body_reads_the_same_on_either_path(
    obj: dict[str, Any], bounds: PriorityBounds, ok: bool
) -> None:
    _both(*ROUTES[2], obj, bounds, ok)


# Every value kind a field may hold at its edges, and every field a plain reader reads (a path into the
# body: a key, or keys and indices below it), with the rare keys the general path alone reads.
EDGES = [
    -1,
    0,
    1,
    2,
    2**63 - 1,
    2**63,
    5.0,
    0.5,
    1e308,
    True,
    False,
    None,
    "1",
    "",
    [],
    {},
    [1],
    ["a"],
    {"a": 1},
]
FEW_EDGES = [-1, 0, 2, 2**63, 5.0, True, None, "", [], {}]
BASES: dict[str, tuple[str, str, dict[str, Any], list[tuple[Any, ...]]]] = {
    "generate": (
        "/generate",
        "generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 1, "n": 1}, "stream": False, "rid": "r"},
        [("text",), ("sampling_params",), ("sampling_params", "max_new_tokens"), ("sampling_params", "n"),
         ("stream",), ("rid",), ("priority",), ("emulator",), ("input_ids",), ("input_embeds",),
         ("logprob_start_len",), ("return_logprob",), ("image_data",), ("video_data",), ("audio_data",)],
    ),
    "chat": (
        "/v1/chat/completions",
        "chat",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "system"}], "stream": True,
         "max_completion_tokens": 3, "max_tokens": 2, "n": 1, "best_of": 2, "rid": "r", "tools": [{}]},
        [("model",), ("messages",), ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
         ("messages", 1, "content"), ("stream",), ("max_completion_tokens",), ("max_tokens",), ("n",),
         ("best_of",), ("rid",), ("tools",), ("priority",), ("emulator",)],
    ),
    "completions": (
        "/v1/completions",
        "completions",
        {"model": "m", "prompt": "hi", "max_tokens": 2, "n": 2, "best_of": 1, "rid": "r", "stream": False},
        [("model",), ("prompt",), ("max_completion_tokens",), ("max_tokens",), ("n",), ("best_of",), ("rid",),
         ("stream",), ("priority",), ("emulator",)],
    ),
}  # fmt: skip
_GONE = object()


def _with(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    """A deep copy of ``obj`` with the value at ``path`` replaced (``_GONE``: the key left out); as is
    where an earlier change left no such place."""
    obj = json.loads(json.dumps(obj))
    *parents, last = path
    holder = obj
    try:
        for key in parents:
            holder = holder[key]
        if value is _GONE:
            del holder[last]
        else:
            holder[last] = value
    except (KeyError, IndexError, TypeError):
        pass
    return obj


@pytest.mark.parametrize("base", sorted(BASES))
def test_every_field_at_every_edge_reads_the_same_on_either_path(base: str) -> None:
    """One field changed (or left out), then two: a plain reader's accepting check that let a value
    through that ``_from_object`` refuses or reads otherwise, or a check run out of order, differs."""
    path, kind, obj, fields = BASES[base]
    for bounds in (BOUNDS[0], BOUNDS[2]):
        for where in fields:
            for value in [*EDGES, _GONE]:
                _both(path, kind, _with(obj, where, value), bounds, True)
    for i, first in enumerate(fields):
        for second in fields[i + 1 :]:
            for a in FEW_EDGES:
                for b in FEW_EDGES:
                    _both(path, kind, _with(_with(obj, first, a), second, b), BOUNDS[1], False)


PLAIN = [
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
    ("/generate", {"text": "hi", "stream": True, "rid": "a", "sampling_params": {"n": 2, "top_p": 1}}),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1, "n": 2, "best_of": 3}),
    (
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4},
    ),
]


@pytest.mark.parametrize(("path", "obj"), PLAIN, ids=[p for p, _ in PLAIN])
def test_the_common_bodies_take_the_plain_path(
    path: str, obj: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guards the cut itself (issue #27): the small bodies every client sends are read without
    ``_from_object``, and what is read is what it would read."""
    raw = json.dumps(obj).encode()
    expected = parse_generation(path, raw, {}, max_body_bytes=LIMIT)

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("a plain body went to _from_object")

    monkeypatch.setattr(body_module, "_from_object", refuse)
    assert parse_generation(path, raw, {}, max_body_bytes=LIMIT) == expected
    assert parse_generation(path, raw, None, max_body_bytes=LIMIT).body_obj == obj


def test_a_priority_header_takes_the_general_path() -> None:
    raw = json.dumps({"text": "hi"}).encode()
    assert parse_generation("/generate", raw, {"x-priority": "3"}, max_body_bytes=LIMIT).priority == 3
    bounds = BOUNDS[3]
    req = parse_generation("/generate", raw, {"x-tier": "gold"}, max_body_bytes=LIMIT, priority=bounds)
    assert req.priority == 9
