"""Property-based fuzzing of what the sidecar reads from outside: request bodies and policy YAML.

The properties are the issue's: a request body either becomes a decision or a clear 400/413 that names
its field, never an exception (which the proxy would answer as a 500); a policy either loads or fails
with file, line and field, never a traceback. Examples are bounded so ``make test`` stays fast;
``make fuzz`` runs the same properties with ``SIDECAR_FUZZ_EXAMPLES`` set much higher.

Hypothesis writes the examples; what they reached is kept as regression tests below, each named for
the bug it found.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sidecar.intake.body as requests_module
from sidecar.admission.clock import LoopClock
from sidecar.admission.controller import Admission, Outcome
from sidecar.http.answers import decision_fields, invalid_request
from sidecar.intake.body import EXPLAIN_PATH, BadRequest, GenerationRequest, parse_explain, parse_generation
from sidecar.intake.demand import demand_of
from sidecar.intake.tokens import CounterConfig, PromptCounter
from sidecar.policy.engine_routes import RouteTable
from sidecar.policy.schema import PolicyError, load_policy_text
from tests.conftest import POLICIES, ManualClock, small_policy, snapshot
from tests.harness import FakeEngine, lane

EXAMPLES = int(os.environ.get("SIDECAR_FUZZ_EXAMPLES", "0")) or None
FUZZ = settings(
    max_examples=EXAMPLES or 150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
# Requests through a real lane cost a round trip each: fewer of them.
FUZZ_HTTP = settings(FUZZ, max_examples=EXAMPLES or 60)

CODES = {
    "invalid_json",
    "body_too_large",
    "invalid_body",
    "invalid_field",
    "missing_prompt",
    "empty_prompt",
    "gateway_field",
    "rid_in_flight",
}
LIMIT = 64 * 1024

# --- strategies --------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    # Unbounded: 99999999999999999999 and -2**70 are valid JSON integers.
    | st.integers()
    | st.sampled_from([0, -1, 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30])
    # Past a float's range (issue 24: a 400-digit integer in any numeric field was a 500, the error
    # message formatted it as a float), up to JSON's own 4,300-digit limit.
    | st.integers(min_value=10**308, max_value=10**4200)
    | st.integers(min_value=10**308, max_value=10**4200).map(lambda v: -v)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([1e308, -1e308, 5.0, 0.5, -0.0])
    | st.text(max_size=12)
)
junk = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=16,
)
token_ids = st.lists(st.integers(min_value=-3, max_value=2**40), min_size=0, max_size=6)
prompts = st.one_of(
    st.text(max_size=20),
    st.lists(st.text(max_size=8), max_size=3),
    token_ids,
    st.lists(token_ids, max_size=3),
    junk,
)
numbers = st.one_of(scalars, st.integers(min_value=-5, max_value=10**6))
content_parts = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", "input_audio", "x"]) | junk},
        optional={"text": st.text(max_size=10) | junk, "image_url": junk},
    ),
    max_size=3,
)
messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["user", "system", "assistant", "tool"]) | junk,
            "content": st.text(max_size=20) | content_parts | junk,
            "name": st.text(max_size=5) | junk,
            "tool_calls": junk,
            "reasoning_content": junk,
        },
    ),
    max_size=3,
)
emulator = st.fixed_dictionaries(
    {}, optional={"prompt_tokens": numbers, "cached_tokens": numbers, "prefix_key": junk}
)
sampling = st.fixed_dictionaries({}, optional={"max_new_tokens": numbers, "n": numbers, "temperature": junk})

# Every key any gated route's parser reads, with values that are sometimes right and often not.
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "text": prompts,
    "input_ids": prompts,
    "input_embeds": st.lists(st.lists(st.floats(width=16), max_size=3), max_size=3) | junk,
    "prompt": prompts,
    "messages": messages | junk,
    "tools": st.lists(junk, max_size=2) | junk,
    "input": prompts,
    "instructions": prompts,
    "query": prompts,
    "documents": prompts,
    "items": prompts,
    "system": prompts,
    "instances": junk,
    "suffix": prompts,
    "context": prompts,
    "images": prompts,
    "questions": prompts,
    "state": prompts,
    "parameters": st.fixed_dictionaries({}, optional={"sampling_params": sampling | junk}) | junk,
    "sampling_params": sampling | st.lists(sampling, max_size=2) | junk,
    "max_tokens": numbers,
    "max_completion_tokens": numbers,
    "max_output_tokens": numbers,
    "n": numbers,
    "stream": st.booleans() | junk,
    "rid": st.text(max_size=6) | st.lists(st.text(max_size=4), max_size=2) | junk,
    "priority": numbers,
    "model": st.text(max_size=6) | junk,
    "image_data": junk,
    "video_data": junk,
    "audio_data": junk,
    "emulator": emulator | junk,
}
bodies = st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), max_size=6).flatmap(
    lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in keys})
) | st.dictionaries(st.text(max_size=8), junk, max_size=4)
explain_bodies = st.fixed_dictionaries(
    {"prompt_tokens": numbers},
    optional={
        "max_new_tokens": numbers,
        "cached_tokens": numbers,
        "prefix_key": junk,
        "priority": numbers,
        "junk": junk,
    },
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "x-admission-priority": st.text(max_size=22) | st.integers().map(str),
        "X-Priority": st.text(max_size=5),
    },
)

ROUTES = sorted(RouteTable().routes.values(), key=lambda r: r.path)


def encode(obj: Any) -> bytes:
    """JSON as a client might send it: NaN and huge integers included (the standard encoder's way)."""
    return json.dumps(obj, allow_nan=True).encode()


raw_bodies = st.one_of(
    bodies.map(encode),
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"",
            b"   ",
            b"null",
            b"[]",
            b'"text"',
            b"{",
            b'{"text": "a"',
            b'{"text": "\\ud800"}',
            b'\xef\xbb\xbf{"text": "a"}',
            '{"text": "a"}'.encode("utf-16"),
            b'{"max_tokens": NaN, "prompt": "a"}',
            b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}",
            b'{"text": "a", "sampling_params": {"max_new_tokens": 1e999}}',
            b'{"text": ' + b"[" * 2000 + b"]" * 2000 + b"}",
        ]
    ),
)

# --- the core properties: parse, count, decide -------------------------------------------------


def check_bad_request(e: BadRequest, body: bytes) -> None:
    """A clear refusal: a known code, a sentence, and the field when a field was wrong."""
    assert e.status in (400, 413), e
    assert e.code in CODES, e
    assert e.message, e
    if e.code == "invalid_field":
        assert e.param, e
        root = e.param.split(".")[0].split("[")[0]
        assert root.encode() in body or root.lower().startswith("x-"), (e, body[:200])
    body_obj = invalid_request(e)
    assert orjson.dumps(body_obj)  # the answer itself can be written


class Decider:
    """Count and decide as the proxy does (no tokenizer: the bytes bound), with a fresh lane."""

    def __init__(self) -> None:
        self.admission = Admission(small_policy(), ManualClock())
        self.admission.update_snapshot(snapshot(self.admission.clock.now()))
        self.counter = PromptCounter(CounterConfig())

    def decide(self, req: GenerationRequest) -> dict[str, Any]:
        a = self.admission
        count = asyncio.run(self.counter.count(req))
        assert count.tokens >= 0
        demand = demand_of(a.rules, a.snapshot, req, count, now=a.clock.now())
        out = decision_fields(a.evaluate(demand), demand)
        json.dumps(out, allow_nan=False)  # what explain answers must serialise (as Starlette does)
        return out


DECIDER = Decider()


@FUZZ
@given(route=st.sampled_from(ROUTES), body=raw_bodies, hdrs=headers, emulator_ok=st.booleans())
def test_every_gated_body_is_a_decision_or_a_clear_400(
    route: Any, body: bytes, hdrs: dict[str, str], emulator_ok: bool
) -> None:
    try:
        req = parse_generation(
            route.path, body, hdrs, max_body_bytes=LIMIT, accept_emulator=emulator_ok, shape=route.shape
        )
    except BadRequest as e:
        check_bad_request(e, body + json.dumps(hdrs).encode())
        return
    DECIDER.decide(req)


@FUZZ
@given(body=explain_bodies.map(encode) | raw_bodies, path=st.sampled_from([None, *[r.path for r in ROUTES]]))
def test_every_explain_body_is_a_decision_or_a_clear_400(body: bytes, path: str | None) -> None:
    try:
        req = parse_explain(body, {}, max_body_bytes=LIMIT, path=path)
    except BadRequest as e:
        check_bad_request(e, body)
        return
    assert req.path in (EXPLAIN_PATH, path)
    DECIDER.decide(req)


# A flat `input_ids` of a large body is counted in the raw bytes (sidecar.intake.idscan), not decoded: the two
# paths must agree. The one documented difference: an array malformed in a way that still balances
# (`[1,,2 3]`, `[01]`) is counted and forwarded, where decoding refuses it (the engine refuses it too).
id_arrays = st.lists(
    st.sampled_from(
        ["1", "0", "42", "-1", "1.5", "1e3", "01", "99999999999999999999", '"7"', "[1]", "", " ", "null"]
    ),
    min_size=0,
    max_size=6,
).flatmap(
    lambda items: st.sampled_from([",", ", ", " ,", ",,", " "]).map(lambda sep: "[" + sep.join(items) + "]")
)
lift_bodies = st.tuples(
    id_arrays,
    st.sampled_from(
        [
            '{"input_ids": %s}',
            '{"input_ids": %s, "sampling_params": {"max_new_tokens": 5}}',
            '{"text": "a", "input_ids": %s}',
            '{"x": {"input_ids": %s}, "text": "a"}',
            '{"input_ids": %s, "input_ids": [1, 2]}',
            '{"input_ids": [1, 2], "input_ids": %s}',
            '{"text": "\\"input_ids\\": %s"}',
            '{"input_ids" : %s ,"stream": true}',
            '[{"input_ids": %s}]',
            '{"input_ids": %s',
        ]
    ),
)


def outcome(route: Any, body: bytes) -> tuple[str, Any]:
    try:
        req = parse_generation(route.path, body, {}, max_body_bytes=len(body) + 1, shape=route.shape)
    except BadRequest as e:
        return "refused", (e.code, e.param)
    count = asyncio.run(DECIDER.counter.count(req))
    return "counted", (count.tokens, req.n_texts, req.max_new_tokens, req.stream)


@FUZZ
@given(parts=lift_bodies, route=st.sampled_from([r for r in ROUTES if r.shape == "generate"]))
def test_counting_ids_in_the_raw_body_agrees_with_decoding_it(
    parts: tuple[str, str], route: Any, monkeypatch_module: Any
) -> None:
    array, template = parts
    body = (template % array).encode()
    monkeypatch_module.setattr(requests_module, "LIFT_IDS_BYTES", 1 << 40)
    decoded = outcome(route, body)
    monkeypatch_module.setattr(requests_module, "LIFT_IDS_BYTES", 0)
    lifted = outcome(route, body)
    if decoded != lifted:
        assert decoded[0] == "refused" and decoded[1][0] == "invalid_json", (body, decoded, lifted)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


# --- the same bodies through a real lane: never a 500, one outcome each ------------------------


@pytest.fixture(scope="module")
def live_lane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    """A real sidecar in front of a fake engine, served from its own thread's event loop so that the
    (synchronous) hypothesis test can send it requests one after another."""
    tmp = tmp_path_factory.mktemp("fuzz-lane")
    ready: dict[str, Any] = {}
    started, stop = threading.Event(), None

    async def run() -> None:
        nonlocal stop
        stop = asyncio.Event()
        # A stale signal rejects (503 with its reason) rather than holds: a busy machine must not turn
        # a slow poll into a client timeout here.
        async with lane(
            tmp,
            FakeEngine(events=1),
            app_kwargs={"trust_emulator_sizes": False},
            engine__on_stale="reject",
            gpu__on_stale="reject",
        ) as (
            url,
            app,
            _,
        ):
            ready.update(url=url, app=app, loop=asyncio.get_running_loop())
            started.set()
            await stop.wait()

    thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
    thread.start()
    assert started.wait(30), "the fuzz lane did not start"
    try:
        yield ready["url"], ready["app"]
    finally:
        ready["loop"].call_soon_threadsafe(stop.set)  # type: ignore[union-attr]
        thread.join(30)


def outcomes_total(app: Any) -> float:
    return sum(
        app.registry.get_sample_value("sglang_sidecar_requests_total", {"outcome": o.value}) or 0
        for o in Outcome
    )


@FUZZ_HTTP
@given(route=st.sampled_from(ROUTES), body=raw_bodies)
def test_fuzzed_bodies_through_the_proxy_never_answer_500(
    live_lane: tuple[str, Any], route: Any, body: bytes
) -> None:
    url, app = live_lane
    before = outcomes_total(app)
    r = httpx.post(url + route.path, content=body, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code < 500 or r.headers.get("x-admission-reason"), (r.status_code, r.text[:300])
    if r.status_code in (400, 413):
        error = r.json()["error"]
        assert error["code"] in CODES and error["message"], error
    # One outcome per gated request (recorded as the answer ends: wait for it, bounded), and nothing
    # left charged once it is answered.
    deadline = time.monotonic() + 10
    while outcomes_total(app) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert outcomes_total(app) == before + 1
    assert app.admission.ledger.totals.requests == 0 and app.admission.held == 0


def _raw_exchange(url: str, request: bytes) -> bytes:
    """One raw request in one write (a client library would split or refuse it), the whole answer."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@FUZZ_HTTP
@given(
    count=st.integers(min_value=0, max_value=12_000),
    name=st.sampled_from([b"a", b"x-h", b"accept"]),
    value=st.binary(min_size=0, max_size=3).map(lambda b: b.hex().encode()),
)
def test_many_small_headers_never_reach_the_engine_past_the_limit(
    live_lane: tuple[str, Any], count: int, name: bytes, value: bytes
) -> None:
    """Issue 24: 9,000 small headers (~100 KiB) in one write reached the engine, the limit counted only
    after httptools had parsed them all. Any count of headers in one write: at most 100 get in,
    more answer 431 before the app, never a 5xx."""
    url, app = live_lane
    before = outcomes_total(app)
    body = b'{"text": "hi", "stream": false}'
    headers = b"".join(name + b"%d: " % i + value + b"\r\n" for i in range(count))
    request = (
        b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n%s\r\n%s" % (len(body), headers, body)
    )
    answer = _raw_exchange(url, request)
    status = int(answer.split(b" ", 2)[1])
    if count + 4 > 100:
        assert status == 431, answer[:200]
        assert outcomes_total(app) == before  # the app never saw it
    else:
        assert status < 500 or b"x-admission-reason" in answer, answer[:300]


# --- policies ----------------------------------------------------------------------------------

BASE_POLICY = (POLICIES / "h200-generic.yaml").read_text(encoding="utf-8")
BASE = yaml.safe_load(BASE_POLICY)


def leaves(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from leaves(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from leaves(v, (*path, i))
    yield path


PATHS = [p for p in leaves(BASE) if p]
yaml_values = (
    scalars
    | junk
    | st.sampled_from(
        ["1GiB", "-1MiB", "1e400", "0x10", "1.5KiB", "9" * 40, "nan", 10**400, 10**5000, 2**64, float("inf")]
    )
)


def check_policy_error(e: PolicyError, source: str) -> None:
    assert e.problems, e
    for problem in e.problems:
        # file:line[:column]: field: message (or file:line: YAML syntax: ...)
        assert problem.startswith(source + ":"), problem
        where = problem.removeprefix(source + ":").split(":", 1)[0]
        assert where.isdigit(), problem


def usable(text: str) -> None:
    """Load ``text``; a policy that loads must also decide without an exception."""
    try:
        loaded = load_policy_text(text, "p.yaml")
    except PolicyError as e:
        check_policy_error(e, "p.yaml")
        return
    a = Admission(loaded, LoopClock())
    a.update_snapshot(snapshot(a.clock.now()))
    from sidecar.core import demand

    for tokens in (1, 1000, 10**6):
        d = demand.build(a.rules, tokens, arrived_at=a.clock.now(), max_new_tokens=100)
        json.dumps(decision_fields(a.evaluate(d), d), allow_nan=False)


@FUZZ
@given(changes=st.lists(st.tuples(st.sampled_from(PATHS), yaml_values), min_size=1, max_size=3))
def test_a_mutated_policy_loads_and_decides_or_names_file_line_and_field(
    changes: list[tuple[tuple[Any, ...], Any]],
) -> None:
    data = json.loads(json.dumps(BASE))
    for path, value in changes:
        node = data
        for part in path[:-1]:
            node = node[part] if isinstance(node, dict | list) else None
            if node is None:
                break
        last = path[-1]
        if isinstance(node, dict) or (isinstance(node, list) and isinstance(last, int) and last < len(node)):
            node[last] = value
    try:
        text = yaml.safe_dump(data, allow_unicode=True)
    except (yaml.YAMLError, ValueError):
        return
    usable(text)


@FUZZ
@given(text=st.text(max_size=200) | st.sampled_from(BASE_POLICY.splitlines(keepends=True)).map(str))
def test_any_text_is_a_policy_or_a_located_error(text: str) -> None:
    usable(text)


# Plain scalars YAML resolves to a type it then cannot construct (issue 24: refused with a traceback
# only, the refusal counter and last_failure unmoved).
unconstructible = st.sampled_from([" 2026-02-30", " 2025-13-01", " 1" + "0" * 5000, " 2026-02-29T25:00:00"])


@FUZZ
@given(
    cut=st.integers(min_value=0, max_value=len(BASE_POLICY)),
    insert=st.text(max_size=6) | unconstructible,
)
def test_an_edited_policy_file_is_a_policy_or_a_located_error(cut: int, insert: str) -> None:
    usable(BASE_POLICY[:cut] + insert + BASE_POLICY[cut + len(insert) :])


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(BASE_POLICY.replace("\nname:", "\nwritten: 2026-02-30\nname:", 1), id="impossible-date"),
        pytest.param(
            re.sub(r"\n  max_held: [^\n]*", "\n  max_held: 1" + "0" * 5000, BASE_POLICY), id="5000-digits"
        ),
    ],
)
def test_a_value_yaml_cannot_construct_is_a_located_error(text: str) -> None:
    """Issue 24: an impossible date or a 5,000-digit integer raised ValueError out of PyYAML's
    constructor, which only a traceback reported."""
    assert text != BASE_POLICY
    with pytest.raises(PolicyError, match=r"p\.yaml:\d+:\d+: .* cannot be read") as info:
        load_policy_text(text, "p.yaml")
    check_policy_error(info.value, "p.yaml")


# --- regressions: what the fuzzers found ---------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("[" * 3000 + "]" * 3000, id="nested-3000-deep"),
        pytest.param("a: &a [*a]\n", id="recursive-alias"),
        pytest.param("lane: &l {x: [*l]}\n", id="recursive-alias-in-mapping"),
    ],
)
def test_deep_or_recursive_yaml_is_a_located_error(text: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy_text(text, "p.yaml")
    check_policy_error(info.value, "p.yaml")


def test_an_alias_bomb_is_refused_quickly() -> None:
    """Nine levels of nine aliases: 387 million nodes once expanded. Refused from the node count, not
    after walking them (the duplicate-key check used to walk every expanded node)."""
    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    with pytest.raises(PolicyError, match="aliases") as info:
        load_policy_text("\n".join(lines) + "\n", "p.yaml")
    check_policy_error(info.value, "p.yaml")


def test_anchors_and_merge_keys_still_load() -> None:
    """What people do write: an anchor reused under a merge key."""
    text = BASE_POLICY.replace("\ngpu:", "\ngpu: &signal", 1)
    assert text != BASE_POLICY
    loaded = load_policy_text(text.rstrip("\n") + "\n", "p.yaml")
    assert loaded.policy.gpu.max_age_s > 0


def test_a_control_character_is_a_located_error() -> None:
    with pytest.raises(PolicyError) as info:
        load_policy_text("name: a\x08\n", "p.yaml")
    check_policy_error(info.value, "p.yaml")


@pytest.mark.parametrize("rid", ["café", "a\nb", "x" * 200, "\U000fef10"])
async def test_a_rid_that_is_no_header_value_gets_a_fresh_request_id(tmp_path: Path, rid: str) -> None:
    """Found by the proxy fuzzer: the body's rid became the answer's X-Request-ID as is, and a rid
    outside printable ASCII (or with a newline) made the answer itself fail: a 500."""
    engine = FakeEngine()
    async with lane(tmp_path, engine) as (url, _app, _), httpx.AsyncClient(timeout=10) as c:
        r = await c.post(url + "/generate", json={"text": "hello", "stream": False, "rid": rid})
        assert r.status_code == 200, r.text
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
        assert engine.arrived[0]["rid"] == rid  # the body reaches the engine unchanged
        ok = await c.post(url + "/generate", json={"text": "hello", "stream": False, "rid": "mine-1"})
        assert ok.headers["x-request-id"] == "mine-1"


@pytest.mark.parametrize("field", ["margin", "chunk_context_bytes"])
@pytest.mark.parametrize("value", [".inf", ".nan"])
def test_an_infinite_cost_figure_is_refused_at_its_line(field: str, value: str) -> None:
    """Found by the policy fuzzer: `margin: .inf` passed `ge=1`, then every projection overflowed
    (OverflowError: a 500 for every request under that policy)."""
    text = re.sub(rf"\n  {field}: [^\n]*", f"\n  {field}: {value}", BASE_POLICY)
    assert text != BASE_POLICY
    with pytest.raises(PolicyError, match=rf"p\.yaml:\d+: cost\.{field}: ") as info:
        load_policy_text(text, "p.yaml")
    check_policy_error(info.value, "p.yaml")


def test_an_astronomical_integer_is_refused_at_its_line() -> None:
    """Found by the policy fuzzer: a 400-digit `context_len` validated, then every projection raised
    OverflowError (int too large to convert to float): a 500 for every request."""
    text = re.sub(r"\n  context_len: [^\n]*", "\n  context_len: 1" + "0" * 400, BASE_POLICY)
    with pytest.raises(PolicyError, match=r"p\.yaml:\d+: lane\.context_len: .*beyond any figure") as info:
        load_policy_text(text, "p.yaml")
    check_policy_error(info.value, "p.yaml")


def test_a_projection_past_float_range_is_unfit_not_an_exception() -> None:
    """Found by the policy fuzzer: `chunk_context_bytes: 1e300` (finite, allowed) times chunk times
    context is infinity, and int(inf) raised in every projection."""
    text = re.sub(r"\n  chunk_context_bytes: [^\n]*", "\n  chunk_context_bytes: 1e300", BASE_POLICY)
    a = Admission(load_policy_text(text, "p.yaml"), ManualClock())
    a.update_snapshot(snapshot(a.clock.now()))
    from sidecar.core import demand

    d = demand.build(a.rules, 100_000, arrived_at=a.clock.now())
    decision = a.evaluate(d)
    assert decision.action.value == "reject" and decision.reason.value == "unfit_request"
