"""``PromptCounter.count_now`` answers without a coroutine what ``count`` would answer, and nothing it
would not: it reads a flag (``_bytes_only``) kept with the counter's sources, so every change of source
(a policy's tokenizer, the engine's model adopted, /tokenize found missing or asked again) must reach it.
Each state is compared here for a text, a chat, a batch, media and a non-ASCII prompt."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from sidecar.intake.body import GenerationRequest, parse_generation
from sidecar.intake.tokens import CounterConfig, PromptCounter, TokenCount
from tests.test_tokens import FakeEngine, tokenizer_path  # noqa: F401 (a fixture)

BODIES = [
    ("/generate", {"text": "the cat sat on the mat"}),
    ("/generate", {"text": "é ü 猫 \ud800 x", "image_data": ["a", "b"]}),
    ("/generate", {"text": ["the cat", "a dog"]}),
    ("/v1/completions", {"prompt": "the dog ate the bone", "model": "m"}),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "the cat"}, {"type": "image_url"}]},
            ],
            "tools": [{"type": "function"}],
        },
    ),
]


def _req(path: str, obj: dict[str, Any]) -> GenerationRequest:
    return parse_generation(path, json.dumps(obj).encode(), max_body_bytes=10**8)


def _never(count: TokenCount) -> bool:
    raise AssertionError("count_now asked admits where asks_admits said it would not")


async def _agrees(counter: PromptCounter, *, bytes_only: bool) -> None:
    # The proxy builds its admits callback only where the counter says it may ask it.
    assert counter.asks_admits is not bytes_only
    for path, obj in BODIES:
        req = _req(path, obj)
        now = counter.count_now(req)
        if not counter.asks_admits:
            assert counter.count_now(req, admits=_never) == now, (path, obj)
        if bytes_only:
            assert now is not None and now.method == "bytes", (path, obj)
        elif req.prompt_text is not None or req.messages is not None or req.batch_texts:
            assert now is None, (path, obj)  # a tokenizer or the engine counts it
        counted = await counter.count(req)
        if now is not None:
            assert now == counted, (path, obj)
        if bytes_only:  # and independently of count(), which asks count_now first
            assert now == await _bytes_bound(counter, req), (path, obj)


async def _bytes_bound(counter: PromptCounter, req: GenerationRequest) -> TokenCount:
    config = counter.config
    if req.messages is not None:
        return await counter._count_chat(req)
    texts = [req.prompt_text] if req.prompt_text is not None else list(req.batch_texts)
    tokens = sum(
        math.ceil(len(str(t).encode("utf-8", "surrogatepass")) / config.bytes_per_token) for t in texts
    )
    return TokenCount(tokens + req.media_items * config.tokens_per_media_item, False, "bytes")


async def test_no_tokenizer_no_engine_counts_every_prompt_now() -> None:
    counter = PromptCounter(CounterConfig(bytes_per_token=3.0, tokens_per_media_item=100))
    await _agrees(counter, bytes_only=True)
    assert counter.count_now(_req("/generate", {"text": "abcdefg"})) == TokenCount(
        math.ceil(7 / 3), False, "bytes"
    )


async def test_every_change_of_source_reaches_count_now(tokenizer_path: Path) -> None:  # noqa: F811
    engine = FakeEngine(answer=None)  # a 404: no /tokenize on this engine
    counter = PromptCounter(CounterConfig(use_engine_tokenize=True), engine_tokenize=engine)
    assert counter.count_now(_req(*BODIES[0])) is None
    assert (await counter.count(_req(*BODIES[0]))).method == "bytes"  # asked: 404
    assert engine.calls
    await _agrees(counter, bytes_only=True)  # not asked again
    engine.answer = "words"  # the engine restarted with a /tokenize
    counter.reset_engine_tokenize()
    await _agrees(counter, bytes_only=False)
    engine.answer = None
    await counter.count(_req(*BODIES[0]))  # 404 again
    await _agrees(counter, bytes_only=True)
    counter.config = CounterConfig(tokenizer_path=tokenizer_path)
    await _agrees(counter, bytes_only=False)
    counter.config = CounterConfig(bytes_per_token=1.5)
    await _agrees(counter, bytes_only=True)
    assert counter.count_now(_req("/generate", {"text": "abc"})) == TokenCount(2, False, "bytes")
    await counter.adopt_engine_model([str(tokenizer_path.parent)])
    await _agrees(counter, bytes_only=False)
    await counter.reconfigure(CounterConfig(tokenizer_from_engine=False))
    await _agrees(counter, bytes_only=True)


@pytest.mark.parametrize("admitted", [True, False])
async def test_admits_is_not_asked_where_the_bound_is_the_count(admitted: bool) -> None:
    asked: list[TokenCount] = []

    def admits(count: TokenCount) -> bool:
        asked.append(count)
        return admitted

    counter = PromptCounter()
    for path, obj in BODIES:
        req = _req(path, obj)
        assert counter.count_now(req, admits=admits) == await counter.count(req)
    assert asked == []
