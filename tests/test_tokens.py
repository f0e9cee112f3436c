"""Prompt token counting: method order, exact counts with a real tokenizer.json, the engine's
/tokenize (and its remembered 404), and the bytes-per-token bound."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from sidecar.intake.body import GenerationRequest, parse_generation
from sidecar.intake.idscan import JsonText
from sidecar.intake.tokens import CounterConfig, PromptCounter, TokenCount, TokenizerLoadError

CORPUS = [
    "the cat sat on the mat",
    "the dog ate the bone",
    "a long prompt is many words",
]


@pytest.fixture
def tokenizer_path(tmp_path: Path) -> Path:
    """A word-level tokenizer.json trained here: one token per known word, [UNK] for the rest."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def req(path: str, obj: dict[str, Any]) -> GenerationRequest:
    return parse_generation(path, json.dumps(obj).encode(), max_body_bytes=10**8)


class FakeEngine:
    """An injected `/tokenize`: answers by whitespace words, or a fixed answer, and records calls."""

    def __init__(self, answer: int | Exception | str | None = "words") -> None:
        self.answer = answer
        self.calls: list[dict[str, Any]] = []

    async def __call__(self, payload: dict[str, Any]) -> int | None:
        self.calls.append(payload)
        if isinstance(self.answer, Exception):
            raise self.answer
        if self.answer == "words":
            if "messages" in payload:
                return 100 + sum(len(m["content"].split()) for m in payload["messages"])
            return len(payload["prompt"].split())
        assert not isinstance(self.answer, str)
        return self.answer


TEXT = {"text": "the cat sat on the mat"}  # 6 words, 22 bytes
ENGINE_ON = CounterConfig(use_engine_tokenize=True)  # the engine's /tokenize is opt-in


# --- method order ------------------------------------------------------------------------------


async def test_declared_beats_everything(tokenizer_path: Path) -> None:
    engine = FakeEngine()
    counter = PromptCounter(CounterConfig(tokenizer_path=tokenizer_path), engine_tokenize=engine)
    body = {"input_ids": [1, 2, 3], "emulator": {"prompt_tokens": 500_000}}
    assert await counter.count(req("/generate", body)) == TokenCount(500_000, True, "declared")
    assert engine.calls == []


async def test_ids_beat_tokenizer_and_engine(tokenizer_path: Path) -> None:
    engine = FakeEngine()
    counter = PromptCounter(CounterConfig(tokenizer_path=tokenizer_path), engine_tokenize=engine)
    assert await counter.count(req("/generate", {"input_ids": [7] * 1234})) == TokenCount(
        1234, True, "input_ids"
    )
    batch = req("/v1/completions", {"prompt": [[1, 2], [3, 4, 5]]})
    assert await counter.count(batch) == TokenCount(5, True, "input_ids")
    embeds = req("/generate", {"input_embeds": [[0.0], [0.0], [0.0]]})
    assert await counter.count(embeds) == TokenCount(3, True, "input_embeds")
    assert engine.calls == []


async def test_tokenizer_beats_engine(tokenizer_path: Path) -> None:
    engine = FakeEngine(answer=999)
    counter = PromptCounter(CounterConfig(tokenizer_path=tokenizer_path), engine_tokenize=engine)
    assert await counter.count(req("/generate", TEXT)) == TokenCount(6, True, "tokenizer")
    assert engine.calls == []


async def test_engine_beats_bytes() -> None:
    engine = FakeEngine()
    counter = PromptCounter(ENGINE_ON, engine_tokenize=engine)
    count = await counter.count(req("/v1/completions", {"prompt": "the cat sat on the mat", "model": "qwen"}))
    assert count == TokenCount(6, True, "engine")
    assert engine.calls == [{"prompt": "the cat sat on the mat", "add_special_tokens": True, "model": "qwen"}]


async def test_bytes_when_nothing_else() -> None:
    counter = PromptCounter()
    assert await counter.count(req("/generate", TEXT)) == TokenCount(math.ceil(22 / 2.5), False, "bytes")


async def test_engine_disabled_by_config() -> None:
    engine = FakeEngine()
    counter = PromptCounter(CounterConfig(use_engine_tokenize=False), engine_tokenize=engine)
    assert (await counter.count(req("/generate", TEXT))).method == "bytes"
    assert engine.calls == []
    assert not counter.engine_tokenize_available


# --- the local tokenizer -----------------------------------------------------------------------


async def test_tokenizer_counts_exactly(tokenizer_path: Path) -> None:
    counter = PromptCounter(CounterConfig(tokenizer_path=tokenizer_path))
    text = "the dog sat on a long bone and an unknown word"  # 11 words, unknowns are [UNK], still 1 each
    assert await counter.count(req("/v1/completions", {"prompt": text})) == TokenCount(11, True, "tokenizer")


async def test_tokenizer_sums_a_batch(tokenizer_path: Path) -> None:
    counter = PromptCounter(CounterConfig(tokenizer_path=tokenizer_path))
    batch = req("/generate", {"text": ["the cat", "the dog ate", "a"]})
    assert await counter.count(batch) == TokenCount(6, True, "tokenizer")


async def test_tokenizer_truncation_in_the_file_is_switched_off(tmp_path: Path, tokenizer_path: Path) -> None:
    truncating = Tokenizer.from_file(str(tokenizer_path))
    truncating.enable_truncation(max_length=4)
    path = tmp_path / "truncating.json"
    truncating.save(str(path))
    counter = PromptCounter(CounterConfig(tokenizer_path=path))
    assert (await counter.count(req("/generate", TEXT))).tokens == 6


async def test_large_text_is_encoded_in_a_thread(
    tokenizer_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threaded: list[int] = []
    real_to_thread = asyncio.to_thread

    async def spy(func: Any, /, *args: Any, **kwargs: Any) -> Any:
        threaded.append(len(args[1]))
        return await real_to_thread(func, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", spy)  # the module tokens.py calls it through
    counter = PromptCounter(CounterConfig(tokenizer_path=tokenizer_path, thread_threshold_chars=1000))

    small = await counter.count(req("/generate", TEXT))
    assert (small.tokens, threaded) == (6, [])

    big_text = " ".join(["the cat sat on the mat"] * 100)  # 2,299 characters, 600 words
    big = await counter.count(req("/generate", {"text": big_text}))
    assert (big.tokens, big.exact, threaded) == (600, True, [1])


async def test_tokenizer_failure_falls_through(tokenizer_path: Path) -> None:
    # A lone surrogate is valid JSON but not a Rust string: the tokenizer refuses it, the bound does not.
    engine = FakeEngine(answer=RuntimeError("down"))
    counter = PromptCounter(CounterConfig(tokenizer_path=tokenizer_path), engine_tokenize=engine)
    body = b'{"text": "the cat \\ud800"}'
    count = await counter.count(parse_generation("/generate", body, max_body_bytes=100))
    # "the cat " is 8 bytes, the surrogate 3
    assert count == TokenCount(math.ceil(11 / 2.5), False, "bytes")


def test_missing_tokenizer_file_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match=r"cannot load tokenizer .*nope\.json"):
        PromptCounter(CounterConfig(tokenizer_path=tmp_path / "nope.json"))


def test_broken_tokenizer_file_fails_at_construction(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    with pytest.raises(TokenizerLoadError):
        PromptCounter(CounterConfig(tokenizer_path=path))


# --- chat --------------------------------------------------------------------------------------

CHAT_BODY = {
    "messages": [
        {"role": "system", "content": "the cat"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "the dog ate"}, {"type": "text", "text": "a bone"}],
        },
    ]
}


async def test_chat_with_tokenizer_is_contents_plus_template_bound(tokenizer_path: Path) -> None:
    config = CounterConfig(
        tokenizer_path=tokenizer_path, chat_overhead_tokens_per_message=5, chat_overhead_tokens_fixed=10
    )
    counter = PromptCounter(config)
    count = await counter.count(req("/v1/chat/completions", CHAT_BODY))
    # contents 2 + 3 + 2 words, 2 messages x 5, fixed 10; a bound, since the template is not applied
    assert count == TokenCount(7 + 2 * 5 + 10, False, "tokenizer")


async def test_chat_media_tools_and_tool_calls(tokenizer_path: Path) -> None:
    config = CounterConfig(
        tokenizer_path=tokenizer_path,
        chat_overhead_tokens_per_message=5,
        chat_overhead_tokens_fixed=10,
        chat_overhead_tokens_tools=100,
        tokens_per_media_item=1000,
    )
    counter = PromptCounter(config)
    body: dict[str, Any] = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "the cat"},
                    {"type": "image_url", "image_url": {"url": "data:x"}},
                    {"type": "video_url", "video_url": {"url": "v"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "mat", "arguments": "cat"}}],
            },
        ],
        "tools": [{"name": "dog"}],
    }
    parts = counter._chat_parts(req("/v1/chat/completions", body))
    assert parts.media == 2
    assert parts.overhead == 10 + 2 * 5 + 100
    tool_calls_words = len(
        Tokenizer.from_file(str(tokenizer_path)).encode(json.dumps(body["messages"][1]["tool_calls"])).ids
    )
    tools_words = len(Tokenizer.from_file(str(tokenizer_path)).encode(json.dumps(body["tools"])).ids)
    count = await counter.count(req("/v1/chat/completions", body))
    assert count == TokenCount(2 + tool_calls_words + tools_words + 120 + 2000, False, "tokenizer")


async def test_chat_with_engine_uses_the_server_template() -> None:
    engine = FakeEngine()
    counter = PromptCounter(ENGINE_ON, engine_tokenize=engine)
    body = {"model": "qwen", "messages": [{"role": "user", "content": "the cat sat"}]}
    assert await counter.count(req("/v1/chat/completions", body)) == TokenCount(103, True, "engine")
    assert engine.calls == [{"messages": body["messages"], "model": "qwen"}]


async def test_chat_with_engine_bounds_tools_it_cannot_see() -> None:
    counter = PromptCounter(
        CounterConfig(chat_overhead_tokens_tools=50, use_engine_tokenize=True), engine_tokenize=FakeEngine()
    )
    tools = [{"name": "f"}]
    body = {"messages": [{"role": "user", "content": "the cat sat"}], "tools": tools}
    tools_bound = math.ceil(len(json.dumps(tools)) / 2.5)
    assert await counter.count(req("/v1/chat/completions", body)) == TokenCount(
        103 + 50 + tools_bound, False, "engine"
    )


async def test_chat_bytes_fallback() -> None:
    config = CounterConfig(
        bytes_per_token=2.0, chat_overhead_tokens_per_message=5, chat_overhead_tokens_fixed=10
    )
    counter = PromptCounter(config)
    count = await counter.count(req("/v1/chat/completions", CHAT_BODY))
    # "the cat" 7 -> 4, "the dog ate" 11 -> 6, "a bone" 6 -> 3; 2 messages x 5; fixed 10
    assert count == TokenCount(4 + 6 + 3 + 10 + 10, False, "bytes")


# --- the engine's /tokenize --------------------------------------------------------------------


async def test_engine_404_is_remembered() -> None:
    engine = FakeEngine(answer=None)
    counter = PromptCounter(ENGINE_ON, engine_tokenize=engine)
    first = await counter.count(req("/generate", TEXT))
    second = await counter.count(req("/generate", TEXT))
    assert first.method == second.method == "bytes"
    assert len(engine.calls) == 1
    assert not counter.engine_tokenize_available

    engine.answer = "words"
    counter.reset_engine_tokenize()
    assert await counter.count(req("/generate", TEXT)) == TokenCount(6, True, "engine")


async def test_engine_error_falls_back_but_is_asked_again() -> None:
    engine = FakeEngine(answer=ConnectionError("refused"))
    counter = PromptCounter(ENGINE_ON, engine_tokenize=engine)
    assert (await counter.count(req("/generate", TEXT))).method == "bytes"
    engine.answer = "words"
    assert (await counter.count(req("/generate", TEXT))).method == "engine"
    assert counter.engine_tokenize_available


@pytest.mark.parametrize("answer", [-1, "12", True, 2.5])
async def test_engine_nonsense_answer_falls_back(answer: Any) -> None:
    async def engine(payload: dict[str, Any]) -> Any:
        return answer

    counter = PromptCounter(ENGINE_ON, engine_tokenize=engine)
    assert (await counter.count(req("/generate", TEXT))).method == "bytes"
    assert counter.engine_tokenize_available


async def test_engine_that_never_answers_falls_back() -> None:
    never = asyncio.Event()

    async def engine(payload: dict[str, Any]) -> int | None:
        await never.wait()
        return 1

    counter = PromptCounter(
        CounterConfig(engine_tokenize_timeout_s=0.01, use_engine_tokenize=True), engine_tokenize=engine
    )
    assert (await counter.count(req("/generate", TEXT))).method == "bytes"


async def test_engine_batch_is_asked_per_prompt() -> None:
    engine = FakeEngine()
    counter = PromptCounter(ENGINE_ON, engine_tokenize=engine)
    assert await counter.count(req("/generate", {"text": ["a b", "c d e"]})) == TokenCount(5, True, "engine")
    assert [call["prompt"] for call in engine.calls] == ["a b", "c d e"]


# --- the bytes bound ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bytes_per_token", "expected"),
    [
        ("abcde", 2.5, 2),  # 5 / 2.5 = 2 exactly: no rounding up
        ("abcdef", 2.5, 3),  # 6 / 2.5 = 2.4 -> 3
        ("a", 2.5, 1),
        ("\u4e2d\u6587", 2.5, 3),  # 2 CJK characters = 6 UTF-8 bytes -> 2.4 -> 3
        ("\U0001f600", 2.5, 2),  # one emoji, 4 bytes
        ("x" * 2_000_000, 2.5, 800_000),  # a ~500K-token English prompt is bounded at 800K, not millions
        ("abcdef", 1.0, 6),
    ],
)
async def test_bytes_bound_math(text: str, bytes_per_token: float, expected: int) -> None:
    counter = PromptCounter(CounterConfig(bytes_per_token=bytes_per_token))
    assert await counter.count(req("/generate", {"text": text})) == TokenCount(expected, False, "bytes")


async def test_bytes_bound_sums_a_batch_per_prompt() -> None:
    counter = PromptCounter()
    assert (await counter.count(req("/v1/completions", {"prompt": ["abc", "abc"]}))).tokens == 2 * 2


async def test_generate_media_items_add_the_bound(tokenizer_path: Path) -> None:
    counter = PromptCounter(CounterConfig(tokenizer_path=tokenizer_path, tokens_per_media_item=500))
    body = {"text": "the cat", "image_data": ["a.png", ["b.png", "c.png"]]}
    assert await counter.count(req("/generate", body)) == TokenCount(2 + 3 * 500, False, "tokenizer")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bytes_per_token": 0},
        {"bytes_per_token": float("nan")},
        {"chat_overhead_tokens_fixed": -1},
        {"engine_tokenize_timeout_s": 0},
    ],
)
def test_config_rejects_nonsense(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        CounterConfig(**kwargs)


async def test_request_without_prompt_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="carries no prompt"):
        await PromptCounter().count(GenerationRequest(path="/generate"))


# --- reconfiguration on a policy reload --------------------------------------------------------


async def test_config_reload_loads_a_new_tokenizer_and_toggles_the_engine(tokenizer_path: Path) -> None:
    engine = FakeEngine(answer=42)
    counter = PromptCounter(CounterConfig(use_engine_tokenize=False), engine_tokenize=engine)
    assert (await counter.count(req("/generate", TEXT))).method == "bytes"

    counter.config = CounterConfig(use_engine_tokenize=True)
    assert await counter.count(req("/generate", TEXT)) == TokenCount(42, True, "engine")

    counter.config = CounterConfig(tokenizer_path=tokenizer_path)
    assert await counter.count(req("/generate", TEXT)) == TokenCount(6, True, "tokenizer")

    counter.config = CounterConfig(tokenizer_path=None, use_engine_tokenize=False)
    assert (await counter.count(req("/generate", TEXT))).method == "bytes"


async def test_config_reload_with_a_bad_tokenizer_keeps_the_running_one(
    tmp_path: Path, tokenizer_path: Path
) -> None:
    running = CounterConfig(tokenizer_path=tokenizer_path)
    counter = PromptCounter(running)
    with pytest.raises(TokenizerLoadError):
        counter.config = CounterConfig(tokenizer_path=tmp_path / "missing.json")
    assert counter.config is running
    assert await counter.count(req("/generate", TEXT)) == TokenCount(6, True, "tokenizer")


# --- counting only when the count decides ----------------------------------------------------


def byte_level_bpe(tmp_path: Path) -> Path:
    """A small byte-level BPE (the GPT-2/Qwen kind) trained here on mixed scripts."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([*CORPUS, "数据中心的显存", "naïve café ☕ 🚀"], trainer)
    path = tmp_path / "bpe.json"
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize(
    "text", ["the cat sat on the mat", "数据中心的显存不够了", "naïve café ☕ 🚀 \ud83d", "x" * 5000, " "]
)
async def test_the_bound_is_never_below_the_exact_count(tmp_path: Path, text: str) -> None:
    counter = PromptCounter(CounterConfig(tokenizer_path=byte_level_bpe(tmp_path)))
    for body in ({"text": text}, {"messages": [{"role": "user", "content": text}]}):
        path = "/generate" if "text" in body else "/v1/chat/completions"
        r = req(path, body)
        bound, exact = counter.bound(r), await counter.count(r)
        assert bound is not None and bound.method == "bound" and not bound.exact
        assert bound.tokens >= exact.tokens


async def test_an_admitting_bound_skips_the_tokenizer(tokenizer_path: Path) -> None:
    counter = PromptCounter(CounterConfig(tokenizer_path=tokenizer_path))
    asked: list[TokenCount] = []

    def admits(yes: bool):  # type: ignore[no-untyped-def]
        def check(count: TokenCount) -> bool:
            asked.append(count)
            return yes

        return check

    assert await counter.count(req("/generate", TEXT), admits=admits(True)) == TokenCount(
        22 + 8, False, "bound"
    )
    assert await counter.count(req("/generate", TEXT), admits=admits(False)) == TokenCount(
        6, True, "tokenizer"
    )
    assert asked == [TokenCount(30, False, "bound")] * 2
    # Already cheap: no bound is offered, the count is what it is.
    assert await counter.count(req("/generate", {"input_ids": [1, 2]}), admits=admits(True)) == TokenCount(
        2, True, "input_ids"
    )
    assert PromptCounter().bound(req("/generate", TEXT)) is None  # no tokenizer: bytes bound is the count
    assert len(asked) == 2


# --- the engine's model's tokenizer, and reloads off the loop -------------------------------------


async def test_the_engines_model_directory_or_hf_id_supplies_the_tokenizer(
    tokenizer_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = PromptCounter()
    assert await counter.adopt_engine_model(["/no/such/model"]) is None
    assert (await counter.count(req("/generate", TEXT))).method == "bytes"
    assert await counter.adopt_engine_model([str(tokenizer_path.parent)]) == str(tokenizer_path)
    assert await counter.count(req("/generate", TEXT)) == TokenCount(6, True, "tokenizer")

    # An HF id, found in the local hub cache the way SGLang downloads it.
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").write_bytes(tokenizer_path.read_bytes())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    other = PromptCounter()
    assert await other.adopt_engine_model(["Qwen/Qwen3-8B"]) == str(snapshot / "tokenizer.json")

    # The policy's own tokenizer wins; opting out of the engine's keeps the bytes bound.
    named = PromptCounter(CounterConfig(tokenizer_path=tokenizer_path))
    await named.adopt_engine_model([str(snapshot)])
    assert (await named.count(req("/generate", TEXT))).method == "tokenizer"
    off = PromptCounter(CounterConfig(tokenizer_from_engine=False))
    await off.adopt_engine_model([str(snapshot)])
    assert (await off.count(req("/generate", TEXT))).method == "bytes"


async def test_reconfigure_loads_the_tokenizer_off_the_event_loop(
    tokenizer_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import sidecar.intake.tokens

    threads: list[threading.Thread] = []
    real = sidecar.intake.tokens.load_tokenizer

    def spy(path):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread())
        return real(path)

    monkeypatch.setattr(sidecar.intake.tokens, "load_tokenizer", spy)
    counter = PromptCounter()
    await counter.reconfigure(CounterConfig(tokenizer_path=tokenizer_path))
    assert threads and threads[0] is not threading.main_thread()
    assert await counter.count(req("/generate", TEXT)) == TokenCount(6, True, "tokenizer")
    with pytest.raises(TokenizerLoadError):
        await counter.reconfigure(CounterConfig(tokenizer_path=tokenizer_path.parent / "missing.json"))
    assert counter.config.tokenizer_path == tokenizer_path


# --- a large text left encoded in its body (sidecar.intake.idscan.JsonText) ---------------------------

BIG_TEXT = "the cat sat on the mat\n" * 20_000  # 120,000 words, 460 KB: measured in the raw body


async def test_a_large_text_left_in_its_body_is_decoded_for_the_tokenizer_and_the_engine(
    tokenizer_path: Path,
) -> None:
    big = req("/generate", {"text": BIG_TEXT})
    assert isinstance(big.prompt_text, JsonText)
    counter = PromptCounter(CounterConfig(tokenizer_path=tokenizer_path))
    assert await counter.count(big) == TokenCount(120_000, True, "tokenizer")
    engine = FakeEngine()
    assert await PromptCounter(ENGINE_ON, engine_tokenize=engine).count(big) == TokenCount(
        120_000, True, "engine"
    )
    assert engine.calls == [{"prompt": BIG_TEXT, "add_special_tokens": True}]


async def test_a_large_text_left_in_its_body_has_the_same_bounds_as_its_str() -> None:
    big, small = (
        req("/generate", {"text": BIG_TEXT}),
        replace(req("/generate", {"text": "x"}), prompt_text=BIG_TEXT),
    )
    assert isinstance(big.prompt_text, JsonText)
    counter = PromptCounter()
    assert await counter.count(big) == await counter.count(small)  # the bytes bound, exact UTF-8 size
    engine_counter = PromptCounter(ENGINE_ON, engine_tokenize=FakeEngine())
    assert engine_counter.bound(big) == engine_counter.bound(small) is not None


# --- the count without a coroutine (PromptCounter.count_now: the proxy's common case) ------------


@pytest.mark.parametrize(
    "body",
    [
        {"text": "the cat sat on the mat", "emulator": {"prompt_tokens": 40}},
        {"input_ids": [1, 2, 3]},
        {"input_ids": [[1, 2], [3]]},
        {"input_embeds": [[0.1, 0.2], [0.3, 0.4]]},
        TEXT,
        {"text": ["the cat", "a dog"]},
        {"text": "the cat", "image_data": ["a", "b"]},
    ],
)
@pytest.mark.parametrize("setup", ["bytes only", "tokenizer", "engine"])
@pytest.mark.parametrize("verdict", [None, True, False])
async def test_count_now_answers_as_count_or_leaves_it_to_count(
    tokenizer_path: Path, body: dict[str, Any], setup: str, verdict: bool | None
) -> None:
    """Whatever ``count_now`` answers is what ``count`` answers; where it answers None, ``count``
    without ``admits`` answers what ``count`` with it would (``admits`` was asked once, and said no or
    had no bound to judge). The proxy relies on both (``_decide``)."""
    config = {
        "bytes only": CounterConfig(),
        "tokenizer": CounterConfig(tokenizer_path=tokenizer_path),
        "engine": ENGINE_ON,
    }[setup]
    counter = PromptCounter(config, engine_tokenize=FakeEngine())
    r = req("/generate", body)
    asked: list[TokenCount] = []

    def admits(c: TokenCount) -> bool:
        asked.append(c)
        return bool(verdict)

    want = await counter.count(r, admits=None if verdict is None else admits)
    asked.clear()
    now = counter.count_now(r, admits=None if verdict is None else admits)
    assert len(asked) <= 1
    got = now if now is not None else await counter.count(r)
    assert got == want
    if setup == "bytes only":
        assert now is not None  # no tokenizer and no engine: never a coroutine
